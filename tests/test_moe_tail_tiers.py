"""Latent-MoE tail tiers (``k3fusion.moe_tail``): selection rules, config/env switches,
and every tier against the reference under real ``torch.distributed`` (gloo, CPU).

Distributed part: one process group per world size (2 and 4), started once (spawned
processes, a free TCP port on 127.0.0.1) and running every case in turn; rank 0 checks
each case and the pytest items below report the cases one by one. No mocks: the tails
run real functional-collective all-reduces over gloo.

Tolerances. The exact value is computed in fp64 on rank 0 from every rank's partials
(each rank draws its inputs from a seed of its own, so rank 0 can redraw them all). A
tier rounds at: the partial sums of the two all-reduces (``tp - 1`` additions each),
the norm's cast and weight product (2), the GEMM output (or the ``addmm_`` beta-add,
1), and the final add (1): with unit roundoff ``u`` of the dtype, per element

    |y - exact| <= (2 tp + 8) u (S + (|h| + inv |w| X) @ |up_w|^T) + L 2^-24 |h| @ |up_w|^T

with ``S = sum_r |shared_r|``, ``X = sum_r |routed_r|``, ``h`` the exact normed latent
and ``inv`` its exact rsqrt factor (``inv |w| X`` carries the latent all-reduce's
rounding through the norm). The last term is the GEMM's fp32 accumulation over L. The
margin (2 tp + 8 roundings where at most 2 tp + 3 happen) covers the second-order
change of ``inv``. REPLICATED and ALLREDUCE_OVERLAP run the reference's op sequence on
the same collectives, so they must equal the distributed reference bit for bit.
"""

from __future__ import annotations

import math
import os
import time
import traceback

import pytest
import torch

import k3fusion
from _gloo import run_ranks
from _kernel_paths import cpu_path, spy_on_launcher
from _tolerances import latent_tail_exact_and_bound
from k3fusion import moe_tail, reference
from k3fusion.config import FusionConfig, load_config
from k3fusion.moe_tail import Tier, TierUnavailableError

LATENT = 40
EPS = 1e-6
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
ENV_VARS = ("K3FUSION_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD",
            "K3FUSION_DISABLE_SHARED_EXPERTS_STREAM", "K3FUSION_MOE_TAIL_TIER",
            "K3FUSION_MOE_TAIL", "K3FUSION_FUSED_TAIL_MAX_TOKENS")


# ============================================================================ inputs and bound


def partials(seed: int, rank: int, lead: tuple, hidden: int, dtype: torch.dtype):
    """Rank ``rank``'s partial sums (routed latent, shared): drawn from its own seed."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randn(*lead, LATENT, generator=g).to(dtype)
    s = torch.randn(*lead, hidden, generator=g).to(dtype)
    return x, s


def weights(seed: int, hidden: int, dtype: torch.dtype):
    """Replicated norm and up-projection weights (same on every rank)."""
    g = torch.Generator().manual_seed(7_000_000 + seed)
    norm_w = (1 + 0.5 * torch.randn(LATENT, generator=g)).to(dtype)
    up_w = (torch.randn(hidden, LATENT, generator=g) / math.sqrt(LATENT)).to(dtype)
    return norm_w, up_w


def exact_and_bound(seed, ranks, lead, hidden, dtype):
    """fp64 exact tail of the ranks' partials, and the per-element error bound (module doc)."""
    parts = [partials(seed, r, lead, hidden, dtype) for r in ranks]
    norm_w, up_w = weights(seed, hidden, dtype)
    return latent_tail_exact_and_bound(torch.stack([p[0] for p in parts]),
                                       torch.stack([p[1] for p in parts]), norm_w, up_w, EPS,
                                       UNIT_ROUNDOFF[dtype])


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, what: str):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got.double() - want).abs()
    bad = err > bound
    assert not bad.any(), (f"{what}: {int(bad.sum())} elements beyond the bound; worst "
                           f"err {float(err.max()):.3g} vs bound {float(bound[bad].min()):.3g}")


# ============================================================================ distributed harness

CASES: dict[str, tuple] = {}


def case(name, worlds=(2, 4)):
    """Register ``run(ctx) -> payload`` (every rank) with ``check(ctx, payloads)`` (rank 0)."""
    def deco(run):
        def with_check(check):
            CASES[name] = (run, check, worlds)
            return check
        run.check = with_check
        return run
    return deco


class Ctx:
    def __init__(self, rank, world, group):
        self.rank, self.world, self.group = rank, world, group
        self.ranks = list(range(world))


def _tail(ctx, seed, lead, hidden, dtype, *, group=None, ranks=None, **kw):
    """Run the tiered tail on this rank; returns what the checks need."""
    group = ctx.group if group is None else group
    x, s = partials(seed, ctx.rank, lead, hidden, dtype)
    norm_w, up_w = weights(seed, hidden, dtype)
    s_before = s.clone()
    before = moe_tail.tier_counts()
    y, tier = moe_tail.run_latent_moe_tail(x, s, norm_w, EPS, up_w, group, **kw)
    after = moe_tail.tier_counts()
    counted = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}
    ref = reference.latent_moe_tail(x, s_before, norm_w, EPS, up_w, group)
    return dict(y=y, tier=tier.value, ref=ref, counted=counted,
                shared_changed=not torch.equal(s, s_before), seed=seed, lead=lead,
                hidden=hidden, dtype=dtype, ranks=ranks)


