"""The dual RMSNorm Triton kernel, through its launcher, against ``k3fusion.reference``.

On a CPU-only machine the kernel runs in Triton's interpreter (``tests/conftest.py`` sets
``TRITON_INTERPRET=1`` before k3fusion is imported); on a CUDA machine the same property
tests run on the GPU. ``TestDualRmsNormCuda`` adds the real MLA sizes (GPU only).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from _ptx import assert_pdl_order, hopper_ptx, hopper_ptxs
from _tolerances import (
    assert_close_ulps,
    assert_matches_reference,
    assert_on_input_grid,
    dual_norm_tolerance,
    ulp,
)
from k3fusion import reference
from k3fusion.kernels._launch import kernels_are_interpreted
from k3fusion.kernels.qkv_rmsnorm import dual_rms_norm as launch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter truncates fp32 -> bf16 casts (see _tolerances.dual_norm_tolerance).
INTERPRETED = DEVICE == "cpu"

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@dataclass(frozen=True)
class Member:
    """One of the two RMSNorms: ``x`` is the first ``width`` columns of a parent whose
    rows are ``width + pad`` wide (``pad = 0``: contiguous); likewise the output."""

    rows: int
    width: int
    pad: int
    out_pad: int
    x_dtype: torch.dtype
    w_fp32: bool
    weight_in_fp32: bool
    eps: float
    log2_scale: int  # inputs are ~N(0, 1) * 2**log2_scale: small ones make eps matter
    zero_row: bool   # one all-zero row (output must be exactly 0, not NaN)

    @property
    def w_dtype(self) -> torch.dtype:
        return torch.float32 if self.w_fp32 else self.x_dtype

    @property
    def out_dtype(self) -> torch.dtype:
        return reference.rms_norm_out_dtype(self.x_dtype, self.w_dtype, self.weight_in_fp32)


ROWS = st.one_of(st.sampled_from([0, 1, 2, 3, 5, 31, 64, 67, 70]), st.integers(0, 70))
WIDTHS = st.one_of(
    st.sampled_from([1, 2, 3, 16, 48, 64, 100, 127, 128, 129, 200, 255, 256, 300]),
    st.integers(1, 300),
)
PADS = st.sampled_from([0, 1, 8, 64])
EPS = st.sampled_from([1e-6, 1e-5, 1e-3, 0.1])


@st.composite
def members(draw, rows=ROWS) -> Member:
    return Member(
        rows=draw(rows),
        width=draw(WIDTHS),
        pad=draw(PADS),
        out_pad=draw(PADS),
        x_dtype=draw(st.sampled_from(DTYPES)),
        w_fp32=draw(st.booleans()),
        weight_in_fp32=draw(st.booleans()),
        eps=draw(EPS),
        log2_scale=draw(st.sampled_from([-6, 0, 6])),
        zero_row=draw(st.booleans()),
    )


def make_inputs(m: Member, gen: torch.Generator, device: str = DEVICE):
    """``(x_parent, x, w)``: ``x`` a row view of ``x_parent`` (never copied)."""
    parent = torch.randn(m.rows, m.width + m.pad, generator=gen) * 2.0**m.log2_scale
    if m.zero_row and m.rows:
        parent[m.rows // 2, : m.width] = 0
    parent = parent.to(device=device, dtype=m.x_dtype)
    w = (torch.rand(m.width, generator=gen) * 4 - 2).to(device=device, dtype=m.w_dtype)
    return parent, parent[:, : m.width], w


def poisoned_output(m: Member, device: str = DEVICE):
    """``(y_parent, y)``: NaN-filled, ``y`` the first ``width`` columns of each row."""
    parent = torch.full((m.rows, m.width + m.out_pad), float("nan"), dtype=m.out_dtype, device=device)
    return parent, parent[:, : m.width]


def run_and_check(m1: Member, m2: Member, rows_per_program: int, seed: int,
                  *, bf16_casts_truncate: bool = INTERPRETED, device: str = DEVICE) -> None:
    gen = torch.Generator().manual_seed(seed)
    xp1, x1, w1 = make_inputs(m1, gen, device)
    xp2, x2, w2 = make_inputs(m2, gen, device)
    saved = [t.clone() for t in (xp1, w1, xp2, w2)]
    yp1, y1 = poisoned_output(m1, device)
    yp2, y2 = poisoned_output(m2, device)

    launch(x1, w1, m1.eps, x2, w2, m2.eps, y1, y2, m1.weight_in_fp32, m2.weight_in_fp32,
           rows_per_program=rows_per_program)

    for name, before, after in zip(("x1 parent", "w1", "x2 parent", "w2"), saved, (xp1, w1, xp2, w2)):
        assert torch.equal(before, after), f"{name} was modified"
    for i, (m, x, w, y, yp) in enumerate(((m1, x1, w1, y1, yp1), (m2, x2, w2, y2, yp2)), 1):
        assert not y.isnan().any(), f"y{i}: {int(y.isnan().sum())} elements never written"
        assert yp[:, m.width:].isnan().all(), f"y{i}: columns beside the row view were written"
        assert_matches_reference(y, x, w, m.eps, m.weight_in_fp32,
                                 bf16_casts_truncate=bf16_casts_truncate, msg=f"y{i} {m}")


# --------------------------------------------------------------- property test

_KV = Member(rows=7, width=48, pad=8, out_pad=0, x_dtype=torch.bfloat16, w_fp32=False,
             weight_in_fp32=False, eps=1e-6, log2_scale=0, zero_row=False)
_Q = Member(rows=7, width=96, pad=0, out_pad=0, x_dtype=torch.bfloat16, w_fp32=False,
            weight_in_fp32=False, eps=1e-5, log2_scale=0, zero_row=False)


@given(m1=members(), m2=members(), rows_per_program=st.sampled_from([1, 2, 4]),
       seed=st.integers(0, 2**31 - 1))
# The MLA pair scaled down (q contiguous, kv_c = first 48 of 56-wide rows), both forms.
@example(m1=_Q, m2=_KV, rows_per_program=1, seed=0)
@example(m1=replace(_Q, weight_in_fp32=True, rows=1), m2=replace(_KV, weight_in_fp32=True, rows=1),
         rows_per_program=4, seed=1)
# T = 0 on one side only, then on both.
@example(m1=replace(_Q, rows=0), m2=_KV, rows_per_program=2, seed=2)
@example(m1=replace(_Q, rows=0), m2=replace(_KV, rows=0), rows_per_program=1, seed=3)
# Odd, large-ish, different row counts; bf16 input with fp32 weight (fp32 output); small
# inputs where eps dominates.
@example(m1=Member(67, 129, 64, 1, torch.bfloat16, True, False, 0.1, -6, True),
         m2=Member(3, 300, 1, 8, torch.float16, True, True, 1e-6, 6, False),
         rows_per_program=4, seed=4)
def test_kernel_matches_reference(m1: Member, m2: Member, rows_per_program: int, seed: int) -> None:
    run_and_check(m1, m2, rows_per_program, seed)


# --------------------------------------------------------------- focused tests


def test_kernels_are_interpreted_on_cpu() -> None:
    """Guard for everything above: on CPU the kernel must be the interpreted one."""
    if DEVICE == "cuda":
        pytest.skip("compiled kernels on a CUDA machine")
    assert kernels_are_interpreted()


def test_eps_is_per_member() -> None:
    """Same rows, different eps: outputs differ as the reference says (eps not swapped
    or shared)."""
    x = (torch.randn(5, 40, generator=torch.Generator().manual_seed(0)) * 2.0**-6).to(DEVICE)
    w = torch.ones(40, device=DEVICE)
    y1, y2 = torch.empty_like(x), torch.empty_like(x)
    launch(x, w, 0.1, x, w, 1e-6, y1, y2, False, False, rows_per_program=2)
    assert_close_ulps(y1, reference.rms_norm(x, w, 0.1), 8.0)
    assert_close_ulps(y2, reference.rms_norm(x, w, 1e-6), 8.0)
    assert (y2.abs() > 10 * y1.abs()).all()


def test_eps_zero() -> None:
    """eps = 0 is allowed (>= 0): plain 1/rms for nonzero rows."""
    gen = torch.Generator().manual_seed(1)
    x1 = torch.randn(3, 33, generator=gen).to(DEVICE)
    x2 = torch.randn(4, 10, generator=gen).to(DEVICE)
    w1, w2 = torch.rand(33, generator=gen).to(DEVICE), torch.rand(10, generator=gen).to(DEVICE)
    y1, y2 = torch.empty_like(x1), torch.empty_like(x2)
    launch(x1, w1, 0.0, x2, w2, 0.0, y1, y2, False, True, rows_per_program=1)
    assert_close_ulps(y1, reference.rms_norm(x1, w1, 0.0, False), 8.0)
    assert_close_ulps(y2, reference.rms_norm(x2, w2, 0.0, True), 8.0)


def test_cast_then_weight_rounds_before_weighting() -> None:
    """bf16 input, fp32 weight: the two formulations give different fp32 outputs, and the
    grid check tells them apart (so the property test would catch a swapped flag)."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, 100, generator=gen).to(DEVICE, torch.bfloat16)
    w = (torch.rand(100, generator=gen) + 0.5).to(DEVICE)
    y = torch.empty(6, 100, device=DEVICE)  # promote(bf16, fp32): fp32
    launch(x, w, 1e-6, x, w, 1e-6, y, torch.empty_like(x), False, True, rows_per_program=1)
    assert_on_input_grid(y, w, torch.bfloat16)
    # The weight-in-fp32 value (no rounding of the normalized row) is off the grid.
    unrounded = reference.rms_norm(x.float(), w, 1e-6, True)
    with pytest.raises(AssertionError, match="grid"):
        assert_on_input_grid(unrounded, w, torch.bfloat16)


