"""Plain-PyTorch reference Kimi-K3-style causal LM.

This file is deliberately written the way a user (or a model hub) writes a
decoder: ordinary ``nn.Linear`` / ``nn.Embedding`` modules, an RMSNorm whose
forward is spelled out op by op, and MLA attention that slices the fused
``kv_a_proj_with_mqa`` output with ``split`` (so the latent ``kv_c`` handed to
``kv_a_layernorm`` is a strided, non-contiguous view).  Nothing here knows
about k3fusion.  The fusion passes must recognize *this* code after
torch.compile traces it, so please keep it idiomatic rather than clever: if a
change makes the graph easier to match but less like real user code, it
defeats the purpose.

``norm_style`` selects among the RMSNorm spellings found in the wild (HF
transformers, vLLM ``forward_native``, fp32-weight, ``x * x``, and
``F.rms_norm``); they compute the same function, and the passes have to match
all of them.

``attn_res=True`` (Block Attention Residuals, the delta hand-off) and
``latent_moe=True`` (K3's latent mixture of experts, tensor parallel):
docs/design-notes.md, "k3fusion/models/kimi_k3.py".
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "NORM_STYLES",
    "KimiK3Config",
    "KimiK3RMSNorm",
    "KimiK3Attention",
    "KimiK3MLP",
    "KimiK3AttnRes",
    "KimiK3DecoderLayer",
    "KimiK3Model",
    "KimiK3ForCausalLM",
    "ATTN_RES_BANKS",
    "ATTN_RES_PRECISIONS",
    "apply_attn_res",
    "attn_res_max_blocks",
    "count_mla_layers",
    "count_attn_res_sites",
]


# --------------------------------------------------------------------------
# RMSNorm spellings.  Each takes (x, weight, eps) and returns x's dtype.
# They are kept as separate small functions (not one parametrized function)
# because the *exact op sequence* is what differs between them, and that is
# what the pattern matcher sees.
# --------------------------------------------------------------------------


def _rms_hf(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # HF transformers LlamaRMSNorm style: weight on the left, after downcast.
    dt = x.dtype
    x = x.to(torch.float32)
    var = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(var + eps)
    return weight * x.to(dt)


def _rms_vllm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # vLLM RMSNorm.forward_native style: one upcast, weight on the right.
    orig_dtype = x.dtype
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(dim=-1, keepdim=True)
    x32 = x32 * torch.rsqrt(variance + eps)
    return x32.to(orig_dtype) * weight


def _rms_weight_fp32(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # Weight applied in fp32 before the single downcast (one rounding, not two).
    dt = x.dtype
    x32 = x.to(torch.float32)
    var = x32.pow(2).mean(-1, keepdim=True)
    return (x32 * torch.rsqrt(var + eps) * weight.float()).to(dt)


def _rms_square(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # Same as "hf" but squares with a mul, which traces to a different op.
    dt = x.dtype
    x = x.to(torch.float32)
    var = (x * x).mean(-1, keepdim=True)
    x = x * torch.rsqrt(var + eps)
    return weight * x.to(dt)


def _rms_torch(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    # The built-in op; dynamo sees a single aten.rms_norm (or its decomposition).
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


_NORM_FNS: dict[str, Callable[[Tensor, Tensor, float], Tensor]] = {
    "hf": _rms_hf,
    "vllm": _rms_vllm,
    "weight_fp32": _rms_weight_fp32,
    "square": _rms_square,
    "torch": _rms_torch,
}

NORM_STYLES: tuple[str, ...] = tuple(_NORM_FNS)

_ALLOWED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)

# Init std of the AttnRes pseudo-query is this / sqrt(hidden_size).
_ATTN_RES_QUERY_STD = 1.0

# AttnRes block bank: a list that grows by one tensor per block, or one
# preallocated [B, S, max_blocks, H] tensor written in place.
ATTN_RES_BANKS: tuple[str, ...] = ("list", "tensor")
# "model": the mix runs in the model dtype (softmax in fp32), as module code
# usually is; "fp32": key norm, logits, softmax and mix all in fp32, one
# rounding at the end.
ATTN_RES_PRECISIONS: tuple[str, ...] = ("model", "fp32")


# --------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------


@dataclass
class KimiK3Config:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    norm_style: str = "hf"
    dtype: torch.dtype = torch.bfloat16
    # Block Attention Residuals (see the module docstring).
    attn_res: bool = False
    # Normalized latent MoE instead of the dense MLP (see KimiK3LatentMoE).
    latent_moe: bool = False
    # Layers per AttnRes block (K3: 12); the embedding is block 0.
    attn_res_block_size: int = 12
    attn_res_bank: str = "list"
    attn_res_precision: str = "model"
    # Latent MoE (used when latent_moe=True; defaults are the tiny widths).
    num_experts: int = 4
    top_k: int = 2
    latent_size: int = 40
    moe_intermediate_size: int = 32
    num_shared_experts: int = 1
    # "situ" (K3's SiTU-GLU, see situ_glu) or "silu" (plain SiLU-GLU).
    activation: str = "situ"
    beta: float = 4.0
    beta_lin: float = 25.0
    routed_scaling: float = 1.0

    _POSITIVE_INT_FIELDS = (
        "vocab_size",
        "hidden_size",
        "num_layers",
        "num_heads",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "intermediate_size",
        "attn_res_block_size",
    )

    def __post_init__(self) -> None:
        for name in self._POSITIVE_INT_FIELDS:
            value = getattr(self, name)
            # bool is an int subclass; True is never a meaningful width.
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"KimiK3Config.{name} must be a positive int, got {value!r}")
        eps = self.rms_norm_eps
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
            raise ValueError(f"KimiK3Config.rms_norm_eps must be a positive float, got {eps!r}")
        if self.norm_style not in NORM_STYLES:
            raise ValueError(
                f"KimiK3Config.norm_style must be one of {NORM_STYLES}, got {self.norm_style!r}"
            )
        if self.dtype not in _ALLOWED_DTYPES:
            raise ValueError(
                f"KimiK3Config.dtype must be one of {_ALLOWED_DTYPES}, got {self.dtype!r}"
            )
        for name in ("attn_res", "latent_moe"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"KimiK3Config.{name} must be a bool, got {getattr(self, name)!r}")
        if self.attn_res_bank not in ATTN_RES_BANKS:
            raise ValueError(
                f"KimiK3Config.attn_res_bank must be one of {ATTN_RES_BANKS}, "
                f"got {self.attn_res_bank!r}"
            )
        if self.attn_res_precision not in ATTN_RES_PRECISIONS:
            raise ValueError(
                f"KimiK3Config.attn_res_precision must be one of {ATTN_RES_PRECISIONS}, "
                f"got {self.attn_res_precision!r}"
            )
        _check_latent_moe_fields(self)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def attn_res_max_blocks(self) -> int:
        """Blocks in the AttnRes bank: ceil(num_layers / attn_res_block_size)."""
        return attn_res_max_blocks(self.num_layers, self.attn_res_block_size)

    def replace(self, **changes: object) -> KimiK3Config:
        """Copy with some fields changed (re-validated)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def tiny(cls, **overrides: object) -> KimiK3Config:
        """CPU-sized config.  q_lora_rank=48 is deliberately not a power of two
        so kernels/passes can't silently assume one."""
        fields = dict(
            vocab_size=128,
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            q_lora_rank=48,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            intermediate_size=96,
        )
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def k3(cls, **overrides: object) -> KimiK3Config:
        """Real Kimi-K3 widths (far too large to instantiate on CPU)."""
        fields = dict(
            vocab_size=163840,
            hidden_size=7168,
            num_layers=61,
            num_heads=64,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            intermediate_size=18432,
            rms_norm_eps=1e-6,
            # Latent MoE: latent 3584 -> hidden 7168 (the widths); the expert
            # counts and widths are Kimi-K2's (384 experts, top 8, 2048, 1 shared).
            latent_size=3584,
            num_experts=384,
            top_k=8,
            moe_intermediate_size=2048,
            num_shared_experts=1,
        )
        fields.update(overrides)
        return cls(**fields)


