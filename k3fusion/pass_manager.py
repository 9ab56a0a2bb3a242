"""The post-grad pass that runs every k3fusion fusion, as an Inductor ``CustomGraphPass``.

Order: recognize all RMSNorms once (``patterns.rms_norm``), then let each enabled fusion
of ``patterns.registry`` claim what it matches, by its claim priority (docs/architecture.md,
"Claims between fusions"). Norms no fusion claims stay the aten ops they were. A fusion
that fails on a graph (a bug) leaves the graph as it was, with a warning: k3fusion never
fails a compile.

``uuid()`` hashes the pattern sources, the op registry, the config and the torch version,
so Inductor's FX graph cache never serves a graph compiled under other rules.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path

import torch
from torch._inductor import custom_graph_pass
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx import Graph, Node

from . import patterns
from .config import FusionConfig, get_config
from .counters import record_matches
from .joint_retrace import retrace_joint
# fuse_attn_res stays importable here: tests/test_compile_never_fails.py patches it in
# this module (the registry's FUSION.run reaches it through patterns.attn_res).
from .patterns.attn_res import fuse_attn_res  # noqa: F401
from .patterns._fx import (CHANGE_HOOK, SavedValues, is_backward_graph, joint_backward_values,
                           recompute_in_backward, restore, saved_for_backward, saving, snapshot)
from .patterns.fusion import Fusion
from .patterns.registry import claim_order
from .patterns.rms_norm import anchor_name, find_rms_norms

__all__ = ["K3FusionPass", "K3JointPass", "ComposedPass", "compose_with"]

log = logging.getLogger("k3fusion")

#: Raise a fusion's own error instead of leaving the graph unfused with a warning (the
#: test suite sets it: there a bug must fail the test, not hide behind the fallback).
RAISE_INTERNAL_ERRORS = False


def _digest_files() -> list[Path]:
    """Every source file whose change changes what the pass does (or what tracing its ops
    runs: their fake implementations and argument checks)."""
    files = sorted(Path(patterns.__file__).parent.glob("*.py"))
    root = Path(__file__).parent
    files += [root / name for name in ("pass_manager.py", "joint_retrace.py", "reference.py",
                                       "config.py", "counters.py")]
    files += sorted((root / "ops").glob("*.py"))
    # the tail op's fake implementation and argument rules run while a graph is traced
    files += [root / "moe_tail" / "op.py", root / "moe_tail_args.py"]
    return files


@functools.lru_cache(maxsize=None)
def _source_digest() -> str:
    """Hash of :func:`_digest_files`."""
    h = hashlib.sha256()
    for f in _digest_files():
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def _claim_steps(config: FusionConfig) -> list[tuple[Fusion, bool]]:
    """``(fusion, reserves)`` in the order of their priorities: every fusion's claim (one
    switched off may still explain the norms that reach its turn), and an enabled fusion's
    reservation where another enabled fusion claims between it and the owner's claim (a
    reservation only matters to those)."""
    on = [f for f in claim_order() if getattr(config, f.switch)]
    steps = [(f.claim_priority, f, False) for f in claim_order()]
    for f in on:
        r = f.reservation
        if r is not None and any(r.priority < g.claim_priority < f.claim_priority
                                 for g in on if g is not f):
            steps.append((r.priority, f, True))
    return [(f, reserves) for _, f, reserves in sorted(steps, key=lambda s: s[0])]


class K3FusionPass(CustomGraphPass):
    """Runs the k3fusion fusions on a post-grad FX graph (in place).

    ``config=None`` uses :func:`k3fusion.get_config` at the time of each call.
    """

    def __init__(self, config: FusionConfig | None = None) -> None:
        self._config = config

    @property
    def config(self) -> FusionConfig:
        return self._config if self._config is not None else get_config()

    def __call__(self, graph: Graph) -> None:
        """Run the fusions (see :meth:`_guarded`). A backward graph is left alone: what it
        recomputes of a fused site is the gradient formulas' business (counts are the
        forward's)."""
        if is_backward_graph(graph):
            return
        _record_joint_counts(graph)
        # The forward of a training pair: values returned for the backward stay
        # computed, and are no reason to leave a site unfused (patterns/_fx.py).
        self._guarded(graph, saved_for_backward(graph))

    def _guarded(self, graph: Graph, values: SavedValues) -> bool:
        """Run the fusions, not counting the reads in ``values``; on an error of a fusion
        itself (a bug: matching never raises on a graph it does not understand) the graph
        goes back to what it was, a warning says so, and the compile goes on: the result
        is default Inductor's (returns False). The graph is copied once, lazily, before
        the first change (``_fx.before_change``)."""
        saved: list[Graph] = []
        setattr(graph, CHANGE_HOOK, lambda: saved or saved.append(snapshot(graph)))
        try:
            with saving(values):
                self._run(graph)
            return True
        except Exception:
            if RAISE_INTERNAL_ERRORS:
                raise
            if saved:
                restore(graph, saved[0])
            log.warning("k3fusion: a fusion failed on this graph, which is left unfused "
                        "(default Inductor compiles it); please report this with the "
                        "traceback below", exc_info=True)
            return False
        finally:
            delattr(graph, CHANGE_HOOK)

    def _run(self, graph: Graph) -> None:
        config = self.config
        counts: dict[str, int] = {}
        misses: list[str] = []
        norms, rejected = find_rms_norms(graph)
        recognized = len(norms)
        reserved: dict[str, set[Node]] = {}  # fusion -> the norms it holds until its turn
        for fusion, reserves in _claim_steps(config):
            if reserves:
                reserved[fusion.name] = fusion.reservation.take(graph, norms)
            elif not getattr(config, fusion.switch):
                if fusion.when_off is not None:
                    misses += fusion.when_off(norms)
            else:
                held = set().union(*(r for name, r in reserved.items() if name != fusion.name))
                result = fusion.run(graph, [m for m in norms if m.out not in held])
                reserved.pop(fusion.name, None)
                counts.update(result.counts)
                misses += result.misses
                norms = [m for m in norms if m.out not in result.claimed]
        graph.lint()
        self._record(graph, counts)

        log.info("%s; %d RMSNorms recognized, %d left unfused",
                 ", ".join(f"{k} {v} matches" for k, v in counts.items()) or "no fusion enabled",
                 recognized, len(norms))
        if config.debug:
            for miss in misses:
                log.info("%s", miss)
            for r in rejected:
                log.info("%s %s not recognized as RMSNorm: %s", anchor_name(r.anchor),
                         r.anchor.name, r.reason)

    def _record(self, graph: Graph, counts: dict[str, int]) -> None:
        # Recorded in torch's inductor counters, which Inductor saves with a cached graph
        # and replays on a cache hit (k3fusion.counters); only once the graph is final.
        for name, n in counts.items():
            record_matches(name, n)

    def uuid(self) -> str:
        key = f"{_source_digest()}|{self.config.cache_key()}|torch={torch.__version__}"
        return hashlib.sha256(key.encode()).hexdigest()