def _check_tail(ctx, payloads, *, tier=None, exact_ref=None, same_ranks=None):
    """All ranks ran the same tier (counted once), agree, and match the exact value."""
    p0 = payloads[0]
    tiers = {p["tier"] for p in payloads}
    assert len(tiers) == 1, f"ranks chose different tiers: {[p['tier'] for p in payloads]}"
    if tier is not None:
        assert p0["tier"] == Tier(tier).value, f"tier {p0['tier']}, expected {Tier(tier).value}"
    for p in payloads:
        assert p["counted"] == {p0["tier"]: 1}, f"tier counter moved by {p['counted']}"
        assert not p["shared_changed"], "the caller's shared partial was modified"
    groups = same_ranks or [ctx.ranks]
    for ranks in groups:
        want, bound = exact_and_bound(p0["seed"], ranks, p0["lead"], p0["hidden"], p0["dtype"])
        for r in ranks:
            y = payloads[r]["y"]
            assert y.dtype == p0["dtype"]
            assert torch.equal(y, payloads[ranks[0]]["y"]), f"rank {r} differs from rank {ranks[0]}"
            assert_within(y, want, bound, f"rank {r} tier {p0['tier']}")
            assert_within(payloads[r]["ref"], want, bound, f"rank {r} distributed reference")
            bitwise = (p0["tier"] in ("replicated", "allreduce_overlap")
                       if exact_ref is None else exact_ref)
            if bitwise:
                assert torch.equal(y, payloads[r]["ref"]), (
                    f"rank {r}: {p0['tier']} is not bit-identical to the reference")


def _check_each(ctx, payloads, **kw):
    """Payloads are dicts of sub-cases: check each."""
    for key in payloads[0]:
        sub = [p[key] for p in payloads]
        expect = kw.get("tiers", {}).get(key)
        try:
            _check_tail(ctx, sub, tier=expect)
        except AssertionError as e:
            raise AssertionError(f"[{key}] {e}") from None


# ---------------------------------------------------------------------------- cases

_TOKENS = (0, 1, 7, 33)

for _tier in ("replicated", "allreduce_overlap", "column_parallel"):
    for _dtype in (torch.float32, torch.bfloat16):
        def _run(ctx, tier=_tier, dtype=_dtype):
            cfg = FusionConfig(moe_tail_tier=tier)
            out = {t: _tail(ctx, 10 + t, (t,), 64, dtype, config=cfg) for t in _TOKENS}
            out["lead"] = _tail(ctx, 5, (3, 5), 64, dtype, config=cfg)  # leading dims [3, 5]
            return out

        def _check(ctx, payloads, tier=_tier):
            _check_each(ctx, payloads, tiers={k: tier for k in payloads[0]})

        case(f"forced-{_tier}-{str(_dtype).split('.')[-1]}")(_run).check(_check)


@case("forced-through-global-config")
def _run_global(ctx):
    try:
        out = {}
        for tier in ("replicated", "allreduce_overlap", "column_parallel"):
            k3fusion.set_config(moe_tail_tier=tier)
            out[tier] = _tail(ctx, 3, (9,), 64, torch.float32)
        return out
    finally:
        k3fusion.set_config(FusionConfig())


@_run_global.check
def _(ctx, payloads):
    _check_each(ctx, payloads, tiers={k: k for k in payloads[0]})


@case("forced-tail-fusion-unavailable")
def _run_tf(ctx):
    x, s = partials(0, ctx.rank, (4,), 64, torch.float32)
    norm_w, up_w = weights(0, 64, torch.float32)
    errors = []
    for kw in (dict(tier="tail_fusion"), dict(config=FusionConfig(moe_tail_tier="tail_fusion"))):
        try:
            moe_tail.latent_moe_tail(x, s, norm_w, EPS, up_w, ctx.group, **kw)
        except TierUnavailableError as e:
            errors.append(str(e))
    return errors


@_run_tf.check
def _(ctx, payloads):
    for p in payloads:
        assert len(p) == 2, f"forcing tail_fusion did not raise: {p}"
        assert all("tail_fusion" in m and f"tp={ctx.world}" in m and "cpu" in m for m in p), p
    assert "tier argument" in payloads[0][0] and "moe_tail_tier" in payloads[0][1]


@case("threshold-boundary")
def _run_thr(ctx):
    cfg = FusionConfig(shared_experts_stream_token_threshold=8)
    return {t: _tail(ctx, 20 + t, (t,), 64, torch.bfloat16, config=cfg) for t in (7, 8, 9)}


@_run_thr.check
def _(ctx, payloads):
    _check_each(ctx, payloads, tiers={7: "allreduce_overlap", 8: "allreduce_overlap",
                                      9: "column_parallel"})


@case("fused-tail-boundary")
def _run_ftb(ctx):
    # At fused_tail_max_tokens and one above: no fused tail on CPU, so the overlap tier
    # (not at T = 0: 0 < T <= threshold).
    cfg = FusionConfig(fused_tail_max_tokens=4, shared_experts_stream_token_threshold=5)
    return {t: _tail(ctx, 30 + t, (t,), 64, torch.float32, config=cfg) for t in (0, 3, 4, 5, 6)}


@_run_ftb.check
def _(ctx, payloads):
    _check_each(ctx, payloads, tiers={0: "column_parallel", 3: "allreduce_overlap",
                                      4: "allreduce_overlap", 5: "allreduce_overlap",
                                      6: "column_parallel"})


def _with_env(env: dict, fn):
    old = {k: os.environ.get(k) for k in ENV_VARS}
    try:
        for k in ENV_VARS:
            os.environ.pop(k, None)
        os.environ.update(env)
        k3fusion.set_config(None)  # re-read the environment
        return fn()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        k3fusion.set_config(None)


@case("env-switches")
def _run_env(ctx):
    out = {}
    raised = {"K3FUSION_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD": "8"}  # default 0: no overlap
    out["disable-1"] = _with_env({"K3FUSION_DISABLE_SHARED_EXPERTS_STREAM": "1", **raised},
                                 lambda: _tail(ctx, 40, (1,), 64, torch.bfloat16))
    out["disable-0"] = _with_env({"K3FUSION_DISABLE_SHARED_EXPERTS_STREAM": "0", **raised},
                                 lambda: _tail(ctx, 40, (1,), 64, torch.bfloat16))
    out["default-T1"] = _tail(ctx, 40, (1,), 64, torch.bfloat16)
    for t in (4, 5, 6):
        out[f"threshold-5-T{t}"] = _with_env(
            {"K3FUSION_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD": "5"},
            lambda t=t: _tail(ctx, 41 + t, (t,), 64, torch.bfloat16))
    out["tier-replicated"] = _with_env({"K3FUSION_MOE_TAIL_TIER": "replicated"},
                                       lambda: _tail(ctx, 50, (2,), 64, torch.float32))
    out["moe-tail-0"] = _with_env({"K3FUSION_MOE_TAIL": "0"},
                                  lambda: _tail(ctx, 51, (300,), 64, torch.float32))
    return out