def attn_res_max_blocks(num_layers: int, block_size: int) -> int:
    """Number of block-write layers (``layer_idx % block_size == 0``) = ceil(L / bs)."""
    return -(-num_layers // block_size)


def _check_supported(config: KimiK3Config) -> None:
    # Every switch of KimiK3Config is implemented (latent_moe landed); a future
    # switch that is not yet must raise NotImplementedError here rather than
    # silently build a model with other numerics.
    return None


# --------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------


class KimiK3RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, norm_style: str = "hf") -> None:
        super().__init__()
        if norm_style not in _NORM_FNS:
            raise ValueError(f"norm_style must be one of {NORM_STYLES}, got {norm_style!r}")
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps
        self.norm_style = norm_style

    @property
    def eps(self) -> float:
        return self.variance_epsilon

    def forward(self, x: Tensor) -> Tensor:
        return _NORM_FNS[self.norm_style](x, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}, style={self.norm_style!r}"


class KimiK3Attention(nn.Module):
    """Multi-head latent attention (MLA), NoPE variant: no rotary embedding,
    the single ``k_pe`` head is shared by all query heads."""

    def __init__(self, config: KimiK3Config) -> None:
        super().__init__()
        c = config
        self.num_heads = c.num_heads
        self.kv_lora_rank = c.kv_lora_rank
        self.qk_nope_head_dim = c.qk_nope_head_dim
        self.qk_rope_head_dim = c.qk_rope_head_dim
        self.qk_head_dim = c.qk_head_dim
        self.v_head_dim = c.v_head_dim
        self.scaling = 1.0 / math.sqrt(self.qk_head_dim)

        self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=False)
        self.q_a_layernorm = KimiK3RMSNorm(c.q_lora_rank, c.rms_norm_eps, c.norm_style)
        self.q_b_proj = nn.Linear(c.q_lora_rank, c.num_heads * self.qk_head_dim, bias=False)

        self.kv_a_proj_with_mqa = nn.Linear(
            c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, bias=False
        )
        self.kv_a_layernorm = KimiK3RMSNorm(c.kv_lora_rank, c.rms_norm_eps, c.norm_style)
        self.kv_b_proj = nn.Linear(
            c.kv_lora_rank, c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(c.num_heads * c.v_head_dim, c.hidden_size, bias=False)

    def forward(self, hidden_states: Tensor) -> Tensor:
        bsz, seq, _ = hidden_states.shape
        h = self.num_heads

        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(bsz, seq, h, self.qk_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        # A RoPE model would rotate q_pe / k_pe here; K3 attention is NoPE, but
        # we keep the split/cat layout users copy from DeepSeek-style MLA code.

        kv = self.kv_a_proj_with_mqa(hidden_states)
        # kv_c is a strided view (row stride kv_lora + rope); users do not call
        # .contiguous() here, so the norm pattern must accept it as is.
        kv_c, k_pe = kv.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(kv_c))
        kv = kv.view(bsz, seq, h, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)

        k_pe = k_pe.view(bsz, seq, 1, self.qk_rope_head_dim).expand(-1, -1, h, -1)
        query = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)
        key = torch.cat([k_nope, k_pe], dim=-1).transpose(1, 2)
        value = v.transpose(1, 2)

        out = F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=self.scaling
        )  # [B, heads, S, v_head_dim]
        out = out.transpose(1, 2).reshape(bsz, seq, h * self.v_head_dim)
        return self.o_proj(out)


