"""Public implementations of the three chains, rewritten as tests (issue 27).

Each entry re-spells, in this project's own words, the op sequence, layouts and dtypes of
one public implementation nobody here wrote (repository, path and commit in its
``source``), at test sizes, and says what a correct pass does with it: the exact number of
sites per fusion, which norms form each q/kv pair and which norm each tail takes (by
parameter name), and, for near relatives, that nothing fuses. ``tests/test_public_catalogue.py``
runs them; docs/testing.md lists them with what each one exercises.

Sizes: hidden 64; MLA q latent 48, kv latent 32, rope 16 (all different, so a wrong pair
shows); latent MoE 40. Every entry takes ``(tokens, dtype)`` inputs from :meth:`Entry.inputs`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

H = 64
Q_LORA, KV_LORA, ROPE = 48, 32, 16
LATENT = 40
EPS = 1e-6


@dataclass(frozen=True)
class Source:
    repo: str
    path: str
    commit: str


@dataclass
class Entry:
    """One catalogue entry: ``build()`` makes the module (fp32, seeded); ``fused`` the exact
    match count per fusion in one compiled call; ``pairs`` the q/kv pairs (each a frozenset
    of two norm-weight parameter names); ``tails`` the (norm weight, up weight) names of
    each fused tail; ``attn_res_blocks`` the sorted ``num_blocks`` of every fused AttnRes
    site."""

    name: str
    source: Source
    build: type
    what: str
    fused: dict[str, int]
    pairs: list[frozenset] = field(default_factory=list)
    tails: list[tuple[str, str]] = field(default_factory=list)
    attn_res_blocks: list[int] = field(default_factory=list)
    #: the compiled call's inputs: ``"h"`` hidden [B, T, H]; ``"tokens"`` flat [T, H];
    #: ``"seq_first"`` [T, B, H]; ``"moe"`` (latent [T, L], hidden [T, H], prefix [T, H])
    inputs_kind: str = "h"
    #: what differs in bf16 (a site that cannot fuse there), with the reason
    bf16: tuple[dict[str, int], list[int], str] | None = None
    #: what differs compiled with ``dynamic=True`` (matches per fusion), with the reason
    dynamic: tuple[dict[str, int], str] | None = None

    def expected(self, dtype: torch.dtype,
                 dynamic: bool = False) -> tuple[dict[str, int], list[int]]:
        """(matches per fusion, sorted AttnRes num_blocks) in ``dtype``; ``dynamic``: the
        matches of a ``dynamic=True`` compile (its blocks are not listed)."""
        fused, blocks = self.fused, self.attn_res_blocks
        if dtype != torch.float32 and self.bf16 is not None:
            fused, blocks = self.bf16[0], self.bf16[1]
        if dynamic and self.dynamic is not None:
            fused, blocks = self.dynamic[0], []
        return ({f: fused.get(f, 0) for f in ("qkv_rmsnorm", "attn_res", "moe_tail")},
                sorted(blocks))

    def inputs(self, tokens: int, dtype: torch.dtype, seed: int = 1, device="cpu") -> tuple:
        g = torch.Generator(device).manual_seed(seed)

        def rand(*shape):
            return torch.randn(*shape, generator=g, device=device).to(dtype)

        if self.inputs_kind == "tokens":
            return (rand(tokens, H),)
        if self.inputs_kind == "seq_first":
            return (rand(tokens, 2, H),)
        if self.inputs_kind == "moe":
            return (rand(tokens, LATENT), rand(tokens, H), rand(tokens, H))
        return (rand(2, tokens, H),)


def _init(module: nn.Module, seed: int = 0) -> nn.Module:
    """Weights off their defaults (norm weights off 1, projections of unit-ish gain) so a
    wrong weight, eps or pair is visible in the output."""
    gens: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, p in module.named_parameters():
            g = gens.setdefault(p.device, torch.Generator(p.device).manual_seed(seed))

            def randn(*shape):
                return torch.randn(*shape, generator=g, device=p.device)

            if p.dim() == 1:
                p.copy_(1 + 0.3 * randn(p.shape))
            elif p.dim() == 0:
                p.copy_(randn(()))
            else:
                p.copy_(randn(p.shape) / math.sqrt(p.shape[-1]))
                if p.shape[0] == 1:  # a Linear(H, 1) pseudo-query: logits of std ~1
                    p.mul_(3.0)
    return module


def _keep_fp32(module: nn.Module, *names: str) -> nn.Module:
    """Parameters a public model keeps in fp32 whatever its dtype (``.to(dtype)`` goes
    through ``_apply``, which calls this after converting)."""
    for name in names:
        p = module.get_parameter(name)
        p.data = p.data.float()
    return module


# =============================================================== AttnRes: shared sublayers


class _Sublayers(nn.Module):
    """Stand-ins for attention and MLP (only the residual stream matters to the pass)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(H, H, bias=False)
        self.up = nn.Linear(H, 2 * H, bias=False)
        self.down = nn.Linear(2 * H, H, bias=False)

    def attention(self, x):
        return torch.tanh(self.attn(x))

    def mlp(self, x):
        return self.down(F.silu(self.up(x)))