def test_launch_shape_one_row_per_program_at_decode_sizes() -> None:
    """Up to DECODE_MAX_ROWS rows: one row of either norm per program, >= 4 warps (the
    H200's fastest at T 1-128 against vLLM's one-row programs); above, the narrow norm's
    rows grouped into tiles of the wide row's size; an explicit shape wins."""
    from k3fusion.kernels.qkv_rmsnorm import DECODE_MAX_ROWS, LaunchShape, pick_launch_shape

    for t in (1, 2, 8, DECODE_MAX_ROWS):
        assert pick_launch_shape(t, 2048, 512) == LaunchShape(1, 1, 4)
    assert pick_launch_shape(4, 8192, 512) == LaunchShape(1, 1, 8)
    assert pick_launch_shape(DECODE_MAX_ROWS + 1, 2048, 512) == LaunchShape(1, 4, 2)
    assert pick_launch_shape(DECODE_MAX_ROWS + 1, 512, 2048) == LaunchShape(4, 1, 2)
    assert pick_launch_shape(8, 2048, 512, rows_per_program=1) == LaunchShape(1, 4, 2)
    assert pick_launch_shape(8, 2048, 512, num_warps=8) == LaunchShape(1, 4, 8)


def test_rows_per_program_auto_and_larger_than_rows() -> None:
    """rows_per_program 0 (pick by size) and a block larger than T (masked rows)."""
    m1 = Member(3, 20, 4, 0, torch.float32, False, False, 1e-5, 0, False)
    m2 = Member(1, 7, 0, 2, torch.bfloat16, True, True, 1e-3, 0, False)
    for rpp in (0, 4, 8):
        run_and_check(m1, m2, rpp, seed=rpp)


