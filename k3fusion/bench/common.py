"""What every benchmark shares: the model-style norm, uncached compiles, the run's
environment, and writing JSON / markdown / PNG results."""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path
from typing import Callable

import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
import triton

from k3fusion.kernels import _scratch

__all__ = ["hf_rms_norm", "compile_uncached", "environment", "base_parser", "write_results",
           "plot_series", "fake_tp_group", "add_scratch_argument"]


def hf_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as HF model code writes it (what the graph passes must recognize)."""
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return w * x.to(dtype)


def compile_uncached(fn: Callable, backend: str) -> Callable:
    """``torch.compile(fn, backend=backend)``, compiled with the graph caches off: a cache
    hit would skip the k3fusion pass (no fusion, no match count)."""
    torch._dynamo.reset()
    compiled = torch.compile(lambda *args: fn(*args), backend=backend, dynamic=False)

    def call(*args):
        with inductor_config.patch(fx_graph_cache=False), \
                functorch_config.patch(enable_autograd_cache=False):
            return compiled(*args)
    return call


def environment(device="cuda") -> dict:
    """Date, GPU and versions of a run (``device`` "cpu": a CPU test of a bench's loop)."""
    return {
        "date": datetime.date.today().isoformat(),
        "gpu": "cpu" if str(device) == "cpu" else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        # Where captured launches' scratch words come from (--scratch-memset).
        "scratch": "arena" if _scratch.GRAPH_WORDS else "memset",
    }


def base_parser(prog: str, tokens) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-out")))
    p.add_argument("--tokens", type=int, nargs="*", default=list(tokens))
    p.add_argument("--sweep", action="store_true", help="time every kernel launch shape")
    add_peers_argument(p)
    add_scratch_argument(p)
    return p


class _ScratchMemset(argparse.Action):
    """``--scratch-memset``: set when parsed, for the whole run."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=False, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        _scratch.GRAPH_WORDS = False
        setattr(namespace, self.dest, True)


def add_scratch_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scratch-memset", action=_ScratchMemset,
                   help="captured launches zero their scratch words in the graph (a memset "
                        "node each, as before the arena) instead of keeping arena words for "
                        "good: an A/B of docs/design-notes.md, 'Scratch memory'")


def add_peers_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peers", type=Path, default=None, metavar="DIR",
                   help="also check and time the peer kernels whose adapters are in DIR "
                        "(docs/bench-methods.md, 'Peer kernels')")


def write_results(out: Path, name: str, result: dict, markdown: str,
                  plot: Callable[[dict, Path], None]) -> None:
    """``name``.json, .md and .png in ``out``; prints the markdown table."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
    (out / f"{name}.md").write_text(markdown)
    try:
        plot(result, out / f"{name}.png")
    except ImportError:
        print("matplotlib missing (pip install k3fusion[bench]): no plot")
    print(markdown)


def plot_series(result: dict, series: list[tuple[str, str]], title: str, path: Path) -> None:
    """Log-log plot of microseconds against T, one line per ``(row key, label)``."""
    import matplotlib  # optional (the bench extra): only the plots need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ts = [r["T"] for r in result["rows"]]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for key, label in series:
        ys = [float("nan") if r.get(key) is None else r[key] for r in result["rows"]]
        ax.plot(ts, ys, marker="o", label=label,
                linestyle="--" if key == "floor_us" else "-")
    ax.set(xscale="log", yscale="log", xlabel="tokens T", ylabel="us (CUDA-graph replay, median)",
           title=title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def fake_tp_group(n: int):
    """A process group of ``n`` ranks in this one process, this process rank 0 (torch's
    fake backend: every collective returns at once and moves nothing). Started once;
    RuntimeError if another default group is running."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_initialized():
        dist.init_process_group("fake", rank=0, world_size=n, store=FakeStore())
    backend, world = dist.get_backend(), dist.get_world_size()
    if backend != "fake" or world != n:
        raise RuntimeError(f"this benchmark needs a fake process group of {n} ranks; this "
                           f"process runs a {backend!r} group of {world}")
    return dist.group.WORLD