class HFRMSNorm(nn.Module):
    """HF Llama/DeepSeek style: upcast, normalize, cast back, then the weight (model dtype)."""

    def __init__(self, dim: int, eps: float = EPS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class FP32WeightRMSNorm(nn.Module):
    """The weight applied in fp32, then one cast (DeepSeek-V3.2 inference, SGLang's
    ``forward_native``; ``contiguous`` copies a non-contiguous input first, as SGLang does)."""

    def __init__(self, dim: int, eps: float = EPS, contiguous: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.contiguous = eps, contiguous

    def forward(self, x):
        if self.contiguous and not x.is_contiguous():
            x = x.contiguous()
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * self.weight).to(dtype)


# =============================================================== AttnRes entries


class MoonshotReadme(nn.Module):
    """The Attention-Residuals README: a list of blocks, ``torch.stack`` on dim 0, an RMSNorm
    module on the stack, ``einsum`` logits with ``proj.weight.squeeze()``, ``softmax(0)``,
    ``einsum`` mix; two sites per layer and a final one; a block closes every layer."""

    layers = 3

    def __init__(self) -> None:
        super().__init__()
        self.subs = nn.ModuleList(_Sublayers() for _ in range(self.layers))
        self.res_norms = nn.ModuleList(HFRMSNorm(H) for _ in range(2 * self.layers + 1))
        self.res_projs = nn.ModuleList(nn.Linear(H, 1, bias=False)
                                       for _ in range(2 * self.layers + 1))
        _init(self)

    def _res(self, blocks, partial, i):
        V = torch.stack(blocks + [partial])
        K = self.res_norms[i](V)
        logits = torch.einsum("d, n b t d -> n b t", self.res_projs[i].weight.squeeze(), K)
        return torch.einsum("n b t, n b t d -> b t d", logits.softmax(0), V)

    def forward(self, x):
        blocks, partial = [], x
        for i, sub in enumerate(self.subs):
            h = self._res(blocks, partial, 2 * i)
            blocks.append(partial)
            partial = sub.attention(h)
            h = self._res(blocks, partial, 2 * i + 1)
            partial = partial + sub.mlp(h)
        return self._res(blocks, partial, 2 * self.layers)


class K3FoldedQuery(nn.Module):
    """Kimi-K3 as a training framework's layers write it (the Hub's
    ``modeling_kimi_linear._apply_attn_res``, ported to torchtitan): packed ``[T, H]`` tokens,
    a ``[T, N, H]`` bank grown by ``torch.cat`` at block boundaries, an unweighted fp32 inline
    RMS, the norm weight folded into the query
    (``norm.weight.float() * proj.weight.squeeze(0).float()``), ``(k * q).sum(-1)``,
    ``torch.softmax(-1)``, ``matmul(p.unsqueeze(1), v).squeeze(1)``, one cast back. Layer 0
    skips its pre-attention read (empty bank); a final read after the last layer."""

    layers, block = 4, 2

    def __init__(self) -> None:
        super().__init__()
        self.subs = nn.ModuleList(_Sublayers() for _ in range(self.layers))
        n = 2 * self.layers + 1
        self.res_norms = nn.ModuleList(HFRMSNorm(H) for _ in range(n))
        self.res_projs = nn.ModuleList(nn.Linear(H, 1, bias=False) for _ in range(n))
        _init(self)

    def _res(self, prefix, bank, i):
        v = torch.cat((bank, prefix.unsqueeze(1)), dim=1)
        vf = v.float()
        k = vf * torch.rsqrt(vf.pow(2).mean(dim=-1, keepdim=True) + self.res_norms[i].variance_epsilon)
        q = self.res_norms[i].weight.float() * self.res_projs[i].weight.squeeze(0).float()
        probs = torch.softmax((k * q).sum(dim=-1), dim=-1).unsqueeze(1)
        return torch.matmul(probs, vf).squeeze(1).to(v.dtype)

    def forward(self, x):
        bank, prefix = x.new_empty(x.shape[0], 0, H), x
        for i, sub in enumerate(self.subs):
            h = self._res(prefix, bank, 2 * i) if bank.shape[1] else prefix
            if i % self.block == 0:
                bank = torch.cat((bank, prefix.unsqueeze(1)), dim=1)
                prefix = None
            out = sub.attention(h)
            prefix = out if prefix is None else prefix + out
            h = self._res(prefix, bank, 2 * i + 1)
            prefix = prefix + sub.mlp(h)
        return self._res(prefix, bank, 2 * self.layers)


class K3SequenceFirst(nn.Module):
    """Kimi-K3 on a Megatron-style stack: sequence-first ``[S, B, H]`` activations, a
    ``[S, B, K, H]`` bank grown on dim 2, ``cat`` over dim -2, ``.square()``, the folded
    query, ``torch.softmax(-1)``, the mix ``(p.unsqueeze(-1) * rows_float).sum(-2)`` cast
    back, and the layer's pre-norm on the mix (an output norm the site can fold)."""

    layers, block = 4, 2

    def __init__(self) -> None:
        super().__init__()
        self.subs = nn.ModuleList(_Sublayers() for _ in range(self.layers))
        n = 2 * self.layers + 1
        self.score_norms = nn.ModuleList(HFRMSNorm(H) for _ in range(n))
        self.score_projs = nn.ModuleList(nn.Linear(H, 1, bias=False) for _ in range(n))
        self.pre_norms = nn.ModuleList(HFRMSNorm(H) for _ in range(n))
        _init(self)

    def _res(self, prefix, bank, i):
        rows = torch.cat((bank, prefix.unsqueeze(-2)), dim=-2)
        rf = rows.float()
        normed = rf * torch.rsqrt(rf.square().mean(dim=-1, keepdim=True) + self.score_norms[i].variance_epsilon)
        w = self.score_norms[i].weight.float() * self.score_projs[i].weight.squeeze(0).float()
        p = torch.softmax((normed * w).sum(dim=-1), dim=-1)
        mixed = (p.unsqueeze(-1) * rf).sum(dim=-2).to(rows.dtype)
        return self.pre_norms[i](mixed)

    def forward(self, x):
        s, b, _ = x.shape
        bank, prefix = x.new_zeros(s, b, 0, H), x
        for i, sub in enumerate(self.subs):
            h = self._res(prefix, bank, 2 * i) if bank.shape[2] else self.pre_norms[2 * i](prefix)
            if i % self.block == 0:
                bank = torch.cat([bank, prefix.unsqueeze(2)], dim=2)
                prefix = None
            out = sub.attention(h)
            prefix = out if prefix is None else prefix + out
            h = self._res(prefix, bank, 2 * i + 1)
            prefix = prefix + sub.mlp(h)
        return self._res(prefix, bank, 2 * self.layers)


class K3FlattenedProjection(nn.Module):
    """Kimi-K3 in a serving framework's torch reference path: a preallocated ``[T, NB, H]``
    bank written with ``copy_``, rows ``cat([bank[:, :n], prefix.unsqueeze(1)], 1)``, the key
    norm on ``rows.reshape(T * R, H)``, a ``Linear(H, 1)`` whose output is
    ``.reshape(T, R)`` (no squeeze), ``softmax(scores.float(), -1)``, the mix
    ``(p.unsqueeze(-1) * rows.float()).sum(1)``, and the next layer's norm on
    ``mixed.to(dtype)``; the prefix update ``prefix + delta`` right before the read."""

    layers, block = 4, 2

    def __init__(self) -> None:
        super().__init__()
        self.subs = nn.ModuleList(_Sublayers() for _ in range(self.layers))
        n = 2 * self.layers + 1
        self.score_norms = nn.ModuleList(FP32WeightRMSNorm(H) for _ in range(n))
        self.score_projs = nn.ModuleList(nn.Linear(H, 1, bias=False) for _ in range(n))
        self.out_norms = nn.ModuleList(HFRMSNorm(H) for _ in range(n))
        _init(self)

    def _res(self, prefix, bank, nvb, i):
        t = prefix.shape[0]
        rows = torch.cat([bank[:, :nvb, :], prefix.unsqueeze(1)], dim=1)
        r = nvb + 1
        normed = self.score_norms[i](rows.reshape(t * r, H))
        scores = self.score_projs[i](normed).reshape(t, r)
        probs = torch.softmax(scores.float(), dim=-1)
        mixed = (probs.unsqueeze(-1) * rows.float()).sum(dim=1)
        return self.out_norms[i](mixed.to(prefix.dtype))

    def forward(self, x):
        bank = x.new_zeros(x.shape[0], self.layers // self.block + 1, H)
        nvb, prefix = 0, x
        for i, sub in enumerate(self.subs):
            h = self._res(prefix, bank, nvb, 2 * i) if nvb else self.out_norms[2 * i](prefix)
            if i % self.block == 0:
                bank[:, nvb, :].copy_(prefix)
                nvb, prefix = nvb + 1, None
            out = sub.attention(h)
            prefix = out if prefix is None else prefix + out
            h = self._res(prefix, bank, nvb, 2 * i + 1)
            prefix = prefix + sub.mlp(h)
        return self._res(prefix, bank, nvb, 2 * self.layers)


class VllmTestReference(nn.Module):
    """vLLM's torch reference for its K3 ``attn_res`` kernel test: everything in the model
    dtype, a weighted ``F.rms_norm`` on the values, logits ``K @ qk_w`` (a vector),
    ``softmax(-1)``, ``matmul(p.unsqueeze(1), values).squeeze(1)``, ``prefix = prefix +
    delta`` first, an output ``F.rms_norm``; one step of a decoder over a ``[T, NB, H]`` bank."""

    steps = 3

    def __init__(self) -> None:
        super().__init__()
        self.norm_w = nn.Parameter(torch.ones(self.steps, H))
        self.qk_w = nn.Parameter(torch.ones(self.steps, H))
        self.out_w = nn.Parameter(torch.ones(self.steps, H))
        self.delta = nn.Linear(H, H, bias=False)
        _init(self)

    def _res(self, prefix, delta, blocks, n, i):
        if delta is not None:
            prefix = prefix + delta
        values = torch.cat((blocks[:, :n], prefix.unsqueeze(1)), dim=1)
        keys = F.rms_norm(values, (H,), self.norm_w[i], EPS)
        probs = (keys @ self.qk_w[i]).softmax(dim=-1)
        out = torch.matmul(probs.unsqueeze(1), values).squeeze(1)
        return F.rms_norm(out, (H,), self.out_w[i], EPS), prefix

    def forward(self, x):
        blocks = torch.stack([x, torch.tanh(x), x * 0.5], dim=1)  # [T, 3, H]
        prefix, outs = x, []
        for i in range(self.steps):
            out, prefix = self._res(prefix, torch.tanh(self.delta(prefix)), blocks, i + 1, i)
            outs.append(out)
        return torch.stack(outs), prefix


class FlaNaive(nn.Module):
    """flash-linear-attention's ``naive_attnres``: each source ``.view(-1, D)``, stacked on
    dim 0, an fp32 weighted ``F.rms_norm`` (weights ``.float()``), an einsum with the query
    (scale 1), ``softmax(0)``, an einsum mix, an optional fp32 output ``F.rms_norm``, one cast
    at the end. Called as a model's depth mix over its layer outputs."""

    layers = 3

    def __init__(self) -> None:
        super().__init__()
        self.subs = nn.ModuleList(_Sublayers() for _ in range(self.layers))
        self.query = nn.Parameter(torch.ones(self.layers + 1, H))
        self.rms_w = nn.Parameter(torch.ones(self.layers + 1, H))
        self.out_w = nn.Parameter(torch.ones(self.layers + 1, H))
        _init(self)

    def _res(self, residuals, i):
        shape, d = residuals[0].shape, residuals[0].shape[-1]
        stacked = torch.stack(tuple(r.view(-1, d) for r in residuals), dim=0)
        v = stacked.float()
        k = F.rms_norm(v, (d,), self.rms_w[i].float(), EPS)
        p = torch.einsum("l n d, d -> l n", k, self.query[i].float() * 1.0).softmax(dim=0)
        o = torch.einsum("l n, l n d -> n d", p, v).view(shape)
        o = F.rms_norm(o, (d,), self.out_w[i].float(), EPS)
        return o.to(stacked.dtype)

    def forward(self, x):
        states = [x]
        for i, sub in enumerate(self.subs):
            h = self._res(states, i)
            states.append(sub.mlp(h))
        return self._res(states, self.layers)


class FastAttnresReference(nn.Module):
    """fast-attnres's readable reference (``reference_attnres``): values ``[S, ..., D]``
    stacked, the keys the last ``R`` columns of each row (here ``R = D``: the whole rows,
    ``values[..., -D:]``), everything in fp32, ``k * rsqrt(k.square().mean(-1, keepdim=True)
    + 2**-23) * q`` summed over the row, ``softmax(scores * scale, 0)`` with the default
    ``scale=1.0``, the weighted sum over sources, cast back. Called as a model's depth mix
    over its layer outputs (as ``FlaNaive``)."""

    layers = 3

    def __init__(self) -> None:
        super().__init__()
        self.subs = nn.ModuleList(_Sublayers() for _ in range(self.layers))
        self.query = nn.Parameter(torch.ones(self.layers + 1, H))
        _init(self)

    def _res(self, outputs, i, scale=1.0):
        values, query = torch.stack(outputs), self.query[i]
        v = values.to(torch.float32)
        k = values[..., -query.numel():].to(torch.float32)
        q = query.to(torch.float32)
        scores = (k * torch.rsqrt(k.square().mean(-1, keepdim=True) + 2**-23) * q).sum(-1)
        weights = torch.softmax(scores * scale, dim=0)
        return (weights.unsqueeze(-1) * v).sum(0).to(values.dtype)

    def forward(self, x):
        states = [x]
        for i, sub in enumerate(self.subs):
            states.append(sub.mlp(self._res(states, i)))
        return self._res(states, self.layers)


class CatsweNaive(nn.Module):
    """flash-attention-residuals' paper-form reference (``paper_forward`` and
    ``naive_attention_residual``): inputs and pseudo-queries upcast to fp32 once, a
    parameter-free ``F.rms_norm`` key norm, einsum logits minus their max, ``softmax(0)``,
    an einsum mix cast to bf16 at every call (the sublayers here take it in the model
    dtype); a block closes at every other layer (``blocks.append`` / ``blocks[-1] +=
    update``). The read over one source (the first) is no contraction."""

    layers, block_size = 4, 2

    def __init__(self) -> None:
        super().__init__()
        self.subs = nn.ModuleList(_Sublayers() for _ in range(self.layers))
        self.pseudo_queries = nn.Parameter(torch.ones(self.layers + 1, H))
        _init(self)

    # (the fp64 reference copy keeps fp64 where the code says fp32 and bf16)
    @staticmethod
    def _fp32(t):
        return t.to(torch.promote_types(t.dtype, torch.float32))

    @staticmethod
    def _res(q, values):
        keys = F.rms_norm(values, (values.shape[-1],), eps=EPS)
        logits = torch.einsum("d, n b t d -> n b t", q, keys)
        logits = logits - logits.max(dim=0, keepdim=True).values
        dtype = torch.bfloat16 if values.dtype == torch.float32 else values.dtype
        return torch.einsum("n b t, n b t d -> b t d", logits.softmax(0), values).to(dtype)

    def forward(self, x):
        inputs, queries = self._fp32(x), self._fp32(self.pseudo_queries)
        blocks = [inputs]
        for i, sub in enumerate(self.subs):
            mix = self._res(queries[i], torch.stack(blocks, dim=0))
            update = self._fp32(sub.mlp(mix.to(x.dtype)))  # the layers in the model dtype
            if i % self.block_size == 0:
                blocks.append(update)
            else:
                blocks[-1] = blocks[-1] + update
        return self._res(queries[-1], torch.stack(blocks, dim=0))


class NanochatBf16(nn.Module):
    """nanochat's AttnRes pull request: a parameter-free ``F.rms_norm`` key norm in the model
    dtype, pseudo-queries as rows of an fp32 ``[L, D]`` parameter cast ``.to(x.dtype)`` at
    the call, einsum logits, ``softmax(0)`` in the model dtype, einsum mix; a block closes
    at every layer but the first (``i > 0 and i % (block_size // 2) == 0``, block size 2);
    no final read. The reads over one source (the first three) are not contractions."""

    layers = 4

    def __init__(self) -> None:
        super().__init__()
        self.subs = nn.ModuleList(_Sublayers() for _ in range(self.layers))
        self.attn_res_proj = nn.Parameter(torch.ones(self.layers, H))
        self.mlp_res_proj = nn.Parameter(torch.ones(self.layers, H))
        _init(self)

    def _apply(self, fn, recurse=True):  # the queries stay fp32 masters in any model dtype
        return _keep_fp32(super()._apply(fn, recurse), "attn_res_proj", "mlp_res_proj")

    @staticmethod
    def _res(blocks, partial, w):
        V = torch.stack(blocks + [partial])
        K = F.rms_norm(V, (V.size(-1),))
        logits = torch.einsum("d, n b t d -> n b t", w, K)
        return torch.einsum("n b t, n b t d -> b t d", logits.softmax(0), V)

    def forward(self, x):
        blocks, partial = [], x
        for i, sub in enumerate(self.subs):
            h = self._res(blocks, partial, self.attn_res_proj[i].to(partial.dtype))
            if i > 0:  # block size 2: a block closes at every layer after the first
                blocks, partial = blocks + [partial], None
            out = sub.attention(F.rms_norm(h, (H,)))
            partial = out if partial is None else partial + out
            h = self._res(blocks, partial, self.mlp_res_proj[i].to(partial.dtype))
            partial = partial + sub.mlp(F.rms_norm(h, (H,)))
        return partial


class NanogptRoundedScale(nn.Module):
    """A nanoGPT AttnRes reproduction's key norm: the mean square in fp32, the scale
    ``rsqrt(...)`` cast back to the model dtype and multiplied with the model-dtype input and
    weight (``x * scale.to(x.dtype) * w``); the query a row of a parameter cast to the
    values' dtype; ellipsis einsums; ``softmax(0)``."""

    layers = 3

    def __init__(self) -> None:
        super().__init__()
        self.subs = nn.ModuleList(_Sublayers() for _ in range(self.layers))
        self.key_w = nn.Parameter(torch.ones(2 * self.layers + 1, H))
        self.queries = nn.Parameter(torch.ones(2 * self.layers + 1, H))
        _init(self)

    def _apply(self, fn, recurse=True):  # fp32 masters, cast at the call
        return _keep_fp32(super()._apply(fn, recurse), "key_w", "queries")

    def _keys(self, x, i):
        scale = torch.rsqrt(x.float().pow(2).mean(dim=-1, keepdim=True) + 1e-8).to(x.dtype)
        return x * scale * self.key_w[i].to(x.dtype)

    def _res(self, sources, i):
        V = torch.stack(sources, dim=0)
        q = self.queries[i].to(V.dtype)
        logits = torch.einsum("d,s...d->s...", q, self._keys(V, i))
        return torch.einsum("s...,s...d->...d", F.softmax(logits, dim=0), V)

    def forward(self, x):
        completed, partial = [x], None
        for i, sub in enumerate(self.subs):
            h = self._res(completed + ([partial] if partial is not None else []), 2 * i)
            out = sub.attention(h)
            partial = out if partial is None else partial + out
            h = self._res(completed + [partial], 2 * i + 1)
            partial = partial + sub.mlp(h)
            completed, partial = completed + [partial], None
        return self._res(completed, 2 * self.layers)


# ---------------------------------------------------------------- AttnRes near relatives


class ScaledLogits(nn.Module):
    """Depth attention with a temperature: the README's step with ``logits / sqrt(H)``
    (Adaptive-Deep-Networks' ``block_attnres``). Another softmax: must not fuse."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = HFRMSNorm(H)
        self.proj = nn.Linear(H, 1, bias=False)
        self.sub = _Sublayers()
        _init(self)

    def forward(self, x):
        blocks = [x, self.sub.attention(x)]
        V = torch.stack(blocks + [self.sub.mlp(x)])
        logits = torch.einsum("d, n b t d -> n b t", self.proj.weight.squeeze(), self.norm(V))
        logits = logits / (V.shape[-1] ** 0.5)
        return torch.einsum("n b t, n b t d -> b t d", logits.softmax(0), V)


class RecencyBias(nn.Module):
    """open-attention-residuals: a learned bias on the newest source's logit before the
    softmax. Not AttnRes: must not fuse."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = HFRMSNorm(H)
        self.proj = nn.Linear(H, 1, bias=False)
        self.recency = nn.Parameter(torch.tensor(3.0))
        self.sub = _Sublayers()
        _init(self)

    def forward(self, x):
        V = torch.stack([x, self.sub.attention(x), self.sub.mlp(x)])
        logits = torch.einsum("d, n b t d -> n b t", self.proj.weight.squeeze(), self.norm(V))
        bias = torch.zeros_like(logits)
        bias[-1] = self.recency
        return torch.einsum("n b t, n b t d -> b t d", (logits + bias).softmax(0), V)


class NormalizedSourceMix(nn.Module):
    """Depth attention that mixes the *normalized* sources (the keys) instead of the raw
    ones: no public code found; the near miss a matcher must catch. Must not fuse."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = HFRMSNorm(H)
        self.proj = nn.Linear(H, 1, bias=False)
        self.sub = _Sublayers()
        _init(self)

    def forward(self, x):
        V = torch.stack([x, self.sub.attention(x), self.sub.mlp(x)])
        K = self.norm(V)
        logits = torch.einsum("d, n b t d -> n b t", self.proj.weight.squeeze(), K)
        return torch.einsum("n b t, n b t d -> b t d", logits.softmax(0), K)


# =============================================================== MLA fronts


class _MLAHeads(nn.Module):
    """What reads the latents (q_b / kv_b), so the norms' outputs are used as in a model."""

    def __init__(self) -> None:
        super().__init__()
        self.q_b_proj = nn.Linear(Q_LORA, 40, bias=False)
        self.kv_b_proj = nn.Linear(KV_LORA, 40, bias=False)


class HFDeepseekV3MLA(_MLAHeads):
    """transformers' DeepseekV3Attention front: separate ``q_a_proj`` and
    ``kv_a_proj_with_mqa`` (with bias when ``attention_bias``), ``torch.split`` into the kv
    latent and the rope part, HF RMSNorms (cast, then weight), ``[B, S, H]``; q_b reads the
    q latent before kv is projected."""

    def __init__(self, bias: bool = False) -> None:
        super().__init__()
        self.q_a_proj = nn.Linear(H, Q_LORA, bias=bias)
        self.q_a_layernorm = HFRMSNorm(Q_LORA)
        self.kv_a_proj_with_mqa = nn.Linear(H, KV_LORA + ROPE, bias=bias)
        self.kv_a_layernorm = HFRMSNorm(KV_LORA)
        _init(self)

    def forward(self, h):
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(h)))
        k_pass, k_rot = torch.split(self.kv_a_proj_with_mqa(h), [KV_LORA, ROPE], dim=-1)
        k_pass = self.kv_b_proj(self.kv_a_layernorm(k_pass))
        return q, k_pass, k_rot


