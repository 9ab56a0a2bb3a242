"""The small-T latent-MoE tail in one Triton launch (the ``TAIL_FUSION`` tier, tp = 1)::

    out[T, H] = shared[T, H] + rms_norm(routed[T, L], norm_w[L], eps) @ up_w[H, L].T

For decode-sized T (Kimi-K3: L = 3584, H = 7168, bf16) the op is bound by reading
``up_w`` (51 MB) once; the token rows are tiny and stay in L2. Default Inductor runs a
norm kernel, then a cuBLAS ``addmm``; this kernel does both in one pass over ``up_w``.

Grid: ``(cdiv(H, BLOCK_N), SPLIT_K)``: a norm prologue over the token rows, a main loop
streaming ``up_w`` tiles against the normalized, rounded token tile, and an epilogue
adding ``shared`` in fp32 (one rounding). Constexpr forms of the same kernel: ``SPLIT_K``,
``SWAP_AB``, ``GEMV``, ``NORMED_IN`` / ``INV_RMS_IN`` / ``PDL`` (a norm or 1/rms launch
first), row tiles (``M_FIRST``), ``DOT_IN_FP32`` (the interpreter);
:func:`pick_launch_config` picks the default :class:`LaunchConfig`.

Each form's design and the interpreter's constraints: docs/design-notes.md, "kernels/moe_tail.py".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from k3fusion.moe_tail_args import check_latent_moe_tail_args

from ._fences import fence_gpu
from ._launch import (TL_DTYPES, DEFAULT_SMS, kernels_are_interpreted, cdiv,
                      gdc_launch_dependents, gdc_wait, interpreter_enabled, may_overlap, num_sms, same_view,
                      on_tensor_device, pdl_available)
from ._scratch import launch_scratch
from .rms_norm import rms_norm

__all__ = ["MAX_TOKENS", "LaunchConfig", "pick_launch_config", "resolve_config",
           "latent_moe_tail_fused", "check_fused_tail_args", "num_sms", "block_m_for",
           "gemv_block_k"]

#: Largest token count the kernel takes (``BLOCK_M``: T padded to a power of two, >= 16 for a dot).
#: Tier selection stops earlier: at the implementation's measured limit
#: (``k3fusion.moe_tail.TRITON_SELECT_MAX_TOKENS``) and ``FusionConfig.fused_tail_max_tokens``.
MAX_TOKENS = 64

@triton.jit
def _inv_rms(sum_sq, row_mask, L, eps):
    # Padded rows: 0, not rsqrt(eps) (inf when eps == 0, and 0 * inf = NaN).
    return tl.where(row_mask, tl.rsqrt(sum_sq / L + eps), 0.0)


@triton.jit
def _store_out(acc, s_ptr, s_stride, y_ptr, y_stride, rows64, cols, mask):
    """``y = (acc + shared)`` rounded once to the output dtype."""
    s = tl.load(s_ptr + rows64[:, None] * s_stride + cols[None, :], mask=mask, other=0.0)
    y = acc + s.to(tl.float32)
    tl.store(y_ptr + rows64[:, None] * y_stride + cols[None, :],
             y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _copy_rest(sf_ptr, yf_ptr, s_stride, y_stride, pid_m, pid_r, T, COL0, H, H_FULL,
               BLOCK_M: tl.constexpr, REST_BLOCK: tl.constexpr):
    """``y[rows, c] = shared[rows, c]`` for this program's ``REST_BLOCK`` of the columns
    outside ``[COL0, COL0 + H)``, numbered left to right."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows64 = rows.to(tl.int64)
    rest = pid_r * REST_BLOCK + tl.arange(0, REST_BLOCK)
    cols = tl.where(rest < COL0, rest, rest + H)
    mask = (rows < T)[:, None] & (rest < H_FULL - H)[None, :]
    v = tl.load(sf_ptr + rows64[:, None] * s_stride + cols[None, :], mask=mask)
    tl.store(yf_ptr + rows64[:, None] * y_stride + cols[None, :], v, mask=mask)


