"""AttnRes read one source at a time: each source normed and projected on its own, only
the logits stacked, the mix a sum of ``p[i] * v_i`` -- the form of the Megatron-LM
Attention Residuals fork (Smu-Tan/Megatron-LM, as kimmichtank/rms-block-attnres's
``scaling/megatron-attnres.patch`` carries it) and of highbuyer/attnres's "two-pass" read
(public_catalogue.py has both). The site is the op's function over a list bank; it must
fuse, and every mutation that reads the sources differently must not (and stays equal to
eager, its graph untouched).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

import k3fusion
from k3fusion.config import FusionConfig

from graph_utils import (CaptureBackend, LoweringBackend, count_op, fresh_state,  # noqa: F401
                         op_histogram)

ATTN_RES = torch.ops.k3fusion.attn_res.default
H = 16

#: mutation -> whether the read still computes AttnRes over its sources
MUTATIONS = {
    "none": True,               # zeros, then out.add_(p[i].unsqueeze(-1) * v_i)
    "out_of_place": True,       # out = out + p[i].unsqueeze(-1) * v_i
    "no_zeros": True,           # the sum starts at the first term
    "reversed_sum": True,       # the newest source added first
    "fp32_mix": True,           # p kept fp32: the sum in fp32, cast back
    "model_dtype_keys": True,   # the key norm in the sources' dtype
    "other_query": False,       # one source's logit from another query
    "other_norm_weight": False,  # one source's key norm weighted differently
    "other_eps": False,         # one source's key norm with another eps
    "swapped_weights": False,   # p[0] scales v_1 and p[1] scales v_0
    "missing_term": False,      # the oldest source left out of the mix
    "repeated_term": False,     # the newest source mixed twice
    "softmax_other_dim": False,  # softmax over the tokens
    "temperature": False,       # logits / 2
    "leak_logits": False,       # the stacked logits also returned
}


class PerSourceRead(nn.Module):
    def __init__(self, mutation: str) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.mutation = mutation
        self.norm_w = nn.Parameter(1 + 0.2 * torch.randn(H, generator=g))
        self.other_w = nn.Parameter(1 + 0.2 * torch.randn(H, generator=g))
        self.query = nn.Parameter(torch.randn(H, generator=g) / H ** 0.5)
        self.other_q = nn.Parameter(torch.randn(H, generator=g) / H ** 0.5)

    def key(self, v, i):
        m = self.mutation
        x = v if m == "model_dtype_keys" else v.float()
        eps = 1e-5 if m == "other_eps" and i == 0 else 1e-6
        w = self.other_w if m == "other_norm_weight" and i == 0 else self.norm_w
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(v.dtype) * w.to(v.dtype)

    def forward(self, *sources):
        m = self.mutation
        logits = []
        for i, v in enumerate(sources):
            q = self.other_q if m == "other_query" and i == 0 else self.query
            logits.append(torch.einsum("c,btc->bt", q.to(v.dtype), self.key(v, i)))
        stacked = torch.stack(logits, 0).float()
        if m == "temperature":
            stacked = stacked / 2
        p = stacked.softmax(1 if m == "softmax_other_dim" else 0)
        if m != "fp32_mix":
            p = p.to(sources[0].dtype)
        order = list(range(len(sources)))
        if m == "reversed_sum":
            order.reverse()
        if m == "missing_term":
            order = order[1:]
        if m == "repeated_term":
            order.append(order[-1])
        pick = {0: 1, 1: 0} if m == "swapped_weights" else {}
        out = None if m == "no_zeros" else torch.zeros_like(sources[0], dtype=p.dtype)
        for i in order:
            term = p[i].unsqueeze(-1) * sources[pick.get(i, i)]
            if out is None:
                out = term
            elif m == "out_of_place":
                out = out + term
            else:
                out.add_(term)
        out = out.to(sources[0].dtype)
        return (out, stacked) if m == "leak_logits" else out


def check(mutation, n, tokens, dtype, dynamic=False, lowering=False):
    torch._dynamo.reset()
    k3fusion.reset_match_counts()
    # (the q/kv fusion would pair two key norms of graph inputs left unfused: its own
    # business, tested elsewhere; off here, an unfused read's graph stays as it was)
    k3fusion.set_config(FusionConfig(qkv_rmsnorm=False))
    model = PerSourceRead(mutation).to(dtype)
    g = torch.Generator().manual_seed(n * 100 + tokens)
    sources = [torch.randn(2, tokens, H, generator=g).to(dtype) for _ in range(n)]
    with torch.no_grad():
        expected = model(*sources)
        be = (LoweringBackend if lowering else CaptureBackend)()
        out = torch.compile(model, backend=be, dynamic=dynamic, fullgraph=True)(*sources)
    outs = out if isinstance(out, tuple) else (out,)
    exps = expected if isinstance(expected, tuple) else (expected,)
    bound = dict(atol=3e-2, rtol=3e-2) if dtype != torch.float32 else dict(atol=1e-5, rtol=1e-5)
    for a, b in zip(outs, exps):
        torch.testing.assert_close(a.float(), b.float(), **bound)
    fused = count_op(be.graph_after, ATTN_RES)
    if MUTATIONS[mutation]:
        assert fused == 1, f"miss: {mutation}"
        (call,) = [nd for nd in be.graph_after.nodes if nd.target is ATTN_RES]
        assert call.args[2] == n - 1, "num_blocks"
    else:
        assert fused == 0, f"misfire: {mutation}"
        assert op_histogram(be.graph_after) == op_histogram(be.graph_before)


@pytest.mark.usefixtures("fresh_state")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_per_source_read(mutation, dtype):
    # (swapped and missing terms need two sources to differ; three is the smallest read
    # where a wrong order could still look like a stack)
    check(mutation, 3, 3, dtype)


@pytest.mark.usefixtures("fresh_state")
@settings(max_examples=8, deadline=None)
@given(mutation=st.sampled_from(sorted(MUTATIONS)), n=st.integers(2, 5),
       tokens=st.integers(1, 4), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       dynamic=st.booleans())
def test_per_source_read_drawn(mutation, n, tokens, dtype, dynamic):
    check(mutation, n, tokens, dtype, dynamic=dynamic)


@pytest.mark.usefixtures("fresh_state")
@pytest.mark.parametrize("tokens", [0, 1, 5])
def test_per_source_read_lowers(tokens):
    """Through Inductor's lowering and codegen (the list bank stacked for the op)."""
    if tokens == 0:  # (Inductor may fold a zero-size chain away before the pass)
        torch._dynamo.reset()
        model = PerSourceRead("none").to(torch.bfloat16)
        sources = [torch.randn(2, 0, H).bfloat16() for _ in range(3)]
        be = LoweringBackend()
        with torch.no_grad():
            out = torch.compile(model, backend=be, fullgraph=True)(*sources)
        assert out.shape == (2, 0, H) and be.lowered == 1
        return
    check("none", 3, tokens, torch.bfloat16, lowering=True)