class HFDeepseekV2BiasMLA(HFDeepseekV3MLA):
    """transformers' DeepseekV2Attention with ``attention_bias=True``: the projections are
    ``addmm``s."""

    def __init__(self) -> None:
        super().__init__(bias=True)


class DeepseekV32Indexer(_MLAHeads):
    """DeepSeek-V3.2-Exp inference: fp32 norm weights applied before the cast, the q latent
    read by ``wq_b`` and by the indexer, the kv norm before rope, and a third norm -- the
    indexer's ``LayerNorm`` on ``wk(x)`` -- that is no RMSNorm and no partner."""

    def __init__(self) -> None:
        super().__init__()
        self.wq_a = nn.Linear(H, Q_LORA, bias=False)
        self.q_norm = FP32WeightRMSNorm(Q_LORA)
        self.wkv_a = nn.Linear(H, KV_LORA + ROPE, bias=False)
        self.kv_norm = FP32WeightRMSNorm(KV_LORA)
        self.wk = nn.Linear(H, 24, bias=False)
        self.k_norm = nn.LayerNorm(24, eps=EPS)
        self.indexer_q = nn.Linear(Q_LORA, 24, bias=False)
        _init(self)

    def _apply(self, fn, recurse=True):  # the norm weights stay fp32 in any model dtype
        return _keep_fp32(super()._apply(fn, recurse), "q_norm.weight", "kv_norm.weight")

    def forward(self, x):
        qr = self.q_norm(self.wq_a(x))
        q = self.q_b_proj(qr)
        kv, k_pe = torch.split(self.wkv_a(x), [KV_LORA, ROPE], dim=-1)
        kv = self.kv_norm(kv)
        k = self.k_norm(self.wk(x))
        scores = (self.indexer_q(qr) * k).sum(-1)
        return q, self.kv_b_proj(kv), k_pe, scores


