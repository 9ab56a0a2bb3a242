"""Run the fusion passes on the graphs a CUDA build makes, on a machine without a GPU.

A developer's tool, not a test module: ``python tests/fake_cuda_graphs.py NAMES|all DTYPE T
[--dynamic] [--max-autotune] [--pad] [--no-fold] [-v]`` compiles catalogue entries
(``public_catalogue.py``) with ``backend="k3fusion"`` on fake CUDA tensors: Dynamo, AOT
autograd and Inductor's joint and post-grad passes run as for a GPU (device-dependent
decompositions and rewrites included) up to lowering, which fails without CUDA (ignored).
Prints, per entry, ``OK`` or ``MISS`` with the counts against ``Entry.expected``.

How: a C++ extension (built on first use with the compiler torch's ``cpp_extension``
finds) registers c10's ``FakeGuardImpl`` for CUDA, so functionalization accepts fake
CUDA tensors. ``--pad`` forces ``pad_mm`` (it needs Triton on a GPU otherwise);
``--max-autotune`` turns on coordinate-descent tuning (its skinny-GEMM decompositions);
``--no-fold`` skips the joint graph's constant folding, which runs real ops (entries that
build constants in their forward need it). docs/testing.md tells what it found.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import tempfile
import traceback

import torch

_GUARD = r"""
#include <torch/extension.h>
#include <c10/core/impl/FakeGuardImpl.h>
static c10::impl::FakeGuardImpl<c10::DeviceType::CUDA> fake_impl;
int install() {
  c10::impl::device_guard_impl_registry[static_cast<size_t>(c10::DeviceType::CUDA)]
      .store(&fake_impl);
  return 0;
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("install", &install); }
"""


def install_fake_cuda_guard() -> None:
    from torch.utils.cpp_extension import load_inline
    build = os.path.join(tempfile.gettempdir(), "k3fusion_fake_cuda_guard")
    os.makedirs(build, exist_ok=True)
    load_inline("k3fusion_fake_cuda_guard", cpp_sources=[_GUARD], build_directory=build).install()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("names", help="comma-separated entry names, or 'all'")
    p.add_argument("dtype", choices=["bfloat16", "float16", "float32"])
    p.add_argument("tokens", type=int)
    p.add_argument("--dynamic", action="store_true")
    p.add_argument("--max-autotune", action="store_true")
    p.add_argument("--pad", action="store_true")
    p.add_argument("--no-fold", action="store_true")
    p.add_argument("-v", action="store_true", help="k3fusion's reasons per site")
    args = p.parse_args(argv)

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    install_fake_cuda_guard()
    import k3fusion
    from torch._subclasses.fake_tensor import FakeTensorMode

    from public_catalogue import ENTRIES

    inductor = torch._inductor.config
    if args.pad:
        import torch._inductor.fx_passes.pad_mm as pad_mm
        inductor.force_shape_pad = True
        pad_mm.has_triton = lambda: True
    if args.max_autotune:
        inductor.coordinate_descent_tuning = True
    if args.no_fold:
        import torch._inductor.fx_passes.joint_graph as joint_graph
        joint_graph.constant_fold_uniform_value = lambda gm: None
    if args.v:
        logging.basicConfig()
        logging.getLogger("k3fusion").setLevel(logging.INFO)
        k3fusion.set_config(dataclasses.replace(k3fusion.get_config(), debug=True))
    inductor.fx_graph_cache = False

    dtype = getattr(torch, args.dtype)
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake(t: torch.Tensor) -> torch.Tensor:
        with mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")

    by_name = {e.name: e for e in ENTRIES}
    names = list(by_name) if args.names == "all" else args.names.split(",")
    missed = 0
    for name in names:
        entry = by_name[name]
        torch._dynamo.reset()
        k3fusion.reset_match_counts()
        model = entry.build().eval().to(dtype)
        for m in model.modules():
            for k, prm in list(m._parameters.items()):
                if prm is not None:
                    m._parameters[k] = torch.nn.Parameter(fake(prm), requires_grad=prm.requires_grad)
            for k, buf in list(m._buffers.items()):
                if buf is not None:
                    m._buffers[k] = fake(buf)
        compiled = torch.compile(model, backend="k3fusion", fullgraph=True, dynamic=args.dynamic)
        inputs = [fake(a) for a in entry.inputs(args.tokens, dtype)]
        error = ""
        try:
            with torch.no_grad(), mode:
                compiled(*inputs)
        except Exception as e:  # lowering fails without CUDA: that is expected
            if "not compiled with CUDA" not in str(e):
                error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                if args.v:
                    traceback.print_exc()
        got = dict(k3fusion.match_counts())
        got.pop("attn_res_delta_handoff", None)
        want = entry.expected(dtype, args.dynamic)[0]
        missed += got != want
        print("OK  " if got == want else "MISS", name, "" if got == want else (got, want), error,
              flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
