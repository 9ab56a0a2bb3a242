"""Benchmark the latent-MoE tail on one GPU (needs CUDA).

``python -m k3fusion.bench.moe_tail [--out DIR] [--tokens T ...] [--sweep | --sweep-only]
[--tp-tokens T ...] [--tps TP ...] [--shard-tokens T ...] [--shard-tp TP] [--peers DIR]``

At Kimi-K3's widths, bf16, under CUDA-graph replay against the HBM floor: (a) the tp = 1
tail ``shared + rms_norm(routed) @ up_w.T`` -- eager, default Inductor, the fused kernel,
the op, the model form compiled with and without ``backend="k3fusion"``, and each peer
kernel of ``--peers`` (:mod:`k3fusion.bench.peers`), each checked against the reference first; ``--sweep`` also times the kernel's launch configs (to choose
``kernels.moe_tail.pick_launch_config``); (b) one rank's column-parallel up-projection GEMM
against the replicated one; (c) one rank's column-parallel tier at decode T, in a fake
process group of ``--shard-tp`` ranks (collectives move nothing and are not timed): its
shard through the tail kernel as it runs, with the partials donated as compiled graphs
pass them, and unfused (norm launch, copy, cuBLAS ``addmm_``). Writes ``moe_tail.json``,
``moe_tail.md`` and ``moe_tail.png`` to ``--out``.

How it measures (the variants, the floor, the sweep's grid):
docs/bench-methods.md, section "``python -m k3fusion.bench.moe_tail``".
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import replace
from pathlib import Path
from unittest import mock

import torch

import k3fusion
from k3fusion import moe_tail, reference
from k3fusion.kernels.moe_tail import (MAX_TOKENS, LaunchConfig, block_m_for, gemv_block_k,
                                       num_sms, resolve_config, pick_launch_config)
from k3fusion.kernels.moe_tail import latent_moe_tail_fused as launch

from . import peers as peer_kernels
from .common import (base_parser, compile_uncached, environment, fake_tp_group, hf_rms_norm,
                     write_results)
from .timing import cuda_graph_us, hbm_floor_us, sets_to_outgrow_l2

TOKENS = (1, 4, 8, 16, 32, 64)
#: The GEMV form's sweep: up to this many tokens, over these shapes.
SWEEP_GEMV_MAX_TOKENS = 4
SWEEP_GEMV_BLOCK_N = (16, 32, 64)
SWEEP_GEMV_WARPS = (4, 8)
SWEEP_GEMV_STAGES = (2, 3, 4)
TP_TOKENS = (512, 4096, 16384)
TPS = (2, 4, 8)
SHARD_TOKENS = (1, 2, 4, 8, 16, 32)
SHARD_TP = 8
LATENT, HIDDEN, SHARED_INTER = 3584, 7168, 2048
EPS = 1e-6
#: The column peers are compared with: the op (its tier for T), called directly as a peer is.
PEER_BASELINE = "op_us"
DTYPE = torch.bfloat16
DEVICE = "cuda"  # (a CPU dry run of the code paths sets "cpu" and smaller widths)

#: The sweep grid (stage 1 at the default block_k; stage 2: block_k for the 3 fastest).
SWEEP_BLOCK_N = (16, 32, 64, 128)
SWEEP_SPLIT_K = (1, 2, 4)
SWEEP_WARPS = (4, 8)
SWEEP_STAGES = (3, 4, 5)
SWEEP_BLOCK_K = (64, 128, 256, 512)
SWEEP_NORM_BLOCK_K = (256, 512, 1024, 2048)


def tail(routed, shared, norm_w, up_w):
    """The tp = 1 tail as a model writes it."""
    return shared + hf_rms_norm(routed, norm_w, EPS) @ up_w.T


def tail_model_form(act, down_w, routed, norm_w, up_w):
    """The tail with the shared expert's down-projection (what the graph pass claims)."""
    return act @ down_w.T + hf_rms_norm(routed, norm_w, EPS) @ up_w.T


