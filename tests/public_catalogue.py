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

_TORCH = tuple(int(x) for x in torch.__version__.split(".")[:2])

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
    #: ``"seq_first"`` [T, B, H]; ``"moe"`` (latent [T, L], hidden [T, H], prefix [T, H]);
    #: ``"mtp"`` (hidden [B, T, H], the next tokens' embeddings [B, T, H]); ``"draft"`` (a
    #: draft's block [B, T, H], the target's context [B, T, H])
    inputs_kind: str = "h"
    #: what differs in bf16 (a site that cannot fuse there), with the reason
    bf16: tuple[dict[str, int], list[int], str] | None = None
    #: what differs compiled with ``dynamic=True`` (matches per fusion), with the reason
    dynamic: tuple[dict[str, int], str] | None = None
    #: the first torch (major, minor) whose ``dynamic=True`` graph differs (before it, the
    #: static counts)
    dynamic_from: tuple[int, int] = (0, 0)

    def expected(self, dtype: torch.dtype,
                 dynamic: bool = False) -> tuple[dict[str, int], list[int]]:
        """(matches per fusion, sorted AttnRes num_blocks) in ``dtype``; ``dynamic``: the
        matches of a ``dynamic=True`` compile (its blocks are not listed)."""
        fused, blocks = self.fused, self.attn_res_blocks
        if dtype != torch.float32 and self.bf16 is not None:
            fused, blocks = self.bf16[0], self.bf16[1]
        if dynamic and self.dynamic is not None and _TORCH >= self.dynamic_from:
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
        if self.inputs_kind in ("mtp", "draft"):
            return (rand(2, tokens, H), rand(2, tokens, H))
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


class _DivSqrtRMSNorm(nn.Module):
    """nanoAttnRes' key norm: ``weight * x / sqrt(mean(x^2) + eps)`` (the weight first, a
    division by the root, eps 1e-5) in the model dtype."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        denom = x.pow(2).mean(dim=-1, keepdim=True).add(self.eps).sqrt()
        return self.weight * x / denom


class LimeiWeightFirstNorm(nn.Module):
    """nanoAttnRes' ``block_attn_res(blocks, partial, proj, norm)``, called before each
    sublayer with the layer's own ``Linear(H, 1)`` and key norm (``weight * x / sqrt(...)``,
    model dtype); ``torch.stack(blocks + [partial], 0)``, einsum ``'c,nbtc->nbt'`` with
    ``proj.weight[0]``, ``.softmax(dim=0)``, einsum ``'nbt,nbtc->btc'``. The blocks list
    starts empty (the first read is over the embedding alone); a block closes before every
    attention sublayer (two sublayers a block), the partial restarting as
    ``torch.zeros_like(partial)``; no final read."""

    layers, n_blocks = 4, 4

    def __init__(self) -> None:
        super().__init__()
        self.subs = nn.ModuleList(_Sublayers() for _ in range(self.layers))
        self.attn_res_projs = nn.ModuleList(nn.Linear(H, 1, bias=False) for _ in range(self.layers))
        self.attn_res_norms = nn.ModuleList(_DivSqrtRMSNorm(H) for _ in range(self.layers))
        self.mlp_res_projs = nn.ModuleList(nn.Linear(H, 1, bias=False) for _ in range(self.layers))
        self.mlp_res_norms = nn.ModuleList(_DivSqrtRMSNorm(H) for _ in range(self.layers))
        _init(self)

    @staticmethod
    def _res(blocks, partial, proj, norm):
        V = torch.stack(blocks + [partial], dim=0)
        logits = torch.einsum("c,nbtc->nbt", proj.weight[0], norm(V))
        return torch.einsum("nbt,nbtc->btc", logits.softmax(dim=0), V)

    def forward(self, x):
        per_block = 2 * self.layers // self.n_blocks
        blocks = []
        for i, sub in enumerate(self.subs):
            partial = x
            h = self._res(blocks, partial, self.attn_res_projs[i], self.attn_res_norms[i])
            if (2 * i) % per_block == 0:
                blocks, partial = blocks + [partial], torch.zeros_like(partial)
            partial = partial + sub.attention(h)
            h = self._res(blocks, partial, self.mlp_res_projs[i], self.mlp_res_norms[i])
            if (2 * i + 1) % per_block == 0:
                blocks, partial = blocks + [partial], torch.zeros_like(partial)
            partial = partial + sub.mlp(h)
            x = partial
        return x


class ZefanTwoQueriesOneStack(nn.Module):
    """open-attention-residuals' Qwen3 AttnRes in its ``delta_v`` mode (``delta_attn_res``,
    no gate): Full AttnRes over the sublayer *outputs* (``[emb, a0, m0, ...]``), the mix
    added to the running stream afterwards (``h = partial + mix``: no source is the prefix);
    each attention sublayer reads the same sources twice with two queries and two key norms
    (one read for q/k, one for v); ``proj.weight.view(-1)`` queries, HF Qwen3RMSNorm keys,
    einsum, ``softmax(0)``. Layer 0's two reads are over the embedding alone (no
    contraction): their key norms are two norms of views of one tensor, and the q/kv pass
    pairs them in one dual norm (correct: each normalizes its own view with its own weight)."""

    layers = 3

    def __init__(self) -> None:
        super().__init__()
        n = self.layers
        self.subs = nn.ModuleList(_Sublayers() for _ in range(n))
        self.in_norm = nn.ModuleList(HFRMSNorm(H) for _ in range(n))
        self.post_norm = nn.ModuleList(HFRMSNorm(H) for _ in range(n))
        for k in ("a", "m", "v"):
            setattr(self, f"{k}_proj", nn.ModuleList(nn.Linear(H, 1, bias=False) for _ in range(n)))
            setattr(self, f"{k}_norm", nn.ModuleList(HFRMSNorm(H) for _ in range(n)))
        _init(self)

    @staticmethod
    def _read(deltas, partial, proj, norm):
        V = torch.stack(list(deltas), dim=0)
        w = torch.einsum("d, n b t d -> n b t", proj.weight.view(-1), norm(V)).softmax(dim=0)
        return partial + torch.einsum("n b t, n b t d -> b t d", w, V)

    def forward(self, emb):
        deltas, partial = [emb], emb
        for i, sub in enumerate(self.subs):
            h_qk = self._read(deltas, partial, self.a_proj[i], self.a_norm[i])
            h_v = self._read(deltas, partial, self.v_proj[i], self.v_norm[i])
            out = sub.attention(self.in_norm[i](h_qk)) \
                * torch.sigmoid(sub.attn(self.in_norm[i](h_v)))  # the v read gates the stand-in
            partial, deltas = partial + out, deltas + [out]
            h = self._read(deltas, partial, self.m_proj[i], self.m_norm[i])
            out = sub.mlp(self.post_norm[i](h))
            partial, deltas = partial + out, deltas + [out]
        return partial


class _RootDivNorm(nn.Module):
    """attention-residuals' (Edward-Zion-Saji) key norm: no weight, ``x / x.pow(2).mean(-1,
    keepdim=True).add(eps).sqrt()`` in the model dtype."""

    def __init__(self, eps: float = EPS) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x):
        return x / x.pow(2).mean(dim=-1, keepdim=True).add(self.eps).sqrt()


class SourcesOnDimTwo(nn.Module):
    """attention-residuals' (Edward-Zion-Saji) ``BlockAttnRes.compute_all_inputs``: the
    sublayer outputs of a plain residual pass first, then every sublayer's input read from
    them: sources ``torch.stack(..., dim=2)`` ``[B, T, N, D]``, one shared parameter-free key
    norm (``x / sqrt(mean(x^2) + eps)``), the query a row of a ``[sublayers, D]`` parameter,
    ``(k * w).sum(-1)``, ``torch.softmax(-1)``, the mix ``(p.unsqueeze(-1) * v).sum(dim=2)``.
    A block of 2 sublayers; its first read takes the completed blocks only (no partial),
    the first of all the embedding alone (a site over one source: the weighted-sum mix
    stays in the graph, as fast-attnres'). The second pass's sublayer
    outputs are summed here (the demo model's loop keeps only its last read live)."""

    layers, block = 4, 2

    def __init__(self) -> None:
        super().__init__()
        self.subs = nn.ModuleList(_Sublayers() for _ in range(self.layers))
        self.queries = nn.Parameter(torch.ones(2 * self.layers, H))
        self.key_norm = _RootDivNorm()
        _init(self)

    def _inputs(self, outputs, emb):
        reprs, partial, inputs = [emb], None, []
        for n, out in enumerate(outputs):
            i = n % self.block
            v = torch.stack(reprs + ([partial] if i > 0 and partial is not None else []), dim=2)
            scores = (self.key_norm(v) * self.queries[n]).sum(dim=-1)
            alpha = torch.softmax(scores, dim=-1)
            inputs.append((alpha.unsqueeze(-1) * v).sum(dim=2))
            partial = out if partial is None else partial + out
            if i + 1 >= self.block:
                reprs, partial = reprs + [partial], None
        return inputs

    def forward(self, x):
        outputs, h = [], x
        for sub in self.subs:  # the plain residual pass that yields the sublayer outputs
            a = sub.attention(h)
            m = sub.mlp(h + a)
            outputs += [a, m]
            h = h + a + m
        inputs = self._inputs(outputs, x)
        return sum(sub.attention(inputs[2 * i]) + sub.mlp(inputs[2 * i + 1])
                   for i, sub in enumerate(self.subs))


class TwoPhaseOnlineMerge(SourcesOnDimTwo):
    """attention-residuals' (Edward-Zion-Saji) ``BlockAttnRes.two_phase_block`` (the paper's
    two-phase inference, its Algorithm 1), over the same precomputed sublayer outputs as
    ``SourcesOnDimTwo``: per block, phase 1 scores every layer's query against the completed
    blocks in one einsum ``'btnd,sd->btsn'`` and spells the softmax out (``max``, ``exp``,
    ``sum``, ``lse = m + log(sum)``), mixing with ``einsum('btsn,btnd->btsd', exp / sum,
    v)``; phase 2 merges each later layer's read with the partial (one source: output the
    partial, statistics its logit) by the online-softmax rule ``(o1 * e1 + o2 * e2) / (e1 +
    e2)``. The function is AttnRes's, but no read is one softmax over its own sources: a
    block's first read is a slice of a softmax batched over the block's queries, the later
    ones merge two partial softmaxes. A miss (nothing fuses; eager's graph is left)."""

    def _inputs(self, outputs, emb):
        reprs, inputs = [emb], []
        for start in range(0, len(outputs), self.block):
            v = torch.stack(reprs, dim=2)
            k = self.key_norm(v)
            scores = torch.einsum("btnd,sd->btsn", k, self.queries[start:start + self.block])
            m1 = scores.max(dim=-1, keepdim=True).values
            exp1 = torch.exp(scores - m1)
            sum1 = exp1.sum(dim=-1, keepdim=True)
            lse1 = m1 + torch.log(sum1)
            o1 = torch.einsum("btsn,btnd->btsd", exp1 / sum1, v)
            partial = None
            for i in range(self.block):
                if i == 0:
                    inputs.append(o1[:, :, 0, :])
                else:
                    s2 = (self.key_norm(partial) * self.queries[start + i]).sum(-1, keepdim=True)
                    m = torch.maximum(m1[:, :, i, :], s2)
                    e1, e2 = torch.exp(lse1[:, :, i, :] - m), torch.exp(s2 - m)
                    inputs.append((o1[:, :, i, :] * e1 + partial * e2) / (e1 + e2))
                out = outputs[start + i]
                partial = out if partial is None else partial + out
            reprs = reprs + [partial]
        return inputs


class _WeightTimesQuotientNorm(nn.Module):
    """attnres (Da1sypetals)' key norm: ``weight * (x / x.pow(2).mean(-1, keepdim=True)
    .add(eps).sqrt())`` in the model dtype."""

    def __init__(self, dim: int, eps: float = EPS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x / x.pow(2).mean(-1, keepdim=True).add(self.eps).sqrt())


class ZeroPartialSource(nn.Module):
    """attnres (Da1sypetals)' ``AttnResAggregator``: the README's step (``stack(blocks +
    [partial], 0)``, einsum ``'d, s b t d -> s b t'`` with a bare ``[D]`` pseudo-query,
    ``softmax(dim=0)``, einsum mix) with the key norm ``weight * (x / sqrt(...))``; the
    partial starts as ``torch.zeros_like(x)`` and restarts so after each block boundary, so
    the read that opens a block takes an all-zero source (its key is 0, its logit 0); the
    last block never closes; a final read. The sublayer pre-norms are the key norm's
    class, as there. (The source's final norm of the last read, the same bf16 class, is
    left out: it amplified the eager bf16 module's own rounding -- max error 0.31 at a
    scale of 4 against fp64, T = 64 -- past the compile test's compiled-vs-eager bound,
    the compiled output being the closer to fp64.)"""

    layers, n_blocks = 3, 3

    def __init__(self) -> None:
        super().__init__()
        n = 2 * self.layers + 1
        self.subs = nn.ModuleList(_Sublayers() for _ in range(self.layers))
        self.pseudo_queries = nn.ParameterList(nn.Parameter(torch.zeros(H)) for _ in range(n))
        self.key_norms = nn.ModuleList(_WeightTimesQuotientNorm(H) for _ in range(n))
        self.sub_norms = nn.ModuleList(_WeightTimesQuotientNorm(H) for _ in range(2 * self.layers))
        _init(self)
        with torch.no_grad():  # queries as _init makes a Linear(H, 1)'s: logits of std ~3
            for q in self.pseudo_queries:
                q.sub_(1).mul_(10 / H ** 0.5)

    def _res(self, blocks, partial, i):
        V = torch.stack(blocks + [partial], dim=0)
        logits = torch.einsum("d, s b t d -> s b t", self.pseudo_queries[i], self.key_norms[i](V))
        return torch.einsum("s b t, s b t d -> b t d", logits.softmax(dim=0), V)

    def forward(self, x):
        per_block = 2 * self.layers // self.n_blocks
        boundaries = {k * per_block - 1 for k in range(1, self.n_blocks)}
        blocks, partial = [x], torch.zeros_like(x)
        for i, sub in enumerate(self.subs):
            for j, f in enumerate((sub.attention, sub.mlp)):
                s = 2 * i + j
                partial = partial + f(self.sub_norms[s](self._res(blocks, partial, s)))
                if s in boundaries:
                    blocks, partial = blocks + [partial], torch.zeros_like(partial)
        return self._res(blocks, partial, 2 * self.layers)


class RawSublayerSource(nn.Module):
    """attnres (Sohailm25)'s ``BlockAttnResTinyLM``: ``torch.nn.RMSNorm`` keys (eps None:
    the dtype's machine epsilon) on ``torch.stack(tuple(sources), 0)``, einsum
    ``'d,sbtd->sbt'`` with a bare ``[D]`` query, ``torch.softmax(logits, dim=0)``, einsum
    mix. One block per layer: the pre-attention read takes ``[embed] + completed``, the
    pre-MLP read those and the attention sublayer's *raw output* (no running partial), and
    the completed block is ``attn_out + mlp_out`` (no prefix); a final read, then a final
    norm. Layer 0's pre-attention read is over the embedding alone (no contraction)."""

    layers = 3

    def __init__(self) -> None:
        super().__init__()
        n = self.layers
        self.subs = nn.ModuleList(_Sublayers() for _ in range(n))
        self.attn_norms = nn.ModuleList(nn.RMSNorm(H) for _ in range(n))
        self.mlp_norms = nn.ModuleList(nn.RMSNorm(H) for _ in range(n))
        self.attn_res_norms = nn.ModuleList(nn.RMSNorm(H) for _ in range(n))
        self.mlp_res_norms = nn.ModuleList(nn.RMSNorm(H) for _ in range(n))
        self.attn_queries = nn.ParameterList(nn.Parameter(torch.zeros(H)) for _ in range(n))
        self.mlp_queries = nn.ParameterList(nn.Parameter(torch.zeros(H)) for _ in range(n))
        self.final_res_norm = nn.RMSNorm(H)
        self.final_query = nn.Parameter(torch.zeros(H))
        self.final_norm = nn.RMSNorm(H)
        _init(self)
        with torch.no_grad():  # queries as _init makes a Linear(H, 1)'s: logits of std ~3
            for q in [*self.attn_queries, *self.mlp_queries, self.final_query]:
                q.sub_(1).mul_(10 / H ** 0.5)

    @staticmethod
    def _route(sources, query, norm):
        stacked = torch.stack(tuple(sources), dim=0)
        alpha = torch.softmax(torch.einsum("d,sbtd->sbt", query, norm(stacked)), dim=0)
        return torch.einsum("sbt,sbtd->btd", alpha, stacked)

    def forward(self, x):
        completed = []
        for i, sub in enumerate(self.subs):
            pre_attn = [x] + completed
            h = self._route(pre_attn, self.attn_queries[i], self.attn_res_norms[i])
            attn_out = sub.attention(self.attn_norms[i](h))
            h = self._route(pre_attn + [attn_out], self.mlp_queries[i], self.mlp_res_norms[i])
            completed.append(attn_out + sub.mlp(self.mlp_norms[i](h)))
        h = self._route([x] + completed, self.final_query, self.final_res_norm)
        return self.final_norm(h)


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


class XrenyaLayerNormKeys(nn.Module):
    """Attention-Residuals' ``FullAttnResStack``: ``nn.LayerNorm`` keys (mean-centred, with
    a bias) and logits multiplied by ``1/sqrt(D)`` before ``softmax(0)`` -- two departures
    from AttnRes; the mix replaces the skip (``h = mix + ff(h)``), each feed-forward behind
    its own LayerNorm. (Its ``BlockAttnResStack`` has the same keys and scale.) Must not fuse."""

    layers = 4

    def __init__(self) -> None:
        super().__init__()
        self.scale = math.sqrt(H) ** -1
        self.queries = nn.ParameterList(nn.Parameter(torch.zeros(H)) for _ in range(self.layers))
        self.key_norms = nn.ModuleList(nn.LayerNorm(H) for _ in range(self.layers))
        self.ff_norms = nn.ModuleList(nn.LayerNorm(H) for _ in range(self.layers))
        self.subs = nn.ModuleList(_Sublayers() for _ in range(self.layers))
        _init(self)

    def forward(self, x):
        hist, h = [x], x
        for q, kn, fn, sub in zip(self.queries, self.key_norms, self.ff_norms, self.subs):
            V = torch.stack(hist, dim=0)
            a = (torch.einsum("d, l b t d -> l b t", q, kn(V)) * self.scale).softmax(dim=0)
            h = torch.einsum("l b t, l b t d -> b t d", a, V) + sub.mlp(fn(h))
            hist.append(h)
        return h


class _CastingRMSNorm(nn.RMSNorm):
    """rms-block-attnres' ``CastingRMSNorm``: ``nn.RMSNorm`` (eps None: the dtype's
    machine epsilon) whose weight is cast to the input's dtype before ``F.rms_norm``."""

    def forward(self, x):
        w = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        return F.rms_norm(x, self.normalized_shape, w, self.eps)


class HighbuyerTwoPass(nn.Module):
    """highbuyer/attnres's "two-pass" read (no ``[N, B, T, C]`` stack): per source a
    weighted ``nn.RMSNorm`` (eps None) cast ``.to(v.dtype)`` and einsum ``'c,btc->bt'`` with
    ``proj.weight[0]``; only the logits stacked, ``.float().softmax(0).to(v.dtype)``; the
    mix ``zeros_like(v0)`` then ``out.add_(p[n].unsqueeze(-1) * v[n])`` per source. The
    embedding (``F.rms_norm``-ed) the first partial; a block closes at a layer start every
    ``bs`` sublayers (here 2; the source's default 3); no final read."""

    layers, bs = 4, 2

    def __init__(self) -> None:
        super().__init__()
        self.subs = nn.ModuleList(_Sublayers() for _ in range(self.layers))
        self.attnres_proj = nn.ModuleList(nn.Linear(H, 1, bias=False) for _ in range(2 * self.layers))
        self.attnres_norm = nn.ModuleList(nn.RMSNorm(H) for _ in range(2 * self.layers))
        _init(self)

    @staticmethod
    def _norm(x):
        return F.rms_norm(x, (x.size(-1),))

    def _read(self, completed, partial, idx):
        values = completed + ([partial] if partial is not None else [])
        w, dtype = self.attnres_proj[idx].weight[0], values[0].dtype
        logits = [torch.einsum("c,btc->bt", w.to(dtype), self.attnres_norm[idx](v).to(dtype))
                  for v in values]
        probs = torch.stack(logits, dim=0).float().softmax(dim=0).to(dtype)
        out = torch.zeros_like(values[0])
        for n, v in enumerate(values):
            out.add_(probs[n].unsqueeze(-1) * v)
        return out

    def forward(self, x):
        completed, partial, count = [], self._norm(x), 0
        for i, sub in enumerate(self.subs):
            if count % self.bs == 0 and count > 0:
                completed, partial = completed + [partial], None
            out = sub.attention(self._norm(self._read(completed, partial, 2 * i)))
            partial = out if partial is None else partial + out
            partial = partial + sub.mlp(self._norm(self._read(completed, partial, 2 * i + 1)))
            count += 2
        return self._norm(partial)


class MegatronLoopRead(nn.Module):
    """The Megatron-LM Attention Residuals fork's torch reference (``_full_attn_res_compute``,
    as kimmichtank/rms-block-attnres's ``scaling/megatron-attnres.patch`` adds it from
    Smu-Tan/Megatron-LM acd39782): sequence-first ``[S, B, H]`` sources never stacked; query
    and key weight cast to the sources' dtype; per source an inline model-dtype key norm
    ``v * rsqrt(v.pow(2).mean(-1) + eps) * w`` and einsum ``'h,sbh->sb'``; the logits
    stacked, ``softmax(0).to(dtype)``; the mix ``out = zeros_like(v0)`` then ``out = out +
    p[d].unsqueeze(-1) * v``. ``rms_block`` state: sources (embedding, completed blocks, the
    pending sum); a completed block is the sum of 4 unweighted fp32-normed writes, cast back;
    a read before attention and before the MLP of every layer, and a final read."""

    layers, block = 4, 4

    def __init__(self) -> None:
        super().__init__()
        self.subs = nn.ModuleList(_Sublayers() for _ in range(self.layers))
        self.input_norms = nn.ModuleList(nn.RMSNorm(H, eps=EPS) for _ in range(self.layers))
        self.mlp_norms = nn.ModuleList(nn.RMSNorm(H, eps=EPS) for _ in range(self.layers))
        self.queries = nn.ParameterList(nn.Parameter(torch.zeros(H)) for _ in range(2 * self.layers + 1))
        self.key_w = nn.ParameterList(nn.Parameter(torch.ones(H)) for _ in range(2 * self.layers + 1))
        self.final_norm = nn.RMSNorm(H, eps=EPS)
        _init(self)
        with torch.no_grad():  # queries as _init makes a Linear(H, 1)'s: logits of std ~3
            for q in self.queries:
                q.sub_(1).mul_(10 / H ** 0.5)

    def _read(self, values, i):
        ref = values[0]
        q, w = self.queries[i].to(ref.dtype), self.key_w[i].to(ref.dtype)
        logits = [torch.einsum("h,sbh->sb", q, v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True)
                                                                + EPS) * w) for v in values]
        probs = torch.softmax(torch.stack(logits, dim=0), dim=0).to(ref.dtype)
        out = torch.zeros_like(ref)
        for d, v in enumerate(values):
            out = out + probs[d].unsqueeze(-1) * v
        return out

    @staticmethod
    def _rms_write(v):
        x = v.float()
        return (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS)).to(v.dtype)

    def forward(self, hidden):
        completed, pending = [], []

        def values():
            return (hidden, *completed, *((sum(pending),) if pending else ()))

        def append(v):
            pending.append(v)
            if len(pending) == self.block:
                completed.append(sum(self._rms_write(p) for p in pending))
                pending.clear()

        for i, sub in enumerate(self.subs):
            append(sub.attention(self.input_norms[i](self._read(values(), 2 * i))))
            append(sub.mlp(self.mlp_norms[i](self._read(values(), 2 * i + 1))))
        return self.final_norm(self._read(values(), 2 * self.layers))