@_run_env.check
def _(ctx, payloads):
    _check_each(ctx, payloads, tiers={
        "disable-1": "column_parallel", "disable-0": "allreduce_overlap",
        "default-T1": "column_parallel",
        "threshold-5-T4": "allreduce_overlap", "threshold-5-T5": "allreduce_overlap",
        "threshold-5-T6": "column_parallel", "tier-replicated": "replicated",
        "moe-tail-0": "replicated"})


@case("hidden-not-divisible")
def _run_nd(ctx):
    out = {}
    for hidden in (63, 66):  # 63: odd; 66 % 4 == 2 (66 % 2 == 0: column-parallel at tp 2)
        out[f"H{hidden}-big"] = _tail(ctx, 60, (300,), hidden, torch.bfloat16)
        out[f"H{hidden}-small"] = _tail(ctx, 61, (5,), hidden, torch.bfloat16,
                                        config=FusionConfig(shared_experts_stream_token_threshold=8))
        out[f"H{hidden}-T0"] = _tail(ctx, 62, (0,), hidden, torch.bfloat16,
                                     config=FusionConfig(disable_shared_experts_stream=True))
        x, s = partials(63, ctx.rank, (5,), hidden, torch.float32)
        norm_w, up_w = weights(63, hidden, torch.float32)
        try:
            moe_tail.latent_moe_tail(x, s, norm_w, EPS, up_w, ctx.group, tier="column_parallel")
            out[f"H{hidden}-forced"] = None
        except TierUnavailableError as e:
            out[f"H{hidden}-forced"] = str(e)
    return out


@_run_nd.check
def _(ctx, payloads):
    tp = ctx.world
    for hidden in (63, 66):
        cp_ok = hidden % tp == 0
        for key, tier in ((f"H{hidden}-big", "column_parallel" if cp_ok else "replicated"),
                          (f"H{hidden}-small", "allreduce_overlap"),
                          (f"H{hidden}-T0", "column_parallel" if cp_ok else "replicated")):
            try:
                _check_tail(ctx, [p[key] for p in payloads], tier=tier)
            except AssertionError as e:
                raise AssertionError(f"[{key}] {e}") from None
        msgs = [p[f"H{hidden}-forced"] for p in payloads]
        if cp_ok:
            assert msgs == [None] * tp, msgs
        else:
            assert all(m and f"H={hidden}" in m and f"tp={tp}" in m and "divisible" in m
                       for m in msgs), msgs


@case("auto-T0")
def _run_t0(ctx):
    return {dt: _tail(ctx, 70, (0,), 64, dt) for dt in (torch.float32, torch.bfloat16)}


@_run_t0.check
def _(ctx, payloads):
    # T = 0 is never an overlap call (0 < T <= threshold), whatever the threshold.
    big = "column_parallel" if 64 % ctx.world == 0 else "replicated"
    _check_each(ctx, payloads, tiers={k: big for k in payloads[0]})


@case("donate-shared")
def _run_donate(ctx):
    x, s = partials(80, ctx.rank, (6,), 64, torch.float32)
    norm_w, up_w = weights(80, 64, torch.float32)
    kept = s.clone()
    y_keep = moe_tail.latent_moe_tail(x, s, norm_w, EPS, up_w, ctx.group, tier="column_parallel")
    unchanged = torch.equal(s, kept)
    y_donate = moe_tail.latent_moe_tail(x, s, norm_w, EPS, up_w, ctx.group,
                                        tier="column_parallel", donate_shared=True)
    shard = 64 // ctx.world
    cols = slice(ctx.rank * shard, (ctx.rank + 1) * shard)
    # What a donated shared holds afterwards is not part of the contract (the tier sums
    # into it and all-reduces it in place); that it was accumulated into is.
    return dict(unchanged=unchanged, same=torch.equal(y_keep, y_donate),
                own_cols_written=not torch.equal(s[:, cols], kept[:, cols]))


@_run_donate.check
def _(ctx, payloads):
    for r, p in enumerate(payloads):
        assert p == dict(unchanged=True, same=True, own_cols_written=True), f"rank {r}: {p}"


@case("donate-routed")
def _run_donate_routed(ctx):
    # donate_routed: the unfused tiers all-reduce the routed partial in place (no copy for
    # the functional collective); the result is the same, and without the flag the
    # caller's partial is untouched.
    out = {}
    for tier in ("column_parallel", "replicated", "allreduce_overlap"):
        x, s = partials(81, ctx.rank, (5,), 64, torch.float32)
        norm_w, up_w = weights(81, 64, torch.float32)
        kept, summed = x.clone(), reference.all_reduce(x.clone(), ctx.group)
        y_keep = moe_tail.latent_moe_tail(x, s, norm_w, EPS, up_w, ctx.group, tier=tier)
        unchanged = torch.equal(x, kept)
        y_donate = moe_tail.latent_moe_tail(x, s, norm_w, EPS, up_w, ctx.group, tier=tier,
                                            donate_routed=True)
        # Donated row views of wider buffers: a collective takes contiguous buffers only,
        # so the tiers copy them as if not donated.
        xv = torch.zeros(5, kept.shape[1] + 8)[:, :kept.shape[1]].copy_(kept)
        sv = torch.zeros(5, 72)[:, :64].copy_(s)
        y_views = moe_tail.latent_moe_tail(xv, sv, norm_w, EPS, up_w, ctx.group, tier=tier,
                                           donate_routed=True, donate_shared=True)
        out[tier] = dict(unchanged=unchanged, same=torch.equal(y_keep, y_donate),
                         reduced_in_place=torch.equal(x, summed),
                         views=torch.equal(y_views, y_keep))
    # the in-place op (what compiled graphs run) on such views
    x, s = partials(81, ctx.rank, (5,), 64, torch.float32)
    want = moe_tail.latent_moe_tail(x, s, norm_w, EPS, up_w, ctx.group)
    sv = torch.zeros(5, 72)[:, :64].copy_(s)
    torch.ops.k3fusion.latent_moe_tail_(torch.zeros(5, x.shape[1] + 8)[:, :x.shape[1]].copy_(x),
                                        sv, norm_w, EPS, up_w, ctx.group.group_name)
    out["inplace-op"] = dict(unchanged=True, same=torch.equal(sv, want), reduced_in_place=True,
                             views=True)
    return out