def _tail_inputs(t: int):
    device = DEVICE
    routed = torch.randn(t, LATENT, device=device).to(DTYPE)
    shared = torch.randn(t, HIDDEN, device=device).to(DTYPE)
    norm_w = (1 + 0.1 * torch.randn(LATENT, device=device)).to(DTYPE)
    up_w = (torch.randn(HIDDEN, LATENT, device=device) / LATENT**0.5).to(DTYPE)
    return routed, shared, norm_w, up_w


def _tail_bytes(t: int) -> int:
    return 2 * (HIDDEN * LATENT + LATENT + t * LATENT + 2 * t * HIDDEN)


def _model_inputs(t: int):
    device = DEVICE
    routed, _, norm_w, up_w = _tail_inputs(t)
    act = torch.randn(t, SHARED_INTER, device=device).to(DTYPE)
    down_w = (torch.randn(HIDDEN, SHARED_INTER, device=device) / SHARED_INTER**0.5).to(DTYPE)
    return act, down_w, routed, norm_w, up_w


def _model_bytes(t: int) -> int:
    return _tail_bytes(t) - 2 * t * HIDDEN + 2 * (HIDDEN * SHARED_INTER + t * SHARED_INTER)


def peer_inputs(routed, shared, norm_w, up_w) -> dict:
    """One input set as a peer's ``make`` gets it (``peers.CONTRACTS["moe_tail"]``)."""
    return {"routed": routed, "shared": shared, "norm_weight": norm_w, "up_weight": up_w}


def peer_point(t: int) -> dict:
    return {"op": "moe_tail", "T": t, "latent": LATENT, "hidden": HIDDEN, "eps": EPS}


def time_peers(peers, t: int, sets, ref, timer=cuda_graph_us) -> dict:
    """The ``peers`` cells of one row: each peer checked as :func:`_check` checks the
    variants, against ``ref``, then timed on ``sets``."""
    def check(make):
        try:
            _check(make(peer_inputs(*[a.clone() for a in sets[0]]))(), ref, "peer")
        except (AssertionError, TypeError, ValueError) as e:
            return peer_kernels.failure(e)
        return None

    return peer_kernels.time_peers(peers, peer_point(t), [peer_inputs(*s) for s in sets],
                                   check, timer)