class FullRMSAggregate(nn.Module):
    """rms-block-attnres' ``full_rms_aggregate`` (``summary_mode='full_rms'``): Full
    AttnRes whose mix takes the *normalized* sources (the keys) as values:
    ``normalized = key_norm(stack(sources, 0))``, einsum ``"d,lbtd->lbt"`` with a bare
    ``[D]`` query, ``F.softmax(dim=0)``, ``(weights.unsqueeze(-1) * normalized).sum(0)``;
    each sublayer behind a ``CastingRMSNorm``, a final read. Another function: must not fuse."""

    layers = 3

    def __init__(self) -> None:
        super().__init__()
        n = 2 * self.layers + 1
        self.subs = nn.ModuleList(_Sublayers() for _ in range(self.layers))
        self.pre_norms = nn.ModuleList(_CastingRMSNorm(H) for _ in range(2 * self.layers))
        self.queries = nn.ParameterList(nn.Parameter(torch.zeros(H)) for _ in range(n))
        self.key_norms = nn.ModuleList(_CastingRMSNorm(H) for _ in range(n))
        _init(self)

    def _res(self, prior, i):
        normalized = self.key_norms[i](torch.stack(prior, dim=0))
        weights = F.softmax(torch.einsum("d,lbtd->lbt", self.queries[i], normalized), dim=0)
        return (weights.unsqueeze(-1) * normalized).sum(dim=0)

    def forward(self, x):
        v_list = [x]
        for i, sub in enumerate(self.subs):
            v_list.append(sub.attention(self.pre_norms[2 * i](self._res(v_list, 2 * i))))
            v_list.append(sub.mlp(self.pre_norms[2 * i + 1](self._res(v_list, 2 * i + 1))))
        return self._res(v_list, 2 * self.layers)


class InPlaceRecencyBias(nn.Module):
    """attention-residuals-reproduction's ``block_attn_res`` (Qwen3 converted to Block
    AttnRes): HF Qwen3 RMSNorm keys, ``proj.weight.view(-1)``, einsum logits, then
    ``logits[-1] = logits[-1] + recency_bias`` written in place before ``softmax(dim=0)``.
    The bias makes it another softmax: must not fuse (a matcher that read the einsum's
    output past the in-place write would drop the bias)."""

    layers, per_block = 3, 1

    def __init__(self) -> None:
        super().__init__()
        self.subs = nn.ModuleList(_Sublayers() for _ in range(self.layers))
        self.res_projs = nn.ModuleList(nn.Linear(H, 1, bias=False) for _ in range(2 * self.layers))
        self.res_norms = nn.ModuleList(HFRMSNorm(H) for _ in range(2 * self.layers))
        self.res_bias = nn.ParameterList(nn.Parameter(torch.tensor(3.0))
                                         for _ in range(2 * self.layers))
        self.final_norm = HFRMSNorm(H)
        _init(self)

    def _res(self, blocks, partial, i):
        V = torch.stack(blocks + [partial], dim=0)
        logits = torch.einsum("d, n b t d -> n b t", self.res_projs[i].weight.view(-1),
                              self.res_norms[i](V))
        logits[-1] = logits[-1] + self.res_bias[i]
        return torch.einsum("n b t, n b t d -> b t d", logits.softmax(dim=0), V)

    def forward(self, x):
        blocks, partial = [x], x
        for i, sub in enumerate(self.subs):
            partial = partial + sub.attention(self._res(blocks, partial, 2 * i))
            partial = partial + sub.mlp(self._res(blocks, partial, 2 * i + 1))
            if (i + 1) % self.per_block == 0:
                blocks = blocks + [partial]
        return self.final_norm(partial)


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


