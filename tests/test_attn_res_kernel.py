"""The AttnRes Triton kernel, through its launcher, against ``k3fusion.reference.attn_res``.

On a CPU-only machine the kernel runs in Triton's interpreter (``tests/conftest.py`` sets
``TRITON_INTERPRET=1`` before k3fusion is imported); on a CUDA machine the same property
tests run on the GPU. ``TestAttnResCuda`` adds Kimi-K3's sizes (GPU only).

How a launch is checked (:func:`check_launch`), stage by stage, each against the spec:

1. the prefix update: bit-exact. ``(prefix.float() + delta.float())`` is one fp32 add on
   both sides, then one rounding: to nearest even on the GPU and in torch, toward zero in
   the interpreter for bf16 (so the expected value is rounded the same way);
2. the bank: the written slot equals the kernel's own new prefix bit for bit; every other
   slot, the padding beside the rows and the slots past ``num_blocks`` (poisoned with NaN,
   which also proves they are never read) are bit-identical afterwards;
3. the mix: the kernel's rounded mix against the reference run on the kernel's *own*
   updated prefix and bank (so stage 1's rounding mode does not leak in), within
   :func:`mix_tolerance`;
4. the output norm: against ``reference.rms_norm`` of the kernel's own rounded mix (from
   a second launch without the norm), within ``_tolerances.dual_norm_tolerance``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from _ptx import assert_pdl_order, hopper_ptx, hopper_ptxs
from _tolerances import (assert_close_ulps, assert_matches_reference, dual_norm_tolerance,
                         ulp)
from k3fusion import reference
from k3fusion.kernels._launch import kernels_are_interpreted
from k3fusion.kernels.attn_res import (
    DECODE_SOURCES_PER_TILE, EARLY_TILE_MAX_TOKENS, PREFILL_SOURCES_PER_TILE,
    PREFILL_TOKENS, PREFILL_LOOP_STAGES,
    SPLIT_CHUNK,
    SPLIT_MAX_SOURCES,
    SPLIT_MAX_TOKENS,
    SPLIT_NUM_WARPS,
    _attn_res_kernel,
    _attn_res_split_kernel,
    pick_launch_shape,
)
from k3fusion.kernels.attn_res import attn_res as launch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = DEVICE == "cpu"  # fp32 -> bf16 casts truncate in the interpreter

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FP32_EPS = 2.0**-24  # unit roundoff of fp32


# --------------------------------------------------------------- tolerances


def round_to(x32: torch.Tensor, dtype: torch.dtype, *, truncate: bool) -> torch.Tensor:
    """``x32`` (fp32) rounded to ``dtype`` as the kernel does: to nearest even, or for bf16
    in Triton's interpreter toward zero (drop the low 16 bits; exact for normal numbers)."""
    if truncate and dtype == torch.bfloat16:
        bits = x32.contiguous().view(torch.int32) & ~0xFFFF
        return bits.view(torch.float32).to(torch.bfloat16)  # exact: low bits are zero
    return x32.to(dtype)


