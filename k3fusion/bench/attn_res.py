"""Benchmark the AttnRes prefix-update chain (needs CUDA).

``python -m k3fusion.bench.attn_res [--out DIR] [--tokens T ...] [--sweep] [--compiled NAME]
[--peers DIR]``

Kimi-K3's step at a layer that closes a block (bf16, ``H = 7168``, 9 sources), under
CUDA-graph replay against the HBM floor: eager (:func:`attn_res_chain`), default Inductor
and the fused op ``torch.ops.k3fusion.attn_res_``, and each peer kernel of ``--peers``
(:mod:`k3fusion.bench.peers`). ``--sweep`` also times the kernel at
every launch shape (to set ``kernels.attn_res.pick_launch_shape``). Writes
``attn_res.json``, ``attn_res.md`` and ``attn_res.png`` to ``--out``.

How it measures (the chain, the in-place op's drift, the floor, the sweep's grid):
docs/bench-methods.md, section "``python -m k3fusion.bench.attn_res``".
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

import k3fusion
from k3fusion import reference
from k3fusion.kernels.attn_res import PREFILL_TOKENS, device_table_name, pick_launch_shape
from k3fusion.kernels.attn_res import attn_res as launch

from . import peers as peer_kernels
from .common import (base_parser, compile_uncached, environment, hf_rms_norm, plot_series,
                     write_results)
from .timing import cuda_graph_us, hbm_floor_us, sets_to_outgrow_l2

TOKENS = (1, 8, 32, 128, 512, 4096)
HIDDEN = 7168
NUM_BLOCKS = 8           # completed blocks: the sources are these 8 and the prefix
BANK_SLOTS = NUM_BLOCKS + 1
WRITE_IDX = NUM_BLOCKS   # this layer closes a block: the new prefix is appended here
EPS = 1e-6
#: The column peers are compared with: the fused op, called directly as a peer's kernel is.
PEER_BASELINE = "fused_op_us"

#: Compiled variants timed besides eager and the fused op: {column name: backend}.
#: HOOK (for when ``patterns/attn_res.py`` rewrites this chain): add
#: ``"k3fusion": "k3fusion"`` here, or pass ``--compiled k3fusion``; its match count is
#: then recorded as ``k3fusion_matches``. Until then there is no k3fusion compiled column
#: -- the table shows only what was measured.
COMPILED_VARIANTS: dict[str, str] = {"inductor": "inductor", "k3fusion": "k3fusion"}

#: Launch shapes of ``--sweep``: the row kernel's (sources per tile, warps, loop stages, early
#: first tile) and the split kernel's (columns per program, warps).
SWEEP_ROW = [(spt, w, st, early) for spt in (1, 2, 4) for w in (4, 8, 16)
             for st, early in ((1, False), (1, True), (3, False))]
SWEEP_SPLIT = [(chunk, w) for chunk in (256, 512, 1024, 2048) for w in (2, 4, 8)]


def shape_label(shape) -> str:
    """``row 4x16`` (sources per tile x warps) or ``split 1024x4`` (columns x warps)."""
    if shape.kind == "row":
        stages = f" st{shape.loop_stages}" if shape.loop_stages > 1 else ""
        early = " early" if shape.early_tile else ""
        return f"row {shape.sources_per_tile}x{shape.num_warps}{stages}{early}"
    return f"split {shape.chunk}x{shape.num_warps}"


def attn_res_chain(prefix, delta, bank, norm_w, proj_w, out_w):
    """The AttnRes step as a model writes it. ``proj_w`` is the ``Linear(H, 1)`` weight
    ``[1, H]``. Returns ``(new prefix, out)``; ``bank[:, WRITE_IDX]`` is written."""
    prefix = prefix + delta
    bank[:, WRITE_IDX] = prefix
    sources = torch.cat([bank[:, :NUM_BLOCKS], prefix.unsqueeze(1)], 1)   # [T, 9, H]
    logits = F.linear(hf_rms_norm(sources, norm_w, EPS), proj_w).squeeze(-1)  # [T, 9]
    weights = logits.float().softmax(-1)
    mixed = (weights.to(sources.dtype).unsqueeze(-1) * sources).sum(1)  # model dtype
    return prefix, hf_rms_norm(mixed, out_w, EPS)


def fused_op(prefix, delta, bank, norm_w, proj_w, out_w):
    """The same step through ``k3fusion::attn_res_``: updates ``prefix`` in place."""
    out = torch.ops.k3fusion.attn_res_(prefix, bank, NUM_BLOCKS, norm_w, proj_w[0], EPS, delta,
                                       WRITE_IDX, out_w, EPS)
    return prefix, out


#: Memory layout of the bank: "sources-last" ``[T, slots, H]``, or "sources-first"
#: ``[slots, T, H]`` (MoonshotAI's ``torch.stack(blocks + [partial])`` order) handed to
#: every variant as the same ``[T, slots, H]`` view (block stride T * H), read in place.
LAYOUTS = ("sources-last", "sources-first")
LAYOUT = "sources-last"


def _inputs(t: int, device: str = "cuda", hidden: int = HIDDEN):
    dt = torch.bfloat16
    prefix = torch.randn(t, hidden, device=device, dtype=dt)
    delta = torch.randn(t, hidden, device=device, dtype=dt)
    if LAYOUT == "sources-first":
        bank = torch.randn(BANK_SLOTS, t, hidden, device=device, dtype=dt).movedim(0, 1)
    else:
        bank = torch.randn(t, BANK_SLOTS, hidden, device=device, dtype=dt)
    norm_w = (1 + 0.1 * torch.randn(hidden, device=device)).to(dt)
    proj_w = (torch.randn(1, hidden, device=device) / hidden**0.5).to(dt)
    out_w = (1 + 0.1 * torch.randn(hidden, device=device)).to(dt)
    return prefix, delta, bank, norm_w, proj_w, out_w


def _bytes(t: int, hidden: int = HIDDEN) -> int:
    # read 8 blocks + prefix + delta, write prefix + block + out; three bf16 weight rows
    return 2 * (13 * t * hidden + 3 * hidden)


def assert_near_chain(out: torch.Tensor, chain_out: torch.Tensor, what: str) -> None:
    """``out`` against the model's chain: that chain rounds the normalized keys and the
    logits to bf16 (the spec keeps them fp32), which moves outputs by ~2e-3 on average and
    by up to ~0.07 (measured on CPU, |out| ~ 0.8 on average). With one token the mean does
    not average over tokens: one logit's bf16 rounding (an ulp of 0.06 at |logit| ~ 10)
    moves every weight of that token by a few percent -- 4.9e-3 was seen between default
    Inductor and eager at T = 1 on the H200. A wrong source, slot, eps or weight moves the
    mean by 0.1 or more."""
    diff = (out.float() - chain_out.float()).abs()
    mean, worst = diff.mean().item(), diff.max().item()
    assert mean < 1.6e-2 and worst < 0.125, f"{what}: mean |diff| {mean:.2e}, max {worst:.2e}"


def _clone(args) -> list:
    """Copies that keep each tensor's strides (a sources-first bank stays one)."""
    return [torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device).copy_(a)
            if a.dim() == 3 else a.clone() for a in args]


