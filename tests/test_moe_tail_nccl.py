"""The latent-MoE tail tiers over NCCL, one GPU per rank, at Kimi-K3 widths (bf16, L = 3584,
H = 7168): every NCCL tier (replicated, overlap, column-parallel; the fused tail needs the
opt-in symm-mem implementation at tp > 1, tested in ``test_moe_tail_symm``) forced at T
from 0 to 4096, across the overlap threshold (default and one above) and around the
symm-mem tail's limit, equals the exact tail within the bound of ``test_moe_tail_tiers``;
the two tiers that run the same ops on different streams (replicated and overlap) equal
each other bit for bit; every rank's output is the same, and every rank's ``select_tier``
picks the same tier. Skipped without enough GPUs (``pytest -m cuda``).
"""

from __future__ import annotations

import pytest
import torch

from _gloo import run_ranks
from _tolerances import latent_tail_exact_and_bound

LATENT, HIDDEN = 3584, 7168
EPS = 1e-6
U_BF16 = 2.0**-8


def _tokens():
    from k3fusion.config import FusionConfig
    from k3fusion.moe_tail.symm_mem import SELECT_MAX_TOKENS

    thr = FusionConfig().shared_experts_stream_token_threshold
    return sorted({0, 1, 16, thr, thr + 1, SELECT_MAX_TOKENS, SELECT_MAX_TOKENS + 1, 4096})


def _tiers_on_rank(rank: int, world: int, group, tokens_list) -> dict:
    import torch.distributed as dist

    from k3fusion import moe_tail

    dev = torch.device("cuda", rank)
    dt = torch.bfloat16
    gw = torch.Generator(device=dev).manual_seed(3)  # replicated weights: one seed
    norm_w = (1 + 0.1 * torch.randn(LATENT, device=dev, generator=gw)).to(dt)
    up_w = (torch.randn(HIDDEN, LATENT, device=dev, generator=gw) / LATENT**0.5).to(dt)
    out = {}
    for tokens in tokens_list:
        g = torch.Generator(device=dev).manual_seed(1000 * tokens + rank)
        x = torch.randn(tokens, LATENT, device=dev, generator=g).to(dt)
        s = torch.randn(tokens, HIDDEN, device=dev, generator=g).to(dt)
        xs = [torch.empty_like(x) for _ in range(world)]
        ss = [torch.empty_like(s) for _ in range(world)]
        dist.all_gather(xs, x)
        dist.all_gather(ss, s)
        exact, bound = latent_tail_exact_and_bound(torch.stack(xs), torch.stack(ss), norm_w,
                                                   up_w, EPS, U_BF16)
        x_before, s_before = x.clone(), s.clone()
        facts, outputs = {}, {}
        for tier in moe_tail.available_tiers(tokens, HIDDEN, world, dev):
            y = moe_tail.latent_moe_tail(x, s, norm_w, EPS, up_w, group, tier=tier)
            ys = [torch.empty_like(y) for _ in range(world)]
            dist.all_gather(ys, y)
            over = (y.double() - exact).abs() > bound
            facts[tier.value] = dict(
                beyond_bound=int(over.sum()),
                same_on_ranks=all(torch.equal(o, ys[0]) for o in ys),
                inputs_kept=torch.equal(x, x_before) and torch.equal(s, s_before))
            outputs[tier.value] = y
        out[tokens] = dict(
            auto=moe_tail.select_tier(tokens, HIDDEN, world, dev).value, tiers=facts,
            overlap_equals_replicated=torch.equal(outputs["replicated"],
                                                  outputs["allreduce_overlap"]))
    return out


@pytest.mark.cuda
@pytest.mark.parametrize("world", [2, 4, 8])
def test_nccl_tiers_equal_the_exact_tail(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, {torch.cuda.device_count()} visible")
    tokens_list = _tokens()
    ranks = run_ranks(_tiers_on_rank, world, tokens_list, backend="nccl", timeout_s=600.0)
    for tokens in tokens_list:
        autos = {r[tokens]["auto"] for r in ranks}
        assert len(autos) == 1, f"T={tokens}: ranks chose {autos}"
        tiers = list(ranks[0][tokens]["tiers"])
        assert {"replicated", "allreduce_overlap", "column_parallel"} <= set(tiers), tiers
        for rank, r in enumerate(ranks):
            for tier in tiers:
                f = r[tokens]["tiers"][tier]
                what = f"tp={world} T={tokens} rank {rank} {tier}"
                assert f["beyond_bound"] == 0, f"{what}: {f['beyond_bound']} beyond the bound"
                assert f["same_on_ranks"], f"{what}: ranks differ"
                assert f["inputs_kept"], f"{what}: an input was modified"
            assert r[tokens]["overlap_equals_replicated"], (
                f"tp={world} T={tokens} rank {rank}: overlap and replicated differ")
