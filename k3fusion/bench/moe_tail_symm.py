"""The symmetric-memory latent-MoE tail against the ALLREDUCE_OVERLAP tier, across GPUs.

    torchrun --nproc-per-node N -m k3fusion.bench.moe_tail_symm [--tokens 1 4 16]
        [--latent 3584] [--hidden 7168] [--dtype bfloat16] [--out DIR]

One process per GPU, NCCL. For each T every rank draws its own partials (the replicated
weights from one seed) and

* checks correctness: the ``symm_mem`` tail (``k3fusion.moe_tail_symm``) and the overlap
  tier against the exact tail computed in fp64 from every rank's gathered partials (max
  error relative to max |exact|), and that every rank's ``symm_mem`` output is
  bit-identical to rank 0's;
* times both under CUDA-graph replay (``k3fusion.bench.timing.cuda_graph_us``: 20 calls
  per graph, inputs rotated to outgrow L2), taking the slowest rank's median (a step
  waits for the slowest rank).

Rank 0 prints a markdown table and writes ``moe_tail_symm.json`` / ``.md`` to ``--out``.
With ``--nproc-per-node 1`` it is a one-GPU smoke check (the overlap tier then has no
all-reduce: it is the plain tail). NVLink multicast stays off unless the environment says
otherwise (``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NCCL_NVLS_ENABLE=0`` by default).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

EPS = 1e-6
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m k3fusion.bench.moe_tail_symm")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--latent", type=int, default=3584)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-out")))
    return p


def _max_over_ranks(value: float, group) -> float:
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _rel_err(y: torch.Tensor, exact: torch.Tensor) -> float:
    return float((y.double() - exact).abs().max() / exact.abs().max().clamp_min(1e-30))


def _one_t(tokens: int, args, group, rank: int, world: int) -> dict:
    import torch.distributed as dist

    from k3fusion import moe_tail
    from k3fusion.bench.timing import cuda_graph_us, hbm_floor_us, sets_to_outgrow_l2
    from k3fusion.moe_tail_symm import symm_mem_latent_moe_tail

    dt, latent, hidden = DTYPES[args.dtype], args.latent, args.hidden
    item = torch.empty((), dtype=dt).element_size()
    set_bytes = (hidden * latent + tokens * (latent + hidden)) * item
    n_sets = sets_to_outgrow_l2(set_bytes, most=4)
    sets = []
    for i in range(n_sets):
        gw = torch.Generator(device="cuda").manual_seed(10 + i)  # same on every rank
        norm_w = (1 + 0.1 * torch.randn(latent, device="cuda", generator=gw)).to(dt)
        up_w = (torch.randn(hidden, latent, device="cuda", generator=gw) / latent**0.5).to(dt)
        gp = torch.Generator(device="cuda").manual_seed(1000 * tokens + 100 * i + rank)
        x = torch.randn(tokens, latent, device="cuda", generator=gp).to(dt)
        s = torch.randn(tokens, hidden, device="cuda", generator=gp).to(dt)
        sets.append((x, s, norm_w, up_w))

    def symm(x, s, w, up):
        return symm_mem_latent_moe_tail(x, s, w, EPS, up, group)

    def overlap(x, s, w, up):
        return moe_tail.latent_moe_tail(x, s, w, EPS, up, group, tier="allreduce_overlap")

    # Correctness on set 0, against fp64 from every rank's partials.
    x, s, w, up = sets[0]
    xs = [torch.empty_like(x) for _ in range(world)]
    ss = [torch.empty_like(s) for _ in range(world)]
    dist.all_gather(xs, x, group=group)
    dist.all_gather(ss, s, group=group)
    x64 = torch.stack(xs).double().sum(0)
    s64 = torch.stack(ss).double().sum(0)
    exact = s64 + (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS) * w.double()) \
        @ up.double().T
    y_symm, y_overlap = symm(*sets[0]), overlap(*sets[0])
    ys = [torch.empty_like(y_symm) for _ in range(world)]
    dist.all_gather(ys, y_symm, group=group)
    identical = all(torch.equal(y, ys[0]) for y in ys)
    row = dict(T=tokens, tp=world, err_symm=_max_over_ranks(_rel_err(y_symm, exact), group),
               err_overlap=_max_over_ranks(_rel_err(y_overlap, exact), group),
               ranks_identical=identical)

    for name, fn in (("symm_us", symm), ("overlap_us", overlap)):
        try:
            us, error = cuda_graph_us(fn, sets), None
        except Exception as e:  # noqa: BLE001 - reported in the table, the run goes on
            us, error = float("inf"), f"{type(e).__name__}: {e}"[:300]
        # Every rank learns whether any failed (the next collectives stay matched).
        slowest = _max_over_ranks(us, group)
        row[name] = None if slowest == float("inf") else slowest
        if error is not None:
            row[f"{name}_error"] = f"rank {rank}: {error}"
    row["floor_us"] = hbm_floor_us(hidden * latent * item)  # reading up_w once
    if row.get("symm_us") and row.get("overlap_us"):
        row["speedup"] = row["overlap_us"] / row["symm_us"]
    return row


def _markdown(rows: list[dict], args, world: int, env: dict) -> str:
    def fmt(v, spec):
        return "n/a" if v is None else format(v, spec)

    lines = [f"latent-MoE tail, tp={world}, L={args.latent}, H={args.hidden}, {args.dtype}, "
             f"{env.get('gpu')}, torch {env.get('torch')}, triton {env.get('triton')} "
             "(CUDA-graph replay, slowest rank's median)", "",
             "| T | symm_mem (us) | allreduce_overlap (us) | speedup | up_w HBM floor (us) "
             "| rel err symm_mem | rel err overlap | ranks bit-identical |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['T']} | {fmt(r.get('symm_us'), '.2f')} | {fmt(r.get('overlap_us'), '.2f')} "
            f"| {fmt(r.get('speedup'), '.2f')} | {r['floor_us']:.2f} | {r['err_symm']:.2e} "
            f"| {r['err_overlap']:.2e} | {'yes' if r['ranks_identical'] else 'NO'} |")
    for r in rows:
        for key in ("symm_us_error", "overlap_us_error"):
            if key in r:
                lines.append(f"\nT={r['T']} {key[:-9]}: {r[key]}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise SystemExit("run it under torchrun, one process per GPU: torchrun "
                         "--nproc-per-node N -m k3fusion.bench.moe_tail_symm")
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs CUDA GPUs")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import torch.distributed as dist

    from k3fusion.bench.common import environment
    from k3fusion.moe_tail_symm import enable_symm_mem_tail, prepare_symm_mem_tail

    local = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    try:
        group = dist.group.WORLD
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        enable_symm_mem_tail()
        prepare_symm_mem_tail(group, args.latent, args.hidden, DTYPES[args.dtype])
        rows = [_one_t(t, args, group, rank, world) for t in args.tokens]
        if rank == 0:
            env = environment()
            md = _markdown(rows, args, world, env)
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "moe_tail_symm.json").write_text(json.dumps(
                dict(environment=env, tp=world, latent=args.latent, hidden=args.hidden,
                     dtype=args.dtype, rows=rows), indent=2))
            (args.out / "moe_tail_symm.md").write_text(md)
            print(md, flush=True)
        ok = all(r["ranks_identical"] for r in rows)
    finally:
        dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