@_run_donate_routed.check
def _(ctx, payloads):
    for r, p in enumerate(payloads):
        for tier, got in p.items():
            assert got == dict(unchanged=True, same=True, reduced_in_place=True,
                               views=True), \
                f"rank {r} {tier}: {got}"


@case("column-parallel-fused-shard")
def _run_fused_shard(ctx):
    # Up to COLUMN_FUSED_MAX_TOKENS 16-bit tokens the tier runs its shard through the fused
    # kernel (on a GPU; here the interpreter, asked for) at this rank's column offset, into
    # a new buffer; above, the norm and addmm_.
    # Both within the exact tail's bound; hidden 96: shards of 48 / 24 columns.
    top = moe_tail.tiers.COLUMN_FUSED_MAX_TOKENS
    out = {}
    for dtype in (torch.bfloat16, torch.float16):
        for t in sorted({1, 5, top, top + 1}):
            with spy_on_launcher("latent_moe_tail_fused", "column_offset") as calls, \
                    pytest.MonkeyPatch.context() as mp:
                mp.setattr(moe_tail.tiers, "SHARD_KERNEL_ON_CPU", True)
                p = _tail(ctx, 90 + t, (t,), 96, dtype, tier="column_parallel")
            p["fused_calls"] = len(calls)
            p["offsets"] = calls
            p["interpreted"] = moe_tail.tiers.kernels.moe_tail.kernels_are_interpreted()
            out[(str(dtype), t)] = p
    return out


