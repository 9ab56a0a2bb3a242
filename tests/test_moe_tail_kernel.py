"""The fused small-T latent-MoE tail kernel (``k3fusion.kernels.moe_tail``) and its
``TAIL_FUSION`` registration, against ``k3fusion.reference``.

On a CPU-only machine the kernel runs in Triton's interpreter (``tests/conftest.py`` sets
``TRITON_INTERPRET=1`` before k3fusion is imported); on a CUDA machine the same property
tests run on the GPU, and the tests marked ``cuda`` add Kimi-K3's real sizes, the tier
running through ``k3fusion.moe_tail`` / the custom op / a compiled graph, and CUDA-graph
replay of the split-K form.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, replace

import pytest
import torch
import triton
from hypothesis import example, given, settings
from hypothesis import strategies as st

import k3fusion
from _kernel_paths import spy_on_launcher
from _ptx import run_compile_script
from graph_utils import no_compile_caches
from _tolerances import assert_matches_reference, dual_norm_tolerance, tail_tolerance, ulp
from k3fusion import moe_tail, reference
from k3fusion.config import FusionConfig
from k3fusion.kernels import moe_tail as kernel_mod
from k3fusion.kernels.moe_tail import MAX_TOKENS, latent_moe_tail_fused as launch
from k3fusion.moe_tail import Tier, TierUnavailableError

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter truncates fp32 -> bf16 casts (see _tolerances.dual_norm_tolerance).
INTERPRETED = DEVICE == "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# ============================================================================ the bound


def assert_within(got, ref, bound, msg=""):
    assert got.shape == ref.shape, f"{msg}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert got.dtype == ref.dtype, f"{msg}: dtype {got.dtype} != {ref.dtype}"
    g = got.detach().to("cpu", torch.float64)
    r = ref.detach().to("cpu", torch.float64)
    assert torch.equal(g.isnan(), r.isnan()), f"{msg}: NaN positions differ"
    err = torch.where(r.isnan(), torch.zeros_like(g), (g - r).abs())
    bad = ~(err <= bound) & ~r.isnan()  # a NaN reference row has a NaN bound
    if bad.any():
        ratio = torch.where(bad, err / bound, torch.zeros_like(err))
        i = tuple(int(v) for v in torch.unravel_index(ratio.argmax(), ratio.shape))
        raise AssertionError(
            f"{msg}: {int(bad.sum())} of {bad.numel()} elements beyond the bound; worst at "
            f"{list(i)}: got {g[i].item()!r}, reference {r[i].item()!r}, |err| "
            f"{err[i].item():.3e} = {ratio[i].item():.2f} x bound {bound[i].item():.3e}")


# ============================================================================ cases


@dataclass(frozen=True)
class Case:
    tokens: int
    latent: int
    hidden: int
    x_dtype: torch.dtype
    w_fp32: bool
    weight_in_fp32: bool
    eps: float
    log2_scale: int   # routed ~ N(0, 1) * 2**log2_scale (small ones make eps matter)
    x_pad: int        # routed/shared/up_w are the first columns of wider rows
    s_pad: int
    up_pad: int
    zero_row: bool    # one all-zero routed row (eps = 0: NaN, as in the reference)

    @property
    def w_dtype(self):
        return torch.float32 if self.w_fp32 else self.x_dtype

    @property
    def out_dtype(self):
        # The GEMM input's dtype; up_w and shared must have it (no mixed-dtype GEMM/add).
        return reference.rms_norm_out_dtype(self.x_dtype, self.w_dtype, self.weight_in_fp32)


TOKENS = st.one_of(st.sampled_from([0, 1, 2, 3, 5, 7, 15, 16, 17, 32]), st.integers(0, 32))
LATENTS = st.one_of(st.sampled_from([1, 16, 17, 40, 100, 128, 129, 200]), st.integers(1, 200))
HIDDENS = st.one_of(st.sampled_from([1, 16, 17, 48, 70]), st.integers(1, 96))
PADS = st.sampled_from([0, 1, 8, 64])


@st.composite
def cases(draw, tokens=TOKENS) -> Case:
    return Case(
        tokens=draw(tokens), latent=draw(LATENTS), hidden=draw(HIDDENS),
        x_dtype=draw(st.sampled_from(DTYPES)), w_fp32=draw(st.booleans()),
        weight_in_fp32=draw(st.booleans()),
        eps=draw(st.sampled_from([0.0, 1e-6, 1e-5, 1e-3, 0.1])),
        log2_scale=draw(st.sampled_from([-6, 0, 6])),
        x_pad=draw(PADS), s_pad=draw(PADS), up_pad=draw(st.sampled_from([0, 3, 16])),
        zero_row=draw(st.booleans()),
    )


LAUNCH = st.fixed_dictionaries({
    "block_n": st.sampled_from([0, 16, 32]),
    "block_k": st.sampled_from([0, 16, 32, 64]),
    "split_k": st.sampled_from([0, 1, 2, 3, 5]),
    "num_warps": st.sampled_from([0, 2, 4]),
    "num_stages": st.sampled_from([0, 2]),
    "norm_block_k": st.sampled_from([0, 16, 64]),
    "swap_ab": st.sampled_from([None, False, True]),
    "gemv": st.sampled_from([None, False, True]),
    "normed_rows": st.sampled_from([None, False, True]),
})


def make_inputs(c: Case, seed: int, device: str = DEVICE):
    """``(routed, shared, norm_w, up_w)``: row views of wider parents (never copied)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(c.tokens, c.latent + c.x_pad, generator=g) * 2.0**c.log2_scale
    if c.zero_row and c.tokens:
        x[c.tokens // 2] = 0
    s = torch.randn(c.tokens, c.hidden + c.s_pad, generator=g)
    w = torch.rand(c.latent, generator=g) * 2 - 0.5
    up = torch.randn(c.hidden, c.latent + c.up_pad, generator=g) / math.sqrt(c.latent)
    x = x.to(device=device, dtype=c.x_dtype)[:, :c.latent]
    s = s.to(device=device, dtype=c.out_dtype)[:, :c.hidden]
    w = w.to(device=device, dtype=c.w_dtype)
    up = up.to(device=device, dtype=c.out_dtype)[:, :c.latent]
    return x, s, w, up


def _launches_rms_in_loop(x, up, opts: dict) -> bool:
    """Whether the launch with ``opts`` takes the ``rms_in_loop`` form (asked for, or the
    default's choice): its GEMM input is bounded as ``tail_tolerance(scaled_after)``."""
    if x.shape[0] == 0:
        return False
    options = inspect.signature(kernel_mod.resolve_config).parameters
    return kernel_mod.resolve_config(x.shape[0], up.shape[0], x.shape[1], up.dtype, x.device,
                                     **{k: v for k, v in opts.items() if k in options}
                                     ).rms_in_loop


def run_and_check(c: Case, seed: int, launch_opts: dict | None = None, device: str = DEVICE):
    x, s, w, up = make_inputs(c, seed, device)
    if (launch_opts or {}).get("swap_ab") and (launch_opts or {}).get("gemv"):
        with pytest.raises(ValueError, match="swap_ab=True.*gemv=True"):
            launch(x, s, w, c.eps, up, weight_in_fp32=c.weight_in_fp32, **launch_opts)
        return None
    saved = [t.clone() for t in (x, s, w, up)]
    y = launch(x, s, w, c.eps, up, weight_in_fp32=c.weight_in_fp32, **(launch_opts or {}))
    for name, a, b in zip(("routed_latent", "shared", "norm_w", "up_w"), saved, (x, s, w, up)):
        assert torch.equal(a, b), f"{name} was modified"
    assert y.is_contiguous() and y.device == x.device
    ref, bound = tail_tolerance(x, s, w, c.eps, up, c.weight_in_fp32,
                                truncating=device == "cpu",
                                scaled_after=_launches_rms_in_loop(x, up, launch_opts or {}))
    assert_within(y, ref, bound, f"{c} {launch_opts}")
    return y


# ============================================================================ properties


@given(c=cases(), opts=LAUNCH, seed=st.integers(0, 2**31 - 1))
@example(c=Case(16, 3584 // 28, 96, torch.bfloat16, False, False, 1e-6, 0, 8, 8, 0, False),
         opts={"split_k": 3, "block_n": 32, "block_k": 32}, seed=0)
@example(c=Case(1, 1, 1, torch.float32, False, False, 0.0, 0, 0, 0, 0, True),
         opts={}, seed=1)  # one zero element, eps 0: NaN like the reference
@example(c=Case(7, 129, 17, torch.float16, True, False, 1e-5, -6, 1, 1, 3, False),
         opts={"split_k": 5, "block_k": 16}, seed=2)  # fp16 input, fp32 weight: fp32 output
@example(c=Case(16, 3584 // 28, 96, torch.bfloat16, False, False, 1e-6, 0, 8, 8, 0, False),
         opts={"split_k": 7, "block_n": 32, "block_k": 16}, seed=3)
@example(c=Case(5, 100, 40, torch.bfloat16, True, False, 1e-5, -6, 0, 0, 0, True),
         opts={}, seed=4)
@example(c=Case(1, 3584 // 28, 96, torch.bfloat16, False, False, 1e-6, 0, 8, 8, 3, False),
         opts={}, seed=5)  # one bf16 token: the GEMV form by default
@example(c=Case(7, 129, 17, torch.bfloat16, False, True, 1e-5, 6, 1, 1, 3, True),
         opts={"gemv": True, "split_k": 3, "block_k": 16}, seed=6)  # GEMV, split-K, T = 7
@example(c=Case(17, 17, 16, torch.bfloat16, False, False, 0.0, -6, 0, 0, 0, True),
         opts={}, seed=0)  # a NaN row among 17 (the reference's CPU bf16 GEMM spread it)
def test_kernel_matches_reference(c, opts, seed):
    run_and_check(c, seed, opts)


@pytest.mark.parametrize("form", [{"normed_rows": True}, {"normed_rows": False}],
                         ids=["norm-launch", "one-launch"])
@given(c=cases(tokens=st.sampled_from([1, 3, 16, 32])), seed=st.integers(0, 2**31 - 1))
def test_normalized_tile_is_formed_as_the_reference_rounds_it(form, c, seed):
    """With ``up_w`` a 0/1 selection (row n picks column ``n % L``) and ``shared`` 0 the
    GEMM is exact, so the output *is* the kernel's normalized tile: it must pass the
    RMSNorm kernels' own test (``assert_matches_reference``, including the check that
    cast-then-weight rounds the normalized row to the input dtype before weighting), in
    the tile formed per program and in the norm launch's rows alike. (The bf16 default at
    2-16 rows, ``rms_in_loop``, feeds the dot ``rnd(x * w)`` and scales after it: its own
    bound, ``test_sum_of_squares_in_the_loop_matches_reference``.)"""
    latent = min(c.latent, 64)
    hidden = latent + c.hidden % 8
    # (a zero row with eps = 0 is NaN, which assert_matches_reference does not take)
    c = replace(c, latent=latent, hidden=hidden, zero_row=c.zero_row and c.eps > 0)
    x, _, w, _ = make_inputs(c, seed)
    up = torch.zeros(hidden, latent, dtype=c.out_dtype, device=x.device)
    up[torch.arange(hidden), torch.arange(hidden) % latent] = 1
    s = torch.zeros(c.tokens, hidden, dtype=c.out_dtype, device=x.device)
    y = launch(x, s, w, c.eps, up, weight_in_fp32=c.weight_in_fp32, **form)
    assert_matches_reference(y[:, :latent], x, w, c.eps, c.weight_in_fp32,
                             bf16_casts_truncate=INTERPRETED, msg=str(c))
    torch.testing.assert_close(y, y[:, torch.arange(hidden) % latent], rtol=0, atol=0,
                               equal_nan=True)


@pytest.mark.parametrize("tokens", [17, 33, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_more_than_16_tokens(tokens, dtype):
    """Up to MAX_TOKENS rows (BLOCK_M 32 and 64): 17-32 what selection runs by default,
    33-64 for a raised fused_tail_max_tokens."""
    run_and_check(Case(tokens, 72, 40, dtype, False, False, 1e-6, 0, 8, 0, 0, False), tokens)


ROW_TILED = st.fixed_dictionaries({
    "prenorm": st.sampled_from([None, False, True]),
    "normed_rows": st.sampled_from([None, False, True]),
    "block_m": st.sampled_from([0, 16, 32]),
    "m_first": st.booleans(),
    "split_k": st.sampled_from([0, 1, 3]),
    "block_n": st.sampled_from([0, 16, 32]),
    "block_k": st.sampled_from([16, 32]),
    "swap_ab": st.sampled_from([None, False, True]),
})


@settings(max_examples=12, deadline=None)
@given(c=cases(tokens=st.sampled_from([1, 5, 16, 17, 40, 70])), opts=ROW_TILED,
       seed=st.integers(0, 2**31 - 1))
@example(c=Case(70, 72, 40, torch.bfloat16, False, False, 1e-6, 0, 8, 0, 0, True),
         opts={"normed_rows": None, "prenorm": True, "block_m": 32, "m_first": False, "split_k": 3,
               "block_n": 16, "block_k": 16, "swap_ab": None}, seed=11)  # 3 row tiles, split-K
@example(c=Case(40, 100, 48, torch.bfloat16, False, False, 1e-5, -6, 0, 8, 3, False),
         opts={"normed_rows": None, "prenorm": False, "block_m": 16, "m_first": True, "split_k": 2,
               "block_n": 32, "block_k": 32, "swap_ab": True}, seed=12)  # row tiles fastest
@example(c=Case(70, 100, 48, torch.float16, True, False, 1e-5, -6, 8, 0, 3, True),
         opts={"normed_rows": True, "prenorm": None, "block_m": 32, "m_first": True,
               "split_k": 3, "block_n": 16, "block_k": 16, "swap_ab": None},
         seed=14)  # the norm launch's rows: row tiles, split-K, fp32 weight
@example(c=Case(5, 129, 17, torch.float16, True, False, 0.0, 6, 1, 1, 0, True),
         opts={"normed_rows": None, "prenorm": True, "block_m": 0, "m_first": False, "split_k": 5,
               "block_n": 16, "block_k": 16, "swap_ab": None}, seed=13)  # eps 0, zero row: NaN
def test_prenorm_and_row_tiles_match_reference(c, opts, seed):
    """The probe's candidate forms (issue 17): the rows normalized by a norm launch
    (``normed_rows``), 1/rms from a prologue launch (``prenorm``),
    T tiled into ``block_m`` row tiles (any T, a third grid dimension, split-K counters per
    (row tile, column tile)), ``m_first`` grid order -- the spec's normalized tile and the
    same bound as the default form."""
    if c.tokens > MAX_TOKENS and not opts["block_m"]:
        opts = {**opts, "block_m": 32}
    if opts["prenorm"] and opts["normed_rows"]:  # two prologue forms: one at a time
        opts = {**opts, "prenorm": None}
    run_and_check(c, seed, opts)


IN_LOOP = st.fixed_dictionaries({
    "block_m": st.sampled_from([0, 16, 32]),
    "block_n": st.sampled_from([0, 16, 32]),
    "block_k": st.sampled_from([16, 32, 64]),
    "swap_ab": st.sampled_from([None, False, True]),
    "gemv": st.sampled_from([None, False, True]),
})


@settings(max_examples=40, deadline=None)
@given(c=cases(tokens=st.sampled_from([0, 1, 2, 5, 16, 17, 33, 70])), opts=IN_LOOP,
       seed=st.integers(0, 2**31 - 1))
@example(c=Case(17, 129, 70, torch.bfloat16, False, False, 1e-6, -6, 8, 1, 3, True),
         opts={"block_m": 0, "block_n": 32, "block_k": 16, "swap_ab": True, "gemv": None},
         seed=0)  # the swapped dot, a zero row, masks on every side
@example(c=Case(5, 100, 48, torch.bfloat16, True, True, 0.0, 6, 0, 0, 0, True),
         opts={"block_m": 0, "block_n": 16, "block_k": 32, "swap_ab": None, "gemv": True},
         seed=1)  # GEMV, eps 0 and a zero row: NaN as in the reference
@example(c=Case(70, 72, 40, torch.float32, False, False, 1e-5, 0, 1, 0, 0, False),
         opts={"block_m": 32, "block_n": 16, "block_k": 16, "swap_ab": False, "gemv": None},
         seed=2)  # fp32, three row tiles
def test_sum_of_squares_in_the_loop_matches_reference(c, opts, seed):
    """``rms_in_loop``: one launch, each program summing the rows' squares while it
    streams its weights and scaling its outputs by 1/rms after the dot -- the reference
    within the bound of a GEMM input ``r * rnd(x * w)`` (``tail_tolerance(scaled_after)``).
    fp16 weights are refused (below)."""
    if c.out_dtype == torch.float16 or c.x_dtype == torch.float16:
        c = replace(c, x_dtype=torch.bfloat16)
    if c.tokens > MAX_TOKENS and not opts["block_m"]:
        opts = {**opts, "block_m": 32}
    if opts["gemv"] and opts["swap_ab"]:
        opts = {**opts, "swap_ab": None}
    run_and_check(c, seed, {**opts, "rms_in_loop": True, "split_k": 1})


def _scratch_spy(monkeypatch) -> list[torch.Tensor]:
    """The split-K counters each launch allocates (``_launch.launch_scratch``)."""
    made = []
    real = kernel_mod.launch_scratch

    def spy(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(kernel_mod, "launch_scratch", spy)
    return made


def test_norm_launch_zeroes_the_split_k_counters_it_hands_on(monkeypatch):
    """The norm-launch form with split-K takes its counters uninitialized and has the norm
    launch zero them (no memset launch): poisoned words still give the reference's tail,
    every launch leaves them at 0, and no zeroed scratch is allocated."""
    c = Case(5, 150, 70, torch.bfloat16, False, False, 1e-6, 0, 0, 0, 0, False)
    opts = {"split_k": 4, "block_n": 16, "block_k": 16, "normed_rows": True}
    made = []

    def poisoned(device, size):
        made.append(torch.full((max(size, 1),), 7, dtype=torch.int32, device=device))
        return made[-1]

    monkeypatch.setattr(kernel_mod, "_counter_words", poisoned)
    scratch = _scratch_spy(monkeypatch)
    ys = [run_and_check(c, 3, opts) for _ in range(2)]
    assert torch.equal(ys[0], ys[1]) and scratch == []
    assert len(made) == 2 and all(int(b.abs().sum()) == 0 for b in made)


def test_rms_norm_zero_argument_is_checked():
    from k3fusion.kernels.rms_norm import rms_norm

    x = torch.randn(3, 40, device=DEVICE)
    w, y = torch.ones(40, device=DEVICE), torch.empty(3, 40, device=DEVICE)
    for bad in (torch.zeros(4, device=DEVICE), torch.zeros(4, 2, dtype=torch.int32,
                                                            device=DEVICE),
                torch.zeros(8, dtype=torch.int32, device=DEVICE)[::2]):
        with pytest.raises(ValueError, match="zero must be a contiguous 1-D int32 tensor"):
            rms_norm(x, w, 1e-6, y, zero=bad)
    words = torch.full((3,), 5, dtype=torch.int32, device=DEVICE)
    rms_norm(x[:0], w, 1e-6, y[:0], zero=words)  # no rows: still zeroed
    assert words.tolist() == [0, 0, 0]


def test_prenorm_split_k_is_deterministic_and_leaves_counters_at_zero(monkeypatch):
    c = Case(40, 150, 70, torch.bfloat16, False, False, 1e-6, 0, 0, 0, 0, False)
    opts = {"split_k": 4, "block_n": 16, "block_k": 16, "prenorm": True, "block_m": 16}
    locks = _scratch_spy(monkeypatch)
    ys = [run_and_check(c, 3, opts) for _ in range(2)]
    assert torch.equal(ys[0], ys[1])
    # each launch its own counters (zeroed), which the last arrivals leave at zero
    assert len(locks) == 2 and locks[0] is not locks[1]
    assert all(int(b.abs().sum()) == 0 for b in locks)


def test_row_inv_rms_prologue_matches_reference_norm():
    """The prologue launch's 1/rms, fed through a 0/1 selection up_w, gives the
    reference's normalized tile (the same check as the default form's prologue)."""
    c = Case(9, 48, 48, torch.bfloat16, False, False, 1e-6, 0, 0, 0, 0, False)
    x, _, w, _ = make_inputs(c, 5)
    up = torch.eye(48, dtype=torch.bfloat16, device=x.device)
    s = torch.zeros(9, 48, dtype=torch.bfloat16, device=x.device)
    y = launch(x, s, w, c.eps, up, prenorm=True, split_k=3, block_k=16)
    assert_matches_reference(y, x, w, c.eps, False, bf16_casts_truncate=INTERPRETED,
                             msg="prenorm")


@pytest.mark.parametrize("opts, exc, match", [
    ({"block_m": 8}, ValueError, "block_m=8"),
    ({"block_m": 24}, ValueError, "power of two"),
    ({"block_m": True}, TypeError, "block_m must be an int"),
    ({"prenorm": 1}, TypeError, "prenorm must be a bool"),
    ({"normed_rows": 1}, TypeError, "normed_rows must be a bool"),
    ({"prenorm": True, "normed_rows": True}, ValueError, "two prologue forms"),
    ({"pdl": True}, ValueError, "needs prenorm=True or normed_rows=True"),
    ({"m_first": "yes"}, TypeError, "m_first must be a bool"),
    ({"rms_in_loop": 1}, TypeError, "rms_in_loop must be a bool"),
    ({"rms_in_loop": True, "normed_rows": True}, ValueError, "one-launch form"),
    ({"rms_in_loop": True, "prenorm": True}, ValueError, "one-launch form"),
    ({"rms_in_loop": True, "split_k": 2, "block_k": 16}, ValueError, "needs split_k=1"),
])
def test_row_tiled_option_errors(opts, exc, match):
    x, s, w, up = make_inputs(Case(4, 32, 16, torch.bfloat16, False, False, 1e-6, 0, 0, 0, 0,
                                   False), 0)
    with pytest.raises(exc, match=match):
        launch(x, s, w, 1e-6, up, **opts)


def test_sum_of_squares_in_the_loop_refuses_fp16():
    c = Case(4, 32, 16, torch.float16, False, False, 1e-6, 0, 0, 0, 0, False)
    x, s, w, up = make_inputs(c, 0)
    with pytest.raises(ValueError, match="rms_in_loop=True takes bf16 or fp32"):
        launch(x, s, w, 1e-6, up, rms_in_loop=True)


def test_more_than_max_tokens_needs_row_tiles():
    c = Case(MAX_TOKENS + 1, 32, 16, torch.bfloat16, False, False, 1e-6, 0, 0, 0, 0, False)
    x, s, w, up = make_inputs(c, 0)
    with pytest.raises(ValueError, match="more with block_m"):
        launch(x, s, w, 1e-6, up)
    run_and_check(c, 0, {"block_m": 64, "block_k": 16})


def test_no_tokens():
    x, s, w, up = make_inputs(Case(0, 40, 24, torch.bfloat16, False, False, 1e-6, 0, 0, 0, 0,
                                   False), 0)
    y = launch(x, s, w, 1e-6, up)
    assert y.shape == (0, 24) and y.dtype == torch.bfloat16


@pytest.mark.parametrize("gemv", [False, True])
def test_split_k_is_deterministic_and_leaves_counters_at_zero(gemv, monkeypatch):
    c = Case(5, 150, 70, torch.bfloat16, False, False, 1e-6, 0, 0, 0, 0, False)
    opts = {"split_k": 4, "block_n": 16, "block_k": 16, "gemv": gemv}
    locks = _scratch_spy(monkeypatch)
    ys = [run_and_check(c, 3, opts) for _ in range(2)]
    assert torch.equal(ys[0], ys[1])
    assert len(locks) == 2 and all(int(b.abs().sum()) == 0 for b in locks)


@pytest.mark.parametrize("opts", [{}, {"gemv": True, "split_k": 3, "block_n": 16},
                                  {"split_k": 2, "block_n": 16, "block_k": 16}])
def test_out_in_place_on_a_column_shard_of_shared(opts):
    """``out=shared`` with shared a column shard of a wider row (the column-parallel tier's
    call): the shard gets the tail, bit for bit the allocating call's; the other columns
    are untouched."""
    g = torch.Generator().manual_seed(4)
    tokens, latent, hidden, lo, width = 5, 40, 96, 32, 24
    x = torch.randn(tokens, latent, generator=g).to(torch.bfloat16).to(DEVICE)
    w = (1 + 0.3 * torch.randn(latent, generator=g)).to(torch.bfloat16).to(DEVICE)
    up = (torch.randn(width, latent, generator=g) / latent**0.5).to(torch.bfloat16).to(DEVICE)
    wide = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16).to(DEVICE)
    before = wide.clone()
    shard = wide[:, lo:lo + width]
    want = launch(x, shard, w, 1e-6, up, **opts)
    got = launch(x, shard, w, 1e-6, up, out=shard, **opts)
    assert got.data_ptr() == shard.data_ptr()
    assert torch.equal(wide[:, lo:lo + width], want)
    assert torch.equal(wide[:, :lo], before[:, :lo])
    assert torch.equal(wide[:, lo + width:], before[:, lo + width:])
    into = torch.empty(tokens, 2 * width, dtype=torch.bfloat16, device=DEVICE)[:, ::2]
    with pytest.raises(ValueError, match="contiguous"):
        launch(x, before[:, lo:lo + width], w, 1e-6, up, out=into)


# Launch options with GEMV tiles narrower than a dot takes (the column shard's default).
NARROW_GEMV = st.fixed_dictionaries({
    "gemv": st.just(True), "block_n": st.sampled_from([1, 4, 8]),
    "split_k": st.sampled_from([0, 1, 2]), "num_stages": st.sampled_from([0, 4, 5]),
})


@settings(max_examples=20, deadline=None)
@given(c=cases(), opts=st.one_of(LAUNCH, NARROW_GEMV), seed=st.integers(0, 2**31 - 1),
       extra=st.integers(0, 40), where=st.floats(0, 1), in_place=st.booleans(),
       row_pad=st.sampled_from([0, 8]))
@example(c=Case(3, 40, 24, torch.bfloat16, False, False, 1e-6, 0, 0, 0, 0, False), opts={},
         seed=0, extra=72, where=0.5, in_place=False, row_pad=8)  # rest split around it
@example(c=Case(1, 100, 16, torch.bfloat16, False, False, 1e-6, 0, 0, 0, 0, False),
         opts={"gemv": True, "block_n": 8}, seed=1, extra=40, where=1.0, in_place=True,
         row_pad=0)
def test_column_offset_adds_the_shard_and_copies_the_rest(c, opts, seed, extra, where,
                                                          in_place, row_pad):
    """``column_offset``: ``up_w`` makes ``hidden`` of a wider ``shared``'s columns (the
    column-parallel tier's shard). Those columns get the tail, within its bound; the others
    are ``shared``'s, bit for bit -- copied by the same launch into a new buffer, or left
    alone in place; ``shared`` is untouched unless it is ``out``."""
    if opts.get("swap_ab") and opts.get("gemv"):
        return
    x, _, w, up = make_inputs(c, seed)
    g = torch.Generator().manual_seed(seed % 2**31)
    width, offset = c.hidden + extra, round(where * extra)
    parent = torch.randn(c.tokens, width + row_pad, generator=g)
    full = parent.to(device=DEVICE, dtype=c.out_dtype)[:, :width]
    before = full.clone()
    y = launch(x, full, w, c.eps, up, weight_in_fp32=c.weight_in_fp32,
               out=full if in_place else None, column_offset=offset, **opts)
    assert y.shape == full.shape and y.dtype == full.dtype
    if in_place:
        assert y.data_ptr() == full.data_ptr()
    else:
        assert y.is_contiguous() and torch.equal(full, before)
    cols = slice(offset, offset + c.hidden)
    assert torch.equal(y[:, :cols.start], before[:, :cols.start])
    assert torch.equal(y[:, cols.stop:], before[:, cols.stop:])
    ref, bound = tail_tolerance(x, before[:, cols], w, c.eps, up, c.weight_in_fp32,
                                truncating=DEVICE == "cpu")
    assert_within(y[:, cols], ref, bound, f"{c} {opts} offset {offset} of {width}")


def test_column_offset_errors_name_the_argument():
    x, s, w, up = make_inputs(Case(3, 40, 24, torch.bfloat16, False, False, 1e-6, 0, 0, 0, 0,
                                   False), 0)
    wide = torch.zeros(3, 64, dtype=s.dtype, device=s.device)
    for bad in (True, 1.0, "8"):
        with pytest.raises(TypeError, match="column_offset must be an int"):
            launch(x, wide, w, 1e-6, up, column_offset=bad)
    for bad in (-1, 41, 1000):
        with pytest.raises(ValueError, match=f"column_offset={bad}: up_w's 24 rows"):
            launch(x, wide, w, 1e-6, up, column_offset=bad)
    with pytest.raises(ValueError, match="out has shape"):
        launch(x, wide, w, 1e-6, up, column_offset=8, out=wide[:, 8:32])  # out is [T, H]
    with pytest.raises(ValueError, match="out overlaps shared"):
        launch(x, wide[:, :48], w, 1e-6, up, column_offset=8, out=wide[:, 16:])
    with pytest.raises(ValueError, match="shared must be 2-D"):
        launch(x, wide[None], w, 1e-6, up, column_offset=0)
    assert launch(x, wide, w, 1e-6, up, column_offset=40).shape == (3, 64)


def test_overlap_check_is_exact_for_row_views_of_one_stride():
    """``out=``'s overlap check against brute force: row views of one buffer with one row
    stride (column shards, row ranges) share an element exactly when it says so; other
    layouts fall back to whether their byte spans meet, whatever the element sizes."""
    import random

    from k3fusion.kernels.moe_tail import _overlaps

    rng = random.Random(0)
    for _ in range(2000):
        rows, tokens = rng.randint(1, 12), rng.randint(1, 5)
        buf = torch.zeros(tokens * rows + 20)

        def view():
            return buf.as_strided((rng.randint(1, tokens), rng.randint(1, rows)), (rows, 1),
                                  rng.randint(0, 15))

        def elements(v):
            o = v.storage_offset()
            return {o + i * rows + j for i in range(v.shape[0]) for j in range(v.shape[1])}

        a, b = view(), view()
        assert _overlaps(a, b) == bool(elements(a) & elements(b))
    assert not _overlaps(torch.zeros(4), torch.zeros(4))  # another storage
    wide = torch.zeros(8, dtype=torch.float32)
    assert _overlaps(wide[2:4], wide.view(torch.bfloat16)[6:8])  # float 3 = bf16 6..7
    assert not _overlaps(wide[:2], wide.view(torch.bfloat16)[4:6])


def test_out_errors_name_the_argument():
    x, s, w, up = make_inputs(Case(3, 40, 24, torch.bfloat16, False, False, 1e-6, 0, 0, 0, 0,
                                   False), 0)
    with pytest.raises(TypeError, match="out must be a torch.Tensor"):
        launch(x, s, w, 1e-6, up, out=[0])
    with pytest.raises(ValueError, match="out has shape"):
        launch(x, s, w, 1e-6, up, out=s[:, :8])
    with pytest.raises(ValueError, match="out has dtype"):
        launch(x, s, w, 1e-6, up, out=s.float())
    wide = torch.zeros(3, 48, dtype=s.dtype, device=s.device)
    shared = wide[:, :24]
    with pytest.raises(ValueError, match="out overlaps shared"):
        launch(x, shared, w, 1e-6, up, out=wide[:, 8:32])  # overlaps, not shared itself
    with pytest.raises(ValueError, match="out overlaps up_w"):
        launch(x, s, w, 1e-6, up, out=up[:3, :24])
    launch(x, shared, w, 1e-6, up, out=wide[:, 24:])  # disjoint: fine


def test_launch_config_heuristic():
    cfg = kernel_mod.pick_launch_config(4, 7168, 3584, torch.bfloat16, 132)
    assert (cfg.block_n, cfg.split_k) == (64, 1)  # the H200 sweep's best: 112 column tiles
    assert cfg.swap_ab  # measured best operand order for 16-bit
    assert not kernel_mod.pick_launch_config(4, 7168, 3584, torch.float32, 132).swap_ab
    assert kernel_mod.pick_launch_config(17, 7168, 3584, torch.bfloat16, 132).swap_ab
    assert not kernel_mod.pick_launch_config(33, 7168, 3584, torch.bfloat16, 132).swap_ab
    # ... and not where its weight-tile stages would not fit in shared memory
    cpu = torch.device("cpu")
    big = kernel_mod.resolve_config(4, 7168, 3584, torch.bfloat16, cpu, block_n=128)
    assert not big.swap_ab and big.block_n * big.block_k * 2 * big.num_stages > \
        kernel_mod.SWAP_AB_SMEM_BYTES
    assert kernel_mod.resolve_config(4, 7168, 3584, torch.bfloat16, cpu, block_n=128,
                                     swap_ab=True).swap_ab  # forced: as asked
    # the token tile's stages count too: 32 rows at 4 stages swap (192 KiB), at 5 not
    # (240 KiB: over sm_90's 227 KiB per block)
    assert kernel_mod.resolve_config(20, 7168, 3584, torch.bfloat16, cpu).swap_ab
    assert not kernel_mod.resolve_config(20, 7168, 3584, torch.bfloat16, cpu,
                                         num_stages=5).swap_ab
    assert kernel_mod.resolve_config(16, 7168, 3584, torch.bfloat16, cpu, num_stages=5).swap_ab
    small = kernel_mod.pick_launch_config(8, 512, 3584, torch.bfloat16, 132)
    assert small.block_n == 64 and small.split_k == 4  # 8 tiles: split K to reach the SMs
    assert small.normed_rows and small.pdl  # ... 4 ways in the norm-launch form, else 8
    assert kernel_mod.pick_launch_config(8, 512, 3584, torch.float32, 132).split_k == 8
    assert kernel_mod.pick_launch_config(33, 512, 3584, torch.bfloat16, 132).split_k == 8
    assert kernel_mod.pick_launch_config(1, 64, 20, torch.float32).block_k == 32
    # split_k never leaves a split without K blocks
    r = kernel_mod.resolve_config(4, 64, 100, torch.bfloat16, torch.device("cpu"), 16, 32,
                                  split_k=8)
    assert r.split_k == 4 and (r.block_n, r.block_k, r.norm_block_k) == (16, 32, 128)
    assert kernel_mod.pick_launch_config(16, 7168, 3584, torch.bfloat16).norm_block_k == 512
    assert kernel_mod.pick_launch_config(64, 7168, 3584, torch.bfloat16).norm_block_k == 128


def test_launch_config_takes_the_norm_launch_form_from_2_to_32_rows(monkeypatch):
    """Issue 17: from 2 to 32 tokens (16-bit weights, no split-K) the default is a norm
    launch + the tail kernel as a GEMM + add, its programmatic dependent -- except bf16 at
    2-16 tokens (issue 30): one launch, the sums of squares in the main loop; one token
    stays GEMV, 33 the plain dot with the kernel's own norm prologue."""
    pick = kernel_mod.pick_launch_config
    assert kernel_mod.PDL_MAX_BLOCK_M == 32
    for t, dtype in ((17, torch.bfloat16), (32, torch.bfloat16), (2, torch.float16),
                     (16, torch.float16), (32, torch.float16)):
        cfg = pick(t, 7168, 3584, dtype, 132)
        assert cfg.normed_rows and cfg.pdl and cfg.swap_ab and cfg.split_k == 1, (t, cfg)
        assert not (cfg.prenorm or cfg.rms_in_loop), (t, cfg)
    # bf16 at 2-16 rows (issue 30): one launch, the sums of squares in the main loop
    assert kernel_mod.LOOP_RMS_MAX_BLOCK_M == 16
    for t in (2, 8, 16):
        cfg = pick(t, 7168, 3584, torch.bfloat16, 132)
        assert cfg.rms_in_loop and cfg.swap_ab and cfg.split_k == 1, (t, cfg)
        assert not (cfg.normed_rows or cfg.pdl or cfg.prenorm), (t, cfg)
    for cfg in (pick(1, 7168, 3584, torch.bfloat16, 132),      # GEMV
                pick(33, 7168, 3584, torch.bfloat16, 132),     # 64 token rows
                pick(4, 7168, 3584, torch.float32, 132)):      # fp32 weights
        assert not (cfg.normed_rows or cfg.prenorm or cfg.pdl), cfg
    split = pick(8, 512, 3584, torch.bfloat16, 132)  # 8 column tiles: split-K, norm launch
    assert split.split_k == 4 and split.normed_rows and split.pdl
    resolve = kernel_mod.resolve_config
    cpu = torch.device("cpu")
    auto = resolve(17, 7168, 3584, torch.bfloat16, cpu)
    assert auto.normed_rows and auto.pdl  # the interpreter runs the launches in turn
    assert resolve(4, 7168, 3584, torch.bfloat16, cpu).rms_in_loop
    # anything asked for (below): the form asked for, never rms_in_loop unless it is named
    assert not resolve(4, 7168, 3584, torch.bfloat16, cpu, block_n=64).rms_in_loop
    # anything asked for about the form or the grid: as asked, no PDL unless asked
    for opts in ({"prenorm": False}, {"prenorm": True}, {"normed_rows": True},
                 {"normed_rows": False}, {"split_k": 2}, {"block_n": 32}, {"block_n": 64},
                 {"num_stages": 4}, {"swap_ab": True}, {"block_m": 16}):
        cfg = resolve(4, 7168, 3584, torch.bfloat16, cpu, **opts)
        assert not cfg.pdl and cfg.prenorm == bool(opts.get("prenorm")), (opts, cfg)
        assert cfg.normed_rows == bool(opts.get("normed_rows")), (opts, cfg)
    assert resolve(4, 7168, 3584, torch.bfloat16, cpu, prenorm=True, pdl=True).pdl
    assert resolve(4, 7168, 3584, torch.bfloat16, cpu, normed_rows=True, pdl=True).pdl
    # where PDL does not run (before sm_90): the kernel's own norm prologue, one launch
    monkeypatch.setattr(kernel_mod, "pdl_available", lambda device: False)
    cfg = resolve(4, 7168, 3584, torch.bfloat16, cpu)
    assert not (cfg.normed_rows or cfg.prenorm or cfg.pdl)


def test_launch_config_for_a_column_shard():
    """A tp = 8 shard (896 columns): the GEMV form up to 4 tokens in 8-column tiles (112
    programs, no split-K), then the norm launch + the swapped dot split 4 ways."""
    pick = kernel_mod.pick_launch_config
    for t, block_k, stages in ((1, 1024, 4), (2, 512, 5), (4, 256, 5)):
        cfg = pick(t, 896, 3584, torch.bfloat16, 132)
        assert cfg.gemv and (cfg.block_n, cfg.split_k, cfg.block_k, cfg.num_stages) == (
            8, 1, block_k, stages), (t, cfg)
    for t in (5, 8, 32):
        cfg = pick(t, 896, 3584, torch.bfloat16, 132)
        assert not cfg.gemv and cfg.normed_rows and cfg.pdl and cfg.swap_ab, (t, cfg)
        assert (cfg.block_n, cfg.split_k) == (64, 4), (t, cfg)
    assert pick(1, 1025, 3584, torch.bfloat16, 132).block_n == 32  # not narrow: as before
    assert not pick(2, 1025, 3584, torch.bfloat16, 132).gemv
    assert pick(1, 2048, 3584, torch.bfloat16, 132).block_n == 32
    assert not pick(1, 896, 3584, torch.float32, 132).gemv  # 16-bit weights only
    assert pick(1, 96, 3584, torch.bfloat16, 132).split_k > 1  # 12 tiles of 8: split-K
    # asked for: narrow tiles in the GEMV form only
    cpu = torch.device("cpu")
    assert kernel_mod.resolve_config(1, 896, 3584, torch.bfloat16, cpu, block_n=4).block_n == 4
    with pytest.raises(ValueError, match="block_n < 16 needs the GEMV form"):
        kernel_mod.resolve_config(8, 896, 3584, torch.bfloat16, cpu, block_n=8)


def test_launch_config_takes_the_gemv_form_for_one_16_bit_token():
    pick = kernel_mod.pick_launch_config
    one = pick(1, 7168, 3584, torch.bfloat16, 132)
    assert one.gemv and not one.swap_ab  # H200: 15.4 us against the dot's 17.7
    assert (one.block_n, one.block_k, one.num_warps, one.num_stages) == (32, 256, 4, 3)
    assert pick(1, 7168, 3584, torch.float16, 132).gemv
    assert not pick(1, 7168, 3584, torch.float32, 132).gemv  # not measured: the dot form
    assert not pick(2, 7168, 3584, torch.bfloat16, 132).gemv  # the dot wins from T = 2
    # Forced at more tokens: the accumulator stays at 8K elements, T padded to 4, not 16.
    four = pick(3, 7168, 3584, torch.bfloat16, 132, gemv=True)
    assert four.gemv and (four.block_n, four.block_k, four.norm_block_k) == (32, 64, 2048)
    assert kernel_mod.block_m_for(3, True) == 4 and kernel_mod.block_m_for(3) == 16
    assert kernel_mod.block_m_for(0, True) == 1
    cpu = torch.device("cpu")
    # forced off at T = 1: the swapped dot, as before; so is asking for a dot operand order
    assert kernel_mod.resolve_config(1, 7168, 3584, torch.bfloat16, cpu, gemv=False).swap_ab
    for order in (True, False):
        forced = kernel_mod.resolve_config(1, 7168, 3584, torch.bfloat16, cpu, swap_ab=order)
        assert forced.swap_ab is order and not forced.gemv
    # a block_n asked for keeps the accumulator budget (block_k follows it)
    wide = kernel_mod.resolve_config(1, 7168, 3584, torch.bfloat16, cpu, block_n=64)
    assert wide.gemv and wide.block_n * wide.block_k == 8192
    assert kernel_mod.resolve_config(1, 7168, 3584, torch.bfloat16, cpu, block_n=64,
                                     block_k=32).block_k == 32  # as asked
    with pytest.raises(ValueError, match="swap_ab=True.*gemv=True"):
        kernel_mod.resolve_config(1, 7168, 3584, torch.bfloat16, cpu, swap_ab=True, gemv=True)


# ============================================================================ bad arguments


def _randn(*shape, **kw):  # on the machine's device: the argument checks run before launch
    return torch.randn(*shape, device=DEVICE, **kw)


def _rand(*shape, **kw):
    return torch.rand(*shape, device=DEVICE, **kw)


def _good():
    return dict(routed_latent=_randn(4, 40), shared=_randn(4, 24),
                norm_w=_rand(40) + 0.5, eps=1e-6, up_w=_randn(24, 40))


@pytest.mark.parametrize(
    "change,exc,match",
    [
        (dict(routed_latent=[[1.0]]), TypeError, "routed_latent must be a Tensor"),
        (dict(up_w=None), TypeError, "up_w must be a Tensor"),
        (dict(eps="1e-6"), TypeError, "eps must be a float"),
        (dict(eps=-1.0), ValueError, "eps must be finite"),
        (dict(eps=float("nan")), ValueError, "eps must be finite"),
        (dict(weight_in_fp32=1), TypeError, "weight_in_fp32 must be a bool"),
        (dict(routed_latent=_randn(40)), ValueError, "routed_latent must be 2-D"),
        (dict(shared=_randn(1, 4, 24)), ValueError, "shared must be 2-D"),
        (dict(norm_w=_rand(1, 40)), ValueError, "norm_w must be 1-D"),
        (dict(routed_latent=_randn(MAX_TOKENS + 1, 40), shared=_randn(MAX_TOKENS + 1, 24)),
         ValueError, f"T={MAX_TOKENS + 1}.*at most {MAX_TOKENS}"),
        (dict(norm_w=_rand(39)), ValueError, "norm_w has 39"),
        (dict(up_w=_randn(24, 41)), ValueError, "up_w is"),
        (dict(shared=_randn(4, 23)), ValueError, "shared must be"),
        (dict(shared=_randn(3, 24)), ValueError, "shared must be"),
        (dict(routed_latent=_randn(4, 0), norm_w=_rand(0), up_w=_randn(24, 0)),
         ValueError, "L = 0"),
        (dict(up_w=_randn(0, 40), shared=_randn(4, 0)), ValueError, "H = 0"),
        (dict(routed_latent=_randn(4, 80)[:, ::2]), ValueError, "routed_latent must be contiguous"),
        (dict(shared=_randn(4, 48)[:, ::2]), ValueError, "shared must be contiguous"),
        (dict(up_w=_randn(40, 24).t()), ValueError, "up_w must be contiguous"),
        (dict(norm_w=_rand(80)[::2]), ValueError, "norm_w must be contiguous"),
        (dict(routed_latent=_randn(4, 40, dtype=torch.float64)), TypeError, "routed_latent must be float32"),
        (dict(norm_w=_rand(40).to(torch.int32)), TypeError, "norm_w must be float32"),
        (dict(up_w=_randn(24, 40, dtype=torch.bfloat16)), TypeError, "dtypes must agree"),
        (dict(shared=_randn(4, 24, dtype=torch.float16)), TypeError, "dtypes must agree"),
        (dict(up_w=torch.randn(24, 40, device="meta")), ValueError, "up_w is on meta"),
        (dict(block_n=24), ValueError, "block_n must be a power of two"),
        (dict(block_n=512), ValueError, "block_n must be 0"),
        (dict(block_n=8), ValueError, "block_n < 16 needs the GEMV form"),
        (dict(block_n=8, gemv=False), ValueError, "block_n < 16 needs the GEMV form"),
        (dict(block_k=True), TypeError, "block_k must be an int"),
        (dict(split_k=-1), ValueError, "split_k must be 0"),
        (dict(num_warps=3), ValueError, "num_warps must be a power of two"),
        (dict(num_stages=99), ValueError, "num_stages must be 0"),
        (dict(norm_block_k=100), ValueError, "norm_block_k must be a power of two"),
    ],
)
def test_argument_errors(change, exc, match):
    args = _good() | change
    with pytest.raises(exc, match=match):
        launch(**args)


def test_weight_in_fp32_dtype_rule():
    """bf16 input, fp32 weight: cast-then-weight gives fp32 (fp32 up_w/shared), the
    weight-in-fp32 form bf16 (bf16 up_w/shared); the other pairing is refused."""
    x = _randn(2, 40, dtype=torch.bfloat16)
    w = _rand(40) + 0.5
    s16, up16 = _randn(2, 24, dtype=torch.bfloat16), _randn(24, 40, dtype=torch.bfloat16)
    assert launch(x, s16, w, 1e-6, up16, weight_in_fp32=True).dtype == torch.bfloat16
    assert launch(x, s16.float(), w, 1e-6, up16.float()).dtype == torch.float32
    with pytest.raises(TypeError, match="weight_in_fp32=False.*gives torch.float32"):
        launch(x, s16, w, 1e-6, up16)


def test_not_launchable_on_other_devices():
    meta = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in _good().items()}
    with pytest.raises(RuntimeError, match="runs on CUDA .*not on meta"):
        launch(**meta)


# ============================================================================ registry / selection


def _triton_impl():
    (impl,) = [i for i in moe_tail.tail_fusion_impls() if i.name == "triton"]
    return impl


def test_triton_impl_is_registered_on_import():
    impl = _triton_impl()
    assert impl.device_types == ("cuda",)
    with pytest.raises(TypeError, match="device_types"):
        moe_tail.register_tail_fusion(moe_tail.TailFusionImpl("bad", impl.supports, impl.run,
                                                              "cuda"))


def test_cpu_has_no_fused_tail():
    why = moe_tail.tier_unavailable_reason("tail_fusion", 4, 64, 1, "cpu")
    assert "'cpu'" in why and "none is registered for 'cpu'" in why and "triton (cuda)" in why
    assert Tier.TAIL_FUSION not in moe_tail.available_tiers(4, 64, 1, "cpu")
    assert moe_tail.select_tier(4, 64, 1, "cpu") is Tier.REPLICATED
    with pytest.raises(TierUnavailableError, match=r"tail_fusion.*'cpu'"):
        moe_tail.select_tier(4, 64, 1, "cpu", force="tail_fusion")
    # below the overlap threshold the CPU call runs the replicated form, the reference
    x, s, w, up = make_inputs(Case(4, 40, 24, torch.float32, False, False, 1e-6, 0, 0, 0, 0,
                                   False), 0, "cpu")
    y, tier = moe_tail.run_latent_moe_tail(
        x, s, w, 1e-6, up, config=FusionConfig(shared_experts_stream_token_threshold=4))
    assert tier is Tier.ALLREDUCE_OVERLAP
    assert torch.equal(y, reference.latent_moe_tail(x, s, w, 1e-6, up))


def test_supports_on_a_cuda_device_object():
    """Selection needs no GPU: a ``torch.device("cuda")`` object is enough to ask."""
    impl, cuda = _triton_impl(), torch.device("cuda")
    for t in (1, 2, 7, 16, 17, MAX_TOKENS):
        assert impl.supports(t, 7168, 1, cuda) is None, t
    assert "tp=2" in impl.supports(4, 7168, 2, cuda)
    assert "T=0" in impl.supports(0, 7168, 1, cuda)
    assert f"T={MAX_TOKENS + 1}" in impl.supports(MAX_TOKENS + 1, 7168, 1, cuda)
    assert "'cpu'" in impl.supports(4, 7168, 1, torch.device("cpu"))

    assert moe_tail.select_tier(1, 7168, 1, cuda) is Tier.TAIL_FUSION
    # selection stops at the kernel's measured select_max_tokens (32), below its limit
    # and below config.fused_tail_max_tokens; forcing the tier runs it up to its limit.
    # The boundary is checked on both sides of the constant (docs/experiments.md,
    # "2026-12-02: the tail as a norm launch + a GEMM (issue 17)", the run that moved it).
    most = moe_tail.TRITON_SELECT_MAX_TOKENS
    assert impl.select_max_tokens == most == 32
    assert moe_tail.select_tier(most, 7168, 1, cuda) is Tier.TAIL_FUSION
    assert moe_tail.select_tier(most + 1, 7168, 1, cuda) is Tier.REPLICATED
    lowered = FusionConfig(fused_tail_max_tokens=4)
    assert moe_tail.select_tier(5, 7168, 1, cuda, lowered) is Tier.REPLICATED
    assert moe_tail.select_tier(4, 7168, 1, cuda, lowered) is Tier.TAIL_FUSION
    assert moe_tail.select_tier(most + 1, 7168, 1, cuda, force="tail_fusion") is Tier.TAIL_FUSION
    assert moe_tail.select_tier(0, 7168, 1, cuda) is Tier.REPLICATED  # no fused tail, no overlap at T = 0
    assert moe_tail.select_tier(4, 7168, 2, cuda) is Tier.COLUMN_PARALLEL
    with pytest.raises(TierUnavailableError, match=r"tail_fusion.*triton: tp=2"):
        moe_tail.select_tier(4, 7168, 2, cuda, force="tail_fusion")
    with pytest.raises(TierUnavailableError, match=r"triton: T=65"):
        moe_tail.select_tier(65, 7168, 1, cuda, force="tail_fusion")


def test_registered_run_computes_the_tail():
    """The registry's ``run`` (what the tier calls), here on the interpreted kernel."""
    c = Case(3, 40, 24, torch.bfloat16, False, True, 1e-5, 0, 8, 8, 0, False)
    x, s, w, up = make_inputs(c, 5)
    y = _triton_impl().run(x, s, w, 1e-5, up, None, True)
    ref, bound = tail_tolerance(x, s, w, 1e-5, up, True, truncating=INTERPRETED)
    assert_within(y, ref, bound, "registered run")


# ============================================================================ CUDA


K3_LATENT, K3_HIDDEN = 3584, 7168


def _k3_inputs(tokens, dtype=torch.bfloat16, seed=0, hidden=K3_HIDDEN):
    c = Case(tokens, K3_LATENT, hidden, dtype, False, False, 1e-6, 0, 0, 0, 0, False)
    return make_inputs(c, seed, "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("tokens", [1, 4, 16])
def test_cuda_k3_sizes(tokens):
    x, s, w, up = _k3_inputs(tokens)
    y = launch(x, s, w, 1e-6, up)
    ref, bound = tail_tolerance(x, s, w, 1e-6, up, False, truncating=False)
    assert_within(y, ref, bound, f"T={tokens}")


@pytest.mark.cuda
@pytest.mark.parametrize("tokens", [1, 4, 16, 32])
def test_cuda_column_parallel_shard_in_one_launch(tokens, monkeypatch):
    """The column-parallel tier at tp = 8, rank 3 (collectives stubbed: one GPU): its 896
    columns from the tail kernel (in place on a donated partial, else into a buffer the
    launch copies the other columns into), within the tail's bound, the other columns
    shared's; the unfused shard (norm + addmm_) within the same bound."""
    monkeypatch.setattr(moe_tail.tiers, "tp_size_and_rank", lambda group: (8, 3))
    monkeypatch.setattr(moe_tail.tiers, "_all_reduce_owned", lambda t, group: t)
    monkeypatch.setattr(reference, "all_reduce", lambda t, group=None: t)
    x, s, w, up = _k3_inputs(tokens)
    cols = slice(3 * 896, 4 * 896)
    ref, bound = tail_tolerance(x, s[:, cols], w, 1e-6, up[cols], False, truncating=False)
    monkeypatch.setattr(moe_tail.tiers, "COLUMN_FUSED_MAX_TOKENS", 32)  # every T here
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(moe_tail.tiers, "COLUMN_FUSED_MAX_TOKENS", 0)
        for donate in (False, True):
            mine = s.clone()
            with spy_on_launcher("latent_moe_tail_fused", "column_offset") as calls:
                y = moe_tail.tiers._column_parallel(x, mine, w, 1e-6, up, object(), False,
                                                    None, donate)
            assert calls == ([cols.start] if fused else [])
            assert (y.data_ptr() == mine.data_ptr()) == donate
            assert_within(y[:, cols], ref, bound, f"T={tokens} fused={fused}")
            assert torch.equal(y[:, :cols.start], s[:, :cols.start])
            assert torch.equal(y[:, cols.stop:], s[:, cols.stop:])


@pytest.mark.cuda
@pytest.mark.parametrize("opts", [
    dict(split_k=1, block_n=16), dict(split_k=2, block_n=64), dict(split_k=4, block_n=128),
    dict(split_k=3, block_n=32, block_k=128, num_warps=8, num_stages=3),
    dict(block_n=64, block_k=64, num_warps=2, num_stages=5),
    # the GEMV form at 4 tokens (its 3-D accumulator), with split-K, with 8 warps
    dict(gemv=True), dict(gemv=True, split_k=3, block_n=16), dict(gemv=True, num_warps=8),
])
def test_cuda_launch_configs(opts):
    x, s, w, up = _k3_inputs(4, seed=1)
    y = launch(x, s, w, 1e-6, up, **opts)
    ref, bound = tail_tolerance(x, s, w, 1e-6, up, False, truncating=False)
    assert_within(y, ref, bound, str(opts))


@pytest.mark.cuda
@pytest.mark.parametrize("weight_in_fp32", [False, True])
def test_cuda_fp32_and_weight_in_fp32(weight_in_fp32):
    run_and_check(Case(5, K3_LATENT, 640, torch.float32, False, weight_in_fp32, 1e-6, 0, 8, 8,
                       3, False), 4, device="cuda")
    run_and_check(Case(5, K3_LATENT, 640, torch.bfloat16, True, weight_in_fp32, 1e-6, 0, 8, 8,
                       3, False), 4, device="cuda")


@pytest.mark.cuda
def test_cuda_tier_runs_the_kernel():
    """The tier picks the kernel up to ``TRITON_SELECT_MAX_TOKENS`` (the GEMV form at one
    token, the PDL prologue form at the limit) and not one token above it."""
    limit = moe_tail.TRITON_SELECT_MAX_TOKENS
    for tokens in (1, limit):
        x, s, w, up = _k3_inputs(tokens, seed=2)
        with spy_on_launcher("latent_moe_tail_fused", "weight_in_fp32") as calls:
            y, tier = moe_tail.run_latent_moe_tail(x, s, w, 1e-6, up)
        assert tier is Tier.TAIL_FUSION and calls == [False]
        ref, bound = tail_tolerance(x, s, w, 1e-6, up, False, truncating=False)
        assert_within(y, ref, bound, f"tier T={tokens}")
        with spy_on_launcher("latent_moe_tail_fused", "weight_in_fp32") as calls:
            y_op = torch.ops.k3fusion.latent_moe_tail(x, s, w, 1e-6, up, None)
        assert calls == [False] and torch.equal(y_op, y)
        # the in-place op (what compiled graphs run): the kernel writes into shared itself
        mine = s.clone()
        with spy_on_launcher("latent_moe_tail_fused", "out") as calls:
            torch.ops.k3fusion.latent_moe_tail_(x.clone(), mine, w, 1e-6, up, None)
        assert len(calls) == 1 and calls[0].data_ptr() == mine.data_ptr()
        assert torch.equal(mine, y)
    x, s, w, up = _k3_inputs(limit + 1, seed=2)
    with spy_on_launcher("latent_moe_tail_fused", "weight_in_fp32") as calls:
        _, tier = moe_tail.run_latent_moe_tail(x, s, w, 1e-6, up)
    assert tier is not Tier.TAIL_FUSION and calls == []


@pytest.mark.cuda
@pytest.mark.parametrize("padding", [dict(force_shape_pad=True), dict(shape_padding=False)],
                         ids=["rows-padded", "not-padded"])
def test_cuda_compiled_tail_runs_the_kernel(padding):
    """``backend="k3fusion"``: the tail becomes the op, whose tier at T=4 is the kernel --
    whether Inductor's pad_mm pads the GEMMs' 4 rows to 8 or not. (Left to itself pad_mm
    decides by a timing, cached on disk: this test used to match or not depending on what
    had run before; both outcomes are forced here.)"""
    import torch._inductor.config as inductor_config

    x, s, w, up = _k3_inputs(4, seed=3, hidden=1024)
    act = torch.randn(4, 512, device="cuda", dtype=torch.bfloat16)
    # A 0/1 selection: the shared projection is exact whatever GEMM algorithm computes it.
    down = torch.zeros(1024, 512, device="cuda", dtype=torch.bfloat16)
    down[torch.arange(1024), torch.arange(1024) % 512] = 1

    def tail(act, down, x, w, up):
        x32 = x.float()
        h = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w
        return act @ down.T + h @ up.T  # shared = a projection: what the pattern claims

    pads = []  # constant_pad_nd nodes in the post-grad graph our pass receives

    def count_pads(graph):
        pads.append(sum(n.target is torch.ops.aten.constant_pad_nd.default for n in graph.nodes))

    torch._dynamo.reset()
    k3fusion.reset_match_counts()
    with inductor_config.patch(fx_graph_cache=False, post_grad_custom_pre_pass=count_pads,
                               **padding), torch.no_grad(), \
            spy_on_launcher("latent_moe_tail_fused", "weight_in_fp32") as calls:
        y = torch.compile(tail, backend="k3fusion")(act, down, x, w, up)
    assert len(pads) == 1 and (pads[0] >= 1) == ("force_shape_pad" in padding), pads
    assert k3fusion.match_counts().get("moe_tail") == 1
    assert calls == [False]
    shared = act[:, torch.arange(1024) % 512]
    ref, bound = tail_tolerance(x, shared, w, 1e-6, up, False, truncating=False)
    assert_within(y, ref, bound, "compiled")


@pytest.mark.cuda
def test_cuda_graph_replay_split_k(monkeypatch):
    """The graph owns the split-K counters of its launch (allocated and zeroed in the
    capture): replays with new inputs each time stay correct, and every replay ends with
    them at 0."""
    x, s, w, up = _k3_inputs(8, seed=4)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        launch(x, s, w, 1e-6, up, split_k=4)  # compile
        torch.cuda.synchronize()
        locks = _scratch_spy(monkeypatch)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            y = launch(x, s, w, 1e-6, up, split_k=4)
    (lock,) = locks
    for seed in (5, 6, 7):
        x2, s2, _, _ = _k3_inputs(8, seed=seed)
        x.copy_(x2)
        s.copy_(s2)
        graph.replay()
        torch.cuda.synchronize()
        ref, bound = tail_tolerance(x, s, w, 1e-6, up, False, truncating=False)
        assert_within(y, ref, bound, f"replay {seed}")
        assert int(lock.abs().sum()) == 0


@pytest.mark.cuda
@pytest.mark.parametrize("tokens, opts", [
    (4, {}),                        # the default at 2-16 tokens: one launch (rms_in_loop)
    (32, {}),                                            # the default: the norm-launch form
    (4, {"normed_rows": True, "pdl": True}),
    (8, {"normed_rows": True, "pdl": True, "split_k": 2}),
    (8, {"prenorm": True, "pdl": True}),                 # the 1/rms prologue form
])
def test_cuda_pdl_forms_never_read_a_stale_prologue(tokens, opts):
    """The PDL forms' tail kernel starts before its prologue launch has finished: it must
    wait for it. Captured in a graph between an in-graph write of the routed rows and an
    in-graph read of the output, replayed with new rows each time, and launched back to
    back eagerly without a sync: every result is that call's tail, never the previous
    rows' (a missing or misplaced wait reads the prologue buffer of an earlier call)."""
    x, s, w, up = _k3_inputs(tokens, seed=20)
    if not opts:  # the default form this case is about
        config = kernel_mod.resolve_config(tokens, K3_HIDDEN, K3_LATENT, torch.bfloat16, x.device)
        assert config.rms_in_loop if tokens <= 16 else config.pdl, config
    src = x.clone()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        launch(x, s, w, 1e-6, up, **opts)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            x.copy_(src)                       # the rows written just before the tail
            y = launch(x, s, w, 1e-6, up, **opts)
            out = y * 1                        # and read right after it
    for seed in (21, 22, 23):
        src.copy_(_k3_inputs(tokens, seed=seed)[0])
        graph.replay()
        torch.cuda.synchronize()
        ref, bound = tail_tolerance(src, s, w, 1e-6, up, False, truncating=False)
        assert_within(out, ref, bound, f"replay {seed} {opts}")
    rows = [_k3_inputs(tokens, seed=seed)[0] for seed in (24, 25, 26)]
    ys = [launch(r, s, w, 1e-6, up, **opts) for r in rows]  # no sync in between
    torch.cuda.synchronize()
    for r, y in zip(rows, ys):
        ref, bound = tail_tolerance(r, s, w, 1e-6, up, False, truncating=False)
        assert_within(y, ref, bound, f"eager {opts}")


# ============================================================================ the benchmark (CPU parts)


def _fake_bench_result():
    row = {"T": 4, "floor_us": 12.0, "input_sets": 3, "eager_us": 30.0, "inductor_us": 21.0,
           "op_us": 13.5, "kernel_us": 13.0, "op_tier": "tail_fusion", "model_floor_us": 18.9,
           "model_eager_us": 40.0, "model_inductor_us": 32.0, "model_k3fusion_matches": 1,
           "model_k3fusion_us": 24.0, "kernel_vs_inductor": 21 / 13, "kernel_of_floor": 12 / 13,
           "model_k3fusion_vs_inductor": 32 / 24,
           "sweep": {"times_us": {"n32_k256_p512_s1_w4_st4": 13.0, "n64_k256_p512_s2_w4_st4": 12.6,
                                  "n128_k256_p512_s4_w8_st5": float("nan")},
                     "default": "n32_k256_p512_s1_w4_st4", "best": "n64_k256_p512_s2_w4_st4"}}
    big = {"T": 64, "floor_us": 12.4, "input_sets": 3, "eager_us": 31.0, "inductor_us": 22.0,
           "op_us": 22.5, "op_tier": "allreduce_overlap", "model_floor_us": 19.0,
           "model_eager_us": 41.0, "model_inductor_us": 33.0, "model_k3fusion_matches": 1,
           "model_k3fusion_us": 33.5, "model_k3fusion_vs_inductor": 33 / 33.5}
    tp = {"T": 512, "input_sets": 1, "replicated_us": 100.0, "tp2_us": 52.0,
          "tp2_speedup": 100 / 52, "tp4_us": 27.0, "tp4_speedup": 100 / 27}
    return {"bench": "moe_tail", "latent": 3584, "hidden": 7168, "dtype": "bfloat16",
            "rows": [row, big], "tp_rows": [tp], "tps": [2, 4, 8], "date": "2026-01-01",
            "gpu": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0", "cuda": "13.0"}


def test_bench_markdown_and_plot(tmp_path):
    from k3fusion.bench import moe_tail as bench

    md = bench.markdown(_fake_bench_result())
    assert "| 4 | 30.00 | 21.00 | 13.00 | 13.50 (tail_fusion) | 12.00 | 1.62x | 92% |" in md
    assert "| 64 | 31.00 | 22.00 | - | 22.50 (allreduce_overlap) | 12.40 | - | - |" in md
    assert "| 4 | 40.00 | 32.00 | 24.00 | 1 | 18.90 | 1.33x |" in md
    assert "n64_k256_p512_s2_w4_st4 12.60, n32_k256_p512_s1_w4_st4 13.00 | n32_k256_p512_s1_w4_st4 13.00 |" in md
    assert "| 512 | 100.00 | 52.00 (1.92x) | 27.00 (3.70x) | - (-) |" in md
    only_sweep = dict(_fake_bench_result(), tp_rows=[],
                      rows=[{"T": 1, "floor_us": 12.0, "input_sets": 3,
                             "sweep": _fake_bench_result()["rows"][0]["sweep"]}])
    md = bench.markdown(only_sweep)
    assert "sweep" in md and "(a)" not in md and "(b)" not in md
    pytest.importorskip("matplotlib")
    bench.plot(_fake_bench_result(), tmp_path / "moe_tail.png")
    assert (tmp_path / "moe_tail.png").stat().st_size > 0


_SHARD_SCRIPT = r"""
import json, os
os.environ["TRITON_INTERPRET"] = "1"
import torch
from k3fusion import moe_tail
from k3fusion.bench import moe_tail as bench
bench.DEVICE, bench.LATENT, bench.HIDDEN = "cpu", 40, 64
moe_tail.tiers.SHARD_KERNEL_ON_CPU = True  # the shard through the interpreted kernel
launches = []
real = moe_tail.tiers.kernels.moe_tail.latent_moe_tail_fused
def spy(*a, **k):
    launches.append(k.get("column_offset"))
    return real(*a, **k)
moe_tail.tiers.kernels.moe_tail.latent_moe_tail_fused = spy
calls = []
def timer(fn, sets):
    calls.append(len(sets))
    fn(*sets[0])
    return 1.0
rows = bench.run_shard([1, 5], 4, timer=timer)
assert not torch.distributed.is_initialized()  # the group it started is gone
try:
    bench.run_shard([1], 3, timer=timer)
except ValueError as e:
    refused = str(e)
print(json.dumps(dict(rows=rows, launches=launches, calls=calls, refused=refused,
                      md=bench.markdown(dict(rows=[], tp_rows=[], tps=[], shard_rows=rows,
                                             latent=40, hidden=64, dtype="bfloat16",
                                             gpu="cpu", date="d", torch="t",
                                             triton="t")))))
"""


@pytest.mark.skipif(tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 7),
                    reason="Triton 3.6's interpreter fails inside this launch (TypeError: only "
                           "0-dimensional arrays ..., the H200 machine, 2026-12-04); on a GPU "
                           "the bench's part (c) runs the compiled kernel")
def test_bench_shard_part_checks_and_times_the_tier_variants():
    """Part (c), a CPU dry run (in a process of its own: the fake group is process-wide):
    rank 0 of a fake group of 4 runs the column-parallel tier, its shard through the
    (interpreted) tail kernel at column 0 -- as it runs, with donated partials -- and
    unfused; each variant checked against the reference, then timed; the table."""
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _SHARD_SCRIPT], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert [(row["T"], row["tp"]) for row in r["rows"]] == [(1, 4), (5, 4)]
    for row in r["rows"]:
        assert (row["tier_us"], row["tier_donated_us"], row["unfused_us"]) == (1.0, 1.0, 1.0)
    # per T: fused check + timing, donated check + timing; the unfused variant none
    assert r["launches"] == [0] * 8 and len(r["calls"]) == 6
    assert "does not divide H = 64" in r["refused"]
    assert "(c) One rank's column-parallel tier at tp = 4" in r["md"]
    assert "| 1 | 1.00 | 1.00 | 1.00 |" in r["md"]


def test_bench_arguments(monkeypatch):
    from k3fusion.bench import moe_tail as bench

    args = bench.parser().parse_args([])
    assert (args.tokens, args.tp_tokens, args.tps) == ([1, 4, 8, 16, 32, 64], [512, 4096, 16384],
                                                       [2, 4, 8])
    args = bench.parser().parse_args(["--sweep-only", "--tokens", "1", "16", "--tp-tokens"])
    assert args.sweep_only and args.tokens == [1, 16] and args.tp_tokens == []
    with pytest.raises(SystemExit, match="--tp-tokens values must be >= 1"):
        bench.main(["--tp-tokens", "0"])
    assert (args.shard_tokens, args.shard_tp) == ([1, 2, 4, 8, 16, 32], 8)
    with pytest.raises(SystemExit, match="--shard-tokens values must be >= 1"):
        bench.main(["--shard-tokens", "0"])
    for bad in ("1", "5"):
        with pytest.raises(SystemExit, match="--shard-tp must be >= 2 and divide H"):
            bench.main(["--shard-tp", bad])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main(["--out", "unused"])


_PTX_CHECK = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from k3fusion.kernels.moe_tail import _moe_tail_kernel as k
names = [p.name for p in k.params]
for split, swap, gemv, rest, loop in (
        (1, False, 0, 0, 0), (4, False, 0, 0, 0), (1, True, 0, 0, 0), (2, True, 0, 0, 0),
        (1, False, 1, 0, 0), (3, False, 1, 0, 0), (1, False, 4, 0, 0), (1, False, 1, 1, 0),
        (4, True, 0, 1, 0), (1, True, 0, 0, 1), (1, False, 0, 0, 1)):
    const = dict(BLOCK_M=gemv or 16, BLOCK_N=(8 if rest else 32) if gemv else 64,
                 BLOCK_K=64 if gemv == 4 else 256,
                 NORM_BLOCK_K=512, SPLIT_K=split, SWAP_AB=swap,
                 GEMV=bool(gemv), NUM_STAGES=3 if gemv else 4, WEIGHT_IN_FP32=False,
                 DOT_IN_FP32=False, GPU_FENCE=True, NORM_DTYPE=triton.language.bfloat16,
                 INV_RMS_IN=False, M_FIRST=False, PDL=False, NORMED_IN=bool(rest),
                 COPY_REST=bool(rest), REST_BLOCK=512, RMS_IN_LOOP=bool(loop))
    ptrs = {"ws_ptr": "*fp32", "lock_ptr": "*i32", "rinv_ptr": "*fp32"}
    sig = {n: "constexpr" if n in const else ptrs.get(n, "*bf16") if n.endswith("_ptr")
           else "fp32" if n == "eps" else "i32" for n in names}
    src = ASTSource(fn=k, signature=sig,
                    constexprs={(names.index(n),): v for n, v in const.items()})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 4, "num_stages": 4}).asm["ptx"]
    print(split, swap, gemv, "mma" in ptx, ("atom.global" in ptx) == (split > 1))
"""


@pytest.mark.slow
def test_gpu_variants_compile_for_hopper():
    """The GPU-only code (the tensor-core dot in both operand orders, the split-K fences
    and counters, the GEMV form, the column shard's copy programs, the sums of squares in
    the main loop) compiles for sm_90 on any machine: the interpreter never builds it. The
    GEMV form has no tensor-core instruction."""
    out = run_compile_script(_PTX_CHECK, "the fused tail kernel")
    lines = out.split("\n")
    assert [x for x in lines if x] == [
        "1 False 0 True True", "4 False 0 True True", "1 True 0 True True",
        "2 True 0 True True", "1 False 1 False True", "3 False 1 False True",
        "1 False 4 False True", "1 False 1 False True", "4 True 0 True True",
        "1 True 0 True True", "1 False 0 True True"], out


_PTX_CHECK_ISSUE17 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from k3fusion.kernels.moe_tail import _moe_tail_kernel as k, _row_inv_rms_kernel as pro
from k3fusion.kernels.rms_norm import _rms_norm_kernel as norm

def build(kernel, const, ptrs, warps, stages):
    names = [p.name for p in kernel.params]
    sig = {n: "constexpr" if n in const else ptrs.get(n, "*bf16") if n.endswith("_ptr")
           else "fp32" if n == "eps" else "i32" for n in names}
    # The 16-divisibility a K3-width launch specializes on (pointers, strides, L, H): without
    # it there is no cp.async pipeline and the shared-memory figure means nothing.
    div = [n for n in names if n not in const and (n.endswith("_ptr") or n in (
        "x_stride", "up_stride", "s_stride", "y_stride", "L", "H", "K_PER_SPLIT"))]
    src = ASTSource(fn=kernel, signature=sig,
                    constexprs={(names.index(n),): v for n, v in const.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in div})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages})

ptrs = {"ws_ptr": "*fp32", "lock_ptr": "*i32", "rinv_ptr": "*fp32"}
# (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, SWAP_AB, M_FIRST, PDL, NORMED_IN, warps, stages):
# the probe's prenorm split-K at decode, its row-tiled GEMMs, and the default norm-launch
# form at 16 and 32 token rows, and a column shard's at 32
for bm, bn, bk, split, swap, mfirst, pdl, normed, nw, ns in (
        (16, 64, 256, 4, True, False, True, False, 4, 4),
        (64, 64, 256, 2, True, False, False, False, 4, 3),
        (128, 128, 64, 1, False, True, True, False, 8, 4),
        (128, 256, 64, 1, False, False, False, False, 8, 3),
        (16, 64, 256, 1, True, False, True, True, 4, 4),
        (32, 64, 256, 1, True, False, True, True, 4, 4),
        (32, 64, 256, 4, True, False, True, True, 4, 4)):
    const = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, NORM_BLOCK_K=512, SPLIT_K=split,
                 SWAP_AB=swap, GEMV=False, NUM_STAGES=ns,
                 WEIGHT_IN_FP32=False, DOT_IN_FP32=False, GPU_FENCE=True,
                 NORM_DTYPE=triton.language.bfloat16, INV_RMS_IN=not normed, M_FIRST=mfirst,
                 PDL=pdl, NORMED_IN=normed,
                 # the column shard's form: split-K after a norm launch, the rest copied
                 COPY_REST=normed and split > 1, REST_BLOCK=256, RMS_IN_LOOP=False)
    c = build(k, const, ptrs, nw, ns)
    ptx = c.asm["ptx"]
    print(bm, bn, "wgmma" in ptx and "cp.async" in ptx, ("griddepcontrol.wait" in ptx) == pdl,
          c.metadata.shared <= 227 * 1024)
c = build(pro, dict(ROWS=4, BLOCK_L=1024, PDL=True), {"rinv_ptr": "*fp32"}, 4, 3)
print("prologue", "griddepcontrol.launch_dependents" in c.asm["ptx"])
for pdl in (True, False):
    c = build(norm, dict(BLOCK_COLS=4096, ROWS=1, WEIGHT_IN_FP32=False,
                         ROUND_DTYPE=triton.language.bfloat16, COPY=False, COPY_BLOCK=1,
                         COPY_ROWS=1, PDL=pdl, ZERO=pdl), {"zero_ptr": "*i32"}, 4, 3)
    print("norm launch", ("griddepcontrol.launch_dependents" in c.asm["ptx"]) == pdl)
"""


def test_issue17_forms_compile_for_hopper():
    """The prenorm / norm-launch / row-tiled / PDL forms compile for sm_90 with
    tensor-core dots (wgmma) fed by a cp.async pipeline, the grid-dependency instructions exactly where PDL asks for
    them, and shared memory within the H200's 227 KiB per block."""
    out = run_compile_script(_PTX_CHECK_ISSUE17, "the fused tail kernel's issue-17 forms")
    assert [x for x in out.split("\n") if x] == [
        "16 64 True True True", "64 64 True True True", "128 128 True True True",
        "128 256 True True True", "16 64 True True True", "32 64 True True True",
        "32 64 True True True", "prologue True", "norm launch True", "norm launch True"], out


@pytest.mark.parametrize("form", [{}, {"normed_rows": False}, {"prenorm": True}],
                         ids=["default", "own-prologue", "prenorm"])
def test_norm_dtype_casts_the_normalized_fp32_latent(form):
    """``norm_dtype``: an fp32 latent whose normalized row is cast to bf16 (T5-style, or a
    round trip Inductor removed) -- the kernel casts there, as the reference does, in the
    norm launch (the default) and in the kernel's own tile alike."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(5, 96, generator=g).to(DEVICE)
    s = torch.randn(5, 40, generator=g).to(DEVICE, torch.bfloat16)
    w = (torch.rand(96, generator=g) + 0.5).to(DEVICE, torch.bfloat16)
    up = (torch.randn(40, 96, generator=g) / 10).to(DEVICE, torch.bfloat16)
    y = launch(x, s, w, 1e-6, up, norm_dtype=torch.bfloat16, **form)
    ref, bound = tail_tolerance(x, s, w, 1e-6, up, False, truncating=INTERPRETED,
                                norm_dtype=torch.bfloat16)
    assert_within(y, ref, bound, "norm_dtype")
    with pytest.raises(TypeError, match="dtypes must agree"):
        launch(x, s, w, 1e-6, up)  # without it: an fp32 normed latent against a bf16 up_w
    with pytest.raises(ValueError, match="norm_dtype"):
        launch(x, s, w, 1e-6, up, norm_dtype=torch.bfloat16, weight_in_fp32=True)



# ============================================================================ the tier, compiled


class _T5LatentNorm(torch.nn.Module):
    """HF ``T5LayerNorm``: an fp32 input normalized in fp32, cast to the 16-bit weight's
    dtype, then weighted -- the tail op's ``norm_dtype`` form (also what a GPU compile
    gives where Inductor drops a latent's 16-bit round trip)."""

    def __init__(self, weight: torch.nn.Parameter, eps: float):
        super().__init__()
        self.weight, self.variance_epsilon = weight, eps

    def forward(self, hidden_states):
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        if self.weight.dtype in [torch.float16, torch.bfloat16]:
            hidden_states = hidden_states.to(self.weight.dtype)
        return self.weight * hidden_states


def _fp32_latent_model():
    """The tiny bf16 latent-MoE Kimi-K3 whose routed latent stays the experts' fp32 sum
    and whose latent norm is T5's: every tail has an fp32 latent and a bf16 norm."""
    import types

    from k3fusion.models import KimiK3Config, KimiK3ForCausalLM
    from k3fusion.models.kimi_k3 import KimiK3LatentMoE

    model = KimiK3ForCausalLM(KimiK3Config.tiny(latent_moe=True, dtype=torch.bfloat16),
                              seed=0).eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, KimiK3LatentMoE):
                w = m.latent_norm.weight
                w.copy_(1 + 0.1 * torch.randn(w.shape, generator=torch.Generator().manual_seed(3)))
                m.latent_norm = _T5LatentNorm(w, m.latent_norm.eps)
                m.routed_latent = types.MethodType(_acc, m)
    return model


def _acc(moe, x):
    # KimiK3LatentMoE.routed_latent without its final `.to(x.dtype)`.
    ids, weights = moe.route(x)
    combine = torch.zeros(x.shape[0], moe.num_experts, dtype=torch.float32).scatter(1, ids, weights)
    z = moe.down_proj(x)
    acc = torch.zeros(z.shape, dtype=torch.float32)
    for e, expert in enumerate(moe.experts):
        acc = acc + combine[:, e:e + 1] * expert(z).float()
    return acc


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's CPU registration")
def test_compiled_fp32_latent_model_runs_the_forced_fused_tier_with_norm_dtype():
    """A compiled latent-MoE model with an fp32 latent norm (T <= 16, tp = 1) with the tier
    forced to ``tail_fusion``, here through the interpreted kernel registered for CPU: the
    op passes ``norm_dtype`` to the implementation, which runs, and the model equals eager
    within bf16 roundings. (Dropping ``norm_dtype`` in the tier made such GPU models crash
    with ``dtypes must agree``; CPU never ran this path before.)"""
    calls = []

    def interpreted(routed, shared, norm_w, eps, up_w, group, weight_in_fp32,
                    norm_dtype=None):
        calls.append((routed.shape[0], routed.dtype, norm_dtype))
        return launch(routed, shared, norm_w, eps, up_w, weight_in_fp32=weight_in_fp32,
                      norm_dtype=norm_dtype)

    model = _fp32_latent_model()
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(1))  # T = 12
    impl = moe_tail.TailFusionImpl(
        "test-interpreter", lambda t, h, tp, dev: None if tp == 1 and 0 < t <= 16 else "no",
        interpreted, ("cpu",))
    moe_tail.register_tail_fusion(impl)
    saved = k3fusion.get_config()
    try:
        k3fusion.set_config(FusionConfig(moe_tail_tier="tail_fusion"))
        torch._dynamo.reset()
        k3fusion.reset_match_counts()
        with torch.no_grad(), no_compile_caches():  # a cache hit would skip the pass
            got = torch.compile(model, backend="k3fusion", dynamic=False)(ids)
            assert k3fusion.match_counts()["moe_tail"] == model.config.num_layers
            want = model(ids)  # eager: the model's own tail code
    finally:
        k3fusion.set_config(saved)
        moe_tail.unregister_tail_fusion("test-interpreter")
        torch._dynamo.reset()
    assert calls == [(12, torch.float32, torch.bfloat16)] * model.config.num_layers
    assert got.dtype == want.dtype and torch.isfinite(got).all()
    # Logits after two bf16 layers (the interpreter truncates bf16 casts): bf16 roundings.
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)
