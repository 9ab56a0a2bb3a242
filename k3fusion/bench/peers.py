"""Peer kernels (issue 30): public implementations of a benchmarked op, loaded from adapter
files in a directory outside the repo (``--peers DIR``), checked against the same reference
as k3fusion and timed in the same run, on the same rotated inputs, with the same timer.

An adapter is ``DIR/<anything>.py`` (files starting with ``_`` are helpers, not adapters)
defining ``NAME``, ``OP`` (one of :data:`OPS`), ``SOURCE`` (``repo``, ``path``, ``commit``),
``make(inputs, point) -> zero-arg callable`` and optionally ``declines(point) -> reason or
None``. What ``inputs``, ``point`` and the callable's result are per op: :data:`CONTRACTS`;
how to write one: docs/bench-methods.md, "Peer kernels (``--peers DIR``)".
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

__all__ = ["OPS", "CONTRACTS", "AdapterError", "Peer", "load_peers", "time_peers",
           "summarize", "sources", "table_columns", "table_cells", "sources_lines",
           "from_args", "plot_series_of", "failure"]

#: What a peer's ``make`` gets and its callable must return, per op (the docs repeat it).
CONTRACTS = {
    "attn_res": "inputs: prefix [T, H], delta [T, H], bank [T, slots, H] (a view; its block "
                "stride may differ), norm_weight [H], proj_weight [H], out_norm_weight [H]; "
                "point: T, hidden, num_blocks, block_write_idx, eps, out_eps. The callable "
                "adds delta into prefix in place, writes the new prefix to "
                "bank[:, block_write_idx] and returns the normed output [T, H].",
    "qkv_rmsnorm": "inputs: q [T, q_size], q_weight, kv [T, kv_size] (a view of the "
                   "[T, kv_size + rope] projection: row stride kv_stride), kv_weight; point: "
                   "T, q_size, kv_size, kv_stride, eps. The callable returns (q_normed, "
                   "kv_normed).",
    "moe_tail": "inputs: routed [T, latent], shared [T, hidden], norm_weight [latent], "
                "up_weight [hidden, latent]; point: T, latent, hidden, eps. The callable "
                "returns shared + rms_norm(routed) @ up_weight.T [T, hidden].",
}
OPS = tuple(CONTRACTS)
REQUIRED = ("NAME", "OP", "SOURCE", "make")
SOURCE_KEYS = ("repo", "path", "commit")
#: A peer this much faster than k3fusion fails the issue's acceptance (one run's noise).
NOISE = 1.02


class AdapterError(ValueError):
    """A peer directory or adapter that cannot be used; the message names the file."""


@dataclass(frozen=True)
class Peer:
    name: str
    op: str
    source: dict
    make: Callable
    declines: Callable = field(default=lambda point: None)
    file: str = ""


def _fail(file: Path, what: str) -> AdapterError:
    return AdapterError(f"peer adapter {file}: {what} (how to write one: docs/bench-methods.md, "
                        "'Peer kernels')")


def load_adapter(file: Path) -> Peer:
    """Import one adapter file and check what it declares (nothing of it runs but its
    module body)."""
    # A name of our own: two directories may both hold a "vllm.py".
    spec = importlib.util.spec_from_file_location(f"k3fusion_peer_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - any import problem is the adapter's: say which
        raise _fail(file, f"importing it failed: {type(e).__name__}: {e}") from e
    missing = [a for a in REQUIRED if not hasattr(module, a)]
    if missing:
        raise _fail(file, f"missing {', '.join(missing)}; an adapter defines "
                          f"{', '.join(REQUIRED)}")
    if not isinstance(module.NAME, str) or not module.NAME.strip():
        raise _fail(file, f"NAME must be a non-empty string, got {module.NAME!r}")
    if module.OP not in OPS:
        raise _fail(file, f"OP {module.OP!r} is not a benchmarked op ({', '.join(OPS)})")
    source = module.SOURCE
    if not isinstance(source, dict):
        raise _fail(file, f"SOURCE must be a dict with {', '.join(SOURCE_KEYS)}")
    lacking = [k for k in SOURCE_KEYS if not isinstance(source.get(k), str) or not source[k]]
    if lacking:
        raise _fail(file, f"SOURCE lacks {', '.join(lacking)} (the tables name each peer's "
                          "repository, path and commit)")
    declines = getattr(module, "declines", None)
    for attr, fn in (("make", module.make), ("declines", declines)):
        if fn is not None and not callable(fn):
            raise _fail(file, f"{attr} must be a function")
    return Peer(module.NAME.strip(), module.OP, {k: source[k] for k in SOURCE_KEYS},
                module.make, declines or (lambda point: None), str(file))


def load_peers(directory, op: str | None = None) -> list[Peer]:
    """Every adapter in ``directory`` (all of them checked, whatever ``op``), then those of
    ``op``. Raises :class:`AdapterError` before anything is timed."""
    path = Path(directory)
    if not path.is_dir():
        raise AdapterError(f"--peers {directory}: no such directory")
    files = sorted(p for p in path.glob("*.py") if not p.name.startswith("_"))
    if not files:
        raise AdapterError(f"--peers {directory}: no adapter in it (*.py files not starting "
                           "with '_')")
    # An adapter may import helpers next to it (_*.py, or a checkout of the peer's repo).
    if str(path.resolve()) not in sys.path:
        sys.path.insert(0, str(path.resolve()))
    peers = [load_adapter(f) for f in files]
    seen: dict[tuple[str, str], str] = {}  # a name is a column of its op's table
    for p in peers:
        if (p.op, p.name) in seen:
            raise AdapterError(f"peer adapters {seen[p.op, p.name]} and {p.file} both have "
                               f"NAME {p.name!r} for OP {p.op!r}")
        seen[p.op, p.name] = p.file
    return [p for p in peers if op is None or p.op == op]


def time_peers(peers: Sequence[Peer], point: dict, input_sets: Sequence[dict],
               check: Callable[[Callable], str | None],
               timer: Callable[[Callable, list], float]) -> dict[str, dict]:
    """Each peer at one point: ``{name: {"us": ...} | {"declined": reason} |
    {"failed_check": what} | {"error": what}}``.

    ``check(make)`` runs ``make(inputs)()`` on copies of the first set against the bench's
    reference and returns what is wrong (None: nothing); only a peer that passes is timed:
    ``timer(fn, arg_sets)`` as the bench times k3fusion, ``fn(i)`` running set ``i``."""
    cells: dict[str, dict] = {}
    for peer in peers:
        def make(inputs, peer=peer):
            return peer.make(inputs, dict(point))

        try:
            reason = peer.declines(dict(point))
            if reason:
                cells[peer.name] = {"declined": str(reason)}
                continue
            problem = check(make)
        except Exception as e:  # noqa: BLE001 - a peer's crash is its cell, not the run's end
            cells[peer.name] = {"error": f"{type(e).__name__}: {e}"[:300]}
            continue
        if problem:
            cells[peer.name] = {"failed_check": problem[:300]}
            continue
        try:
            # One callable per rotated set, made before the capture (allocations outside it).
            calls = [make(inputs) for inputs in input_sets]
            cells[peer.name] = {"us": timer(lambda i: calls[i](),
                                            [(i,) for i in range(len(calls))])}
        except Exception as e:  # noqa: BLE001
            cells[peer.name] = {"error": f"{type(e).__name__}: {e}"[:300]}
    return cells


def summarize(row: dict, k3fusion_key: str) -> None:
    """The fastest timed peer of ``row["peers"]`` and ``row[k3fusion_key] / its us``
    (``peer_speedup``: above :data:`NOISE`, a public kernel beats k3fusion at this point)."""
    timed = {n: c["us"] for n, c in (row.get("peers") or {}).items() if "us" in c}
    if not timed:
        row["best_peer"] = row["best_peer_us"] = row["peer_speedup"] = None
        return
    best = min(timed, key=timed.get)
    row["best_peer"], row["best_peer_us"] = best, timed[best]
    k3 = row.get(k3fusion_key)
    row["peer_speedup"] = k3 / timed[best] if k3 and timed[best] > 0 else None


def sources(peers: Sequence[Peer]) -> list[dict]:
    """What the result JSON records of each peer."""
    return [{"name": p.name, "op": p.op, **p.source, "adapter": p.file} for p in peers]


def table_columns(result: dict) -> list[str]:
    """Extra markdown header cells: one per peer, then the best peer against k3fusion."""
    names = [p["name"] for p in result.get("peers") or []]
    return names + ["best peer vs k3fusion"] if names else []


def _cell(c: dict | None) -> str:
    if not c:
        return "-"
    if "us" in c:
        return f"{c['us']:.2f}"
    if "declined" in c:
        return f"n/a ({c['declined']})"
    if "failed_check" in c:
        return f"**failed check** ({c['failed_check']})"
    return f"error ({c['error']})"


def table_cells(result: dict, row: dict) -> list[str]:
    """The cells of :func:`table_columns` for one row."""
    names = [p["name"] for p in result.get("peers") or []]
    if not names:
        return []
    cells = [_cell((row.get("peers") or {}).get(n)).replace("|", "/") for n in names]
    speedup = row.get("peer_speedup")
    if speedup is None:
        cells.append("-")
    else:
        text = f"{row['best_peer']} {speedup:.2f}x"
        cells.append(f"**{text}, peer faster**" if speedup > NOISE else text)
    return cells


def sources_lines(result: dict, k3fusion_column: str) -> list[str]:
    """Lines under a table: each peer's source and commit, and how to read the last column."""
    peers = result.get("peers") or []
    if not peers:
        return []
    lines = ["", "Peers (each checked against the reference k3fusion is checked against "
             "before it is timed; n/a: the peer declines the point):"]
    lines += [f"- {p['name']}: {p['repo']} `{p['path']}` @ {p['commit']} (adapter "
              f"`{Path(p['adapter']).name}`)" for p in peers]
    lines.append(f"best peer vs k3fusion: {k3fusion_column}'s time over the fastest peer's "
                 f"(above {NOISE:.2f}, bold: a public kernel more than 2% faster).")
    return lines


def from_args(parser, args, op: str) -> list[Peer]:
    """The peers of ``op`` in ``args.peers`` (none without ``--peers``); a bad directory or
    adapter is the parser's error, before anything runs."""
    if getattr(args, "peers", None) is None:
        return []
    try:
        return load_peers(args.peers, op)
    except AdapterError as e:
        parser.error(str(e))


def plot_series_of(result: dict) -> list[tuple[str, str]]:
    """The fastest peer's line for :func:`common.plot_series` (none without peers)."""
    return [("best_peer_us", "fastest peer")] if result.get("peers") else []


def failure(e: BaseException) -> str:
    """One line of what a check found (``assert_close``'s message spans several lines)."""
    return "; ".join(line.strip() for line in str(e).splitlines() if line.strip())[:300]
