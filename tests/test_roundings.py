"""Every rounding the spec (``k3fusion.reference``) fixes, checked bit for bit in each kernel.

The property tests compare kernels with the reference within ulp bounds, and those bounds
cannot see a missing or an extra 16-bit rounding (it moves an element by at most an ulp,
which the bound must allow for fp32 summation-order noise). So each rounding gets a test
that compares *bits* with the spec's roundings emulated on the reference's own fp32 values:

=================================  ==========================================  =====================
rounding (reference.py)            where                                        exact test
=================================  ==========================================  =====================
cast-then-weight: normalized row   rms_norm, dual_rms_norm, fused tail tile,    here (16-bit weight),
rounded to x.dtype, then weighted  AttnRes out norm                             grid checks for fp32
                                                                                weights (_tolerances),
                                                                                test_attn_res_kernel
``norm_dtype``: the same rounding  rms_norm, fused tail tile                    here; grid check in
to norm_dtype                                                                   test_rms_norm_kernel
weight-in-fp32: one rounding at    rms_norm, dual_rms_norm, fused tail tile,    here;
the end                            AttnRes out norm                             test_attn_res_kernel
AttnRes new prefix rounded before  attn_res kernel                              test_attn_res_kernel
it is a source                                                                  (rounded prefix)
AttnRes mix rounded before the     attn_res kernel                              test_attn_res_kernel
output norm                                                                     (bit for bit)
tail: GEMM output rounded, then    unfused tiers (CPU: the reference's ops)     test_moe_tail_pass /
the shared add                                                                  test_moe_tail_tiers
                                                                                (torch.equal); the
                                                                                fused kernel rounds
                                                                                once by design (its
                                                                                bound)
=================================  ==========================================  =====================

Kernel and reference agree on the fp32 normalized values up to a few fp32 ulps (their sums
run in different orders), so a 16-bit rounding of them may differ where such noise straddles
a rounding boundary: rare (well under 1% of elements, 99% required). Each test also checks
that the wrong formulation is far from the kernel's bits (the test can fail): one rounding
more or fewer moves 15-50% of the elements.
"""

from __future__ import annotations

import pytest
import torch

from k3fusion.kernels.moe_tail import latent_moe_tail_fused as tail_launch
from k3fusion.kernels.qkv_rmsnorm import dual_rms_norm as dual_launch
from k3fusion.kernels.rms_norm import rms_norm as norm_launch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Triton's interpreter converts fp32 -> bf16 by truncation (toward zero).
TRUNCATE = DEVICE == "cpu"
EPS = 1e-6
EXACT = 0.99   # fraction of elements bit-identical to the spec's roundings
WRONG = 0.90   # a wrong formulation agrees with the kernel on fewer than this


def round_to(x32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x32`` rounded to ``dtype`` as the kernel rounds: to nearest even, or for bf16 in
    the interpreter toward zero (drop the low 16 bits; exact for normal numbers)."""
    if TRUNCATE and dtype == torch.bfloat16:
        return (x32.contiguous().view(torch.int32) & ~0xFFFF).view(torch.float32).to(dtype)
    return x32.to(dtype)


def spec(x, w, weight_in_fp32: bool, norm_dtype=None, *, rounds_normed: bool | None = None):
    """The reference's norm with its roundings emulated as the kernel rounds;
    ``rounds_normed`` overrides whether the normalized row is rounded before weighting
    (the wrong formulation for each form)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)
    out_dtype = x.dtype if weight_in_fp32 else torch.promote_types(norm_dtype or x.dtype, w.dtype)
    if rounds_normed is None:
        rounds_normed = not weight_in_fp32
    if rounds_normed:
        normed = round_to(normed, norm_dtype or x.dtype).float()
    y = normed * w.float()
    return y if out_dtype == torch.float32 else round_to(y, out_dtype)


def exact_fraction(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    return float((a.cpu() == b.cpu()).double().mean())


def inputs(dtype, w_dtype, seed, rows=16, cols=96):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, cols, generator=g) * 3).to(DEVICE, dtype)
    w = (1 + 0.3 * torch.randn(cols, generator=g)).to(DEVICE, w_dtype)
    return x, w


