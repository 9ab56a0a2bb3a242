"""The single RMSNorm: its Triton kernel through the launcher, and the ``k3fusion::rms_norm``
op (what the latent-MoE tail's unfused tiers call on CUDA), against
``k3fusion.reference.rms_norm``.

Same property test and tolerances as the dual kernel's (``test_qkv_rmsnorm_kernel``, whose
input strategy it shares), plus a drawn ``norm_dtype``: interpreted on CPU, compiled on a
CUDA machine, and the tail's real width (L = 3584) on the GPU.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from _tolerances import assert_matches_reference, assert_on_input_grid
from k3fusion import reference
from k3fusion.kernels.rms_norm import pick_launch_shape
from k3fusion.kernels.rms_norm import rms_norm as launch
from test_qkv_rmsnorm_kernel import DEVICE, INTERPRETED, Member, make_inputs, members

NORM_DTYPES = [None, torch.float32, torch.bfloat16, torch.float16]


def run_and_check(m: Member, rows_per_program: int, seed: int, norm_dtype=None, *,
                  bf16_casts_truncate: bool = INTERPRETED, device: str = DEVICE) -> None:
    gen = torch.Generator().manual_seed(seed)
    xp, x, w = make_inputs(m, gen, device)
    saved = (xp.clone(), w.clone())
    out_dtype = reference.rms_norm_out_dtype(m.x_dtype, m.w_dtype, m.weight_in_fp32, norm_dtype)
    yp = torch.full((m.rows, m.width + m.out_pad), float("nan"), dtype=out_dtype, device=device)
    y = yp[:, : m.width]

    launch(x, w, m.eps, y, m.weight_in_fp32, norm_dtype, rows_per_program=rows_per_program)

    assert torch.equal(saved[0], xp) and torch.equal(saved[1], w), "an input was modified"
    assert not y.isnan().any(), f"{int(y.isnan().sum())} elements never written"
    assert yp[:, m.width:].isnan().all(), "columns beside the row view were written"
    assert_matches_reference(y, x, w, m.eps, m.weight_in_fp32, norm_dtype=norm_dtype,
                             bf16_casts_truncate=bf16_casts_truncate,
                             msg=f"{m} norm_dtype={norm_dtype}")


_LATENT = Member(rows=5, width=112, pad=0, out_pad=0, x_dtype=torch.bfloat16, w_fp32=False,
                 weight_in_fp32=False, eps=1e-6, log2_scale=0, zero_row=False)


@given(m=members(), rows_per_program=st.sampled_from([0, 1, 2, 4]),
       norm_dtype=st.sampled_from(NORM_DTYPES), seed=st.integers(0, 2**31 - 1))
# The tail's latent scaled down (112 = 3584 / 32, not a power of two), one row, no rows,
# a strided view with an all-zero row and fp32 weight (fp32 output), and the graph pass's
# form: an fp32 latent rounded to bf16 (norm_dtype) before a bf16 weight.
@example(m=_LATENT, rows_per_program=0, norm_dtype=None, seed=0)
@example(m=Member(1, 112, 0, 0, torch.bfloat16, False, True, 1e-6, 0, False),
         rows_per_program=0, norm_dtype=None, seed=1)
@example(m=Member(0, 112, 0, 0, torch.float16, False, False, 1e-6, 0, False),
         rows_per_program=1, norm_dtype=None, seed=2)
@example(m=Member(67, 129, 64, 8, torch.bfloat16, True, False, 0.1, -6, True),
         rows_per_program=4, norm_dtype=None, seed=3)
@example(m=Member(9, 112, 8, 0, torch.float32, False, False, 1e-6, 0, False),
         rows_per_program=0, norm_dtype=torch.bfloat16, seed=4)
def test_kernel_matches_reference(m: Member, rows_per_program: int, norm_dtype, seed: int):
    if m.weight_in_fp32:
        norm_dtype = None  # norm_dtype is the cast-then-weight form's
    run_and_check(m, rows_per_program, seed, norm_dtype)


def test_norm_dtype_rounds_before_weighting() -> None:
    """An fp32 input normalized with ``norm_dtype=bf16`` and an fp32 weight: ``y / w`` is on
    the bf16 grid (without the cast it is not: the check fails on the fp32 form)."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(6, 100, generator=gen).to(DEVICE)
    w = (torch.rand(100, generator=gen) + 0.5).to(DEVICE)
    y = torch.empty_like(x)
    launch(x, w, 1e-6, y, norm_dtype=torch.bfloat16)
    assert_on_input_grid(y, w, torch.bfloat16)
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
    with pytest.raises(TypeError, match="x must be"):
        launch(x.double(), w, 1e-6, torch.empty_like(x))
    with pytest.raises(ValueError, match="one device"):
        launch(x, torch.ones(8, device="meta"), 1e-6, torch.empty_like(x))