class KimiK3MLP(nn.Module):
    def __init__(self, config: KimiK3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# --------------------------------------------------------------------------
# Latent mixture of experts (latent_moe=True)
# --------------------------------------------------------------------------

__all__ += [
    "MOE_ACTIVATIONS",
    "situ_glu",
    "KimiK3GLU",
    "KimiK3LatentMoE",
    "tp_shard_state_dict",
    "count_latent_moe_layers",
]

MOE_ACTIVATIONS: tuple[str, ...] = ("situ", "silu")

# Init std of the router's e_score_correction_bias.
_MOE_BIAS_STD = 0.02


def _check_latent_moe_fields(c: KimiK3Config) -> None:
    for name in ("num_experts", "top_k", "latent_size", "moe_intermediate_size"):
        value = getattr(c, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"KimiK3Config.{name} must be a positive int, got {value!r}")
    n = c.num_shared_experts
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"KimiK3Config.num_shared_experts must be an int >= 0, got {n!r}")
    if c.top_k > c.num_experts:
        raise ValueError(
            f"KimiK3Config.top_k ({c.top_k}) must not exceed num_experts ({c.num_experts})"
        )
    if c.activation not in MOE_ACTIVATIONS:
        raise ValueError(
            f"KimiK3Config.activation must be one of {MOE_ACTIVATIONS}, got {c.activation!r}"
        )
    for name in ("beta", "beta_lin", "routed_scaling"):
        value = getattr(c, name)
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not math.isfinite(value) or value <= 0):
            raise ValueError(f"KimiK3Config.{name} must be a positive finite float, got {value!r}")


