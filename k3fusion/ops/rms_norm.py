"""``k3fusion::rms_norm``: one RMSNorm in one launch (the latent-MoE tail's unfused tiers);
``k3fusion::rms_norm_and_copy``: the same launch also copying the shared partial (tp = 1)."""

from __future__ import annotations

from typing import Optional

import torch

from .. import kernels, reference
from ..reference import FLOAT_DTYPES
from ._args import new_norm_output, as_rows, runs_kernel, check_rms_norm_args
from ._backward import differentiate_by_reference

__all__ = ["rms_norm", "rms_norm_and_copy"]


def _check(x, w, eps, weight_in_fp32, norm_dtype) -> None:
    check_rms_norm_args(x, w, eps)
    if norm_dtype is not None:
        if norm_dtype not in FLOAT_DTYPES:
            raise TypeError(f"norm_dtype must be float32, bfloat16 or float16, got {norm_dtype}")
        if weight_in_fp32:
            raise ValueError("norm_dtype applies to the cast-then-weight form only "
                             "(weight_in_fp32=False)")


@torch.library.custom_op("k3fusion::rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, w: torch.Tensor, eps: float, weight_in_fp32: bool = False,
                norm_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``k3fusion.reference.rms_norm`` in one Triton launch (the fp32 sum of squares in
    another order than torch's ``mean``: within that rounding of the reference).
    ``norm_dtype``: cast-then-weight's rounding dtype when it is not ``x``'s."""
    raise NotImplementedError(f"k3fusion::rms_norm has no kernel for {x.device.type}")


@rms_norm_op.register_fake
def _(x, w, eps, weight_in_fp32=False, norm_dtype=None):
    _check(x, w, eps, weight_in_fp32, norm_dtype)
    return new_norm_output(x, w, weight_in_fp32, norm_dtype)


@rms_norm_op.register_kernel(("cpu", "cuda"))
def _(x, w, eps, weight_in_fp32=False, norm_dtype=None):
    _check(x, w, eps, weight_in_fp32, norm_dtype)
    if not runs_kernel(x):
        # Same layout as the fake impl promises (the reference keeps permuted inputs' strides).
        return reference.rms_norm(x, w, eps, weight_in_fp32, norm_dtype).contiguous()
    y = new_norm_output(x, w, weight_in_fp32, norm_dtype)
    # The launcher is looked up per call: tests swap in a spy (tests/_kernel_paths.py).
    kernels.rms_norm.rms_norm(as_rows(x), w, eps, as_rows(y), weight_in_fp32=weight_in_fp32,
                     norm_dtype=norm_dtype)
    return y


# ---------------------------------------------------------------------- norm + copy


def _check_copy(x, other) -> None:
    if not isinstance(other, torch.Tensor):
        raise TypeError(f"other must be a Tensor, got {type(other).__name__}")
    if other.device != x.device:
        raise ValueError(f"other is on {other.device} but x is on {x.device}")
    if other.dim() < 1 or tuple(other.shape[:-1]) != tuple(x.shape[:-1]):
        raise ValueError(f"other must have x's leading dims {tuple(x.shape[:-1])}, got shape "
                         f"{tuple(other.shape)}")
    if not reference.last_dim_contiguous(other):
        raise ValueError(f"other must be contiguous in its last dim, got stride {other.stride(-1)}")


@torch.library.custom_op("k3fusion::rms_norm_and_copy", mutates_args=())
def rms_norm_and_copy(x: torch.Tensor, w: torch.Tensor, eps: float, other: torch.Tensor,
                      weight_in_fp32: bool = False,
                      norm_dtype: Optional[torch.dtype] = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x, w, eps, ...), other.clone())`` in the norm's one launch (``other``
    has ``x``'s leading dims; the copy is contiguous). The tail's tp = 1 unfused tiers
    beta-add the GEMM into the copy in place (``addmm_``), so the add needs no launch of
    its own; the norm is :func:`rms_norm`'s, bit for bit."""
    raise NotImplementedError(f"k3fusion::rms_norm_and_copy has no kernel for {x.device.type}")


@rms_norm_and_copy.register_fake
def _(x, w, eps, other, weight_in_fp32=False, norm_dtype=None):
    _check(x, w, eps, weight_in_fp32, norm_dtype)
    _check_copy(x, other)
    return (new_norm_output(x, w, weight_in_fp32, norm_dtype),
            other.new_empty(other.shape))


@rms_norm_and_copy.register_kernel(("cpu", "cuda"))
def _(x, w, eps, other, weight_in_fp32=False, norm_dtype=None):
    _check(x, w, eps, weight_in_fp32, norm_dtype)
    _check_copy(x, other)
    if not runs_kernel(x):
        y = reference.rms_norm(x, w, eps, weight_in_fp32, norm_dtype).contiguous()
        return y, other.clone(memory_format=torch.contiguous_format)
    y = new_norm_output(x, w, weight_in_fp32, norm_dtype)
    out = other.new_empty(other.shape)
    kernels.rms_norm.rms_norm(as_rows(x), w, eps, as_rows(y), weight_in_fp32=weight_in_fp32,
                              norm_dtype=norm_dtype,
                              copy=(as_rows(other), out.view(-1, other.shape[-1])))
    return y, out


differentiate_by_reference(rms_norm_op, reference.rms_norm)


def rms_norm(x, w, eps, weight_in_fp32=False, norm_dtype=None):
    """``torch.ops.k3fusion.rms_norm`` after checking the arguments as given (the op's
    schema would turn ``eps=True`` or a 0-dim tensor into a float first)."""
    _check(x, w, eps, weight_in_fp32, norm_dtype)
    return torch.ops.k3fusion.rms_norm(x, w, eps, weight_in_fp32, norm_dtype)