#: Meta key of a fused op node in a joint graph: the joint pass's counts, recorded when the
#: forward graph holding that node is compiled (see :meth:`K3JointPass._record`).
JOINT_COUNTS = "k3fusion_joint_counts"


def _first_fused_op(graph: Graph) -> Node | None:
    """The first call of a k3fusion op, directly or under ``auto_functionalized`` (the
    tail's in-place form)."""
    def op(n):
        if n.target is torch.ops.higher_order.auto_functionalized:
            return n.args[0]
        return n.target

    return next((n for n in graph.nodes if n.op == "call_function"
                 and getattr(op(n), "namespace", None) == "k3fusion"), None)


def _record_joint_counts(graph: Graph) -> None:
    for node in graph.nodes:
        counts = node.meta.pop(JOINT_COUNTS, None)
        if counts:
            for name, n in counts.items():
                record_matches(name, n)


class K3JointPass(K3FusionPass):
    """The fusions on the joint forward + backward graph of a training compile, as
    Inductor's ``joint_custom_pre_pass`` (before AOTAutograd partitions it). The backward's
    reads of a site's chain do not count; what the rewrite leaves computed only for them
    is marked to be recomputed in the backward, so the forward runs the fused op alone
    (docs/architecture.md, "While autograd records"). An inference graph (no backward) is
    left to the post-grad pass."""

    def __call__(self, graph: Graph) -> None:
        values = joint_backward_values(graph)
        if values is not None and self._guarded(graph, values):
            if not self._fused_backward(graph):
                recompute_in_backward(graph, values)

    def _fused_backward(self, graph: Graph) -> bool:
        """Re-derive the backward from the fused forward, so that fused AttnRes sites run
        the fused backward kernel (``joint_retrace``); False leaves the backward traced
        from the unfused chain (the caller then marks the chain for recomputation)."""
        if not self.config.fused_backward or not any(
                n.op == "call_function" and n.target is torch.ops.k3fusion.attn_res.default
                for n in graph.nodes):
            return False
        counts = next((n.meta[JOINT_COUNTS] for n in graph.nodes if JOINT_COUNTS in n.meta),
                      None)
        try:
            why = retrace_joint(graph)
        except Exception:
            if RAISE_INTERNAL_ERRORS:
                raise
            log.warning("k3fusion: re-deriving a training graph's backward failed; its fused "
                        "AttnRes sites run default Inductor's backward instead (please "
                        "report this with the traceback below)", exc_info=True)
            return False
        if why is not None:
            log.info("k3fusion: fused AttnRes backward not used in this graph: %s", why)
            return False
        if counts:  # the counts ride on the new graph's first fused op
            _first_fused_op(graph).meta[JOINT_COUNTS] = counts
        return True

    def _record(self, graph: Graph, counts: dict[str, int]) -> None:
        # Not here: the joint pass runs outside the compile whose counter changes Inductor
        # saves with its cached graphs, so a warm AOTAutograd hit would count nothing. The
        # counts ride on a fused op node into the forward graph, and the post-grad pass
        # records them there, inside that compile.
        if not any(counts.values()):
            return
        fused = _first_fused_op(graph)
        if fused is None:  # nothing carries them: count now rather than never
            super()._record(graph, counts)
        else:
            fused.meta[JOINT_COUNTS] = {k: v for k, v in counts.items() if v}

    def uuid(self) -> str:
        return "joint-" + super().uuid()


