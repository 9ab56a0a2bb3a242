"""One RMSNorm over rows in one Triton launch, and the row routine the q/kv pair kernel shares.

The latent-MoE tail's unfused tiers (T above the fused tail) normalize the all-reduced
latent with this launch instead of the reference's eager op sequence: that sequence is
about eight kernels (cast, square, mean, add, rsqrt, scale, cast, weight), slower than
default Inductor's one fused norm (docs/experiments.md, "kernels/rms_norm.py").

Formulation, matching ``k3fusion.reference.rms_norm``: fp32 sum of squares, rsqrt and
products; cast-then-weight rounds the normalized row to ``ROUND_DTYPE`` (the input's
dtype, or the graph's ``norm_dtype``) before the weight multiply, weight-in-fp32 rounds
once at the end. The fp32 sum runs in another order than torch's ``mean``: the result
agrees with the reference to within that rounding, not bit for bit.

``copy=(src, dst)`` and the unspecialized row count: docs/design-notes.md, "kernels/rms_norm.py".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import TL_DTYPES, cdiv, check_launchable, gdc_launch_dependents, on_tensor_device

__all__ = ["rms_norm", "rms_norm_rows", "pick_launch_shape"]


@triton.jit
def rms_norm_rows(
    x_ptr,
    w_ptr,
    y_ptr,
    row0,
    n_rows,
    x_row_stride,
    y_row_stride,
    n_cols,
    eps,
    BLOCK_COLS: tl.constexpr,
    ROWS: tl.constexpr,
    WEIGHT_IN_FP32: tl.constexpr,
    ROUND_DTYPE: tl.constexpr,
    w_loaded=None,
):
    """Rows ``row0 .. row0 + ROWS`` of ``x`` (those below ``n_rows``), normalized into ``y``;
    ``w_loaded``: the weight row already loaded (fp32, ``[BLOCK_COLS]``) instead of ``w_ptr``."""
    rows = row0 + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    # int64 row offsets: T * stride overflows int32 at long prefill sizes.
    rows64 = rows.to(tl.int64)

    x = tl.load(x_ptr + rows64[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0)
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, axis=1) / n_cols + eps)
    normed = x32 * inv_rms[:, None]
    if w_loaded is None:
        w32 = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    else:
        w32 = w_loaded
    if WEIGHT_IN_FP32:
        y = normed * w32[None, :]
    else:
        # The eager graph rounds the normalized row before weighting; so do we.
        y = normed.to(ROUND_DTYPE).to(tl.float32) * w32[None, :]
    tl.store(
        y_ptr + rows64[:, None] * y_row_stride + cols[None, :],
        y.to(y_ptr.dtype.element_ty),
        mask=mask,
    )


@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_kernel(
    x_ptr, w_ptr, y_ptr, n_rows, x_row_stride, y_row_stride, n_cols, eps,
    src_ptr, dst_ptr, src_row_stride, dst_row_stride, n_copy_cols,
    zero_ptr, n_zero,
    BLOCK_COLS: tl.constexpr,
    ROWS: tl.constexpr,
    WEIGHT_IN_FP32: tl.constexpr,
    ROUND_DTYPE: tl.constexpr,
    COPY: tl.constexpr,
    COPY_BLOCK: tl.constexpr,
    COPY_ROWS: tl.constexpr,
    PDL: tl.constexpr = False,
    ZERO: tl.constexpr = False,
):
    """The first ``cdiv(n_rows, ROWS)`` programs normalize rows. With ``COPY`` the programs
    after them copy ``src [n_rows, n_copy_cols]`` into ``dst``, ``COPY_ROWS`` rows each: the
    tail's unfused tiers get the buffer cuBLAS beta-adds into from the norm's own launch
    (separate programs, so the copy's loads are in flight with the norm's, not after them).
    ``PDL``: let the next kernel, launched as this one's programmatic dependent, start now
    (it waits for this grid's results before reading them). ``ZERO``: program 0 also sets
    the ``n_zero`` int32 words at ``zero_ptr`` to 0 (the next launch's counters)."""
    if PDL:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    if ZERO:
        if pid == 0:
            for z0 in range(0, n_zero, 1024):
                offs = z0 + tl.arange(0, 1024)
                tl.store(zero_ptr + offs, tl.zeros([1024], dtype=tl.int32), mask=offs < n_zero)
    n_norm = tl.cdiv(n_rows, ROWS)
    if pid < n_norm:
        rms_norm_rows(x_ptr, w_ptr, y_ptr, pid * ROWS, n_rows, x_row_stride,
                      y_row_stride, n_cols, eps, BLOCK_COLS, ROWS, WEIGHT_IN_FP32, ROUND_DTYPE)
    elif COPY:
        rows = (pid - n_norm) * COPY_ROWS + tl.arange(0, COPY_ROWS)
        rows64 = rows.to(tl.int64)
        row_mask = rows < n_rows
        for c0 in range(0, n_copy_cols, COPY_BLOCK):
            cols = c0 + tl.arange(0, COPY_BLOCK)
            mask = row_mask[:, None] & (cols < n_copy_cols)[None, :]
            v = tl.load(src_ptr + rows64[:, None] * src_row_stride + cols[None, :], mask=mask)
            tl.store(dst_ptr + rows64[:, None] * dst_row_stride + cols[None, :], v, mask=mask)


#: Widest copy tile: 8192 elements (64 per thread at 4 warps: 16-byte loads, no loop at the
#: tail's H = 7168).
_COPY_TILE = 8192


def pick_launch_shape(block_cols: int, rows_per_program: int = 0,
                      num_warps: int = 0) -> tuple[int, int]:
    """``(rows per program, warps)``: rows narrower than 2048 columns are grouped into a
    tile of about 2048 elements (at most 16 rows), and a warp takes 1024 tile elements
    (32 per thread: 16-byte loads, no spills; the q/kv pair kernel's per-warp budget)."""
    rows = rows_per_program or max(1, min(16, 2048 // block_cols))
    warps = num_warps or max(1, min(16, rows * block_cols // 1024))
    return rows, warps


@on_tensor_device
def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, y: torch.Tensor,
             weight_in_fp32: bool = False, norm_dtype: torch.dtype | None = None,
             rows_per_program: int = 0, num_warps: int = 0,
             copy: tuple[torch.Tensor, torch.Tensor] | None = None,
             pdl_primary: bool = False, zero: torch.Tensor | None = None) -> None:
    """Launch on the 2-D row view ``x [T, N]`` into the preallocated ``y [T, N]`` (any row
    strides, last dims contiguous). ``norm_dtype``: cast-then-weight's rounding dtype when
    it is not ``x``'s. ``copy=(src, dst)``: also copy ``src [T, M]`` into ``dst [T, M]``
    (one dtype, any row strides, last dims contiguous) in the same launch.
    ``pdl_primary``: the next launch is this one's programmatic dependent (refused off CUDA;
    sm_90+ is the caller's to check). ``zero``: a 1-D int32 tensor (contiguous, on ``x``'s
    device) the launch also fills with 0: the next launch's split-K counters, with no memset
    launch of their own. Arguments are validated by the caller; this checks only what the
    launch itself needs."""
    src, dst = (x, y) if copy is None else copy
    check_launchable(x, w, y, src, dst)
    if x.dim() != 2 or y.shape != x.shape:
        raise ValueError(f"x and y must be 2-D row views of one shape, got {tuple(x.shape)} "
                         f"and {tuple(y.shape)}")
    if copy is not None:
        if src.dim() != 2 or dst.shape != src.shape or src.shape[0] != x.shape[0]:
            raise ValueError(f"copy=(src, dst) must be 2-D row views of one shape with x's "
                             f"{x.shape[0]} rows, got {tuple(src.shape)} and {tuple(dst.shape)}")
        if src.dtype != dst.dtype:
            raise TypeError(f"copy: src is {src.dtype} but dst is {dst.dtype}")
        if src.shape[1] > 1 and (src.stride(1) != 1 or dst.stride(1) != 1):
            raise ValueError("copy: src and dst must be contiguous in their last dim")
    if zero is not None and (zero.dtype != torch.int32 or zero.dim() != 1
                             or zero.stride(0) != 1 or zero.device != x.device):
        raise ValueError(f"zero must be a contiguous 1-D int32 tensor on {x.device}, got "
                         f"{zero.dtype} {tuple(zero.shape)} on {zero.device}")
    if norm_dtype is not None and weight_in_fp32:
        raise ValueError("norm_dtype applies to the cast-then-weight form only")
    if x.dtype not in TL_DTYPES:
        raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    if norm_dtype is not None and norm_dtype not in TL_DTYPES:
        raise TypeError(f"norm_dtype must be float32, bfloat16 or float16, got {norm_dtype}")
    if pdl_primary and (x.device.type != "cuda" or gdc_launch_dependents is None):
        raise ValueError("pdl_primary=True needs a CUDA device and a Triton with "
                         "triton.language.extra.cuda.gdc_launch_dependents")
    round_dtype = x.dtype if norm_dtype is None else norm_dtype
    n_rows, n_cols = x.shape
    if n_rows == 0:
        if zero is not None:
            zero.zero_()
        return
    block = triton.next_power_of_2(n_cols)
    rows, warps = pick_launch_shape(block, rows_per_program, num_warps)
    n_copy = src.shape[1] if copy is not None else 0
    copy_block = min(triton.next_power_of_2(max(n_copy, 1)), _COPY_TILE)
    copy_rows = max(1, min(16, _COPY_TILE // copy_block))
    programs = cdiv(n_rows, rows) + (cdiv(n_rows, copy_rows) if n_copy else 0)
    _rms_norm_kernel[(programs,)](
        x, w, y, n_rows, x.stride(0), y.stride(0), n_cols, float(eps),
        src, dst, src.stride(0), dst.stride(0), n_copy,
        x if zero is None else zero, 0 if zero is None else zero.numel(),
        BLOCK_COLS=block, ROWS=rows, WEIGHT_IN_FP32=bool(weight_in_fp32),
        ROUND_DTYPE=TL_DTYPES[round_dtype], COPY=n_copy > 0, COPY_BLOCK=copy_block,
        COPY_ROWS=copy_rows, PDL=bool(pdl_primary), ZERO=zero is not None, num_warps=warps,
    )
