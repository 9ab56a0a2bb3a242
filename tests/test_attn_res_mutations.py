"""Mutation test for the AttnRes fusion (issue 15, item 3): build one site in one of its
accepted spellings, apply a random mutation from a catalogue of structural facts the
matcher relies on, compile, and check: the compile never raises; the output equals eager
within the dtype's bound; the site is fused exactly when the mutation keeps the op's
semantics (``MUTATIONS[name]`` is that expectation).

Graphs come from ``graph_utils.CaptureBackend`` (Inductor's post-grad passes for real, then
the graph run eagerly); the two Inductor-lowering failures of issue 15 are covered with a
real compile in ``test_attn_res_misfires.py``.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings, strategies as st
from torch import nn

import k3fusion

from graph_utils import (CaptureBackend, LoweringBackend, count_op, fresh_state,  # noqa: F401
                         nodes_of, op_histogram)

ATTN_RES = torch.ops.k3fusion.attn_res.default
H = 16

#: mutation -> whether the mutated site still computes AttnRes (so must fuse)
MUTATIONS = {
    "none": True,
    "other_eps": True,              # eps 1e-5: the op takes any eps
    "minus_max": True,              # logits - max(logits): shift-invariant
    "slice_step": False,            # bank[::2] is not the leading slots
    "slice_start": False,           # bank[1:n+1]
    "softmax_other_dim": False,     # softmax over the tokens
    "mix_other_dim": False,         # sum over the tokens
    "keepdim": False,               # the mix keeps the source dim
    "norm_other_dim": False,        # mean over a leading dim
    "eps_outside": False,           # 1 / (sqrt(mean) + eps)
    "div_by_sqrt": True,            # x / sqrt(mean + eps): the from-scratch key norm
    "weight_first_div": True,       # (w * x) / sqrt(mean + eps): the weight multiplied first
    "keys_model_dtype": True,       # the key norm computed in the sources' dtype, no upcast
    "layernorm_keys": False,        # mean-centred keys
    "bias": False,                  # Linear(H, 1) with a bias
    "temperature": False,           # logits / 2
    "unit_scale": True,             # logits * 1.0 (a default scale): Inductor's scaled form
    "unit_divisor": True,           # logits / 1.0 (a default temperature): the same, divided
    "unit_scale_early": True,       # (logits * 1.0).float(): a 16-bit product, cast per branch
    "whole_slice_keys": True,       # keys of V[..., -H:], the whole rows (a tail-keys API)
    "sink": False,                  # a sink logit concatenated before the softmax
    "mask": False,                  # logits + mask
    "gemma": False,                 # (1 + w) key weight
    "leak_logits": False,           # an intermediate also returned
    "leak_keys": False,             # the keys also returned
    "mix_fp32": False,              # the mix left in fp32 (bf16: another output dtype)
    "keys_fp16": False,             # keys rounded to another dtype
    # the matrix-vector spelling's own facts (``K @ q``: rows, row sums viewed back)
    "rows_misread": False,          # the row sums viewed back in another order
    "query_activation": False,      # the query computed from the input, not a parameter
    "logits_fp16": False,           # the row sums rounded to fp16
    "query_scalar": False,          # (K * s).sum(-1), s a one-element parameter
    "float_product": True,          # K.float() @ w.float().squeeze(): the product in fp32
    # the moved stack's own (stack(items).movedim(0, -2))
    "moved_other_dims": False,      # the stack permuted to [T, B, S, H]: tokens and batch swap
    # softmax written out: exp(l - l.max(d, keepdim=True).values) / sum(..., d)
    "max_softmax": True,            # max.dim's values over the source dim: a softmax
    "max_softmax_other_dim": False,  # the max over another dim: a shift that varies by source
    "max_softmax_indices": False,   # the max's indices also returned
    # softmax(l * s) as torch 2.11 decomposes it: exp((l * 1 - amax(l * 1)) * s) / sum(...)
    "unit_scale_written": True,     # s = 1.0: exactly softmax(l)
    "scale_written": False,         # s = 0.5: a temperature
    # the sources stacked as a list for the keys and stacked again for the mix
    "restacked": True,              # the same items in the same order: the same sources
    "restacked_reordered": False,   # the mix's stack in the reverse order
    "restacked_other_source": False,  # the oldest item replaced by a slot the keys do not read
    "restacked_repeated": False,    # the newest item in place of the oldest (one missing)
    "restacked_missing": False,     # the newest item alone, broadcast over the weights
}
#: mutations that only the matrix-vector spelling can make
MATVEC_ONLY = {"rows_misread", "query_activation", "logits_fp16", "query_scalar",
               "float_product"}
#: ... and only the moved-stack spelling
MOVED_ONLY = {"moved_other_dims"}
#: mutations that a stack of explicit items still computes as AttnRes over those items
STACK_KEEPS = {"slice_step", "slice_start"}
#: a softmax written with max(...).values and a second stack of the sources, each with
#: its near misses: tested in every spelling and dtype below, beside the draws
SOFTMAX_MAX = ["max_softmax", "max_softmax_other_dim", "max_softmax_indices"]
#: softmax(l * s) written as torch 2.11 decomposes it (its where-guard dropped), with and
#: without a temperature: likewise
SCALE_WRITTEN = ["unit_scale_written", "scale_written"]
RESTACKED = ["restacked", "restacked_reordered", "restacked_other_source", "restacked_repeated",
             "restacked_missing"]


#: ATTN_RES_MUTATIONS=a,b narrows the draw (a developer's knob, e.g. to replay a class of
#: bugs against older code); CI draws from the whole catalogue.
DRAWN = sorted(os.environ.get("ATTN_RES_MUTATIONS", "").split(",")) if os.environ.get(
    "ATTN_RES_MUTATIONS") else sorted(MUTATIONS)


class Site(nn.Module):
    def __init__(self, spelling: str, mutation: str, n: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.spelling, self.mutation, self.n = spelling, mutation, n
        self.w = nn.Parameter(1 + 0.1 * torch.randn(H, generator=g))
        self.proj = nn.Linear(H, 1, bias=mutation == "bias")
        self.scale = nn.Parameter(torch.tensor([0.7]))  # a one-element "query" (query_scalar)
        with torch.no_grad():
            self.proj.weight.copy_(2 * torch.randn(1, H, generator=g) / H ** 0.5)
            if self.proj.bias is not None:
                self.proj.bias.fill_(0.3)

    def keys(self, V):
        m = self.mutation
        x = V[..., -H:].float() if m == "whole_slice_keys" else (
            V if m == "keys_model_dtype" else V.float())
        eps = 1e-5 if m == "other_eps" else 1e-6
        if m == "layernorm_keys":
            x = x - x.mean(-1, keepdim=True)
        if m == "norm_other_dim":
            normed = x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + eps)
        elif m == "eps_outside":
            normed = x / (x.pow(2).mean(-1, keepdim=True).sqrt() + eps)
        elif m == "div_by_sqrt":
            normed = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        elif m == "weight_first_div":
            return ((self.w.to(x.dtype) * x) / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
                    ).to(V.dtype)
        else:
            normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        w = (1 + self.w) if m == "gemma" else self.w
        to = torch.float16 if m == "keys_fp16" else V.dtype
        return w.to(to) * normed.to(to)

    def restacked(self, bank, blocks, prefix):
        """The sources as a list stacked for the keys, and that list stacked again for the
        mix (two stack nodes; mutated: another order, another tensor, a source twice, one
        source alone)."""
        m, moved = self.mutation, self.spelling == "moved"
        item_dim = -2 if self.spelling == "sources_last" else 0
        items = list(blocks.unbind(item_dim)) + [prefix]
        mixed = {"restacked": items, "restacked_reordered": items[::-1],
                 # (the bank's last slot: never one of the blocks)
                 "restacked_other_source": [bank.select(item_dim, -1)] + items[1:],
                 "restacked_repeated": [prefix] + items[1:], "restacked_missing": [prefix]}[m]

        def stack(xs):
            stacked = torch.stack(xs, item_dim)
            return stacked.movedim(0, -2) if moved else stacked
        return stack(items), stack(mixed)

    def max_softmax(self, logits, ld, other):
        """The softmax written out with ``max(...).values`` -> (p, the max's indices);
        mutated: the max over ``other``, not the softmax's dim ``ld``."""
        top = logits.max(dim=other if self.mutation == "max_softmax_other_dim" else ld,
                         keepdim=True)
        e = (logits - top.values).exp()
        return e / e.sum(dim=ld, keepdim=True), top.indices

    def forward(self, bank, prefix):
        m, n = self.mutation, self.n
        first = self.spelling in ("sources_first", "matvec")
        moved = self.spelling == "moved"  # a sources-first bank's slots, stacked and moved
        sd = 0 if first else -2  # source dim of V
        if first or moved:  # bank [slots, B, T, H]
            if m == "slice_step":
                blocks = bank[0:2 * n:2]
            elif m == "slice_start":
                blocks = bank[1:n + 1]
            else:
                blocks = bank[:n]
            if moved:
                stacked = torch.stack(list(blocks.unbind(0)) + [prefix])
                V = stacked.permute(2, 1, 0, 3) if m == "moved_other_dims" else \
                    stacked.movedim(0, -2)
            else:
                V = torch.cat([blocks, prefix.unsqueeze(0)], 0)
        else:  # bank [B, T, slots, H]
            if m == "slice_step":
                blocks = bank[..., 0:2 * n:2, :]
            elif m == "slice_start":
                blocks = bank[..., 1:n + 1, :]
            else:
                blocks = bank[..., :n, :]
            V = torch.cat([blocks, prefix.unsqueeze(-2)], -2)
        V_mix = V  # what the mix reads: the keys' sources, or their second stack
        if m in RESTACKED:
            V, V_mix = self.restacked(bank, blocks, prefix)
        K = self.keys(V)
        if self.spelling == "matvec":
            q = V.mean((0, 1, 2)) if m == "query_activation" else self.proj.weight.squeeze()
            q = q.to(K.dtype)
            if m == "rows_misread":
                sources, batch, tokens = K.shape[:3]
                logits = (K.reshape(-1, H) @ q).reshape(batch, sources, tokens).transpose(0, 1)
            elif m == "float_product":
                logits = K.float() @ self.proj.weight.float().squeeze()
            elif m == "query_scalar":
                logits = (K * self.scale.to(K.dtype)).sum(-1)
            elif m == "logits_fp16":
                logits = (K.reshape(-1, H).float() @ q.float()).half().reshape(K.shape[:-1])
            else:
                logits = K @ q
            if self.proj.bias is not None:
                logits = logits + self.proj.bias.to(K.dtype)
        elif first:
            logits = torch.einsum("d, n b t d -> n b t", self.proj.weight.squeeze().to(K.dtype), K)
            if self.proj.bias is not None:
                logits = logits + self.proj.bias.to(K.dtype)
        else:
            logits = self.proj(K.to(V.dtype)).squeeze(-1)
        if m == "unit_scale_early":
            logits = logits * 1.0
        logits = logits.float()
        ld = 0 if first else -1  # source dim of the logits
        if m == "temperature":
            logits = logits / 2
        if m == "unit_scale":
            logits = logits * 1.0
        if m == "unit_divisor":
            logits = logits / 1.0
        if m == "mask":
            logits = logits + torch.linspace(-1, 0, logits.shape[-1])
        if m == "minus_max":
            logits = logits - logits.max(dim=ld, keepdim=True).values
        other = 1 if first else -2  # a dim of the logits other than the sources'
        if m == "sink":
            sink = torch.zeros_like(logits.narrow(ld, 0, 1))
            p = torch.cat([logits, sink], ld).softmax(ld).narrow(ld, 0, logits.shape[ld])
        elif m in SOFTMAX_MAX:
            p, indices = self.max_softmax(logits, ld, other)
        elif m in SCALE_WRITTEN:
            signed = logits * 1
            e = ((signed - signed.amax(ld, keepdim=True))
                 * (1.0 if m == "unit_scale_written" else 0.5)).exp()
            p = e / e.sum(ld, keepdim=True)
        else:
            p = logits.softmax(other if m == "softmax_other_dim" else ld)
        p = p.to(V.dtype)
        mix_dim = (1 if first else -3) if m == "mix_other_dim" else sd
        if first and self.spelling != "matvec":
            if m in ("mix_other_dim", "keepdim"):
                out = (p.unsqueeze(-1) * V).sum(mix_dim, keepdim=m == "keepdim")
            else:
                out = torch.einsum("n b t, n b t d -> b t d", p, V_mix)
        else:
            out = (p.unsqueeze(-1) * V_mix).sum(mix_dim, keepdim=m == "keepdim")
        if m == "mix_fp32":
            out = (p.float().unsqueeze(-1) * V.float()).sum(sd)
        if m == "max_softmax_indices":
            return out, indices
        if m == "leak_logits":
            return out, logits
        if m == "leak_keys":
            return out, K
        return out


def _bound(dtype):
    return dict(atol=3e-2, rtol=3e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)


@pytest.mark.usefixtures("fresh_state")
@pytest.mark.parametrize("spelling", ["sources_last", "sources_first", "matvec", "moved"])
@settings(max_examples=10, deadline=None)
@given(mutation=st.sampled_from(DRAWN),
       n=st.integers(1, 3), tokens=st.integers(1, 4),
       dtype=st.sampled_from([torch.float32, torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2 ** 16), grad=st.booleans())
def test_mutated_site(spelling, mutation, n, tokens, dtype, seed, grad):
    """``grad``: compiled with autograd recording (the module's parameters require grad):
    the forward of a training pair, where the same sites fuse."""
    assume(spelling == "matvec" or mutation not in MATVEC_ONLY)
    assume(spelling == "moved" or mutation not in MOVED_ONLY)
    check_site(spelling, mutation, n, tokens, dtype, seed, grad)


@pytest.mark.usefixtures("fresh_state")
@pytest.mark.parametrize("spelling", ["sources_last", "sources_first", "matvec", "moved"])
@pytest.mark.parametrize("dtype,mutation", [
    (dtype, m) for m in ["div_by_sqrt", "eps_outside", "unit_scale", "temperature",
                         "whole_slice_keys", "unit_divisor", "weight_first_div"]
    for dtype in (torch.float32, torch.bfloat16)] + [
    # (in fp32 these two are "unit_scale" and "none": 16-bit forms only)
    (torch.bfloat16, "unit_scale_early"), (torch.bfloat16, "keys_model_dtype")])
def test_keys_and_logits_in_other_spellings(spelling, dtype, mutation):
    """Keys as ``x / sqrt(mean(x ** 2) + eps)`` fuse in every spelling and dtype, so do
    ``(w * x) / sqrt(...)`` and a key norm computed in the model dtype; with eps outside
    the sqrt they do not. Logits times 1.0 (Inductor rewrites ``softmax(l * s)``)
    fuse, and so do logits divided by 1.0 and 16-bit logits times 1.0 before their fp32
    cast; halved they do not. Keys of ``V[..., -H:]`` (all of each row) fuse. (The draws
    above may not reach every case.)"""
    check_site(spelling, mutation, 2, 3, dtype, seed=5, grad=False)


SPELLINGS = ["sources_last", "sources_first", "matvec", "moved"]
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
_CAT, _MAX, _AMAX, _EXP = (torch.ops.aten.cat.default, torch.ops.aten.max.dim,
                           torch.ops.aten.amax.default, torch.ops.aten.exp.default)


@pytest.mark.usefixtures("fresh_state")
@pytest.mark.parametrize("spelling", SPELLINGS)
@DTYPES
@pytest.mark.parametrize("mutation", SOFTMAX_MAX)
def test_softmax_written_with_max(spelling, dtype, mutation):
    """``e = (l - l.max(d, keepdim=True).values).exp(); e / e.sum(d, keepdim=True)`` fuses
    as ``softmax(l, d)`` does: one site, its max and exp gone. The max over another dim,
    or with its indices also returned, stays as it was and equal to eager (check_site)."""
    be = check_site(spelling, mutation, 2, 3, dtype, seed=3, grad=False)
    assert k3fusion.match_counts()["attn_res"] == int(MUTATIONS[mutation])
    assert (count_op(be.graph_before, _MAX), count_op(be.graph_before, _AMAX)) == (1, 0)
    if MUTATIONS[mutation]:
        assert [count_op(be.graph_after, op) for op in (_MAX, _AMAX, _EXP)] == [0, 0, 0]


@pytest.mark.usefixtures("fresh_state")
@pytest.mark.parametrize("tokens", [0, 1, 5])
def test_softmax_written_with_max_lowers(tokens):
    check_lowering("max_softmax", tokens)


@pytest.mark.usefixtures("fresh_state")
@pytest.mark.parametrize("spelling", SPELLINGS)
@DTYPES
@pytest.mark.parametrize("mutation", SCALE_WRITTEN)
def test_softmax_scaled_as_torch_2_11_writes_it(spelling, dtype, mutation):
    """torch 2.11 rewrites ``softmax(l * s)`` for a constant ``s > 0`` as ``e = exp((l * 1 -
    amax(l * 1)) * s); e / sum(e)`` (later versions guard it with a where). With ``s = 1``
    that is ``softmax(l)``: one site, its amax and exp gone; with ``s = 0.5`` a temperature,
    left as it was and equal to eager."""
    be = check_site(spelling, mutation, 2, 3, dtype, seed=3, grad=False)
    assert k3fusion.match_counts()["attn_res"] == int(MUTATIONS[mutation])
    assert count_op(be.graph_before, _AMAX) >= 1  # (torch 2.13+ guards its rewrite: two)
    if MUTATIONS[mutation]:
        assert [count_op(be.graph_after, op) for op in (_AMAX, _EXP)] == [0, 0]


@pytest.mark.usefixtures("fresh_state")
@pytest.mark.parametrize("tokens", [0, 1, 5])
def test_softmax_scaled_as_torch_2_11_writes_it_lowers(tokens):
    check_lowering("unit_scale_written", tokens)


@pytest.mark.usefixtures("fresh_state")
@pytest.mark.parametrize("spelling", SPELLINGS)
@DTYPES
@pytest.mark.parametrize("mutation", RESTACKED)
def test_sources_stacked_again_for_the_mix(spelling, dtype, mutation):
    """``torch.stack(items)`` for the keys and a second ``torch.stack(items)`` for the mix
    fuse as one stack does: one site, its softmax gone, and neither stack left (only the
    op's own stack of the blocks). The second stack in another order, with another tensor,
    with a source twice, or of one source alone stays as it was and equal to eager."""
    n = 2
    be = check_site(spelling, mutation, n, 3, dtype, seed=3, grad=False)
    assert k3fusion.match_counts()["attn_res"] == int(MUTATIONS[mutation])
    if MUTATIONS[mutation]:
        assert sorted(len(c.args[0]) for c in nodes_of(be.graph_before, _CAT)) == [n + 1] * 2
        (call,) = nodes_of(be.graph_after, ATTN_RES)
        assert nodes_of(be.graph_after, _CAT) == [call.args[1]]  # the op's stack of the blocks
        assert len(call.args[1].args[0]) == n and count_op(be.graph_after, _EXP) == 0


@pytest.mark.usefixtures("fresh_state")
@pytest.mark.parametrize("tokens", [0, 1, 5])
def test_sources_stacked_again_lower(tokens):
    check_lowering("restacked", tokens)


def check_lowering(mutation, tokens):
    """``mutation``'s site through Inductor's lowering and codegen, sources-first (the
    einsum mix) in bf16, as served."""
    # (at T 0 Inductor may fold the zero-size chain away before the pass: output only)
    be = check_site("sources_first", mutation, 2, tokens, torch.bfloat16, seed=3, grad=False,
                    lowering=True, check_fusion=tokens > 0)
    assert be.lowered == 1


def check_site(spelling, mutation, n, tokens, dtype, seed, grad, lowering=False,
               check_fusion=True):
    """-> the backend. ``lowering``: compiled through Inductor's lowering and codegen too;
    ``check_fusion=False``: the output only (a zero-size site, which Inductor may fold
    away before the pass runs)."""
    torch._dynamo.reset()
    k3fusion.reset_match_counts()
    m = Site(spelling, mutation, n).to(dtype)
    g = torch.Generator().manual_seed(seed)
    slots = 2 * n + 1
    bank_shape = (2, tokens, slots, H) if spelling == "sources_last" else (slots, 2, tokens, H)
    bank = torch.randn(bank_shape, generator=g).to(dtype)
    prefix = torch.randn(2, tokens, H, generator=g).to(dtype)
    with torch.no_grad():
        expected = m(bank, prefix)
    with contextlib.nullcontext() if grad else torch.no_grad():
        be = LoweringBackend() if lowering else CaptureBackend()
        out = torch.compile(m, backend=be, dynamic=False, fullgraph=True)(bank, prefix)
    outs = out if isinstance(out, tuple) else (out,)
    exps = expected if isinstance(expected, tuple) else (expected,)
    # (separate asserts: hypothesis reports a misfire and a miss as two bugs)
    assert [tuple(a.shape) for a in outs] == [tuple(b.shape) for b in exps], "output shape"
    for a, b in zip(outs, exps):
        torch.testing.assert_close(a.detach().float(), b.float(), **_bound(dtype))
    if not check_fusion:
        return be
    fused = count_op(be.graph_after, ATTN_RES)
    keeps = (MUTATIONS[mutation] or (mutation == "mix_fp32" and dtype == torch.float32)
             or (spelling == "moved" and mutation in STACK_KEEPS))
    if keeps:  # (an fp32 mix of an fp32 model is no mutation)
        assert fused == 1, f"miss: {mutation} keeps the op's semantics but was not fused"
    else:
        assert fused == 0, f"misfire: {mutation} changes the semantics but was fused"
    if not fused:  # left as it was: what Inductor compiles is default Inductor's graph
        assert op_histogram(be.graph_after) == op_histogram(be.graph_before), mutation
    return be