# torch >= 2.12 also has inference-aware passes, called with ``is_inference``.
_InferenceAware = getattr(custom_graph_pass, "CustomInferenceAwareGraphPass", None)


class ComposedPass(_InferenceAware or CustomGraphPass):
    """Run several post-grad passes in order (a user's own pass first)."""

    def __init__(self, *passes) -> None:
        self.passes = passes

    def __call__(self, graph: Graph, is_inference: bool = True) -> None:
        for p in self.passes:
            if _InferenceAware is not None and isinstance(p, _InferenceAware):
                p(graph, is_inference=is_inference)
            else:
                p(graph)

    def uuid(self):
        ids = [p.uuid() if isinstance(p, CustomGraphPass) else None for p in self.passes]
        # A plain callable has no stable id: returning None makes Inductor bypass its cache.
        return None if any(i is None for i in ids) else tuple(ids)


def _contains_k3fusion(p) -> bool:
    if isinstance(p, K3FusionPass):
        return True
    return isinstance(p, ComposedPass) and any(_contains_k3fusion(q) for q in p.passes)


def compose_with(existing, ours: K3FusionPass | None = None):
    """``existing`` (the user's ``post_grad_custom_post_pass``, or None) followed by ours.

    A list or tuple of passes (torch >= 2.12 accepts one) gets ours appended.
    """
    ours = ours if ours is not None else K3FusionPass()
    if isinstance(existing, (list, tuple)):
        if any(_contains_k3fusion(p) for p in existing):
            return existing
        return [*existing, ours]
    if existing is not None and _contains_k3fusion(existing):
        return existing
    return ours if existing is None else ComposedPass(existing, ours)
