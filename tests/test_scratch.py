"""``kernels/_scratch.py``: who owns the words a synchronizing kernel's programs exchange.

An eager launch: zeroed words of its own, every call. A launch captured into a CUDA graph,
of a kernel that leaves its words ready for the next launch (``reusable``): a slice of a
per-device arena for good -- no memset node in every replay -- never handed to another
launch. Here the capture state and the arena's allocation are stand-ins (CPU); the GPU
half (real captures, replays on two streams at once, a CUDA-graph tree's pool) is in
``tests/test_launch.py``.
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path

import pytest
import torch

from k3fusion.kernels import _scratch

CUDA0 = torch.device("cuda", 0)


@pytest.fixture
def fake(monkeypatch):
    """CPU stand-ins: capture state under the test's control, arenas and fresh words as
    CPU tensors, arenas of 4 KiB (limit 12 KiB), a clean registry."""
    state = dict(capturing=False, made=0, fresh=0)

    def zeroed(device, nbytes):
        state["made"] += 1
        return torch.zeros(nbytes, dtype=torch.uint8)

    def fresh(device, size, dtype):
        state["fresh"] += 1
        return torch.zeros(size, dtype=dtype)

    monkeypatch.setattr(_scratch, "_capturing", lambda device: state["capturing"])
    monkeypatch.setattr(_scratch, "_zeroed_outside_any_pool", zeroed)
    monkeypatch.setattr(_scratch, "_fresh_zeros", fresh)
    monkeypatch.setattr(_scratch, "ARENA_BYTES", 4096)
    monkeypatch.setattr(_scratch, "ARENA_LIMIT_BYTES", 3 * 4096)
    monkeypatch.setattr(_scratch, "_arenas", {})
    monkeypatch.setattr(_scratch, "_warned", set())
    return state


def _span(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def test_cpu_launches_get_fresh_zeroed_words():
    cpu = torch.device("cpu")
    a = _scratch.launch_scratch(cpu, 10, torch.int64, reusable=True)
    b = _scratch.launch_scratch(cpu, 10, torch.int64)
    assert a.dtype == torch.int64 and a.numel() == 10 and not a.any()
    assert a.data_ptr() != b.data_ptr()
    assert _scratch.launch_scratch(cpu, 0, torch.int32).numel() == 1  # a pointer to pass


def test_eager_launches_get_fresh_words_and_make_one_arena(fake):
    words = [_scratch.launch_scratch(CUDA0, 100, torch.int64, reusable=True) for _ in range(3)]
    assert fake["fresh"] == 3 and fake["made"] == 1
    assert _scratch.arena_stats(0) == {"arenas": 1, "bytes_handed_out": 0}
    assert _scratch.arena_stats(CUDA0) == _scratch.arena_stats("cuda:0") == _scratch.arena_stats(0)
    assert all(w.numel() == 100 and not w.any() for w in words)


def test_not_reusable_never_makes_or_takes_an_arena(fake):
    _scratch.launch_scratch(CUDA0, 8, torch.int32)
    fake["capturing"] = True
    _scratch.launch_scratch(CUDA0, 8, torch.int32)
    assert fake["made"] == 0 and fake["fresh"] == 2


def test_captured_launches_take_disjoint_aligned_zeroed_slices(fake):
    _scratch.launch_scratch(CUDA0, 1, torch.int64, reusable=True)  # warm-up: the arena
    fake["capturing"] = True
    sizes = [(3, torch.int64), (5, torch.int32), (1, torch.int64), (64, torch.int32)]
    got = [_scratch.launch_scratch(CUDA0, n, dt, reusable=True) for n, dt in sizes]
    assert fake["fresh"] == 1  # only the warm-up's
    base = _scratch._arenas[0][-1].words.data_ptr()  # (a CUDA allocation is 512-B aligned)
    for t, (n, dt) in zip(got, sizes):
        assert t.dtype == dt and t.numel() == n and not t.any()
        assert (t.data_ptr() - base) % _scratch.SLICE_ALIGN_BYTES == 0
    spans = sorted(_span(t) for t in got)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans
    assert _scratch.arena_stats(0)["bytes_handed_out"] == 3 * 256 + 64 * 4


def test_a_capture_before_any_arena_zeroes_its_own_words_and_warns_once(fake):
    fake["capturing"] = True
    with pytest.warns(UserWarning, match="no launch outside a capture made an arena"):
        a = _scratch.launch_scratch(CUDA0, 4, torch.int64, reusable=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        b = _scratch.launch_scratch(CUDA0, 4, torch.int64, reusable=True)
    assert fake["fresh"] == 2 and fake["made"] == 0  # never an arena inside a capture
    assert not a.any() and not b.any()


def test_arenas_grow_outside_captures_up_to_the_limit(fake):
    _scratch.launch_scratch(CUDA0, 1, torch.int64, reusable=True)
    fake["capturing"] = True
    for _ in range(14):  # 14 x 256 B: under a quarter of 4 KiB left
        _scratch.launch_scratch(CUDA0, 32, torch.int64, reusable=True)
    fake["capturing"] = False
    _scratch.launch_scratch(CUDA0, 1, torch.int64, reusable=True)
    assert fake["made"] == 2
    fake["capturing"] = True
    taken = [_scratch.launch_scratch(CUDA0, 512, torch.int64, reusable=True)]  # 4 KiB
    fake["capturing"] = False
    _scratch.launch_scratch(CUDA0, 1, torch.int64, reusable=True)  # third and last arena
    _scratch.launch_scratch(CUDA0, 1, torch.int64, reusable=True)
    assert fake["made"] == 3
    fake["capturing"] = True
    taken.append(_scratch.launch_scratch(CUDA0, 512, torch.int64, reusable=True))
    fresh_before = fake["fresh"]
    with pytest.warns(UserWarning, match="more than its arena has left"):
        late = _scratch.launch_scratch(CUDA0, 8, torch.int64, reusable=True)
    assert fake["fresh"] == fresh_before + 1 and not late.any()
    fake["capturing"] = False
    _scratch.launch_scratch(CUDA0, 1, torch.int64, reusable=True)
    assert fake["made"] == 3  # the limit holds
    assert _span(taken[0]) != _span(taken[1])


def test_a_slice_larger_than_an_arena_zeroes_its_own_words(fake):
    _scratch.launch_scratch(CUDA0, 1, torch.int64, reusable=True)
    fake["capturing"] = True
    with pytest.warns(UserWarning):
        big = _scratch.launch_scratch(CUDA0, 4096, torch.int64, reusable=True)
    assert big.numel() == 4096 and fake["fresh"] == 2


def test_the_measurement_switch_zeroes_captured_words(fake, monkeypatch):
    monkeypatch.setattr(_scratch, "GRAPH_WORDS", False)
    _scratch.launch_scratch(CUDA0, 1, torch.int64, reusable=True)
    fake["capturing"] = True
    _scratch.launch_scratch(CUDA0, 1, torch.int64, reusable=True)
    assert fake["made"] == 0 and fake["fresh"] == 2


def test_threads_capturing_at_once_never_share_a_slice(fake):
    _scratch.launch_scratch(CUDA0, 1, torch.int64, reusable=True)
    fake["capturing"] = True
    got, barrier = [], threading.Barrier(4)

    def take():
        barrier.wait()
        for _ in range(3):
            got.append(_span(_scratch.launch_scratch(CUDA0, 16, torch.int64, reusable=True)))

    threads = [threading.Thread(target=take) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    spans = sorted(got)
    assert len(spans) == 12 and all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def test_words_of_graphs_that_died_within_a_scope_are_zeroed_and_handed_out_again(fake):
    _scratch.launch_scratch(CUDA0, 1, torch.int64, reusable=True)
    fake["capturing"] = True
    kept = _scratch.launch_scratch(CUDA0, 4, torch.int64, reusable=True)
    kept.fill_(7)  # a live graph's words
    with _scratch.graphs_die_within():
        inner = _scratch.launch_scratch(CUDA0, 4, torch.int64, reusable=True)
        inner.fill_(5)  # a replay's epochs
    again = _scratch.launch_scratch(CUDA0, 4, torch.int64, reusable=True)
    assert _span(again) == _span(inner) and not again.any()
    assert kept.tolist() == [7] * 4 and _span(kept) != _span(again)


def test_an_arena_that_cannot_be_made_now_is_made_by_a_later_launch(fake, monkeypatch):
    """Another thread's capture (global mode) forbids the allocation, or memory is short:
    the launch goes on with fresh words; a later launch outside a capture makes the arena."""
    real = _scratch._zeroed_outside_any_pool

    def refuse(device, nbytes):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(_scratch, "_zeroed_outside_any_pool", refuse)
    words = _scratch.launch_scratch(CUDA0, 4, torch.int64, reusable=True)
    assert not words.any() and _scratch.arena_stats(0)["arenas"] == 0
    monkeypatch.setattr(_scratch, "_zeroed_outside_any_pool", real)
    _scratch.launch_scratch(CUDA0, 4, torch.int64, reusable=True)
    assert _scratch.arena_stats(0)["arenas"] == 1 and fake["made"] == 1


@pytest.mark.parametrize("bench", ["decoder", "attn_res_sweep", "moe_tail"])
def test_benchmarks_take_the_memset_switch_and_record_it(bench, monkeypatch):
    """``--scratch-memset`` (an A/B of the arena) turns captured launches' words back to a
    memset per launch for the whole run, and the run's environment says which it was."""
    import importlib

    from k3fusion.bench import common

    monkeypatch.setattr(_scratch, "GRAPH_WORDS", True)
    module = importlib.import_module(f"k3fusion.bench.{bench}")
    if bench == "attn_res_sweep":  # it parses inside main: the table-printing path
        saved = str(Path(__file__).parents[1] / "docs" / "attn_res_decode_sweep_2026-12-04.json")
        parse = lambda argv: module.main(argv + ["--tables-from", saved])  # noqa: E731
    else:
        parse = {"decoder": lambda argv: module._parse(argv),
                 "moe_tail": lambda argv: module.parser().parse_args(argv)}[bench]
    parse([])
    assert _scratch.GRAPH_WORDS and common.environment("cpu")["scratch"] == "arena"
    parse(["--scratch-memset"])
    assert not _scratch.GRAPH_WORDS and common.environment("cpu")["scratch"] == "memset"
