"""Per-fusion match counts since the last reset (what ``k3fusion.match_counts()`` reads).

The pass records its matches in ``torch._dynamo.utils.counters["inductor"]`` (keys
``k3fusion.<fusion>``). Inductor saves the change in that counter with each graph it
caches and adds it back when it serves the graph from its FX graph cache (also through
the AOTAutograd cache, in memory or on disk, in another process), so a warm compile,
which runs no custom pass, counts the same matches as the cold one.

Rule: :func:`match_counts` has a key for every count a fusion of ``patterns.registry``
keeps (:data:`FUSIONS`, in the registry's order), 0 when nothing matched since the reset
(or the fusion is switched off).

A reset stores the current totals as a baseline next to them (keys
``k3fusion.reset_at.<fusion>``), so clearing the torch counters (``counters.clear()``,
as torch's own test cases do) clears the baseline with them and the counts start at 0.
"""

from __future__ import annotations

from collections import Counter

from .patterns.registry import COUNT_NAMES

__all__ = ["FUSIONS", "match_counts", "reset_match_counts", "record_matches"]

#: Every ``match_counts()`` key: the registry's fusions and the sub-counts they keep.
FUSIONS = COUNT_NAMES

_COUNT_KEY = "k3fusion.{}"
_BASELINE_KEY = "k3fusion.reset_at.{}"


def _inductor_counters() -> Counter[str]:
    from torch._dynamo.utils import counters

    return counters["inductor"]


def record_matches(fusion: str, n: int) -> None:
    """Add ``n`` matches of ``fusion`` (called by the pass, inside Inductor's compile)."""
    if fusion not in FUSIONS:
        raise ValueError(f"fusion must be one of {FUSIONS}, got {fusion!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    if n:
        _inductor_counters()[_COUNT_KEY.format(fusion)] += n


def match_counts() -> dict[str, int]:
    """``{fusion: matches}`` since :func:`reset_match_counts`, every fusion a key.

    Cache hits count: a graph served from Inductor's FX graph cache adds the matches
    the pass made when it compiled that graph.
    """
    c = _inductor_counters()
    counts = {}
    for fusion in FUSIONS:
        total = c.get(_COUNT_KEY.format(fusion), 0)
        baseline = c.get(_BASELINE_KEY.format(fusion), 0)
        # total < baseline: someone cleared only the totals; count from 0 again.
        counts[fusion] = total - baseline if total >= baseline else total
    return counts


def reset_match_counts() -> None:
    """Start counting from 0 (for every fusion)."""
    c = _inductor_counters()
    for fusion in FUSIONS:
        total = c.get(_COUNT_KEY.format(fusion), 0)
        key = _BASELINE_KEY.format(fusion)
        if total:
            c[key] = total
        else:
            c.pop(key, None)