def _check(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    # bf16 outputs of size ~1: a few output roundings apart at most; a wrong result is
    # off by O(1).
    try:
        torch.testing.assert_close(out, ref, rtol=2**-6, atol=2e-2)
    except AssertionError as e:
        raise AssertionError(f"{what} does not match the reference: {e}") from None


def config_label(cfg) -> str:
    return (f"n{cfg.block_n}_k{cfg.block_k}_p{cfg.norm_block_k}_s{cfg.split_k}"
            f"_w{cfg.num_warps}_st{cfg.num_stages}"
            + ("_swap" if cfg.swap_ab else "") + ("_gemv" if cfg.gemv else "")
            + ("_normed" if cfg.normed_rows else "")
            + ("_pdl" if cfg.pdl else "_pre" if cfg.prenorm else ""))


def _sweep(t: int, sets) -> dict:
    """``{label: us}`` over the grid, the default config's label, and the fastest."""
    sms = num_sms(torch.device(DEVICE))
    # the default as a call with no options runs it (the PDL norm-launch form where it runs);
    # the grid: the one-launch form (each program its own norm prologue)
    default = resolve_config(t, HIDDEN, LATENT, DTYPE, torch.device(DEVICE))
    dot_default = replace(pick_launch_config(t, HIDDEN, LATENT, DTYPE, sms, gemv=False),
                          prenorm=False, pdl=False, normed_rows=False)
    ref = tail(*sets[0])

    def time(cfg: LaunchConfig) -> float:
        opts = dict(block_n=cfg.block_n, block_k=cfg.block_k, split_k=cfg.split_k,
                    num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                    norm_block_k=cfg.norm_block_k, swap_ab=cfg.swap_ab, gemv=cfg.gemv,
                    prenorm=cfg.prenorm, pdl=cfg.pdl, normed_rows=cfg.normed_rows)
        fn = lambda r, s, w, u: launch(r, s, w, EPS, u, **opts)  # noqa: E731
        try:
            _check(fn(*sets[0]), ref, f"kernel {config_label(cfg)}")
            return cuda_graph_us(fn, sets)
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: skip, say so
            print(f"  T={t} {config_label(cfg)}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            return float("nan")

    times, configs = {}, {}

    def add(cfg: LaunchConfig, swap_ab=None) -> None:
        # The operand order: as given, else what the launcher would pick for this shape
        # (it swaps only where the weight-tile stages fit in shared memory).
        if swap_ab is None:
            swap_ab = resolve_config(t, HIDDEN, LATENT, DTYPE, torch.device(DEVICE),
                                     cfg.block_n, cfg.block_k, cfg.num_warps,
                                     cfg.num_stages, cfg.split_k, cfg.norm_block_k,
                                     gemv=cfg.gemv).swap_ab
        cfg = replace(cfg, swap_ab=swap_ab)
        label = config_label(cfg)
        if label not in times:
            configs[label] = cfg
            times[label] = time(cfg)

    for bn, sk, nw, ns in itertools.product(SWEEP_BLOCK_N, SWEEP_SPLIT_K, SWEEP_WARPS,
                                            SWEEP_STAGES):
        add(replace(dot_default, block_n=bn, split_k=sk, num_warps=nw, num_stages=ns))
    if t <= SWEEP_GEMV_MAX_TOKENS:  # before the refinement, so GEMV shapes get refined too
        gemv = pick_launch_config(t, HIDDEN, LATENT, DTYPE, sms, gemv=True)
        for bn, nw, ns in itertools.product(SWEEP_GEMV_BLOCK_N, SWEEP_GEMV_WARPS,
                                            SWEEP_GEMV_STAGES):
            # the same accumulator budget: block_k shrinks as block_n grows
            add(replace(gemv, block_n=bn, block_k=gemv_block_k(bn, block_m_for(t, True), LATENT),
                        num_warps=nw, num_stages=ns))
    fastest = sorted((v, k) for k, v in times.items() if v == v)[:3]
    for _, label in fastest:
        for bk in SWEEP_BLOCK_K:
            add(replace(configs[label], block_k=bk))
        for pk in SWEEP_NORM_BLOCK_K:
            add(replace(configs[label], norm_block_k=pk))
        if not configs[label].gemv:
            add(configs[label], swap_ab=not configs[label].swap_ab)  # the other operand order
    add(default)
    ok = {k: v for k, v in times.items() if v == v}
    best = min(ok, key=ok.get) if ok else None
    return {"times_us": times, "default": config_label(default), "best": best}


@torch.no_grad()  # inference graphs: what the passes fuse (and no recompile on grad mode)
def run_tail(tokens=TOKENS, sweep: bool = False, variants: bool = True, peers=()) -> list[dict]:
    def kernel(routed, shared, norm_w, up_w):
        return launch(routed, shared, norm_w, EPS, up_w)

    def op(routed, shared, norm_w, up_w):
        return torch.ops.k3fusion.latent_moe_tail(routed, shared, norm_w, EPS, up_w, None)

    rows = []
    for t in tokens:
        # Distinct weights per set too: up_w alone nearly fits in L2.
        sets = [_tail_inputs(t) for _ in range(sets_to_outgrow_l2(_tail_bytes(t)))]
        ref = reference.latent_moe_tail(*sets[0][:3], EPS, sets[0][3])
        row = {"T": t, "floor_us": hbm_floor_us(_tail_bytes(t)), "input_sets": len(sets)}
        if variants:
            fns = {"eager": tail, "inductor": compile_uncached(tail, "inductor"), "op": op}
            if t <= MAX_TOKENS:
                fns["kernel"] = kernel
            for name, fn in fns.items():
                _check(fn(*sets[0]), ref, name)  # compiles, then checks, then times
                row[f"{name}_us"] = cuda_graph_us(fn, sets)
            row["op_tier"] = str(k3fusion.moe_tail.select_tier(t, HIDDEN, 1, DEVICE))
            if peers:
                row["peers"] = time_peers(peers, t, sets, ref)
                peer_kernels.summarize(row, PEER_BASELINE)

            msets = [_model_inputs(t) for _ in range(sets_to_outgrow_l2(_model_bytes(t)))]
            mref = tail_model_form(*msets[0])
            row["model_floor_us"] = hbm_floor_us(_model_bytes(t))
            row["model_eager_us"] = cuda_graph_us(tail_model_form, msets)
            for name, backend in (("model_inductor", "inductor"), ("model_k3fusion", "k3fusion")):
                k3fusion.reset_match_counts()
                fn = compile_uncached(tail_model_form, backend)
                _check(fn(*msets[0]), mref, name)
                if backend == "k3fusion":
                    row["model_k3fusion_matches"] = k3fusion.match_counts().get("moe_tail", 0)
                row[f"{name}_us"] = cuda_graph_us(fn, msets)
            if "kernel_us" in row:
                row["kernel_vs_inductor"] = row["inductor_us"] / row["kernel_us"]
                row["kernel_of_floor"] = row["floor_us"] / row["kernel_us"]
            row["model_k3fusion_vs_inductor"] = row["model_inductor_us"] / row["model_k3fusion_us"]
        if sweep and t <= MAX_TOKENS:
            row["sweep"] = _sweep(t, sets)
            best = row["sweep"]["best"]
            if best:
                row["sweep_best_us"] = row["sweep"]["times_us"][best]
                row["sweep_default_us"] = row["sweep"]["times_us"][row["sweep"]["default"]]
        rows.append(row)
        print(", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in row.items() if k != "sweep"), flush=True)
        if "sweep" in row:
            print(f"  sweep: best {row['sweep']['best']} {row.get('sweep_best_us', float('nan')):.2f} us,"
                  f" default {row['sweep']['default']} {row.get('sweep_default_us', float('nan')):.2f} us",
                  flush=True)
    return rows


@torch.no_grad()
def run_tp(tokens=TP_TOKENS, tps=TPS) -> list[dict]:
    """(b): one rank's column-parallel ``addmm_`` vs the replicated full GEMM."""
    rows = []
    for t in tokens:
        nbytes = 2 * (t * LATENT + HIDDEN * LATENT + 2 * t * HIDDEN)
        sets = []
        for _ in range(sets_to_outgrow_l2(nbytes)):
            h = torch.randn(t, LATENT, device=DEVICE).to(DTYPE)
            up_w = (torch.randn(HIDDEN, LATENT, device=DEVICE) / LATENT**0.5).to(DTYPE)
            sets.append((h, up_w, torch.zeros(t, HIDDEN, device=DEVICE, dtype=DTYPE)))
        flops = 2.0 * t * LATENT * HIDDEN

        def full(h, up_w, out):
            return h @ up_w.T

        row = {"T": t, "input_sets": len(sets)}
        row["replicated_us"] = cuda_graph_us(full, sets)
        row["replicated_tflops"] = flops / row["replicated_us"] * 1e-6
        ref = full(*sets[0])
        for tp in tps:
            if HIDDEN % tp:
                continue
            shard = HIDDEN // tp
            start = (tp - 1) * shard  # the last rank: a shard at a nonzero column offset

            def column(h, up_w, out, start=start, shard=shard):
                out.narrow(-1, start, shard).addmm_(h, up_w.narrow(0, start, shard).t())

            h, up_w, out = sets[0]
            out.zero_()
            column(h, up_w, out)
            _check(out[:, start:start + shard], ref[:, start:start + shard], f"tp={tp} shard")
            row[f"tp{tp}_us"] = cuda_graph_us(column, sets)  # accumulates: timing only
            row[f"tp{tp}_speedup"] = row["replicated_us"] / row[f"tp{tp}_us"]
            row[f"tp{tp}_tflops"] = flops / tp / row[f"tp{tp}_us"] * 1e-6
        rows.append(row)
        print(", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in row.items()), flush=True)
        del sets
        torch.cuda.empty_cache()
    return rows


@torch.no_grad()
def run_shard(tokens=SHARD_TOKENS, tp: int = SHARD_TP, timer=cuda_graph_us) -> list[dict]:
    """(c): rank 0 of a fake group of ``tp`` ranks runs the column-parallel tier (its
    ``H / tp`` columns of ``up_w``); each variant checked first (with collectives that move
    nothing, the rank's columns hold ``shared + h @ up_w[cols].T`` and the rest ``shared``)."""
    if HIDDEN % tp:
        raise ValueError(f"--shard-tp {tp} does not divide H = {HIDDEN}")
    started = not torch.distributed.is_initialized()
    group = fake_tp_group(tp)
    try:
        return _shard_rows(tokens, tp, group, timer)
    finally:
        if started:  # the benchmarks after this one in the process (`k3fusion bench`)
            torch.distributed.destroy_process_group()


def _shard_rows(tokens, tp: int, group, timer) -> list[dict]:
    shard = HIDDEN // tp
    rows = []
    for t in tokens:
        nbytes = 2 * (shard * LATENT + t * LATENT + 2 * t * HIDDEN)
        sets = [_tail_inputs(t) for _ in range(sets_to_outgrow_l2(nbytes))]
        routed, shared, norm_w, up_w = sets[0]
        want = shared.clone()
        want[:, :shard] = reference.latent_moe_tail(routed, shared[:, :shard], norm_w, EPS,
                                                    up_w[:shard])

        def tier(routed, shared, norm_w, up_w, donate=False):
            return moe_tail.latent_moe_tail(routed, shared, norm_w, EPS, up_w, group,
                                            tier="column_parallel", donate_shared=donate,
                                            donate_routed=donate)

        def unfused():
            return mock.patch.object(moe_tail.tiers, "COLUMN_FUSED_MAX_TOKENS", 0)

        row = {"T": t, "tp": tp, "input_sets": len(sets), "floor_us": hbm_floor_us(nbytes)}
        for key, ctx, donate in (("tier_us", contextlib.nullcontext, False),
                                 ("tier_donated_us", contextlib.nullcontext, True),
                                 ("unfused_us", unfused, False)):
            with ctx():
                _check(tier(*[a.clone() for a in sets[0]], donate=donate), want,
                       f"T={t} {key}")
                # donated: every call writes its partials, so on copies of them (timing only)
                timed = [(r.clone(), s.clone(), w, u) for r, s, w, u in sets] if donate else sets
                row[key] = timer(lambda *a, donate=donate: tier(*a, donate=donate), timed)
        rows.append(row)
        print(", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in row.items()), flush=True)
    return rows


def run(tokens=TOKENS, sweep: bool = False, sweep_only: bool = False, tp_tokens=TP_TOKENS,
        tps=TPS, peers=(), shard_tokens=SHARD_TOKENS, shard_tp: int = SHARD_TP) -> dict:
    rows = run_tail(tokens, sweep or sweep_only, variants=not sweep_only, peers=peers)
    tp_rows = [] if sweep_only else run_tp(tp_tokens, tps)
    shard_rows = [] if sweep_only or not shard_tokens else run_shard(shard_tokens, shard_tp)
    return {"bench": "moe_tail", "latent": LATENT, "hidden": HIDDEN, "dtype": "bfloat16",
            "rows": rows, "tp_rows": tp_rows, "tps": list(tps), "shard_rows": shard_rows,
            "peers": peer_kernels.sources(peers), **environment()}


def _f(row: dict, key: str, fmt: str = "{:.2f}") -> str:
    v = row.get(key)
    return "-" if v is None or v != v else fmt.format(v)


def markdown(result: dict) -> str:
    head = (f"Latent-MoE tail, L {result['latent']} -> H {result['hidden']}, "
            f"{result['dtype']}. {result['gpu']}, {result['date']}, torch {result['torch']}, "
            f"triton {result['triton']}. CUDA-graph replay (20 calls per graph, inputs and "
            "weights rotated to outgrow L2), median us per call.")
    lines = [head, ""]
    rows = [r for r in result["rows"] if "eager_us" in r]
    if rows:
        lines += [
            "(a) tp = 1 tail `shared + rms_norm(routed) @ up_w.T`:",
            "",
            "| T | eager | default Inductor | fused kernel | op (tier) | HBM floor "
            "| kernel vs Inductor | of floor |"
            + "".join(f" {c} |" for c in peer_kernels.table_columns(result)),
            "|---:|---:|---:|---:|---:|---:|---:|---:|"
            + "---:|" * len(peer_kernels.table_columns(result)),
        ]
        for r in rows:
            lines.append(
                f"| {r['T']} | {_f(r, 'eager_us')} | {_f(r, 'inductor_us')} | "
                f"{_f(r, 'kernel_us')} | {_f(r, 'op_us')} ({r.get('op_tier', '-')}) | "
                f"{_f(r, 'floor_us')} | {_f(r, 'kernel_vs_inductor', '{:.2f}x')} | "
                f"{_f(r, 'kernel_of_floor', '{:.0%}')} |"
                + "".join(f" {c} |" for c in peer_kernels.table_cells(result, r)))
        lines += peer_kernels.sources_lines(result, "the op")
        lines += [
            "",
            "Model form `act @ down_w.T + rms_norm(routed) @ up_w.T` (shared down-projection "
            f"[{result['hidden']}, {SHARED_INTER}]), compiled:",
            "",
            "| T | eager | default Inductor | k3fusion | matches | HBM floor | k3fusion vs Inductor |",
            "|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            lines.append(
                f"| {r['T']} | {_f(r, 'model_eager_us')} | {_f(r, 'model_inductor_us')} | "
                f"{_f(r, 'model_k3fusion_us')} | {r.get('model_k3fusion_matches', '-')} | "
                f"{_f(r, 'model_floor_us')} | {_f(r, 'model_k3fusion_vs_inductor', '{:.2f}x')} |")
    swept = [r for r in result["rows"] if "sweep" in r]
    if swept:
        lines += ["", "Kernel launch-config sweep (label: block_n, block_k, norm_block_k, "
                  "split_k, warps, stages; fastest five, and the default):", "",
                  "| T | fastest (us) | default (us) |", "|---:|---|---|"]
        for r in swept:
            times = {k: v for k, v in r["sweep"]["times_us"].items() if v == v}
            top = sorted(times, key=times.get)[:5]
            d = r["sweep"]["default"]
            lines.append(f"| {r['T']} | " + ", ".join(f"{k} {times[k]:.2f}" for k in top)
                         + f" | {d} {_f(r['sweep']['times_us'], d)} |")
    tp_rows = result.get("tp_rows") or []
    if tp_rows:
        tps = result["tps"]
        lines += ["", "(b) Up-projection GEMM on one GPU: one rank's column-parallel "
                  "`addmm_` (H/tp columns) vs the replicated full `h @ up_w.T` "
                  "(us, speedup; ideal = tp):", "",
                  "| T | replicated | " + " | ".join(f"tp={tp}" for tp in tps) + " |",
                  "|---:|---:|" + "---:|" * len(tps)]
        for r in tp_rows:
            cells = [f"{_f(r, f'tp{tp}_us')} ({_f(r, f'tp{tp}_speedup', '{:.2f}x')})"
                     for tp in tps]
            lines.append(f"| {r['T']} | {_f(r, 'replicated_us')} | " + " | ".join(cells) + " |")
    shard_rows = result.get("shard_rows") or []
    if shard_rows:
        tp = shard_rows[0]["tp"]
        lines += ["", f"(c) One rank's column-parallel tier at tp = {tp} (H/{tp} columns of "
                  "`up_w`; a fake process group: collectives move nothing and are not "
                  "timed), us:", "",
                  "| T | tier | tier, partials donated | shard unfused | HBM floor |",
                  "|---:|---:|---:|---:|---:|"]
        for r in shard_rows:
            lines.append(f"| {r['T']} | {_f(r, 'tier_us')} | {_f(r, 'tier_donated_us')} | "
                         f"{_f(r, 'unfused_us')} | {_f(r, 'floor_us')} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401  (matplotlib.ticker below)

    rows = [r for r in result["rows"] if "eager_us" in r]
    tp_rows = result.get("tp_rows") or []
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    ax = axes[0]
    for key, label in (("eager_us", "eager"), ("inductor_us", "default Inductor"),
                       ("kernel_us", "fused kernel"), ("model_inductor_us", "model form, Inductor"),
                       ("model_k3fusion_us", "model form, k3fusion"), ("floor_us", "HBM floor"),
                       *peer_kernels.plot_series_of(result)):
        pts = [(r["T"], r[key]) for r in rows if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=label,
                    linestyle="--" if key == "floor_us" else "-")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set(xlabel="tokens T", ylabel="us (CUDA-graph replay, median)",
           title=f"(a) tp=1 tail, bf16, {result['gpu']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax = axes[1]
    for r in tp_rows:
        tps = [tp for tp in result["tps"] if f"tp{tp}_speedup" in r]
        ax.plot(tps, [r[f"tp{tp}_speedup"] for tp in tps], marker="o", label=f"T={r['T']}")
    if tp_rows:
        ax.plot(result["tps"], result["tps"], linestyle="--", color="gray", label="ideal (tp)")
    ax.set(xlabel="tp", ylabel="replicated / column-parallel GEMM time",
           title="(b) column-parallel up-projection GEMM speedup")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parser():
    p = base_parser("python -m k3fusion.bench.moe_tail", TOKENS)
    p.add_argument("--sweep-only", action="store_true",
                   help="only the kernel launch-config sweep (no compiles, no tp part)")
    p.add_argument("--tp-tokens", type=int, nargs="*", default=list(TP_TOKENS),
                   help="T of the column-parallel GEMM comparison (none: skip it)")
    p.add_argument("--tps", type=int, nargs="*", default=list(TPS))
    p.add_argument("--shard-tokens", type=int, nargs="*", default=list(SHARD_TOKENS),
                   help="decode T of one rank's column-parallel tier, part (c) (none: skip it)")
    p.add_argument("--shard-tp", type=int, default=SHARD_TP,
                   help="ranks of part (c)'s fake process group")
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    peers = peer_kernels.from_args(p, args, "moe_tail")
    for name in ("tokens", "tp_tokens", "tps", "shard_tokens"):
        if any(v < 1 for v in getattr(args, name)):
            raise SystemExit(f"--{name.replace('_', '-')} values must be >= 1")
    if args.shard_tp < 2 or HIDDEN % args.shard_tp:
        raise SystemExit(f"--shard-tp must be >= 2 and divide H = {HIDDEN}, got {args.shard_tp}")
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU (none is visible here)")
    result = run(args.tokens, args.sweep, args.sweep_only, args.tp_tokens, args.tps, peers,
                 args.shard_tokens, args.shard_tp)
    write_results(args.out, "moe_tail", result, markdown(result), plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