def mix_atol(prefix: torch.Tensor, blocks: torch.Tensor, num_blocks: int, norm_w: torch.Tensor,
             proj_w: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-element absolute bound (float64, ``[T, H]``) on how far two fp32 evaluations of
    the unrounded mix ``sum_s softmax(logit)_s * v_s`` may drift apart.

    With ``A_s = inv_rms_s * sum_h |v_sh * g_h|`` (``g = norm_w * proj_w``) and
    ``M_h = sum_s w_s |v_sh|``:

    * a logit is a dot product that may cancel, so its fp32 error is absolute, about
      ``u * A_s`` (u = 2**-24; the sum's rounding errors, the mean and the rsqrt) -- not
      relative to the logit;
    * a softmax weight moves by ``w_s * (dl_s - sum_k w_k dl_k)``: relatively at most
      ``2 max|dl|`` per evaluation, ``4 u max A`` for two; the GPU's ``exp`` (``ex2.approx``
      of ``x * log2 e``) adds ``u |l_s - m| <= 2 u max A``: ``6 u max A`` in all;
    * the weighted sum, the online rescaling and the final division: ``S + 2`` roundings
      of at most ``u M`` per evaluation: ``(2 S + 4) u M``.

    So ``|mix' - mix| <= u * M * (6 max_s A_s + 2 S + 4)``. It matters only where the mix
    cancels (``|mix| << M``) or for fp32 outputs; for 16-bit outputs it is ~2**-13 of an
    ulp otherwise. Measured in the interpreter (kernel vs reference, fp32): at most 0.3 of
    it over ~900 random tokens (H <= 300, 1-9 sources, eps 1e-6..0.1, |v| ~ 2**-6..2**6);
    the worst logit term is the GPU-only exp one, hence the margin.
    """
    src = torch.cat([blocks[:, :num_blocks], prefix.unsqueeze(1)], dim=1).double()
    g = norm_w.double() * proj_w.double()
    inv_rms = torch.rsqrt(src.pow(2).mean(-1) + eps)
    logits = inv_rms * (src * g).sum(-1)
    weights = torch.softmax(logits, dim=-1)
    a_max = (inv_rms * (src * g).abs().sum(-1)).amax(-1, keepdim=True)
    m = (weights.unsqueeze(-1) * src.abs()).sum(1)
    n_sources = num_blocks + 1
    return FP32_EPS * m * (6 * a_max + 2 * n_sources + 4)


def mix_ulps(dtype: torch.dtype, *, bf16_casts_truncate: bool) -> float:
    """Ulps (of the prefix dtype) allowed between two roundings of nearly equal mixes.

    fp32: no rounding, 0 (all the drift is in :func:`mix_atol`). 16-bit, both to nearest:
    ``|rne(a) - rne(b)| <= |a - b| + 1 ulp``. Truncation vs to nearest (bf16 in the
    interpreter): ``< |a - b| + 1.5 ulp``.
    """
    if dtype == torch.float32:
        return 0.0
    return 1.5 if (bf16_casts_truncate and dtype == torch.bfloat16) else 1.0


def assert_mix_close(actual: torch.Tensor, expected: torch.Tensor, atol: torch.Tensor,
                     ulps: float, msg: str = "") -> None:
    """``|actual - expected| <= ulps * ulp(expected) + atol`` elementwise (no NaNs)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, msg
    if expected.numel() == 0:
        return
    a = actual.detach().to(torch.float64)  # on its device: Kimi-K3 sizes are big
    e = expected.detach().to(torch.float64)
    assert not a.isnan().any(), f"{msg}: NaN in the kernel's mix"
    step = ulp(e, expected.dtype)
    allowed = ulps * step + atol.to(torch.float64)
    diff = (a - e).abs()
    bad = ~(diff <= allowed)
    if bad.any():
        ratio = torch.where(bad, diff / allowed.clamp_min(1e-300), torch.zeros_like(diff))
        i = tuple(int(k) for k in torch.unravel_index(ratio.flatten().argmax(), ratio.shape))
        raise AssertionError(
            f"{msg}: {int(bad.sum())} of {bad.numel()} mix elements off; at {list(i)}: actual "
            f"{a[i].item()!r}, expected {e[i].item()!r}, |diff| {diff[i].item():.3e} > allowed "
            f"{allowed[i].item():.3e} ({ulps} ulp + atol {atol[i].item():.3e})"
        )


# --------------------------------------------------------------- generated inputs

#: Bank layouts. "rows": a [T, NBmax, H(+pad)] tensor; "stacked": blocks stacked along
#: dim 0 ([NBmax, T, H(+pad)]) and transposed, so the token stride is H(+pad) and the
#: block stride T * (H + pad); "slice": slots [1, 1 + NBmax) of a wider bank.
BANKS = ("rows", "stacked", "slice")


@dataclass(frozen=True)
class Case:
    T: int
    H: int
    nb_max: int
    num_blocks: int
    write_idx: int       # -1: no block write
    dtype: torch.dtype
    has_delta: bool
    out_norm: str        # "none", "cast" (cast-then-weight), "fp32w" (weight-in-fp32)
    w_fp32: bool         # weights fp32 (else the prefix dtype)
    bank: str
    pad: int             # extra columns beside every row (prefix, delta, bank, out)
    inplace: bool        # prefix_out is prefix (else a new buffer)
    eps: float
    out_eps: float
    log2_scale: int      # inputs ~ N(0, 1) * 2**log2_scale
    sources_per_tile: int = 0  # > 0: the row kernel with this tile height
    chunk: int = 0             # > 0: the split kernel with this chunk (else pick_launch_shape)
    launch: tuple = ()         # launcher keyword arguments as (name, value) pairs: all of them

    @property
    def shape(self) -> dict:
        """The launcher's shape arguments for this case."""
        if self.launch:
            return dict(self.launch)
        if self.chunk:
            return {"kind": "split", "chunk": self.chunk}
        if self.sources_per_tile:
            return {"kind": "row", "sources_per_tile": self.sources_per_tile}
        return {}

    @property
    def w_dtype(self) -> torch.dtype:
        return torch.float32 if self.w_fp32 else self.dtype

    @property
    def out_dtype(self) -> torch.dtype:
        if self.out_norm == "none":
            return self.dtype
        return reference.rms_norm_out_dtype(self.dtype, self.w_dtype, self.out_norm == "fp32w")


@dataclass
class Inputs:
    """Tensors of one case: row views into NaN-padded parents (the parents are what the
    bit-identity checks compare)."""

    prefix_parent: torch.Tensor
    prefix: torch.Tensor
    delta: torch.Tensor | None
    bank_parent: torch.Tensor
    blocks: torch.Tensor          # [T, NBmax, H] view into bank_parent
    norm_w: torch.Tensor
    proj_w: torch.Tensor
    out_norm_w: torch.Tensor | None


def bank_view(c: Case, parent: torch.Tensor) -> torch.Tensor:
    """The ``[T, NBmax, H]`` blocks view of a bank parent of layout ``c.bank``."""
    view = {"rows": lambda p: p, "stacked": lambda p: p.transpose(0, 1),
            "slice": lambda p: p[:, 1 : 1 + c.nb_max]}[c.bank](parent)
    return view[..., : c.H]


def make_inputs(c: Case, seed: int, device: str = DEVICE) -> Inputs:
    """Generated on ``device`` (Kimi-K3 sizes would take seconds on the CPU)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    scale = 2.0**c.log2_scale
    nan = float("nan")

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device).mul_(scale)

    def rand(n):
        return torch.rand(n, generator=gen, device=device)

    def rows(n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        parent = torch.full((n_rows, c.H + c.pad), nan, device=device, dtype=c.dtype)
        parent[:, : c.H] = randn(n_rows, c.H)
        return parent, parent[:, : c.H]

    prefix_parent, prefix = rows(c.T)
    delta = rows(c.T)[1] if c.has_delta else None
    shape = {"rows": (c.T, c.nb_max), "stacked": (c.nb_max, c.T),
             "slice": (c.T, c.nb_max + 2)}[c.bank]
    bank_parent = torch.full((*shape, c.H + c.pad), nan, device=device, dtype=c.dtype)
    blocks = bank_view(c, bank_parent)
    # Live sources get data; slots >= num_blocks (the write slot included) stay NaN.
    blocks[:, : c.num_blocks] = randn(c.T, c.num_blocks, c.H)
    w_dtype = c.w_dtype
    norm_w = (rand(c.H) * 2).to(w_dtype)
    proj_w = (randn(c.H) / scale / max(c.H, 1) ** 0.5 * 4).to(w_dtype)
    out_norm_w = None
    if c.out_norm != "none":
        out_norm_w = (rand(c.H) * 4 - 2).to(w_dtype)
    return Inputs(prefix_parent, prefix, delta, bank_parent, blocks, norm_w, proj_w, out_norm_w)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits (NaN-safe equality: ``torch.equal(bits(a), bits(b))``)."""
    if not t.dtype.is_floating_point:
        return t
    int_dtype = {torch.float64: torch.int64, torch.float32: torch.int32,
                 torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype]
    return t.contiguous().view(int_dtype)


def expected_new_prefix(prefix: torch.Tensor, delta: torch.Tensor | None, *,
                        bf16_casts_truncate: bool) -> torch.Tensor:
    """The spec's updated prefix, rounded the way the kernel under test rounds."""
    if delta is None:
        return prefix.clone()
    return round_to(prefix.float() + delta.float(), prefix.dtype, truncate=bf16_casts_truncate)


def check_mix_and_norm(c: Case, new_prefix: torch.Tensor, blocks: torch.Tensor,
                       norm_w: torch.Tensor, proj_w: torch.Tensor, out: torch.Tensor,
                       out_norm_w: torch.Tensor | None, *, bf16_casts_truncate: bool,
                       device: str, msg: str, kernel_mix: torch.Tensor | None = None) -> None:
    """Stages 3 and 4 for the kernel's ``out``, given the kernel's own updated prefix and
    bank. ``kernel_mix``: the kernel's rounded mix when ``out`` is normed (else a second
    launch computes it)."""
    if out_norm_w is None:
        mix = out
    elif kernel_mix is not None:
        mix = kernel_mix
    else:
        mix = torch.empty(new_prefix.shape, device=device, dtype=c.dtype)
        launch(new_prefix, blocks, c.num_blocks, norm_w, proj_w, c.eps, mix, shape=c.shape)
    expected_mix = reference.attn_res(new_prefix.clone(), blocks.clone(), c.num_blocks, norm_w,
                                      proj_w, c.eps)
    if c.num_blocks == 0:
        # The fast path: the mix *is* the prefix.
        assert torch.equal(bits(mix), bits(new_prefix)), f"{msg}: zero blocks, mix != prefix"
    atol = mix_atol(new_prefix, blocks, c.num_blocks, norm_w, proj_w, c.eps)
    assert_mix_close(mix, expected_mix, atol,
                     mix_ulps(c.dtype, bf16_casts_truncate=bf16_casts_truncate), msg=f"{msg} mix")
    if out_norm_w is not None:
        assert out.dtype == c.out_dtype
        if out.shape[0] > 1024:
            # The norm is row-wise and this check runs on the CPU: every 7th row and the last.
            keep = torch.cat([torch.arange(0, out.shape[0] - 1, 7),
                              torch.tensor([out.shape[0] - 1])]).to(out.device)
            out, mix = out[keep], mix[keep]
        if pick_launch_shape(c.T, c.H, c.num_blocks, **c.shape).kind == "split" \
                and kernel_mix is None:
            # The mix comes from a second launch, a different compiled variant of the split
            # kernel (no norm): on the GPU its fp32 mix may round to a neighbouring 16-bit
            # value in rare elements (FMA contraction and reduction order differ between
            # variants; measured 1-2 of 917,504 elements at T = 128). One ulp more for that.
            expected = reference.rms_norm(mix, out_norm_w, c.out_eps, c.out_norm == "fp32w")
            ulps, ulp_dtype = dual_norm_tolerance(mix.dtype, out_norm_w.dtype,
                                                  c.out_norm == "fp32w",
                                                  bf16_casts_truncate=bf16_casts_truncate)
            assert_close_ulps(out, expected, ulps + 1, ulp_dtype=ulp_dtype, msg=f"{msg} out")
        else:
            assert_matches_reference(out, mix, out_norm_w, c.out_eps, c.out_norm == "fp32w",
                                     bf16_casts_truncate=bf16_casts_truncate, msg=f"{msg} out")


def run_and_check(c: Case, seed: int, *, bf16_casts_truncate: bool = INTERPRETED,
                  device: str = DEVICE) -> None:
    x = make_inputs(c, seed, device)
    prefix_before = x.prefix_parent.clone()
    bank_before = x.bank_parent.clone()
    weights_before = [w.clone() for w in (x.norm_w, x.proj_w, x.out_norm_w) if w is not None]
    delta_before = None if x.delta is None else x.delta.clone()
    nan = float("nan")
    out_parent = torch.full((c.T, c.H + c.pad), nan, device=device, dtype=c.out_dtype)
    out = out_parent[:, : c.H]
    new_parent = torch.full((c.T, c.H + c.pad), nan, device=device, dtype=c.dtype)
    prefix_out = x.prefix if c.inplace else new_parent[:, : c.H]

    launch(x.prefix, x.blocks, c.num_blocks, x.norm_w, x.proj_w, c.eps, out,
           delta=x.delta, prefix_out=prefix_out if c.has_delta else None,
           block_write_idx=c.write_idx, out_norm_w=x.out_norm_w, out_eps=c.out_eps,
           out_weight_in_fp32=c.out_norm == "fp32w", shape=c.shape)

    msg = str(c)
    # Inputs the kernel only reads.
    for before, after in zip(weights_before, (x.norm_w, x.proj_w, x.out_norm_w)):
        assert torch.equal(before, after), f"{msg}: a weight was modified"
    if x.delta is not None:
        assert torch.equal(bits(delta_before), bits(x.delta)), f"{msg}: delta was modified"

    # 1. The prefix update (bit-exact).
    new_prefix = expected_new_prefix(prefix_before[:, : c.H], x.delta,
                                     bf16_casts_truncate=bf16_casts_truncate)
    if c.has_delta and c.inplace:
        expect_parent = prefix_before.clone()
        expect_parent[:, : c.H] = new_prefix
        assert torch.equal(bits(x.prefix_parent), bits(expect_parent)), \
            f"{msg}: in-place prefix update wrong (or the padding beside it written)"
    else:
        assert torch.equal(bits(x.prefix_parent), bits(prefix_before)), \
            f"{msg}: prefix modified (it must only be read)"
    if c.has_delta and not c.inplace:
        assert torch.equal(bits(prefix_out), bits(new_prefix)), f"{msg}: prefix_out wrong"
        assert new_parent[:, c.H:].isnan().all(), f"{msg}: prefix_out padding written"
    kernel_prefix = prefix_out if c.has_delta else x.prefix

    # 2. The bank: only the write slot changes, to the kernel's own new prefix.
    expect_bank = bank_before.clone()
    if c.write_idx >= 0:
        bank_view(c, expect_bank)[:, c.write_idx] = kernel_prefix
    assert torch.equal(bits(x.bank_parent), bits(expect_bank)), (
        f"{msg}: bank differs from the expected (write slot {c.write_idx} = new prefix, "
        f"every other slot and the padding unchanged)")

    # 3., 4. The mix and the output norm.
    assert out_parent[:, c.H:].isnan().all(), f"{msg}: out padding written"
    assert not out.isnan().any(), f"{msg}: {int(out.isnan().sum())} outputs NaN or never written"
    check_mix_and_norm(c, kernel_prefix, x.blocks, x.norm_w, x.proj_w, out, x.out_norm_w,
                       bf16_casts_truncate=bf16_casts_truncate, device=device, msg=msg)


# --------------------------------------------------------------- property test

TOKENS = st.one_of(st.sampled_from([0, 1, 2, 3, 7, 33]), st.integers(0, 40))
WIDTHS = st.one_of(st.sampled_from([1, 3, 48, 64, 100, 129, 300]), st.integers(1, 300))


#: Launch shapes: the heuristic, the row kernel's tile heights, the split kernel's chunks
#: (16: many programs per token even at small H; 64: a chunk wider than some rows).
SHAPES = st.sampled_from([{}, {"sources_per_tile": 1}, {"sources_per_tile": 2},
                          {"sources_per_tile": 4}, {"chunk": 16}, {"chunk": 32}, {"chunk": 64}])


@st.composite
def cases(draw, tokens=TOKENS, widths=WIDTHS) -> Case:
    nb_max = draw(st.integers(0, 9))
    num_blocks = draw(st.integers(0, nb_max))
    write_idx = draw(st.one_of(st.just(-1), st.integers(num_blocks, nb_max - 1))
                     if num_blocks < nb_max else st.just(-1))
    dtype = draw(st.sampled_from(DTYPES))
    has_delta = draw(st.booleans())
    return Case(
        T=draw(tokens),
        H=draw(widths),
        nb_max=nb_max,
        num_blocks=num_blocks,
        write_idx=write_idx,
        dtype=dtype,
        has_delta=has_delta,
        out_norm=draw(st.sampled_from(["none", "cast", "fp32w"])),
        w_fp32=draw(st.booleans()),
        bank=draw(st.sampled_from(BANKS)),
        pad=draw(st.sampled_from([0, 0, 1, 8])),
        inplace=draw(st.booleans()) if has_delta else True,
        eps=draw(st.sampled_from([1e-6, 1e-5, 0.1])),
        out_eps=draw(st.sampled_from([1e-6, 1e-3])),
        log2_scale=draw(st.sampled_from([-6, 0, 6])),
        **draw(SHAPES),
    )


# The Kimi-K3 decode step scaled down: 8 completed blocks (9 sources), delta, block write
# into slot 8 of a stacked bank, output norm, bf16.
_K3 = Case(T=5, H=96, nb_max=9, num_blocks=8, write_idx=-1, dtype=torch.bfloat16,
           has_delta=True, out_norm="cast", w_fp32=False, bank="stacked", pad=0, inplace=True,
           eps=1e-6, out_eps=1e-6, log2_scale=0, sources_per_tile=0)


@pytest.mark.slow
@given(c=cases(), seed=st.integers(0, 2**31 - 1))
@example(c=_K3, seed=0)
@example(c=replace(_K3, nb_max=10, write_idx=8, sources_per_tile=4, T=3), seed=1)
# The first block write of a layer group: zero live blocks, the fast path, weight-in-fp32.
@example(c=replace(_K3, num_blocks=0, write_idx=0, out_norm="fp32w", bank="slice", pad=8,
                   inplace=False, T=7, H=129), seed=2)
# Odd sizes, fp32 weights with a bf16 prefix (fp32 output), no delta, 3 of 4 sources in the
# last decode tile, small values where eps matters.
@example(c=Case(T=17, H=300, nb_max=7, num_blocks=6, write_idx=6, dtype=torch.bfloat16,
                has_delta=False, out_norm="cast", w_fp32=True, bank="rows", pad=1, inplace=True,
                eps=0.1, out_eps=1e-3, log2_scale=-6, sources_per_tile=4), seed=3)
@example(c=replace(_K3, dtype=torch.float16, T=0), seed=4)
@example(c=replace(_K3, dtype=torch.float32, out_norm="none", H=1, num_blocks=3, T=3), seed=5)
def test_kernel_matches_reference(c: Case, seed: int) -> None:
    run_and_check(c, seed)


# --------------------------------------------------------------- focused tests


def test_kernels_are_interpreted_on_cpu() -> None:
    if DEVICE == "cuda":
        pytest.skip("compiled kernels on a CUDA machine")
    assert kernels_are_interpreted()


def test_block_count_is_a_constexpr_and_the_write_index_a_runtime_argument() -> None:
    """The block count is compiled in (one variant per count: a tile's rows past it are
    not loaded at all; docs/experiments.md, "2026-12-03: the block count as a constexpr"),
    the write index is not specialized on (Triton would for an int equal to 1 or
    divisible by 16)."""
    for kernel in (_attn_res_kernel, _attn_res_split_kernel):
        if INTERPRETED:
            not_specialized = set(kernel.kwargs["do_not_specialize"])
            constexprs = {name for name, p in inspect.signature(kernel.fn).parameters.items()
                          if "constexpr" in str(p.annotation)}
        else:
            not_specialized = {p.name for p in kernel.params if p.do_not_specialize}
            constexprs = {p.name for p in kernel.params if p.is_constexpr}
        assert "block_write_idx" in not_specialized
        assert "NUM_BLOCKS" in constexprs and "num_blocks" not in not_specialized


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("out_norm", ["none", "cast", "fp32w"])
def test_zero_blocks_is_the_prefix(dtype: torch.dtype, out_norm: str) -> None:
    """num_blocks = 0: out is the (updated) prefix bit for bit, or its output norm, even
    for rows whose logit would overflow (no softmax runs)."""
    c = replace(_K3, T=3, H=40, nb_max=2, num_blocks=0, write_idx=1, dtype=dtype,
                out_norm=out_norm, bank="rows")
    run_and_check(c, seed=11)
    if dtype == torch.float16:
        return
    # A row whose sum of squares overflows fp32 (the softmax would give NaN): the fast
    # path never computes a logit, so out is still the prefix.
    x = make_inputs(replace(c, has_delta=False, write_idx=-1, out_norm="none"), 12)
    x.prefix[0] = 2.0**70
    out = torch.empty_like(x.prefix)
    launch(x.prefix, x.blocks, 0, x.norm_w, x.proj_w, 1e-6, out)
    assert torch.equal(bits(out), bits(x.prefix))


#: One of each kernel's shapes: the row kernel's tile heights, split chunks of 16 (three
#: programs per 33-wide row) and 64.
EVERY_SHAPE = [{"sources_per_tile": 1}, {"sources_per_tile": 2}, {"sources_per_tile": 4},
               {"chunk": 16}, {"chunk": 64}]


def test_sources_past_num_blocks_are_never_read() -> None:
    """NaN in every slot >= num_blocks (and in the row padding) with every tile height:
    a masked-off source that leaked into the softmax would make the output NaN."""
    for i, shape in enumerate(EVERY_SHAPE):
        for nb in (1, 2, 3, 5):
            c = replace(_K3, T=2, H=33, nb_max=8, num_blocks=nb, write_idx=-1, pad=8,
                        has_delta=False, out_norm="none", **shape)
            run_and_check(c, seed=nb * 10 + i)


def test_tile_heights_agree() -> None:
    """Every launch shape computes the same thing (same checks, same inputs)."""
    for shape in EVERY_SHAPE + [{"sources_per_tile": 8}]:
        run_and_check(replace(_K3, T=3, H=70, nb_max=9, num_blocks=7, write_idx=8, **shape),
                      seed=21)


def test_softmax_is_sharp_and_flat() -> None:
    """Large logits (weights near one-hot: the online max must rescale) and all-equal
    sources (weights uniform): both against the reference."""
    c = replace(_K3, T=4, H=64, num_blocks=5, nb_max=6, write_idx=-1, has_delta=False,
                out_norm="none", dtype=torch.float32, bank="rows")
    x = make_inputs(c, 31)
    g = x.norm_w * x.proj_w
    # Sharp: push block 2 of token 0 along g (logit ~ +20), the prefix of token 1 against it.
    x.blocks[0, 2] = g.sign() * 3.0
    x.prefix[1] = -g.sign() * 3.0
    # Flat: token 2's sources all equal.
    x.blocks[2, :5] = x.prefix[2]
    out = torch.empty_like(x.prefix)
    for shape in EVERY_SHAPE:
        launch(x.prefix, x.blocks, 5, x.norm_w, x.proj_w, 1e-6, out, shape=replace(c, **shape).shape)
        check_mix_and_norm(c, x.prefix, x.blocks, x.norm_w, x.proj_w, out, None,
                           bf16_casts_truncate=INTERPRETED, device=DEVICE, msg=f"{shape}")


@pytest.mark.parametrize("sources_per_tile", [1, 2, 4])
@pytest.mark.parametrize("num_blocks", [0, 1, 5, 8])
def test_early_tile_changes_nothing_but_the_order_of_loads(sources_per_tile, num_blocks):
    """``early_tile`` loads the first source tile before the prefix and folds it in a
    peeled first step: the same arithmetic in the same order, so the same bits (output,
    updated prefix, written block)."""
    results = []
    for early in (False, True):
        x = make_inputs(_K3, 3)
        out = torch.empty_like(x.prefix)
        launch(x.prefix, x.blocks, num_blocks, x.norm_w, x.proj_w, 1e-6, out, delta=x.delta,
               prefix_out=x.prefix, block_write_idx=8, out_norm_w=x.out_norm_w,
               shape=dict(kind="row", sources_per_tile=sources_per_tile, early_tile=early))
        results.append((out, x.prefix_parent, x.bank_parent))
    for a, b in zip(*results):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


def test_launcher_needs_prefix_out_with_delta() -> None:
    x = make_inputs(_K3, 0)
    with pytest.raises(ValueError, match="prefix_out"):
        launch(x.prefix, x.blocks, 8, x.norm_w, x.proj_w, 1e-6, torch.empty_like(x.prefix),
               delta=x.delta)


@pytest.mark.parametrize("hidden,dtype,stages", [
    (7168, torch.bfloat16, PREFILL_LOOP_STAGES),     # Kimi-K3: 2 x 16 KiB buffers
    (32768, torch.bfloat16, PREFILL_LOOP_STAGES),    # 2 x 64 KiB: still fits
    (32769, torch.bfloat16, 1),                      # row tile 65536: 256 KiB, unpipelined
    (16384, torch.float32, PREFILL_LOOP_STAGES),
    (16385, torch.float32, 1),
])
def test_pipelined_source_loop_only_where_its_buffers_fit(monkeypatch, hidden, dtype, stages):
    """The automatic prefill shape pipelines the source loop only while its shared-memory
    buffers stay within LOOP_SMEM_BYTES (wider rows would not compile: out of resources);
    a forced loop_stages is taken as given."""
    import triton

    from k3fusion.kernels import attn_res as mod
    seen = []

    class Spy:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append(kw["LOOP_STAGES"])

    monkeypatch.setattr(mod, "_attn_res_kernel", Spy())
    prefix = torch.zeros(1, hidden, dtype=dtype)
    blocks = torch.zeros(1, 2, hidden, dtype=dtype)
    w = torch.ones(hidden, dtype=dtype)
    launch(prefix, blocks, 1, w, w, 1e-6, torch.empty_like(prefix),
           shape=dict(kind="row", prefill_tokens=1))
    launch(prefix, blocks, 1, w, w, 1e-6, torch.empty_like(prefix),
           shape=dict(kind="row", prefill_tokens=1, loop_stages=2))
    assert seen == [stages, 2]
    assert (stages > 1) == (2 * triton.next_power_of_2(hidden) * prefix.element_size()
                            <= mod.LOOP_SMEM_BYTES)


def test_launcher_rejects_bad_indices() -> None:
    x = make_inputs(replace(_K3, has_delta=False), 0)
    out = torch.empty_like(x.prefix)
    with pytest.raises(ValueError, match="num_blocks"):
        launch(x.prefix, x.blocks, 10, x.norm_w, x.proj_w, 1e-6, out)
    with pytest.raises(ValueError, match="block_write_idx"):
        launch(x.prefix, x.blocks, 8, x.norm_w, x.proj_w, 1e-6, out, block_write_idx=3)


def test_mixed_devices_rejected() -> None:
    x = make_inputs(replace(_K3, has_delta=False, T=1), 0)
    with pytest.raises(ValueError, match="one device"):
        launch(x.prefix, x.blocks, 8, torch.ones(96, device="meta"), x.proj_w, 1e-6,
               torch.empty_like(x.prefix))


def emulate(c: Case, new_prefix: torch.Tensor, blocks: torch.Tensor, norm_w: torch.Tensor,
            proj_w: torch.Tensor, out_norm_w: torch.Tensor | None, *, bf16_casts_truncate: bool
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mix, out)`` as the kernel rounds them: the spec's fp32 values (the reference run
    in fp32 on the same values) with every cast the kernel makes, each to nearest or, for
    bf16 in the interpreter, toward zero. The kernel differs from this only where its fp32
    value and the reference's straddle a rounding boundary."""
    trunc = bf16_casts_truncate
    mix32 = reference.attn_res(new_prefix.float(), blocks.float(), c.num_blocks, norm_w, proj_w,
                               c.eps)
    mix = round_to(mix32, c.dtype, truncate=trunc)
    if out_norm_w is None:
        return mix, mix
    x32 = mix.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + c.out_eps)
    w32 = out_norm_w.float()
    if c.out_norm == "fp32w":
        return mix, round_to(normed * w32, c.dtype, truncate=trunc)
    y = round_to(normed, c.dtype, truncate=trunc).float() * w32
    return mix, (y if c.out_dtype == torch.float32 else round_to(y, c.out_dtype, truncate=trunc))