# (x dtype, weight dtype, weight_in_fp32, norm_dtype)
FORMS = {
    "bf16-cast-then-weight": (torch.bfloat16, torch.bfloat16, False, None),
    "fp16-cast-then-weight": (torch.float16, torch.float16, False, None),
    "bf16-weight-in-fp32": (torch.bfloat16, torch.bfloat16, True, None),
    "fp16-weight-in-fp32-fp32w": (torch.float16, torch.float32, True, None),
    "fp32-norm-dtype-bf16": (torch.float32, torch.bfloat16, False, torch.bfloat16),
    "fp32-norm-dtype-fp16": (torch.float32, torch.float16, False, torch.float16),
}


def check(y, x, w, weight_in_fp32, norm_dtype):
    want = spec(x, w, weight_in_fp32, norm_dtype)
    got = exact_fraction(y, want)
    assert got >= EXACT, f"{got:.4f} of the elements are the spec's bits"
    wrong = spec(x, w, weight_in_fp32, norm_dtype, rounds_normed=weight_in_fp32)
    assert exact_fraction(y, wrong) < WRONG, "the other formulation is not told apart"


@pytest.mark.parametrize("form", FORMS)
def test_rms_norm_kernel_roundings(form):
    x_dtype, w_dtype, weight_in_fp32, norm_dtype = FORMS[form]
    x, w = inputs(x_dtype, w_dtype, 1)
    y = torch.empty_like(spec(x, w, weight_in_fp32, norm_dtype))
    norm_launch(x, w, EPS, y, weight_in_fp32, norm_dtype)
    check(y, x, w, weight_in_fp32, norm_dtype)


@pytest.mark.parametrize("form", [f for f, v in FORMS.items() if v[3] is None])
def test_dual_rms_norm_kernel_roundings(form):
    """Both members of the pair, one with each formulation (the flags are per member)."""
    x_dtype, w_dtype, weight_in_fp32, _ = FORMS[form]
    x1, w1 = inputs(x_dtype, w_dtype, 2, rows=5, cols=80)
    x2, w2 = inputs(x_dtype, w_dtype, 3, rows=7, cols=48)
    y1 = torch.empty_like(spec(x1, w1, weight_in_fp32))
    y2 = torch.empty_like(spec(x2, w2, not weight_in_fp32))
    dual_launch(x1, w1, EPS, x2, w2, EPS, y1, y2, weight_in_fp32, not weight_in_fp32)
    check(y1, x1, w1, weight_in_fp32, None)
    check(y2, x2, w2, not weight_in_fp32, None)


@pytest.mark.parametrize("form", [f for f, v in FORMS.items()
                                  if v[1] != torch.float32])  # the GEMM takes one dtype
def test_fused_tail_tile_roundings(form):
    """The fused tail's normalized tile: ``up_w`` a 0/1 selection and ``shared`` 0 make
    the GEMM and the add exact, so the output is the tile itself (in the GEMM dtype)."""
    x_dtype, w_dtype, weight_in_fp32, norm_dtype = FORMS[form]
    x, w = inputs(x_dtype, w_dtype, 4, rows=5, cols=64)
    out_dtype = spec(x, w, weight_in_fp32, norm_dtype).dtype
    hidden = 80
    up = torch.zeros(hidden, 64, dtype=out_dtype, device=DEVICE)
    up[torch.arange(hidden), torch.arange(hidden) % 64] = 1
    s = torch.zeros(5, hidden, dtype=out_dtype, device=DEVICE)
    # the forms that round the tile as the spec does (the bf16 default at 2-16 rows,
    # rms_in_loop, scales after the dot: test_moe_tail_kernel's own bound)
    for opts in ({"normed_rows": True}, {"normed_rows": False}):
        y = tail_launch(x, s, w, EPS, up, weight_in_fp32=weight_in_fp32, norm_dtype=norm_dtype,
                        **opts)
        assert torch.equal(y, y[:, torch.arange(hidden) % 64])
        check(y[:, :64], x, w, weight_in_fp32, norm_dtype)
