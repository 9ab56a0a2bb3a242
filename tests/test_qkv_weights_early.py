"""The q/kv pair's weights read before the PDL wait (``dual_rms_norm(weights_early=True)``):
set by the graph pass only where the launch ahead of the kernel cannot be writing them
(``patterns/qkv_rmsnorm.weights_early``), never by the eager path; the kernel's results do
not depend on it. Why it is safe there: docs/design-notes.md, "Weights read before the PDL
wait"; the PTX order: tests/test_qkv_rmsnorm_kernel.py."""

from __future__ import annotations

import pytest
import torch

import k3fusion
import k3fusion.eager
from k3fusion.kernels.qkv_rmsnorm import dual_rms_norm as launch

from _kernel_paths import cpu_path, spy_on_launcher
from graph_utils import (DUAL, assert_close_rounding, compile_capture, fresh_state,  # noqa: F401
                         nodes_of)
from test_qkv_fusion_pass import MLA, _hidden, dual_args

pytestmark = pytest.mark.usefixtures("fresh_state")


def _early_flags(module, *args) -> tuple[list[bool], object]:
    out, be = compile_capture(module, *args)
    return [dual_args(n)["weights_early"] for n in nodes_of(be.graph_after, DUAL)], out


def test_rows_projected_in_the_graph_read_the_weights_early():
    """The MLA front: both rows are projections computed in the graph, the norm weights
    are parameters nothing in the graph writes."""
    flags, _ = _early_flags(MLA(), _hidden())
    assert flags == [True]


class _WritesItsWeight(MLA):
    """A forward that updates the q norm's weight in place after the norms read it (as an
    EMA or weight-tying hook might): the graph writes the weight, so its launches are not
    known to leave it alone. (A weight written before the norm reads it is no parameter
    read any more: the RMSNorm matcher refuses a weight computed in the graph.)"""

    def forward(self, h):
        out = super().forward(h)
        with torch.no_grad():
            self.q_a_layernorm.weight.mul_(1.0)
        return out


def test_weights_the_graph_writes_are_read_after_the_wait():
    flags, _ = _early_flags(_WritesItsWeight(), _hidden())
    assert flags == [False]  # fused, weights late


def test_compiled_call_launches_with_the_flag_and_equals_eager():
    """Through Inductor's codegen: the compiled module's launch gets ``weights_early=True``
    and its outputs equal the eager module's within the rounding the pair's tests allow."""
    module, h = MLA(), _hidden()
    with torch.no_grad():
        want = module(h)
    compiled = torch.compile(module, backend="k3fusion")
    with torch.no_grad(), cpu_path("kernel"), spy_on_launcher("dual_rms_norm",
                                                              "weights_early") as calls:
        got = compiled(h)
    assert calls == [True] and k3fusion.match_counts()["qkv_rmsnorm"] == 1
    for a, b in zip(got, want):
        assert_close_rounding(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_gives_the_same_bits_either_way(dtype):
    g = torch.Generator().manual_seed(0)
    x1 = torch.randn(5, 48, generator=g).to(dtype)
    x2 = torch.randn(5, 80, generator=g).to(dtype)[:, :40]  # strided rows, as kv_c is
    w1 = (1 + 0.2 * torch.randn(48, generator=g)).to(dtype)
    w2 = torch.rand(40, generator=g).to(dtype)
    outs = []
    with cpu_path("kernel"):
        for early in (False, True):
            y1, y2 = torch.empty(5, 48, dtype=dtype), torch.empty(5, 40, dtype=dtype)
            launch(x1, w1, 1e-6, x2, w2, 1e-6, y1, y2, weights_early=early)
            outs.append((y1, y2))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=0.0, atol=0.0)


def test_the_eager_path_never_reads_them_early():
    """``patch_model``'s call cannot know what the launch before it writes."""
    module, h = MLA(), _hidden()
    k3fusion.eager.patch_model(module)
    with torch.no_grad(), cpu_path("kernel"), spy_on_launcher("dual_rms_norm",
                                                              "weights_early") as calls:
        module(h)
    assert calls == [False]


def test_written_buffers_sees_writes_through_views_and_nothing_else():
    """The graph scan behind the flag: a schema-marked write into a view of a buffer marks
    the buffer; reads, and writes into fresh buffers, mark nothing."""
    from torch.fx import Graph

    from k3fusion.patterns._fx import written_buffers

    aten = torch.ops.aten
    g = Graph()
    w, v, x = g.placeholder("w"), g.placeholder("v"), g.placeholder("x")
    y = g.call_function(aten.add.Tensor, (w, x))  # a read
    g.call_function(aten.copy_.default, (g.call_function(aten.view.default, (w, [-1])), x))
    g.call_function(aten.mul_.Tensor, (y, 2.0))  # a write into a fresh buffer
    g.output((y, v))
    assert written_buffers(g) == {w, y}


def test_public_mla_spellings_read_their_weights_early():
    """Every public catalogue entry with a fused q/kv pair (HF / vLLM / framework MLA
    spellings, not this repo's): its rows are projections computed in the graph and its
    norm weights parameters, so every pair gets the flag; the output equals eager's."""
    from public_catalogue import ENTRIES

    # (an AttnRes entry's pair is two key norms of one graph input's views, no projections;
    # an entry that also fuses a tail is held to that op's bound, in test_public_catalogue)
    entries = [e for e in ENTRIES if e.fused.get("qkv_rmsnorm") and not e.fused.get("attn_res")
               and not e.fused.get("moe_tail")]
    assert entries
    for entry in entries:
        model = entry.build().eval().to(torch.bfloat16)
        args = entry.inputs(5, torch.bfloat16)
        with torch.no_grad():
            want = model(*args)
        flags, got = _early_flags(model, *args)
        assert flags and all(flags), (entry.name, flags)
        for a, b in zip(torch.utils._pytree.tree_leaves(got),
                        torch.utils._pytree.tree_leaves(want)):
            assert_close_rounding(a, b)