# T: one binary for every T of a BLOCK_M (no separate T == 1 compile); SPLIT_STRIDE: a
# tensor even when T * H == 1, so .to(int64) works.
@triton.jit(do_not_specialize=["T", "SPLIT_STRIDE"])
def _moe_tail_kernel(
    x_ptr, x_stride,            # routed latent [T, L]
    w_ptr,                      # norm weight [L]
    up_ptr, up_stride,          # up-projection [H, L]
    s_ptr, s_stride,            # shared [T, H]
    y_ptr, y_stride,            # out [T, H]
    sf_ptr, yf_ptr,             # COPY_REST: the [T, H_FULL] rows s_ptr / y_ptr start COL0 into
    ws_ptr,                     # split-K partials [SPLIT_K, T, H] fp32 (unused if SPLIT_K == 1)
    lock_ptr,                   # split-K arrival counters [>= m tiles * cdiv(H, BLOCK_N)] int32
    rinv_ptr,                   # INV_RMS_IN: every row's inverse RMS [T] fp32 (else unused)
    T, L, H,
    eps,
    K_PER_SPLIT,                # columns of L per split (a multiple of BLOCK_K)
    SPLIT_STRIDE,               # T * H: one split's partials in the workspace
    COL0, H_FULL,               # COPY_REST: this GEMM's columns start at COL0 of H_FULL
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM_BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SWAP_AB: tl.constexpr,      # accumulate out.T = up_w_tile @ h.T (weights as the M side)
    GEMV: tl.constexpr,         # per-token FMAs on CUDA cores instead of a tensor-core dot
    NUM_STAGES: tl.constexpr,   # the main loop's software-pipelining depth
    WEIGHT_IN_FP32: tl.constexpr,
    NORM_DTYPE: tl.constexpr,   # cast-then-weight: the normalized row's dtype
    DOT_IN_FP32: tl.constexpr,
    GPU_FENCE: tl.constexpr,
    INV_RMS_IN: tl.constexpr = False,  # 1/rms from a prologue launch (_row_inv_rms_kernel)
    M_FIRST: tl.constexpr = False,     # grid (m tiles, SPLIT_K, n tiles): row tiles fastest
    PDL: tl.constexpr = False,         # launched as the prologue's programmatic dependent
    NORMED_IN: tl.constexpr = False,   # x_ptr holds the GEMM input h (a norm launch's output)
    COPY_REST: tl.constexpr = False,   # extra programs copy shared's other H_FULL - H columns
    REST_BLOCK: tl.constexpr = 16,     # columns a COPY_REST program copies
    RMS_IN_LOOP: tl.constexpr = False, # sum of squares in the main loop, 1/rms in the epilogue
):
    if PDL:
        # Launched while the prologue launch still runs: wait for it (and, through it, for
        # everything before it in the stream) before reading any input.
        gdc_wait()
    # Grid (n tiles, SPLIT_K, m tiles), or with M_FIRST (m tiles, SPLIT_K, n tiles): the
    # programs in flight then share weight columns instead of token rows (large T).
    if M_FIRST:
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(2)
    else:
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(2)
    pid_k = tl.program_id(1)
    n_tiles = tl.cdiv(H, BLOCK_N)
    if COPY_REST:
        # A column shard written into a fresh [T, H_FULL] buffer: the programs past the
        # GEMM's tiles copy the columns outside it (no separate copy launch before this one).
        if pid_n >= n_tiles:
            if pid_k == 0:
                _copy_rest(sf_ptr, yf_ptr, s_stride, y_stride, pid_m, pid_n - n_tiles, T,
                           COL0, H, H_FULL, BLOCK_M, REST_BLOCK)
            return
    tile_id = pid_m * n_tiles + pid_n  # this (row tile, column tile)'s split-K counter

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < T
    # int64 offsets: row * stride overflows int32 for wide rows at large strides.
    rows64 = rows.to(tl.int64)
    x_rows = x_ptr + rows64[:, None] * x_stride

    # ---- 1. norm prologue: sum of squares over the full row (all of L, whatever split).
    # Pipelined explicitly: a loop without a dot is not pipelined by default, and every
    # step would then wait a full L2 round trip before the weight stream even starts.
    if NORMED_IN:
        inv_rms = 0.0  # the rows arrive normalized, weighted and rounded: nothing to do
    elif RMS_IN_LOOP:
        inv_rms = 0.0  # the sum of squares rides along with the main loop
    elif INV_RMS_IN:
        # Computed once per row by a prologue launch: no program re-reads the rows for it,
        # so split-K can spread the weight stream over every SM without a prologue each.
        inv_rms = tl.load(rinv_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    else:
        sq = tl.zeros([BLOCK_M, NORM_BLOCK_K], dtype=tl.float32)
        for k0 in tl.range(0, L, NORM_BLOCK_K, num_stages=4):
            ks = k0 + tl.arange(0, NORM_BLOCK_K)
            x = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & (ks < L)[None, :],
                        other=0.0)
            x32 = x.to(tl.float32)
            sq += x32 * x32
        inv_rms = _inv_rms(tl.sum(sq, axis=1), row_mask, L, eps)

    # ---- 2. stream this program's up_w tile over its K range.
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < H
    up_rows = up_ptr + cols.to(tl.int64)[:, None] * up_stride
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, L)
    if GEMV:
        # Summed over K once, after the loop: no reduction per step. One token: a 2-D
        # accumulator the token row broadcasts into (the 3-D form's expand_dims of the
        # weight tile costs a layout conversion per step; docs/experiments.md).
        if BLOCK_M == 1:
            acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        else:
            acc3 = tl.zeros([BLOCK_N, BLOCK_M, BLOCK_K], dtype=tl.float32)
    elif SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if RMS_IN_LOOP:
        sq_loop = tl.zeros([BLOCK_M], dtype=tl.float32)  # (a 2-D one: 128 registers at 64 rows)
    # Pipelined explicitly: Triton pipelines a loop with a dot by itself (at the launch's
    # num_stages, the same depth), but not the GEMV form's dot-free loop.
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < L
        x = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if NORMED_IN:
            # Straight from memory into the dot: no per-program work on the token tile.
            a = x
        elif RMS_IN_LOOP:
            # The row's sum of squares rides along with the weight stream (every program
            # sees all of L: SPLIT_K == 1); 1/rms is a per-row scale applied after the dot.
            w = tl.load(w_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
            x32 = x.to(tl.float32)
            sq_loop += tl.sum(x32 * x32, axis=1)
            a = (x32 * w[None, :]).to(up_ptr.dtype.element_ty)
        else:
            w = tl.load(w_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
            normed = x.to(tl.float32) * inv_rms[:, None]
            if WEIGHT_IN_FP32:
                h = normed * w[None, :]
            else:
                # The eager graph rounds the normalized row (to the input dtype, unless
                # norm_dtype says otherwise) before weighting.
                h = normed.to(NORM_DTYPE).to(tl.float32) * w[None, :]
            # The GEMM input the reference hands cuBLAS: h in up_w's dtype.
            a = h.to(up_ptr.dtype.element_ty)
        b = tl.load(up_rows + ks[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        if GEMV:
            # Products of 16-bit values are exact in fp32, as in the tensor-core dot.
            if BLOCK_M == 1:
                acc2 += b.to(tl.float32) * a.to(tl.float32)  # [1, BLOCK_K] broadcast
            else:
                acc3 += b.to(tl.float32)[:, None, :] * a.to(tl.float32)[None, :, :]
        elif SWAP_AB:
            # Weight rows as the dot's M side (>= 64: Hopper's wgmma reads them straight
            # from shared memory), the few token rows as its N side.
            if DOT_IN_FP32:
                acc = tl.dot(b.to(tl.float32), tl.trans(a.to(tl.float32)), acc,
                             input_precision="ieee")
            else:
                acc = tl.dot(b, tl.trans(a), acc)
        elif DOT_IN_FP32:
            acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc,
                         input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(b), acc)  # 16-bit operands, fp32 accumulation
    if GEMV:
        if BLOCK_M == 1:
            acc = tl.trans(tl.sum(acc2, axis=1)[:, None])
        else:
            acc = tl.trans(tl.sum(acc3, axis=2))
    elif SWAP_AB:
        acc = tl.trans(acc)
    if RMS_IN_LOOP:
        acc = acc * _inv_rms(sq_loop, row_mask, L, eps)[:, None]

    out_mask = row_mask[:, None] & col_mask[None, :]
    # ---- 3. epilogue.
    if SPLIT_K == 1:
        _store_out(acc, s_ptr, s_stride, y_ptr, y_stride, rows64, cols, out_mask)
    else:
        tile = rows64[:, None] * H + cols[None, :]
        split_stride = SPLIT_STRIDE.to(tl.int64)
        tl.store(ws_ptr + pid_k * split_stride + tile, acc, mask=out_mask)
        if GPU_FENCE:
            fence_gpu()
        tl.debug_barrier()  # every thread has stored (and fenced) before the one arrival
        arrived = tl.atomic_add(lock_ptr + tile_id, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # the last program of this column tile
            if GPU_FENCE:
                fence_gpu()
            tl.debug_barrier()
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):  # split order: deterministic
                # .cg: read L2 (where the other SMs' stores are), never a stale L1 line.
                total += tl.load(ws_ptr + s * split_stride + tile, mask=out_mask, other=0.0,
                                 cache_modifier=".cg")
            _store_out(total, s_ptr, s_stride, y_ptr, y_stride, rows64, cols, out_mask)
            tl.atomic_xchg(lock_ptr + tile_id, 0, sem="relaxed", scope="gpu")  # next launch


@triton.jit(do_not_specialize=["T"])
def _row_inv_rms_kernel(x_ptr, x_stride, rinv_ptr, T, L, eps,
                        ROWS: tl.constexpr, BLOCK_L: tl.constexpr, PDL: tl.constexpr = False):
    """``rinv[t] = 1 / sqrt(mean(x[t]^2) + eps)`` in fp32 for ``ROWS`` rows per program:
    the prologue launch of the ``prenorm`` forms (``T x L`` read once, from L2 at decode).
    ``PDL``: let the tail kernel launch now (it waits for this grid before reading)."""
    if PDL:
        gdc_launch_dependents()
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < T
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_stride
    sq = tl.zeros([ROWS, BLOCK_L], dtype=tl.float32)
    for k0 in tl.range(0, L, BLOCK_L, num_stages=3):
        ks = k0 + tl.arange(0, BLOCK_L)
        x = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & (ks < L)[None, :], other=0.0)
        x32 = x.to(tl.float32)
        sq += x32 * x32
    tl.store(rinv_ptr + rows, _inv_rms(tl.sum(sq, axis=1), row_mask, L, eps), mask=row_mask)


# ---------------------------------------------------------------------- launch options


@dataclass(frozen=True)
class LaunchConfig:
    """One launch shape. ``block_n``/``block_k``: output columns / L columns per main-loop
    step of a program; ``norm_block_k``: L columns per norm-prologue step (all powers of
    two >= 16); ``split_k``: programs per column tile (>= 1); ``num_warps``/``num_stages``:
    Triton's."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int
    norm_block_k: int
    #: Compute ``out.T = up_w_tile @ h.T``: the weight tile is the dot's M side.
    swap_ab: bool = False
    #: Per-token FMAs on CUDA cores instead of a tensor-core dot (``swap_ab`` then False).
    gemv: bool = False
    #: Every row's 1/rms in a prologue launch (``_row_inv_rms_kernel``) instead of each
    #: program's own norm prologue; the normalized tile is formed as before (same roundings).
    prenorm: bool = False
    #: Token rows per program (0: T padded, one row tile); a third grid dimension of
    #: ``cdiv(T, block_m)`` row tiles -- the form for T above MAX_TOKENS.
    block_m: int = 0
    #: Row tiles as the fastest grid dimension (programs in flight share weight columns).
    m_first: bool = False
    #: ``prenorm`` or ``normed_rows`` only: launch the tail kernel as the prologue's
    #: programmatic dependent (sm_90+; no launch gap between the two). The interpreter runs
    #: the two launches one after the other.
    pdl: bool = False
    #: Every row normalized by a norm launch (``kernels/rms_norm.py``: the same roundings)
    #: into a ``[T, L]`` buffer in ``up_w``'s dtype; the tail kernel is then a GEMM + add on
    #: it, its token tiles going straight from memory into the dot.
    normed_rows: bool = False
    #: One launch, no norm prologue: each program sums the squares of the rows while it
    #: streams its weights and scales its outputs by 1/rms (needs split_k 1).
    rms_in_loop: bool = False


def block_m_for(tokens: int, gemv: bool = False) -> int:
    """Rows of a program's tiles: T padded to a power of two, >= 16 (``tl.dot``'s minimum)
    unless the GEMV form runs (no dot)."""
    return max(1 if gemv else 16, triton.next_power_of_2(max(tokens, 1)))


#: Up to this many tokens the automatic choice takes the GEMV form (16-bit weights)
#: (docs/experiments.md, "2026-11-29: the GEMV form for one token"; summary: "kernels/moe_tail.py").
GEMV_MAX_TOKENS = 1
#: Outputs at most this wide (a column-parallel shard: 7168 / 8 = 896 columns) take the GEMV
#: form up to NARROW_GEMV_MAX_TOKENS tokens, in tiles of down to 8 columns
#: (docs/experiments.md, "2026-12-04: the column-parallel shard's launch shapes").
NARROW_HIDDEN = 1024
NARROW_GEMV_MAX_TOKENS = 4
#: The GEMV form's accumulator elements per program (``BLOCK_N * BLOCK_M * BLOCK_K``): 64
#: fp32 registers per thread at 4 warps -- kept where ``block_k`` can still shrink (>= 16).
_GEMV_ACC_ELEMENTS = 8192


def gemv_block_k(block_n: int, block_m: int, latent: int) -> int:
    """The GEMV form's ``block_k``: the accumulator budget over the tile's other two dims."""
    l_pow2 = max(16, triton.next_power_of_2(latent))
    return min(max(16, _GEMV_ACC_ELEMENTS // (block_n * block_m)), l_pow2)


def pick_launch_config(tokens: int, hidden: int, latent: int, dtype: torch.dtype,
                       num_sms: int = DEFAULT_SMS, gemv: bool | None = None) -> LaunchConfig:
    """The default launch shape for a ``[tokens, latent] -> [tokens, hidden]`` tail
    (``gemv``: None for the measured choice of form, True/False for that form's shape).

    GEMV form (T <= :data:`GEMV_MAX_TOKENS`, 16-bit weights): 32-column tiles, ``block_k``
    256 at T = 1 (halved per doubling of T, down to 16: an 8K-element accumulator up to
    T = 16), 4 warps, 3 stages -- the fastest of eleven shapes at T = 1. Outputs of at most
    :data:`NARROW_HIDDEN` columns (a tp = 8 shard) take it up to
    :data:`NARROW_GEMV_MAX_TOKENS` tokens, in tiles halved down to 8 columns until about
    3/4 of the SMs have one, 4 stages at T = 1 and 5 above.

    Dot form (``--sweep``): 64-column tiles (112 programs) without split-K, ``block_k`` 256,
    4 warps, 4 stages were fastest at T = 1, 8 and 16; ``norm_block_k`` 512 there (8K
    prologue elements: 64 fp32 accumulators per thread at 4 warps). 16-bit weights take
    the ``swap_ab`` operand order (split-K forms were slower at every T).
    The numbers: docs/experiments.md, "kernels/moe_tail.py". Wider tiles mean fewer programs, each re-reading the token rows in its prologue
    once for more weight columns, and more weight bytes in flight per program. Below 64
    tiles (small ``H``) split-K fills the SMs (at most 4 ways in the norm-launch form, 8
    otherwise). fp32 weights: ``block_k`` 64 (their dot runs on FMA units, not tensor
    cores), 3 stages. Up to :data:`PDL_MAX_BLOCK_M` token rows (16-bit weights): every row
    normalized by a norm launch and the tail kernel, a GEMM + add on those rows, launched
    as its programmatic dependent (``normed_rows``, ``pdl``), where :func:`pdl_available`;
    bf16 weights up to :data:`LOOP_RMS_MAX_BLOCK_M` rows instead take one launch that sums
    the rows' squares in its main loop (``rms_in_loop``).
    """
    two_byte = dtype in (torch.bfloat16, torch.float16)
    narrow = hidden <= NARROW_HIDDEN
    if gemv is None:
        gemv = two_byte and tokens <= (NARROW_GEMV_MAX_TOKENS if narrow else GEMV_MAX_TOKENS)
    block_m = block_m_for(tokens, gemv)
    l_pow2 = max(16, triton.next_power_of_2(latent))
    norm_block_k = min(max(16, 8192 // block_m), l_pow2)  # 64 fp32 per thread
    if gemv:
        block_n = 32
        # Narrow outputs: narrower tiles before split-K, so about every SM streams its own
        # rows with no split-K workspace round trip.
        while narrow and block_n > 8 and cdiv(hidden, block_n) < num_sms * 3 // 4:
            block_n //= 2
        block_k = gemv_block_k(block_n, block_m, latent)
    else:
        block_n = 64
        block_k = min(256 if two_byte else 64, l_pow2)
    tiles = cdiv(hidden, block_n)
    # The norm-launch form (below) for up to PDL_MAX_BLOCK_M 16-bit token rows.
    normed = not gemv and two_byte and block_m <= PDL_MAX_BLOCK_M
    split_k = 1
    if tiles < 64:
        split_k = max(1, min(4 if normed else 8, cdiv(num_sms, tiles), cdiv(latent, block_k)))
    # swap_ab: the weight tile as the dot's M side (docs/experiments.md), measured faster
    # at BLOCK_M = 16 and 32, and only for tiles whose pipeline fits (resolve_config).
    if gemv:
        stages = (4 if block_m == 1 else 5) if block_n < 32 else 3
        return LaunchConfig(block_n=block_n, block_k=block_k, num_warps=4, num_stages=stages,
                            split_k=split_k, norm_block_k=norm_block_k, gemv=True)
    if dtype == torch.bfloat16 and block_m <= LOOP_RMS_MAX_BLOCK_M and split_k == 1:
        # One launch: the rows' sums of squares ride along with the weight stream.
        return LaunchConfig(block_n=block_n, block_k=block_k, num_warps=4, num_stages=4,
                            split_k=1, norm_block_k=norm_block_k, swap_ab=True,
                            rms_in_loop=True)
    # The rows normalized by a norm launch, the tail kernel its programmatic dependent: the
    # second launch's start hides behind the first (resolve_config drops it where PDL is
    # absent).
    pdl = normed
    return LaunchConfig(block_n=block_n, block_k=block_k, num_warps=4,
                        num_stages=4 if two_byte else 3, split_k=split_k,
                        norm_block_k=norm_block_k,
                        swap_ab=two_byte and block_m in (16, 32), normed_rows=pdl, pdl=pdl)


#: bf16 dot-form launches of up to this many token rows (T 2-16) take the ``rms_in_loop``
#: form by default (docs/experiments.md, "2026-12-06: the sums of squares in the main loop").
LOOP_RMS_MAX_BLOCK_M = 16
#: Dot-form launches of up to this many token rows take the PDL norm-launch form by default
#: (docs/experiments.md, "2026-12-02: the tail as a norm launch + a GEMM (issue 17)").
PDL_MAX_BLOCK_M = 32


#: Most bytes of pipeline stages (weight and token tiles) for which the automatic choice
#: swaps the dot's operands (sm_90 allows 227 KiB of shared memory per block; the rest is
#: for the epilogue). The default at 32 token rows takes 192 KiB.
SWAP_AB_SMEM_BYTES = 200 * 1024


def _check_option(name: str, value, *, power_of_two: bool = False, low: int = 1,
                  high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value == 0:
        return  # 0: the heuristic's choice
    if value < low or (high is not None and value > high):
        raise ValueError(f"{name} must be 0 (automatic) or in [{low}, {high}], got {value}")
    if power_of_two and value & (value - 1):
        raise ValueError(f"{name} must be a power of two, got {value}")


def resolve_config(tokens, hidden, latent, dtype, device, block_n=0, block_k=0, num_warps=0,
                   num_stages=0, split_k=0, norm_block_k=0,
                   swap_ab=None, gemv=None, prenorm=None, block_m=0,
                   m_first=None, pdl=None, normed_rows=None, rms_in_loop=None) -> LaunchConfig:
    """The launch config for these sizes: :func:`pick_launch_config`'s, with each nonzero
    (or non-None) argument overriding its field after a range check."""
    _check_option("block_n", block_n, power_of_two=True, low=1, high=256)
    _check_option("block_k", block_k, power_of_two=True, low=16, high=1024)
    _check_option("norm_block_k", norm_block_k, power_of_two=True, low=16, high=8192)
    _check_option("num_warps", num_warps, power_of_two=True, low=1, high=16)
    _check_option("num_stages", num_stages, low=1, high=8)
    _check_option("split_k", split_k, low=1, high=64)
    _check_option("block_m", block_m, power_of_two=True, low=1, high=256)
    if block_m and block_m < 16 and not gemv:
        raise ValueError(f"block_m={block_m}: a tensor-core dot takes >= 16 token rows "
                         "(block_m < 16 needs gemv=True)")
    if pdl and not (prenorm or normed_rows):
        raise ValueError("pdl=True overlaps a prologue launch with the tail kernel: it needs "
                         "prenorm=True or normed_rows=True")
    if prenorm and normed_rows:
        raise ValueError("prenorm=True (1/rms from a prologue launch) and normed_rows=True (the "
                         "normalized rows from a norm launch) are two prologue forms: ask for one")
    if swap_ab and gemv:
        raise ValueError("swap_ab=True orders a tensor-core dot's operands; gemv=True has no "
                         "dot: ask for one or the other")
    if rms_in_loop and (prenorm or normed_rows or pdl):
        raise ValueError("rms_in_loop=True is the one-launch form: it takes no prenorm, "
                         "normed_rows or pdl")
    asked = (any((block_n, block_k, num_warps, num_stages, split_k, norm_block_k, block_m))
             or any(v is not None for v in (swap_ab, gemv, prenorm, m_first, pdl, normed_rows,
                                            rms_in_loop)))
    if swap_ab is not None and gemv is None:
        gemv = False  # a dot operand order asked for (either one): the dot form
    auto = pick_launch_config(tokens, hidden, latent, dtype, num_sms(device), gemv)
    if block_n and block_n < 16 and not auto.gemv:
        raise ValueError(f"block_n={block_n}: a tensor-core dot takes >= 16 weight rows "
                         "(block_n < 16 needs the GEMV form: gemv=True)")
    if auto.gemv and block_n and not block_k:
        # the accumulator budget over the block_n asked for, not the default's
        block_k = gemv_block_k(block_n, block_m_for(tokens, True), latent)
    block_k = block_k or auto.block_k
    # No empty splits: split_k as the number of K ranges of ceil(L / split_k) columns.
    k_blocks = cdiv(latent, block_k)
    split = split_k or auto.split_k
    split = cdiv(k_blocks, cdiv(k_blocks, split))
    if rms_in_loop and dtype == torch.float16:
        # x * w is rounded before 1/rms scales it: fp16's range could overflow there.
        raise ValueError("rms_in_loop=True takes bf16 or fp32 weights, not float16 (x * w "
                         "is rounded before the norm's scale: it could overflow in fp16)")
    if rms_in_loop and split != 1:
        raise ValueError(f"rms_in_loop=True needs split_k=1 (each program sees all of L), "
                         f"got split_k={split}")
    block_n = block_n or auto.block_n
    num_stages = num_stages or auto.num_stages
    if auto.gemv:
        swap_ab = False  # no dot to swap
    elif swap_ab is None:
        # The swapped dot keeps every pipeline stage of the weight tile, and of the token
        # tile, in shared memory (wgmma reads both from there): where that would not fit,
        # do not swap.
        rows = block_m or block_m_for(tokens)
        swap_ab = (auto.swap_ab and (block_n + rows) * block_k * dtype.itemsize * num_stages
                   <= SWAP_AB_SMEM_BYTES)
    if not asked:
        # Nothing asked for: the default's PDL norm-launch form where PDL runs (without it
        # the norm is only one launch more); any launch option asks for the one-launch form
        # unless it names normed_rows / prenorm / pdl too (the sweeps time those shapes as
        # they were).
        normed_rows = pdl = auto.pdl and pdl_available(device)
        rms_in_loop = auto.rms_in_loop
    return LaunchConfig(block_n=block_n, block_k=block_k,
                        num_warps=num_warps or auto.num_warps,
                        num_stages=num_stages, split_k=split,
                        norm_block_k=norm_block_k or auto.norm_block_k,
                        swap_ab=swap_ab, gemv=auto.gemv, prenorm=bool(prenorm),
                        block_m=block_m, m_first=bool(m_first), pdl=bool(pdl),
                        normed_rows=bool(normed_rows), rms_in_loop=bool(rms_in_loop))


# ---------------------------------------------------------------------- arguments


def check_fused_tail_args(routed_latent, shared, norm_w, eps, up_w, weight_in_fp32=False,
                          norm_dtype=None, max_tokens: int | None = MAX_TOKENS) -> None:
    """Validate a direct kernel call; TypeError/ValueError naming the argument.

    The family's rules (``k3fusion.moe_tail_args.check_latent_moe_tail_args`` in its
    ``direct`` form: 2-D ``[T, L]`` / ``[T, H]`` partials, any row strides, last dims
    contiguous, one device, one dtype for the normed latent, ``up_w`` and ``shared``), and
    the kernel's own: ``T <= max_tokens`` (None: any T -- the row-tiled ``block_m``
    launches) and a device it can run on (RuntimeError otherwise).
    """
    check_latent_moe_tail_args(routed_latent, shared, norm_w, eps, up_w, norm_dtype,
                               weight_in_fp32, direct=True)
    tokens = routed_latent.shape[0]
    if max_tokens is not None and tokens > max_tokens:
        raise ValueError(f"routed_latent has T={tokens} rows; the fused tail kernel takes at "
                         f"most {max_tokens} (more with block_m: row tiles)")
    device = routed_latent.device
    if device.type == "cuda" or (device.type == "cpu" and kernels_are_interpreted()):
        return
    if device.type == "cpu" and interpreter_enabled():
        raise RuntimeError("TRITON_INTERPRET=1 was set after k3fusion.kernels.moe_tail was "
                           "imported; set it before importing k3fusion to run the kernel on CPU")
    raise RuntimeError(f"the fused tail kernel runs on CUDA (or on CPU with "
                       f"TRITON_INTERPRET=1), not on {device.type}")


def _check_out(out, shared, others, dtype) -> None:
    """``out=`` of :func:`latent_moe_tail_fused`: a tensor of ``shared``'s shape in the
    output dtype, on its device, last dim contiguous; ``shared`` itself or disjoint from
    every input (a partial overlap would let one program read what another wrote)."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    if out.shape != shared.shape:
        raise ValueError(f"out has shape {tuple(out.shape)}; the tail's output is "
                         f"{tuple(shared.shape)} (shared's)")
    if out.dtype != dtype:
        raise ValueError(f"out has dtype {out.dtype}; the tail writes up_w's dtype {dtype}")
    if out.device != shared.device:
        raise ValueError(f"out is on {out.device}, the inputs on {shared.device}")
    if out.numel() and out.stride(-1) != 1:
        raise ValueError(f"out's last dim must be contiguous (stride 1), got {out.stride(-1)}")
    in_place = same_view(out, shared)  # (shapes checked equal above)
    for name, t in (("shared", shared), *zip(("routed_latent", "norm_w", "up_w"), others)):
        if name == "shared" and in_place:
            continue
        if out.numel() and t.numel() and _overlaps(out, t):
            raise ValueError(f"out overlaps {name}: pass shared itself (in place) or a "
                             "tensor that shares no memory with the inputs")


