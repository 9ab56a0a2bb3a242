"""Two RMSNorms in one Triton launch (the MLA ``q_a_layernorm`` / ``kv_a_layernorm`` pair).

Each program normalizes ``ROWS`` rows of the first input and the same rows of the second,
so a decode step (T = 1) is one program instead of two kernel launches. Rows are read in
place through their row stride: ``kv_c`` is the first 512 columns of a 576-wide row and is
never copied. The two norms may differ in width, eps, row count and formulation.

Formulation (constexpr ``WEIGHT_IN_FP32``), matching ``k3fusion.reference.rms_norm``:

* False, cast-then-weight: ``y = (x32 * r).to(x.dtype) * w`` -- the normalized row is
  rounded to the input dtype *before* the weight multiply, exactly as the eager graph does;
* True, weight-in-fp32: ``y = (x32 * r * w32).to(x.dtype)``.

Sum of squares, rsqrt and products are fp32. Only this module imports Triton launch logic;
callers go through :func:`dual_rms_norm`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import check_launchable, cdiv

__all__ = ["dual_rms_norm", "pick_rows_per_program"]


@triton.jit
def _rms_norm_rows(
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
):
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
    w32 = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    if WEIGHT_IN_FP32:
        y = normed * w32[None, :]
    else:
        # The eager graph rounds to the input dtype before weighting; so do we.
        y = normed.to(x.dtype).to(tl.float32) * w32[None, :]
    tl.store(
        y_ptr + rows64[:, None] * y_row_stride + cols[None, :],
        y.to(y_ptr.dtype.element_ty),
        mask=mask,
    )


@triton.jit
def _dual_rms_norm_kernel(
    x1_ptr, w1_ptr, y1_ptr, n_rows1, x1_row_stride, y1_row_stride, n_cols1, eps1,
    x2_ptr, w2_ptr, y2_ptr, n_rows2, x2_row_stride, y2_row_stride, n_cols2, eps2,
    BLOCK_COLS1: tl.constexpr,
    BLOCK_COLS2: tl.constexpr,
    ROWS: tl.constexpr,
    WEIGHT_IN_FP32_1: tl.constexpr,
    WEIGHT_IN_FP32_2: tl.constexpr,
):
    row0 = tl.program_id(0) * ROWS
    if row0 < n_rows1:
        _rms_norm_rows(x1_ptr, w1_ptr, y1_ptr, row0, n_rows1, x1_row_stride, y1_row_stride,
                       n_cols1, eps1, BLOCK_COLS1, ROWS, WEIGHT_IN_FP32_1)
    if row0 < n_rows2:
        _rms_norm_rows(x2_ptr, w2_ptr, y2_ptr, row0, n_rows2, x2_row_stride, y2_row_stride,
                       n_cols2, eps2, BLOCK_COLS2, ROWS, WEIGHT_IN_FP32_2)


def pick_rows_per_program(n_rows: int, n_cols_total: int) -> int:
    """Rows per program: one at decode sizes (more programs in flight), more once
    there are enough rows to fill the GPU, so each program moves a few KB.

    Measured on an H200 (docs/benchmarks.md); a power of two.
    """
    if n_rows <= 1024:
        return 1
    target_elems = 4096
    rows = 1
    while rows * 2 * n_cols_total <= target_elems and rows < 8:
        rows *= 2
    return rows


def _num_warps(block_elems: int) -> int:
    # ~8-16 elements per thread keeps loads 16 bytes wide without register spills.
    return max(1, min(16, triton.next_power_of_2(block_elems) // 256))


def dual_rms_norm(
    x1: torch.Tensor,
    w1: torch.Tensor,
    eps1: float,
    x2: torch.Tensor,
    w2: torch.Tensor,
    eps2: float,
    y1: torch.Tensor,
    y2: torch.Tensor,
    weight_in_fp32_1: bool = False,
    weight_in_fp32_2: bool = False,
    rows_per_program: int = 0,
) -> None:
    """Launch the fused kernel on 2-D row views ``x1 [T1, N1]``, ``x2 [T2, N2]``.

    ``y1``/``y2`` are preallocated outputs with the same shapes (any row stride, last
    dim contiguous). Arguments are validated by the caller (``k3fusion.ops``); this
    only checks what the kernel itself needs.
    """
    check_launchable(x1, w1, y1, x2, w2, y2)
    n_rows1, n_cols1 = x1.shape
    n_rows2, n_cols2 = x2.shape
    n_rows = max(n_rows1, n_rows2)
    if n_rows == 0:
        return
    block1 = triton.next_power_of_2(n_cols1)
    block2 = triton.next_power_of_2(n_cols2)
    rows = rows_per_program or pick_rows_per_program(n_rows, n_cols1 + n_cols2)
    grid = (cdiv(n_rows, rows),)
    _dual_rms_norm_kernel[grid](
        x1, w1, y1, n_rows1, x1.stride(0), y1.stride(0), n_cols1, float(eps1),
        x2, w2, y2, n_rows2, x2.stride(0), y2.stride(0), n_cols2, float(eps2),
        BLOCK_COLS1=block1,
        BLOCK_COLS2=block2,
        ROWS=rows,
        WEIGHT_IN_FP32_1=bool(weight_in_fp32_1),
        WEIGHT_IN_FP32_2=bool(weight_in_fp32_2),
        num_warps=_num_warps(rows * max(block1, block2)),
    )
