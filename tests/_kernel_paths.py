"""Choosing which CPU implementation an op runs, and watching its Triton launcher."""

from __future__ import annotations

import contextlib

import pytest

import k3fusion.kernels
from k3fusion.kernels._launch import kernels_are_interpreted

__all__ = ["cpu_path", "spy_on_launcher"]


@contextlib.contextmanager
def cpu_path(path: str):
    """``"kernel"``: TRITON_INTERPRET=1 (the Triton kernel); ``"reference"``: unset.

    The ops read the variable at call time; the kernels were decorated at import, so the
    kernel path exists only where they were decorated for the interpreter (the CPU suite):
    elsewhere (a GPU machine's run) the test is skipped."""
    if path == "kernel" and not kernels_are_interpreted():
        pytest.skip("the CPU kernel path needs TRITON_INTERPRET=1 before k3fusion's import")
    with pytest.MonkeyPatch.context() as mp:
        if path == "kernel":
            mp.setenv("TRITON_INTERPRET", "1")
        else:
            mp.delenv("TRITON_INTERPRET", raising=False)
        yield


#: Each launcher the ops call, and its module under ``k3fusion.kernels``.
LAUNCHER_MODULES = {"attn_res": "attn_res", "dual_rms_norm": "qkv_rmsnorm",
                    "rms_norm": "rms_norm", "latent_moe_tail_fused": "moe_tail"}


@contextlib.contextmanager
def spy_on_launcher(name: str, record: str):
    """Record, per call of launcher ``name`` (``k3fusion.kernels.<module>.<name>``, looked
    up there by the ops at each call), the value of its keyword argument ``record``."""
    calls = []
    module = getattr(k3fusion.kernels, LAUNCHER_MODULES[name])
    real = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(kwargs.get(record))
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(module, name, spy)
        yield calls
