"""``k3fusion.explain(model, *example_inputs)``: compile once and say, per candidate site,
whether it was fused and, if not, why -- with the line of the model's own code the
candidate came from, when the traced graph's stack trace has it.

The raw material is what the passes log with ``K3FUSION_DEBUG`` (``FusionConfig.debug``);
this turns those lines, for one compile, into a report a model author can act on.
"""

from __future__ import annotations

import argparse
import logging
import re
from dataclasses import dataclass, field

import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config

from .config import get_config, set_config
from .counters import match_counts, reset_match_counts
from .models import KimiK3Config, KimiK3ForCausalLM
from .pass_manager import K3FusionPass

__all__ = ["Candidate", "Explanation", "explain", "main_explain"]

#: debug log line -> (what the candidate is, its anchor node's name, the reason)
_LINES = [
    (re.compile(r"^AttnRes site not fused: softmax (\S+): (.*)$"), "AttnRes step (softmax)"),
    (re.compile(r"^MoE-tail site not fused: (?:\S+ )?(\S+?):? (.*)$"), "MoE tail"),
    (re.compile(r"^RMSNorm (\S+) \(x=\S+\) not fused: (.*)$"), "RMSNorm"),
    (re.compile(r"^rsqrt (\S+) not recognized as RMSNorm: (.*)$"), "rsqrt (not an RMSNorm)"),
]


@dataclass
class Candidate:
    """One candidate a pass looked at and left alone."""

    kind: str
    node: str
    reason: str
    #: ``file:line  code`` of the model code the node was traced from ("" if unknown)
    where: str = ""

    def __str__(self) -> str:
        at = f" at {self.where}" if self.where else ""
        return f"{self.kind}{at} not fused: {self.reason}"


@dataclass
class Explanation:
    #: fusion -> sites fused (``k3fusion.match_counts()`` for this compile)
    matches: dict[str, int]
    not_fused: list[Candidate] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"{k}: {v} fused" for k, v in sorted(self.matches.items())]
        lines += [str(c) for c in self.not_fused] or ["nothing left unfused"]
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


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def explain(model, *example_inputs, dynamic: bool = False, verbose: bool = False,
            quiet: bool = False) -> Explanation:
    """Compile ``model`` with ``backend="k3fusion"`` on ``example_inputs`` (under
    ``torch.no_grad()``, no compile cache), then print and return what was fused and why
    each other candidate was not. ``verbose`` also lists rsqrt ops that are no RMSNorm."""
    saved = get_config()
    log = logging.getLogger("k3fusion")
    handler, level = _Collect(), log.level
    traces: dict[str, str] = {}
    candidates: list[Candidate] = []
    original = K3FusionPass.__call__

    def recording(self, graph):  # the node names the log lines use -> their stack traces
        traces.clear()
        traces.update({n.name: n.meta.get("stack_trace") for n in graph.nodes})
        start = len(handler.lines)
        original(self, graph)
        for line in handler.lines[start:]:
            for pattern, kind in _LINES:
                m = pattern.match(line)
                if m:
                    node, reason = m.groups()
                    candidates.append(Candidate(kind, node, reason, _user_frame(traces.get(node))))
                    break

    log.addHandler(handler)
    log.setLevel(logging.INFO)
    K3FusionPass.__call__ = recording
    set_config(debug=True)
    reset_match_counts()
    try:
        torch._dynamo.reset()
        with torch.no_grad(), inductor_config.patch(fx_graph_cache=False), \
                functorch_config.patch(enable_autograd_cache=False):
            torch.compile(model, backend="k3fusion", dynamic=dynamic)(*example_inputs)
    finally:
        K3FusionPass.__call__ = original
        log.removeHandler(handler)
        log.setLevel(level)
        set_config(saved)
        torch._dynamo.reset()
    if not verbose:
        candidates = [c for c in candidates if not c.kind.startswith("rsqrt")]
    result = Explanation(dict(match_counts()), candidates)
    if not quiet:
        print(result)
    return result


def main_explain(argv=None) -> int:
    """``python -m k3fusion explain [--dynamic] [--verbose] [--no-attn-res] [--latent-moe]``:
    explain the built-in tiny Kimi-K3 model (what ``python -m k3fusion`` compiles)."""
    p = argparse.ArgumentParser(prog="python -m k3fusion explain")
    p.add_argument("--dynamic", action="store_true")
    p.add_argument("--verbose", action="store_true", help="also list rsqrt ops that are no RMSNorm")
    p.add_argument("--no-attn-res", dest="attn_res", action="store_false")
    p.add_argument("--latent-moe", action="store_true")
    p.add_argument("--tokens", type=int, default=8)
    args = p.parse_args(argv)
    config = KimiK3Config.tiny(attn_res=args.attn_res, latent_moe=args.latent_moe)
    model = KimiK3ForCausalLM(config, seed=0).eval()
    ids = torch.randint(0, config.vocab_size, (2, args.tokens),
                        generator=torch.Generator().manual_seed(0))
    explain(model, ids, dynamic=args.dynamic, verbose=args.verbose)
    return 0
