"""Per-fusion match counts since the last reset (what ``k3fusion.match_counts()`` reads).

Counts are taken when a graph is compiled. A compile served from Inductor's FX graph
cache runs no custom pass and counts nothing: tests that count disable the caches.
"""

from __future__ import annotations

from collections import Counter

__all__ = ["match_counts", "reset_match_counts", "record_matches"]

_counts: Counter[str] = Counter()


def record_matches(fusion: str, n: int) -> None:
    _counts[fusion] += n


def match_counts() -> dict[str, int]:
    """``{fusion_name: matches}`` since :func:`reset_match_counts` (fusions that ran)."""
    return dict(_counts)


def reset_match_counts() -> None:
    _counts.clear()