#: heads of the MLA fronts below that run attention (qk = nope + rope, v)
N_HEADS, NOPE, V_DIM = 2, 16, 16
#: the longest sequence a rope table or cache below holds (the catalogue compiles T <= 64)
MAX_SEQ = 64


class _FRMSNorm(nn.Module):
    """DeepSeek-V3 inference's ``RMSNorm``: ``F.rms_norm(x, (dim,), weight, eps)`` in the
    model dtype."""

    def __init__(self, dim: int, eps: float = EPS) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, (self.dim,), self.weight, self.eps)


def _complex_freqs(dim: int = ROPE, seqlen: int = MAX_SEQ, base: float = 10000.0):
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.outer(torch.arange(seqlen).float(), freqs)
    return torch.polar(torch.ones_like(freqs), freqs)  # complex64 [seqlen, dim / 2]


class DeepseekV3CacheWrite(nn.Module):
    """DeepSeek-V3's reference inference MLA, ``attn_impl = "absorb"``: ``F.rms_norm`` norms
    in the model dtype; ``q = wq_b(q_norm(wq_a(x)))`` split, complex rope on ``q_pe``;
    ``wkv_a(x)`` split, complex rope on ``k_pe``; ``q_nope`` absorbed into ``wkv_b``; then the
    kv norm's output is *written into a buffer* (``kv_cache[:b, start:end] = kv_norm(kv)``)
    and read only back through the cache (the scores and the output einsums), ``pe_cache``
    likewise. The complex ``freqs_cis`` buffer stays complex64 in any dtype (``_apply``);
    the caches hold 64 positions; the complex view names its size (``x.size(-1) // 2`` for
    the public ``-1``: a view of zero tokens cannot infer it)."""

    def __init__(self) -> None:
        super().__init__()
        qk = NOPE + ROPE
        self.wq_a = nn.Linear(H, Q_LORA, bias=False)
        self.q_norm = _FRMSNorm(Q_LORA)
        self.wq_b = nn.Linear(Q_LORA, N_HEADS * qk, bias=False)
        self.wkv_a = nn.Linear(H, KV_LORA + ROPE, bias=False)
        self.kv_norm = _FRMSNorm(KV_LORA)
        self.wkv_b = nn.Linear(KV_LORA, N_HEADS * (NOPE + V_DIM), bias=False)
        self.wo = nn.Linear(N_HEADS * V_DIM, H, bias=False)
        self.softmax_scale = qk ** -0.5
        _init(self)
        self.register_buffer("kv_cache", torch.zeros(4, MAX_SEQ, KV_LORA), persistent=False)
        self.register_buffer("pe_cache", torch.zeros(4, MAX_SEQ, ROPE), persistent=False)
        self.register_buffer("freqs_cis", _complex_freqs(), persistent=False)

    def _apply(self, fn, recurse=True):  # the complex freqs_cis stays complex64
        freqs_cis = self.freqs_cis
        out = super()._apply(fn, recurse)
        self.freqs_cis = freqs_cis
        return out

    @staticmethod
    def _rope(x, freqs_cis):
        dtype = x.dtype
        x = torch.view_as_complex(x.float().view(*x.shape[:-1], x.size(-1) // 2, 2))
        freqs_cis = freqs_cis.view(1, x.size(1), 1, x.size(-1))
        return torch.view_as_real(x * freqs_cis).flatten(3).to(dtype)

    def forward(self, x, start_pos: int = 0):
        bsz, seqlen, _ = x.size()
        end_pos = start_pos + seqlen
        freqs_cis = self.freqs_cis[start_pos:end_pos]
        mask = torch.full((seqlen, seqlen), float("-inf"), device=x.device).triu_(1) \
            if seqlen > 1 else None
        q = self.wq_b(self.q_norm(self.wq_a(x))).view(bsz, seqlen, N_HEADS, NOPE + ROPE)
        q_nope, q_pe = torch.split(q, [NOPE, ROPE], dim=-1)
        q_pe = self._rope(q_pe, freqs_cis)
        kv, k_pe = torch.split(self.wkv_a(x), [KV_LORA, ROPE], dim=-1)
        k_pe = self._rope(k_pe.unsqueeze(2), freqs_cis)
        wkv_b = self.wkv_b.weight.view(N_HEADS, -1, KV_LORA)
        q_nope = torch.einsum("bshd,hdc->bshc", q_nope, wkv_b[:, :NOPE])
        self.kv_cache[:bsz, start_pos:end_pos] = self.kv_norm(kv)
        self.pe_cache[:bsz, start_pos:end_pos] = k_pe.squeeze(2)
        scores = (torch.einsum("bshc,btc->bsht", q_nope, self.kv_cache[:bsz, :end_pos])
                  + torch.einsum("bshr,btr->bsht", q_pe, self.pe_cache[:bsz, :end_pos])) \
            * self.softmax_scale
        if mask is not None:
            scores += mask.unsqueeze(1)
        scores = scores.softmax(dim=-1, dtype=torch.float32).type_as(x)
        x = torch.einsum("bsht,btc->bshc", scores, self.kv_cache[:bsz, :end_pos])
        x = torch.einsum("bshc,hdc->bshd", x, wkv_b[:, -V_DIM:])
        return self.wo(x.flatten(2))


class _TupleLinear(nn.Linear):
    """Megatron's Column/RowParallelLinear at tp = 1: ``(output, bias)``."""

    def forward(self, x):
        return F.linear(x, self.weight), None


class MegatronCoreMLA(nn.Module):
    """Megatron-Core's ``MLASelfAttention``, local (non-TE) spec: sequence-first
    ``[S, B, H]``; ``(out, bias)`` linears; ``_qkv_down_projection`` runs *both* down
    projections before either norm, the kv one ``torch.split`` into latent and rope; then
    ``q_layernorm`` and ``kv_layernorm`` (``torch.nn.RMSNorm``) back to back; up projections,
    views into heads, MLA-interleaved rope (``t[..., 0::2]``, ``t[..., 1::2]`` cat,
    rotate-half), ``.contiguous()`` q/k/v; a causal attention stand-in. The output reshape
    names its batch size for the public ``-1`` (a view of zero tokens cannot infer it)."""

    def __init__(self) -> None:
        super().__init__()
        self.q_head = NOPE + ROPE
        self.linear_q_down_proj = _TupleLinear(H, Q_LORA, bias=False)
        self.linear_kv_down_proj = _TupleLinear(H, KV_LORA + ROPE, bias=False)
        self.linear_q_up_proj = _TupleLinear(Q_LORA, N_HEADS * self.q_head, bias=False)
        self.linear_kv_up_proj = _TupleLinear(KV_LORA, N_HEADS * (NOPE + V_DIM), bias=False)
        self.q_layernorm = nn.RMSNorm(Q_LORA, eps=EPS)
        self.kv_layernorm = nn.RMSNorm(KV_LORA, eps=EPS)
        self.linear_proj = _TupleLinear(N_HEADS * V_DIM, H, bias=False)
        _init(self)
        inv = 1.0 / (10000 ** (torch.arange(0, ROPE, 2).float() / ROPE))
        freqs = torch.outer(torch.arange(MAX_SEQ).float(), inv)
        self.register_buffer("rotary_pos_emb", torch.cat((freqs, freqs), dim=-1)[:, None, None, :],
                             persistent=False)  # [S, 1, 1, R]

    @staticmethod
    def _rope(t, freqs):  # _apply_rotary_pos_emb_bshd(mla_rotary_interleaved=True)
        if freqs.dim() == t.dim() + 1 and freqs.size(-2) == 1:
            freqs = freqs.squeeze(-2)
        rot_dim = freqs.shape[-1]
        t, t_pass = t[..., :rot_dim], t[..., rot_dim:]
        t = torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1)
        cos_, sin_ = torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)
        x1, x2 = torch.chunk(t, 2, dim=-1)
        t = (t * cos_) + (torch.cat((-x2, x1), dim=-1) * sin_)
        return torch.cat((t, t_pass), dim=-1)

    def forward(self, hidden_states):
        q_compressed, _ = self.linear_q_down_proj(hidden_states)
        kv_combined, _ = self.linear_kv_down_proj(hidden_states)
        kv_compressed, k_pos_emb = torch.split(kv_combined, [KV_LORA, ROPE], dim=-1)
        q_compressed = self.q_layernorm(q_compressed)
        kv_compressed = self.kv_layernorm(kv_compressed)
        q, _ = self.linear_q_up_proj(q_compressed)
        q = q.view(*q.size()[:-1], N_HEADS, self.q_head)
        kv, _ = self.linear_kv_up_proj(kv_compressed)
        kv = kv.view(*kv.size()[:-1], N_HEADS, NOPE + V_DIM)
        k_pos_emb = torch.unsqueeze(k_pos_emb, -2)
        q_len = q.size()[0]
        rotary_pos_emb = self.rotary_pos_emb[0:q_len]
        q_no_pe, q_pos_emb = torch.split(q, [NOPE, ROPE], dim=-1)
        k_no_pe, value = torch.split(kv, [NOPE, V_DIM], dim=-1)
        q_pos_emb = self._rope(q_pos_emb, rotary_pos_emb)
        k_pos_emb = self._rope(k_pos_emb, rotary_pos_emb)
        query = torch.cat([q_no_pe, q_pos_emb], dim=-1)
        key = torch.cat([k_no_pe, k_pos_emb.expand(-1, -1, N_HEADS, -1)], dim=-1)
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
        # core attention stand-in: [s, b, n, d] -> [b, n, s, d], causal
        qh, kh, vh = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        scores = torch.matmul(qh, kh.transpose(-1, -2)) * self.q_head ** -0.5
        causal = torch.triu(torch.ones(q_len, q_len, dtype=torch.bool, device=scores.device), 1)
        probs = torch.softmax(scores.masked_fill(causal, float("-inf")).float(), dim=-1).type_as(vh)
        out = torch.matmul(probs, vh).permute(2, 0, 1, 3)
        out = out.reshape(q_len, hidden_states.shape[1], N_HEADS * V_DIM)
        return self.linear_proj(out)[0]