def situ_glu(gate: Tensor, up: Tensor, beta: float = 4.0, beta_lin: float = 25.0) -> Tensor:
    """K3's SiTU-GLU: ``beta*tanh(g/beta)*sigmoid(g) * beta_lin*tanh(u/beta_lin)``.

    A SiLU whose linear branch is soft-capped at ``beta`` (``tanh(g/beta)*beta ~ g``
    for ``|g| << beta``), times the up branch soft-capped at ``beta_lin``.
    """
    return beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * (beta_lin * torch.tanh(up / beta_lin))


class KimiK3GLU(nn.Module):
    """A gated MLP ``down(act(gate(x), up(x)))``: one routed expert (latent width) or
    the shared experts (hidden width).  Under tensor parallelism it holds a slice of
    the intermediate width and returns a partial sum."""

    def __init__(
        self,
        in_features: int,
        intermediate: int,
        out_features: int,
        activation: str = "situ",
        beta: float = 4.0,
        beta_lin: float = 25.0,
    ) -> None:
        super().__init__()
        if activation not in MOE_ACTIVATIONS:
            raise ValueError(f"activation must be one of {MOE_ACTIVATIONS}, got {activation!r}")
        self.gate_proj = nn.Linear(in_features, intermediate, bias=False)
        self.up_proj = nn.Linear(in_features, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, out_features, bias=False)
        self.activation = activation
        self.beta = beta
        self.beta_lin = beta_lin

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.activation == "situ":
            h = situ_glu(gate, up, self.beta, self.beta_lin)
        else:
            h = F.silu(gate) * up
        return self.down_proj(h)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"


def _tp_size(group: object) -> int:
    if group is None:
        return 1
    import torch.distributed as dist

    return dist.get_world_size(group)