class VllmFusedProjection(_MLAHeads):
    """vLLM's MLA wrapper: one fused ``q_a + kv_a`` projection on flattened ``[T, H]``
    tokens, ``.split([q_lora, kv_lora + rope])``, the q norm and ``q_b_proj`` before the kv
    latent is split again (a nested split), RMSNorm ``forward_native`` (cast, then weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.fused_qkv_a_proj = nn.Linear(H, Q_LORA + KV_LORA + ROPE, bias=False)
        self.q_a_layernorm = HFRMSNorm(Q_LORA)
        self.kv_a_layernorm = HFRMSNorm(KV_LORA)
        _init(self)

    def forward(self, h):
        q_c, kv_lora = self.fused_qkv_a_proj(h).split([Q_LORA, KV_LORA + ROPE], dim=-1)
        q = self.q_b_proj(self.q_a_layernorm(q_c))
        kv_c, k_pe = kv_lora.split([KV_LORA, ROPE], dim=-1)
        return q, self.kv_b_proj(self.kv_a_layernorm(kv_c)), k_pe


class SglangAbsorbContiguous(_MLAHeads):
    """SGLang's ``forward_absorb_prepare``: one fused projection split in two, the kv latent
    a slice ``latent[..., :kv_lora]``, norms whose ``forward_native`` copies a non-contiguous
    input (``x.contiguous()``) and applies the weight in fp32; the rope part sliced after."""

    def __init__(self) -> None:
        super().__init__()
        self.fused_qkv_a_proj_with_mqa = nn.Linear(H, Q_LORA + KV_LORA + ROPE, bias=False)
        self.q_a_layernorm = FP32WeightRMSNorm(Q_LORA, contiguous=True)
        self.kv_a_layernorm = FP32WeightRMSNorm(KV_LORA, contiguous=True)
        _init(self)

    def forward(self, h):
        q, latent = self.fused_qkv_a_proj_with_mqa(h).split([Q_LORA, KV_LORA + ROPE], dim=-1)
        k_nope = latent[..., :KV_LORA]
        q = self.q_a_layernorm(q)
        k_nope = self.kv_a_layernorm(k_nope)
        k_pe = latent[..., KV_LORA:]
        return self.q_b_proj(q), self.kv_b_proj(k_nope), k_pe


class VllmMiniCPM3(_MLAHeads):
    """vLLM's MiniCPM3: separate projections, ``kv_a_layernorm(kv_a.contiguous())``, the
    normed kv latent written back into the projection's buffer in place."""

    def __init__(self) -> None:
        super().__init__()
        self.q_a_proj = nn.Linear(H, Q_LORA, bias=False)
        self.q_a_layernorm = HFRMSNorm(Q_LORA)
        self.kv_a_proj_with_mqa = nn.Linear(H, KV_LORA + ROPE, bias=False)
        self.kv_a_layernorm = HFRMSNorm(KV_LORA)
        _init(self)

    def forward(self, h):
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(h)))
        latent_cache = self.kv_a_proj_with_mqa(h)
        kv_a, _ = latent_cache.split([KV_LORA, ROPE], dim=-1)
        kv_a = self.kv_a_layernorm(kv_a.contiguous())
        kv = self.kv_b_proj(kv_a)
        latent_cache = latent_cache.unsqueeze(1)
        latent_cache[:, :, :KV_LORA] = kv_a.unsqueeze(1)
        return q, kv, latent_cache


