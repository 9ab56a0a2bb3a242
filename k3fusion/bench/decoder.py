"""End-to-end benchmark: a stack of Kimi-K3-width decoder layers (needs CUDA).

``python -m k3fusion.bench.decoder [--out DIR] [--layers N] [--tokens T ...] [--prefill T ...]
[--seeds N] [--static] [--quick] [--rank-of N [--fake-tp]] [--profile]``

Times :class:`k3fusion.models.KimiK3Model` (the K3 preset cut to one GPU, bf16) at decode
steps and prefill chunks under CUDA-graph replay: eager, default ``torch.compile`` and
``torch.compile(backend="k3fusion")``, with each shape's compile time and match counts.
Each shape is first checked against an fp64 run (the suite's model-level bf16 rule); a miss
stops the sweep and exits 1. ``--rank-of N``: the step of one rank of N-way tensor
parallel (``--fake-tp``: with the tail's tier at tp = N, collectives moving nothing);
``--profile``: a kernel-time profile and the Amdahl bound it implies. Writes
``decoder.json``, ``decoder.md`` and ``decoder.png`` to ``--out``.

How it measures (the stack's widths, the steps, the compiles, the equivalence rule, each
flag): docs/bench-methods.md, section "``python -m k3fusion.bench.decoder``".
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import inspect
import io
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
import torch.profiler
import triton
from torch._dynamo.utils import counters
from torch._inductor import utils

import k3fusion
from k3fusion.models import KimiK3Config, KimiK3ForCausalLM
from k3fusion.models.kimi_k3 import count_attn_res_sites, count_latent_moe_layers, count_mla_layers

from .common import add_scratch_argument, environment, fake_tp_group, write_results
from .timing import call_loop_us, cuda_graph_us

__all__ = ["stack_config", "block_size_for", "build_model", "stack_inputs", "weight_bytes",
           "expected_sites", "check_equivalence", "equivalence_failures", "run", "markdown",
           "plot", "main"]

DECODE_TOKENS = (1, 8, 32, 64)
PREFILL_TOKENS = (512, 4096)
LAYERS = 4
SEEDS = 3
NUM_EXPERTS = 8          # top_k = NUM_EXPERTS: why in docs/bench-methods.md (decoder)
VOCAB = 2048
QUICK = dict(layers=2, tokens=(1, 32), prefill=(512,), seeds=2)

#: Compiled variants: {column name: torch.compile backend}.
BACKENDS = {"inductor": "inductor", "k3fusion": "k3fusion"}
#: Suffix of a variant compiled with ``mode="reduce-overhead"`` (Inductor's CUDA-graph trees).
REDUCE_OVERHEAD = "_ro"

#: The rule: compiled error (vs fp64) <= ERROR_RATIO x eager bf16's, max (+ 1 ulp of
#: max|out|) and mean.
ERROR_RATIO = 2.0
#: Eager's own max error above this fraction of max|out| means the yardstick is broken.
YARDSTICK = 2.0**-3


# --------------------------------------------------------------------------
# The stack
# --------------------------------------------------------------------------


def block_size_for(layers: int) -> int:
    """AttnRes block size ``layers // 2`` (at least 1): layer 0 and layer ``block_size``
    write blocks, so a boundary falls inside any stack of 2 or more layers."""
    return max(1, layers // 2)


def stack_config(layers: int = LAYERS, width: str = "k3", rank_of: int = 1, **overrides):
    """The benchmarked :class:`KimiK3Config`: ``width="k3"`` (the K3 preset) or ``"tiny"``
    (the CPU preset, same switches), AttnRes and latent MoE on; ``overrides`` win; then
    ``rank_of`` > 1 cuts it to one rank of that many (:func:`rank_view`)."""
    fields = dict(num_layers=layers, attn_res=True, attn_res_block_size=block_size_for(layers),
                  latent_moe=True, dtype=torch.bfloat16)
    if width == "k3":
        fields.update(vocab_size=VOCAB, num_experts=NUM_EXPERTS, top_k=NUM_EXPERTS)
        preset = KimiK3Config.k3
    elif width == "tiny":
        fields.update(num_experts=4, top_k=4)
        preset = KimiK3Config.tiny
    else:
        raise ValueError(f"width must be 'k3' or 'tiny', got {width!r}")
    fields.update(overrides)
    return rank_view(preset(**fields), rank_of)


def rank_view(config, n: int, experts: bool = True):
    """``config`` as one rank of an ``n``-way tensor-parallel deployment computes it:
    ``num_heads / n`` and ``moe_intermediate_size / n`` (routed and shared experts: the
    model's TP shards), everything else (hidden width, MLA a-projections, router, latent
    projections, expert count) as is. ``experts=False`` leaves the expert width whole (a
    model built with a tensor-parallel group shards it itself). ValueError unless ``n``
    divides both."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"rank_of must be an int >= 1, got {n!r}")
    if n == 1:
        return config
    for name in ("num_heads", "moe_intermediate_size"):
        if getattr(config, name) % n:
            raise ValueError(f"rank_of={n} does not divide {name}={getattr(config, name)}")
    if not experts:
        return config.replace(num_heads=config.num_heads // n)
    return config.replace(num_heads=config.num_heads // n,
                          moe_intermediate_size=config.moe_intermediate_size // n)


def build_model(config, seed: int, device: torch.device | str, tp_group=None):
    """``KimiK3ForCausalLM(config, tp_group=tp_group)`` initialized on ``device`` from
    ``seed`` (the global RNG of that device, forked: the caller's RNG state is left as it
    was), in eval mode."""
    device = torch.device(device)
    if device.type == "cuda":
        devices = [torch.cuda.current_device() if device.index is None else device.index]
    else:
        devices = []
    with torch.random.fork_rng(devices=devices), torch.device(device):
        torch.manual_seed(seed)
        return KimiK3ForCausalLM(config, tp_group=tp_group).eval()


def weight_bytes(config) -> int:
    """Bytes of the stack's weights (embedding, layers, final AttnRes and norm), counted
    on the meta device (nothing is allocated)."""
    with torch.device("meta"):
        model = KimiK3ForCausalLM(config)
    return sum(t.numel() * t.element_size()
               for t in [*model.model.parameters(), *model.model.buffers()])


def expected_sites(model) -> dict[str, int]:
    """Sites of each fusion in the stack: a q/kv norm pair per MLA layer, 2 AttnRes sites
    per layer + the final one, a MoE tail per latent-MoE layer."""
    return {"qkv_rmsnorm": count_mla_layers(model), "attn_res": count_attn_res_sites(model),
            "moe_tail": count_latent_moe_layers(model)}


def stack_inputs(step: str, t: int, vocab: int, seed: int, device) -> torch.Tensor:
    """Token ids: a decode step is ``[T, 1]`` (T sequences of one token), a prefill chunk
    ``[1, T]`` (one sequence of T tokens)."""
    shape = {"decode": (t, 1), "prefill": (1, t)}[step]
    gen = torch.Generator().manual_seed(10_000 + seed)
    return torch.randint(0, vocab, shape, generator=gen).to(device)


# --------------------------------------------------------------------------
# Equivalence
# --------------------------------------------------------------------------


def _ulp(value: float, dtype: torch.dtype) -> float:
    """The spacing of ``dtype`` at ``value`` (> 0)."""
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(value)) if value > 0 else 0.0


def _errors(out: torch.Tensor, oracle: torch.Tensor) -> tuple[float, float]:
    d = (out.double() - oracle).abs()
    return float(d.max()), float(d.mean())


def check_equivalence(model, variants: dict[str, Callable], step: str, t: int,
                      seeds: Iterable[int]) -> list[dict]:
    """One record per seed: ``model``'s weights are redrawn from the seed (in place, so
    compiled variants keep their graphs), a seeded input is drawn, and eager
    ``model.model``, every variant (a callable of the ids) and an fp64 copy of the same
    weights run. Errors are against the fp64 output; ``ok`` applies the rule of the module
    docstring to the ``k3fusion`` variants (every variant when there is none). Outputs are
    cloned at once (a CUDA-graph tree reuses its output memory at the next call)."""
    config = model.config
    device = next(model.parameters()).device
    records = []
    for seed in seeds:
        fresh = build_model(config, seed, device)
        model.load_state_dict(fresh.state_dict())
        ids = stack_inputs(step, t, config.vocab_size, seed, device)
        with torch.no_grad():
            eager = model.model(ids)
            outs = {name: fn(ids).clone() for name, fn in variants.items()}
            oracle = fresh.model.double()(ids)
        del fresh
        scale = float(oracle.abs().max())
        e_max, e_mean = _errors(eager, oracle)
        max_bound = ERROR_RATIO * e_max + _ulp(scale, eager.dtype)
        rec = {"step": step, "T": t, "seed": seed, "scale": scale,
               "eager_max_err": e_max, "eager_mean_err": e_mean, "max_err_bound": max_bound,
               "mean_err_bound": ERROR_RATIO * e_mean,
               "yardstick_ok": e_max <= YARDSTICK * scale}
        eager_scale = float(eager.float().abs().max()) or 1.0
        checked = [n for n in variants if n.startswith("k3fusion")] or list(variants)
        ok = rec["yardstick_ok"]
        for name, out in outs.items():
            m, a = _errors(out, oracle)
            within = m <= max_bound and a <= ERROR_RATIO * e_mean
            rec.update({f"{name}_max_err": m, f"{name}_mean_err": a,
                        f"{name}_max_ratio": m / e_max if e_max else math.inf,
                        f"{name}_mean_ratio": a / e_mean if e_mean else math.inf,
                        f"{name}_rel_diff_vs_eager":
                            float((out.float() - eager.float()).abs().max()) / eager_scale,
                        f"{name}_within": within})
            if name in checked:
                ok = ok and within
        rec["ok"] = ok
        records.append(rec)
    return records


def equivalence_failures(records: Sequence[dict]) -> list[str]:
    """A line per failed record (empty: all within bound)."""
    lines = []
    for r in records:
        if r["ok"]:
            continue
        if not r["yardstick_ok"]:
            lines.append(f"{r['step']} T={r['T']} seed {r['seed']}: eager's own max error "
                         f"{r['eager_max_err']:.3g} exceeds {YARDSTICK:g} x max|out| "
                         f"({r['scale']:.3g}): the fp64 yardstick is broken")
        for key in r:
            if key.endswith("_within") and not r[key]:
                name = key[: -len("_within")]
                lines.append(
                    f"{r['step']} T={r['T']} seed {r['seed']}: {name} error vs fp64 max "
                    f"{r[f'{name}_max_err']:.3g} (bound {r['max_err_bound']:.3g}; eager "
                    f"{r['eager_max_err']:.3g}, {r[f'{name}_max_ratio']:.2f}x), mean "
                    f"{r[f'{name}_mean_err']:.3g} (bound {r['mean_err_bound']:.3g}; eager "
                    f"{r['eager_mean_err']:.3g}, {r[f'{name}_mean_ratio']:.2f}x)")
    return lines


# --------------------------------------------------------------------------
# Compiles, progress
# --------------------------------------------------------------------------


@contextlib.contextmanager
def _cold(cache_root: str):
    """FX graph and AOT autograd caches off (a hit would skip the k3fusion pass and count
    no match), and a fresh Inductor / Triton cache directory under ``cache_root`` (kept
    until the run ends: compiled code may still load from it)."""
    fresh = getattr(utils, "fresh_cache", None) or getattr(utils, "fresh_inductor_cache", None)
    with contextlib.ExitStack() as stack:
        stack.enter_context(inductor_config.patch(fx_graph_cache=False))
        stack.enter_context(functorch_config.patch(enable_autograd_cache=False))
        if fresh is not None:
            params = inspect.signature(fresh).parameters
            kwargs = {k: v for k, v in (("dir", cache_root), ("delete", False)) if k in params}
            stack.enter_context(fresh(**kwargs))
        yield


def _first_call(fn: Callable, ids: torch.Tensor, cache_root: str) -> tuple[float, bool]:
    """Wall seconds of ``fn(ids)`` (synchronized), cold caches; and whether it compiled."""
    before = counters["stats"]["unique_graphs"]
    with _cold(cache_root):
        start = time.perf_counter()
        fn(ids)
        if ids.is_cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    return seconds, counters["stats"]["unique_graphs"] > before


class _Progress:
    """A one-line stderr bar: ``[#####.....] 12/36 1m05s decode T=32: time eager``."""

    def __init__(self, total: int, stream=None, width: int = 28) -> None:
        self.total, self.done, self.width = total, 0, width
        self.stream = sys.stderr if stream is None else stream
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = time.perf_counter()

    def show(self, label: str) -> None:
        filled = round(self.width * self.done / max(self.total, 1))
        elapsed = int(time.perf_counter() - self.start)
        line = (f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} "
                f"{elapsed // 60}m{elapsed % 60:02d}s {label}")
        if self.tty:
            self.stream.write("\r\033[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def advance(self) -> None:
        self.done += 1

    def close(self, label: str = "done") -> None:
        self.show(label)
        if self.tty:
            self.stream.write("\n")
        self.stream.flush()


# --------------------------------------------------------------------------
# Kernel-time profile
# --------------------------------------------------------------------------

#: k3fusion's own Triton kernels (what replaces the fused chains), by launch name.
OWN_KERNELS = re.compile(r"^_(attn_res|attn_res_split|dual_rms_norm|moe_tail|row_inv_rms|"
                         r"rms_norm|one_shot_pair)_kernel")
PROFILE_STEPS = 5


def kernel_profile(fn: Callable, ids: torch.Tensor, steps: int = PROFILE_STEPS) -> dict:
    """Device-kernel time per step of ``fn(ids)`` (torch.profiler, ``steps`` calls without a
    graph, after one warm call): ``kernel_us`` in all, ``own_us`` in k3fusion's kernels
    (:data:`OWN_KERNELS`), ``kernels`` launched per step, and the ten largest by time."""
    fn(ids)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn(ids)
        torch.cuda.synchronize()
    by_name: dict[str, float] = {}
    count = 0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        by_name[e.name] = by_name.get(e.name, 0.0) + e.time_range.elapsed_us() / steps
        count += 1
    total = sum(by_name.values())
    own = sum(v for k, v in by_name.items() if OWN_KERNELS.match(k))
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:10]
    return {"kernel_us": total, "own_us": own, "kernels": count / steps,
            "top": [[k[:120], v] for k, v in top]}