@_run_fused_shard.check
def _(ctx, payloads):
    top = moe_tail.tiers.COLUMN_FUSED_MAX_TOKENS
    for key in payloads[0]:
        t = key[1]
        for r, p in enumerate(payloads):
            # (a CUDA machine runs no interpreter: the CPU ranks keep the unfused shard there)
            want = 1 if t <= top and p[key]["interpreted"] else 0
            assert p[key]["fused_calls"] == want, (
                f"rank {r} {key}: {p[key]['fused_calls']} fused launches, expected {want}")
            want = [r * 96 // len(payloads)] * p[key]["fused_calls"]
            assert p[key]["offsets"] == want, f"rank {r} {key}: column offsets {p[key]['offsets']}"
    _check_each(ctx, [{k: v for k, v in p.items()} for p in payloads],
                tiers={k: "column_parallel" for k in payloads[0]})


@case("subgroups")
def _run_sub(ctx):
    # Two TP groups of world/2 ranks: column shards must follow the rank *in the group*.
    import torch.distributed as dist

    half = ctx.world // 2
    groups = [dist.new_group(list(range(0, half))), dist.new_group(list(range(half, ctx.world)))]
    mine = groups[ctx.rank // half]
    ranks = list(range(0, half)) if ctx.rank < half else list(range(half, ctx.world))
    return {tier: _tail(ctx, 90, (11,), 64, torch.float32, group=mine, ranks=ranks, tier=tier)
            for tier in ("replicated", "allreduce_overlap", "column_parallel")}


@_run_sub.check
def _(ctx, payloads):
    half = ctx.world // 2
    for tier in payloads[0]:
        _check_tail(ctx, [p[tier] for p in payloads], tier=tier,
                    same_ranks=[list(range(0, half)), list(range(half, ctx.world))])


def _run_cases(rank: int, world: int, group):
    """Every case for this world size on this rank; rank 0 returns (results, timings)."""
    import torch.distributed as dist

    ctx = Ctx(rank, world, group)
    results, timings = {}, {}
    for name, (run, check, worlds) in CASES.items():
        if world not in worlds:
            continue
        t0 = time.perf_counter()
        try:
            payload = ("ok", run(ctx))
        except Exception:  # noqa: BLE001 - reported by rank 0 below
            payload = ("error", traceback.format_exc())
        gathered = [None] * world
        dist.all_gather_object(gathered, payload)  # keeps every rank in step
        if rank == 0:
            errors = [f"rank {r}:\n{p[1]}" for r, p in enumerate(gathered) if p[0] == "error"]
            if errors:
                results[name] = "\n".join(errors)
            else:
                try:
                    check(ctx, [p[1] for p in gathered])
                    results[name] = "ok"
                except Exception:  # noqa: BLE001
                    results[name] = traceback.format_exc()
        timings[name] = time.perf_counter() - t0
    return results, timings


def run_world(world: int, timeout_s: float = 150.0):
    """Spawn ``world`` ranks running every case; rank 0's ``({case: 'ok' | failure}, timings)``."""
    return run_ranks(_run_cases, world, timeout_s=timeout_s)[0]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"tp{w}")
def world_results(request):
    results, _timings = run_world(request.param)
    return request.param, results


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_distributed_case(world_results, name):
    world, results = world_results
    if world not in CASES[name][2]:
        pytest.skip(f"case not run at world size {world}")
    assert results.get(name) == "ok", f"tp={world} case {name}:\n{results.get(name)}"


# ============================================================================ in-process: rules


def _cfg(**kw) -> FusionConfig:
    return FusionConfig(**kw)


T256 = {"shared_experts_stream_token_threshold": 256}


@pytest.mark.parametrize(
    "tokens,hidden,tp,cfg,want",
    [
        # Defaults: threshold 0 (column-parallel was measured faster at every T).
        (0, 64, 2, {}, Tier.COLUMN_PARALLEL),        # T = 0: no fused tail, no overlap (0 < T)
        (0, 64, 1, {}, Tier.REPLICATED),             # T = 0, tp 1
        (1, 64, 2, {}, Tier.COLUMN_PARALLEL),        # no fused tail on CPU; 1 > 0
        (1, 63, 2, {}, Tier.REPLICATED),             # H % tp != 0: fall back, correct
        (0, 64, 2, T256, Tier.COLUMN_PARALLEL),      # T = 0 at a raised threshold: 0 < T
        (0, 63, 2, T256, Tier.REPLICATED),           # T = 0, H % tp != 0
        (1, 64, 2, T256, Tier.ALLREDUCE_OVERLAP),    # no fused tail on CPU
        (255, 64, 8, T256, Tier.ALLREDUCE_OVERLAP),  # threshold - 1
        (256, 64, 8, T256, Tier.ALLREDUCE_OVERLAP),  # threshold (inclusive)
        (257, 64, 8, T256, Tier.COLUMN_PARALLEL),    # threshold + 1
        (257, 63, 8, T256, Tier.REPLICATED),         # H % tp != 0: fall back, correct
        (257, 64, 1, T256, Tier.REPLICATED),         # tp 1: nothing to split
        (1, 64, 1, {}, Tier.REPLICATED),             # tp 1, default threshold
        (1, 64, 2, {"disable_shared_experts_stream": True}, Tier.COLUMN_PARALLEL),
        (1, 63, 2, {"disable_shared_experts_stream": True}, Tier.REPLICATED),
        (9, 64, 2, {"shared_experts_stream_token_threshold": 8}, Tier.COLUMN_PARALLEL),
        (0, 64, 2, {"shared_experts_stream_token_threshold": 0}, Tier.COLUMN_PARALLEL),
        (0, 64, 2, {"shared_experts_stream_token_threshold": 1}, Tier.COLUMN_PARALLEL),
        (1, 64, 2, {"shared_experts_stream_token_threshold": 1}, Tier.ALLREDUCE_OVERLAP),
        (2, 64, 2, {"shared_experts_stream_token_threshold": 1}, Tier.COLUMN_PARALLEL),
        (1, 64, 2, {"shared_experts_stream_token_threshold": 0}, Tier.COLUMN_PARALLEL),
        (10**6, 64, 2, {"moe_tail": False}, Tier.REPLICATED),
        (3, 64, 2, {"moe_tail_tier": "column_parallel"}, Tier.COLUMN_PARALLEL),
        (10**6, 63, 2, {"moe_tail_tier": "allreduce_overlap"}, Tier.ALLREDUCE_OVERLAP),
    ],
)
def test_select_tier_rules(tokens, hidden, tp, cfg, want):
    assert moe_tail.select_tier(tokens, hidden, tp, "cpu", _cfg(**cfg)) is want


def test_select_tier_is_a_function_of_static_facts_and_tokens():
    """What every rank computes independently: same facts, same tier, over a sweep."""
    cfg = _cfg(shared_experts_stream_token_threshold=32)
    for tp in (1, 2, 4, 8):
        for tokens in range(0, 80):
            tiers = {moe_tail.select_tier(tokens, 96, tp, torch.device("cpu"), cfg) for _ in range(3)}
            assert len(tiers) == 1
            big = Tier.COLUMN_PARALLEL if tp > 1 else Tier.REPLICATED
            assert tiers.pop() is (Tier.ALLREDUCE_OVERLAP if 0 < tokens <= 32 else big)


def test_forced_unavailable_tiers_raise_clearly():
    with pytest.raises(TierUnavailableError, match=r"column_parallel.*H=63.*tp=2.*not divisible"):
        moe_tail.select_tier(5, 63, 2, "cpu", force="column_parallel")
    with pytest.raises(TierUnavailableError, match=r"moe_tail_tier.*H=63"):
        moe_tail.select_tier(5, 63, 2, "cpu", _cfg(moe_tail_tier="column_parallel"))
    with pytest.raises(TierUnavailableError, match=r"tail_fusion.*none is registered"):
        moe_tail.select_tier(5, 64, 1, "cpu", force=Tier.TAIL_FUSION)
    with pytest.raises(ValueError, match="unknown latent-MoE tail tier 'fast'"):
        moe_tail.select_tier(5, 64, 1, "cpu", force="fast")


def test_available_tiers_and_reasons():
    assert moe_tail.available_tiers(5, 64, 2, "cpu") == (
        Tier.ALLREDUCE_OVERLAP, Tier.COLUMN_PARALLEL, Tier.REPLICATED)
    assert moe_tail.available_tiers(5, 63, 2, "cpu") == (Tier.ALLREDUCE_OVERLAP, Tier.REPLICATED)
    why = moe_tail.tier_unavailable_reason("tail_fusion", 5, 64, 1, "cpu")
    assert "none is registered" in why and "'cpu'" in why
    for bad in (dict(tokens=-1), dict(hidden=0), dict(tp=0), dict(tokens=1.5)):
        args = dict(tokens=1, hidden=64, tp=2) | bad
        with pytest.raises((ValueError, TypeError), match=next(iter(bad))):
            moe_tail.available_tiers(args["tokens"], args["hidden"], args["tp"], "cpu")


def test_registered_tail_fusion_is_selected_at_small_t():
    """The registry the GPU kernel plugs into: T in (0, max] selects it where it supports."""
    calls = []

    def run(routed, shared, norm_w, eps, up_w, group, weight_in_fp32):
        calls.append(routed.shape[0])
        return reference.latent_moe_tail(routed, shared, norm_w, eps, up_w, group, weight_in_fp32)

    impl = moe_tail.TailFusionImpl(
        "test-cpu-tp1", lambda t, h, tp, dev: None if tp == 1 and dev.type == "cpu" else "tp 1 only",
        run)
    moe_tail.register_tail_fusion(impl)
    try:
        with pytest.raises(ValueError, match="registered already"):
            moe_tail.register_tail_fusion(impl)
        cfg = _cfg(fused_tail_max_tokens=4)
        got = [moe_tail.select_tier(t, 64, 1, "cpu", cfg) for t in (0, 1, 4, 5)]
        assert got == [Tier.REPLICATED, Tier.TAIL_FUSION, Tier.TAIL_FUSION,
                       Tier.REPLICATED]
        assert moe_tail.select_tier(1, 64, 2, "cpu", cfg) is Tier.COLUMN_PARALLEL
        with pytest.raises(TierUnavailableError, match="tp 1 only"):
            moe_tail.select_tier(1, 64, 2, "cpu", force="tail_fusion")
        assert moe_tail.select_tier(1, 64, 1, "cpu", _cfg(fused_tail_max_tokens=0)) is not Tier.TAIL_FUSION
        x, s = partials(1, 0, (3,), 64, torch.float32)
        w, up = weights(1, 64, torch.float32)
        y, tier = moe_tail.run_latent_moe_tail(x, s, w, EPS, up, config=cfg)
        assert tier is Tier.TAIL_FUSION and calls == [3]
        assert torch.equal(y, reference.latent_moe_tail(x, s, w, EPS, up))
    finally:
        moe_tail.unregister_tail_fusion("test-cpu-tp1")
    assert "test-cpu-tp1" not in {i.name for i in moe_tail.tail_fusion_impls()}


def test_a_donated_shared_goes_to_implementations_that_take_out():
    """``takes_out=True``: with ``donate_shared=True`` the implementation gets ``out=shared``
    (and the result is that tensor); without the flag, or for an implementation without
    ``takes_out``, no ``out`` at all."""
    seen = []

    def run(r, s, w, eps, up, group, wf, out=None):
        seen.append(out)
        y = reference.latent_moe_tail(r, s, w, eps, up)
        return y if out is None else out.copy_(y)

    def run_plain(r, s, w, eps, up, group, wf, **kw):
        seen.append(kw.get("out"))
        return reference.latent_moe_tail(r, s, w, eps, up)

    x, s = partials(2, 0, (3,), 64, torch.float32)
    w, up = weights(2, 64, torch.float32)
    want = reference.latent_moe_tail(x, s, w, EPS, up)
    for name, fn, takes in (("test-out", run, True), ("test-no-out", run_plain, False)):
        moe_tail.register_tail_fusion(moe_tail.TailFusionImpl(
            name, lambda t, h, tp, dev: None, fn, ("cpu",), takes_out=takes))
        try:
            for donate in (False, True):
                seen.clear()
                mine = s.clone()
                y = moe_tail.latent_moe_tail(x, mine, w, EPS, up, tier="tail_fusion",
                                             donate_shared=donate)
                assert torch.equal(y, want)
                wrote = donate and takes
                assert len(seen) == 1, (name, donate)
                assert (seen[0] is not None and seen[0].data_ptr() == mine.data_ptr()) == wrote
                assert wrote or seen[0] is None
                assert (y.data_ptr() == mine.data_ptr()) == wrote
                assert wrote or torch.equal(mine, s)
        finally:
            moe_tail.unregister_tail_fusion(name)


def test_implementation_selection_limit():
    """``select_max_tokens``: automatic selection stops there (the implementation's own
    measured crossover), below the config's cap; forcing the tier still runs it above."""
    run = lambda r, s, w, eps, up, group, wf: reference.latent_moe_tail(r, s, w, eps, up)  # noqa: E731
    impl = moe_tail.TailFusionImpl("test-limit", lambda t, h, tp, dev: None, run, ("cpu",),
                                   select_max_tokens=2)
    with pytest.raises(TypeError, match="select_max_tokens"):
        moe_tail.register_tail_fusion(moe_tail.TailFusionImpl("bad", impl.supports, run,
                                                              select_max_tokens=-1))
    moe_tail.register_tail_fusion(impl)
    try:
        cfg = _cfg(fused_tail_max_tokens=8)
        got = [moe_tail.select_tier(t, 64, 1, "cpu", cfg) for t in (1, 2, 3)]
        assert got == [Tier.TAIL_FUSION, Tier.TAIL_FUSION, Tier.REPLICATED]
        assert moe_tail.select_tier(2, 64, 1, "cpu", _cfg(fused_tail_max_tokens=1)) \
            is Tier.REPLICATED  # the config's cap is below the implementation's
        assert moe_tail.select_tier(3, 64, 1, "cpu", force="tail_fusion") is Tier.TAIL_FUSION
        assert moe_tail.tier_unavailable_reason("tail_fusion", 3, 64, 1, "cpu") is None
        # A second implementation without a limit: above the first one's limit it is the
        # one selected, and the one that runs; at or below it, the first (registry order).
        ran = []

        def run_b(r, s, w, eps, up, group, wf):
            ran.append(r.shape[0])
            return reference.latent_moe_tail(r, s, w, eps, up)
        moe_tail.register_tail_fusion(moe_tail.TailFusionImpl(
            "test-limit-b", lambda t, h, tp, dev: None, run_b, ("cpu",)))
        x, s = partials(2, 0, (3,), 64, torch.float32)
        w, up = weights(2, 64, torch.float32)
        y, tier = moe_tail.run_latent_moe_tail(x, s, w, EPS, up, config=cfg)
        assert tier is Tier.TAIL_FUSION and ran == [3]
        moe_tail.run_latent_moe_tail(x[:2], s[:2], w, EPS, up, config=cfg)
        assert ran == [3]  # T = 2: the first implementation ran
    finally:
        moe_tail.unregister_tail_fusion("test-limit")
        if any(i.name == "test-limit-b" for i in moe_tail.tail_fusion_impls()):
            moe_tail.unregister_tail_fusion("test-limit-b")


# ---------------------------------------------------------------------------- config / env


def test_config_fields_defaults_and_env(monkeypatch):
    c = FusionConfig()
    assert (c.moe_tail, c.fused_tail_max_tokens, c.shared_experts_stream_token_threshold,
            c.disable_shared_experts_stream, c.moe_tail_tier) == (True, 64, 0, False, "auto")
    env = {"K3FUSION_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD": "12",
           "K3FUSION_DISABLE_SHARED_EXPERTS_STREAM": "1", "K3FUSION_MOE_TAIL": "off",
           "K3FUSION_FUSED_TAIL_MAX_TOKENS": "0"}
    c = load_config(env)
    assert (c.shared_experts_stream_token_threshold, c.disable_shared_experts_stream,
            c.moe_tail, c.fused_tail_max_tokens) == (12, True, False, 0)
    assert load_config({"K3FUSION_MOE_TAIL_TIER": "Column_Parallel"}).moe_tail_tier == "column_parallel"
    # the process environment, through get_config
    for k in ENV_VARS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("K3FUSION_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD", "3")
    try:
        k3fusion.set_config(None)
        assert moe_tail.select_tier(3, 64, 2, "cpu") is Tier.ALLREDUCE_OVERLAP
        assert moe_tail.select_tier(4, 64, 2, "cpu") is Tier.COLUMN_PARALLEL
        monkeypatch.setenv("K3FUSION_DISABLE_SHARED_EXPERTS_STREAM", "1")
        k3fusion.set_config(None)
        assert moe_tail.select_tier(3, 64, 2, "cpu") is Tier.COLUMN_PARALLEL
    finally:
        monkeypatch.undo()
        k3fusion.set_config(None)


@pytest.mark.parametrize(
    "env,match",
    [
        ({"K3FUSION_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD": "-1"},
         "K3FUSION_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD='-1': expected an integer >= 0"),
        ({"K3FUSION_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD": "lots"}, "K3FUSION_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD"),
        ({"K3FUSION_DISABLE_SHARED_EXPERTS_STREAM": "maybe"}, "K3FUSION_DISABLE_SHARED_EXPERTS_STREAM"),
        ({"K3FUSION_FUSED_TAIL_MAX_TOKENS": "1e3"}, "K3FUSION_FUSED_TAIL_MAX_TOKENS"),
        ({"K3FUSION_MOE_TAIL_TIER": "fast"}, "K3FUSION_MOE_TAIL_TIER='fast': expected one of auto"),
        ({"K3FUSION_MOE_TAIL": "0", "K3FUSION_MOE_TAIL_TIER": "replicated"},
         "K3FUSION_MOE_TAIL='0' turns the tiered tail off"),
    ],
)
def test_bad_env_values_are_errors(env, match):
    with pytest.raises(ValueError, match=match):
        load_config(env)


def test_config_type_checks():
    with pytest.raises(TypeError, match="moe_tail_tier must be a str"):
        FusionConfig(moe_tail_tier=3)
    with pytest.raises(TypeError, match="shared_experts_stream_token_threshold must be an int"):
        FusionConfig(shared_experts_stream_token_threshold=True)
    with pytest.raises(TypeError, match="disable_shared_experts_stream must be a bool"):
        FusionConfig(disable_shared_experts_stream=1)
    assert "moe_tail_tier='replicated'" in FusionConfig(moe_tail_tier="replicated").cache_key()


# ---------------------------------------------------------------------------- tp = 1 numerics


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lead", [(0,), (1,), (17,), (2, 3)])
@pytest.mark.parametrize("tier", ["replicated", "allreduce_overlap", "column_parallel"])
def test_tp1_tiers_match_reference(tier, lead, dtype):
    x, s = partials(2, 0, lead, 48, dtype)
    w, up = weights(2, 48, dtype)
    s0 = s.clone()
    y, ran = moe_tail.run_latent_moe_tail(x, s, w, EPS, up, tier=tier)
    assert ran is Tier(tier) and torch.equal(s, s0)
    want, bound = exact_and_bound(2, [0], lead, 48, dtype)
    assert_within(y, want, bound, tier)
    if tier != "column_parallel":
        assert torch.equal(y, reference.latent_moe_tail(x, s0, w, EPS, up))


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="CPU tensors through the interpreter's norm kernel (a CUDA machine "
                           "runs the compiled kernels: test_moe_tail_kernel's cuda tests)")
