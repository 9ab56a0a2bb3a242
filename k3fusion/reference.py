"""Reference semantics in plain torch: the spec every fused path is tested against.

These functions are deliberately written the obvious way (see ``DESIGN.md``, "Op
contracts"). The CPU implementations of the custom ops call them, and the tests compare
the Triton kernels, the custom ops and compiled graphs with them.
"""

from __future__ import annotations

import torch

__all__ = ["rms_norm", "dual_rms_norm", "rms_norm_out_dtype"]


def rms_norm_out_dtype(x_dtype: torch.dtype, w_dtype: torch.dtype, weight_in_fp32: bool) -> torch.dtype:
    """Output dtype of :func:`rms_norm`, i.e. what the source graph produced.

    cast-then-weight ``(...).to(x.dtype) * w`` promotes with the weight (a bf16 input
    with an fp32 weight gives fp32); weight-in-fp32 ``(... * w.float()).to(x.dtype)``
    always gives the input dtype.
    """
    return x_dtype if weight_in_fp32 else torch.promote_types(x_dtype, w_dtype)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, weight_in_fp32: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim.

    ``weight_in_fp32=False`` (cast-then-weight, HF / vLLM ``forward_native``)::

        (x.float() * rsqrt(mean(x.float()**2, -1) + eps)).to(x.dtype) * w

    ``weight_in_fp32=True``::

        (x.float() * rsqrt(mean(x.float()**2, -1) + eps) * w.float()).to(x.dtype)
    """
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight_in_fp32:
        return (normed * w.float()).to(x.dtype)
    return normed.to(x.dtype) * w


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
