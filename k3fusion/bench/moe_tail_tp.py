"""The latent-MoE tail tiers side by side across GPUs, and the thresholds they imply.

    torchrun --nproc-per-node N -m k3fusion.bench.moe_tail_tp
        [--tokens 1 4 16 64 256 1024 4096 16384] [--latent 3584] [--hidden 7168]
        [--dtype bfloat16] [--no-symm-mem] [--out DIR]

One process per GPU, NCCL. For each T, every tier ``k3fusion.moe_tail`` has there (forced)
and the symmetric-memory fused tail: checked against an fp64 tail of every rank's partials
and bit for bit across ranks, then timed under CUDA-graph replay (the slowest rank's
median). Rank 0 prints the crossovers (the fused-tail limit, the overlap threshold) and
writes ``moe_tail_tp.json`` / ``.md`` / ``.png`` to ``--out``. NVLink multicast stays off
unless the environment says otherwise.

How it measures:
docs/bench-methods.md, section "``torchrun --nproc-per-node N -m k3fusion.bench.moe_tail_tp``".
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from k3fusion import moe_tail
from k3fusion.moe_tail.symm_mem import MAX_TOKENS as SYMM_MAX_TOKENS
from k3fusion.moe_tail.symm_mem import (prepare_symm_mem_tail, symm_mem_latent_moe_tail,
                                        unavailable_reason)

from .common import environment, plot_series, write_results
from .timing import cuda_graph_us, hbm_floor_us, sets_to_outgrow_l2

EPS = 1e-6
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
TOKENS = (1, 4, 16, 64, 256, 1024, 4096, 16384)
TIERS = ("replicated", "allreduce_overlap", "column_parallel")
SYMM = "symm_mem"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m k3fusion.bench.moe_tail_tp")
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    p.add_argument("--latent", type=int, default=3584)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--no-symm-mem", action="store_true",
                   help="leave out the symmetric-memory fused tail")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-out")))
    return p


def _max_over_ranks(value: float, group) -> float:
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _rel_err(y: torch.Tensor, exact: torch.Tensor) -> float:
    return float((y.double() - exact).abs().max() / exact.abs().max().clamp_min(1e-30))


def _all_ranks_equal(y: torch.Tensor, group, world: int) -> bool:
    import torch.distributed as dist

    ys = [torch.empty_like(y) for _ in range(world)]
    dist.all_gather(ys, y.contiguous(), group=group)
    return all(torch.equal(other, ys[0]) for other in ys)


def _inputs(tokens: int, args, rank: int) -> list[tuple]:
    dt, latent, hidden = DTYPES[args.dtype], args.latent, args.hidden
    item = dt.itemsize
    set_bytes = (hidden * latent + tokens * (latent + hidden)) * item
    sets = []
    for i in range(sets_to_outgrow_l2(set_bytes, most=4)):
        gw = torch.Generator(device="cuda").manual_seed(10 + i)  # same on every rank
        norm_w = (1 + 0.1 * torch.randn(latent, device="cuda", generator=gw)).to(dt)
        up_w = (torch.randn(hidden, latent, device="cuda", generator=gw) / latent**0.5).to(dt)
        gp = torch.Generator(device="cuda").manual_seed(1000 * tokens + 100 * i + rank)
        x = torch.randn(tokens, latent, device="cuda", generator=gp).to(dt)
        s = torch.randn(tokens, hidden, device="cuda", generator=gp).to(dt)
        sets.append((x, s, norm_w, up_w))
    return sets


def _exact(x, s, w, up, group, world: int) -> torch.Tensor:
    """The tail in fp64 from every rank's gathered partials."""
    import torch.distributed as dist

    xs = [torch.empty_like(x) for _ in range(world)]
    ss = [torch.empty_like(s) for _ in range(world)]
    dist.all_gather(xs, x, group=group)
    dist.all_gather(ss, s, group=group)
    x64 = torch.stack(xs).double().sum(0)
    s64 = torch.stack(ss).double().sum(0)
    h = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS) * w.double()
    return s64 + h @ up.double().T


def _one_t(tokens: int, args, group, rank: int, world: int, symm: bool) -> dict:
    import torch.distributed as dist

    sets = _inputs(tokens, args, rank)
    device = sets[0][0].device
    fns = {tier: (lambda x, s, w, up, tier=tier: moe_tail.latent_moe_tail(
        x, s, w, EPS, up, group, tier=tier)) for tier in TIERS
        if moe_tail.tier_unavailable_reason(tier, tokens, args.hidden, world, device) is None}
    if symm and tokens <= SYMM_MAX_TOKENS:
        fns[SYMM] = lambda x, s, w, up: symm_mem_latent_moe_tail(x, s, w, EPS, up, group)

    auto = moe_tail.select_tier(tokens, args.hidden, world, device).value
    autos = [None] * world
    dist.all_gather_object(autos, auto, group=group)
    row = dict(T=tokens, tp=world, auto=auto, same_auto_tier=len(set(autos)) == 1)
    exact = _exact(*sets[0], group, world)
    for name, fn in fns.items():
        y = fn(*sets[0])
        row[f"{name}_err"] = _max_over_ranks(_rel_err(y, exact), group)
        row[f"{name}_ranks_identical"] = _all_ranks_equal(y, group, world)
        del y
        try:
            us, error = cuda_graph_us(fn, sets), None
        except Exception as e:  # noqa: BLE001 - reported in the table, the run goes on
            us, error = float("inf"), f"{type(e).__name__}: {e}"[:300]
        slowest = _max_over_ranks(us, group)  # every rank learns whether any failed
        row[f"{name}_us"] = None if slowest == float("inf") else slowest
        if error is not None:
            row[f"{name}_error"] = f"rank {rank}: {error}"
    item = DTYPES[args.dtype].itemsize
    row["floor_us"] = hbm_floor_us(args.hidden * args.latent * item)  # reading up_w once
    del sets, exact
    torch.cuda.empty_cache()
    return row


