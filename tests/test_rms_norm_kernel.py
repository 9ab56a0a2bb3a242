"""The single RMSNorm Triton kernel (the latent-MoE tail's unfused tiers), through its
launcher, against ``k3fusion.reference.rms_norm``.

Same property test and tolerances as the dual kernel's (``test_dual_rms_norm_kernel``, whose
input strategy it shares): interpreted on CPU, compiled on a CUDA machine, plus the tail's
real width (L = 3584) on the GPU.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from _tolerances import assert_matches_reference, assert_on_input_grid, dual_norm_tolerance, \
    assert_close_ulps
from k3fusion import reference
from k3fusion.kernels.rms_norm import pick_launch_shape
from k3fusion.kernels.rms_norm import rms_norm as launch
from test_dual_rms_norm_kernel import DEVICE, INTERPRETED, Member, make_inputs, members, \
    poisoned_output


def run_and_check(m: Member, rows_per_program: int, seed: int, *,
                  bf16_casts_truncate: bool = INTERPRETED, device: str = DEVICE) -> None:
    gen = torch.Generator().manual_seed(seed)
    xp, x, w = make_inputs(m, gen, device)
    saved = (xp.clone(), w.clone())
    yp, y = poisoned_output(m, device)

    launch(x, w, m.eps, y, m.weight_in_fp32, rows_per_program=rows_per_program)

    assert torch.equal(saved[0], xp) and torch.equal(saved[1], w), "an input was modified"
    assert not y.isnan().any(), f"{int(y.isnan().sum())} elements never written"
    assert yp[:, m.width:].isnan().all(), "columns beside the row view were written"
    assert_matches_reference(y, x, w, m.eps, m.weight_in_fp32,
                             bf16_casts_truncate=bf16_casts_truncate, msg=str(m))


_LATENT = Member(rows=5, width=112, pad=0, out_pad=0, x_dtype=torch.bfloat16, w_fp32=False,
                 weight_in_fp32=False, eps=1e-6, log2_scale=0, zero_row=False)


@given(m=members(), rows_per_program=st.sampled_from([0, 1, 2, 4]),
       seed=st.integers(0, 2**31 - 1))
# The tail's latent scaled down (112 = 3584 / 32, not a power of two), one row, no rows,
# a strided view with an all-zero row and fp32 weight (fp32 output).
@example(m=_LATENT, rows_per_program=0, seed=0)
@example(m=Member(1, 112, 0, 0, torch.bfloat16, False, True, 1e-6, 0, False),
         rows_per_program=0, seed=1)
@example(m=Member(0, 112, 0, 0, torch.float16, False, False, 1e-6, 0, False),
         rows_per_program=1, seed=2)
@example(m=Member(67, 129, 64, 8, torch.bfloat16, True, False, 0.1, -6, True),
         rows_per_program=4, seed=3)
def test_kernel_matches_reference(m: Member, rows_per_program: int, seed: int) -> None:
    run_and_check(m, rows_per_program, seed)


def test_norm_dtype_rounds_before_weighting() -> None:
    """An fp32 input normalized with ``norm_dtype=bf16`` and an fp32 weight: ``y / w`` is on
    the bf16 grid (without the cast it is not: the check fails on the fp32 form)."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(6, 100, generator=gen).to(DEVICE)
    w = (torch.rand(100, generator=gen) + 0.5).to(DEVICE)
    y = torch.empty_like(x)
    launch(x, w, 1e-6, y, norm_dtype=torch.bfloat16)
    assert_on_input_grid(y, w, torch.bfloat16)
    want = reference.rms_norm(x, w, 1e-6, False, torch.bfloat16)
    ulps, ulp_dtype = dual_norm_tolerance(torch.bfloat16, torch.float32, False,
                                          bf16_casts_truncate=INTERPRETED)
    assert_close_ulps(y, want, ulps, ulp_dtype=ulp_dtype)
    plain = torch.empty_like(x)
    launch(x, w, 1e-6, plain)
    with pytest.raises(AssertionError, match="grid"):
        assert_on_input_grid(plain, w, torch.bfloat16)


def test_bad_launch_arguments() -> None:
    x = torch.randn(3, 8, device=DEVICE)
    w = torch.ones(8, device=DEVICE)
    with pytest.raises(ValueError, match="one shape"):
        launch(x, w, 1e-6, torch.empty(3, 9, device=DEVICE))
    with pytest.raises(ValueError, match="cast-then-weight form only"):
        launch(x, w, 1e-6, torch.empty_like(x), True, torch.bfloat16)
    with pytest.raises(TypeError, match="norm_dtype"):
        launch(x, w, 1e-6, torch.empty_like(x), False, torch.float64)
    with pytest.raises(ValueError, match="one device"):
        launch(x, torch.ones(8, device="meta"), 1e-6, torch.empty_like(x))


def test_launch_shape() -> None:
    # the tail's latent (3584 -> 4096 columns): a row per program, 4 warps
    assert pick_launch_shape(4096) == (1, 4)
    # narrow rows are grouped into ~2048-element tiles
    assert pick_launch_shape(128) == (16, 2)
    assert pick_launch_shape(512) == (4, 2)
    assert pick_launch_shape(4096, rows_per_program=2, num_warps=8) == (2, 8)


@pytest.mark.cuda
@pytest.mark.parametrize("T", [1, 17, 64, 4099])
@pytest.mark.parametrize("weight_in_fp32", [False, True])
def test_tail_latent_width_on_gpu(T: int, weight_in_fp32: bool) -> None:
    """The tail's latent (3584 wide, bf16) at decode and prefill row counts, rows read
    through a stride (the first 3584 columns of 3600-wide rows)."""
    m = Member(T, 3584, 16, 8, torch.bfloat16, False, weight_in_fp32, 1e-6, 0, T > 1)
    run_and_check(m, 0, seed=T, bf16_casts_truncate=False, device="cuda")
