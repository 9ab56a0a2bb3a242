"""Scratch words for kernels whose programs exchange data through global memory (the
tail's split-K arrival counters, the AttnRes split kernel's epoch-tagged records).

No two launches that can run at once share words (docs/design-notes.md, "Scratch
memory"). An eager launch gets zeroed words of its own from the caching allocator. A
launch captured into a CUDA graph, of a kernel that leaves its words ready for the next
launch on them (``reusable``), keeps a slice of a per-device arena for good: zeroed once,
never handed out again, so no memset node runs in every replay; the graph is its only
user, and CUDA runs one graph's replays one after another.

The arena is made at a launch outside any capture (a warm-up), by a thread of its own,
so that no CUDA-graph pool routes it (a tree's warm-up routes its thread's allocations
to the tree's pool). Slices are never given back, so a device gets at most
:data:`ARENA_LIMIT_BYTES`; past it, or before any arena exists, a captured launch zeroes
its words in the graph as an eager one does: slower, never different.
"""

from __future__ import annotations

import contextlib
import threading
import warnings

import torch

from ._launch import cuda_index

__all__ = ["launch_scratch", "ARENA_BYTES", "ARENA_LIMIT_BYTES", "SLICE_ALIGN_BYTES",
           "arena_stats", "graphs_die_within"]

#: Bytes of one arena; a new one is made, outside a capture, once less than a quarter is left.
ARENA_BYTES = 8 << 20
#: The most bytes of arenas a device gets; then captured launches zero their own words.
ARENA_LIMIT_BYTES = 128 << 20
#: Each slice starts on its own 256-byte boundary (no two launches' words share a line).
SLICE_ALIGN_BYTES = 256

#: Switch for measurements (docs/bench-methods.md): False zeroes captured launches' words too.
GRAPH_WORDS = True


class _Arena:
    def __init__(self, words: torch.Tensor):
        self.words = words  # uint8 view of zeroed memory
        self.used = 0

    def take(self, nbytes: int) -> torch.Tensor | None:
        start = -(-self.used // SLICE_ALIGN_BYTES) * SLICE_ALIGN_BYTES
        if start + nbytes > self.words.numel():
            return None
        self.used = start + nbytes
        return self.words[start:start + nbytes]


_lock = threading.Lock()
_arenas: dict[int, list[_Arena]] = {}  # device index -> its arenas, the newest last
_warned: set[int] = set()


def _capturing(device: torch.device) -> bool:
    return torch.cuda.is_current_stream_capturing()


def _zeroed_outside_any_pool(device: torch.device, nbytes: int) -> torch.Tensor:
    """``nbytes`` zeroed bytes from the default pool, allocated and zeroed by another
    thread (pool routing is per thread), finished before this returns."""
    made: list = []

    def alloc():
        try:
            with torch.cuda.device(device):
                t = torch.zeros(nbytes, dtype=torch.uint8, device=device)
                torch.cuda.current_stream(device).synchronize()
                made.append(t)
        except BaseException as exc:  # re-raised in the caller's thread
            made.append(exc)

    worker = threading.Thread(target=alloc, name="k3fusion-scratch-arena")
    worker.start()
    worker.join()
    if isinstance(made[0], BaseException):
        raise made[0]
    return made[0]


def _has_room(arenas: list[_Arena]) -> bool:
    return bool(arenas) and arenas[-1].words.numel() - arenas[-1].used >= ARENA_BYTES // 4


def _grow_if_low(device: torch.device) -> None:
    """Outside a capture: make an arena where there is none or under a quarter is left.
    If that allocation fails (another thread's capture forbids it, no memory), nothing is
    made now: captured launches zero their own words until a later launch makes one."""
    index = cuda_index(device)
    if _has_room(_arenas.get(index, [])):  # the common case, without the lock
        return
    with _lock:
        arenas = _arenas.setdefault(index, [])
        if _has_room(arenas) or (len(arenas) + 1) * ARENA_BYTES > ARENA_LIMIT_BYTES:
            return
        try:
            words = _zeroed_outside_any_pool(torch.device(device.type, index), ARENA_BYTES)
        except RuntimeError:
            return
        arenas.append(_Arena(words))


def _graph_slice(device: torch.device, nbytes: int) -> torch.Tensor | None:
    index = cuda_index(device)
    with _lock:
        arenas = _arenas.get(index) or []
        words = arenas[-1].take(nbytes) if arenas and nbytes <= ARENA_BYTES else None
        if words is None and index not in _warned:
            _warned.add(index)
            reason = ("no launch outside a capture made an arena first" if not arenas else
                      f"{nbytes} bytes are more than its arena has left")
            warnings.warn(f"k3fusion: a launch captured on cuda:{index} zeroes its scratch "
                          f"words in the graph ({reason}): a memset node in every replay, "
                          f"same results (docs/design-notes.md, \"Scratch memory\"); "
                          f"warned once per device", stacklevel=4)
        return words


def launch_scratch(device: torch.device, size: int, dtype: torch.dtype, *,
                   reusable: bool = False) -> torch.Tensor:
    """``size`` (at least 1) zeroed words of ``dtype`` for one launch; see the module
    docstring for who owns them. ``reusable``: the kernel leaves its words ready for the
    next launch on them, so a captured launch may take arena words for good."""
    size = max(size, 1)
    if reusable and GRAPH_WORDS and device.type == "cuda":
        if _capturing(device):
            nbytes = size * dtype.itemsize
            words = _graph_slice(device, nbytes)
            if words is not None:
                return words.view(dtype)
        else:
            _grow_if_low(device)
    return _fresh_zeros(device, size, dtype)


def _fresh_zeros(device: torch.device, size: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(size, dtype=dtype, device=device)


def arena_stats(device: torch.device | int | None = None) -> dict[str, int]:
    """Arenas made on a CUDA device and bytes handed out to captured launches."""
    index = device if isinstance(device, int) else cuda_index(torch.device(device or "cuda"))
    with _lock:
        arenas = _arenas.get(index, [])
        return {"arenas": len(arenas), "bytes_handed_out": sum(a.used for a in arenas)}


@contextlib.contextmanager
def graphs_die_within():
    """For a caller whose graphs captured inside are all gone when it ends (a benchmark's
    timing of one graph): the arena words handed out inside are zeroed and handed out
    again afterwards, so repeated captures do not use the arenas up. A graph that
    outlives it could share words with a later one: never wrap a model's capture in it."""
    with _lock:
        used_before = {id(a): a.used for arenas in _arenas.values() for a in arenas}
    try:
        yield
    finally:
        with _lock:
            for arenas in _arenas.values():
                for arena in arenas:
                    used = used_before.get(id(arena), 0)  # 0: made inside
                    if arena.used > used:
                        arena.words[used:arena.used].zero_()
                        arena.used = used
                if arenas and arenas[0].words.is_cuda:
                    torch.cuda.synchronize(arenas[0].words.device)