class LongcatTwoBlocks(nn.Module):
    """transformers' LongCat-Flash: two MLA blocks per layer (one graph, two pairs), each
    norm's output scaled by a Python float before its up-projection."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(HFDeepseekV3MLA() for _ in range(2))
        self.mix = nn.Linear(40, H, bias=False)
        _init(self)

    def forward(self, h):
        outs = []
        for blk in self.blocks:
            q_c = blk.q_a_layernorm(blk.q_a_proj(h)) * (H / Q_LORA) ** 0.5
            k_pass, k_rot = torch.split(blk.kv_a_proj_with_mqa(h), [KV_LORA, ROPE], dim=-1)
            k_pass = blk.kv_a_layernorm(k_pass) * (H / KV_LORA) ** 0.5
            q, kv = blk.q_b_proj(q_c), blk.kv_b_proj(k_pass)
            outs += [q, kv, k_rot]
            h = h + self.mix(q * kv)
        return outs


class RopeSliceNorm(_MLAHeads):
    """Three norms over slices of related projections: ``q_a_layernorm``,
    ``kv_a_layernorm`` on the kv latent, and a small norm on the rope slice of the same
    projection, computed and read first (the spelling of issue 27's class 5). The pair is
    q with the kv latent; the rope-slice norm stays alone."""

    def __init__(self) -> None:
        super().__init__()
        self.q_a_proj = nn.Linear(H, Q_LORA, bias=False)
        self.q_a_layernorm = HFRMSNorm(Q_LORA)
        self.kv_a_proj_with_mqa = nn.Linear(H, KV_LORA + ROPE, bias=False)
        self.kv_a_layernorm = HFRMSNorm(KV_LORA)
        self.k_pe_norm = HFRMSNorm(ROPE)
        _init(self)

    def forward(self, h):
        q_c = self.q_a_layernorm(self.q_a_proj(h))
        kv = self.kv_a_proj_with_mqa(h)
        k_pe = self.k_pe_norm(kv[..., KV_LORA:])
        gate = torch.sigmoid(k_pe.mean(-1, keepdim=True))  # read before the kv latent
        q = self.q_b_proj(q_c * gate)
        kv_c = self.kv_a_layernorm(kv[..., :KV_LORA])
        return q, self.kv_b_proj(kv_c)


class LatentHeadsSum(_MLAHeads):
    """``q_b(norm(q_a(x))) + kv_b(norm(kv_a(x)[..., :r]))``: an ``RMSNorm -> bias-free
    Linear -> +`` that looks like a MoE tail but is the q/kv pair (issue 27, class 5)."""

    def __init__(self) -> None:
        super().__init__()
        self.q_a_proj = nn.Linear(H, Q_LORA, bias=False)
        self.q_a_layernorm = HFRMSNorm(Q_LORA)
        self.kv_a_proj_with_mqa = nn.Linear(H, KV_LORA + ROPE, bias=False)
        self.kv_a_layernorm = HFRMSNorm(KV_LORA)
        _init(self)

    def forward(self, x):
        kv = self.kv_a_proj_with_mqa(x)
        return (self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
                + self.kv_b_proj(self.kv_a_layernorm(kv[..., :KV_LORA])))


class GemmaPair(HFDeepseekV3MLA):
    """An MLA front with Gemma-style ``(1 + w)`` norms (TensorRT-LLM's ``use_gemma``
    RMSNorm). Another function: must not fuse."""

    def forward(self, h):
        def gemma(x, w):
            dtype = x.dtype
            x = x.float()
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
            return ((1 + w) * x.to(dtype))

        q = self.q_b_proj(gemma(self.q_a_proj(h), self.q_a_layernorm.weight))
        k_pass, k_rot = torch.split(self.kv_a_proj_with_mqa(h), [KV_LORA, ROPE], dim=-1)
        return q, self.kv_b_proj(gemma(k_pass, self.kv_a_layernorm.weight)), k_rot


# =============================================================== latent MoE tails


class _Tail(nn.Module):
    """A latent MoE's tail at tp = 1 behind its shared expert (an MLP of the hidden state:
    its down-projection is the shared output)."""

    def __init__(self, norm: nn.Module | None, up_bias: bool = False) -> None:
        super().__init__()
        self.shared_up = nn.Linear(H, 2 * H, bias=False)
        self.shared_down = nn.Linear(2 * H, H, bias=False)
        self.routed_expert_norm = norm
        self.routed_expert_up_proj = nn.Linear(LATENT, H, bias=up_bias)
        _init(self)

    def shared_experts(self, h):
        return self.shared_down(F.silu(self.shared_up(h)))


class VllmLatentTail(_Tail):
    """vLLM's K3 ``KimiRoutedOutputTransform`` at tp = 1: the routed latent normed, up-projected
    by a bias-free Linear, then the shared experts' output added."""

    def __init__(self) -> None:
        super().__init__(HFRMSNorm(LATENT))

    def forward(self, latent, h, prefix):
        return self.routed_expert_up_proj(self.routed_expert_norm(latent)) + self.shared_experts(h)


