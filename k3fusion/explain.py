"""``k3fusion.explain(model, *example_inputs)``: compile the call as given and say, per
candidate site, whether it was fused and, if not, why -- with the line of the model's own
code the candidate came from, when the traced graph's stack trace has it.

The call is compiled under the caller's config and grad mode, so the report is what a
real ``torch.compile(model, backend="k3fusion")`` of the same call fuses. The reasons are
what the passes log with ``FusionConfig.debug``, switched on for this compile only.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from dataclasses import dataclass, field

import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config

from .config import overridden
from .counters import match_counts, reset_match_counts
from .pass_manager import K3FusionPass
from .patterns.registry import claim_order
from .patterns.rms_norm import starts_rms_norm

__all__ = ["Candidate", "Explanation", "explain"]

#: debug log line -> (what the candidate is, its anchor node's name, the reason): each
#: fusion's miss lines, then the rsqrt ops the norm recognizer refused.
_LINES = [(f.miss_line, f.miss_kind) for f in claim_order()] + [
    (re.compile(r"^r?sqrt (\S+) not recognized as RMSNorm: (.*)$"), "rsqrt"),
]

#: An rsqrt of ``mean(x**2) + eps`` the norm matcher refused (Gemma's ``1 + w``, a weight
#: computed in the graph, a leaked intermediate): a norm left alone, shown by default.
REFUSED_NORM = "RMSNorm (refused)"
#: Any other rsqrt: no norm at all, listed with ``verbose`` only.
OTHER_RSQRT = "rsqrt (not an RMSNorm)"


@dataclass
class Candidate:
    """One candidate a pass looked at and left alone."""

    kind: str
    node: str
    reason: str
    #: ``file:line  code`` of the model code the node was traced from ("" if unknown)
    where: str = ""

    def __str__(self) -> str:
        at = "" if not self.where else (
            f" {self.where}" if self.where.startswith("near ") else f" at {self.where}")
        return f"{self.kind}{at} not fused: {self.reason}"


@dataclass
class Explanation:
    #: fusion -> sites fused (``k3fusion.match_counts()`` for this compile)
    matches: dict[str, int]
    not_fused: list[Candidate] = field(default_factory=list)
    #: facts about the call that decide what fuses (grad mode, ...)
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"{k}: {v} fused" for k, v in sorted(self.matches.items())]
        lines += [str(c) for c in self.not_fused] or ["nothing left unfused"]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _user_frame(trace: str | None) -> str:
    """The innermost frame of a node's stack trace outside torch: ``file:line  code``."""
    if not trace:
        return ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in \S+\n\s*(.*)', trace)
    frames = [f for f in frames if "/torch/" not in f[0]] or frames
    if not frames:
        return ""
    path, line, code = frames[-1]
    return f"{path.rsplit('/', 1)[-1]}:{line}  {code.strip()}"


def _where(node: torch.fx.Node, max_steps: int = 64) -> str:
    """``file:line  code`` of ``node``, else ``near file:line  code`` of the closest node with
    a stack trace (inputs and users, breadth first): nodes a decomposition or a pattern
    replacement of Inductor's made carry none."""
    frame = _user_frame(node.meta.get("stack_trace"))
    if frame:
        return frame
    seen, queue = {node}, [node]
    for step in range(max_steps):
        if step == len(queue):
            break
        for m in (*queue[step].all_input_nodes, *queue[step].users):
            if m in seen:
                continue
            frame = _user_frame(m.meta.get("stack_trace"))
            if frame:
                return f"near {frame}"
            seen.add(m)
            queue.append(m)
    return ""


def _records_autograd(model, example_inputs) -> bool:
    if not torch.is_grad_enabled():
        return False
    params = model.parameters() if isinstance(model, torch.nn.Module) else ()
    tensors = [*params, *(x for x in example_inputs if isinstance(x, torch.Tensor))]
    return any(t.requires_grad for t in tensors)


_GRAD_NOTE = ("autograd records this call (grad mode is on and a parameter or input requires "
              "grad): the forward is fused as under no_grad; the backward, default "
              "Inductor's, recomputes what it reads of the fused sites. For inference, "
              "torch.no_grad() or torch.inference_mode() skips the backward's bookkeeping.")


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class StageProgress:
    """A line on stderr per stage (and, in explain, per compiled graph): a compile takes a
    while on a CPU. ``label`` starts each line, with the seconds since the start."""

    def __init__(self, quiet: bool, label: str = "k3fusion explain") -> None:
        self.quiet, self.label, self.start = quiet, label, time.perf_counter()

    def __call__(self, what: str) -> None:
        if not self.quiet:
            print(f"[{self.label} {time.perf_counter() - self.start:5.1f} s] {what}",
                  file=sys.stderr, flush=True)


def explain(model, *example_inputs, dynamic: bool = False, verbose: bool = False,
            quiet: bool = False) -> Explanation:
    """Compile ``model`` with ``backend="k3fusion"`` and call it on ``example_inputs``, under
    the config and grad mode in force (no compile cache, so every graph goes through the
    pass), then print and return what was fused and why each other candidate was not.
    Progress goes to stderr, a line per compiled graph. ``verbose`` also lists rsqrt ops
    that are no RMSNorm (a sqrt is listed only when it is one, refused); ``quiet`` prints
    nothing."""
    progress = StageProgress(quiet)
    log = logging.getLogger("k3fusion")
    handler, level = _Collect(), log.level
    candidates: list[Candidate] = []
    graphs = 0
    original = K3FusionPass.__call__

    def recording(self, graph):
        nonlocal graphs
        graphs += 1
        # The node names the log lines use -> the nodes, before the pass rewrites the graph.
        nodes = {n.name: n for n in graph.nodes}
        rms_like = {n.name for n in graph.nodes if starts_rms_norm(n)}
        start, before = len(handler.lines), len(candidates)
        original(self, graph)
        for line in handler.lines[start:]:
            for pattern, kind in _LINES:
                m = pattern.match(line)
                if m:
                    node, reason = m.groups()
                    if kind == "rsqrt":
                        kind = REFUSED_NORM if node in rms_like else OTHER_RSQRT
                    where = _where(nodes[node]) if node in nodes else ""
                    candidates.append(Candidate(kind, node, reason, where))
                    break
        left = sum(c.kind != OTHER_RSQRT for c in candidates[before:])
        progress(f"graph {graphs}: k3fusion pass done ({left} candidate(s) left alone); "
                 "Inductor generates its code")

    notes = [_GRAD_NOTE] if _records_autograd(model, example_inputs) else []
    progress("compiling the call with backend='k3fusion' and running it "
             f"({'grad mode on' if torch.is_grad_enabled() else 'no grad'}); "
             "a line per compiled graph follows")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    K3FusionPass.__call__ = recording
    reset_match_counts()
    try:
        torch._dynamo.reset()
        with overridden(debug=True), inductor_config.patch(fx_graph_cache=False), \
                functorch_config.patch(enable_autograd_cache=False):
            torch.compile(model, backend="k3fusion", dynamic=dynamic)(*example_inputs)
    finally:
        K3FusionPass.__call__ = original
        log.removeHandler(handler)
        log.setLevel(level)
        torch._dynamo.reset()
    progress(f"done: {graphs} graph(s) compiled")
    if not verbose:
        candidates = [c for c in candidates if c.kind != OTHER_RSQRT]
    result = Explanation(dict(match_counts()), candidates, notes)
    if not quiet:
        print(result)
    return result
