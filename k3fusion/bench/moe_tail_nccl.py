"""Multi-GPU check of the latent-MoE tail tiers over NCCL (needs >= 2 CUDA GPUs).

``python -m k3fusion.bench.moe_tail_nccl [--world N]``: one process per GPU; for each T,
every tier available (forced) is compared with an exact reference computed from all
ranks' gathered partials, and the tier ``select_tier`` picks is checked to be the same
on every rank. Prints one line per (T, tier). Leaves NVLink multicast off (the machine's
NCCL_NVLS_ENABLE / TORCH_SYMM_MEM_DISABLE_MULTICAST settings are inherited).
"""

from __future__ import annotations

import argparse
import os
import socket

import torch

TOKENS = (1, 16, 256, 4096)
HIDDEN, LATENT = 7168, 3584


def _worker(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist

    from k3fusion import moe_tail, reference

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=torch.device("cuda", rank))
    group = dist.group.WORLD
    dt = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)  # replicated weights: same seed
    norm_w = (1 + 0.1 * torch.randn(LATENT, device="cuda", generator=gen)).to(dt)
    up_w = (torch.randn(HIDDEN, LATENT, device="cuda", generator=gen) / LATENT**0.5).to(dt)
    for t in TOKENS:
        g = torch.Generator(device="cuda").manual_seed(1000 * t + rank)  # per-rank partials
        routed = torch.randn(t, LATENT, device="cuda", generator=g).to(dt)
        shared = torch.randn(t, HIDDEN, device="cuda", generator=g).to(dt)
        parts_r = [torch.empty_like(routed) for _ in range(world)]
        parts_s = [torch.empty_like(shared) for _ in range(world)]
        dist.all_gather(parts_r, routed)
        dist.all_gather(parts_s, shared)
        # Exact in fp64 from the partials (what all-reduces in bf16 approximate).
        r64 = torch.stack(parts_r).double().sum(0)
        s64 = torch.stack(parts_s).double().sum(0)
        n64 = r64 * torch.rsqrt(r64.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w.double()
        exact = s64 + n64 @ up_w.double().T
        scale = exact.abs().max().item()
        auto = moe_tail.select_tier(t, HIDDEN, world, routed.device)
        names = [None] * world
        dist.all_gather_object(names, auto.value)
        assert len(set(names)) == 1, f"ranks chose different tiers at T={t}: {names}"
        ref = reference.latent_moe_tail(routed, shared, norm_w, 1e-6, up_w, group)
        ref_err = (ref.double() - exact).abs().max().item() / scale
        for tier in moe_tail.available_tiers(t, HIDDEN, world, routed.device):
            y = moe_tail.latent_moe_tail(routed, shared, norm_w, 1e-6, up_w, group, tier=tier)
            torch.cuda.synchronize()
            err = (y.double() - exact).abs().max().item() / scale
            same = [None] * world
            dist.all_gather_object(same, y.float().sum().item())
            if rank == 0:
                print(f"T={t:5d} tp={world} tier={tier.value:18s} auto={auto.value:18s} "
                      f"max rel err {err:.2e} (reference {ref_err:.2e}) "
                      f"ranks agree: {max(same) - min(same) == 0}", flush=True)
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m k3fusion.bench.moe_tail_nccl")
    p.add_argument("--world", type=int, default=0, help="GPUs to use (default: all)")
    args = p.parse_args(argv)
    world = args.world or torch.cuda.device_count()
    if world < 2:
        raise SystemExit("this check needs at least two CUDA GPUs")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    torch.multiprocessing.spawn(_worker, args=(world, port), nprocs=world)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