def _counter_words(device: torch.device, size: int) -> torch.Tensor:
    """Uninitialized int32 words for a launch's split-K counters, which the norm launch
    before it zeroes."""
    return torch.empty(max(size, 1), dtype=torch.int32, device=device)


def _shard_of(shared, up_w, column_offset) -> torch.Tensor:
    """``column_offset``'s check, and the columns of ``shared [T, H]`` that ``up_w``'s
    rows produce (``shared`` as given where the argument check will refuse it)."""
    if isinstance(column_offset, bool) or not isinstance(column_offset, int):
        raise TypeError(f"column_offset must be an int or None, got "
                        f"{type(column_offset).__name__}")
    if not (isinstance(shared, torch.Tensor) and isinstance(up_w, torch.Tensor)
            and shared.dim() == 2 and up_w.dim() == 2):
        return shared
    width, rows = shared.shape[1], up_w.shape[0]
    if column_offset < 0 or column_offset + rows > width:
        raise ValueError(f"column_offset={column_offset}: up_w's {rows} rows must land inside "
                         f"shared's {width} columns")
    return shared.narrow(1, column_offset, rows)


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` share an element: exact for row views of one row stride
    (column shards of one ``[T, H]`` buffer), else :func:`may_overlap` (byte spans)."""
    size = a.element_size()
    if (a.dim() == b.dim() == 2 and a.element_size() == b.element_size()
            and a.stride(1) == b.stride(1) == 1 and a.stride(0) == b.stride(0) > 0
            and max(a.shape[1], b.shape[1]) <= a.stride(0)
            and (a.data_ptr() - b.data_ptr()) % size == 0):
        rows, d = a.stride(0), (b.data_ptr() - a.data_ptr()) // size
        wa, wb = a.shape[1], b.shape[1]
        # Row i of a meets row j of b iff d - wa < (i - j) * rows < d + wb.
        k = (d - wa) // rows + 1
        while k * rows < d + wb:
            if -(b.shape[0] - 1) <= k <= a.shape[0] - 1:
                return True
            k += 1
        return False
    return may_overlap(a, b)


# ---------------------------------------------------------------------- launch


@on_tensor_device
def latent_moe_tail_fused(
    routed_latent: torch.Tensor,
    shared: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
    up_w: torch.Tensor,
    *,
    weight_in_fp32: bool = False,
    block_n: int = 0,
    block_k: int = 0,
    num_warps: int = 0,
    num_stages: int = 0,
    split_k: int = 0,
    norm_block_k: int = 0,
    swap_ab: bool | None = None,
    gemv: bool | None = None,
    norm_dtype: torch.dtype | None = None,
    prenorm: bool | None = None,
    block_m: int = 0,
    m_first: bool | None = None,
    pdl: bool | None = None,
    normed_rows: bool | None = None,
    rms_in_loop: bool | None = None,
    out: torch.Tensor | None = None,
    column_offset: int | None = None,
) -> torch.Tensor:
    """``shared + rms_norm(routed_latent, norm_w, eps, weight_in_fp32) @ up_w.T`` in one
    launch; returns a new contiguous ``[T, H]`` tensor in ``up_w``'s dtype, or ``out``
    (``[T, H]``, ``up_w``'s dtype, any row stride, last dim contiguous) written in place:
    ``out`` may be ``shared`` itself (each element is read before the same program writes
    it), or must share no memory with any input.

    Inputs as :func:`check_fused_tail_args` says (validated before launch; never
    modified). Launch options of 0 (``swap_ab``, ``gemv``: None) take
    :func:`pick_launch_config`'s choice. ``normed_rows``: every row normalized by a norm
    launch, the tail kernel a GEMM + add on them; ``prenorm``: every row's 1/rms in a
    prologue launch (either: two launches; ``pdl``: the second as the first's programmatic
    dependent). ``block_m``: token rows per program, tiling T (any T then, not only up to
    ``MAX_TOKENS``); ``m_first``: row tiles as the fastest grid dimension.

    ``column_offset``: ``up_w`` holds ``N`` of the output's columns (a column-parallel
    shard), ``shared`` and ``out`` are ``[T, H]`` with ``H >= column_offset + N``; the
    result is ``shared`` with columns ``column_offset .. column_offset + N`` gaining the
    GEMM. In place (``out`` is ``shared``) only those columns are written; into another
    buffer the launch also copies the other columns (no copy launch of its own).
    """
    for name, flag in (("swap_ab", swap_ab), ("gemv", gemv), ("prenorm", prenorm),
                       ("m_first", m_first), ("pdl", pdl), ("normed_rows", normed_rows),
                       ("rms_in_loop", rms_in_loop)):
        if flag is not None and not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool or None, got {type(flag).__name__}")
    if isinstance(block_m, bool) or not isinstance(block_m, int):
        raise TypeError(f"block_m must be an int, got {type(block_m).__name__}")
    full = shared
    if column_offset is not None:
        shared = _shard_of(shared, up_w, column_offset)
    check_fused_tail_args(routed_latent, shared, norm_w, eps, up_w, weight_in_fp32, norm_dtype,
                          max_tokens=None if block_m else MAX_TOKENS)
    tokens, latent = routed_latent.shape
    hidden = up_w.shape[0]
    if out is not None:
        _check_out(out, full, (routed_latent, norm_w, up_w), up_w.dtype)
    else:
        out = torch.empty(full.shape, dtype=up_w.dtype, device=up_w.device)
    out_full = out
    # Columns outside the shard: copied by the launch unless it writes in place.
    rest = 0 if same_view(out, full) else full.shape[1] - hidden
    out = out.narrow(1, column_offset or 0, hidden)
    cfg = resolve_config(tokens, hidden, latent, up_w.dtype, routed_latent.device, block_n,
                          block_k, num_warps, num_stages, split_k, norm_block_k,
                          swap_ab, gemv, prenorm, block_m, m_first, pdl, normed_rows,
                          rms_in_loop)
    if tokens == 0:
        return out_full
    interpreted = routed_latent.device.type == "cpu"
    block_m = cfg.block_m or block_m_for(tokens, cfg.gemv)
    m_tiles = cdiv(tokens, block_m)
    tiles = cdiv(hidden, cfg.block_n)
    k_per_split = cdiv(cdiv(latent, cfg.block_k), cfg.split_k) * cfg.block_k
    if cfg.split_k > 1:
        ws = torch.empty((cfg.split_k, tokens, hidden), dtype=torch.float32, device=up_w.device)
        # Zeroed counters no other launch uses (docs/design-notes.md, "Scratch memory"):
        # zeroed by the norm launch where there is one (no memset launch of their own), else
        # launch_scratch's (the last arrival resets each: a captured launch keeps its own).
        lock = (_counter_words(up_w.device, tiles * m_tiles) if cfg.normed_rows
                else launch_scratch(up_w.device, tiles * m_tiles, torch.int32, reusable=True))
    else:
        ws = lock = out  # never read
    rinv = out  # never read
    pdl_on = cfg.pdl and not interpreted  # (inline PTX: the interpreter runs the launches in turn)
    if pdl_on and gdc_wait is None:
        raise RuntimeError("pdl=True needs a Triton with triton.language.extra.cuda.gdc_wait")
    pdl_kw = {"launch_pdl": True} if pdl_on else {}
    rows_in = routed_latent
    if cfg.normed_rows:
        # The GEMM input as the reference rounds it, in up_w's dtype (L2-resident at decode).
        rows_in = torch.empty((tokens, latent), dtype=up_w.dtype, device=up_w.device)
        rms_norm(routed_latent, norm_w, eps, rows_in, bool(weight_in_fp32), norm_dtype,
                 pdl_primary=pdl_on, zero=lock if cfg.split_k > 1 else None)
    if cfg.prenorm:
        rinv = torch.empty(tokens, dtype=torch.float32, device=up_w.device)
        rows = 4  # rows per prologue program
        _row_inv_rms_kernel[(cdiv(tokens, rows),)](
            routed_latent, routed_latent.stride(0), rinv, tokens, latent, float(eps),
            ROWS=rows, BLOCK_L=min(1024, max(16, triton.next_power_of_2(latent))),
            PDL=pdl_on, num_warps=4)
    rest_block = min(max(16, 8192 // block_m), triton.next_power_of_2(max(rest, 1)))
    col_programs = tiles + cdiv(rest, rest_block)
    grid = ((m_tiles, cfg.split_k, col_programs) if cfg.m_first
            else (col_programs, cfg.split_k, m_tiles))
    _moe_tail_kernel[grid](
        rows_in, rows_in.stride(0),
        norm_w,
        up_w, up_w.stride(0),
        shared, shared.stride(0),
        out, out.stride(0),
        full, out_full,
        ws, lock, rinv,
        tokens, latent, hidden,
        float(eps),
        k_per_split,
        tokens * hidden,
        column_offset or 0, full.shape[1],
        BLOCK_M=block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        NORM_BLOCK_K=cfg.norm_block_k,
        SPLIT_K=cfg.split_k,
        SWAP_AB=cfg.swap_ab,
        GEMV=cfg.gemv,
        NUM_STAGES=cfg.num_stages,
        WEIGHT_IN_FP32=bool(weight_in_fp32),
        NORM_DTYPE=TL_DTYPES[routed_latent.dtype if norm_dtype is None else norm_dtype],
        DOT_IN_FP32=interpreted or up_w.dtype == torch.float32,
        GPU_FENCE=not interpreted,
        INV_RMS_IN=cfg.prenorm,
        M_FIRST=cfg.m_first,
        PDL=pdl_on,
        NORMED_IN=cfg.normed_rows,
        COPY_REST=rest > 0,
        REST_BLOCK=rest_block,
        RMS_IN_LOOP=cfg.rms_in_loop,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_kw,
    )
    return out_full