def exact_fraction(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((bits(a) == bits(b)).double().mean()) if a.numel() else 1.0


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_norm", ["none", "cast", "fp32w"])
@pytest.mark.parametrize("shape", [{"sources_per_tile": 1}, {"sources_per_tile": 4}, {"chunk": 32}],
                         ids=str)
def test_roundings_are_the_spec_bit_for_bit(dtype: torch.dtype, out_norm: str, shape: dict) -> None:
    """The ulp tolerances cannot see a missing or extra rounding (a half-ulp shift stays
    within them), so compare bits with the spec's roundings emulated: the new prefix is
    rounded before it is a source, the mix is rounded before the output norm, and the
    normalized row before the weight (cast-then-weight). Only fp32 last-bit noise that
    straddles a rounding boundary may differ: measured <= 0.25% of the elements in the
    interpreter (98% required: the GPU's approximate exp/rsqrt add noise). A missing
    rounding of the prefix moves ~10% of the mix, of the mix ~25-50% of out."""
    c = replace(_K3, T=8, H=128, dtype=dtype, out_norm=out_norm, w_fp32=out_norm == "cast",
                write_idx=8, **shape)
    x = make_inputs(c, 51)
    out = torch.empty(c.T, c.H, device=DEVICE, dtype=c.out_dtype)
    launch(x.prefix, x.blocks, c.num_blocks, x.norm_w, x.proj_w, c.eps, out, delta=x.delta,
           prefix_out=x.prefix, block_write_idx=c.write_idx, out_norm_w=x.out_norm_w,
           out_eps=c.out_eps, out_weight_in_fp32=out_norm == "fp32w", shape=c.shape)
    mix = torch.empty_like(x.prefix)
    launch(x.prefix, x.blocks, c.num_blocks, x.norm_w, x.proj_w, c.eps, mix, shape=c.shape)
    exp_mix, exp_out = emulate(c, x.prefix, x.blocks, x.norm_w, x.proj_w, x.out_norm_w,
                               bf16_casts_truncate=INTERPRETED)
    assert exact_fraction(mix, exp_mix) >= 0.98, f"mix: {exact_fraction(mix, exp_mix)} bit-exact"
    assert exact_fraction(out, exp_out) >= 0.98, f"out: {exact_fraction(out, exp_out)} bit-exact"


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_rounded_prefix_is_the_last_source(dtype: torch.dtype) -> None:
    """Exact arithmetic that exposes the prefix's rounding: prefix 1, delta 2**-12 (below
    half a 16-bit ulp of 1, so the new prefix rounds back to 1 in every mode), one block
    -1, and a g whose dot with a constant row is 0 (equal logits, weights 1/2 each). The
    spec's mix is (1 - 1) / 2 = 0; an unrounded source would give 2**-13. In fp32 the
    sum is representable and the mix is 2**-13."""
    T, H = 3, 64
    prefix = torch.ones(T, H, device=DEVICE, dtype=dtype)
    delta = torch.full((T, H), 2.0**-12, device=DEVICE, dtype=dtype)
    blocks = torch.full((T, 2, H), -1.0, device=DEVICE, dtype=dtype)
    norm_w = torch.ones(H, device=DEVICE)
    proj_w = torch.tensor([1.0, -1.0], device=DEVICE).repeat(H // 2)
    out = torch.empty_like(prefix)
    launch(prefix, blocks, 1, norm_w, proj_w, 1e-6, out, delta=delta, prefix_out=prefix,
           block_write_idx=1)
    new = 1.0 + 2.0**-12 if dtype == torch.float32 else 1.0
    assert (prefix == new).all() and (blocks[:, 1] == new).all()
    assert (out == (new - 1.0) / 2).all(), out.unique()


def test_launcher_takes_a_shape_or_its_overrides() -> None:
    """``shape``: a :class:`LaunchShape` runs as given, a mapping goes to
    ``pick_launch_shape`` (the same launch), an unknown override is a TypeError naming it."""
    c = replace(_K3, T=3, H=48, num_blocks=4)
    x = make_inputs(c, 0)
    overrides = {"kind": "row", "sources_per_tile": 2}
    outs = []
    for shape in (overrides, pick_launch_shape(c.T, c.H, c.num_blocks, **overrides)):
        outs.append(torch.empty_like(x.prefix))
        launch(x.prefix, x.blocks, c.num_blocks, x.norm_w, x.proj_w, 1e-6, outs[-1], shape=shape)
    assert torch.equal(outs[0], outs[1])
    with pytest.raises(TypeError, match="source_per_tile"):
        launch(x.prefix, x.blocks, c.num_blocks, x.norm_w, x.proj_w, 1e-6, outs[0],
               shape={"source_per_tile": 2})


# --------------------------------------------------------------- launch shape heuristic


def test_pick_launch_shape() -> None:
    H = 7168
    # The rule: the split kernel up to 12 tokens, then the row kernel (measured on the
    # H200: the split kernel with its epoch-tagged exchange ahead up to 12;
    # docs/experiments.md, "2026-11-29: the split kernel's epoch-tagged exchange"). The
    # launch table, which comes first where it has an entry, reaches further at H 7168
    # (tests/test_attn_res_launch_table.py).
    assert SPLIT_MAX_TOKENS == 12
    for T in (1, SPLIT_MAX_TOKENS):
        s = pick_launch_shape(T, H, 8, use_table=False)
        assert (s.kind, s.chunk, s.num_warps) == ("split", SPLIT_CHUNK, SPLIT_NUM_WARPS) \
            == ("split", 1024, 4)
    after = pick_launch_shape(SPLIT_MAX_TOKENS + 1, H, 8, use_table=False)
    assert (after.kind, after.sources_per_tile, after.early_tile) == ("row", 4, True)
    # split_max_tokens=0: never the split kernel; the row kernel's decode shape, the first
    # source tile loaded early.
    one = pick_launch_shape(1, H, 8, split_max_tokens=0)
    assert (one.kind, one.sources_per_tile, one.early_tile) == ("row", 4, True)
    assert pick_launch_shape(EARLY_TILE_MAX_TOKENS, H, 8).early_tile
    assert not pick_launch_shape(EARLY_TILE_MAX_TOKENS + 1, H, 8).early_tile
    assert not pick_launch_shape(4096, H, 8).early_tile  # the prefill shape: never
    assert not pick_launch_shape(1, H, 8, early_tile=False).early_tile
    assert pick_launch_shape(4096, H, 8, early_tile=True).early_tile  # forced: as asked
    # The split kernel where asked for (kind or split_max_tokens), with the chunk and warps
    # the H200 sweep found fastest; chunk no wider than the row.
    split = pick_launch_shape(1, H, 8, split_max_tokens=8)
    assert (split.kind, split.chunk, split.num_warps) == ("split", SPLIT_CHUNK, SPLIT_NUM_WARPS)
    assert pick_launch_shape(8, H, 8, split_max_tokens=8).kind == "split"
    assert pick_launch_shape(9, H, 8, split_max_tokens=8).kind == "row"
    assert pick_launch_shape(3, 100, 5, kind="split").chunk == min(SPLIT_CHUNK, 128)
    assert pick_launch_shape(3, 5, 5, kind="split").chunk == 8
    # More sources than the split kernel holds: the row kernel.
    assert pick_launch_shape(1, H, SPLIT_MAX_SOURCES - 1, split_max_tokens=8).kind == "split"
    assert pick_launch_shape(1, H, SPLIT_MAX_SOURCES, split_max_tokens=8).kind == "row"
    with pytest.raises(ValueError, match="at most"):
        pick_launch_shape(1, H, SPLIT_MAX_SOURCES, kind="split")
    # Past SPLIT_MAX_TOKENS the row kernel: its prefill shape, or below PREFILL_TOKENS
    # (with the threshold moved) its decode shape.
    prefill = pick_launch_shape(max(SPLIT_MAX_TOKENS + 1, PREFILL_TOKENS), H, 8)
    assert (prefill.kind, prefill.sources_per_tile, prefill.num_warps, prefill.loop_stages) == \
        ("row", PREFILL_SOURCES_PER_TILE, 8, PREFILL_LOOP_STAGES) == ("row", 1, 8, 3)
    decode = pick_launch_shape(8, H, 8, kind="row")
    assert (decode.sources_per_tile, decode.num_warps, decode.block_h) == \
        (DECODE_SOURCES_PER_TILE, 16, 8192) == (4, 16, 8192)
    assert decode.loop_stages == 1
    assert pick_launch_shape(PREFILL_TOKENS - 1, H, 8, kind="row").sources_per_tile == 4
    assert pick_launch_shape(4096, H, 8, loop_stages=2).loop_stages == 2
    # the prefill pipeline only where its buffers fit (the launcher passes the dtype's size)
    assert pick_launch_shape(4096, 32768, 8).loop_stages == PREFILL_LOOP_STAGES
    assert pick_launch_shape(4096, 32769, 8).loop_stages == 1
    assert pick_launch_shape(4096, 16385, 8, element_size=4).loop_stages == 1
    assert pick_launch_shape(4096, 32769, 8, loop_stages=3).loop_stages == 3
    with pytest.raises(ValueError, match="loop_stages"):
        pick_launch_shape(4096, H, 8, loop_stages=-1)
    assert pick_launch_shape(64, H, 8, split_max_tokens=63).kind == "row"
    # No wider than the sources: one block + the prefix is two, none is one.
    assert pick_launch_shape(1, H, 1, kind="row").sources_per_tile == 2
    assert pick_launch_shape(1, H, 0, kind="row").sources_per_tile == 1
    assert pick_launch_shape(1, H, 0, kind="row").num_warps == 4
    # The thresholds are arguments (the benchmark sweeps them) ...
    assert pick_launch_shape(64, H, 8, kind="row", prefill_tokens=64).sources_per_tile == 1
    assert pick_launch_shape(4096, H, 8, kind="row", prefill_tokens=10**9).sources_per_tile == 4
    # ... and so are the shapes themselves and the warps; a row tile height means the row kernel.
    s = pick_launch_shape(4096, H, 8, sources_per_tile=4, num_warps=4)
    assert (s.kind, s.sources_per_tile, s.num_warps) == ("row", 4, 4)
    s = pick_launch_shape(1, H, 8, chunk=512, num_warps=8)
    assert (s.kind, s.chunk, s.num_warps) == ("split", 512, 8)
    assert pick_launch_shape(3, 100, 5).block_h == 128
    with pytest.raises(ValueError, match="sources_per_tile"):
        pick_launch_shape(8, H, 8, sources_per_tile=3)
    with pytest.raises(ValueError, match="num_warps"):
        pick_launch_shape(8, H, 8, kind="row", num_warps=6)
    with pytest.raises(ValueError, match="chunk"):
        pick_launch_shape(8, H, 8, chunk=48, kind="split")
    with pytest.raises(ValueError, match="kind"):
        pick_launch_shape(8, H, 8, kind="tiled")


def test_split_kernel_many_sources() -> None:
    """16 to 31 sources: the split kernel's source tile grows to 32 rows."""
    for nb in (15, 20):
        run_and_check(replace(_K3, T=2, H=40, nb_max=nb + 1, num_blocks=nb, write_idx=nb,
                              chunk=16), seed=nb)




@pytest.mark.parametrize("num_blocks", [0, 1, 3, 8])
@pytest.mark.parametrize("out_norm", ["none", "cast", "fp32w"])
def test_split_kernel_one_program_per_token(num_blocks: int, out_norm: str) -> None:
    """A chunk as wide as the row: one program per token, which exchanges nothing (its
    constexpr path without words runs in one launch, in the interpreter too) -- against
    the spec, at widths below, at and past a power of two."""
    for H, chunk in ((70, 128), (64, 64), (100, 1024)):
        c = replace(_K3, T=3, H=H, nb_max=9, num_blocks=num_blocks, write_idx=8,
                    out_norm=out_norm, chunk=chunk)
        assert pick_launch_shape(c.T, H, num_blocks, **c.shape).chunk >= H
        run_and_check(c, seed=num_blocks)


def test_split_kernel_one_program_per_token_is_one_launch(monkeypatch) -> None:
    """The one-program form is one launch of PHASE 0 (no separate phases, in the
    interpreter too); wider rows keep the phased form here."""
    from k3fusion.kernels import attn_res as mod
    phases = []
    kernel = mod._attn_res_split_kernel

    class Spy:
        def __getitem__(self, grid):
            def run(*args, **kw):
                phases.append((grid, kw["PHASE"], kw["N_CHUNKS"]))
                return kernel[grid](*args, **kw)
            return run

    monkeypatch.setattr(mod, "_attn_res_split_kernel", Spy())
    x = make_inputs(_K3, 0)
    out = torch.empty_like(x.prefix)
    launch(x.prefix, x.blocks, 8, x.norm_w, x.proj_w, 1e-6, out,
           shape=dict(kind="split", chunk=128), out_norm_w=x.out_norm_w)
    assert phases == [((1, _K3.T), 0, 1)]
    phases.clear()
    launch(x.prefix, x.blocks, 8, x.norm_w, x.proj_w, 1e-6, out,
           shape=dict(kind="split", chunk=32), out_norm_w=x.out_norm_w)
    assert [p[1] for p in phases] == [1, 2, 3]


def test_split_kernel_one_program_form_compiles_for_hopper() -> None:
    """The one-program form compiles for sm_90 (the interpreter never builds it) with no
    exchange left in it: no atomics, no volatile polls."""
    ptx = hopper_ptx("k3fusion.kernels.attn_res:_attn_res_split_kernel", "the one-program form",
                     dict(CHUNK=2048, NUM_BLOCKS=9, N_CHUNKS=1, N_CHUNKS_PAD=1, S_PAD=16,
                          HAS_DELTA=True, WRITE_BLOCK=True, HAS_OUT_NORM=True,
                          OUT_WEIGHT_IN_FP32=False, PHASE=0, PDL=False, LATE_TRIGGER=False,
                          EVEN_H=False, MIX_TRIGGER=False),
                     pointers={"words_ptr": "*i64"}, num_warps=8)
    assert "atom" not in ptx and "ld.volatile" not in ptx


@pytest.mark.slow
def test_split_kernel_exchange_compiles_for_hopper() -> None:
    """The one-launch split kernel (its exchanges never run in the interpreter) compiles
    for sm_90 on any machine, and its PTX holds the fence-free exchange: one relaxed
    arrival add for the launch epoch, the tagged partial sums published by relaxed 64-bit
    GPU-scope exchanges, polls with volatile (relaxed) 64-bit loads; no fence, no
    acquire/release atomic."""
    ptx = hopper_ptx("k3fusion.kernels.attn_res:_attn_res_split_kernel", "the split kernel",
                     dict(CHUNK=512, NUM_BLOCKS=9, N_CHUNKS=14, N_CHUNKS_PAD=16, S_PAD=16,
                          HAS_DELTA=True, WRITE_BLOCK=True, HAS_OUT_NORM=True,
                          OUT_WEIGHT_IN_FP32=False, PHASE=0, PDL=False, LATE_TRIGGER=False,
                          EVEN_H=False, MIX_TRIGGER=False),
                     pointers={"words_ptr": "*i64"}, num_warps=2)
    lines = [line.strip() for line in ptx.splitlines()]
    assert not [x for x in lines if x.startswith("fence.")]
    adds = [x for x in lines if "atom" in x and ".add" in x]
    assert len(adds) == 1 and ".relaxed" in adds[0] and ".gpu" in adds[0], adds
    assert not [x for x in lines if "atom" in x and (".acq" in x or ".release" in x)]
    stores = [x for x in lines if "atom.global.gpu.relaxed.exch.b64" in x]
    polls = [x for x in lines if x.startswith("ld.volatile.global.b64")]
    # the sources' dot and square sums, then the mix's sum of squares
    assert len(stores) >= 3, stores
    assert len(polls) >= 3, polls




def test_row_kernel_source_loop_loads_evict_first() -> None:
    """The decode shape's looped source loads carry the evict-first hint (worth 4% at
    T = 128 on the H200): rows read once per call go ahead of the rows it writes."""
    ptx = hopper_ptx("k3fusion.kernels.attn_res:_attn_res_kernel", "the row kernel",
                     dict(BLOCK_H=1024, NUM_BLOCKS=8, SOURCES_PER_TILE=4, LOOP_STAGES=1,
                          EARLY_TILE=True, HAS_DELTA=True, WRITE_BLOCK=True, HAS_OUT_NORM=True,
                          OUT_WEIGHT_IN_FP32=False, PDL=False, LATE_TRIGGER=False,
                          EVEN_H=False, MIX_TRIGGER=False))
    # predicated loads: "@%p1 ld.global..."
    loads = [x.split()[1] for x in ptx.splitlines() if " ld.global" in x]
    hinted = [x for x in loads if x.startswith("ld.global.L1::evict_first.L2::cache_hint")]
    # Exactly the looped tile's loads (4 rows x 1024 columns over 128 threads, one 16-bit
    # element per load without alignment hints): not the early tile, prefix or weights.
    assert len(hinted) == 4 * 1024 // 128, (len(hinted), sorted(set(loads)))
    assert len(hinted) < len(loads)
    assert "createpolicy.fractional.L2::evict_first" in ptx


@pytest.mark.parametrize("kernel", ["_attn_res_kernel", "_attn_res_split_kernel"])
def test_rows_the_tiles_cover_exactly_take_no_column_predicate(kernel: str) -> None:
    """``EVEN_H`` (the launcher's where the row's width is a multiple of the tile's): the
    column mask is true at compile time, so the loads and stores of a step with no
    blocks (prefix, delta, weights; prefix, block, output) carry no predicate; without it
    every one does."""
    const = (dict(BLOCK_H=1024, SOURCES_PER_TILE=1, LOOP_STAGES=1, EARLY_TILE=False)
             if kernel == "_attn_res_kernel" else
             dict(CHUNK=1024, N_CHUNKS=1, N_CHUNKS_PAD=1, S_PAD=2, PHASE=0))
    const.update(NUM_BLOCKS=0, HAS_DELTA=True, WRITE_BLOCK=True, HAS_OUT_NORM=True,
                 OUT_WEIGHT_IN_FP32=False, PDL=False, LATE_TRIGGER=False, MIX_TRIGGER=False)
    ptxs = hopper_ptxs(f"k3fusion.kernels.attn_res:{kernel}", f"{kernel}, EVEN_H forms",
                       [dict(const, EVEN_H=even) for even in (True, False)],
                       pointers={"words_ptr": "*i64"})
    for even, ptx in zip((True, False), ptxs, strict=True):
        memory = [x.strip() for x in ptx.splitlines()
                  if " ld.global" in x or " st.global" in x or x.strip().startswith(
                      ("ld.global", "st.global"))]
        predicated = [x for x in memory if x.startswith("@")]
        assert memory and (not predicated if even else len(predicated) == len(memory)), (
            even, memory)


@pytest.mark.parametrize("kernel,chunks", [("_attn_res_kernel", 1), ("_attn_res_split_kernel", 1),
                                           ("_attn_res_split_kernel", 2)])
def test_pdl_form_waits_before_its_first_load(kernel: str, chunks: int) -> None:
    """``PDL``: the launch may start while the previous one runs, so it waits for it
    (griddepcontrol.wait) before any global load -- weights included -- then lets the
    next launch start (at once, at the mix or at the end); without PDL neither instruction
    is there. The split kernel with its exchange too (2 programs per token)."""
    const = (dict(BLOCK_H=1024, NUM_BLOCKS=3, SOURCES_PER_TILE=4, LOOP_STAGES=1,
                  EARLY_TILE=True) if kernel == "_attn_res_kernel" else
             dict(CHUNK=1024 // chunks, NUM_BLOCKS=3, N_CHUNKS=chunks, N_CHUNKS_PAD=chunks,
                  S_PAD=4, PHASE=0))
    const.update(HAS_DELTA=True, WRITE_BLOCK=True, HAS_OUT_NORM=True, OUT_WEIGHT_IN_FP32=False)
    forms = ((True, False, False), (True, True, False), (True, True, True),
             (False, False, False))
    ptxs = hopper_ptxs(f"k3fusion.kernels.attn_res:{kernel}", f"{kernel}, PDL forms",
                       [dict(const, PDL=pdl, LATE_TRIGGER=late, MIX_TRIGGER=mix, EVEN_H=False)
                        for pdl, late, mix in forms],
                       pointers={"words_ptr": "*i64"})
    for (pdl, late, mix), ptx in zip(forms, ptxs, strict=True):
        assert_pdl_order(ptx, pdl, late, mix)


# --------------------------------------------------------------- the tolerance helpers


def test_round_to_truncates_like_the_interpreter() -> None:
    x = torch.tensor([1.0 + 2.0**-8 + 2.0**-9, -(1.0 + 2.0**-8 + 2.0**-9), 3.0])
    assert round_to(x, torch.bfloat16, truncate=True).tolist() == [1.0, -1.0, 3.0]
    assert round_to(x, torch.bfloat16, truncate=False).tolist() == [1.0078125, -1.0078125, 3.0]
    assert round_to(x, torch.float16, truncate=True).dtype == torch.float16


def test_mix_tolerances_are_tight() -> None:
    """The ulp part is what the roundings allow, nothing more; and the fp32 drift bound
    is far below a 16-bit ulp when the mix does not cancel."""
    assert mix_ulps(torch.bfloat16, bf16_casts_truncate=False) == 1.0
    assert mix_ulps(torch.bfloat16, bf16_casts_truncate=True) == 1.5
    assert mix_ulps(torch.float16, bf16_casts_truncate=True) == 1.0
    assert mix_ulps(torch.float32, bf16_casts_truncate=True) == 0.0
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randn(4, 256, generator=gen) + 3.0  # positive: no cancellation
    blocks = torch.randn(4, 8, 256, generator=gen) + 3.0
    nw, pw = torch.rand(256, generator=gen), torch.randn(256, generator=gen) / 16
    atol = mix_atol(prefix, blocks, 8, nw, pw, 1e-6)
    mixed = reference.attn_res(prefix.clone(), blocks, 8, nw, pw, 1e-6).double()
    assert (atol / ulp(mixed, torch.bfloat16)).max() < 2.0**-8


def test_mix_tolerance_catches_a_wrong_eps() -> None:
    """A kernel bug of the size of a wrong eps (0.1 vs 1e-6) fails the check."""
    c = replace(_K3, T=3, H=64, has_delta=False, out_norm="none", dtype=torch.float32,
                write_idx=-1, log2_scale=-4)
    x = make_inputs(c, 41)
    out = torch.empty_like(x.prefix)
    launch(x.prefix, x.blocks, 8, x.norm_w, x.proj_w, 0.1, out)
    with pytest.raises(AssertionError, match="mix elements off"):
        check_mix_and_norm(c, x.prefix, x.blocks, x.norm_w, x.proj_w, out, None,
                           bf16_casts_truncate=INTERPRETED, device=DEVICE, msg="wrong eps")


# --------------------------------------------------------------- real sizes, GPU only


@pytest.mark.cuda
class TestAttnResCuda:
    """Kimi-K3 sizes on the GPU (round-to-nearest-even casts, as torch): bf16, H = 7168,
    up to 8 completed blocks (9 sources) in a stacked bank of 9 slots, every switch, both
    launch shapes. Tolerances as above with ``bf16_casts_truncate=False``: the prefix and
    bank bit-exact, the mix within 1 ulp + :func:`mix_atol`, the output norm 2 ulps
    (cast-then-weight) or 1 (weight-in-fp32) of ``rms_norm`` of the kernel's own mix."""

    # (has_delta, block write, output norm): every switch on and off, both norm forms.
    FLAGS = [(False, False, "none"), (True, True, "cast"), (True, False, "fp32w"),
             (False, True, "cast"), (True, True, "none")]

    # Every kernel at every T: the row kernel's two tile heights, the split kernel at its
    # default chunk and at 512 (14 programs per token).
    SHAPES = [(T, shape) for T in (1, 7, 128, 4099)
              for shape in ({"sources_per_tile": 1}, {"sources_per_tile": 4},
                            {"chunk": SPLIT_CHUNK}, {"chunk": 512})]

    @pytest.mark.parametrize("T, shape", SHAPES, ids=str)
    @pytest.mark.parametrize("flags", FLAGS,
                             ids=lambda f: f"delta{int(f[0])}-write{int(f[1])}-{f[2]}")
    def test_launcher(self, T: int, shape: dict, flags: tuple) -> None:
        has_delta, write, out_norm = flags
        # Every block count 0..8 (the 9-source step last); at 4099 tokens a sample.
        for nb in (range(9) if T <= 128 else (0, 1, 2, 5, 8)):
            c = Case(T=T, H=7168, nb_max=9, num_blocks=nb, write_idx=nb if write and nb < 9 else -1,
                     dtype=torch.bfloat16, has_delta=has_delta, out_norm=out_norm, w_fp32=False,
                     bank="stacked", pad=0, inplace=True, eps=1e-6, out_eps=1e-6, log2_scale=0,
                     **shape)
            run_and_check(c, seed=T * 10 + nb, bf16_casts_truncate=False, device="cuda")

    @pytest.mark.parametrize("T", [1, 7, 128, 1000])
    @pytest.mark.parametrize("flags", FLAGS,
                             ids=lambda f: f"delta{int(f[0])}-write{int(f[1])}-{f[2]}")
    def test_split_barrier_is_exact(self, T: int, flags: tuple) -> None:
        """The split kernel in one launch (programs meet at the barriers) gives the same
        bits as its phases run as separate launches (the interpreter's form): a program
        that read a partial sum before its partner stored it would differ. Repeated, so
        the barrier counters are reused across launches."""
        has_delta, write, out_norm = flags
        for nb in (0, 1, 8):
            c = Case(T=T, H=7168, nb_max=9, num_blocks=nb, write_idx=8 if write else -1,
                     dtype=torch.bfloat16, has_delta=has_delta, out_norm=out_norm, w_fp32=False,
                     bank="stacked", pad=0, inplace=False, eps=1e-6, out_eps=1e-6, log2_scale=0,
                     chunk=512)
            x = make_inputs(c, seed=nb)
            results = []
            for phases in (True, False, False, False):
                bank = x.bank_parent.clone()
                blocks = bank_view(c, bank)
                out = torch.empty(T, c.H, device="cuda", dtype=c.out_dtype)
                new = torch.empty_like(x.prefix)
                launch(x.prefix, blocks, nb, x.norm_w, x.proj_w, c.eps, out, delta=x.delta,
                       prefix_out=new if has_delta else None, block_write_idx=c.write_idx,
                       out_norm_w=x.out_norm_w, out_eps=c.out_eps, split_phases=phases,
                       shape=c.shape)
                results.append((bits(out), bits(bank), bits(new) if has_delta else None))
            for r in results[1:]:
                assert torch.equal(r[0], results[0][0]), f"{c}: out differs"
                assert torch.equal(r[1], results[0][1]), f"{c}: bank differs"
                if has_delta:
                    assert torch.equal(r[2], results[0][2]), f"{c}: prefix differs"

    @pytest.mark.parametrize("T", [7, 128])
    def test_heuristic_shape_and_fp16(self, T: int) -> None:
        for nb in (1, 2, 8):
            for dtype in (torch.bfloat16, torch.float16):
                c = Case(T=T, H=7168, nb_max=9, num_blocks=nb, write_idx=8, dtype=dtype,
                         has_delta=True, out_norm="cast", w_fp32=False, bank="rows", pad=0,
                         inplace=False, eps=1e-6, out_eps=1e-6, log2_scale=0)
                run_and_check(c, seed=nb, bf16_casts_truncate=False, device="cuda")

    @pytest.mark.parametrize("T", [1, 128])
    def test_fp32_weight_and_strided_rows(self, T: int) -> None:
        for nb in (0, 3, 8):
            c = Case(T=T, H=7168, nb_max=10, num_blocks=nb, write_idx=9, dtype=torch.bfloat16,
                     has_delta=True, out_norm="cast", w_fp32=True, bank="slice", pad=64,
                     inplace=False, eps=1e-6, out_eps=1e-6, log2_scale=0)
            run_and_check(c, seed=nb, bf16_casts_truncate=False, device="cuda")

    def test_split_kernel_in_a_cuda_graph(self, monkeypatch) -> None:
        """Captured once after a warm-up, replayed several times: each captured launch
        keeps words of its own for good (``_scratch.launch_scratch``: an arena slice, no
        memset node), each replay moves a token's counter on by one epoch, and the output
        stays right replay after replay."""
        from k3fusion.kernels import _scratch
        from k3fusion.kernels import attn_res as kernel_mod
        from k3fusion.kernels.attn_res import SYNC_EPOCH

        c = replace(_K3, T=3, H=7168, num_blocks=8, nb_max=9, write_idx=-1, chunk=512,
                    inplace=False)
        x = make_inputs(c, 5, "cuda")
        out = torch.empty(c.T, c.H, device="cuda", dtype=c.out_dtype)
        new = torch.empty_like(x.prefix)

        def step():
            for _ in range(3):
                launch(x.prefix, x.blocks, 8, x.norm_w, x.proj_w, c.eps, out, delta=x.delta,
                       prefix_out=new, out_norm_w=x.out_norm_w, out_eps=c.out_eps, shape=c.shape)

        made, real = [], kernel_mod.launch_scratch
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            step()  # compile; the warm-up makes the arena
            torch.cuda.synchronize()
            monkeypatch.setattr(kernel_mod, "launch_scratch",
                                lambda *a, **k: made.append(real(*a, **k)) or made[-1])
            handed = _scratch.arena_stats()["bytes_handed_out"]
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                step()
        token_words = 529  # 1 + 16 * (2 * 16 + 1)
        assert len(made) == 3 and len({t.data_ptr() for t in made}) == 3
        assert _scratch.arena_stats()["bytes_handed_out"] >= handed + 3 * c.T * token_words * 8
        expected_out = torch.empty_like(out)
        launch(x.prefix, x.blocks, 8, x.norm_w, x.proj_w, c.eps, expected_out, delta=x.delta,
               prefix_out=new, out_norm_w=x.out_norm_w, out_eps=c.out_eps, split_phases=True,
               shape=c.shape)
        for replay in range(1, 4):
            out.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(bits(out), bits(expected_out))
            for words in made:  # word 0 of each token's words: one epoch per replay
                used = words[:c.T * token_words:token_words]
                assert used.tolist() == [replay * SYNC_EPOCH.value] * c.T, (replay, used)

    def test_split_exchange_never_accepts_a_stale_word(self) -> None:
        """The exchange protocol on a reused buffer (the ``words`` test hook): every record
        word poisoned with NaN bits tagged with the previous launch's epoch -- what a stale
        word holds at worst -- before a launch: the programs must wait for this launch's
        words, so the output equals the phased launches'. A poll that did not check the
        epoch, or a kernel that did not wait, would read the NaNs. (Launches get fresh
        zeroed words of their own; this holds the protocol to its own rule.)"""
        from k3fusion.kernels.attn_res import SYNC_EPOCH

        T, H, nb = 3, 7168, 8
        g = torch.Generator(device="cuda").manual_seed(3)

        def rand(*shape):
            return torch.randn(*shape, device="cuda", generator=g).to(torch.bfloat16)

        prefix, blocks = rand(T, H), rand(T, nb + 1, H)
        norm_w, proj_w, out_w = 1 + rand(H) / 10, rand(H) / H**0.5, 1 + rand(H) / 10
        # 1024-column chunks of 7168: 7 programs (8 record slots); 9 sources (16 rows)
        per_token = 1 + 8 * (2 * 16 + 1)
        buf = torch.zeros(T * per_token, dtype=torch.int64, device="cuda")

        def run(**kw):
            out = torch.empty_like(prefix)
            launch(prefix, blocks, nb, norm_w, proj_w, 1e-6, out, out_norm_w=out_w,
                   shape=dict(kind="split"), **kw)
            return out

        want = run(split_phases=True)
        assert torch.equal(run(words=buf), want)
        words = buf.view(T, per_token)
        for _ in range(3):
            last_epoch = words[:, :1] // SYNC_EPOCH.value
            words[:, 1:] = (last_epoch << 32) | 0x7FC00000  # a quiet NaN's bits
            out = run(words=buf)
            torch.cuda.synchronize()
            assert torch.equal(out, want)
            used = words[:, 1:1 + 7 * (2 * 16 + 1)]  # the 7 chunks' records
            assert not bool((used >> 32 == last_epoch).any())  # every word rewritten

    def test_int64_offsets(self) -> None:
        """A bank whose last slot starts past 2**31 elements (4 GiB of bf16): int32
        offsets would wrap around."""
        T, H, nb = 2, 7168, 8
        block_stride = 2**28
        storage = torch.zeros(block_stride * nb + T * H, device="cuda", dtype=torch.bfloat16)
        blocks = storage.as_strided((T, nb + 1, H), (H, block_stride, 1))
        gen = torch.Generator(device="cuda").manual_seed(0)
        for s in range(nb):
            blocks[:, s] = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
        assert nb * block_stride >= 2**31  # past the largest int32
        prefix = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
        delta = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
        nw = torch.rand(H, device="cuda", generator=gen).to(torch.bfloat16)
        pw = (torch.randn(H, device="cuda", generator=gen) / 20).to(torch.bfloat16)
        expected_prefix = (prefix.float() + delta.float()).to(torch.bfloat16)
        ref_blocks = blocks.clone()
        ref_blocks[:, nb] = expected_prefix
        out = torch.empty_like(prefix)
        # The bank has nb + 1 slots, the last one past 2**31: write the new prefix there.
        launch(prefix, blocks, nb, nw, pw, 1e-6, out, delta=delta, prefix_out=prefix,
               block_write_idx=nb)
        assert torch.equal(prefix, expected_prefix)
        assert torch.equal(blocks[:, nb], expected_prefix)
        c = replace(_K3, T=T, H=H, nb_max=nb + 1, num_blocks=nb, out_norm="none")
        check_mix_and_norm(c, prefix, ref_blocks, nw, pw, out, None, bf16_casts_truncate=False,
                           device="cuda", msg="int64")