def amdahl(row: dict) -> dict:
    """The chains' kernel time under default compile, and the bound it puts on k3fusion's
    speedup: ``chains = default kernel sum - (k3fusion kernel sum - its own kernels)`` (what
    default compile spends where k3fusion runs its own kernels, assuming the rest is the
    same kernels in both), ``bound = default step / (default step - chains)``: the step
    were the chains free."""
    d, k = row.get("inductor_profile"), row.get("k3fusion_profile")
    if not d or not k or row.get("inductor_us") is None:
        return {}
    chains = d["kernel_us"] - (k["kernel_us"] - k["own_us"])
    free = row["inductor_us"] - chains
    return {"chains_default_us": chains,
            "amdahl_bound": row["inductor_us"] / free if free > 0 else math.inf}


# --------------------------------------------------------------------------
# The sweep
# --------------------------------------------------------------------------


def _environment(device: torch.device) -> dict:
    if device.type == "cuda":
        return environment()
    return {"date": datetime.date.today().isoformat(), "gpu": f"none ({device.type})",
            "torch": torch.__version__, "triton": triton.__version__, "cuda": None}


def _calls_per_graph(step: str) -> int:
    """Steps captured per CUDA graph: a step reads all weights (~1 ms or more), so the
    graph's own launch is noise already at 1; 2 for decode, 1 for prefill."""
    return 2 if step == "decode" else 1