def test_launch_shape() -> None:
    # the tail's latent (3584 -> 4096 columns): a row per program, 4 warps
    assert pick_launch_shape(4096) == (1, 4)
    # narrow rows are grouped into ~2048-element tiles
    assert pick_launch_shape(128) == (16, 2)
    assert pick_launch_shape(512) == (4, 2)
    assert pick_launch_shape(4096, rows_per_program=2, num_warps=8) == (2, 8)


# --------------------------------------------------------------- the op


@pytest.mark.parametrize("shape", [(2, 3, 112), (0, 112), (1, 112)])
@pytest.mark.parametrize("weight_in_fp32,norm_dtype", [(False, None), (True, None),
                                                       (False, torch.bfloat16)])
def test_op_matches_reference(shape, weight_in_fp32, norm_dtype) -> None:
    """The op on leading dims, T = 0 and 1, both forms and a norm_dtype (kernel in the
    interpreter on CPU): the reference's dtype and shape, contiguous, within tolerance."""
    gen = torch.Generator().manual_seed(len(shape))
    x_dtype = torch.float32 if norm_dtype is not None else torch.bfloat16
    x = torch.randn(*shape, generator=gen).to(DEVICE, x_dtype)
    w = (torch.rand(112, generator=gen) + 0.5).to(DEVICE, torch.bfloat16)
    y = torch.ops.k3fusion.rms_norm(x, w, 1e-6, weight_in_fp32, norm_dtype)
    want = reference.rms_norm(x, w, 1e-6, weight_in_fp32, norm_dtype)
    assert y.shape == want.shape and y.dtype == want.dtype and y.is_contiguous()
    assert_matches_reference(y.view(-1, 112), x.view(-1, 112), w, 1e-6, weight_in_fp32,
                             norm_dtype=norm_dtype, bf16_casts_truncate=INTERPRETED)