def test_mixed_devices_rejected() -> None:
    x = torch.randn(2, 8, device=DEVICE)
    w = torch.ones(8, device="meta")
    with pytest.raises(ValueError, match="one device"):
        launch(x, w, 1e-6, x, torch.ones(8, device=DEVICE), 1e-6,
               torch.empty_like(x), torch.empty_like(x), False, False)


def test_pdl_needs_a_gpu_and_is_a_bool() -> None:
    x = torch.randn(2, 8, device=DEVICE)
    w = torch.ones(8, device=DEVICE)
    args = (x, w, 1e-6, x, w, 1e-6, torch.empty_like(x), torch.empty_like(x))
    with pytest.raises(TypeError, match="pdl"):
        launch(*args, pdl=1)
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="pdl=True"):
            launch(*args, pdl=True)


def test_pdl_form_waits_before_its_first_load() -> None:
    """``PDL``: the launch may start while the previous one runs, so it waits for it
    (griddepcontrol.wait) before any global load -- the weights too, which a training
    step's previous launch may have written -- then lets the next launch start."""
    const = dict(BLOCK_COLS1=2048, BLOCK_COLS2=512, ROWS1=1, ROWS2=4, WEIGHT_IN_FP32_1=False,
                 WEIGHT_IN_FP32_2=False, WEIGHTS_EARLY=False)
    ptxs = hopper_ptxs("k3fusion.kernels.qkv_rmsnorm:_dual_rms_norm_kernel",
                       "the q/kv kernel, PDL on and off",
                       [dict(const, PDL=True), dict(const, PDL=False)], num_warps=2)
    for pdl, ptx in zip((True, False), ptxs, strict=True):
        assert_pdl_order(ptx, pdl)