class SglangLatentAdd3(_Tail):
    """SGLang's K3 MoE: ``up_proj(norm(latent))``, then a three-way add with the shared
    output and the AttnRes prefix (``out + shared + prefix``)."""

    def __init__(self) -> None:
        super().__init__(FP32WeightRMSNorm(LATENT))

    def forward(self, latent, h, prefix):
        out = self.routed_expert_up_proj(self.routed_expert_norm(latent))
        return out + self.shared_experts(h) + prefix


class NemotronNoNorm(_Tail):
    """Nemotron-H's latent MoE: no norm on the latent, ``fc2_latent_proj`` with a bias, the
    shared output added. No latent norm: nothing to fuse."""

    def __init__(self) -> None:
        super().__init__(None, up_bias=True)

    def forward(self, latent, h, prefix):
        return self.routed_expert_up_proj(latent * 2.5) + self.shared_experts(h)


def _src(repo, path, commit):
    return Source(repo, path, commit)


ATTN = "attn_res"
QKV = "qkv_rmsnorm"
TAIL = "moe_tail"

ENTRIES: list[Entry] = [
    # ---------------------------------------------------------------- AttnRes
    Entry("moonshot_readme", _src("MoonshotAI/Attention-Residuals", "README.md",
                                  "85e22310fe5ee860b4a023de312d791de8a5a5e6"),
          MoonshotReadme, "stack on dim 0, einsum logits and mix, softmax(0)",
          {ATTN: 6}, attn_res_blocks=[1, 1, 2, 2, 3, 3]),
    Entry("k3_folded_query", _src("pytorch/torchtitan", "torchtitan/models/kimi_k3/model.py",
                                  "9f8bcf0cb19f515c65df239f876f6a910114524b"),
          K3FoldedQuery, "packed [T, H], [T, N, H] cat bank, fp32 inline RMS, folded query, "
          "torch.softmax(-1), matmul mix", {ATTN: 8}, inputs_kind="tokens",
          attn_res_blocks=[1, 1, 1, 1, 2, 2, 2, 2]),
    Entry("k3_sequence_first", _src("ROCm/Megatron-LM", "kimi_k3/block/attn_res.py",
                                    "009f013acbc77b363f462c65ad7f6dc0ac34da48"),
          K3SequenceFirst, "[S, B, H], bank on dim 2, folded query, broadcast mix, output norm",
          {ATTN: 8}, inputs_kind="seq_first", attn_res_blocks=[1, 1, 1, 1, 2, 2, 2, 2]),
    Entry("k3_flattened_projection", _src("sgl-project/sglang",
                                          "python/sglang/srt/layers/attn_residual.py",
                                          "01fd23325ec08538327a88d3dedd860b99dd444f"),
          K3FlattenedProjection, "key norm on rows.reshape(T*R, H), Linear(H, 1).reshape(T, R), "
          "softmax(scores.float()), output norm on mixed.to(dtype)", {ATTN: 8},
          inputs_kind="tokens", attn_res_blocks=[1, 1, 1, 1, 2, 2, 2, 2]),
    Entry("vllm_test_reference", _src("vllm-project/vllm", "tests/models/kimi_k3/test_attn_res.py",
                                      "09712358dc25fe9e0f7ec3f252005dc3e04b3ae5"),
          VllmTestReference, "model-dtype F.rms_norm keys, K @ w, matmul mix, prefix + delta, "
          "output F.rms_norm", {ATTN: 3}, inputs_kind="tokens", attn_res_blocks=[1, 2, 3]),
    Entry("fla_naive", _src("fla-org/flash-linear-attention", "fla/ops/attnres/naive.py",
                            "bc3b101dcb713ddc5bd8924b66754eb68b5ccf89"),
          FlaNaive, "sources .view(-1, D) then stacked, fp32 weighted F.rms_norm, einsum with "
          "query * scale, fp32 output norm, one cast", {ATTN: 3}, attn_res_blocks=[1, 2, 3],
          bf16=({ATTN: 0}, [], "the mix stays fp32 into the output norm; the op rounds the mix "
                "to the model dtype before its output norm")),
    Entry("fast_attnres_reference", _src("jon123boss/fast-attnres", "src/attnres/reference.py",
                                         "ce0881dc4a075a82b841c8e1c2f3b0a5a9e3faf9"),
          FastAttnresReference, "keys of values[..., -D:] (the whole rows), k.square(), the "
          "query multiplied in and summed, softmax of scores * 1.0 (Inductor's scaled-softmax "
          "form), weighted-sum mix over dim 0", {ATTN: 4}, attn_res_blocks=[0, 1, 2, 3],
          dynamic=({ATTN: 0}, "dynamic=True lifts the float scale to a graph input: a "
                   "temperature whose value the compile cannot see, which the op does not take")),
    Entry("catswe_paper_form", _src("catswe/flash-attention-residuals",
                                    "src/flash_attn_res/experimental/torch.py",
                                    "6e285e854b956f5662ca312546df3fe18cf8ce73"),
          CatsweNaive, "fp32 upcast once, unweighted F.rms_norm keys, einsum logits minus max, "
          "einsum mix cast to bf16 at every call", {ATTN: 4}, attn_res_blocks=[1, 1, 2, 2]),
    Entry("nanochat_bf16", _src("karpathy/nanochat", "nanochat/gpt.py",
                                "9f151898539d0cd33a3238cee21c0479a2c410c1"),
          NanochatBf16, "unweighted F.rms_norm keys in bf16, fp32 query rows cast .to(dtype), "
          "no final read", {ATTN: 5}, attn_res_blocks=[1, 1, 2, 2, 3]),
    Entry("nanogpt_rounded_scale", _src("tokenbender/nanogpt-attnres-repro",
                                        "examples/nanogpt/attnres.py",
                                        "58e942ab61badc0070cef55cd0bd4688223a2cd1"),
          NanogptRoundedScale, "keys x * rsqrt(...).to(x.dtype) * w, query .to(V.dtype), "
          "ellipsis einsums", {ATTN: 6}, attn_res_blocks=[1, 1, 2, 2, 3, 3]),
    Entry("scaled_logits", _src("sunnyang1/Adaptive-Deep-Networks", "src/attnres/block_attnres.py",
                                "2a631bc0b5977ce1adff48f44bc73fd4ac80c272"),
          ScaledLogits, "near relative: logits / sqrt(H)", {ATTN: 0}),
    Entry("recency_bias", _src("wdlctc/open-attention-residuals", "modeling_attnres.py",
                               "83d2b8de82c2fbb981c7decca67d13d9db348da6"),
          RecencyBias, "near relative: a learned bias on the newest logit", {ATTN: 0}),
    Entry("normalized_source_mix", _src("(none public)", "-", "-"),
          NormalizedSourceMix, "near relative: the keys mixed instead of the sources", {ATTN: 0}),
    # ---------------------------------------------------------------- MLA
    Entry("hf_deepseek_v3", _src("huggingface/transformers",
                                 "src/transformers/models/deepseek_v3/modeling_deepseek_v3.py",
                                 "00b676f8f0489b88652a31d70751cc540dd06305"),
          HFDeepseekV3MLA, "separate projections, torch.split, HF norms", {QKV: 1},
          pairs=[frozenset({"q_a_layernorm.weight", "kv_a_layernorm.weight"})]),
    Entry("hf_deepseek_v2_bias", _src("huggingface/transformers",
                                      "src/transformers/models/deepseek_v2/modeling_deepseek_v2.py",
                                      "0233e509531ace915c8241b4c16c8032a583279c"),
          HFDeepseekV2BiasMLA, "projections with bias (addmm)", {QKV: 1},
          pairs=[frozenset({"q_a_layernorm.weight", "kv_a_layernorm.weight"})]),
    Entry("deepseek_v32_indexer", _src("deepseek-ai/DeepSeek-V3.2-Exp", "inference/model.py",
                                       "3b99a5350d260b7c2a357e82362305509e2d0724"),
          DeepseekV32Indexer, "fp32 norm weights, q latent read twice, a LayerNorm third norm",
          {QKV: 1}, pairs=[frozenset({"q_norm.weight", "kv_norm.weight"})]),
    Entry("vllm_fused_projection", _src("vllm-project/vllm", "vllm/model_executor/layers/mla.py",
                                        "11080c8e655b4c48219dad6c31d956b9eecf0444"),
          VllmFusedProjection, "one fused projection, nested split, [T, H]", {QKV: 1},
          inputs_kind="tokens",
          pairs=[frozenset({"q_a_layernorm.weight", "kv_a_layernorm.weight"})]),
    Entry("sglang_absorb_contiguous", _src(
        "sgl-project/sglang",
        "python/sglang/srt/models/deepseek_common/attention_forward_methods/forward_mla.py",
        "c513a4824a8c1aa756a72c6f8db880cbd811a857"),
          SglangAbsorbContiguous, "fused projection, kv a slice, norms on .contiguous() "
          "copies, weight in fp32", {QKV: 1}, inputs_kind="tokens",
          pairs=[frozenset({"q_a_layernorm.weight", "kv_a_layernorm.weight"})]),
    Entry("vllm_minicpm3", _src("vllm-project/vllm", "vllm/model_executor/models/minicpm3.py",
                                "009ccee09595bc1ed5de28164ea2490a5ba1ce84"),
          VllmMiniCPM3, "kv_a_layernorm(kv_a.contiguous()), normed latent written back in place",
          {QKV: 1}, inputs_kind="tokens",
          pairs=[frozenset({"q_a_layernorm.weight", "kv_a_layernorm.weight"})]),
    Entry("longcat_two_blocks", _src("huggingface/transformers",
                                     "src/transformers/models/longcat_flash/modeling_longcat_flash.py",
                                     "b1e784f69d55487cdd09d3f268e454d053061708"),
          LongcatTwoBlocks, "two MLA blocks in one graph, norm outputs scaled", {QKV: 2},
          pairs=[frozenset({f"blocks.{i}.q_a_layernorm.weight", f"blocks.{i}.kv_a_layernorm.weight"})
                 for i in range(2)]),
    Entry("rope_slice_norm", _src("(issue 27, class 5: a user's MLA)", "-", "-"),
          RopeSliceNorm, "a third norm on the rope slice, computed first", {QKV: 1},
          pairs=[frozenset({"q_a_layernorm.weight", "kv_a_layernorm.weight"})]),
    Entry("latent_heads_sum", _src("(issue 27, class 5: a user's MLA)", "-", "-"),
          LatentHeadsSum, "q_b(norm(q_a(x))) + kv_b(norm(kv_a(x)[..., :r])): the pair, no tail",
          {QKV: 1, TAIL: 0},
          pairs=[frozenset({"q_a_layernorm.weight", "kv_a_layernorm.weight"})]),
    Entry("gemma_pair", _src("NVIDIA/TensorRT-LLM", "tensorrt_llm/_torch/modules/rms_norm.py",
                             "b35ac1b64368513d215c57d2ed01d62d910df8da"),
          GemmaPair, "near relative: (1 + w) norms", {QKV: 0}),
    # ---------------------------------------------------------------- latent MoE
    Entry("vllm_latent_tail", _src("vllm-project/vllm", "vllm/models/kimi_k3/nvidia/model.py",
                                   "006193b5a9a7957c11bc6472588f951e778072b5"),
          VllmLatentTail, "norm -> bias-free up-proj -> + shared", {TAIL: 1},
          inputs_kind="moe",
          tails=[("routed_expert_norm.weight", "routed_expert_up_proj.weight")]),
    Entry("sglang_latent_add3", _src("sgl-project/sglang", "python/sglang/srt/models/kimi_k3.py",
                                     "e44a41c1c413ce470c66445745f380a50203c286"),
          SglangLatentAdd3, "up(norm(latent)) + shared + prefix, weight in fp32", {TAIL: 1},
          inputs_kind="moe",
          tails=[("routed_expert_norm.weight", "routed_expert_up_proj.weight")]),
    Entry("nemotron_no_norm", _src("huggingface/transformers",
                                   "src/transformers/models/nemotron_h/modular_nemotron_h.py",
                                   "ae3cf70e65cdebb740497f62ac16e35440fe45de"),
          NemotronNoNorm, "near relative: no norm on the latent, a biased up-proj", {TAIL: 0},
          inputs_kind="moe"),
]

BY_NAME = {e.name: e for e in ENTRIES}