@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("lead", [(0,), (1,), (17,)])
@pytest.mark.parametrize("norm_form", ["bf16", "weight_in_fp32", "fp32_latent_norm_dtype"])
def test_tp1_norm_then_beta_add(norm_form, lead, donate):
    """The tp = 1 CUDA form of the replicated/overlap tiers (the norm's launch copies
    ``shared``, cuBLAS-style ``addmm_`` adds into the copy or into a donated ``shared``), run
    here with the norm kernel in the interpreter: within the exact tail's bound; the
    caller's ``shared`` is kept unless donated, and a donated one holds the result."""
    x, s = partials(3, 0, lead, 48, torch.bfloat16)
    w, up = weights(3, 48, torch.bfloat16)
    weight_in_fp32, norm_dtype = norm_form == "weight_in_fp32", None
    if norm_form == "fp32_latent_norm_dtype":
        x, norm_dtype = x.float(), torch.bfloat16
    x0, s0 = x.clone(), s.clone()
    with cpu_path("kernel"):
        # a private helper of the tiers, reached in its own module
        y = moe_tail.tiers._norm_then_beta_add(x.reshape(-1, LATENT), s.reshape(-1, 48), w,
                                               EPS, up, weight_in_fp32, norm_dtype, donate)
    assert torch.equal(x, x0)
    assert torch.equal(s.reshape(-1, 48), y) if donate else torch.equal(s, s0)
    want, bound = latent_tail_exact_and_bound(x0.double()[None], s0.double()[None], w, up, EPS,
                                              UNIT_ROUNDOFF[torch.bfloat16])
    assert_within(y.reshape(want.shape), want, bound, f"{norm_form} donate={donate}")