def run(layers: int = LAYERS, tokens: Sequence[int] = DECODE_TOKENS,
        prefill: Sequence[int] = PREFILL_TOKENS, seeds: int = SEEDS, static: bool = False,
        *, rank_of: int = 1, profile: bool = False, config=None,
        device: str | torch.device = "cuda", backends: dict[str, str] | None = None,
        timer: Callable | None = None, profiler: Callable | None = None,
        progress: bool = True, reduce_overhead: bool = False,
        loop_timer: Callable | None = None, fake_tp: bool = False) -> dict:
    """The sweep; returns the result (``result["ok"]`` False, and ``result["failure"]``,
    when an equivalence check failed: the sweep stops there).

    ``rank_of``: the step as one rank of that many (:func:`rank_view`; applied to
    ``config`` too when one is given). ``config`` (default :func:`stack_config` of ``layers``), ``device``, ``backends`` and
    ``timer`` (``(fn, arg_sets, calls_per_graph) -> us``, default CUDA-graph replay) are
    there so the sweep can be exercised at tiny width on a CPU. ``profile``: also a
    kernel-time profile of each compiled variant per decode shape (``profiler(fn, ids) ->
    dict``, default :func:`kernel_profile`) and its Amdahl bound (:func:`amdahl`).
    ``reduce_overhead``: each backend also compiled with ``mode="reduce-overhead"`` (name +
    :data:`REDUCE_OVERHEAD`), timed per call from Python (``loop_timer``, default
    :func:`call_loop_us`: its own CUDA graphs cannot be captured in another).
    ``fake_tp``: with ``rank_of`` > 1, the latent MoE built with a fake group of that many
    ranks (:func:`fake_tp_group`), so k3fusion's tail runs the tier it picks at that tp
    (the column-parallel one: ``H / rank_of`` columns per rank) while default compile runs
    the model's code (the whole up-projection). The collectives move nothing, so outputs
    are not those of a deployment: the equivalence check is skipped (the same run without
    ``fake_tp`` makes it).
    """
    device = torch.device(device)
    if fake_tp and rank_of < 2:
        raise ValueError(f"fake_tp needs rank_of >= 2, got rank_of={rank_of}")
    config = stack_config(layers) if config is None else config
    config = rank_view(config, rank_of, experts=not fake_tp)
    backends = dict(BACKENDS if backends is None else backends)
    modes = {name: None for name in backends}
    if reduce_overhead:
        modes.update({name + REDUCE_OVERHEAD: "reduce-overhead" for name in backends})
        backends.update({name + REDUCE_OVERHEAD: backends[name] for name in list(backends)})
    if timer is None:
        def timer(fn, arg_sets, calls_per_graph):
            return cuda_graph_us(fn, arg_sets, calls_per_graph=calls_per_graph)
    if loop_timer is None:
        def loop_timer(fn, arg_sets, calls_per_graph):
            return call_loop_us(fn, arg_sets, calls=10 * calls_per_graph)

    shapes = [("decode", t) for t in tokens] + [("prefill", t) for t in prefill]
    seed_list = list(range(seeds))
    t0 = time.perf_counter()
    model = build_model(config, 0, device, fake_tp_group(rank_of) if fake_tp else None)
    stack = model.model
    sites = expected_sites(model)
    result = {
        "bench": "decoder", **_environment(device),
        "config": {"layers": config.num_layers, "hidden": config.hidden_size,
                   "heads": config.num_heads, "q_lora_rank": config.q_lora_rank,
                   "kv_lora_rank": config.kv_lora_rank, "rope_dim": config.qk_rope_head_dim,
                   "attn_res_block_size": config.attn_res_block_size,
                   "attn_res_bank": config.attn_res_bank,
                   "latent_size": config.latent_size, "num_experts": config.num_experts,
                   "top_k": config.top_k, "moe_intermediate_size": config.moe_intermediate_size,
                   "num_shared_experts": config.num_shared_experts,
                   "vocab_size": config.vocab_size, "dtype": str(config.dtype),
                   "rank_of": rank_of},
        "rank_note": (None if rank_of == 1 else
                      f"one rank of a {rank_of}-way tensor-parallel deployment: heads and the "
                      "routed and shared experts' intermediate width divided by "
                      f"{rank_of}; MLA a-projections, router and latent down/up projections "
                      "replicated; collectives (attention output all-reduce, MoE tail "
                      "all-reduces) not run and not timed on one GPU"
                      + ("" if not fake_tp else
                         f". The latent MoE is built with a fake group of {rank_of} ranks "
                         "(collectives return at once, moving nothing): default compile runs "
                         "the model's tail (the whole up-projection per rank), k3fusion the "
                         f"tier it picks at tp = {rank_of} (each rank up-projects "
                         f"H / {rank_of} columns). Outputs are not a deployment's, so no "
                         "equivalence check (the run without --fake-tp makes it)")),
        "fake_tp": fake_tp,
        "weights_gb": weight_bytes(config) / 1e9,
        "sites": sites,
        "compile_shapes": "static" if static else "auto",
        "compile_note": (
            "dynamic=False: every shape recompiles; compile seconds are per shape"
            if static else
            "dynamic=None (torch.compile's default): specialized at the first shape, one "
            "recompile with a dynamic token dim per new shape family; compile seconds where a "
            "shape's first call compiled"),
        "bound": (f"k3fusion error vs fp64 <= {ERROR_RATIO:g}x eager bf16's, max (+ 1 ulp "
                  f"of max|out|) and mean; eager's max error <= {YARDSTICK:g} x max|out|"),
        "seeds": seed_list, "rows": [], "equivalence": [], "ok": True,
        "variants": {name: modes[name] or "default" for name in backends},
    }
    bar = _Progress(len(shapes) * (2 * len(backends) + 2),
                    stream=None if progress else io.StringIO())
    compiled: dict[str, Callable] = {}

    def compile_all():
        torch._dynamo.reset()
        compiled.clear()
        compiled.update({name: torch.compile(stack, backend=backend, mode=modes[name],
                                             dynamic=False if static else None)
                         for name, backend in backends.items()})

    with tempfile.TemporaryDirectory(prefix="k3fusion-decoder-") as cache_root, \
            torch.no_grad():
        if not static:
            compile_all()
        for step, t in shapes:
            where = f"{step} T={t}"
            if static:
                compile_all()
            arg_sets = [(stack_inputs(step, t, config.vocab_size, 100 + i, device),)
                        for i in range(2)]
            row = {"step": step, "T": t, "input_shape": list(arg_sets[0][0].shape),
                   "calls_per_graph": _calls_per_graph(step)}
            for name, fn in compiled.items():
                bar.show(f"{where}: compile {name}")
                k3fusion.reset_match_counts()
                seconds, did_compile = _first_call(fn, arg_sets[0][0], cache_root)
                row[f"{name}_compiled"] = did_compile
                row[f"{name}_compile_s"] = seconds if did_compile else None
                if name.startswith("k3fusion"):
                    row[f"{name}_matches"] = k3fusion.match_counts() if did_compile else None
                bar.advance()
            bar.show(f"{where}: equivalence, {len(seed_list)} seeds")
            # A fake group's all-reduces move nothing: no output to check (see the docstring).
            records = [] if fake_tp else check_equivalence(model, compiled, step, t, seed_list)
            result["equivalence"] += records
            bar.advance()
            failures = equivalence_failures(records)
            if failures:
                result["ok"] = False
                result["failure"] = failures
                break
            for name, fn in {"eager": stack, **compiled}.items():
                bar.show(f"{where}: time {name}")
                time_it = loop_timer if modes.get(name) == "reduce-overhead" else timer
                row[f"{name}_us"] = time_it(fn, arg_sets, row["calls_per_graph"])
                bar.advance()
            if profile and step == "decode":
                for name, fn in compiled.items():
                    bar.show(f"{where}: profile {name}")
                    try:
                        row[f"{name}_profile"] = (profiler or kernel_profile)(fn, arg_sets[0][0])
                    except Exception as e:  # noqa: BLE001 - no profiler there: keep the times
                        row["profile_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                row.update(amdahl(row))
            if "inductor_us" in row and "k3fusion_us" in row:
                row["speedup_vs_inductor"] = row["inductor_us"] / row["k3fusion_us"]
            if "k3fusion_us" in row:
                row["speedup_vs_eager"] = row["eager_us"] / row["k3fusion_us"]
            ro_k3, ro_ind = "k3fusion" + REDUCE_OVERHEAD, "inductor" + REDUCE_OVERHEAD
            if f"{ro_k3}_us" in row and f"{ro_ind}_us" in row:
                row["ro_speedup_vs_inductor"] = row[f"{ro_ind}_us"] / row[f"{ro_k3}_us"]
            result["rows"].append(row)
        torch._dynamo.reset()
    bar.close("done" if result["ok"] else "FAILED (equivalence)")
    result["wall_s"] = time.perf_counter() - t0
    return result


# --------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------


def _fmt(v, spec: str = ".1f", none: str = "-") -> str:
    return none if v is None else format(v, spec)


def _matches(row: dict, sites: dict, name: str = "k3fusion") -> str:
    counts = row.get(f"{name}_matches")
    if counts is None:
        return "reused" if row.get(f"{name}_compiled") is False else "-"
    return ", ".join(f"{k} {counts.get(k, 0)}/{n}" for k, n in sites.items())


def markdown(result: dict) -> str:
    c = result["config"]
    lines = [
        f"Kimi-K3-width decoder stack: {c['layers']} layers, hidden {c['hidden']}, MLA "
        f"{c['heads']} heads (q_lora {c['q_lora_rank']}, kv_lora {c['kv_lora_rank']} + rope "
        f"{c['rope_dim']}), AttnRes block size {c['attn_res_block_size']}, latent MoE (latent "
        f"{c['latent_size']}, {c['num_experts']} experts top {c['top_k']} of width "
        f"{c['moe_intermediate_size']}, {c['num_shared_experts']} shared), {c['dtype']}, "
        f"{result['weights_gb']:.2f} GB of weights. {result['gpu']}, {result['date']}, "
        f"torch {result['torch']}, triton {result['triton']}.",
        "",
        *([f"**Per-rank view ({c['rank_of']}-way TP)**: {result['rank_note']}.", ""]
          if c.get("rank_of", 1) > 1 else []),
        "Decode: T sequences of one token (no KV cache); prefill: one sequence of T tokens. "
        "CUDA-graph replay, median us per step. Compile: wall seconds of a shape's first call "
        f"with cold caches ({result['compile_note']}).",
        "",
        "| step | T | eager | default compile | k3fusion | k3fusion vs default "
        "| compile s (default) | compile s (k3fusion) | k3fusion matches |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in result["rows"]:
        cs = [("reused" if r.get(f"{n}_compiled") is False else _fmt(r.get(f"{n}_compile_s")))
              for n in ("inductor", "k3fusion")]
        lines.append(
            f"| {r['step']} | {r['T']} | {_fmt(r.get('eager_us'))} "
            f"| {_fmt(r.get('inductor_us'))} | {_fmt(r.get('k3fusion_us'))} "
            f"| {_fmt(r.get('speedup_vs_inductor'), '.3f')}{'x' * ('speedup_vs_inductor' in r)} "
            f"| {cs[0]} | {cs[1]} | {_matches(r, result['sites'])} |")
    ro_k3, ro_ind = "k3fusion" + REDUCE_OVERHEAD, "inductor" + REDUCE_OVERHEAD
    if any(f"{ro_k3}_us" in r for r in result["rows"]):
        lines += [
            "", "`mode=\"reduce-overhead\"` (Inductor's CUDA-graph trees), as a server that "
            "lets torch.compile own its graphs runs it: median us per call from Python "
            "(guards and input copies included; the table above replays one graph of the "
            "whole step instead).", "",
            "| step | T | default compile, reduce-overhead | k3fusion, reduce-overhead "
            "| k3fusion vs default | k3fusion matches |",
            "|---|---:|---:|---:|---:|---|"]
        for r in result["rows"]:
            sp = r.get("ro_speedup_vs_inductor")
            lines.append(f"| {r['step']} | {r['T']} | {_fmt(r.get(f'{ro_ind}_us'))} "
                         f"| {_fmt(r.get(f'{ro_k3}_us'))} "
                         f"| {_fmt(sp, '.3f')}{'x' * (sp is not None)} "
                         f"| {_matches(r, result['sites'], ro_k3)} |")
    if result.get("fake_tp"):
        lines += ["", "Equivalence: not checked (a fake process group's all-reduces move "
                  "nothing; the same command without --fake-tp checks it)."]
    else:
        lines += [
            "",
            f"Equivalence before timing, {len(result['seeds'])} seeds (weights and input drawn "
            f"per seed): error against an fp64 copy of the same weights; bound: "
            f"{result['bound']}. Each column: the worst seed.",
            "",
            "| step | T | eager max err | k3fusion max err (x eager) | k3fusion mean err "
            "(x eager) | default max err (x eager) | k3fusion max diff vs eager (of max abs eager) "
            "| ok |",
            "|---|---:|---:|---:|---:|---:|---:|---|",
        ]
        by_shape: dict[tuple, list] = {}
        for rec in result["equivalence"]:
            by_shape.setdefault((rec["step"], rec["T"]), []).append(rec)
        for (step, t), recs in by_shape.items():
            def worst(key):
                vals = [r[key] for r in recs if key in r]
                return max(vals) if vals else None

            lines.append(
                f"| {step} | {t} | {_fmt(worst('eager_max_err'), '.3g')} "
                f"| {_fmt(worst('k3fusion_max_err'), '.3g')} ({_fmt(worst('k3fusion_max_ratio'), '.2f')}) "
                f"| {_fmt(worst('k3fusion_mean_err'), '.3g')} ({_fmt(worst('k3fusion_mean_ratio'), '.2f')}) "
                f"| {_fmt(worst('inductor_max_err'), '.3g')} ({_fmt(worst('inductor_max_ratio'), '.2f')}) "
                f"| {_fmt(worst('k3fusion_rel_diff_vs_eager'), '.2e')} "
                f"| {'yes' if all(r['ok'] for r in recs) else '**NO**'} |")
    prof = [r for r in result["rows"] if "amdahl_bound" in r]
    if prof:
        lines += [
            "", f"Kernel time per decode step (torch.profiler, {PROFILE_STEPS} steps without a "
            "graph): all kernels, k3fusion's own; the chains' time under default compile "
            "(default's kernel sum minus what k3fusion runs outside its own kernels) and the "
            "speedup bound were they free (default step / (default step - chains)):", "",
            "| T | default: step | kernel sum | kernels | k3fusion: kernel sum | own kernels "
            "| chains (default) | bound | measured |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in prof:
            d, k = r["inductor_profile"], r["k3fusion_profile"]
            lines.append(
                f"| {r['T']} | {_fmt(r.get('inductor_us'))} | {_fmt(d['kernel_us'])} "
                f"| {d['kernels']:.0f} | {_fmt(k['kernel_us'])} | {_fmt(k['own_us'])} "
                f"| {_fmt(r['chains_default_us'])} | {r['amdahl_bound']:.3f}x "
                f"| {_fmt(r.get('speedup_vs_inductor'), '.3f')}x |")
    if not result["ok"]:
        lines += ["", "**FAILED: out of bound; the sweep stopped here.**", ""]
        lines += [f"- {line}" for line in result.get("failure", [])]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    """Three panels: decode and prefill us per step (log-log), compile seconds."""
    import matplotlib  # optional (the bench extra): only the plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    series = [("eager_us", "eager"), ("inductor_us", "default compile"),
              ("k3fusion_us", "k3fusion")]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, step in zip(axes[:2], ("decode", "prefill")):
        rows = [r for r in result["rows"] if r["step"] == step]
        for key, label in series:
            pts = [(r["T"], r[key]) for r in rows if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label)
        for r in rows:  # k3fusion vs default compile, next to the k3fusion point
            if r.get("speedup_vs_inductor") is not None:
                ax.annotate(f"{r['speedup_vs_inductor']:.2f}x", (r["T"], r["k3fusion_us"]),
                            textcoords="offset points", xytext=(4, -12), fontsize=8)
        ax.set(xscale="log", yscale="log", xlabel="tokens T",
               ylabel="us per step (CUDA-graph replay, median)",
               title=f"{step} ({'[T, 1]' if step == 'decode' else '[1, T]'}); "
                     "label: k3fusion vs default")
        ax.grid(True, which="both", alpha=0.3)
        if rows:
            ts = sorted({r["T"] for r in rows})
            ax.xaxis.set_minor_locator(ticker.NullLocator())
            ax.set_xticks(ts, [str(t) for t in ts])
            ax.legend()
    ax = axes[2]
    labels = [f"{r['step'][0]}{r['T']}" for r in result["rows"]]
    x = range(len(labels))
    for i, (name, label) in enumerate((("inductor", "default compile"),
                                       ("k3fusion", "k3fusion"))):
        ax.bar([j + (i - 0.5) * 0.4 for j in x],
               [r.get(f"{name}_compile_s") or 0.0 for r in result["rows"]], width=0.4,
               label=label)
    ax.set_xticks(list(x), labels)
    ax.set(xlabel="shape (d: decode, p: prefill; 0: reused graph)", ylabel="compile s (cold)",
           title="compile")
    ax.legend()
    c = result["config"]
    fig.suptitle(f"K3-width decoder stack, {c['layers']} layers, bf16, {result['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m k3fusion.bench.decoder",
                                description="time a K3-width decoder stack: eager, default "
                                            "torch.compile, backend='k3fusion' (CUDA)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-out")))
    p.add_argument("--layers", type=int, default=None, help=f"decoder layers ({LAYERS})")
    p.add_argument("--tokens", type=int, nargs="*", default=None,
                   help=f"decode step sizes T (input [T, 1]; {' '.join(map(str, DECODE_TOKENS))})")
    p.add_argument("--prefill", type=int, nargs="*", default=None,
                   help=f"prefill chunk sizes T (input [1, T]; "
                        f"{' '.join(map(str, PREFILL_TOKENS))})")
    p.add_argument("--seeds", type=int, default=None,
                   help=f"seeds of the equivalence check at each shape ({SEEDS})")
    p.add_argument("--static", action="store_true",
                   help="compile with dynamic=False: a compile per shape (slower)")
    p.add_argument("--rank-of", type=int, default=1, metavar="N",
                   help="time the step one rank of an N-way tensor-parallel deployment "
                        "computes (heads and expert widths / N; collectives not timed)")
    p.add_argument("--fake-tp", action="store_true",
                   help="with --rank-of N: build the latent MoE with a fake group of N ranks, so "
                        "k3fusion's tail runs the tier it picks at tp = N (collectives move "
                        "nothing: no equivalence check)")
    p.add_argument("--profile", action="store_true",
                   help="also a kernel-time profile of each compiled variant per decode shape "
                        "and its Amdahl bound")
    p.add_argument("--no-reduce-overhead", dest="reduce_overhead", action="store_false",
                   help="skip the mode='reduce-overhead' compiles (by default each backend is "
                        "also compiled that way and timed per call)")
    p.add_argument("--quick", action="store_true",
                   help="2 layers, decode T 1 32, prefill 512, 2 seeds (explicit options win)")
    add_scratch_argument(p)
    args = p.parse_args(argv)
    defaults = QUICK if args.quick else dict(layers=LAYERS, tokens=DECODE_TOKENS,
                                              prefill=PREFILL_TOKENS, seeds=SEEDS)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, list(value) if isinstance(value, tuple) else value)
    if args.layers < 1 or args.seeds < 1:
        p.error("--layers and --seeds must be >= 1")
    try:
        rank_view(stack_config(1), args.rank_of)
    except ValueError as e:
        p.error(f"--rank-of: {e}")
    if args.fake_tp and args.rank_of < 2:
        p.error("--fake-tp needs --rank-of N with N >= 2")
    if any(t < 1 for t in [*args.tokens, *args.prefill]):
        p.error("token counts must be >= 1")
    if not args.tokens and not args.prefill:
        p.error("nothing to time: give --tokens or --prefill sizes")
    return args


def main(argv=None) -> int:
    args = _parse(argv)
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")

    result = run(args.layers, args.tokens, args.prefill, args.seeds, args.static,
                 rank_of=args.rank_of, profile=args.profile,
                 reduce_overhead=args.reduce_overhead, fake_tp=args.fake_tp)
    write_results(args.out, "decoder", result, markdown(result), plot)
    if not result["ok"]:
        print("\nFAILED: k3fusion-compiled output is out of the bf16 bound against eager:\n  "
              + "\n  ".join(result["failure"]), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
