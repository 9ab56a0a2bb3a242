"""A fusion's entry in :func:`k3fusion.eager.patch_model`'s table.

Each fusion's eager module, named as the fusion (``k3fusion/eager/<fusion>.py``), exports
one ``PATCHER``; ``patch.py`` finds it through the fusion registry.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from torch import nn

__all__ = ["Patcher"]


class Patcher(NamedTuple):
    """``detects(module) -> bool``: the module has the fusion's contract. ``patch(name,
    module) -> [(report key, None if patched else why skipped)]``, entries in the order the
    report lists them."""

    #: The fusion's name (``patterns.registry``).
    fusion: str
    detects: Callable[[nn.Module], bool]
    patch: Callable[[str, nn.Module], list[tuple[str, "str | None"]]]
    #: Where it is tried on a module, lowest first: a module with several contracts lists
    #: its patches in this order in the report.
    order: int