class KimiK3LatentMoE(nn.Module):
    """K3's normalized latent mixture of experts, optionally tensor-parallel.

    For hidden states ``x [..., H]``::

        scores  = sigmoid(router(x))                        # [T, E], fp32
        experts = topk(scores + e_score_correction_bias, k) # the bias steers selection only
        weights = scores[experts] / sum(scores[experts]) * routed_scaling
        z       = down_proj(x)                              # [T, L], replicated
        routed  = sum_k weights_k * expert_k(z)             # [T, L], a per-rank partial
        shared  = shared_experts(x)                         # [T, H], a per-rank partial
        y       = tail(routed, shared)                      # AR, latent_norm, up_proj, + AR

    The routed sum runs every expert on every token and weights it by a combine
    matrix that is zero off the top-k: the same function as gathering each
    expert's tokens (an unselected expert adds exactly 0), with no data-dependent
    shapes, so the layer traces whole under torch.compile.
    """

    def __init__(self, config: KimiK3Config, tp_group: object = None) -> None:
        super().__init__()
        c = config
        tp = _tp_size(tp_group)
        shared_inter = c.num_shared_experts * c.moe_intermediate_size
        for name, width in (("moe_intermediate_size", c.moe_intermediate_size),
                            ("num_shared_experts * moe_intermediate_size", shared_inter)):
            if width % tp:
                raise ValueError(f"{name} = {width} is not divisible by the tensor-parallel "
                                 f"size {tp}")
        self.tp_group = tp_group
        self.tp_size = tp
        self.num_experts = c.num_experts
        self.top_k = c.top_k
        self.routed_scaling = c.routed_scaling
        self.router = nn.Linear(c.hidden_size, c.num_experts, bias=False)
        self.register_buffer("e_score_correction_bias", torch.zeros(c.num_experts))
        self.down_proj = nn.Linear(c.hidden_size, c.latent_size, bias=False)
        self.experts = nn.ModuleList(
            KimiK3GLU(c.latent_size, c.moe_intermediate_size // tp, c.latent_size,
                      c.activation, c.beta, c.beta_lin)
            for _ in range(c.num_experts)
        )
        self.shared_experts = (
            KimiK3GLU(c.hidden_size, shared_inter // tp, c.hidden_size, c.activation, c.beta,
                      c.beta_lin)
            if shared_inter else None
        )
        self.latent_norm = KimiK3RMSNorm(c.latent_size, c.rms_norm_eps, c.norm_style)
        self.up_proj = nn.Linear(c.latent_size, c.hidden_size, bias=False)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [T, H] -> (expert ids [T, k], weights [T, k] in fp32)."""
        scores = torch.sigmoid(self.router(x).float())
        biased = scores + self.e_score_correction_bias.float()
        ids = torch.topk(biased, self.top_k, dim=-1).indices
        weights = scores.gather(-1, ids)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights * self.routed_scaling

    def routed_latent(self, x: Tensor) -> Tensor:
        """x [T, H] -> this rank's partial sum of the weighted experts, [T, L]."""
        ids, weights = self.route(x)
        combine = torch.zeros(
            x.shape[0], self.num_experts, dtype=torch.float32, device=x.device
        ).scatter(1, ids, weights)
        z = self.down_proj(x)
        acc = torch.zeros(z.shape, dtype=torch.float32, device=z.device)
        for e, expert in enumerate(self.experts):
            acc = acc + combine[:, e : e + 1] * expert(z).float()
        return acc.to(x.dtype)

    def tail(self, routed_latent: Tensor, shared: Tensor) -> Tensor:
        """``AR(shared) + up_proj(latent_norm(AR(routed_latent)))`` from per-rank partials.

        A method, so an eager patch can swap it (the contract of
        ``k3fusion.reference.latent_moe_tail``).
        """
        if self.tp_group is not None:
            routed_latent = funcol.wait_tensor(funcol.all_reduce(routed_latent, "sum", self.tp_group))
            shared = funcol.wait_tensor(funcol.all_reduce(shared, "sum", self.tp_group))
        return shared + self.up_proj(self.latent_norm(routed_latent))

    def forward(self, hidden_states: Tensor) -> Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        routed = self.routed_latent(x)
        shared = self.shared_experts(x) if self.shared_experts is not None else torch.zeros_like(x)
        return self.tail(routed, shared).view(shape)

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}, tp_size={self.tp_size}"


# Expert weights sharded under TP: gate/up by rows (intermediate out), down by columns.
_TP_SHARDED = re.compile(r"(^|\.)(experts\.\d+|shared_experts)\.(gate_proj|up_proj|down_proj)\.weight$")