def _last_win(rows: list[dict], wins) -> int | None:
    """The largest measured T up to which ``wins(row)`` holds at every measured T (a
    "T <= threshold" rule must not select a tier past a T where it lost); None if it
    already loses at the smallest."""
    last = None
    for r in sorted(rows, key=lambda r: r["T"]):
        if not wins(r):
            break
        last = r["T"]
    return last


def crossovers(rows: list[dict]) -> dict:
    """Thresholds the timings imply (None where the data has no crossover)."""
    def best_nccl(r):
        times = [r.get(f"{t}_us") for t in TIERS]
        times = [t for t in times if t is not None]
        return min(times) if times else None

    def symm_wins(r):
        symm, nccl = r.get(f"{SYMM}_us"), best_nccl(r)
        return symm is not None and nccl is not None and symm < nccl

    def overlap_wins(r):
        ov, cp = r.get("allreduce_overlap_us"), r.get("column_parallel_us")
        return ov is not None and cp is not None and ov <= cp

    return dict(fused_tail_max_tokens=_last_win(rows, symm_wins),
                overlap_threshold=_last_win(rows, overlap_wins))


def _markdown(rows: list[dict], args, world: int, env: dict) -> str:
    names = [n for n in (*TIERS, SYMM) if any(f"{n}_us" in r for r in rows)]

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    lines = [f"latent-MoE tail tiers, tp={world}, L={args.latent}, H={args.hidden}, "
             f"{args.dtype}, {env.get('gpu')}, {env.get('date')}, torch {env.get('torch')}, "
             f"triton {env.get('triton')} (CUDA-graph replay, slowest rank's median, us)", "",
             "| T | " + " | ".join(names) + " | up_w HBM floor | auto tier (same on all ranks) "
             "| max rel err | ranks bit-identical |",
             "|---:|" + "---:|" * len(names) + "---:|---|---:|---|"]
    for r in rows:
        errs = [r[f"{n}_err"] for n in names if f"{n}_err" in r]
        same = all(r[f"{n}_ranks_identical"] for n in names if f"{n}_ranks_identical" in r)
        lines.append(f"| {r['T']} | " + " | ".join(fmt(r.get(f"{n}_us"), ".2f") for n in names)
                     + f" | {r['floor_us']:.2f} | {r['auto']} "
                     f"({'yes' if r['same_auto_tier'] else 'NO'}) | {max(errs):.2e} "
                     f"| {'yes' if same else 'NO'} |")
    c = crossovers(rows)
    lines += ["", f"Crossovers: symm-mem fused tail fastest up to T = {c['fused_tail_max_tokens']}; "
              f"overlap no slower than column-parallel up to T = {c['overlap_threshold']}."]
    for r in rows:
        for key, value in r.items():
            if key.endswith("_error"):
                lines.append(f"\nT={r['T']} {key[:-6]}: {value}")
    return "\n".join(lines) + "\n"


def _plot(result: dict, path: Path) -> None:
    names = [n for n in (*TIERS, SYMM) if any(f"{n}_us" in r for r in result["rows"])]
    plot_series(result, [(f"{n}_us", n) for n in names] + [("floor_us", "up_w HBM floor")],
                f"latent-MoE tail tiers, tp={result['tp']}", path)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise SystemExit("run it under torchrun, one process per GPU: torchrun "
                         "--nproc-per-node N -m k3fusion.bench.moe_tail_tp")
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs CUDA GPUs")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    try:
        group = dist.group.WORLD
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        symm = not args.no_symm_mem
        if symm:
            why = unavailable_reason(1, args.hidden, group, torch.device("cuda", local))
            if why is not None:
                if rank == 0:
                    print(f"symm-mem tail left out: {why}", flush=True)
                symm = False
            else:
                prepare_symm_mem_tail(group, args.latent, args.hidden, DTYPES[args.dtype])
        rows = []
        for t in args.tokens:
            rows.append(_one_t(t, args, group, rank, world, symm))
            if rank == 0:
                print(f"T={t} done", flush=True)
        ok = all(r["same_auto_tier"] and all(v for k, v in r.items()
                                             if k.endswith("_ranks_identical")) for r in rows)
        if rank == 0:
            env = environment()
            result = dict(environment=env, tp=world, latent=args.latent, hidden=args.hidden,
                          dtype=args.dtype, rows=rows, crossovers=crossovers(rows))
            write_results(args.out, "moe_tail_tp", result, _markdown(rows, args, world, env),
                          _plot)
    finally:
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
