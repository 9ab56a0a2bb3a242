"""The ``torch.ops.k3fusion`` custom ops: what the graph passes insert and eager wrappers call.

Every op has

* a fake (meta) implementation, so it traces under torch.compile with dynamic shapes;
* a CUDA implementation that launches the Triton kernel;
* a CPU implementation in plain torch (``k3fusion.reference``), or the Triton kernel in
  Triton's interpreter when ``TRITON_INTERPRET=1`` (how the kernels are tested on CPU).

Arguments are validated here, before any launch, with errors that name the argument.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from . import reference
from .config import get_config

__all__ = ["dual_rms_norm", "check_rms_norm_args"]

_NORM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_rms_norm_args(x: torch.Tensor, w: torch.Tensor, eps: float, *, x_name: str = "x",
                        w_name: str = "w", eps_name: str = "eps") -> None:
    """Validate one RMSNorm's inputs; raise TypeError/ValueError naming the argument."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{x_name} must be a Tensor, got {type(x).__name__}")
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{w_name} must be a Tensor, got {type(w).__name__}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"{eps_name} must be a float, got {type(eps).__name__}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"{eps_name} must be finite and >= 0, got {eps}")
    if x.dim() < 1:
        raise ValueError(f"{x_name} must have at least 1 dim ([..., hidden]), got a 0-dim tensor")
    if w.dim() != 1:
        raise ValueError(f"{w_name} must be 1-D [hidden], got shape {tuple(w.shape)}")
    if x.dtype not in _NORM_DTYPES:
        raise TypeError(f"{x_name} must be float32, bfloat16 or float16, got {x.dtype}")
    if w.dtype not in _NORM_DTYPES:
        raise TypeError(f"{w_name} must be float32, bfloat16 or float16, got {w.dtype}")
    if w.shape[0] != x.shape[-1]:
        raise ValueError(
            f"{w_name} has {w.shape[0]} elements but {x_name} rows are {x.shape[-1]} wide"
        )
    if x.shape[-1] == 0:
        raise ValueError(f"{x_name} rows must not be empty (last dim is 0)")
    if x.stride(-1) != 1 and x.shape[-1] > 1:  # a size-1 dim's stride is meaningless
        raise ValueError(
            f"{x_name} must be contiguous in its last dim (stride 1), got stride {x.stride(-1)}"
        )
    if w.stride(0) != 1 and w.shape[0] > 1:
        raise ValueError(f"{w_name} must be contiguous, got stride {w.stride(0)}")
    if w.device != x.device:
        raise ValueError(f"{w_name} is on {w.device} but {x_name} is on {x.device}")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 2-D ``[T, N]`` row view; copies only if the leading dims cannot be merged."""
    n = t.shape[-1]
    try:
        return t.view(-1, n)
    except RuntimeError:
        return t.reshape(-1, n)


def _new_norm_output(x: torch.Tensor, w: torch.Tensor, weight_in_fp32: bool) -> torch.Tensor:
    dtype = reference.rms_norm_out_dtype(x.dtype, w.dtype, weight_in_fp32)
    return x.new_empty(x.shape, dtype=dtype)


def _check_eps_tensor(eps_tensor: torch.Tensor | None, name: str) -> None:
    if eps_tensor is None:
        return
    if eps_tensor.dim() != 0 or not eps_tensor.dtype.is_floating_point:
        raise ValueError(f"{name} must be a 0-dim floating tensor, got shape "
                         f"{tuple(eps_tensor.shape)} and dtype {eps_tensor.dtype}")
    if eps_tensor.device.type != "cpu":
        # Reading a GPU scalar on the host would be a device sync in the launch path.
        raise ValueError(f"{name} must be on the CPU, got {eps_tensor.device}")


def _eps_value(eps: float, eps_tensor: torch.Tensor | None, name: str) -> float:
    if eps_tensor is None:
        return eps
    value = float(eps_tensor)  # a CPU scalar: a host read, not a device sync
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must hold a finite eps >= 0, got {value}")
    return value


def _check_dual(x1, w1, eps1, x2, w2, eps2, eps1_tensor=None, eps2_tensor=None) -> None:
    check_rms_norm_args(x1, w1, eps1, x_name="x1", w_name="w1", eps_name="eps1")
    check_rms_norm_args(x2, w2, eps2, x_name="x2", w_name="w2", eps_name="eps2")
    _check_eps_tensor(eps1_tensor, "eps1_tensor")
    _check_eps_tensor(eps2_tensor, "eps2_tensor")
    if x1.device != x2.device:
        raise ValueError(f"x1 is on {x1.device} but x2 is on {x2.device}")


@torch.library.custom_op("k3fusion::dual_rms_norm", mutates_args=())
def dual_rms_norm(
    x1: torch.Tensor,
    w1: torch.Tensor,
    eps1: float,
    x2: torch.Tensor,
    w2: torch.Tensor,
    eps2: float,
    weight_in_fp32_1: bool = False,
    weight_in_fp32_2: bool = False,
    eps1_tensor: Optional[torch.Tensor] = None,
    eps2_tensor: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two RMSNorms in one launch; see ``k3fusion.reference.dual_rms_norm``.

    ``eps1_tensor``/``eps2_tensor`` are the compiler's form of eps: with
    ``torch.compile(dynamic=True)`` a module's float eps becomes a 0-dim CPU tensor
    input of the graph. When given, it replaces ``eps1``/``eps2``.
    """
    raise NotImplementedError(f"k3fusion::dual_rms_norm has no kernel for {x1.device.type}")