def tp_shard_state_dict(state_dict: dict[str, Tensor], rank: int, tp: int) -> dict[str, Tensor]:
    """A tp=1 state dict cut down to rank ``rank`` of ``tp``'s shards (for a model built
    with a ``tp_group`` of that size): every routed and shared expert keeps its
    ``rank``-th slice of the intermediate width (``gate_proj``/``up_proj`` rows,
    ``down_proj`` columns); everything else is replicated as is."""
    if not 0 <= rank < tp:
        raise ValueError(f"rank must be in [0, tp={tp}), got {rank}")
    out = {}
    for key, value in state_dict.items():
        m = _TP_SHARDED.search(key)
        if m is None:
            out[key] = value
            continue
        dim = 1 if m.group(3) == "down_proj" else 0
        width = value.shape[dim]
        if width % tp:
            raise ValueError(f"{key}: width {width} is not divisible by tp={tp}")
        out[key] = value.narrow(dim, rank * (width // tp), width // tp).clone()
    return out


def count_latent_moe_layers(model: nn.Module) -> int:
    """Number of latent MoE modules (each has one tail)."""
    return sum(isinstance(m, KimiK3LatentMoE) for m in model.modules())


class KimiK3AttnRes(nn.Module):
    """One AttnRes site: a softmax mix over its sources, keyed by ``w . RMSNorm_g(v)``.

    ``norm`` is the key norm ``g`` (the model's RMSNorm style); ``proj`` holds the
    learned pseudo-query ``w`` as a ``Linear(H, 1, bias=False)`` weight.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        norm_style: str = "hf",
        precision: str = "model",
    ) -> None:
        super().__init__()
        if precision not in ATTN_RES_PRECISIONS:
            raise ValueError(
                f"precision must be one of {ATTN_RES_PRECISIONS}, got {precision!r}"
            )
        self.norm = KimiK3RMSNorm(hidden_size, eps, norm_style)
        self.proj = nn.Linear(hidden_size, 1, bias=False)
        self.precision = precision

    def forward(self, sources: Tensor) -> Tensor:
        """sources [..., S, H] (source dim at -2) -> mixed [..., H] in sources' dtype."""
        if self.precision == "fp32":
            s32 = sources.float()
            norm = self.norm
            keys = _NORM_FNS[norm.norm_style](s32, norm.weight.float(), norm.variance_epsilon)
            logits = F.linear(keys, self.proj.weight.float()).squeeze(-1)
            weights = logits.softmax(-1)
            mixed = (weights.unsqueeze(-1) * s32).sum(-2)
            return mixed.to(sources.dtype)
        keys = self.norm(sources)
        logits = self.proj(keys).squeeze(-1)
        weights = logits.float().softmax(-1)
        return (weights.to(sources.dtype).unsqueeze(-1) * sources).sum(-2)

    def extra_repr(self) -> str:
        return f"precision={self.precision!r}"


AttnResBank = list[Tensor] | Tensor


def apply_attn_res(
    prefix: Tensor,
    bank: AttnResBank,
    res: KimiK3AttnRes,
    num_blocks: int,
    *,
    delta: Tensor | None = None,
    output_norm: nn.Module | None = None,
    block_write_idx: int = -1,
) -> tuple[Tensor, Tensor, AttnResBank]:
    """One AttnRes step, in plain torch -> ``(out, prefix, bank)``.

    1. ``prefix = prefix + delta`` (model dtype add);
    2. ``block_write_idx >= 0``: the prefix becomes a completed block -- a list bank
       returns a *new* list (the caller's list is not mutated), a tensor bank
       ``[..., max_blocks, H]`` is written in place at ``block_write_idx``;
    3. sources: the first ``num_blocks`` blocks, then the prefix;
    4. ``out = res(sources)``;  5. ``out = output_norm(out)`` if given.
    """
    if delta is not None:
        prefix = prefix + delta
    is_list = isinstance(bank, list)
    if block_write_idx >= 0:
        if is_list:
            bank = bank + [prefix]
        else:
            bank[..., block_write_idx, :] = prefix
    if is_list:
        sources = torch.stack(bank[:num_blocks] + [prefix], dim=-2)
    else:
        sources = torch.cat([bank[..., :num_blocks, :], prefix.unsqueeze(-2)], dim=-2)
    out = res(sources)
    if output_norm is not None:
        out = output_norm(out)
    return out, prefix, bank


class AttnResStep:
    """Gives a module the K3 contract ``apply_attn_res(...)`` as a method (see the function
    :func:`apply_attn_res`), so ``k3fusion.eager.patch_model`` can swap it per module."""

    def apply_attn_res(
        self,
        prefix: Tensor,
        bank: AttnResBank,
        res: KimiK3AttnRes,
        num_blocks: int,
        *,
        delta: Tensor | None = None,
        output_norm: nn.Module | None = None,
        block_write_idx: int = -1,
    ) -> tuple[Tensor, Tensor, AttnResBank]:
        return apply_attn_res(prefix, bank, res, num_blocks, delta=delta,
                              output_norm=output_norm, block_write_idx=block_write_idx)


class KimiK3DecoderLayer(AttnResStep, nn.Module):
    def __init__(self, config: KimiK3Config, layer_idx: int = 0, tp_group: object = None) -> None:
        super().__init__()
        _check_supported(config)
        c = config
        self.layer_idx = layer_idx
        self.input_layernorm = KimiK3RMSNorm(c.hidden_size, c.rms_norm_eps, c.norm_style)
        self.self_attn = KimiK3Attention(c)
        self.post_attention_layernorm = KimiK3RMSNorm(c.hidden_size, c.rms_norm_eps, c.norm_style)
        # latent_moe: the latent mixture of experts (tensor-parallel over tp_group).
        self.mlp = KimiK3LatentMoE(c, tp_group) if c.latent_moe else KimiK3MLP(c)
        self.use_attn_res = c.attn_res
        if c.attn_res:
            bs = c.attn_res_block_size
            self.is_block_write_layer = layer_idx % bs == 0
            # Block-write layers before this one: ceil(layer_idx / bs).
            self.prev_valid_blocks = -(-layer_idx // bs)
            # Where this layer appends its block (used only if it writes).
            self.block_write_idx = self.prev_valid_blocks
            self.attn_res = KimiK3AttnRes(
                c.hidden_size, c.rms_norm_eps, c.norm_style, c.attn_res_precision
            )
            self.mlp_res = KimiK3AttnRes(
                c.hidden_size, c.rms_norm_eps, c.norm_style, c.attn_res_precision
            )

    def forward(
        self,
        hidden_states: Tensor,
        bank: AttnResBank | None = None,
        delta: Tensor | None = None,
        *,
        handoff: bool = False,
    ) -> Tensor | tuple[Tensor, AttnResBank] | tuple[Tensor, AttnResBank, Tensor]:
        """Plain: hidden [B, S, H] -> hidden.  attn_res: (prefix, bank) -> (prefix, bank),
        or the hand-off form (see :meth:`forward_attn_res`)."""
        if self.use_attn_res:
            if bank is None:
                raise ValueError("an attn_res decoder layer needs the block bank")
            return self.forward_attn_res(hidden_states, bank, delta, handoff=handoff)
        if delta is not None or handoff:
            raise ValueError("delta / handoff are for attn_res decoder layers only")
        # Plain pre-norm residuals.
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states))
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states

    def forward_attn_res(
        self,
        prefix: Tensor,
        bank: AttnResBank,
        delta: Tensor | None = None,
        *,
        handoff: bool = False,
    ) -> tuple[Tensor, AttnResBank] | tuple[Tensor, AttnResBank, Tensor]:
        """One layer: ``(prefix, bank) -> (prefix + mlp_out, bank)``.

        Delta hand-off (what ``KimiK3Model.attn_res_handoff`` runs): ``handoff=True``
        returns ``(prefix, bank, mlp_out)`` without the closing add, and the next layer
        takes ``mlp_out`` as ``delta``: its first AttnRes step adds it to the prefix
        (``apply_attn_res(..., delta=delta)``: the same model-dtype ``prefix + mlp_out``,
        and at a block-write layer the block written is that sum). The last layer's goes
        to the final AttnRes step. A fused step computes the sum in its kernel instead of
        reading it back from memory.
        """
        write = self.is_block_write_layer
        h, prefix, bank = self.apply_attn_res(
            prefix,
            bank,
            self.attn_res,
            self.prev_valid_blocks,
            delta=delta,
            output_norm=self.input_layernorm,
            block_write_idx=self.block_write_idx if write else -1,
        )
        h = self.self_attn(h)
        if write:  # block closed: the prefix restarts from the attention output
            prefix, delta = h, None
        else:
            delta = h
        mlp_blocks = self.prev_valid_blocks + (1 if write else 0)
        h, prefix, bank = self.apply_attn_res(
            prefix,
            bank,
            self.mlp_res,
            mlp_blocks,
            delta=delta,
            output_norm=self.post_attention_layernorm,
        )
        h = self.mlp(h)
        if handoff:
            return prefix, bank, h
        prefix = prefix + h
        return prefix, bank


class KimiK3Model(AttnResStep, nn.Module):
    #: attn_res only. False (the reference): every layer returns ``prefix + mlp_out``.
    #: True: every layer hands its MLP output to the next layer's first AttnRes step (the
    #: last layer's to the final one) as that step's ``delta`` -- the same arithmetic
    #: (see :meth:`KimiK3DecoderLayer.forward_attn_res`), so a fused step adds it in its
    #: kernel. A plain attribute, not state: ``k3fusion.eager.patch_model`` sets it.
    #: Forward hooks on the layers then see ``(prefix, bank, mlp_out)``.
    attn_res_handoff: bool = False

    def __init__(self, config: KimiK3Config, tp_group: object = None) -> None:
        super().__init__()
        _check_supported(config)
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            KimiK3DecoderLayer(config, layer_idx, tp_group)
            for layer_idx in range(config.num_layers)
        )
        self.norm = KimiK3RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_style)
        if config.attn_res:
            # The final mix over all blocks + the last prefix (no output norm of
            # its own: ``norm`` follows).
            self.max_blocks = config.attn_res_max_blocks
            self.final_res = KimiK3AttnRes(
                config.hidden_size, config.rms_norm_eps, config.norm_style,
                config.attn_res_precision,
            )

    def forward(self, input_ids: Tensor) -> Tensor:
        hidden_states = self.embed_tokens(input_ids)
        if not self.config.attn_res:
            for layer in self.layers:
                hidden_states = layer(hidden_states)
            return self.norm(hidden_states)

        prefix = hidden_states
        bank: AttnResBank
        if self.config.attn_res_bank == "list":
            bank = []
        else:
            bsz, seq, hidden = prefix.shape
            bank = torch.zeros(
                bsz, seq, self.max_blocks, hidden, dtype=prefix.dtype, device=prefix.device
            )
        delta = None
        if self.attn_res_handoff:  # each MLP output goes to the next AttnRes step as delta
            for layer in self.layers:
                prefix, bank, delta = layer(prefix, bank, delta, handoff=True)
        else:
            for layer in self.layers:
                prefix, bank = layer(prefix, bank)
        hidden_states, _, _ = self.apply_attn_res(
            prefix, bank, self.final_res, self.max_blocks, delta=delta
        )
        return self.norm(hidden_states)


