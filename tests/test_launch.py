"""``kernels/_launch.py``: the counter buffers the synchronizing kernels share."""

from __future__ import annotations

import torch

from k3fusion.kernels import _launch


def test_counter_buffer_is_cached_zeroed_and_never_freed_when_grown():
    cpu = torch.device("cpu")
    a = _launch.counter_buffer("test", cpu, 10, torch.int64)
    assert a.dtype == torch.int64 and a.numel() >= 10 and not a.any()
    assert _launch.counter_buffer("test", cpu, a.numel(), torch.int64) is a  # cached
    assert _launch.counter_buffer("other", cpu, 10, torch.int64) is not a    # per name
    b = _launch.counter_buffer("test", cpu, a.numel() + 1, torch.int64)     # grown
    assert b is not a and b.numel() > a.numel() and not b.any()
    # A captured CUDA graph may still hold the old address: it stays alive.
    assert any(r is a for r in _launch._retired)
    assert _launch.counter_buffer("test", cpu, 5, torch.int64) is b
