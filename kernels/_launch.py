"""What every launcher needs: where a Triton kernel can run, and small helpers."""

from __future__ import annotations

import os

import torch

__all__ = ["cdiv", "interpreter_enabled", "check_launchable"]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def interpreter_enabled() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``).

    Triton reads the variable when a kernel is *decorated*, so it must be set before
    ``k3fusion`` is imported; :func:`check_launchable` says so if it was set later.
    """
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _kernels_are_interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    from .dual_rms_norm import _dual_rms_norm_kernel

    return isinstance(_dual_rms_norm_kernel, InterpretedFunction)


def check_launchable(*tensors: torch.Tensor) -> None:
    """Raise a clear error instead of a Triton crash when the kernel cannot run here."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    (device,) = devices
    if device.type == "cuda":
        return
    if device.type == "cpu" and _kernels_are_interpreted():
        return
    if device.type == "cpu" and interpreter_enabled():
        raise RuntimeError(
            "TRITON_INTERPRET=1 was set after k3fusion's kernels were imported; "
            "set it before importing k3fusion to run the Triton kernels on CPU"
        )
    raise RuntimeError(
        f"k3fusion's Triton kernels run on CUDA (or on CPU with TRITON_INTERPRET=1), "
        f"not on {device.type}"
    )