class TorchtitanDeepseekV3(nn.Module):
    """torchtitan's DeepSeek-V3 MLA: packed tokens ``[T, H]``; ``q = wq_b(q_norm(wq_a(x)))``
    with plain ``nn.RMSNorm`` (eps 1e-5); ``q.view`` and split; ``wkv_a(x)`` split; complex
    rope on ``(q_pe, k_pe)`` *between* the q norm and the kv norm; only then
    ``kv_norm(kv) -> wkv_b``; causal SDPA over tokens (the inner-attention stand-in). The
    complex rope cache stays complex64 (``_apply``); views name their head counts for the
    public ``-1`` (a view of zero tokens cannot infer it)."""

    def __init__(self) -> None:
        super().__init__()
        self.qk = NOPE + ROPE
        self.wq_a = nn.Linear(H, Q_LORA, bias=False)
        self.q_norm = nn.RMSNorm(Q_LORA, eps=1e-5)
        self.wq_b = nn.Linear(Q_LORA, N_HEADS * self.qk, bias=False)
        self.wkv_a = nn.Linear(H, KV_LORA + ROPE, bias=False)
        self.kv_norm = nn.RMSNorm(KV_LORA, eps=1e-5)
        self.wkv_b = nn.Linear(KV_LORA, N_HEADS * (NOPE + V_DIM), bias=False)
        self.wo = nn.Linear(N_HEADS * V_DIM, H, bias=False)
        self.softmax_scale = self.qk ** -0.5
        _init(self)
        self.register_buffer("cache", _complex_freqs(), persistent=False)

    def _apply(self, fn, recurse=True):  # the complex rope cache stays complex64
        cache = self.cache
        out = super()._apply(fn, recurse)
        self.cache = cache
        return out

    def _rope(self, query, key):  # ComplexRoPE.apply_rotary_emb, positions None
        t = query.shape[0]
        cache = self.cache[:t].view(t, 1, self.cache.shape[-1])
        xq = torch.view_as_complex(query.float().reshape(*query.shape[:-1], ROPE // 2, 2))
        xk = torch.view_as_complex(key.float().reshape(*key.shape[:-1], ROPE // 2, 2))
        xq_out = torch.view_as_real(xq * cache).flatten(-2)
        xk_out = torch.view_as_real(xk * cache).flatten(-2)
        return xq_out.type_as(query), xk_out.type_as(key)

    def forward(self, x):
        num_tokens = x.shape[0]
        q = self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(num_tokens, N_HEADS, self.qk)
        q_nope, q_pe = torch.split(q, [NOPE, ROPE], dim=-1)
        kv, k_pe = torch.split(self.wkv_a(x), [KV_LORA, ROPE], dim=-1)
        q_pe, k_pe = self._rope(q_pe, k_pe.unsqueeze(1))
        q = torch.cat([q_nope, q_pe], dim=-1)
        kv = self.wkv_b(self.kv_norm(kv)).view(num_tokens, N_HEADS, NOPE + V_DIM)
        k_nope, v = torch.split(kv, [NOPE, V_DIM], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, k_nope.size(1), -1)], dim=-1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                             v.transpose(0, 1), is_causal=True,
                                             scale=self.softmax_scale)
        return self.wo(out.transpose(0, 1).contiguous().view(num_tokens, N_HEADS * V_DIM))


class RocmMegatronK3GatedMLA(nn.Module):
    """Kimi-K3's gated MLA on ROCm's Megatron (``sdpa`` backend): the norm weights *bare*
    ``nn.Parameter``s on the attention module (``q_a_layernorm``, ``kv_a_layernorm``; no norm
    module), applied by one shared ``rms_norm(x, w, eps)``: upcast, normalize,
    ``(w.to(fp32) * normed).to(x.dtype)`` (the weight first, in fp32); Megatron's
    sequence-first wrapper transposing ``[S, B, H] -> [B, S, H]`` ``.contiguous()`` and back;
    NoPE heads, ``k_rot.view(b, 1, s, r).expand``; SDPA with V padded to the q head and
    sliced; a full-rank sigmoid gate in fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.q_head = NOPE + ROPE
        self.q_a_proj = nn.Linear(H, Q_LORA, bias=False)
        self.q_b_proj = nn.Linear(Q_LORA, N_HEADS * self.q_head, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, KV_LORA + ROPE, bias=False)
        self.kv_b_proj = nn.Linear(KV_LORA, N_HEADS * (NOPE + V_DIM), bias=False)
        self.o_proj = nn.Linear(N_HEADS * V_DIM, H, bias=False)
        self.g_proj = nn.Linear(H, N_HEADS * V_DIM, bias=False)
        self.q_a_layernorm = nn.Parameter(torch.ones(Q_LORA))
        self.kv_a_layernorm = nn.Parameter(torch.ones(KV_LORA))
        self.scale = self.q_head ** -0.5
        _init(self)

    @staticmethod
    def _hi(x):
        return x.to(torch.promote_types(x.dtype, torch.float32))

    def _rms_norm(self, x, weight, eps=EPS):
        xf = self._hi(x)
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (weight.to(xf.dtype) * normed).to(x.dtype)

    def _mla(self, hidden_states):
        b, s, _ = hidden_states.shape
        q = self._rms_norm(self.q_a_proj(hidden_states), self.q_a_layernorm)
        q = self.q_b_proj(q).view(b, s, N_HEADS, self.q_head).transpose(1, 2)
        k_pass, k_rot = torch.split(self.kv_a_proj_with_mqa(hidden_states), [KV_LORA, ROPE], dim=-1)
        k_pass = self._rms_norm(k_pass, self.kv_a_layernorm)
        k_pass = self.kv_b_proj(k_pass).view(b, s, N_HEADS, NOPE + V_DIM).transpose(1, 2)
        k_pass, value = torch.split(k_pass, [NOPE, V_DIM], dim=-1)
        k_rot = k_rot.view(b, 1, s, ROPE).expand(*k_pass.shape[:-1], -1)
        key = torch.cat((k_pass, k_rot), dim=-1)
        pad = self.q_head - V_DIM
        attn = F.scaled_dot_product_attention(q, key, F.pad(value, (0, pad)), is_causal=True,
                                              scale=self.scale)[..., :V_DIM]
        out = self._hi(attn.transpose(1, 2).reshape(b, s, N_HEADS * V_DIM))
        out = out * torch.sigmoid(self._hi(self.g_proj(hidden_states)))
        return self.o_proj(out.to(self.o_proj.weight.dtype))

    def forward(self, hidden_states):
        return self._mla(hidden_states.transpose(0, 1).contiguous()).transpose(0, 1).contiguous()


class HFDots1QKNorm(nn.Module):
    """transformers' dots1 attention (Qwen3's): per-head HF RMSNorms of two projections of
    one hidden state, ``q_norm(q_proj(x).view(b, s, heads, d))`` and
    ``k_norm(k_proj(x).view(b, s, kv_heads, d))``, both over the head dim -- no latent, no
    slice of a kv projection: not an MLA pair. The q/kv pass fuses them into one
    ``dual_rms_norm`` launch by design (two norms at column 0 of two projections of the same
    input: the same op, each with its own weight and width), and the output is eager's. GQA
    repeat, causal attention in fp32 softmax. Views name their head counts for the public
    ``-1`` (a view of zero tokens cannot infer it)."""

    heads, kv_heads, head_dim = 4, 2, 16

    def __init__(self) -> None:
        super().__init__()
        d = self.head_dim
        self.q_proj = nn.Linear(H, self.heads * d, bias=False)
        self.k_proj = nn.Linear(H, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(H, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, H, bias=False)
        self.q_norm = HFRMSNorm(d)
        self.k_norm = HFRMSNorm(d)
        _init(self)

    def forward(self, hidden_states):
        input_shape, d = hidden_states.shape[:-1], self.head_dim
        q = self.q_norm(self.q_proj(hidden_states).view(*input_shape, self.heads, d))
        q = q.transpose(1, 2)
        k = self.k_norm(self.k_proj(hidden_states).view(*input_shape, self.kv_heads, d))
        k = k.transpose(1, 2)
        v = self.v_proj(hidden_states).view(*input_shape, self.kv_heads, d).transpose(1, 2)
        k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
        v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        s = hidden_states.shape[1]
        attn = torch.matmul(q, k.transpose(2, 3)) * d ** -0.5
        attn = attn + torch.triu(torch.full((s, s), float("-inf"), dtype=attn.dtype,
                                             device=attn.device), 1)
        attn = torch.softmax(attn, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(attn, v).transpose(1, 2).contiguous()
        return self.o_proj(out.reshape(*input_shape, self.heads * d))


class _BridgeRMSNorm(nn.Module):
    """Megatron-Bridge's ``KimiRMSNorm``: upcast, ``square().mean``, rsqrt, cast back, then
    the weight (model dtype)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        y = x.float()
        y = y * torch.rsqrt(y.square().mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * y.to(dtype)


class MegatronBridgeK3MLA(nn.Module):
    """Megatron-Bridge's Kimi K3 ``KimiK3Attention._forward_mla`` (tp = 1, no sequence
    parallel): the sequence-first ``[S, B, H]`` hidden state used as it is (no transpose);
    every projection an ``(out, bias)`` Linear read through a ``_linear`` helper that
    unpacks it (and refuses a bias); ``KimiRMSNorm`` norms (``square().mean``, eps 1e-5);
    the q latent up-projected before the kv projection runs; ``torch.split`` of the kv
    projection; NoPE (the rope-sized slice joins the key unrotated,
    ``unsqueeze(-2).expand``); ``value.contiguous()``; a causal attention stand-in for
    ``TEDotProductAttention`` on ``sbhd``; a full-rank sigmoid output gate."""

    def __init__(self) -> None:
        super().__init__()
        self.q_head = NOPE + ROPE
        self.q_a_proj = _TupleLinear(H, Q_LORA, bias=False)
        self.q_a_layernorm = _BridgeRMSNorm(Q_LORA)
        self.q_b_proj = _TupleLinear(Q_LORA, N_HEADS * self.q_head, bias=False)
        self.kv_a_proj_with_mqa = _TupleLinear(H, KV_LORA + ROPE, bias=False)
        self.kv_a_layernorm = _BridgeRMSNorm(KV_LORA)
        self.kv_b_proj = _TupleLinear(KV_LORA, N_HEADS * (NOPE + V_DIM), bias=False)
        self.g_proj = _TupleLinear(H, N_HEADS * V_DIM, bias=False)
        self.o_proj = _TupleLinear(N_HEADS * V_DIM, H, bias=False)
        _init(self)

    @staticmethod
    def _linear(module, x):
        out, bias = module(x)
        if bias is not None:
            raise ValueError("bias-free projections only")
        return out

    def _core_attention(self, q, k, v):  # [S, B, h, d] in, [S, B, h * dv] out
        s = q.shape[0]
        scores = torch.einsum("sbhd,tbhd->bhst", q, k) * self.q_head ** -0.5
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        probs = scores.masked_fill(mask, float("-inf")).softmax(-1, dtype=torch.float32)
        out = torch.einsum("bhst,tbhd->sbhd", probs.to(v.dtype), v)
        return out.reshape(s, q.shape[1], N_HEADS * V_DIM)

    def forward(self, x):
        query = self._linear(self.q_b_proj, self.q_a_layernorm(self._linear(self.q_a_proj, x)))
        query = query.view(*query.shape[:-1], N_HEADS, self.q_head)
        compressed_kv = self._linear(self.kv_a_proj_with_mqa, x)
        kv_latent, key_extra = torch.split(compressed_kv, [KV_LORA, ROPE], dim=-1)
        key_value = self._linear(self.kv_b_proj, self.kv_a_layernorm(kv_latent))
        key_value = key_value.view(*key_value.shape[:-1], N_HEADS, NOPE + V_DIM)
        key_nope, value = torch.split(key_value, [NOPE, V_DIM], dim=-1)
        value = value.contiguous()
        key_extra = key_extra.unsqueeze(-2).expand(*key_nope.shape[:-1], -1)
        key = torch.cat((key_nope, key_extra), dim=-1)
        out = self._core_attention(query, key, value)
        out = out * torch.sigmoid(self._linear(self.g_proj, x))
        return self._linear(self.o_proj, out)


class _TuneRMSNorm(nn.Module):
    """torchtune's ``RMSNorm``: the weight named ``scale``; fp32 normalize, ``.type_as(x)``,
    then ``* scale``."""

    def __init__(self, dim: int, eps: float = EPS) -> None:
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x_fp32 = x.float()
        normed = (x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)
        return normed * self.scale


class _TuneLatentLinear(nn.Module):
    """torchtune's ``DeepSeekV3LatentLinear``: ``a`` down, the norm, ``b`` up in one module;
    with a rope width, ``a``'s output is split, the rope part returned as ``[b, 1, s, r]``."""

    def __init__(self, in_dim: int, out_dim: int, rank: int, rope: int = 0) -> None:
        super().__init__()
        self.rank, self.rope = rank, rope
        self.a = nn.Linear(in_dim, rank + rope, bias=False)
        self.b = nn.Linear(rank, out_dim, bias=False)
        self.norm = _TuneRMSNorm(rank)

    def forward(self, x):
        b, s, _ = x.shape
        out = self.a(x)
        if self.rope:
            out, rope_out = torch.split(out, [self.rank, self.rope], dim=-1)
            rope_out = rope_out.view(b, s, 1, self.rope).transpose(1, 2)
            return self.b(self.norm(out)), rope_out
        return self.b(self.norm(out))


class TorchtuneLatentLinear(nn.Module):
    """torchtune's DeepSeek-V3 attention (pull request 2764): the q and kv latents
    each inside a ``DeepSeekV3LatentLinear`` (``q_proj.norm``, ``kv_proj.norm``: the norm
    between its own ``a`` and ``b``), torchtune norms (weight ``scale``, ``type_as`` then
    ``* scale``); q viewed into heads and transposed, split; the kv up-projection viewed,
    transposed, split into ``k_nope`` and ``value``; rotate-half rope on ``[b, h, s, r]``;
    q and k assembled by slice assignment into ``new_empty`` buffers; SDPA with the MLA
    scale. ``q_lora = False``: ``q_proj`` a plain Linear (``q_lora_rank`` None), the kv norm
    alone -- nothing to pair."""

    q_lora = True

    def __init__(self) -> None:
        super().__init__()
        self.q_head = NOPE + ROPE
        if self.q_lora:
            self.q_proj = _TuneLatentLinear(H, N_HEADS * self.q_head, Q_LORA)
        else:
            self.q_proj = nn.Linear(H, N_HEADS * self.q_head, bias=False)
        self.kv_proj = _TuneLatentLinear(H, N_HEADS * (NOPE + V_DIM), KV_LORA, rope=ROPE)
        self.output_proj = nn.Linear(N_HEADS * V_DIM, H, bias=False)
        _init(self)
        inv = 1.0 / (10000 ** (torch.arange(0, ROPE, 2).float() / ROPE))
        freqs = torch.outer(torch.arange(MAX_SEQ).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def _rope(self, x):  # [b, h, s, r]
        s = x.shape[2]
        cos, sin = self.cos[:s].to(x.dtype), self.sin[:s].to(x.dtype)
        x1, x2 = x[..., : ROPE // 2], x[..., ROPE // 2:]
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, N_HEADS, self.q_head).transpose(1, 2)
        q_nope, q_pe = torch.split(q, [NOPE, ROPE], dim=-1)
        kv, k_pe = self.kv_proj(x)
        kv = kv.view(b, s, N_HEADS, NOPE + V_DIM).transpose(1, 2)
        k_nope, value = torch.split(kv, [NOPE, V_DIM], dim=-1)
        q_pe, k_pe = self._rope(q_pe), self._rope(k_pe)
        query = k_pe.new_empty(b, N_HEADS, s, self.q_head)
        query[:, :, :, :NOPE] = q_nope
        query[:, :, :, NOPE:] = q_pe
        key = k_pe.new_empty(b, N_HEADS, s, self.q_head)
        key[:, :, :, :NOPE] = k_nope
        key[:, :, :, NOPE:] = k_pe
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True,
                                             scale=self.q_head ** -0.5)
        return self.output_proj(out.transpose(1, 2).contiguous().view(b, s, N_HEADS * V_DIM))


class TorchtuneNoQLora(TorchtuneLatentLinear):
    q_lora = False


class AutomodelDSparkK3Attention(nn.Module):
    """NeMo AutoModel's Kimi K3 DSpark draft attention (``KimiK3DSparkAttention``): the
    queries from the noise block ``hidden_states`` ``[B, T, H]``, the keys and values from
    ``torch.cat([target_hidden_states, hidden_states], dim=1)`` (the frozen target context
    before the block): ``q_a_layernorm`` normalizes T rows a batch, ``kv_a_layernorm`` 2T
    (the context is T long here). HF-style norms eps 1e-5 (the draft creates its norm
    weights in fp32; here all parameters follow the model dtype); NoPE
    (``k_rot.view(b, 1, s, r)`` expanded onto the heads); eager attention with an fp32
    softmax, no mask (the block sees the whole context and itself); sigmoid gate. The
    latents are projections of two different activations: the pass pairs norms of one
    source only (docs/design-notes.md, "patterns/qkv_rmsnorm.py"), so nothing fuses --
    though ``dual_rms_norm``, whose sides have their own row counts, could take the two."""

    def __init__(self) -> None:
        super().__init__()
        self.q_head = NOPE + ROPE
        self.q_a_proj = nn.Linear(H, Q_LORA, bias=False)
        self.q_a_layernorm = HFRMSNorm(Q_LORA, eps=1e-5)
        self.q_b_proj = nn.Linear(Q_LORA, N_HEADS * self.q_head, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, KV_LORA + ROPE, bias=False)
        self.kv_a_layernorm = HFRMSNorm(KV_LORA, eps=1e-5)
        self.kv_b_proj = nn.Linear(KV_LORA, N_HEADS * (NOPE + V_DIM), bias=False)
        self.g_proj = nn.Linear(H, N_HEADS * V_DIM, bias=False)
        self.o_proj = nn.Linear(N_HEADS * V_DIM, H, bias=False)
        _init(self)

    def forward(self, hidden_states, target_hidden_states):
        b, s = hidden_states.shape[:-1]
        kv_states = torch.cat([target_hidden_states, hidden_states], dim=1)
        kv_len = kv_states.shape[1]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(b, s, N_HEADS, self.q_head).transpose(1, 2)
        k, k_rot = torch.split(self.kv_a_proj_with_mqa(kv_states), [KV_LORA, ROPE], dim=-1)
        k = self.kv_b_proj(self.kv_a_layernorm(k))
        k = k.view(b, kv_len, N_HEADS, NOPE + V_DIM).transpose(1, 2)
        k, v = torch.split(k, [NOPE, V_DIM], dim=-1)
        k_rot = k_rot.view(b, 1, kv_len, ROPE).expand(*k.shape[:-1], -1)
        k = torch.cat([k, k_rot], dim=-1)
        attn = torch.matmul(q, k.transpose(2, 3)) * self.q_head ** -0.5
        attn = F.softmax(attn, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(attn, v).transpose(1, 2).contiguous().reshape(b, s, N_HEADS * V_DIM)
        return self.o_proj(out * self.g_proj(hidden_states).sigmoid())


class _AddRMSNorm(HFRMSNorm):
    """vLLM's ``RMSNorm.forward_native`` with a residual: ``x + residual`` (the new
    residual), then the norm."""

    def forward(self, x, residual=None):
        if residual is None:
            return super().forward(x)
        x = x + residual
        return super().forward(x), x


class VllmDeepseekMTP(nn.Module):
    """vLLM's ``DeepSeekMultiTokenPredictorLayer``: the next tokens' embeddings (a fresh
    tensor, as ``embed_tokens`` gives) zeroed where ``positions == 0`` by a boolean-mask
    write, ``enorm`` of them and ``hnorm`` of the previous hidden state, ``eh_proj`` of
    their ``cat``; then the ``mtp_block`` (``DeepseekV2DecoderLayer``): ``input_layernorm``
    (residual None: the input is the residual), vLLM's MLA wrapper (one fused
    ``q_a + kv_a`` projection split, the q norm and ``q_b_proj`` before the kv latent is
    split again; rotate-half rope; a causal attention stand-in for the MLA backend),
    ``post_attention_layernorm`` with the residual add fused (``forward_native``), a dense
    SiLU MLP for the MoE; ``residual + hidden``. ``enorm`` reads the masked copy, no graph
    input, so it shares no source with ``hnorm``: the q/kv latents are the one pair."""

    def __init__(self) -> None:
        super().__init__()
        self.q_head = NOPE + ROPE
        self.enorm, self.hnorm = HFRMSNorm(H), HFRMSNorm(H)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.input_layernorm = _AddRMSNorm(H)
        self.fused_qkv_a_proj = nn.Linear(H, Q_LORA + KV_LORA + ROPE, bias=False)
        self.q_a_layernorm = HFRMSNorm(Q_LORA)
        self.q_b_proj = nn.Linear(Q_LORA, N_HEADS * self.q_head, bias=False)
        self.kv_a_layernorm = HFRMSNorm(KV_LORA)
        self.kv_b_proj = nn.Linear(KV_LORA, N_HEADS * (NOPE + V_DIM), bias=False)
        self.o_proj = nn.Linear(N_HEADS * V_DIM, H, bias=False)
        self.post_attention_layernorm = _AddRMSNorm(H)
        self.gate_up_proj = nn.Linear(H, 4 * H, bias=False)
        self.down_proj = nn.Linear(2 * H, H, bias=False)
        _init(self)
        inv = 1.0 / (10000 ** (torch.arange(0, ROPE, 2).float() / ROPE))
        freqs = torch.outer(torch.arange(MAX_SEQ).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def _rope(self, x):  # [B, T, heads, r]
        cos = self.cos[: x.shape[1], None, :].to(x.dtype)
        sin = self.sin[: x.shape[1], None, :].to(x.dtype)
        return x * cos + torch.cat((-x[..., ROPE // 2:], x[..., : ROPE // 2]), dim=-1) * sin

    def _mla(self, h):
        b, t, _ = h.shape
        q_c, kv_lora = self.fused_qkv_a_proj(h).split([Q_LORA, KV_LORA + ROPE], dim=-1)
        q = self.q_b_proj(self.q_a_layernorm(q_c)).view(b, t, N_HEADS, self.q_head)
        kv_c, k_pe = kv_lora.split([KV_LORA, ROPE], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(kv_c)).view(b, t, N_HEADS, NOPE + V_DIM)
        q_nope, q_pe = q.split([NOPE, ROPE], dim=-1)
        k_nope, v = kv.split([NOPE, V_DIM], dim=-1)
        q = torch.cat((q_nope, self._rope(q_pe)), dim=-1)
        k_pe = self._rope(k_pe.unsqueeze(2)).expand(-1, -1, N_HEADS, -1)
        k = torch.cat((k_nope, k_pe), dim=-1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True,
                                             scale=self.q_head ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, N_HEADS * V_DIM))

    def forward(self, previous_hidden_states, inputs_embeds):
        b, t, _ = inputs_embeds.shape
        positions = torch.arange(t, device=inputs_embeds.device).expand(b, t)
        inputs_embeds = inputs_embeds.clone()  # embed_tokens' fresh output
        inputs_embeds[positions == 0] = 0
        inputs_embeds = self.enorm(inputs_embeds)
        previous_hidden_states = self.hnorm(previous_hidden_states)
        hidden_states = self.eh_proj(torch.cat([inputs_embeds, previous_hidden_states], dim=-1))
        residual = hidden_states
        hidden_states = self._mla(self.input_layernorm(hidden_states))
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        gate, up = self.gate_up_proj(hidden_states).chunk(2, dim=-1)
        hidden_states = self.down_proj(F.silu(gate) * up)
        return residual + hidden_states


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


class MegatronBridgeK3Tail(_Tail):
    """Megatron-Bridge's Kimi K3 ``KimiK3MoELayer.postprocess`` (tp = 1): the shared
    experts' output computed first (MCore runs them before the routed path); the combined
    routed latent through ``combine_postprocess`` (a view back to token rows here),
    ``KimiRMSNorm`` (``square().mean``, eps 1e-5), the ``(out, bias)`` ``fc2_latent_proj``
    unpacked, then ``output + shared_expert_output``."""

    def __init__(self) -> None:
        super().__init__(_BridgeRMSNorm(LATENT))
        self.fc2_latent_proj = _TupleLinear(LATENT, H, bias=False)
        del self.routed_expert_up_proj
        _init(self)

    def forward(self, latent, h, prefix):
        shared_expert_output = self.shared_experts(h)
        output = latent.view(-1, LATENT)  # combine_postprocess stand-in
        output = self.routed_expert_norm(output)
        output, _ = self.fc2_latent_proj(output)
        return output + shared_expert_output


class TorchtitanK3LatentMoE(nn.Module):
    """torchtitan's Kimi K3 ``KimiLatentMoE`` (pull request 4025) on packed ``[T, H]``
    tokens, the whole layer: a sigmoid router with a selection bias (top-2 of 4),
    ``routed_down`` into the latent, the routed experts (SwiGLU for K3's SiTU, in the
    latent; grouped GEMMs made dense: every expert on every token, weight 0 where
    unrouted), ``routed_up(routed_norm(routed))`` with ``routed_norm`` a
    ``torch.nn.RMSNorm`` (eps 1e-5), the shared expert computed *after* it and added.
    (``nn.RMSNorm`` makes a ``dynamic=True`` compile restart Dynamo's analysis, as in
    ``megatron_core_mla`` and ``torchtitan_deepseek_v3``.)"""

    experts, topk, inter = 4, 2, 24

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(H, self.experts, bias=False)
        self.expert_bias = nn.Parameter(torch.zeros(self.experts))
        self.routed_down = nn.Linear(H, LATENT, bias=False)
        self.w1 = nn.ModuleList(nn.Linear(LATENT, self.inter, bias=False)
                                for _ in range(self.experts))
        self.w3 = nn.ModuleList(nn.Linear(LATENT, self.inter, bias=False)
                                for _ in range(self.experts))
        self.w2 = nn.ModuleList(nn.Linear(self.inter, LATENT, bias=False)
                                for _ in range(self.experts))
        self.routed_norm = nn.RMSNorm(LATENT, eps=1e-5)
        self.routed_up = nn.Linear(LATENT, H, bias=False)
        self.shared_w1 = nn.Linear(H, 2 * H, bias=False)
        self.shared_w3 = nn.Linear(H, 2 * H, bias=False)
        self.shared_w2 = nn.Linear(2 * H, H, bias=False)
        _init(self)

    def forward(self, x):
        scores = torch.sigmoid(self.router(x).float())
        idx = (scores + self.expert_bias.float()).topk(self.topk, dim=-1)[1]
        w = scores.gather(-1, idx)
        w = w / w.sum(-1, keepdim=True)
        latent = self.routed_down(x)
        routed = torch.zeros_like(latent)
        for e in range(self.experts):
            gate = (w * (idx == e)).sum(-1, keepdim=True).to(latent.dtype)
            routed = routed + gate * self.w2[e](F.silu(self.w1[e](latent)) * self.w3[e](latent))
        out = self.routed_up(self.routed_norm(routed))
        return out + self.shared_w2(F.silu(self.shared_w1(x)) * self.shared_w3(x))


class MegatronBridgeGemma4PostNorm(_Tail):
    """Megatron-Bridge's Gemma 4 ``Gemma4MoELayer.postprocess`` with ``moe_latent_size``
    set: ``fc2_latent_proj`` first, *then* a norm of its output (``post_moe_layernorm``),
    added to a norm of the shared output (``post_shared_expert_layernorm``); TENorm as a
    plain HF-style RMSNorm. The norm after the up-projection: another function, nothing
    to fuse."""

    def __init__(self) -> None:
        super().__init__(None)
        self.fc2_latent_proj = _TupleLinear(LATENT, H, bias=False)
        self.post_moe_layernorm = HFRMSNorm(H)
        self.post_shared_expert_layernorm = HFRMSNorm(H)
        del self.routed_expert_up_proj
        _init(self)

    def forward(self, latent, h, prefix):
        output, _ = self.fc2_latent_proj(latent)
        output = self.post_moe_layernorm(output)
        return output + self.post_shared_expert_layernorm(self.shared_experts(h))


def _situ(x, beta: float = 4.0, linear_beta: float = 25.0):
    """K3's SiTU on a ``[..., 2 * F]`` gate/up projection, in fp32, one cast back."""
    gate, up = x.chunk(2, dim=-1)
    gate, up = gate.float(), up.float()
    act = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
    return (act * (linear_beta * torch.tanh(up / linear_beta))).to(x.dtype)


class AutomodelK3MoE(nn.Module):
    """NeMo AutoModel's Kimi K3 ``KimiK3MoE`` (inference, no expert parallelism), the whole
    layer on ``[B, S, H]``: ``reshape(-1, H)``; an fp32 sigmoid router with a correction
    bias, top-2 of 4; ``routed_expert_down_proj`` into the latent; the experts (SiTU, in
    the latent) made dense, each token's top-k outputs gathered, weighted in fp32
    (``.type(fp32).mul_(w).sum(1).type(dtype)``); ``routed_expert_norm`` (HF-style) and
    ``routed_expert_up_proj``; the SiTU shared expert (``cat`` of gate and up) added; the
    sum viewed back to ``[B, S, H]``."""

    experts, topk, inter = 4, 2, 24

    def __init__(self) -> None:
        super().__init__()
        self.gate_weight = nn.Parameter(torch.ones(self.experts, H))
        self.correction_bias = nn.Parameter(torch.zeros(self.experts))
        self.routed_expert_down_proj = nn.Linear(H, LATENT, bias=False)
        self.gate_and_up_projs = nn.Parameter(torch.ones(self.experts, LATENT, 2 * self.inter))
        self.down_projs = nn.Parameter(torch.ones(self.experts, self.inter, LATENT))
        self.routed_expert_norm = HFRMSNorm(LATENT, eps=1e-5)
        self.routed_expert_up_proj = nn.Linear(LATENT, H, bias=False)
        self.shared_gate_proj = nn.Linear(H, 2 * H, bias=False)
        self.shared_up_proj = nn.Linear(H, 2 * H, bias=False)
        self.shared_down_proj = nn.Linear(2 * H, H, bias=False)
        _init(self)

    def forward(self, hidden_states):
        shape = hidden_states.shape
        identity = hidden_states.reshape(-1, shape[-1])
        scores = F.linear(identity.float(), self.gate_weight.float()).sigmoid()
        idx = (scores + self.correction_bias.float().unsqueeze(0)).topk(self.topk, dim=-1)[1]
        w = scores.gather(1, idx)
        w = w / w.sum(dim=-1, keepdim=True)
        x = self.routed_expert_down_proj(identity)
        outs = torch.stack([_situ(x @ self.gate_and_up_projs[e]) @ self.down_projs[e]
                            for e in range(self.experts)], dim=1)  # [T, E, L]
        picked = outs.gather(1, idx.unsqueeze(-1).expand(-1, -1, LATENT))  # [T, K, L]
        routed = picked.type(w.dtype).mul_(w.unsqueeze(-1)).sum(dim=1).type(x.dtype)
        output = self.routed_expert_up_proj(self.routed_expert_norm(routed))
        shared = torch.cat((self.shared_gate_proj(identity), self.shared_up_proj(identity)), dim=-1)
        output = output + self.shared_down_proj(_situ(shared))
        return output.view(shape)


class _V4Norm(nn.Module):
    """DeepSeek-V4 inference's ``RMSNorm``: an fp32 weight (kept fp32 in any model dtype),
    ``square().mean``, ``rsqrt``, ``weight * x`` in fp32, one cast back."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + EPS)
        return (self.weight * xf).to(dtype)


class AnshlerV4MTP(nn.Module):
    """deepseek-v4-with-attention-residuals' ``MTPBlock`` (its Block AttnRes version):
    ``e_proj(enorm(embed(ids))) + h_proj(hnorm(h))`` -- a projection of an RMSNorm plus
    another projection's output, the MoE tail op's function exactly -- then one ``Block``
    from ``blocks=[]``, ``partial=merged``: an AttnRes read over the merge alone, the MLA
    front ``q_norm(wq_a(x))`` / ``kv_norm(wkv(x))`` (the kv norm on the *whole* ``wkv``
    output, the rope its last columns), a per-head unweighted in-place rsqrt of
    ``wq_b(q)``, complex rope written back in place (``copy_``) into the norms' outputs,
    attention, a read over the partial, the MoE; the head. V4 norms (fp32 weights kept fp32,
    applied in fp32, one cast). Stand-ins, as in the survey: dense causal attention with an
    attention sink for ``sparse_attn``, the top-k MoE made dense (every expert on every
    token, weight 0 where unrouted), no fp8 ``act_quant``. The compiled call takes the next
    tokens' *embeddings* (``embed`` is the main model's, shared): ids cannot go through the
    catalogue's dtype casts; the head reads every position (the public one the last: a
    catalogue entry compiles at zero tokens); the block's sublayer counter is unrolled. A
    correct pass fuses the merge as a tail (``hnorm`` into ``h_proj``, the ``e_proj``
    output the added term) and pairs ``q_norm`` with ``kv_norm``; the reads over one source
    are no contraction."""

    heads, head_dim, o_groups, o_lora = 2, KV_LORA, 2, 24
    experts, topk, inter, vocab = 4, 2, 48, 40

    def __init__(self) -> None:
        super().__init__()
        d, n = self.head_dim, self.heads
        self.enorm, self.hnorm, self.norm = _V4Norm(H), _V4Norm(H), _V4Norm(H)
        self.e_proj = nn.Linear(H, H, bias=False)
        self.h_proj = nn.Linear(H, H, bias=False)
        # the block: AttnRes reads, attention, MoE
        self.attn_res_proj = nn.Parameter(torch.zeros(H))
        self.mlp_res_proj = nn.Parameter(torch.zeros(H))
        self.attn_res_norm, self.mlp_res_norm = _V4Norm(H), _V4Norm(H)
        self.attn_norm, self.ffn_norm = _V4Norm(H), _V4Norm(H)
        self.attn_sink = nn.Parameter(torch.zeros(n))
        self.wq_a = nn.Linear(H, Q_LORA, bias=False)
        self.q_norm = _V4Norm(Q_LORA)
        self.wq_b = nn.Linear(Q_LORA, n * d, bias=False)
        self.wkv = nn.Linear(H, d, bias=False)
        self.kv_norm = _V4Norm(d)
        self.wo_a = nn.Linear(n * d // self.o_groups, self.o_groups * self.o_lora, bias=False)
        self.wo_b = nn.Linear(self.o_groups * self.o_lora, H, bias=False)
        self.gate_w = nn.Parameter(torch.ones(self.experts, H))
        self.gate_bias = nn.Parameter(torch.zeros(self.experts))
        n_mlp = self.experts + 1  # the routed experts, then the shared one
        self.w1 = nn.ModuleList(nn.Linear(H, self.inter, bias=False) for _ in range(n_mlp))
        self.w3 = nn.ModuleList(nn.Linear(H, self.inter, bias=False) for _ in range(n_mlp))
        self.w2 = nn.ModuleList(nn.Linear(self.inter, H, bias=False) for _ in range(n_mlp))
        self.head = nn.Parameter(torch.ones(self.vocab, H))
        _init(self)
        self.freqs_cis = _complex_freqs(ROPE)  # a plain attribute: complex64 in any dtype

    def _apply(self, fn, recurse=True):  # fp32 masters: norm weights, the sink, gate bias, head
        names = [n for n, _ in self.named_parameters()
                 if n.endswith("norm.weight") or n in ("attn_sink", "gate_bias", "head")]
        return _keep_fp32(super()._apply(fn, recurse), *names)

    def _depth_mix(self, sources, q, norm):
        V = torch.stack(sources, dim=2)  # [b, s, N, d]
        logits = torch.einsum("d,bsnd->bsn", q.float(), norm(V).float()) * H ** -0.5
        p = F.softmax(logits, dim=-1)
        return torch.einsum("bsn,bsnd->bsd", p, V.float()).to(sources[0].dtype)

    @staticmethod
    def _rope_(x, freqs, inverse=False):  # rotate pairs as complex numbers, written back into x
        c = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
        f = freqs.conj() if inverse else freqs
        f = f.view(1, c.size(1), c.size(-1)) if c.ndim == 3 else f.view(1, c.size(1), 1, c.size(-1))
        x.copy_(torch.view_as_real(c * f).flatten(-2))

    def _attention(self, x):
        b, s, _ = x.shape
        n, d, f = self.heads, self.head_dim, self.freqs_cis[:s]
        q = self.wq_b(self.q_norm(self.wq_a(x))).unflatten(-1, (n, d))
        q *= torch.rsqrt(q.square().mean(-1, keepdim=True) + EPS)
        self._rope_(q[..., -ROPE:], f)
        kv = self.kv_norm(self.wkv(x))
        self._rope_(kv[..., -ROPE:], f)
        # sparse_attn stand-in: dense causal attention with a sink
        logits = torch.einsum("bshd,btd->bsht", q.float(), kv.float()) * d ** -0.5
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        logits = logits.masked_fill(mask[None, :, None, :], float("-inf"))
        sink = self.attn_sink.view(1, 1, n, 1).expand(b, s, n, 1)
        p = torch.cat([logits, sink], dim=-1).softmax(-1)[..., :-1]
        o = torch.einsum("bsht,btd->bshd", p, kv.float()).to(q.dtype)
        self._rope_(o[..., -ROPE:], f, inverse=True)
        o = o.view(b, s, self.o_groups, n * d // self.o_groups)
        o = torch.einsum("bsgd,grd->bsgr", o, self.wo_a.weight.view(self.o_groups, self.o_lora, -1))
        return self.wo_b(o.flatten(2))

    def _expert(self, i, x, weights=None):
        dtype = x.dtype
        g, u = self.w1[i](x).float(), self.w3[i](x).float()
        a = F.silu(g) * u
        if weights is not None:
            a = weights * a
        return self.w2[i](a.to(dtype))

    def _moe(self, x):
        shape = x.shape
        x = x.view(-1, H)
        raw = F.softplus(F.linear(x.float(), self.gate_w.float())).sqrt()
        idx = (raw + self.gate_bias).topk(self.topk, dim=-1)[1]
        w = raw.gather(1, idx)
        w /= w.sum(dim=-1, keepdim=True)
        y = torch.zeros_like(x, dtype=torch.float32)
        for e in range(self.experts):  # the routed loop made dense
            y += self._expert(e, x, (w * (idx == e)).sum(-1, keepdim=True))
        y += self._expert(self.experts, x)  # the shared expert
        return y.type_as(x).view(shape)

    def forward(self, h, e):
        e, x = self.enorm(e), self.hnorm(h)
        merged = self.e_proj(e) + self.h_proj(x)
        a_in = self._depth_mix([merged], self.attn_res_proj, self.attn_res_norm)
        partial = merged + self._attention(self.attn_norm(a_in))
        f_in = self._depth_mix([partial], self.mlp_res_proj, self.mlp_res_norm)
        partial = partial + self._moe(self.ffn_norm(f_in))
        return F.linear(self.norm(partial).float(), self.head)


# =============================================================== transformers' Kimi K3
#
# huggingface/transformers ``src/transformers/models/kimi_k3/modular_kimi_k3.py`` (the
# only Kimi K3 file stored at that commit: no generated ``modeling_kimi_k3.py`` or
# configuration to read; the model class and its loop over the layers are not in it).
# The norms are ``KimiK3RMSNorm`` = ``LlamaRMSNorm`` (``HFRMSNorm``).

HF_K3_EXPERTS, HF_K3_TOPK, HF_K3_INTER, HF_K3_SHARED = 4, 2, 24, 48
HF_K3_SITU_BETA, HF_K3_SITU_LINEAR_BETA = 4.0, 25.0


def _hf_k3_situ_and_mul(gate, up, beta=HF_K3_SITU_BETA, linear_beta=HF_K3_SITU_LINEAR_BETA):
    """``situ_and_mul``: both halves upcast, ``up`` squashed first, one cast back."""
    original_dtype = gate.dtype
    gate = gate.to(torch.float32)
    up = up.to(torch.float32)
    if linear_beta is not None:
        up = linear_beta * torch.tanh(up / linear_beta)
    out = beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * up
    return out.to(original_dtype)


class _HFK3MLP(nn.Module):
    """``KimiK3MLP``: SiTU gate/up/down (the dense layers' MLP and the shared expert)."""

    def __init__(self, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(H, intermediate_size, bias=False)
        self.up_proj = nn.Linear(H, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, H, bias=False)

    def forward(self, x):
        return self.down_proj(_hf_k3_situ_and_mul(self.gate_proj(x), self.up_proj(x)))


class HFKimiK3GatedMLA(nn.Module):
    """transformers' ``KimiK3GatedMLA`` on ``[B, S, H]``: ``q_b_proj(q_a_layernorm(q_a_proj(h)))``
    viewed and transposed before the kv projection runs; ``torch.split`` of
    ``kv_a_proj_with_mqa`` into the kv latent and the shared (un-rotated) key slice; both
    norms ``KimiK3RMSNorm`` with the default eps 1e-6 (``config.rms_norm_eps`` is not
    passed); ``expand_kv`` (``kv_b_proj``, view, transpose, split, ``k_pe.expand``, cat);
    no rope; SDPA as transformers' ``sdpa_attention_forward`` calls it (causal when T > 1,
    no mask, V narrower than Q); a full-rank ``output_gate_proj(h).sigmoid()`` gate. The head
    sizes of the two head views and of the output reshape are written out where transformers
    writes ``-1`` (``view(b, s, -1, d)`` cannot infer it from 0 elements: transformers' own
    code raises on 0 tokens; at any other T the graphs are the same)."""

    def __init__(self) -> None:
        super().__init__()
        self.qk_nope_head_dim, self.k_shared_head_dim, self.v_head_dim = NOPE, ROPE, V_DIM
        self.qk_head_dim = NOPE + ROPE
        self.q_a_proj = nn.Linear(H, Q_LORA, bias=False)  # attention_bias False
        self.q_a_layernorm = HFRMSNorm(Q_LORA)
        self.q_b_proj = nn.Linear(Q_LORA, N_HEADS * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, KV_LORA + ROPE, bias=False)
        self.kv_a_layernorm = HFRMSNorm(KV_LORA)
        self.kv_b_proj = nn.Linear(KV_LORA, N_HEADS * (NOPE + V_DIM), bias=False)
        self.output_gate_proj = nn.Linear(H, N_HEADS * V_DIM, bias=False)
        self.o_proj = nn.Linear(N_HEADS * V_DIM, H, bias=False)
        self.scaling = self.qk_head_dim ** (-0.5)
        _init(self)

    def expand_kv(self, kv_nope, k_pe):
        batch_size, seq_length, _ = kv_nope.shape
        key_shape = (batch_size, seq_length, N_HEADS, self.qk_nope_head_dim + self.v_head_dim)
        kv_nope = self.kv_b_proj(kv_nope).view(key_shape).transpose(1, 2)
        kv_nope, value_states = torch.split(kv_nope, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k_pe = k_pe.expand(*kv_nope.shape[:-1], -1)
        key_states = torch.cat((kv_nope, k_pe), dim=-1)
        return key_states, value_states

    def _sdpa(self, query, key, value):  # transformers' sdpa_attention_forward, no mask
        is_causal = query.shape[2] > 1
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                             scale=self.scaling, is_causal=is_causal)
        return out.transpose(1, 2).contiguous()

    def forward(self, hidden_states):
        batch_size, seq_length = hidden_states.shape[:-1]
        query_shape = (batch_size, seq_length, N_HEADS, self.qk_head_dim)
        query_states = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        query_states = query_states.view(query_shape).transpose(1, 2)
        compressed_kv = self.kv_a_proj_with_mqa(hidden_states)
        kv_nope, k_shared = torch.split(compressed_kv, [KV_LORA, self.k_shared_head_dim], dim=-1)
        kv_nope = self.kv_a_layernorm(kv_nope)
        k_shared = k_shared.view(batch_size, 1, seq_length, self.k_shared_head_dim)
        key_states, value_states = self.expand_kv(kv_nope, k_shared)
        attn_output = self._sdpa(query_states, key_states, value_states)
        attn_output = attn_output.reshape(batch_size, seq_length, N_HEADS * V_DIM).contiguous()
        gate = self.output_gate_proj(hidden_states).sigmoid()
        attn_output = attn_output * gate
        return self.o_proj(attn_output)


class _HFK3TopkRouter(nn.Module):
    """``DeepseekV3TopkRouter`` (the three-output form ``KimiK3MoE`` unpacks): fp32 logits,
    sigmoid, the correction bias for the choice (one group: the group mask keeps every
    expert), ``gather``, normalized (+ 1e-20), scaled."""

    routed_scaling_factor = 2.5

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty((HF_K3_EXPERTS, H)))
        # A checkpoint's values, spread past the sigmoid's range: a token's expert choice
        # never flips between eager and a compiled graph (a flip is a large error in a few
        # elements that no fusion makes: the T 64 dynamic lowering test saw one on torch 2.11).
        self.register_buffer("e_score_correction_bias",
                             2.0 * torch.arange(HF_K3_EXPERTS, dtype=torch.float32))

    def forward(self, hidden_states):
        hidden_states = hidden_states.view(-1, H)
        router_logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))
        scores = router_logits.sigmoid()
        scores_for_choice = scores.view(-1, HF_K3_EXPERTS) + self.e_score_correction_bias.unsqueeze(0)
        topk_indices = torch.topk(scores_for_choice, k=HF_K3_TOPK, dim=-1, sorted=False)[1]
        topk_weights = scores.gather(1, topk_indices)
        denominator = topk_weights.sum(dim=-1, keepdim=True) + 1e-20
        topk_weights /= denominator
        topk_weights = topk_weights * self.routed_scaling_factor
        return router_logits, topk_weights, topk_indices


class _HFK3Experts(nn.Module):
    """``KimiK3Experts`` (``DeepseekV4Experts`` in the latent: ``[E, 2I, L]`` / ``[E, L, I]``)
    through transformers' ``batched_mm`` experts implementation (the compile-friendly one;
    the eager loop's ``nonzero`` breaks a full graph): tokens ``repeat_interleave``d,
    per-pair weights gathered, ``bmm``s, SiTU, the model-dtype output times the fp32 routing
    weight, ``view(T, k, L).sum(1)``, cast back."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts = HF_K3_EXPERTS
        self.gate_up_proj = nn.Parameter(torch.empty(HF_K3_EXPERTS, 2 * HF_K3_INTER, LATENT))
        self.down_proj = nn.Parameter(torch.empty(HF_K3_EXPERTS, LATENT, HF_K3_INTER))

    def _apply_gate(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return _hf_k3_situ_and_mul(gate, up)

    @staticmethod
    def _batched_linear(input, weight):
        return torch.bmm(weight, input.unsqueeze(-1)).squeeze(-1)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        num_top_k = top_k_index.size(-1)
        num_tokens = hidden_states.size(0)
        hidden_dim = hidden_states.size(-1)
        selected_hidden_states = hidden_states.repeat_interleave(num_top_k, dim=0)
        sample_weights = top_k_weights.reshape(-1)
        expert_ids = top_k_index.reshape(-1)
        expert_ids = expert_ids.clamp(0, self.num_experts - 1)
        proj_out = self._batched_linear(selected_hidden_states, self.gate_up_proj[expert_ids])
        proj_out = self._apply_gate(proj_out)
        proj_out = self._batched_linear(proj_out, self.down_proj[expert_ids])
        weighted_out = proj_out * sample_weights.unsqueeze(-1)
        final_hidden_states = weighted_out.view(num_tokens, num_top_k, hidden_dim).sum(dim=1)
        return final_hidden_states.to(hidden_states.dtype)


class HFKimiK3MoE(nn.Module):
    """transformers' ``KimiK3MoE`` on ``[B, S, H]``: the router on the hidden state,
    ``view(-1, H)``, ``routed_expert_down_proj`` into the latent, the experts there,
    ``routed_expert_norm`` (``KimiK3RMSNorm``, ``config.rms_norm_eps``), ``routed_expert_up_proj``,
    ``view(*orig_shape)`` *before* the shared expert's output (``KimiK3MLP`` of the unflattened
    hidden state) is added."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = _HFK3TopkRouter()
        self.experts = _HFK3Experts()
        self.shared_experts = _HFK3MLP(HF_K3_SHARED)
        self.routed_expert_down_proj = nn.Linear(H, LATENT, bias=False)
        self.routed_expert_norm = HFRMSNorm(LATENT, EPS)
        self.routed_expert_up_proj = nn.Linear(LATENT, H, bias=False)
        _init(self)

    def forward(self, hidden_states):
        residuals = hidden_states
        orig_shape = hidden_states.shape
        _, topk_weights, topk_indices = self.gate(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        hidden_states = self.routed_expert_down_proj(hidden_states)
        hidden_states = self.experts(hidden_states, topk_indices, topk_weights)
        hidden_states = self.routed_expert_norm(hidden_states)
        hidden_states = self.routed_expert_up_proj(hidden_states)
        hidden_states = hidden_states.view(*orig_shape)
        hidden_states = hidden_states + self.shared_experts(residuals)
        return hidden_states


class _HFK3AttentionResidual(nn.Module):
    """``KimiK3AttentionResidual``: ``cat((block_residual, h.view(-1, 1, H).float()), 1)``, the
    key norm (``KimiK3RMSNorm``) on the whole ``[T, N, H]`` stack, ``pseudo_queries``
    (``Linear(H, 1)``) -> ``[T, N, 1]``, ``transpose(1, 2).softmax(-1)``, ``matmul(probs,
    stack)``, ``squeeze(1)``, cast back, ``view(B, S, H)``. Both modules fp32
    (``_keep_in_fp32_modules_strict``)."""

    def __init__(self) -> None:
        super().__init__()
        self.pseudo_queries = nn.Linear(H, 1, bias=False)
        self.attn_residual_norm = HFRMSNorm(H, eps=EPS)

    def forward(self, hidden_states, block_residual):
        batch_size, seq_len, hidden_size = hidden_states.shape
        initial_dtype = hidden_states.dtype
        hidden_states = hidden_states.view(-1, 1, hidden_size)
        keys_or_values = torch.cat((block_residual, hidden_states.float()), dim=1)
        normalized_keys = self.attn_residual_norm(keys_or_values)
        scores = self.pseudo_queries(normalized_keys)
        probs = scores.transpose(1, 2).softmax(-1)
        hidden_states = torch.matmul(probs, keys_or_values)
        hidden_states = hidden_states.squeeze(1)
        return hidden_states.to(initial_dtype).view(batch_size, seq_len, hidden_size)


class _HFK3KDAStandIn(nn.Module):
    """Stands in for ``KimiK3DeltaAttention`` (a linear-attention layer: none of the three
    chains is inside it)."""

    def __init__(self) -> None:
        super().__init__()
        self.o_proj = nn.Linear(H, H, bias=False)

    def forward(self, hidden_states):
        return torch.tanh(self.o_proj(hidden_states))


class _HFK3DecoderLayer(nn.Module):
    """``KimiK3DecoderLayer``: the pre-attention AttnRes read when the bank is not empty; at
    a block start the layer's input (``residual``) appended to the fp32 bank
    (``residual.view(-1, 1, H).float()``) and not added after attention; the post-attention
    read always; ``input_layernorm`` / ``post_attention_layernorm`` on the reads' outputs;
    the MLP's output added to the residual taken before the post-attention read."""

    def __init__(self, layer_idx: int, attn: str, mlp: str, block_size: int) -> None:
        super().__init__()
        self.hidden_size = H
        self.self_attn = HFKimiK3GatedMLA() if attn == "full_attention" else _HFK3KDAStandIn()
        self.mlp = HFKimiK3MoE() if mlp == "sparse" else _HFK3MLP(2 * H)
        self.input_layernorm = HFRMSNorm(H, eps=EPS)
        self.post_attention_layernorm = HFRMSNorm(H, eps=EPS)
        self.is_start_of_residual_block = layer_idx % block_size == 0
        self.pre_attn_residual = _HFK3AttentionResidual()
        self.post_attn_residual = _HFK3AttentionResidual()

    def forward(self, hidden_states, block_residual):
        residual = hidden_states
        if block_residual.shape[1] > 0:
            hidden_states = self.pre_attn_residual(hidden_states, block_residual)
        if self.is_start_of_residual_block:
            block_residual = torch.cat([block_residual, residual.view(-1, 1, self.hidden_size).float()], dim=1)
            residual = None
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(hidden_states)
        if not self.is_start_of_residual_block:
            hidden_states = hidden_states + residual
        residual = hidden_states
        hidden_states = self.post_attn_residual(hidden_states, block_residual)
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = hidden_states + residual
        return hidden_states, block_residual


class HFKimiK3Decoder(nn.Module):
    """transformers' Kimi K3 decoder layers in order (``KimiK3DecoderLayer`` with the gated
    MLA, ``KimiK3MoE`` and ``KimiK3AttentionResidual`` above; KDA layers stood in for). The
    model's loop is not in the file at this commit: here an empty fp32 ``[T, 0, H]`` bank,
    the layers, the final norm; no read after the last layer (the file has none)."""

    layers, block = 4, 2
    layer_types = ("linear_attention", "full_attention")
    mlp_layer_types = ("dense", "sparse")

    def __init__(self) -> None:
        super().__init__()
        self.decoder_layers = nn.ModuleList(
            _HFK3DecoderLayer(i, self.layer_types[i % 2], self.mlp_layer_types[i % 2], self.block)
            for i in range(self.layers))
        self.norm = HFRMSNorm(H, eps=EPS)
        _init(self)

    def _apply(self, fn, recurse=True):  # _keep_in_fp32_modules_strict
        return _keep_fp32(super()._apply(fn, recurse), *(
            f"decoder_layers.{i}.{res}.{m}.weight" for i in range(self.layers)
            for res in ("pre_attn_residual", "post_attn_residual")
            for m in ("pseudo_queries", "attn_residual_norm")))

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        block_residual = hidden_states.new_zeros(b * s, 0, h, dtype=torch.float32)
        for layer in self.decoder_layers:
            hidden_states, block_residual = layer(hidden_states, block_residual)
        return self.norm(hidden_states)


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
                   "temperature whose value the compile cannot see, which the op does not take"),
          # torch 2.11 specializes the float (its value is in the graph: fused, exact);
          # 2.12 not checked
          dynamic_from=(2, 13)),
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
    Entry("limei_weight_first_norm", _src("limei1221/nanoAttnRes", "model.py",
                                          "2eb550584cc6765a9dfce6d2c098be4cdefa2729"),
          LimeiWeightFirstNorm, "key norm weight * x / sqrt(mean(x^2) + eps) in the model dtype, "
          "einsum with proj.weight[0], zeros_like partial at each block start, no final read",
          {ATTN: 7}, attn_res_blocks=[1, 1, 2, 2, 3, 3, 4]),
    Entry("zefan_two_queries_one_stack", _src("Zefan-Cai/open-attention-residuals",
                                              "Attention-Residuals/modeling_qwen3_attnres.py",
                                              "16a28d48c80794fcaa5e411f8cb8e4b70a4387de"),
          ZefanTwoQueriesOneStack, "Full AttnRes over sublayer outputs, mix added to the stream, "
          "two queries and key norms read the same stack (delta_v)", {ATTN: 7, QKV: 1},
          attn_res_blocks=[1, 2, 2, 3, 4, 4, 5],
          pairs=[frozenset({"a_norm.0.weight", "v_norm.0.weight"})]),
    Entry("highbuyer_two_pass", _src("highbuyer/attnres", "src/model_v2.py",
                                     "a50ddd00f5d63b310d5f4dbe9f4264d04b3b31ca"),
          HighbuyerTwoPass, "per-source nn.RMSNorm keys and einsum logits, only the logits "
          "stacked, mix zeros_like + add_(p[n] * v[n])", {ATTN: 5},
          attn_res_blocks=[1, 1, 2, 2, 3]),
    Entry("megatron_loop_read", _src("kimmichtank/rms-block-attnres",
                                     "scaling/megatron-attnres.patch",
                                     "7a1ee06d8cd06dbd9f9ef6e45d00758c179908a4"),
          MegatronLoopRead, "Megatron-LM AttnRes fork's torch reference: [S, B, H], per-source "
          "model-dtype key norms and einsum logits, mix out = out + p[d] * v, rms_block state",
          {ATTN: 8}, inputs_kind="seq_first", attn_res_blocks=[1, 1, 1, 1, 2, 2, 2, 2]),
    Entry("sources_on_dim_two", _src("Edward-Zion-Saji/attention-residuals",
                                     "attnres/core/block_attn_res.py",
                                     "325945262b7ed7ea00fb7b3403f6db90dd226e7f"),
          SourcesOnDimTwo, "sources stacked on dim 2 ([B, T, N, D]), one shared weightless "
          "x / sqrt(mean(x^2) + eps) key norm, (k * w).sum(-1), torch.softmax(-1), mix "
          "(p.unsqueeze(-1) * v).sum(dim=2); reads over completed blocks only at a block start",
          {ATTN: 8}, attn_res_blocks=[0, 1, 1, 2, 2, 3, 3, 4]),
    Entry("two_phase_online_merge", _src("Edward-Zion-Saji/attention-residuals",
                                         "attnres/core/block_attn_res.py",
                                         "325945262b7ed7ea00fb7b3403f6db90dd226e7f"),
          TwoPhaseOnlineMerge, "the paper's two-phase inference: one einsum scores every layer "
          "of a block against the completed blocks, the softmax spelled out (max, exp, sum, "
          "log-sum-exp), each later read an online-softmax merge with the partial. AttnRes's "
          "function, a miss: no read is one softmax over its own sources (a slice of a "
          "batched-query softmax, or a merge of two; too big for the matcher as it stands)",
          {ATTN: 0}),
    Entry("zero_partial_source", _src("Da1sypetals/attnres", "train_attnres_gpt.py",
                                      "447353239b85a122085b74cc92db5ebf65cf8e3a"),
          ZeroPartialSource, "key norm weight * (x / sqrt(mean(x^2) + eps)), bare [D] query, "
          "'s'-labelled einsums, the partial a zeros_like source at each block start",
          {ATTN: 7}, attn_res_blocks=[1, 1, 2, 2, 3, 3, 3]),
    Entry("raw_sublayer_source", _src("Sohailm25/attnres", "validation/attnres_reproduction.py",
                                      "450018e0658d517d0df9fa2f75c4741a6ac8b3c1"),
          RawSublayerSource, "nn.RMSNorm keys (eps None), torch.softmax(logits, dim=0), the "
          "pre-MLP read's newest source the raw attention output, completed block attn_out + "
          "mlp_out", {ATTN: 6}, attn_res_blocks=[1, 1, 2, 2, 3, 3]),
    Entry("scaled_logits", _src("sunnyang1/Adaptive-Deep-Networks", "src/attnres/block_attnres.py",
                                "2a631bc0b5977ce1adff48f44bc73fd4ac80c272"),
          ScaledLogits, "near relative: logits / sqrt(H)", {ATTN: 0}),
    Entry("recency_bias", _src("wdlctc/open-attention-residuals", "modeling_attnres.py",
                               "83d2b8de82c2fbb981c7decca67d13d9db348da6"),
          RecencyBias, "near relative: a learned bias on the newest logit", {ATTN: 0}),
    Entry("xrenya_layernorm_keys", _src("Xrenya/Attention-Residuals", "attn_res.py",
                                        "593be6d702b1e33b1657fe165bdb968c18a2cd4f"),
          XrenyaLayerNormKeys, "near relative: LayerNorm keys, logits * 1/sqrt(D)", {ATTN: 0}),
    Entry("normalized_source_mix", _src("kimmichtank/rms-block-attnres", "small/pretrain_core.py",
                                        "7a1ee06d8cd06dbd9f9ef6e45d00758c179908a4"),
          FullRMSAggregate, "near relative: the keys mixed instead of the sources "
          "(full_rms_aggregate)", {ATTN: 0}),
    Entry("in_place_recency_bias", _src("gouzigouzi/attention-residuals-reproduction",
                                        "modeling_attnres.py",
                                        "b4d6c7a36eb67cd218f114e0b4974a3010495a94"),
          InPlaceRecencyBias, "near relative: logits[-1] = logits[-1] + bias written in place "
          "before the softmax", {ATTN: 0}),
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
    Entry("deepseek_v3_cache_write", _src("deepseek-ai/DeepSeek-V3", "inference/model.py",
                                          "9b4e9788e4a3a731f7567338ed15d3ec549ce03b"),
          DeepseekV3CacheWrite, "F.rms_norm norms in the model dtype, complex rope, q absorbed "
          "into wkv_b, the kv norm read only through a kv_cache buffer write", {QKV: 1},
          pairs=[frozenset({"q_norm.weight", "kv_norm.weight"})]),
    Entry("megatron_core_mla", _src("NVIDIA/Megatron-LM",
                                    "megatron/core/transformer/multi_latent_attention.py",
                                    "d98e8a64ddf34856e74b24714e3bedb2f5a39553"),
          MegatronCoreMLA, "[S, B, H], both down projections before the norms, torch.nn.RMSNorm, "
          "(out, bias) linears, interleaved rope", {QKV: 1}, inputs_kind="seq_first",
          pairs=[frozenset({"q_layernorm.weight", "kv_layernorm.weight"})]),
    Entry("torchtitan_deepseek_v3", _src("pytorch/torchtitan",
                                         "torchtitan/models/deepseek_v3/model.py",
                                         "b5bcd76c66d0acb1a08b176d9639425bc55e0b2a"),
          TorchtitanDeepseekV3, "[T, H], nn.RMSNorm eps 1e-5, complex rope between the q norm "
          "and the kv norm", {QKV: 1}, inputs_kind="tokens",
          pairs=[frozenset({"q_norm.weight", "kv_norm.weight"})]),
    Entry("rocm_megatron_k3_gated_mla", _src("ROCm/Megatron-LM", "kimi_k3/attention/gated_mla.py",
                                             "23154406525053857799356d62a521f675b63489"),
          RocmMegatronK3GatedMLA, "bare nn.Parameter norm weights, one rms_norm(x, w, eps) "
          "with the weight first in fp32, [S, B, H] transposed .contiguous(), gated SDPA",
          {QKV: 1}, inputs_kind="seq_first",
          pairs=[frozenset({"q_a_layernorm", "kv_a_layernorm"})]),
    Entry("hf_dots1_qk_norm", _src("huggingface/transformers",
                                   "src/transformers/models/dots1/modeling_dots1.py",
                                   "54d1c51d7caea79738710dede0481897ab69d4b9"),
          HFDots1QKNorm, "not MLA: Qwen3-style per-head q/k norms of two projections of one "
          "hidden state, one dual norm by design", {QKV: 1},
          pairs=[frozenset({"q_norm.weight", "k_norm.weight"})]),
    Entry("megatron_bridge_k3_mla", _src("NVIDIA-NeMo/Megatron-Bridge",
                                         "src/megatron/bridge/models/kimi/kimi_k3_layers.py",
                                         "067f987df03b8355b03192d88d70f1709fedf51a"),
          MegatronBridgeK3MLA, "[S, B, H] used as it is, (out, bias) linears unpacked by a "
          "helper, square().mean norms eps 1e-5, NoPE key slice expanded, sigmoid gate",
          {QKV: 1}, inputs_kind="seq_first",
          pairs=[frozenset({"q_a_layernorm.weight", "kv_a_layernorm.weight"})]),
    Entry("torchtune_latent_linear", _src("pytorch/torchtune",
                                          "torchtune/models/deepseek_v3/_attention.py",
                                          "7d3c95e111df6730bb92b8ce431f61f2c2b68812"),
          TorchtuneLatentLinear, "each norm inside a LatentLinear (a, norm, b), weight named "
          "scale applied after type_as, q/k assembled in new_empty buffers", {QKV: 1},
          pairs=[frozenset({"q_proj.norm.scale", "kv_proj.norm.scale"})]),
    Entry("torchtune_no_q_lora", _src("pytorch/torchtune",
                                      "torchtune/models/deepseek_v3/_attention.py",
                                      "7d3c95e111df6730bb92b8ce431f61f2c2b68812"),
          TorchtuneNoQLora, "near relative: q_lora_rank None (q_proj a plain Linear), the kv "
          "norm alone", {QKV: 0}),
    Entry("automodel_dspark_context_kv", _src(
        "NVIDIA-NeMo/Automodel", "nemo_automodel/components/speculative/dspark/draft_kimi_k3.py",
        "36044ad3d139363fb6c73c24af2e7c6b65ec52f6"),
          AutomodelDSparkK3Attention, "near relative: q latent of the draft block, kv latent of "
          "cat([context, block]) -- projections of two activations, T and 2T rows", {QKV: 0},
          inputs_kind="draft"),
    Entry("vllm_deepseek_mtp", _src("vllm-project/vllm",
                                    "vllm/model_executor/models/deepseek_mtp.py",
                                    "4f7c14402630b97c8c078523fca8edef287ed2cf"),
          VllmDeepseekMTP, "MTP: masked embeddings, eh_proj(cat(enorm, hnorm)), then a "
          "decoder block: input norm, fused-projection MLA, residual-add norm", {QKV: 1},
          inputs_kind="mtp", pairs=[frozenset({"q_a_layernorm.weight", "kv_a_layernorm.weight"})]),
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
    Entry("anshler_v4_mtp", _src("Anshler/deepseek-v4-with-attention-residuals",
                                 "inference/model.py", "be0e8761762735618dcbb4dcce1435bb9115c115"),
          AnshlerV4MTP, "MTP merge e_proj(enorm(e)) + h_proj(hnorm(h)) (the tail's function), "
          "then a V4 block: q_norm / kv_norm on the whole wkv output, in-place complex rope",
          {QKV: 1, TAIL: 1}, inputs_kind="mtp",
          pairs=[frozenset({"q_norm.weight", "kv_norm.weight"})],
          tails=[("hnorm.weight", "h_proj.weight")]),
    Entry("megatron_bridge_k3_tail", _src("NVIDIA-NeMo/Megatron-Bridge",
                                          "src/megatron/bridge/models/kimi/kimi_k3_layers.py",
                                          "067f987df03b8355b03192d88d70f1709fedf51a"),
          MegatronBridgeK3Tail, "shared computed first, square().mean norm eps 1e-5, "
          "(out, bias) fc2_latent_proj unpacked, output + shared", {TAIL: 1},
          inputs_kind="moe", tails=[("routed_expert_norm.weight", "fc2_latent_proj.weight")]),
    Entry("torchtitan_k3_latent_moe", _src("pytorch/torchtitan", "torchtitan/models/kimi_k3/moe.py",
                                           "41447a4330a6dae131f7765598c1756bc9969d52"),
          TorchtitanK3LatentMoE, "the whole layer on [T, H]: router, routed_down, dense "
          "experts in the latent, nn.RMSNorm eps 1e-5, routed_up, shared computed after",
          {TAIL: 1}, inputs_kind="tokens", tails=[("routed_norm.weight", "routed_up.weight")]),
    Entry("megatron_bridge_gemma4_post_norm", _src(
        "NVIDIA-NeMo/Megatron-Bridge", "src/megatron/bridge/models/gemma/modeling_gemma4.py",
        "067f987df03b8355b03192d88d70f1709fedf51a"),
          MegatronBridgeGemma4PostNorm, "near relative: norm(fc2_latent_proj(latent)) + "
          "norm(shared), the norm after the up-projection", {}, inputs_kind="moe"),
    Entry("automodel_k3_moe", _src("NVIDIA-NeMo/Automodel",
                                   "nemo_automodel/components/models/kimi_k3/model.py",
                                   "36044ad3d139363fb6c73c24af2e7c6b65ec52f6"),
          AutomodelK3MoE, "the whole layer on reshape(-1, H): fp32 router, top-k expert "
          "outputs weighted in fp32 and cast, HF norm eps 1e-5, SiTU shared expert, the sum "
          "viewed back to [B, S, H]", {TAIL: 1},
          tails=[("routed_expert_norm.weight", "routed_expert_up_proj.weight")]),
    # ---------------------------------------------------------------- transformers' Kimi K3
    Entry("hf_kimi_k3_gated_mla", _src("huggingface/transformers",
                                       "src/transformers/models/kimi_k3/modular_kimi_k3.py",
                                       "e6ffd1347cc61c22b7120d1b556101c6908ba12e"),
          HFKimiK3GatedMLA, "KimiK3GatedMLA: q latent up-projected before the kv projection, "
          "torch.split, HF norms eps 1e-6, expand_kv, no rope, SDPA, sigmoid output gate",
          {QKV: 1}, pairs=[frozenset({"q_a_layernorm.weight", "kv_a_layernorm.weight"})]),
    Entry("hf_kimi_k3_moe", _src("huggingface/transformers",
                                 "src/transformers/models/kimi_k3/modular_kimi_k3.py",
                                 "e6ffd1347cc61c22b7120d1b556101c6908ba12e"),
          HFKimiK3MoE, "KimiK3MoE, the whole layer: fp32 sigmoid router, latent down-proj, "
          "batched_mm experts (fp32-weighted sum, cast back), HF norm, up-proj viewed back to "
          "[B, S, H], then + the SiTU shared expert", {TAIL: 1},
          tails=[("routed_expert_norm.weight", "routed_expert_up_proj.weight")]),
    Entry("hf_kimi_k3_decoder", _src("huggingface/transformers",
                                     "src/transformers/models/kimi_k3/modular_kimi_k3.py",
                                     "e6ffd1347cc61c22b7120d1b556101c6908ba12e"),
          HFKimiK3Decoder, "four KimiK3DecoderLayers (KDA stand-in / gated MLA, dense / latent "
          "MoE): fp32 [T, N, H] bank, AttnRes key norm on the cat'ed stack, Linear(H, 1) "
          "pseudo-query, transpose(1, 2).softmax(-1), matmul mix, the layer norms after the reads",
          {ATTN: 7, QKV: 2, TAIL: 2}, attn_res_blocks=[1, 1, 1, 1, 2, 2, 2],
          pairs=[frozenset({f"decoder_layers.{i}.self_attn.q_a_layernorm.weight",
                            f"decoder_layers.{i}.self_attn.kv_a_layernorm.weight"})
                 for i in (1, 3)],
          tails=[(f"decoder_layers.{i}.mlp.routed_expert_norm.weight",
                  f"decoder_layers.{i}.mlp.routed_expert_up_proj.weight") for i in (1, 3)]),
]

BY_NAME = {e.name: e for e in ENTRIES}
