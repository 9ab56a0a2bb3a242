"""The interface every graph fusion exports (``patterns/<fusion>.py``: ``FUSION``).

A fusion's ``run(graph, norms)`` rewrites the sites it matches among the recognized
RMSNorms it is given and says what it did in a :class:`FusionResult`; the pass manager
hands it the norms no fusion before it claimed. Which fusion claims first is its
``claim_priority`` (lowest first); a fusion may also ``reserve`` norms at an earlier
priority, which the fusions claiming in between do not get. The order of the fusions
themselves (``patterns.registry.FUSIONS``) is the order users see them in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional

from torch.fx import Graph, Node

from .rms_norm import RMSNormMatch

__all__ = ["FusionResult", "Reservation", "Fusion"]


@dataclass(frozen=True)
class FusionResult:
    """What one fusion did to a graph."""

    #: ``match_counts()`` key -> rewrites, for the keys this run counts (a fusion leaves
    #: out a sub-count, or a count of sites the graph does not have, as it chooses).
    counts: dict[str, int]
    #: The outputs of the norms its rewrites folded (no other fusion may take them).
    claimed: frozenset[Node]
    #: The debug log's lines for the candidates it left alone, each with its reason.
    misses: tuple[str, ...]


@dataclass(frozen=True)
class Reservation:
    """Norms a fusion takes before its turn: ``take(graph, norms)`` -> their outputs,
    withheld from the fusions that claim between ``priority`` and the fusion's own."""

    priority: int
    take: Callable[[Graph, list[RMSNormMatch]], set[Node]]


@dataclass(frozen=True)
class Fusion:
    """One graph fusion, as the pass manager, the counters, ``explain`` and the CLI see it."""

    #: Its name: its ``match_counts()`` key and the name of its module in each layer.
    name: str
    #: The ``FusionConfig`` field that switches it on.
    switch: str
    #: When it claims norms, against the other fusions (lowest first).
    claim_priority: int
    run: Callable[[Graph, list[RMSNormMatch]], FusionResult]
    #: Every ``match_counts()`` key its runs may count, its own name first.
    count_names: tuple[str, ...]
    #: ``explain``'s word for a candidate it left alone, and the pattern that reads one of
    #: its miss lines back into (the candidate's node name, the reason).
    miss_kind: str
    miss_line: re.Pattern
    reservation: Optional[Reservation] = None
    #: Its miss lines when switched off, for the norms that reach its turn (a fusion that
    #: explains every norm it is handed says they are left because it is off).
    when_off: Optional[Callable[[list[RMSNormMatch]], tuple[str, ...]]] = None
