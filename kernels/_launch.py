"""What every launcher needs: where a Triton kernel can run, and small helpers."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

__all__ = ["cdiv", "interpreter_enabled", "kernels_are_interpreted", "check_launchable",
           "on_tensor_device", "TL_DTYPES", "gdc_launch_dependents", "gdc_wait",
           "cuda_properties", "cuda_index", "pdl_available", "pdl_launch", "dependent_start",
           "dependents_may_start",
           "DEFAULT_SMS", "num_sms", "byte_span", "spans_meet", "may_overlap", "same_view"]

try:  # programmatic dependent launch (sm_90+): a norm launch's overlap with the kernel after it
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton: launchers refuse pdl=True
    gdc_launch_dependents = gdc_wait = None

#: The Triton dtype of each torch dtype a kernel takes as a constexpr (rounding targets).
TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def on_tensor_device(launcher):
    """Run ``launcher`` with its first tensor argument's CUDA device current.

    Triton launches on the *current* device's current stream, not on the tensors' device:
    with the data on ``cuda:1`` and ``cuda:0`` current (one process driving several GPUs,
    e.g. a model split across them), a launch would run on the wrong device's stream or be
    refused. A CPU first tensor (the interpreter, or a launcher's own error path) runs as is.
    """

    @functools.wraps(launcher)
    def launch(*args, **kwargs):
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if first is None or first.device.type != "cuda":
            return launcher(*args, **kwargs)
        with torch.cuda.device(first.device):
            return launcher(*args, **kwargs)

    return launch


def interpreter_enabled() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``).

    Triton reads the variable when a kernel is *decorated*, so it must be set before
    ``k3fusion`` is imported; :func:`check_launchable` says so if it was set later.
    """
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _interpret_flag() -> bool:
    """Triton's own interpreter flag, the one ``triton.jit`` reads when it decorates."""
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is not None and hasattr(runtime, "interpret"):
        return bool(runtime.interpret)
    return interpreter_enabled()  # a Triton without that knob reads the variable itself


#: Whether this package's kernels were decorated for the interpreter: they are decorated in
#: the same package import as this module (no kernel import here: that was an import circle).
_INTERPRETED_AT_IMPORT = _interpret_flag()


def kernels_are_interpreted() -> bool:
    return _INTERPRETED_AT_IMPORT


@functools.lru_cache(maxsize=None)
def cuda_properties(index: int):
    # Asked once per device: every default launch reads them (a decode step's launch path).
    return torch.cuda.get_device_properties(index)


def cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


#: SMs assumed where there is no GPU to ask (the interpreter): a full Hopper's.
DEFAULT_SMS = 132


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a fixed guess off CUDA)."""
    if device.type != "cuda":
        return DEFAULT_SMS
    return cuda_properties(cuda_index(device)).multi_processor_count


def pdl_available(device: torch.device) -> bool:
    """Whether launches on ``device`` run as programmatic dependents: NVIDIA sm_90+ with a
    Triton that has ``gdc_wait`` (not ROCm, whose capability numbers overlap); on CPU the
    interpreter runs a PDL form's two launches one after the other."""
    if device.type == "cpu":
        return True
    if device.type != "cuda" or torch.version.hip is not None or gdc_wait is None:
        return False
    props = cuda_properties(cuda_index(device))
    return (props.major, props.minor) >= (9, 0)


def pdl_launch(device: torch.device, pdl: bool | None) -> bool:
    """Whether a single-launch kernel with a ``PDL`` switch runs as a programmatic dependent
    of the launch before it: ``pdl`` None means wherever :func:`pdl_available` says so on a
    GPU; True off a GPU that can is an error. The interpreter never does (inline PTX)."""
    if pdl is not None and not isinstance(pdl, bool):
        raise TypeError(f"pdl must be a bool or None, got {type(pdl).__name__}")
    on_gpu = device.type == "cuda" and pdl_available(device)
    if pdl and not on_gpu:
        raise ValueError(f"pdl=True needs an sm_90+ CUDA device and a Triton with "
                         f"triton.language.extra.cuda.gdc_wait, got {device}")
    return on_gpu if pdl is None else pdl


@triton.jit
def dependent_start(PDL: tl.constexpr, LATE_TRIGGER: tl.constexpr = False):
    """First thing in a kernel with a ``PDL`` switch (see :func:`pdl_launch`): launched as
    the previous launch's programmatic dependent, it waits for it -- and through it for
    everything before -- before any load (weights included: a training step may have just
    written them), then lets the next launch start (``LATE_TRIGGER``: not yet; the kernel
    calls :func:`dependents_may_start` after its last store)."""
    if PDL:
        gdc_wait()
        if not LATE_TRIGGER:
            gdc_launch_dependents()


@triton.jit
def dependents_may_start(PDL: tl.constexpr, LATE_TRIGGER: tl.constexpr):
    """Last thing in a kernel whose :func:`dependent_start` left the trigger for later."""
    if PDL and LATE_TRIGGER:
        gdc_launch_dependents()


def check_launchable(*tensors: torch.Tensor) -> None:
    """Raise a clear error instead of a Triton crash when the kernel cannot run here."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    (device,) = devices
    if device.type == "cuda":
        return
    if device.type == "cpu" and kernels_are_interpreted():
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


def same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same view: one first element, strides and shape."""
    return a.data_ptr() == b.data_ptr() and a.stride() == b.stride() and a.shape == b.shape


def byte_span(t: torch.Tensor, skip_dim: int | None = None, index: int = 0):
    """``[first, last + 1)`` byte addresses of ``t``'s elements (of ``t.select(skip_dim,
    index)`` when given, without making the view); None when there are none."""
    shape, strides = list(t.shape), list(t.stride())
    base, item = t.data_ptr(), t.element_size()
    if skip_dim is not None:
        base += index * strides[skip_dim] * item
        del shape[skip_dim], strides[skip_dim]
    lo = hi = 0
    for n, st in zip(shape, strides):
        if n == 0:
            return None
        if st < 0:
            lo += (n - 1) * st
        else:
            hi += (n - 1) * st
    return base + lo * item, base + (hi + 1) * item


def spans_meet(sa, sb) -> bool:
    """Whether two :func:`byte_span` ranges share a byte."""
    return sa is not None and sb is not None and sa[0] < sb[1] and sb[0] < sa[1]


def may_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Conservative: False only if ``a`` and ``b`` share no byte (host-side, O(dims)).
    The arguments are on one device (checked before)."""
    return spans_meet(byte_span(a), byte_span(b))