def test_weights_early_form_loads_only_its_weight_row_before_the_wait() -> None:
    """``WEIGHTS_EARLY``: each program's branch loads its norm's weight row, then waits,
    then loads its rows. Counted in loads of one width: the q weight row (2048) and the kv
    tile (4 x 512) before / after the waits, the q rows (2048) and the kv weight row
    (512) between them."""
    const = dict(BLOCK_COLS1=2048, BLOCK_COLS2=512, ROWS1=1, ROWS2=4, WEIGHT_IN_FP32_1=False,
                 WEIGHT_IN_FP32_2=False, WEIGHTS_EARLY=True, PDL=True)
    ptx = hopper_ptx("k3fusion.kernels.qkv_rmsnorm:_dual_rms_norm_kernel",
                     "the q/kv kernel, weights early", const, num_warps=2)
    lines = [x.strip() for x in ptx.splitlines()]
    waits = [i for i, x in enumerate(lines) if "griddepcontrol.wait" in x]
    loads = [i for i, x in enumerate(lines) if "ld.global" in x]
    assert len(waits) == 2, waits  # one per branch
    first = [i for i in loads if i < waits[0]]
    between = [i for i in loads if waits[0] < i < waits[1]]
    after = [i for i in loads if i > waits[1]]
    assert first and len(after) == len(first) and 4 * len(between) == 5 * len(first), (
        len(first), len(between), len(after))


# --------------------------------------------------------------- the tolerance helper


def test_ulp_values() -> None:
    t = torch.tensor([1.0, 3.0, -0.75, 0.0, 2.0**-20])
    assert ulp(t, torch.bfloat16).tolist() == [2.0**-7, 2.0**-6, 2.0**-8, 2.0**-133, 2.0**-27]
    assert ulp(t, torch.float16).tolist() == [2.0**-10, 2.0**-9, 2.0**-11, 2.0**-24, 2.0**-24]
    assert ulp(t, torch.float32).tolist() == [2.0**-23, 2.0**-22, 2.0**-24, 2.0**-149, 2.0**-43]


def test_assert_close_ulps_can_fail() -> None:
    e = torch.tensor([[1.0, 2.0], [-4.0, 0.0]], dtype=torch.bfloat16)
    a = e.clone()
    a[1, 0] = -4.0 - 2.0**-5  # one bf16 ulp below -4 (the step above |4| is 2**-5)
    assert_close_ulps(a, e, 1)
    with pytest.raises(AssertionError, match=r"1 of 4 elements .* worst at \[1, 0\]"):
        assert_close_ulps(a, e, 0.5)
    nan = e.clone()
    nan[0, 1] = float("nan")
    with pytest.raises(AssertionError, match="NaN mismatch"):
        assert_close_ulps(nan, e, 100)
    with pytest.raises(AssertionError, match="dtype"):
        assert_close_ulps(e.float(), e, 100)


def test_tolerances_are_tight_for_16_bit() -> None:
    """The numbers the reasoning in dual_norm_tolerance gives (fails if loosened)."""
    bf, h, f = torch.bfloat16, torch.float16, torch.float32
    assert dual_norm_tolerance(bf, bf, True, bf16_casts_truncate=True) == (1.0, bf)
    assert dual_norm_tolerance(bf, bf, False, bf16_casts_truncate=True) == (3.0, bf)
    assert dual_norm_tolerance(bf, bf, False, bf16_casts_truncate=False) == (2.0, bf)
    assert dual_norm_tolerance(h, h, False, bf16_casts_truncate=True) == (2.0, h)
    assert dual_norm_tolerance(bf, f, False, bf16_casts_truncate=True)[0] < 2.001


# --------------------------------------------------------------- real sizes, GPU only


