"""Ulp-based comparison, and the tolerance each dual RMSNorm path is allowed.

Why ulps: the kernel and the reference do the same arithmetic up to fp32 summation order
and the rounding mode of the final casts, so their difference is a small number of units
in the last place (ulps) *of each element*, whatever its magnitude. A relative/absolute
``allclose`` would have to be loose enough for the smallest elements and then misses
real errors in the large ones.
"""

from __future__ import annotations

import torch

__all__ = ["ulp", "assert_close_ulps", "dual_norm_tolerance", "FP32_ULPS", "tail_tolerance",
           "latent_tail_exact_and_bound"]

_MANTISSA_BITS = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}
# Exponent of the smallest normal number; below it the spacing stays 2**(min - mantissa).
_MIN_NORMAL_EXP = {torch.float32: -126, torch.bfloat16: -126, torch.float16: -14}


def ulp(values: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Spacing of ``dtype`` at each element of ``values`` (float64).

    ``2**(floor(log2|v|) - mantissa_bits)``, floored at the subnormal spacing (so 0 and
    subnormals get the smallest step of the format). Exact: the exponent comes from frexp.
    """
    dtype = values.dtype if dtype is None else dtype
    if dtype not in _MANTISSA_BITS:
        raise TypeError(f"no ulp for {dtype}")
    v = values.detach().to(torch.float64).abs()
    _, exp = torch.frexp(v)  # v = m * 2**exp, m in [0.5, 1): floor(log2 v) = exp - 1
    floor_log2 = torch.where(v > 0, exp - 1, torch.full_like(exp, _MIN_NORMAL_EXP[dtype]))
    floor_log2 = floor_log2.clamp_min(_MIN_NORMAL_EXP[dtype])
    return torch.pow(2.0, (floor_log2 - _MANTISSA_BITS[dtype]).to(torch.float64))


def assert_close_ulps(
    actual: torch.Tensor,
    expected: torch.Tensor,
    ulps: float,
    *,
    ulp_dtype: torch.dtype | None = None,
    atol: float = 0.0,
    msg: str = "",
) -> None:
    """Assert ``|actual - expected| <= ulps * ulp(expected) + atol`` elementwise.

    ``ulp_dtype`` is the format whose spacing counts (default: ``expected.dtype``); pass
    the input dtype when the error comes from an intermediate rounding to it. NaNs must
    coincide, infinities must be equal. On failure the worst element is reported.
    """
    prefix = f"{msg}: " if msg else ""
    assert actual.shape == expected.shape, f"{prefix}shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{prefix}dtype {actual.dtype} != {expected.dtype}"
    if expected.numel() == 0:
        return
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    a_nan, e_nan = a.isnan(), e.isnan()
    if not torch.equal(a_nan, e_nan):
        idx = (a_nan != e_nan).nonzero()[0].tolist()
        raise AssertionError(
            f"{prefix}NaN mismatch at {idx}: actual {a[tuple(idx)].item()!r}, "
            f"expected {e[tuple(idx)].item()!r} ({int((a_nan != e_nan).sum())} elements)"
        )
    step = ulp(e, ulp_dtype or expected.dtype)
    diff = (a - e).abs()
    both_inf = a.isinf() & e.isinf() & (a == e)
    diff = torch.where(both_inf | e_nan, torch.zeros_like(diff), diff)
    allowed = ulps * step + atol
    bad = ~(diff <= allowed)  # catches NaN/inf diffs too
    if bad.any():
        in_ulps = torch.where(bad, diff / step, torch.zeros_like(diff))
        flat = int(in_ulps.reshape(-1).argmax())
        idx = tuple(torch.unravel_index(torch.tensor(flat), in_ulps.shape))
        idx = tuple(int(i) for i in idx)
        raise AssertionError(
            f"{prefix}{int(bad.sum())} of {bad.numel()} elements differ by more than {ulps} ulps "
            f"({ulp_dtype or expected.dtype}) + atol {atol}; worst at {list(idx)}: "
            f"actual {a[idx].item()!r}, expected {e[idx].item()!r}, "
            f"|diff| {diff[idx].item():.3e} = {in_ulps[idx].item():.3f} ulps"
        )


# fp32 outputs (fp32 input): kernel and reference agree up to the order of the fp32
# sum of squares (Triton's tree reduction vs torch's vectorized sum), the mean's division,
# the rsqrt (1/sqrt: two roundings, <= 1.5 ulp, on both sides) and the 1-2 product
# roundings -- each a fraction of an ulp to a couple of ulps, mostly shared by a whole
# row through 1/rms. Measured: <= 4 ulps for 99.99% of elements and at most 6 over
# ~10^5 random rows (N <= 300, eps 1e-6..0.1, |x| ~ 2**-6..2**6), even at N = 17, so the
# sum order is not the main term. 8 leaves that tail some room while any real error (a
# wrong eps, weight, row or stride) is off by thousands of ulps.
FP32_ULPS = 8.0


def dual_norm_tolerance(
    x_dtype: torch.dtype,
    w_dtype: torch.dtype,
    weight_in_fp32: bool,
    *,
    bf16_casts_truncate: bool,
) -> tuple[float, torch.dtype]:
    """``(ulps, ulp_dtype)`` allowed between a kernel's RMSNorm output and the reference.

    ``bf16_casts_truncate``: Triton's CPU interpreter converts fp32 -> bf16 by truncation
    (toward zero) where the GPU and torch round to nearest even; fp16 rounds to nearest
    in both. Let ``u`` be the ulp of the value being rounded. The fp32 values before any
    cast agree to a few fp32 ulps (see FP32_ULPS), i.e. ~2**-16 of a bf16 ulp.

    * fp32 input: every output is fp32 -> FP32_ULPS fp32 ulps.
    * weight-in-fp32 (output in the 16-bit input dtype): one rounding of nearly equal fp32
      values. RNE vs RNE differs only when a rounding boundary lies between them: <= 1u.
      Truncate vs RNE: |trunc(v') - rne(v)| < u + u/2 + noise, a multiple of u: <= 1u.
    * cast-then-weight, same 16-bit output dtype: the normalized value ``q`` is rounded
      to the input dtype (<= 1 ulp(q) apart, as above), then ``q * w`` is rounded again.
      ``|q - q'| * |w| <= ulp(q) * |w| < 2 ulp(q * w)`` (ulp(q)/|q| can be twice
      ulp(qw)/|qw|). Both rounded to nearest: a multiple of u below 2u + u -> <= 2u.
      Truncate vs RNE: < 2u + u + u/2 -> <= 3u.
    * cast-then-weight, fp32 output (16-bit input, fp32 weight): ``q`` differs by <= 1
      ulp(q) in the input dtype, so the fp32 products differ by < 2 input-dtype ulps of
      the output, plus two fp32 product roundings (2**-16 of a bf16 ulp each, 2**-13 for
      fp16): counted in input-dtype ulps, 2 + 2**-12.

    Measured in the interpreter over ~3000 random members: 3 (bf16 cast-then-weight),
    2 (fp16 cast-then-weight), 1 (weight-in-fp32) and 1.98 / 1.84 (fp32 output from
    bf16 / fp16 input) ulps: every bound is attained, none can be tightened.
    """
    low = (torch.bfloat16, torch.float16)
    if x_dtype == torch.float32:
        return FP32_ULPS, torch.float32
    if x_dtype not in low:
        raise TypeError(f"no tolerance for {x_dtype}")
    truncating = bf16_casts_truncate and x_dtype == torch.bfloat16
    if weight_in_fp32:
        return 1.0, x_dtype
    out_dtype = torch.promote_types(x_dtype, w_dtype)
    if out_dtype == x_dtype:
        return (3.0 if truncating else 2.0), x_dtype
    return 2.0 + 2.0**-12, x_dtype


def assert_on_input_grid(y: torch.Tensor, w: torch.Tensor, x_dtype: torch.dtype, msg: str = "") -> None:
    """Cast-then-weight with an fp32 output: ``y = fp32(q * w)`` where ``q`` is the
    normalized row *rounded to the input dtype*. So ``y / w`` must be a value of
    ``x_dtype`` up to the fp32 product rounding (2**-24 relative, checked at 2**-22).

    This is what tells the two formulations apart: skipping the rounding leaves ``y / w``
    anywhere between grid points (up to half an input-dtype ulp, 2**-9 relative for bf16),
    a difference the ulp tolerance above cannot see.
    """
    prefix = f"{msg}: " if msg else ""
    y64 = y.detach().to("cpu", torch.float64)
    w64 = w.detach().to("cpu", torch.float64).expand_as(y64)
    keep = (w64 != 0) & (y64 != 0)
    q = y64[keep] / w64[keep]
    snapped = q.to(x_dtype).to(torch.float64)
    rel = ((q - snapped).abs() / q.abs()) if q.numel() else q
    if rel.numel() and not bool((rel <= 2.0**-22).all()):
        i = int(rel.argmax())
        raise AssertionError(
            f"{prefix}y / w is not on the {x_dtype} grid (the normalized value was not rounded "
            f"to the input dtype before weighting): {q[i].item()!r} vs nearest "
            f"{snapped[i].item()!r}, relative {rel[i].item():.3e}"
        )


def assert_matches_reference(
    y: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    eps: float,
    weight_in_fp32: bool,
    *,
    bf16_casts_truncate: bool,
    msg: str = "",
    norm_dtype: torch.dtype | None = None,
) -> None:
    """``y`` (a kernel's output for ``x``) against ``k3fusion.reference.rms_norm``.

    ``norm_dtype``: the cast-then-weight rounding dtype when it is not ``x``'s; the
    tolerance is then that of an input of that dtype (the rounding it adds is the same)."""
    from k3fusion import reference

    expected = reference.rms_norm(x, w, eps, weight_in_fp32, norm_dtype)
    rounded = x.dtype if norm_dtype is None else norm_dtype
    ulps, ulp_dtype = dual_norm_tolerance(
        rounded, w.dtype, weight_in_fp32, bf16_casts_truncate=bf16_casts_truncate
    )
    assert y.device == x.device, f"{msg}: output on {y.device}, input on {x.device}"
    assert_close_ulps(y, expected, ulps, ulp_dtype=ulp_dtype, msg=msg)
    if not weight_in_fp32 and rounded != torch.float32 and y.dtype == torch.float32:
        assert_on_input_grid(y, w, rounded, msg=msg)


def latent_tail_exact_and_bound(xs: torch.Tensor, ss: torch.Tensor, norm_w: torch.Tensor,
                                up_w: torch.Tensor, eps: float, unit_roundoff: float):
    """The exact latent-MoE tail of every rank's partials and the per-element bound any tier
    must meet (derived in ``test_moe_tail_tiers``'s module docstring).

    ``xs [tp, ..., L]`` / ``ss [tp, ..., H]``: the ranks' routed and shared partials;
    everything is taken in fp64. Returns ``(exact, bound)``, both ``[..., H]``.
    """
    xs, ss = xs.double(), ss.double()
    w, up = norm_w.double(), up_w.double()
    x, s = xs.sum(0), ss.sum(0)
    inv = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    h = x * inv * w
    tp, latent = xs.shape[0], xs.shape[-1]
    carried = (h.abs() + inv * w.abs() * xs.abs().sum(0)) @ up.abs().T
    bound = ((2 * tp + 8) * unit_roundoff * (ss.abs().sum(0) + carried)
             + latent * 2.0**-24 * (h.abs() @ up.abs().T))
    return s + h @ up.T, bound


def tail_tolerance(x, s, w, eps, up, weight_in_fp32, *, truncating: bool, norm_dtype=None,
                   scaled_after: bool = False):
    """``(reference, per-element bound)`` for the kernel's output (float64, on the CPU).

    Kernel: ``K = rnd(y')``, ``y' = s + P'`` -- one rounding of the fp32 sum of the shared
    value and the fp32-accumulated GEMM ``P'`` of its own normalized tile ``h'``.
    Reference (the spec): ``R = rne(s + rne(P))`` -- the GEMM output ``P`` of ``h`` is
    rounded to the output dtype first, then the sum. With ``ulp`` that dtype's spacing,

        |y' - R| <= ulp(R)/2 + E,   E = ulp(rne(P))/2 + |P' - P|

    (the reference's two roundings), where ``|P' - P|`` is at most

    * the normalized tile: ``|h' - h| <= c ulp(h)`` per element, ``c`` the dual-norm
      kernel's bound for the same formulation (``dual_norm_tolerance``: 0 or 1 ulp on a
      GPU, where both round to nearest from fp32 values a few fp32 ulps apart; up to 3
      where the interpreter truncates bf16), carried through the GEMM as
      ``(c ulp(h)) @ |up_w|^T``;
    * fp32 accumulation in different orders (the kernel's tile order vs the reference
      GEMM's; products exact for 16-bit operands, one fp32 rounding each for fp32):
      ``L 2^-24 (|h| @ |up_w|^T)`` per side, and the kernel's fp32 ``s + acc``: together
      ``(2L + 1) 2^-24 (|s| + |h| @ |up_w|^T)``.

    The kernel's own rounding: ``|K - y'| <= r ulp(y')`` (``r`` = 1/2 rounding to
    nearest, 1 where the interpreter truncates bf16), and ``ulp(y') <= 2 max(ulp(R),
    ulp(|y' - R|)) <= 2 ulp(R) + 2^(1-m) |y' - R|`` (``m`` mantissa bits). So

        |K - R| <= (2r + (1 + d)/2) ulp(R) + (1 + d) E,   d = 2^(1-m) r,

    i.e. about 1.5 output ulps (2.5 truncating) plus half an ulp of the GEMM output: a
    bf16 rounding of the output explains it; the other terms are ~2^-16 of an output ulp
    on a GPU, and the tile term is what the interpreter's truncation costs. Measured
    (interpreter, 1200 random cases): up to ~0.97 of the bound with bf16 inputs (the
    tile term is nearly attained, as the dual norm's bound is), 0.66 fp16, 0.17 fp32. A
    missing or doubled shared add, a wrong column, eps, split or weight is off by far
    more (and the formulation is pinned exactly by the selection-matrix test below).

    ``scaled_after``: the kernel's GEMM input is ``h' = r * rnd(x * w)`` (``rms_in_loop``:
    1/rms ``r`` applied after the dot) instead of the reference's rounded normalized row.
    In 16-bit, ``rnd(x * w)`` is off by at most ``ulp(x w)/2`` and ``r ulp(x w) <= 2
    ulp(h)``, the reference's own one or two roundings at most ``1.5 ulp(h)``: ``c = 3``
    (6 where the interpreter truncates, every rounding error doubled). An fp32 GEMM input
    is not rounded there, so the norm kernels' bound holds.
    """
    # The spec evaluated on the CPU (fp32-accumulated GEMMs; cuBLAS may reduce bf16
    # partial sums in bf16, which this bound does not cover).
    from k3fusion import reference

    x, s, w, up = (t.cpu() for t in (x, s, w, up))
    h = reference.rms_norm(x, w, eps, weight_in_fp32, norm_dtype)
    # reference.latent_moe_tail's ``s + h @ up.T`` with the GEMM on fp32 operands (exact for
    # 16-bit values, fp32-accumulated, rounded to its dtype): torch 2.13's CPU bf16 GEMM
    # turns a row next to a NaN row NaN as well (17 rows: rows 7 and 8 for a NaN row 8).
    p = (h.float() @ up.float().T).to(torch.promote_types(h.dtype, up.dtype))
    ref = s + p
    # A norm_dtype cast rounds the normalized row as a norm of that dtype would.
    c_h, h_ulp_dtype = dual_norm_tolerance(norm_dtype or x.dtype, w.dtype, weight_in_fp32,
                                           bf16_casts_truncate=truncating)
    if scaled_after and up.dtype != torch.float32:
        c_h, h_ulp_dtype = (6.0 if truncating else 3.0), up.dtype
    cpu = dict(device="cpu", dtype=torch.float64)
    up_abs = up.to(**cpu).abs()
    mag = h.to(**cpu).abs() @ up_abs.T
    tile = (c_h * ulp(h, h_ulp_dtype)) @ up_abs.T
    accumulation = (2 * x.shape[-1] + 1) * 2.0**-24 * (mag + s.to(**cpu).abs())
    e = 0.5 * ulp(p) + tile + accumulation
    r = 1.0 if truncating and up.dtype == torch.bfloat16 else 0.5
    d = 2.0 ** (1 - _MANTISSA_BITS[up.dtype]) * r
    bound = (2 * r + (1 + d) / 2) * ulp(ref) + (1 + d) * e
    return ref, bound