def test_weight_in_fp32_form():
    x, s = partials(4, 0, (5,), 32, torch.bfloat16)
    w, up = weights(4, 32, torch.bfloat16)
    for tier in ("replicated", "allreduce_overlap", "column_parallel"):
        y = moe_tail.latent_moe_tail(x, s, w, EPS, up, tier=tier, weight_in_fp32=True)
        h = reference.rms_norm(x, w, EPS, True)
        want = (s.double() + h.double() @ up.double().T)
        assert (y.double() - want).abs().max() <= 3 * 2**-8 * want.abs().max()


def test_tier_counts_and_debug_log(caplog):
    moe_tail.reset_tier_counts()
    x, s = partials(5, 0, (3,), 32, torch.float32)
    w, up = weights(5, 32, torch.float32)
    with caplog.at_level("INFO", logger="k3fusion"):
        moe_tail.latent_moe_tail(x, s, w, EPS, up, config=_cfg(
            debug=True, shared_experts_stream_token_threshold=8))
        moe_tail.latent_moe_tail(x, s, w, EPS, up, tier="column_parallel")
    assert moe_tail.tier_counts() == {"allreduce_overlap": 1, "column_parallel": 1}
    lines = [r.getMessage() for r in caplog.records if "moe_tail" in r.getMessage()]
    assert len(lines) == 1 and "T=3" in lines[0] and "allreduce_overlap" in lines[0]
    moe_tail.reset_tier_counts()
    assert moe_tail.tier_counts() == {}