class KimiK3ForCausalLM(nn.Module):
    def __init__(
        self, config: KimiK3Config, *, seed: int | None = None, tp_group: object = None
    ) -> None:
        """Build and initialize the model in ``config.dtype``.

        ``seed`` makes the init independent of the global RNG; without it the
        global RNG is used (so ``torch.manual_seed`` beforehand also works).
        ``tp_group``: the latent MoE's tensor-parallel process group (None: tp=1);
        the weights it then holds are this rank's shards (see
        :func:`tp_shard_state_dict`).
        """
        super().__init__()
        self.config = config
        self.model = KimiK3Model(config, tp_group)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._init_weights(seed)
        self.to(config.dtype)

    @torch.no_grad()
    def _init_weights(self, seed: int | None) -> None:
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        # Initialize in fp32 (params are still fp32 on CPU here), then cast once.
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                w = module.weight
                w.copy_(torch.randn(w.shape, generator=gen) * 0.02)
            elif isinstance(module, KimiK3RMSNorm):
                # Not ones, so a pass that drops or misplaces the weight shows up.
                w = module.weight
                w.copy_(1.0 + 0.1 * torch.randn(w.shape, generator=gen))
        # AttnRes pseudo-queries (after the loop, which gave them the generic
        # 0.02 init; models without attn_res draw exactly as before).  The keys
        # are RMS-normalized (|key| ~ sqrt(H)), so std c/sqrt(H) gives logits of
        # std ~c across sources: 0.02 would make every softmax near-uniform.
        for module in self.modules():
            if isinstance(module, KimiK3AttnRes):
                w = module.proj.weight
                std = _ATTN_RES_QUERY_STD / math.sqrt(w.shape[-1])
                w.copy_(torch.randn(w.shape, generator=gen) * std)
        # Latent-MoE correction biases (after the loops above, so models without
        # latent_moe draw exactly as before): small, but enough to move selection.
        for module in self.modules():
            if isinstance(module, KimiK3LatentMoE):
                b = module.e_score_correction_bias
                b.copy_(torch.randn(b.shape, generator=gen) * _MOE_BIAS_STD)

    @property
    def mla_layers(self) -> int:
        return count_mla_layers(self)

    @property
    def attn_res_sites(self) -> int:
        return count_attn_res_sites(self)

    def forward(self, input_ids: Tensor) -> Tensor:
        """input_ids [B, S] (int64) -> logits [B, S, vocab_size] in config.dtype."""
        return self.lm_head(self.model(input_ids))


def count_mla_layers(model: nn.Module) -> int:
    """Number of MLA attention modules (each owns one q/kv norm pair)."""
    return sum(isinstance(m, KimiK3Attention) for m in model.modules())


def count_attn_res_sites(model: nn.Module) -> int:
    """Number of AttnRes sites: 2 per layer + the final one (0 without attn_res)."""
    return sum(isinstance(m, KimiK3AttnRes) for m in model.modules())
