"""The latent-MoE tail's argument rules: one check for every entry point of the family.

The tier entry points (``k3fusion.moe_tail``), the ``k3fusion::latent_moe_tail`` op, the
symmetric-memory tail and the fused kernel's launcher (``kernels/moe_tail.py``) validate
their tensors with :func:`check_latent_moe_tail_args`, then add their own limits (token
counts, process groups, devices). A leaf module (torch and ``k3fusion.reference`` only),
outside the ``k3fusion.moe_tail`` package, so that the kernel layer below the tiers can
use it without importing them.
"""

from __future__ import annotations

import math

import torch

from . import reference

__all__ = ["check_latent_moe_tail_args"]


def check_latent_moe_tail_args(routed_latent, shared, norm_w, eps, up_w,
                               norm_dtype: torch.dtype | None = None,
                               weight_in_fp32: bool = False, *, direct: bool = False) -> None:
    """Validate a tail call; TypeError/ValueError naming the argument.

    ``routed_latent [..., L]`` and ``shared [..., H]`` with the same leading dims,
    ``norm_w [L]``, ``up_w [H, L]``, one device, contiguous last dims, and one dtype for
    the normed latent, ``up_w`` and ``shared`` (the column-parallel tier adds the GEMM
    into ``shared`` in place, so no promotion may happen there). ``direct``: the form the
    kernel launcher and the symmetric-memory tail take -- 2-D ``[T, L]`` / ``[T, H]``
    partials and a bool ``weight_in_fp32``.
    """
    for name, t in (("routed_latent", routed_latent), ("shared", shared), ("norm_w", norm_w),
                    ("up_w", up_w)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be finite and >= 0, got {eps}")
    if direct:
        if not isinstance(weight_in_fp32, bool):
            raise TypeError(f"weight_in_fp32 must be a bool, got {type(weight_in_fp32).__name__}")
        for name, t, dims in (("routed_latent", routed_latent, "[T, L]"),
                              ("shared", shared, "[T, H]")):
            if t.dim() != 2:
                raise ValueError(f"{name} must be 2-D {dims}, got shape {tuple(t.shape)}")
    if routed_latent.dim() < 1:
        raise ValueError("routed_latent must have at least 1 dim ([..., L]), got a 0-dim tensor")
    if norm_w.dim() != 1:
        raise ValueError(f"norm_w must be 1-D [L], got shape {tuple(norm_w.shape)}")
    if up_w.dim() != 2:
        raise ValueError(f"up_w must be 2-D [H, L], got shape {tuple(up_w.shape)}")
    for name, t in (("routed_latent", routed_latent), ("norm_w", norm_w)):
        if t.dtype not in reference.FLOAT_DTYPES:
            raise TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")
    for name, t in (("norm_w", norm_w), ("shared", shared), ("up_w", up_w)):
        if t.device != routed_latent.device:
            raise ValueError(f"{name} is on {t.device} but routed_latent is on "
                             f"{routed_latent.device}")
    latent, hidden = routed_latent.shape[-1], up_w.shape[0]
    if latent == 0:
        raise ValueError("routed_latent rows must not be empty (L = 0)")
    if norm_w.shape[0] != latent:
        raise ValueError(f"norm_w has {norm_w.shape[0]} elements but routed_latent rows are "
                         f"{latent} wide")
    if up_w.shape[1] != latent:
        raise ValueError(f"up_w is {tuple(up_w.shape)} but routed_latent rows are {latent} wide "
                         f"(up_w must be [H, L={latent}])")
    if hidden == 0:
        raise ValueError("up_w has no rows (H = 0)")
    if shared.dim() < 1 or shared.shape[-1] != hidden:
        raise ValueError(f"shared must be [..., H={hidden}] (up_w's rows), got {tuple(shared.shape)}")
    lead, shared_lead = tuple(routed_latent.shape[:-1]), tuple(shared.shape[:-1])
    if shared_lead != lead:
        raise ValueError(f"shared must be [{', '.join(map(str, lead + ('H',)))}]: shared leading "
                         f"dims {shared_lead} differ from routed_latent leading dims {lead}")
    for name, t in (("routed_latent", routed_latent), ("shared", shared), ("up_w", up_w)):
        if not reference.last_dim_contiguous(t):
            raise ValueError(f"{name} must be contiguous in its last dim, got stride {t.stride(-1)}")
    if not reference.last_dim_contiguous(norm_w):
        raise ValueError(f"norm_w must be contiguous, got stride {norm_w.stride(0)}")
    if norm_dtype is not None:
        if norm_dtype not in reference.FLOAT_DTYPES:
            raise TypeError(f"norm_dtype must be None or a float dtype, got {norm_dtype}")
        if weight_in_fp32:
            raise ValueError("norm_dtype applies to the cast-then-weight norm only "
                             "(weight_in_fp32=False)")
    normed = reference.rms_norm_out_dtype(routed_latent.dtype, norm_w.dtype, weight_in_fp32,
                                          norm_dtype)
    if not normed == up_w.dtype == shared.dtype:
        raise TypeError(
            f"dtypes must agree: rms_norm(routed_latent {routed_latent.dtype}, norm_w "
            f"{norm_w.dtype}, weight_in_fp32={weight_in_fp32}) gives {normed}, up_w is "
            f"{up_w.dtype}, shared is {shared.dtype}")