@pytest.mark.parametrize(
    "change,exc,match",
    [
        (dict(up_w=torch.randn(48, 41)), ValueError, "up_w"),
        (dict(shared=torch.randn(5, 47)), ValueError, "shared"),
        (dict(shared=torch.randn(4, 48)), ValueError, "leading dims"),
        (dict(up_w=torch.randn(48, 40, dtype=torch.float64)), TypeError, "dtypes must agree"),
        (dict(shared=torch.randn(5, 48, dtype=torch.bfloat16)), TypeError, "dtypes must agree"),
        (dict(norm_w=torch.randn(39)), ValueError, "norm_w"),
        (dict(routed_latent=torch.randn(5, 80)[:, ::2]), ValueError, "routed_latent"),
        (dict(shared=torch.randn(5, 96)[:, ::2]), ValueError, "contiguous"),
        (dict(eps=-1.0), ValueError, "eps"),
    ],
)
def test_argument_errors(change, exc, match):
    args = dict(routed_latent=torch.randn(5, 40), shared=torch.randn(5, 48),
                norm_w=torch.rand(40) + 0.5, eps=EPS, up_w=torch.randn(48, 40))
    args.update(change)
    with pytest.raises(exc, match=match):
        moe_tail.latent_moe_tail(**args)


# ============================================================================ tp = 1 on the GPU

# (lead dims, latent dtype, norm_dtype, weight_in_fp32): the model's bf16 tail, the
# weight-in-fp32 norm, the graph pass's fp32 latent rounded to bf16, leading dims.
_GPU_FORMS = {"bf16": ((), torch.bfloat16, None, False),
              "weight_in_fp32": ((), torch.bfloat16, None, True),
              "fp32_latent_norm_dtype": ((), torch.float32, torch.bfloat16, False),
              "lead_dims": ((3,), torch.bfloat16, None, False)}


@pytest.mark.cuda
@pytest.mark.parametrize("form", list(_GPU_FORMS))
@pytest.mark.parametrize("tokens", [17, 64, 4099])
@pytest.mark.parametrize("tier", ["replicated", "allreduce_overlap", "column_parallel"])
def test_unfused_tiers_on_cuda_norm_in_one_launch(tier, tokens, form):
    """Above the fused tail on a CUDA device, every unfused tier normalizes the latent with
    one launch of the Triton norm (not the reference's ~8 eager kernels), at K3 widths
    (L = 3584, H = 7168; bf16 weights and shared partial), and stays within the exact
    tail's bound; inputs are kept."""
    lead, x_dtype, norm_dtype, weight_in_fp32 = _GPU_FORMS[form]
    latent, hidden, dt = 3584, 7168, torch.bfloat16
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(*lead, tokens, latent, generator=g).to("cuda", x_dtype)
    s = torch.randn(*lead, tokens, hidden, generator=g).to("cuda", dt)
    w = (1 + 0.1 * torch.randn(latent, generator=g)).to("cuda", dt)
    up = (torch.randn(hidden, latent, generator=g) / latent**0.5).to("cuda", dt)
    x0, s0 = x.clone(), s.clone()
    with spy_on_launcher("rms_norm", "norm_dtype") as launches:
        y, ran = moe_tail.run_latent_moe_tail(x, s, w, EPS, up, tier=tier,
                                              weight_in_fp32=weight_in_fp32,
                                              norm_dtype=norm_dtype)
    assert ran is Tier(tier) and launches == [norm_dtype]
    assert torch.equal(x, x0) and torch.equal(s, s0)
    exact, bound = latent_tail_exact_and_bound(x[None].cpu(), s[None].cpu(), w.cpu(), up.cpu(),
                                               EPS, UNIT_ROUNDOFF[dt])
    assert_within(y.cpu(), exact, bound, f"{tier} T={tokens} {form}")


@pytest.mark.cuda
@pytest.mark.parametrize("tokens", [17, 512])
@pytest.mark.parametrize("tier", ["replicated", "allreduce_overlap"])
def test_tp1_donated_shared_holds_the_result_on_cuda(tier, tokens):
    """tp = 1 on CUDA with ``donate_shared``: one norm launch (no copy), cuBLAS adds the GEMM
    into ``shared`` itself (the result is ``shared``'s storage), within the exact tail's
    bound, the latent kept."""
    latent, hidden, dt = 3584, 7168, torch.bfloat16
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, latent, generator=g).to("cuda", dt)
    s = torch.randn(tokens, hidden, generator=g).to("cuda", dt)
    w = (1 + 0.1 * torch.randn(latent, generator=g)).to("cuda", dt)
    up = (torch.randn(hidden, latent, generator=g) / latent**0.5).to("cuda", dt)
    x0, s0 = x.clone(), s.clone()
    with spy_on_launcher("rms_norm", "copy") as copies:
        y, ran = moe_tail.run_latent_moe_tail(x, s, w, EPS, up, tier=tier, donate_shared=True)
    assert ran is Tier(tier) and copies == [None] and torch.equal(x, x0)
    assert y.data_ptr() == s.data_ptr() and torch.equal(y, s)
    exact, bound = latent_tail_exact_and_bound(x0[None].cpu(), s0[None].cpu(), w.cpu(),
                                               up.cpu(), EPS, UNIT_ROUNDOFF[dt])
    assert_within(y.cpu(), exact, bound, f"{tier} T={tokens} donated")