@dual_rms_norm.register_fake
def _(x1, w1, eps1, x2, w2, eps2, weight_in_fp32_1=False, weight_in_fp32_2=False,
      eps1_tensor=None, eps2_tensor=None):
    _check_dual(x1, w1, eps1, x2, w2, eps2, eps1_tensor, eps2_tensor)
    return _new_norm_output(x1, w1, weight_in_fp32_1), _new_norm_output(x2, w2, weight_in_fp32_2)


def _dual_rms_norm_triton(x1, w1, eps1, x2, w2, eps2, weight_in_fp32_1, weight_in_fp32_2):
    from k3fusion.kernels import dual_rms_norm as launch

    y1 = _new_norm_output(x1, w1, weight_in_fp32_1)
    y2 = _new_norm_output(x2, w2, weight_in_fp32_2)
    launch(
        _rows(x1), w1, eps1, _rows(x2), w2, eps2, _rows(y1), _rows(y2),
        weight_in_fp32_1, weight_in_fp32_2,
        rows_per_program=get_config().dual_norm_rows_per_program,
    )
    return y1, y2


@dual_rms_norm.register_kernel("cuda")
def _(x1, w1, eps1, x2, w2, eps2, weight_in_fp32_1=False, weight_in_fp32_2=False,
      eps1_tensor=None, eps2_tensor=None):
    _check_dual(x1, w1, eps1, x2, w2, eps2, eps1_tensor, eps2_tensor)
    eps1 = _eps_value(eps1, eps1_tensor, "eps1_tensor")
    eps2 = _eps_value(eps2, eps2_tensor, "eps2_tensor")
    return _dual_rms_norm_triton(x1, w1, eps1, x2, w2, eps2, weight_in_fp32_1, weight_in_fp32_2)


@dual_rms_norm.register_kernel("cpu")
def _(x1, w1, eps1, x2, w2, eps2, weight_in_fp32_1=False, weight_in_fp32_2=False,
      eps1_tensor=None, eps2_tensor=None):
    _check_dual(x1, w1, eps1, x2, w2, eps2, eps1_tensor, eps2_tensor)
    eps1 = _eps_value(eps1, eps1_tensor, "eps1_tensor")
    eps2 = _eps_value(eps2, eps2_tensor, "eps2_tensor")
    from k3fusion.kernels._launch import interpreter_enabled

    if interpreter_enabled():
        return _dual_rms_norm_triton(x1, w1, eps1, x2, w2, eps2, weight_in_fp32_1, weight_in_fp32_2)
    y1, y2 = reference.dual_rms_norm(x1, w1, eps1, x2, w2, eps2, weight_in_fp32_1, weight_in_fp32_2)
    # Same layout as the fake impl promises (the reference keeps permuted inputs' strides).
    return y1.contiguous(), y2.contiguous()