@pytest.mark.cuda
class TestDualRmsNormCuda:
    """MLA sizes on the GPU (round-to-nearest-even casts, as torch): q_a 1536 wide and
    contiguous; kv_c the first 512 columns of 576-wide rows, bf16. Tolerances from
    ``dual_norm_tolerance(..., bf16_casts_truncate=False)``: 1 ulp weight-in-fp32, 2 ulps
    cast-then-weight (a 1-ulp flip of the rounded normalized value moves the exact
    product by < 2 ulps of the output; both products then rounded to nearest)."""

    @staticmethod
    def _pair(T: int, weight_in_fp32: bool, w_fp32: bool = False):
        q = Member(T, 1536, 0, 0, torch.bfloat16, w_fp32, weight_in_fp32, 1e-6, 0, T > 1)
        kv = Member(T, 512, 64, 64, torch.bfloat16, w_fp32, weight_in_fp32, 1e-5, 0, False)
        return q, kv

    @pytest.mark.parametrize("T", [1, 7, 128, 4099])
    @pytest.mark.parametrize("weight_in_fp32", [False, True])
    @pytest.mark.parametrize("rows_per_program", [0, 1, 2, 4])
    def test_launcher(self, T: int, weight_in_fp32: bool, rows_per_program: int) -> None:
        q, kv = self._pair(T, weight_in_fp32)
        run_and_check(q, kv, rows_per_program, seed=T, bf16_casts_truncate=False, device="cuda")

    @pytest.mark.parametrize("T", [1, 7, 4099])
    def test_pdl_reads_what_the_previous_launch_wrote(self, T: int) -> None:
        """Each launch as the previous one's programmatic dependent, captured in a CUDA
        graph: launch i reads the rows and weights launch i - 1 just wrote (its outputs),
        so a load issued before the wait would read stale values. Bits equal to the
        same chain launched without PDL."""
        gen = torch.Generator().manual_seed(T)
        x1 = torch.randn(T, 1536, generator=gen).to("cuda", torch.bfloat16)
        x2 = torch.randn(T, 512, generator=gen).to("cuda", torch.bfloat16)
        w1 = (1 + 0.1 * torch.randn(1536, generator=gen)).to("cuda", torch.bfloat16)
        w2 = (1 + 0.1 * torch.randn(512, generator=gen)).to("cuda", torch.bfloat16)

        def chain(pdl: bool, steps: int = 6):
            a1, a2, v1, v2 = x1.clone(), x2.clone(), w1.clone(), w2.clone()
            outs = []
            for _ in range(steps):
                y1, y2 = torch.empty_like(a1), torch.empty_like(a2)
                launch(a1, v1, 1e-6, a2, v2, 1e-6, y1, y2, pdl=pdl)
                # the next launch's rows are these outputs, its weights one of their rows
                outs += [y1, y2]
                a1, a2, v1, v2 = y1, y2, y1[0], y2[-1]
            return outs

        eager = chain(False)
        graph = torch.cuda.CUDAGraph()
        chain(True)  # compile outside the capture
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            captured = chain(True)
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(captured, eager):
            assert torch.equal(got, want)

    @pytest.mark.parametrize("T", [1, 7, 128, 4099])
    def test_launcher_fp32_weight(self, T: int) -> None:
        q, kv = self._pair(T, False, w_fp32=True)
        run_and_check(q, kv, 0, seed=T, bf16_casts_truncate=False, device="cuda")

    @pytest.mark.parametrize("T", [1, 7, 128, 4099])
    @pytest.mark.parametrize("weight_in_fp32", [False, True])
    def test_op(self, T: int, weight_in_fp32: bool) -> None:
        gen = torch.Generator().manual_seed(T)
        q = torch.randn(T, 1536, generator=gen).to("cuda", torch.bfloat16)
        kv = torch.randn(T, 576, generator=gen).to("cuda", torch.bfloat16)
        kv_c = kv[:, :512]
        wq = (torch.rand(1536, generator=gen) + 0.5).to("cuda", torch.bfloat16)
        wkv = (torch.rand(512, generator=gen) + 0.5).to("cuda", torch.bfloat16)
        kv_before = kv.clone()
        yq, ykv = torch.ops.k3fusion.dual_rms_norm(
            q, wq, 1e-6, kv_c, wkv, 1e-6, weight_in_fp32, weight_in_fp32
        )
        assert torch.equal(kv, kv_before)
        assert yq.shape == (T, 1536) and ykv.shape == (T, 512)
        assert_matches_reference(yq, q, wq, 1e-6, weight_in_fp32, bf16_casts_truncate=False, msg="q")
        assert_matches_reference(ykv, kv_c, wkv, 1e-6, weight_in_fp32, bf16_casts_truncate=False,
                                 msg="kv")