def check_fused(args) -> None:
    """The fused op on copies of ``args``: against the spec (``k3fusion.reference``) tightly,
    against the eager chain loosely; the new prefix and the bank bit for bit (one fp32
    add, one rounding on every side)."""
    eager_args, fused_args, spec_args = (_clone(args) for _ in range(3))
    prefix_e, out_e = attn_res_chain(*eager_args)
    prefix_f, out_f = fused_op(*fused_args)
    prefix, delta, bank, norm_w, proj_w, out_w = spec_args
    out_s = reference.attn_res(prefix, bank, NUM_BLOCKS, norm_w, proj_w[0], EPS, delta,
                               WRITE_IDX, out_w, EPS)
    assert torch.equal(prefix_f, prefix_e) and torch.equal(prefix_f, prefix), "prefix differs"
    assert torch.equal(fused_args[2], eager_args[2]) and torch.equal(fused_args[2], bank), \
        "bank differs"
    # A few bf16 ulps: the mix within 1, the output norm's roundings (see the tests).
    torch.testing.assert_close(out_f, out_s, rtol=2**-6, atol=2**-6)
    assert_near_chain(out_f, out_e, "fused op vs eager chain")


def peer_inputs(prefix, delta, bank, norm_w, proj_w, out_w) -> dict:
    """One input set as a peer's ``make`` gets it (``peers.CONTRACTS["attn_res"]``)."""
    return {"prefix": prefix, "delta": delta, "bank": bank, "norm_weight": norm_w,
            "proj_weight": proj_w[0], "out_norm_weight": out_w}


