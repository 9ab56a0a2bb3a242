"""Two RMSNorms in one Triton launch (the MLA ``q_a_layernorm`` / ``kv_a_layernorm`` pair).

Programs take tiles of rows of either norm, side by side in one grid, so a decode step
(T = 1) is two programs running at once instead of two kernel launches in a row. Rows are read in
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

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._launch import cdiv, check_launchable, dependent_start, on_tensor_device, pdl_launch
from .rms_norm import rms_norm_rows

__all__ = ["dual_rms_norm", "pick_launch_shape", "LaunchShape", "DECODE_MAX_ROWS"]


@triton.jit
def _dual_rms_norm_kernel(
    x1_ptr, w1_ptr, y1_ptr, n_rows1, x1_row_stride, y1_row_stride, n_cols1, eps1,
    x2_ptr, w2_ptr, y2_ptr, n_rows2, x2_row_stride, y2_row_stride, n_cols2, eps2,
    n_programs1,
    BLOCK_COLS1: tl.constexpr,
    BLOCK_COLS2: tl.constexpr,
    ROWS1: tl.constexpr,
    ROWS2: tl.constexpr,
    WEIGHT_IN_FP32_1: tl.constexpr,
    WEIGHT_IN_FP32_2: tl.constexpr,
    PDL: tl.constexpr,
    WEIGHTS_EARLY: tl.constexpr,
):
    # Programs [0, n_programs1) take tiles of the first norm, the rest tiles of the
    # second: the two norms run side by side instead of one after the other, and each
    # program's tile is about the same size (ROWS2 = ROWS1 * BLOCK_COLS1 / BLOCK_COLS2).
    if not WEIGHTS_EARLY:
        dependent_start(PDL)
    pid = tl.program_id(0)
    if pid < n_programs1:
        w1 = _weight_row(w1_ptr, n_cols1, BLOCK_COLS1, WEIGHTS_EARLY)
        if WEIGHTS_EARLY:
            dependent_start(PDL)
        rms_norm_rows(x1_ptr, w1_ptr, y1_ptr, pid * ROWS1, n_rows1, x1_row_stride,
                      y1_row_stride, n_cols1, eps1, BLOCK_COLS1, ROWS1, WEIGHT_IN_FP32_1,
                      x1_ptr.dtype.element_ty, w1)
    else:
        w2 = _weight_row(w2_ptr, n_cols2, BLOCK_COLS2, WEIGHTS_EARLY)
        if WEIGHTS_EARLY:
            dependent_start(PDL)
        rms_norm_rows(x2_ptr, w2_ptr, y2_ptr, (pid - n_programs1) * ROWS2, n_rows2,
                      x2_row_stride, y2_row_stride, n_cols2, eps2, BLOCK_COLS2, ROWS2,
                      WEIGHT_IN_FP32_2, x2_ptr.dtype.element_ty, w2)


@triton.jit
def _weight_row(w_ptr, n_cols, BLOCK_COLS: tl.constexpr, EARLY: tl.constexpr):
    """``EARLY``: the weight row, loaded now -- before the PDL wait, so its latency overlaps
    the previous launch's tail (only where nothing that launch does writes the weights:
    the caller's promise, ``weights_early``); else None (loaded with the rows)."""
    if EARLY:
        cols = tl.arange(0, BLOCK_COLS)
        w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    else:
        w = None
    return w


@dataclass(frozen=True)
class LaunchShape:
    """How the rows are tiled: rows per program for each norm, and warps per program."""

    rows1: int
    rows2: int
    num_warps: int


#: Up to this many rows each program takes one row of either norm, with at least 4 warps:
#: at decode sizes the pair is latency-bound (docs/experiments.md, "2026-12-04: the q/kv
#: pair's decode launch shape").
DECODE_MAX_ROWS = 128


def pick_launch_shape(n_rows: int, block1: int, block2: int, rows_per_program: int = 0,
                      num_warps: int = 0) -> LaunchShape:
    """Tile sizes for ``n_rows`` rows (the larger of the two norms' row counts).

    Up to :data:`DECODE_MAX_ROWS` rows (nothing asked for): one row of either norm per
    program, ``max(4, wide / 1024)`` warps. Above: one row of the wider norm per program,
    and as many rows of the narrower one as make a tile of the same size;
    ``rows_per_program`` scales both (tests, tuning). About 8 elements per thread keeps
    loads 16 bytes wide without spilling.
    Measured: docs/benchmarks.md, "MLA q/kv RMSNorm pair (`qkv_rmsnorm`)".
    """
    wide, narrow = max(block1, block2), min(block1, block2)
    if not rows_per_program and not num_warps and n_rows <= DECODE_MAX_ROWS:
        return LaunchShape(1, 1, max(4, min(16, wide // 1024)))
    rows_big = rows_per_program or 1
    rows_small = rows_big * max(1, min(wide // narrow, 16))
    if n_rows <= 1:
        rows_small = rows_big  # a single row: nothing to group
    rows1, rows2 = (rows_big, rows_small) if block1 >= block2 else (rows_small, rows_big)
    warps = num_warps or max(1, min(16, rows_big * wide // 1024))
    return LaunchShape(rows1, rows2, warps)


@on_tensor_device
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
    num_warps: int = 0,
    pdl: bool | None = None,
    weights_early: bool = False,
) -> None:
    """Launch the fused kernel on 2-D row views ``x1 [T1, N1]``, ``x2 [T2, N2]``.

    ``y1``/``y2`` are preallocated outputs with the same shapes (any row stride, last
    dim contiguous). Arguments are validated by the caller (``k3fusion.ops``); this
    only checks what the kernel itself needs. ``rows_per_program``/``num_warps`` of 0
    pick by size (:func:`pick_launch_shape`). ``pdl``: launch as the previous launch's
    programmatic dependent (None: wherever the GPU can, :func:`_launch.pdl_launch`).
    ``weights_early``: load the weights before that launch's wait (faster at decode sizes);
    only for a caller that knows the launch before this one does not write ``w1``/``w2``.
    """
    check_launchable(x1, w1, y1, x2, w2, y2)
    pdl = pdl_launch(x1.device, pdl)
    n_rows1, n_cols1 = x1.shape
    n_rows2, n_cols2 = x2.shape
    if max(n_rows1, n_rows2) == 0:
        return
    block1 = triton.next_power_of_2(n_cols1)
    block2 = triton.next_power_of_2(n_cols2)
    shape = pick_launch_shape(max(n_rows1, n_rows2), block1, block2, rows_per_program, num_warps)
    n_programs1 = cdiv(n_rows1, shape.rows1)
    grid = (n_programs1 + cdiv(n_rows2, shape.rows2),)
    _dual_rms_norm_kernel[grid](
        x1, w1, y1, n_rows1, x1.stride(0), y1.stride(0), n_cols1, float(eps1),
        x2, w2, y2, n_rows2, x2.stride(0), y2.stride(0), n_cols2, float(eps2),
        n_programs1,
        BLOCK_COLS1=block1,
        BLOCK_COLS2=block2,
        ROWS1=shape.rows1,
        ROWS2=shape.rows2,
        WEIGHT_IN_FP32_1=bool(weight_in_fp32_1),
        WEIGHT_IN_FP32_2=bool(weight_in_fp32_2),
        PDL=pdl,
        WEIGHTS_EARLY=bool(weights_early),
        num_warps=shape.num_warps,
        **({"launch_pdl": True} if pdl else {}),
    )
