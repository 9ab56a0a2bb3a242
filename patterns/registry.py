"""Every graph fusion k3fusion has, in one ordered tuple that every layer iterates.

:data:`FUSIONS` is the order users see them in (``match_counts()``, the CLI's rows, the
docs' tables); :func:`claim_order` the order the pass lets them claim norms. Adding a
fusion: its module in each layer (``patterns/``, ``k3fusion/eager/``, ...), named as the
fusion, exporting ``FUSION`` here, plus its line below.
"""

from __future__ import annotations

from . import attn_res, moe_tail, qkv_rmsnorm
from .fusion import Fusion

__all__ = ["FUSIONS", "COUNT_NAMES", "claim_order", "by_name"]

FUSIONS: tuple[Fusion, ...] = (
    qkv_rmsnorm.FUSION,
    attn_res.FUSION,
    moe_tail.FUSION,
)

#: Every ``match_counts()`` key, in the order it lists them.
COUNT_NAMES: tuple[str, ...] = tuple(name for f in FUSIONS for name in f.count_names)


def claim_order(fusions: tuple[Fusion, ...] = FUSIONS) -> list[Fusion]:
    """``fusions`` in the order they claim norms (lowest ``claim_priority`` first)."""
    return sorted(fusions, key=lambda f: f.claim_priority)


def by_name(name: str) -> Fusion:
    """The fusion called ``name`` (a KeyError naming the known ones if none is)."""
    for f in FUSIONS:
        if f.name == name:
            return f
    raise KeyError(f"no fusion {name!r}; known: {', '.join(f.name for f in FUSIONS)}")