def peer_point(t: int, hidden: int = HIDDEN) -> dict:
    return {"op": "attn_res", "T": t, "hidden": hidden, "num_blocks": NUM_BLOCKS,
            "block_write_idx": WRITE_IDX, "eps": EPS, "out_eps": EPS, "layout": LAYOUT}


def check_peer(make, args) -> str | None:
    """What is wrong with a peer's step on copies of ``args`` (None: nothing), by
    :func:`check_fused`'s rules: the new prefix and the bank bit for bit, the output within
    its bound of the spec and near the eager chain."""
    peer_args, spec_args, chain_args = (_clone(args) for _ in range(3))
    out_chain = attn_res_chain(*chain_args)[1]
    prefix, delta, bank, norm_w, proj_w, out_w = spec_args
    out_spec = reference.attn_res(prefix, bank, NUM_BLOCKS, norm_w, proj_w[0], EPS, delta,
                                  WRITE_IDX, out_w, EPS)
    out = make(peer_inputs(*peer_args))()
    if not torch.equal(peer_args[0], prefix):
        return "the new prefix is not prefix + delta (bit for bit)"
    if not torch.equal(peer_args[2], bank):
        return f"the bank differs from the reference's (block write to slot {WRITE_IDX})"
    try:
        torch.testing.assert_close(out, out_spec, rtol=2**-6, atol=2**-6)
        assert_near_chain(out, out_chain, "vs eager chain")
    except (AssertionError, TypeError, ValueError) as e:
        return peer_kernels.failure(e)
    return None


