"""Argument checks and helpers the ops share: errors name the argument; which path runs."""

from __future__ import annotations

import math

import torch

from .. import reference
from ..kernels._launch import interpreter_enabled
from ..reference import FLOAT_DTYPES, last_dim_contiguous

__all__ = ["check_rms_norm_args", "check_eps", "check_eps_tensor", "eps_value", "runs_kernel",
           "as_rows", "new_norm_output"]


def check_eps(eps: float, name: str) -> None:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(eps).__name__}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"{name} must be finite and >= 0, got {eps}")


def check_rms_norm_args(x: torch.Tensor, w: torch.Tensor, eps: float, *, x_name: str = "x",
                        w_name: str = "w", eps_name: str = "eps") -> None:
    """Validate one RMSNorm's inputs; raise TypeError/ValueError naming the argument."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{x_name} must be a Tensor, got {type(x).__name__}")
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{w_name} must be a Tensor, got {type(w).__name__}")
    check_eps(eps, eps_name)
    if x.dim() < 1:
        raise ValueError(f"{x_name} must have at least 1 dim ([..., hidden]), got a 0-dim tensor")
    if w.dim() != 1:
        raise ValueError(f"{w_name} must be 1-D [hidden], got shape {tuple(w.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{x_name} must be float32, bfloat16 or float16, got {x.dtype}")
    if w.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{w_name} must be float32, bfloat16 or float16, got {w.dtype}")
    if w.shape[0] != x.shape[-1]:
        raise ValueError(
            f"{w_name} has {w.shape[0]} elements but {x_name} rows are {x.shape[-1]} wide"
        )
    if x.shape[-1] == 0:
        raise ValueError(f"{x_name} rows must not be empty (last dim is 0)")
    if not last_dim_contiguous(x):
        raise ValueError(
            f"{x_name} must be contiguous in its last dim (stride 1), got stride {x.stride(-1)}"
        )
    if not last_dim_contiguous(w):
        raise ValueError(f"{w_name} must be contiguous, got stride {w.stride(0)}")
    if w.device != x.device:
        raise ValueError(f"{w_name} is on {w.device} but {x_name} is on {x.device}")


def runs_kernel(t: torch.Tensor) -> bool:
    """Whether an op on ``t``'s device runs the Triton kernel: always on CUDA; on CPU in
    Triton's interpreter (``TRITON_INTERPRET=1``, read per call), else ``k3fusion.reference``."""
    return t.device.type == "cuda" or interpreter_enabled()


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 2-D ``[T, N]`` row view; copies only if the leading dims cannot be merged."""
    n = t.shape[-1]
    try:
        return t.view(-1, n)
    except RuntimeError:
        return t.reshape(-1, n)


def new_norm_output(x: torch.Tensor, w: torch.Tensor, weight_in_fp32: bool,
                    norm_dtype: torch.dtype | None = None) -> torch.Tensor:
    dtype = reference.rms_norm_out_dtype(x.dtype, w.dtype, weight_in_fp32, norm_dtype)
    return x.new_empty(x.shape, dtype=dtype)


def check_eps_tensor(eps_tensor: torch.Tensor | None, name: str) -> None:
    if eps_tensor is None:
        return
    if eps_tensor.dim() != 0 or not eps_tensor.dtype.is_floating_point:
        raise ValueError(f"{name} must be a 0-dim floating tensor, got shape "
                         f"{tuple(eps_tensor.shape)} and dtype {eps_tensor.dtype}")
    if eps_tensor.device.type != "cpu":
        # Reading a GPU scalar on the host would be a device sync in the launch path.
        raise ValueError(f"{name} must be on the CPU, got {eps_tensor.device}")


def eps_value(eps: float, eps_tensor: torch.Tensor | None, name: str) -> float:
    if eps_tensor is None:
        return eps
    value = float(eps_tensor)  # a CPU scalar: a host read, not a device sync
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must hold a finite eps >= 0, got {value}")
    return value
