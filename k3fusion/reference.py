"""Reference semantics in plain torch: the spec every fused path is tested against.

These functions are deliberately written the obvious way; ``docs/ops.md`` states the same
contracts in words (roundings, in-place effects, tiers). The CPU implementations of the
custom ops call them, and the tests compare the Triton kernels, the custom ops and
compiled graphs with them.
"""

from __future__ import annotations

import torch

__all__ = ["FLOAT_DTYPES", "last_dim_contiguous", "rms_norm", "dual_rms_norm", "rms_norm_out_dtype", "attn_res",
           "latent_moe_tail", "all_reduce"]

#: The floating dtypes every op takes (inputs, weights, ``norm_dtype``).
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def last_dim_contiguous(t: torch.Tensor) -> bool:
    """The layout every op asks of a tensor it reads by rows: stride 1 in the last dim.
    A size-1 last dim's stride is meaningless, and a tensor with no elements may have any
    strides (Inductor gives zero-element buffers stride 0)."""
    return t.shape[-1] <= 1 or t.stride(-1) == 1 or t.numel() == 0


def rms_norm_out_dtype(x_dtype: torch.dtype, w_dtype: torch.dtype, weight_in_fp32: bool,
                       norm_dtype: torch.dtype | None = None) -> torch.dtype:
    """Output dtype of :func:`rms_norm`, i.e. what the source graph produced.

    cast-then-weight ``(...).to(x.dtype) * w`` promotes with the weight (a bf16 input
    with an fp32 weight gives fp32; ``norm_dtype`` replaces ``x.dtype`` in the cast);
    weight-in-fp32 ``(... * w.float()).to(x.dtype)`` always gives the input dtype.
    """
    if weight_in_fp32:
        return x_dtype
    return torch.promote_types(x_dtype if norm_dtype is None else norm_dtype, w_dtype)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, weight_in_fp32: bool = False,
             norm_dtype: torch.dtype | None = None) -> torch.Tensor:
    """RMSNorm over the last dim.

    ``weight_in_fp32=False`` (cast-then-weight, HF / vLLM ``forward_native``)::

        (x.float() * rsqrt(mean(x.float()**2, -1) + eps)).to(x.dtype) * w

    ``weight_in_fp32=True``::

        (x.float() * rsqrt(mean(x.float()**2, -1) + eps) * w.float()).to(x.dtype)

    ``norm_dtype`` (cast-then-weight only): the normalized row is cast to it instead of
    ``x.dtype`` -- T5's ``LayerNorm`` on an fp32 input with a bf16 weight, or an fp32
    input whose 16-bit round trip Inductor removed.
    """
    if norm_dtype is not None and weight_in_fp32:
        raise ValueError("norm_dtype applies to the cast-then-weight form only")
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight_in_fp32:
        return (normed * w.float()).to(x.dtype)
    return normed.to(x.dtype if norm_dtype is None else norm_dtype) * w


def dual_rms_norm(
    x1: torch.Tensor,
    w1: torch.Tensor,
    eps1: float,
    x2: torch.Tensor,
    w2: torch.Tensor,
    eps2: float,
    weight_in_fp32_1: bool = False,
    weight_in_fp32_2: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two independent :func:`rms_norm` calls (one launch in the fused kernel)."""
    return rms_norm(x1, w1, eps1, weight_in_fp32_1), rms_norm(x2, w2, eps2, weight_in_fp32_2)


def attn_res(
    prefix: torch.Tensor,
    blocks: torch.Tensor,
    num_blocks: int,
    norm_w: torch.Tensor,
    proj_w: torch.Tensor,
    eps: float,
    delta: torch.Tensor | None = None,
    block_write_idx: int = -1,
    out_norm_w: torch.Tensor | None = None,
    out_eps: float = 1e-6,
    out_weight_in_fp32: bool = False,
) -> torch.Tensor:
    """Block Attention Residuals: a softmax mix over completed blocks and the prefix.

    ``prefix [T, H]``, ``blocks [T, NBmax, H]`` (any strides but a contiguous last dim),
    in this order (mutating ``prefix`` and ``blocks`` in place):

    1. with ``delta``: ``prefix <- (prefix.float() + delta.float()).to(prefix.dtype)``;
       the rounded value is what the later steps read;
    2. ``block_write_idx >= 0``: ``blocks[:, block_write_idx] <- prefix`` (an append: the
       index must be >= ``num_blocks``);
    3. sources ``v_s``: ``blocks[:, :num_blocks]``, then ``prefix``;
    4. ``logit_s = rsqrt(mean(v_s**2) + eps) * sum(v_s * norm_w * proj_w)``, in fp32;
    5. ``mixed = sum_s softmax(logit)_s * v_s`` (raw values, fp32);
    6. without ``out_norm_w``: ``mixed.to(prefix.dtype)``; with it,
       ``rms_norm(mixed.to(prefix.dtype), out_norm_w, out_eps, out_weight_in_fp32)`` --
       the mix is rounded to the model dtype first, as a module materializes it before
       its next norm.
    """
    if delta is not None:
        prefix.copy_((prefix.float() + delta.float()).to(prefix.dtype))
    if block_write_idx >= 0:
        if block_write_idx < num_blocks:
            raise ValueError(f"block_write_idx {block_write_idx} would overwrite a live source "
                             f"(num_blocks={num_blocks})")
        blocks[:, block_write_idx].copy_(prefix)
    sources = torch.cat([blocks[:, :num_blocks], prefix.unsqueeze(1)], dim=1).float()
    inv_rms = torch.rsqrt(sources.pow(2).mean(-1) + eps)
    logits = inv_rms * (sources * norm_w.float() * proj_w.float()).sum(-1)
    weights = torch.softmax(logits, dim=-1)
    mixed = (weights.unsqueeze(-1) * sources).sum(1).to(prefix.dtype)
    if out_norm_w is None:
        return mixed
    return rms_norm(mixed, out_norm_w, out_eps, out_weight_in_fp32)


# ====================================================================== latent-MoE tail



def all_reduce(t: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``t`` over ``group`` with a functional collective (traces under torch.compile);
    ``group=None`` is tp=1: ``t`` itself. Never modifies ``t``."""
    if group is None:
        return t
    import torch.distributed._functional_collectives as funcol

    out = funcol.all_reduce(t, "sum", group)
    # Eager gives an AsyncCollectiveTensor: wait now (a trace has already emitted the wait).
    return out.trigger_wait() if isinstance(out, funcol.AsyncCollectiveTensor) else out


def latent_moe_tail(
    routed_latent: torch.Tensor,
    shared: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
    up_w: torch.Tensor,
    group=None,
    weight_in_fp32: bool = False,
    norm_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The latent-MoE tail: ``all_reduce(shared) + rms_norm(all_reduce(routed_latent)) @ up_w.T``.

    ``routed_latent [..., L]`` and ``shared [..., H]`` are this rank's partial sums over the
    tensor-parallel ``group`` (``None``: tp=1, no collective); ``norm_w [L]``; ``up_w [H, L]``
    is replicated on every rank. :func:`rms_norm` is cast-then-weight unless
    ``weight_in_fp32``. Returns ``[..., H]``, the same on every rank; inputs are not modified.
    """
    h = rms_norm(all_reduce(routed_latent, group), norm_w, eps, weight_in_fp32, norm_dtype)
    return all_reduce(shared, group) + h @ up_w.T