def run(tokens=TOKENS, sweep: bool = False, compiled=None, peers=(), *, device="cuda",
        hidden: int = HIDDEN, timer=None) -> dict:
    """``compiled``: {column: dynamo backend, a name or a callable}; ``peers``:
    :class:`peers.Peer` of this op. ``device``, ``hidden`` and ``timer`` (``(fn, arg_sets)
    -> us``, default :func:`cuda_graph_us`) let a CPU test run the loop."""
    compiled = dict(COMPILED_VARIANTS if compiled is None else compiled)
    timer = timer or cuda_graph_us
    rows = []
    for t in tokens:
        # Rotate input sets so that every variant reads from HBM, not from L2.
        sets = [_inputs(t, device, hidden) for _ in range(sets_to_outgrow_l2(_bytes(t, hidden)))]
        check_fused(sets[0])
        k3fusion.reset_match_counts()
        variants = {"eager": attn_res_chain}
        variants.update({name: compile_uncached(attn_res_chain, backend)
                         for name, backend in compiled.items()})
        variants["fused_op"] = fused_op
        gpu = device_table_name(torch.device(device))
        shape = pick_launch_shape(t, hidden, NUM_BLOCKS, gpu=gpu)
        row = {"T": t, "floor_us": hbm_floor_us(_bytes(t, hidden)), "input_sets": len(sets),
               "shape": shape_label(shape)}
        chain_out = attn_res_chain(*_clone(sets[0]))[1]
        for name, fn in variants.items():
            if name in compiled:
                out = fn(*_clone(sets[0]))[1]  # compiles; check before timing
                assert_near_chain(out, chain_out, f"{name} vs eager chain")
            row[f"{name}_us"] = timer(fn, sets)
        if "k3fusion" in compiled:
            row["k3fusion_matches"] = k3fusion.match_counts().get("attn_res", 0)
        if peers:
            row["peers"] = peer_kernels.time_peers(
                peers, peer_point(t, hidden), [peer_inputs(*s) for s in sets],
                lambda make: check_peer(make, sets[0]), timer)
            peer_kernels.summarize(row, PEER_BASELINE)
        if sweep:
            outs = [torch.empty_like(s[0]) for s in sets]
            shapes = [("row", {"sources_per_tile": a, "num_warps": w, "loop_stages": st,
                               "early_tile": early})
                      for a, w, st, early in SWEEP_ROW]
            shapes += [("split", {"kind": "split", "chunk": a, "num_warps": w})
                       for a, w in SWEEP_SPLIT]
            for kind, kw in shapes:
                label = shape_label(pick_launch_shape(t, hidden, NUM_BLOCKS, gpu=gpu, **kw))
                row["sweep " + label] = cuda_graph_us(
                    lambda prefix, delta, bank, norm_w, proj_w, out_w, out, kw=kw:
                    launch(prefix, bank, NUM_BLOCKS, norm_w, proj_w[0], EPS, out,
                           delta=delta, prefix_out=prefix, block_write_idx=WRITE_IDX,
                           out_norm_w=out_w, out_eps=EPS, shape=kw),
                    [s + (o,) for s, o in zip(sets, outs)])
            best = min((k for k in row if k.startswith("sweep ")), key=row.get)
            row["sweep_best"] = best[len("sweep "):]
        row["speedup_vs_inductor"] = row["inductor_us"] / row["fused_op_us"] \
            if "inductor_us" in row else None
        row["floor_fraction"] = row["floor_us"] / row["fused_op_us"]
        rows.append(row)
        print(", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in row.items()), flush=True)
    return {"bench": "attn_res", "hidden": hidden, "num_blocks": NUM_BLOCKS, "layout": LAYOUT,
            "prefill_tokens": PREFILL_TOKENS, "compiled": {k: str(v) for k, v in compiled.items()},
            "rows": rows, "peers": peer_kernels.sources(peers), **environment(device)}


def markdown(result: dict) -> str:
    compiled = list(result["compiled"])
    names = {"inductor": "default Inductor", "k3fusion": "k3fusion (compiled)"}
    head = ["T", "eager", *[names.get(c, c) for c in compiled], "fused op (shape)", "HBM floor",
            "fused vs Inductor", "of floor", *peer_kernels.table_columns(result)]
    lines = [
        f"AttnRes step, bf16, H {result['hidden']}, {result['num_blocks']} blocks + prefix "
        "(9 sources), delta + block write + output norm. "
        f"{result['gpu']}, {result['date']}, torch {result['torch']}, triton "
        f"{result['triton']}. CUDA-graph replay (20 calls per graph, inputs rotated to outgrow "
        "L2), median us per call. Shape: the kernel and tile the heuristic picked.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---:|" * len(head),
    ]
    for r in result["rows"]:
        cells = [str(r["T"]), f"{r['eager_us']:.2f}"]
        cells += [f"{r[f'{c}_us']:.2f}" for c in compiled]
        cells += [f"{r['fused_op_us']:.2f} ({r['shape']})",
                  f"{r['floor_us']:.2f}",
                  "-" if r["speedup_vs_inductor"] is None else f"{r['speedup_vs_inductor']:.2f}x",
                  f"{100 * r['floor_fraction']:.0f}%"]
        cells += peer_kernels.table_cells(result, r)
        lines.append("| " + " | ".join(cells) + " |")
    lines += peer_kernels.sources_lines(result, "the fused op")
    sweep_keys = [k for k in result["rows"][0] if k.startswith("sweep ")] if result["rows"] else []
    if sweep_keys:
        lines += ["", "Kernel launch-shape sweep (us; row: sources per tile x warps, split: "
                  "columns per program x warps):", "",
                  "| T | " + " | ".join(k[len("sweep "):] for k in sweep_keys) + " | best |",
                  "|" + "---:|" * (len(sweep_keys) + 2)]
        for r in result["rows"]:
            lines.append(f"| {r['T']} | " + " | ".join(f"{r[k]:.2f}" for k in sweep_keys)
                         + f" | {r['sweep_best']} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    series = [("eager_us", "eager")]
    series += [(f"{c}_us", {"inductor": "default Inductor"}.get(c, c)) for c in result["compiled"]]
    series += [("fused_op_us", "fused op"), ("floor_us", "HBM floor")]
    series += peer_kernels.plot_series_of(result)
    plot_series(result, series,
                f"AttnRes step (9 sources, H {result['hidden']}), bf16, {result['gpu']}", path)


def main(argv=None) -> int:
    p = base_parser("python -m k3fusion.bench.attn_res", TOKENS)
    p.add_argument("--compiled", action="append", default=[], metavar="BACKEND",
                   help="also time torch.compile with this backend")
    p.add_argument("--layout", choices=LAYOUTS, default="sources-last",
                   help="bank memory layout (sources-first: [slots, T, H] read through a view)")
    args = p.parse_args(argv)
    peers = peer_kernels.from_args(p, args, "attn_res")
    global LAYOUT
    LAYOUT = args.layout
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    compiled = dict(COMPILED_VARIANTS)
    compiled.update({b: b for b in args.compiled})
    result = run(args.tokens, args.sweep, compiled, peers)
    name = "attn_res" if LAYOUT == "sources-last" else "attn_res_sources_first"
    write_results(args.out, name, result, markdown(result), plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