def test_op_fake_and_errors() -> None:
    x = torch.randn(4, 5, 112, dtype=torch.float32, device="meta")
    w = torch.ones(112, dtype=torch.bfloat16, device="meta")
    y = torch.ops.k3fusion.rms_norm(x, w, 1e-6, False, torch.bfloat16)
    assert y.shape == (4, 5, 112) and y.dtype == torch.bfloat16 and y.device.type == "meta"
    assert torch.ops.k3fusion.rms_norm(x, w.float(), 1e-6, True).dtype == torch.float32
    with pytest.raises(ValueError, match="cast-then-weight form only"):
        torch.ops.k3fusion.rms_norm(x, w, 1e-6, True, torch.bfloat16)
    with pytest.raises(TypeError, match="norm_dtype"):
        torch.ops.k3fusion.rms_norm(x, w, 1e-6, False, torch.float64)
    with pytest.raises(ValueError, match="w has 111 elements"):
        torch.ops.k3fusion.rms_norm(x, w[:111], 1e-6)
    with pytest.raises(ValueError, match="eps"):
        torch.ops.k3fusion.rms_norm(x, w, -1.0)


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's refusal")
def test_pdl_primary_needs_cuda() -> None:
    """A programmatic-dependent trigger is inline PTX: refused on CPU (the interpreter)
    before any launch, naming the argument."""
    x = torch.randn(3, 40)
    w = torch.ones(40)
    y = torch.empty_like(x)
    with pytest.raises(ValueError, match="pdl_primary=True needs a CUDA device"):
        launch(x, w, 1e-6, y, pdl_primary=True)
    launch(x, w, 1e-6, y)  # and runs without it
    torch.testing.assert_close(y, reference.rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("T", [1, 17, 64, 4099])
@pytest.mark.parametrize("weight_in_fp32", [False, True])
def test_tail_latent_width_on_gpu(T: int, weight_in_fp32: bool) -> None:
    """The tail's latent (3584 wide, bf16) at decode and prefill row counts, rows read
    through a stride (the first 3584 columns of 3600-wide rows)."""
    m = Member(T, 3584, 16, 8, torch.bfloat16, False, weight_in_fp32, 1e-6, 0, T > 1)
    run_and_check(m, 0, seed=T, bf16_casts_truncate=False, device="cuda")


@pytest.mark.cuda
def test_launch_on_the_tensors_device() -> None:
    """Data on the second GPU while the first is current: the launch runs on the data's
    device (Triton launches on the current one; the launcher switches to the tensors')."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    m = Member(33, 3584, 0, 0, torch.bfloat16, False, False, 1e-6, 0, False)
    with torch.cuda.device(0):
        run_and_check(m, 0, seed=5, bf16_casts_truncate=False, device="cuda:1")
        x = torch.randn(8, 3584, device="cuda:1", dtype=torch.bfloat16)
        w = torch.ones(3584, device="cuda:1", dtype=torch.bfloat16)
        y = torch.ops.k3fusion.rms_norm(x, w, 1e-6)
        torch.cuda.synchronize(1)
        assert_matches_reference(y, x, w, 1e-6, False, bf16_casts_truncate=False)


# --------------------------------------------------------------- norm + copy in one launch


@given(rows=st.integers(0, 9), width=st.sampled_from([1, 40, 112, 129]),
       copy_width=st.sampled_from([1, 48, 136, 200]), copy_tile=st.sampled_from([0, 64]),
       src_pad=st.sampled_from([0, 8]), dst_pad=st.sampled_from([0, 5]),
       dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
       seed=st.integers(0, 2**31 - 1))
@example(rows=5, width=112, copy_width=136, copy_tile=0, src_pad=0, dst_pad=0,
         dtype=torch.bfloat16, seed=0)
@example(rows=3, width=40, copy_width=200, copy_tile=64, src_pad=8, dst_pad=5,
         dtype=torch.float32, seed=1)
def test_copy_rides_the_norm_launch(rows, width, copy_width, copy_tile, src_pad, dst_pad,
                                    dtype, seed) -> None:
    """``copy=(src, dst)``: ``dst`` is ``src`` bit for bit (strided rows on both sides, the
    copy tile narrower than a row: the column loop), the columns beside ``dst``'s view are
    not written, and the norm is the plain launch's bit for bit."""
    from k3fusion.kernels import rms_norm as mod
    with pytest.MonkeyPatch.context() as mp:
        if copy_tile:
            mp.setattr(mod, "_COPY_TILE", copy_tile)
        _copy_case(rows, width, copy_width, src_pad, dst_pad, dtype, seed)


def _copy_case(rows, width, copy_width, src_pad, dst_pad, dtype, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=gen).to(DEVICE, torch.bfloat16)
    w = (torch.rand(width, generator=gen) + 0.5).to(DEVICE, torch.bfloat16)
    srcp = torch.randn(rows, copy_width + src_pad, generator=gen).to(DEVICE, dtype)
    src = srcp[:, :copy_width]
    dstp = torch.full((rows, copy_width + dst_pad), float("nan"), dtype=dtype, device=DEVICE)
    dst = dstp[:, :copy_width]
    saved = srcp.clone()
    y, plain = torch.empty_like(x), torch.empty_like(x)
    launch(x, w, 1e-6, y, copy=(src, dst))
    launch(x, w, 1e-6, plain)
    assert torch.equal(srcp, saved), "src was modified"
    assert torch.equal(dst, src), "the copy differs from src"
    assert dstp[:, copy_width:].isnan().all(), "columns beside dst's view were written"
    assert torch.equal(y, plain), "the norm differs from the plain launch's"


def test_copy_launch_errors() -> None:
    x = torch.randn(3, 8, device=DEVICE)
    w = torch.ones(8, device=DEVICE)
    y = torch.empty_like(x)
    s = torch.randn(3, 6, device=DEVICE)
    with pytest.raises(ValueError, match="x's 3 rows"):
        launch(x, w, 1e-6, y, copy=(s[:2], torch.empty(2, 6, device=DEVICE)))
    with pytest.raises(ValueError, match="one shape"):
        launch(x, w, 1e-6, y, copy=(s, torch.empty(3, 7, device=DEVICE)))
    with pytest.raises(TypeError, match="src is"):
        launch(x, w, 1e-6, y, copy=(s, torch.empty(3, 6, device=DEVICE, dtype=torch.bfloat16)))
    with pytest.raises(ValueError, match="contiguous in their last dim"):
        launch(x, w, 1e-6, y, copy=(torch.randn(6, 3, device=DEVICE).t(), torch.empty_like(s)))


@pytest.mark.parametrize("lead", [(2, 3), (0,), (1,)])
def test_norm_and_copy_op(lead) -> None:
    """``k3fusion::rms_norm_and_copy`` (kernel in the interpreter on CPU): the norm op's
    result bit for bit and a contiguous copy of ``other``; fake shapes; errors name
    ``other``."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(*lead, 112, generator=gen).to(DEVICE, torch.bfloat16)
    w = (torch.rand(112, generator=gen) + 0.5).to(DEVICE, torch.bfloat16)
    other = torch.randn(*lead, 150, generator=gen).to(DEVICE, torch.bfloat16)[..., :136]
    y, c = torch.ops.k3fusion.rms_norm_and_copy(x, w, 1e-6, other)
    assert torch.equal(y, torch.ops.k3fusion.rms_norm(x, w, 1e-6))
    assert torch.equal(c, other) and c.is_contiguous()
    assert other.numel() == 0 or c.data_ptr() != other.data_ptr(), "not a copy"
    meta = [t.to("meta") for t in (x, w, other)]
    fy, fc = torch.ops.k3fusion.rms_norm_and_copy(meta[0], meta[1], 1e-6, meta[2])
    assert fy.shape == x.shape and fc.shape == other.shape and fc.dtype == other.dtype
    with pytest.raises(ValueError, match="other must have x's leading dims"):
        torch.ops.k3fusion.rms_norm_and_copy(x, w, 1e-6, other[..., None, :])
    with pytest.raises(ValueError, match="other must be contiguous"):
        torch.ops.k3fusion.rms_norm_and_copy(torch.randn(2, 112, device=DEVICE), w, 1e-6,
                                             torch.randn(5, 2, device=DEVICE).t())
    with pytest.raises(TypeError, match="other must be a Tensor"):
        torch.ops.k3fusion.rms_norm_and_copy(x, w, 1e-6, None)


@pytest.mark.parametrize("path", ["reference", "kernel"])
def test_norm_and_copy_opcheck(path) -> None:
    """torch.library.opcheck: schema, fake impl and registrations agree (both CPU paths)."""
    from _kernel_paths import cpu_path

    gen = torch.Generator().manual_seed(11)
    x = torch.randn(3, 40, generator=gen).to(torch.bfloat16)
    w = (torch.rand(40, generator=gen) + 0.5).to(torch.bfloat16)
    other = torch.randn(3, 24, generator=gen).to(torch.bfloat16)
    with cpu_path(path):
        torch.library.opcheck(torch.ops.k3fusion.rms_norm_and_copy.default,
                              (x, w, 1e-6, other, False, None))


def test_copy_form_compiles_for_hopper_with_16_byte_accesses() -> None:
    """The launch with ``copy=`` at the tail's widths (L 3584 -> a 4096 block, H 7168 -> one
    8192 copy tile) compiles for sm_90, with the 16-divisibility hints real K3 launches get:
    every global access is 16 bytes wide (x, w and the copy's 8 per thread, 4 + 8 stores)."""
    from _ptx import run_compile_script

    script = """
import re
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from k3fusion.kernels.rms_norm import _rms_norm_kernel as k
names = [p.name for p in k.params]
const = dict(BLOCK_COLS=4096, ROWS=1, WEIGHT_IN_FP32=False, ROUND_DTYPE=tl.bfloat16,
             COPY=True, COPY_BLOCK=8192, COPY_ROWS=1, ZERO=False)
sig = {n: "constexpr" if n in const else "*bf16" if n.endswith("_ptr")
       else "fp32" if n.endswith("eps") else "i32" for n in names}
hinted = [n for n in names if n.endswith(("_ptr", "stride")) or n in ("n_cols", "n_copy_cols")]
src = ASTSource(fn=k, signature=sig, constexprs={(names.index(n),): v for n, v in const.items()},
                attrs={(names.index(n),): [["tt.divisibility", 16]] for n in hinted})
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
loads = re.findall(r"ld\\.global[^\\n]*", ptx)
stores = re.findall(r"st\\.global[^\\n]*", ptx)
print(sum(".v4" in l for l in loads), len(loads), sum(".v4" in s for s in stores), len(stores))
"""
    v4_loads, loads, v4_stores, stores = map(int, run_compile_script(script, "the copy form")
                                             .split())
    assert (v4_loads, v4_stores) == (16, 12) and loads == v4_loads and stores == v4_stores
