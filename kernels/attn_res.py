"""Block Attention Residuals (AttnRes) in one Triton launch: the prefix update, the block
write, the depth-softmax over the sources and the output RMSNorm.

Semantics are ``k3fusion.reference.attn_res`` (the spec), computed in fp32. Two kernels,
the four feature switches (``HAS_DELTA``, ``WRITE_BLOCK``, ``HAS_OUT_NORM``,
``OUT_WEIGHT_IN_FP32``) constexpr in both: the **split** kernel for a few tokens
(``cdiv(H, CHUNK)`` programs per token exchange partial sums as epoch-tagged words: no
fence, no barrier) and the **row** kernel for more (one program per token, an online
softmax over the sources). Which one, and its tile, by (T, H, completed blocks, dtype)
from the measured :data:`LAUNCH_TABLE`, else the rule in :func:`pick_launch_shape`.
The block count is compiled in (``NUM_BLOCKS``: one variant per count, so a tile's rows
past it are never loaded), the write index is a runtime argument; offsets are int64.
Both kernels launch as the previous launch's programmatic dependent (``PDL``) where the
GPU can, every load after the wait.

The per-token steps, both kernels' designs (the split kernel's epoch exchange protocol
and what it requires), the interpreter's form: docs/design-notes.md, "kernels/attn_res.py".
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import triton
import triton.language as tl

from ._launch import (cdiv, check_launchable, dependent_start, dependents_may_start,
                      interpreter_enabled, on_tensor_device, pdl_launch)
from ._scratch import launch_scratch

__all__ = ["attn_res", "pick_launch_shape", "LaunchShape", "PREFILL_TOKENS", "SPLIT_NUM_WARPS",
           "DECODE_SOURCES_PER_TILE", "PREFILL_SOURCES_PER_TILE", "SPLIT_MAX_TOKENS",
           "SPLIT_CHUNK", "SPLIT_MAX_PROGRAMS", "SPLIT_MAX_SOURCES", "PREFILL_LOOP_STAGES",
           "EARLY_TILE_MAX_TOKENS", "LAUNCH_TABLE", "TILE_MAX_PER_THREAD", "table_shape",
           "parse_shape", "TRIGGERS", "LAUNCH_TABLE_BY_GPU", "launch_table",
           "device_table_name"]

#: Switch for measurements (docs/bench-methods.md, ``--late-trigger``): True lets a PDL
#: launch's dependents start after its last store instead of at its start.
LATE_TRIGGER = False
#: Switch for measurements: False keeps the column mask where the tiles cover the row
#: exactly (``EVEN_H``), as before 2026-12-06.
ELIDE_FULL_MASKS = True

#: From this many tokens on, the row kernel uses its prefill shape (docs/experiments.md,
#: "2026-11-29: the pipelined source loop (prefill shape from 256 tokens)"; summary: "kernels/attn_res.py").
PREFILL_TOKENS = 256
#: Sources per tile of the row kernel's decode shape.
DECODE_SOURCES_PER_TILE = 4
#: Sources per tile of the row kernel's prefill shape: one source row per loop step ...
PREFILL_SOURCES_PER_TILE = 1
#: ... software-pipelined three deep (two rows in flight while one is reduced).
PREFILL_LOOP_STAGES = 3
#: Most shared memory the automatic choice lets the pipelined source loop take (its
#: ``LOOP_STAGES - 1`` buffers of a source tile); wider rows run unpipelined (sm_90 allows
#: 227 KiB per block; H = 7168 bf16 takes 32 KiB).
LOOP_SMEM_BYTES = 160 * 1024
#: Up to this many tokens the row kernel's decode shape loads its first source tile
#: before the prefix (``EARLY_TILE``: the two HBM round trips overlap instead of following
#: each other) (docs/experiments.md, "2026-11-29: the early first tile"; summary: "kernels/attn_res.py").
EARLY_TILE_MAX_TOKENS = 64
#: Up to this many tokens the rule runs the split kernel (``split_max_tokens`` overrides;
#: 0: never); :data:`LAUNCH_TABLE`'s first token edge.
#: (docs/experiments.md, "2026-11-29: the split kernel's epoch-tagged exchange"; summary: "kernels/attn_res.py")
SPLIT_MAX_TOKENS = 12
#: Columns per program of the split kernel (7 programs per 7168-wide token) ...
SPLIT_CHUNK = 1024
#: ... and warps: 1024 x 4 was the fastest at every T but 2 in the same runs
#: (docs/experiments.md, "kernels/attn_res.py").
SPLIT_NUM_WARPS = 4
#: Most programs one split launch may have (forced launches included): a token's programs
#: must be resident together while they poll for each other's words; in-order dispatch
#: keeps that true for any grid, this bound keeps it far from the counter buffer's limits.
SPLIT_MAX_PROGRAMS = 1 << 20
#: Tokens are the split kernel's second grid dim, which CUDA caps at 65535.
SPLIT_MAX_GRID_Y = 65535
#: Most sources (blocks + prefix) the split kernel holds in registers at once.
SPLIT_MAX_SOURCES = 32
#: What the programs of one token add to its launch counter per launch (> programs per token).
SYNC_EPOCH = tl.constexpr(1 << 16)
#: Most source-tile elements per thread a shape of :data:`LAUNCH_TABLE` may hold (live rows
#: of the tile x its width / threads): past it the tile spills. The sweep's bound too
#: (docs/experiments.md, "2026-12-03: the block count as a constexpr").
TILE_MAX_PER_THREAD = 192

#: The automatic launch shape, measured: docs/benchmarks.md#attnres-launch-selection-sweep-issue-20
#: (H 7168's rows up to 32 tokens the 2026-12-04 run with captured launches' scratch words
#: kept: docs/experiments.md#2026-12-04-the-split-kernel-without-its-memset-node; the other
#: rows up to 255 tokens the 2026-12-03 run with the block count compiled in:
#: docs/experiments.md#2026-12-03-the-block-count-as-a-constexpr-pdl-issue-30; the prefill rows the
#: 2026-12-02 run: docs/experiments.md#2026-12-02-the-launch-selection-run-issue-20, with
#: the rows of 256-724 / 256-362 tokens and H 2048's from 363 the 2026-12-03 prefill run:
#: docs/experiments.md#2026-12-03-prefill-rows-against-the-public-kernel-issue-30; the
#: trigger suffixes the 2026-12-05 probe: docs/experiments.md#2026-12-05-pdls-trigger-per-row).
#: Keyed by the most bytes of a padded row (``next_power_of_2(H) * element size``, so fp32
#: at H 2048 takes bf16's H 4096 row: the same bytes per thread in flight, half the
#: registers); rows ``(most tokens, shapes for 0, 1, ..., 8 completed blocks)``, the first
#: row with ``T <= most tokens`` applies (``None``: any T). Shapes are named as the sweep names them:
#: ``r<sources per tile>x<warps>`` the row kernel (``e``: first tile early, ``p<N>``:
#: source loop pipelined N deep), ``solo<warps>`` the split kernel's one program per
#: token, ``s<chunk>x<warps>`` the split kernel; a suffix ``M`` moves PDL's trigger to the
#: computed mix, ``L`` after the last store, ``N`` launches without PDL
#: (:attr:`LaunchShape.trigger`). Wider rows, more blocks, a shape past
#: :data:`TILE_MAX_PER_THREAD` or outside the kernels' limits: the rule of
#: :func:`pick_launch_shape` (``use_table=False``).
LAUNCH_TABLE: dict[int, tuple[tuple[int | None, str], ...]] = {
    4 * 1024: (  # bf16/fp16 H <= 2048, fp32 H <= 1024
        (64, "r1x4e solo8 solo8 solo8 r4x4e solo4 solo4 solo8 solo4"),
        (255, "r1x8 solo8 solo8 solo8 solo8 solo4 solo4 solo8 solo8"),
        (362, "r1x4p3 r1x8p3 r1x4p3 r1x4p3 r1x4p3 r1x4p3 r1x4p3 r1x4p3 r1x4p3"),
        (575, "r1x2p3 r1x8p3 r1x2p3 r1x2p3 r1x2p3 r1x2p3 r1x2p3 r1x2p3 r1x2p3"),
        (None, "r1x2p3L r1x8p3L r1x2p3L r1x2p3L r1x2p3L r1x2p3L r1x2p3L r1x2p3L r1x2p3L"),
    ),
    8 * 1024: (  # bf16/fp16 H <= 4096, fp32 H <= 2048
        (64, "r1x8e solo16 solo16 solo16 r4x8e solo8 solo8 r8x8e solo8"),
        (255, "solo16 solo16 solo16 solo8 solo8 solo8 solo16 solo8 solo8"),
        (None, "solo16L solo16L r1x4p3L r1x4p3L r1x4p3L r1x4p3L r1x4p3L r1x4p3L r1x4p3L"),
    ),
    16 * 1024: (  # bf16/fp16 H <= 8192 (7168), fp32 H <= 4096
        (1, "r1x16e solo8 solo8 solo8 s1024x4 s1024x4 s1024x4 s1024x4 s1024x4"),
        (12, "r1x16e solo8 solo8 solo8 solo8 solo8 s1024x4 s1024x4 s1024x4"),
        (16, "r1x16 solo8 solo8 solo16 solo16 solo8 s1024x4 s1024x4 s1024x4"),
        (32, "r1x16 solo8 solo8 solo16 solo16 solo8 r8x8e s1024x4 s2048x8"),
        (64, "solo16 solo8 solo8 solo16 solo16 solo8 r8x8e solo16 r4x8e"),
        (255, "solo16 solo8 solo16 solo16 solo16 solo16 solo16 r2x8p3 r2x8p3"),
        (724, "solo8L solo8L r1x8p3L r1x8p3L r1x8p3L r1x8p3L r1x8p3L r1x8p3L r1x8p3L"),
        (None, "solo16 solo16 r1x8p3 r1x8p3 r1x8p3 r1x8p3 r1x8p3 r1x8p3 r1x8p3"),
    ),
}


#: Rows measured on another GPU, by its ``torch.cuda.get_device_name``: they replace (or,
#: at a new token edge, add) the rows of :data:`LAUNCH_TABLE` with the same key and most
#: tokens there; the rest is the table's. Where each GPU's rows came from:
#: docs/benchmarks.md#against-both-public-kernels-2026-12-06-rows-per-gpu.
LAUNCH_TABLE_BY_GPU: dict[str, dict[int, dict[int | None, str]]] = {
    "NVIDIA H100 80GB HBM3": {
        4 * 1024: {
            32: "r1x8M solo8 solo8M solo8M r4x4e solo4 solo4 solo8 solo4",
            64: "r1x8M solo8 solo8M solo8M solo8M solo4 solo4 solo8 solo4",
            255: "r1x8 solo8 solo8M solo8M solo8 solo4 solo4 solo8 solo8",
            575: "r1x2p3 r1x8p3 solo8M solo4M r1x2p3 r1x2p3 r1x2p3 r1x2p3 r1x2p3",
        },
        8 * 1024: {724: "solo16L solo16L r1x4M r1x4M r1x4M r1x4M r1x4M r1x4M r1x4M"},
        16 * 1024: {255: "solo16 solo8 solo16 solo16 solo16 solo16 solo16 r4x8 r2x8p3"},
    },
}


def launch_table(gpu: str | None = None) -> dict[int, tuple[tuple[int | None, str], ...]]:
    """:data:`LAUNCH_TABLE` with the rows :data:`LAUNCH_TABLE_BY_GPU` has for ``gpu`` (a
    device name; None or a GPU without rows of its own: the table as it is)."""
    override = LAUNCH_TABLE_BY_GPU.get(gpu or "")
    if not override:
        return LAUNCH_TABLE
    return _merged_table(gpu)


@functools.lru_cache(maxsize=None)  # every eager launch asks: merge once per GPU
def _merged_table(gpu: str) -> dict[int, tuple[tuple[int | None, str], ...]]:
    override = LAUNCH_TABLE_BY_GPU[gpu]
    out = {}
    for key, rows in LAUNCH_TABLE.items():
        merged = dict(rows) | override.get(key, {})
        out[key] = tuple(sorted(merged.items(),
                                key=lambda r: float("inf") if r[0] is None else r[0]))
    return out


def device_table_name(device: torch.device) -> str | None:
    """The name :data:`LAUNCH_TABLE_BY_GPU` knows ``device`` by (None off CUDA)."""
    return cuda_device_name(device.index) if device.type == "cuda" else None


@functools.lru_cache(maxsize=None)  # asked by every launch: once per device
def cuda_device_name(index: int | None) -> str:
    return torch.cuda.get_device_name(index)


# ---------------------------------------------------------------------- shared pieces


@triton.jit
def _update_prefix(prefix_ptr, delta_ptr, prefix_out_ptr, cols, cmask, HAS_DELTA: tl.constexpr):
    """The (rounded) prefix row or chunk, after the delta add, stored to prefix_out."""
    p = tl.load(prefix_ptr + cols, mask=cmask, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptr + cols, mask=cmask, other=0.0)
        # fp32 add, one rounding to the prefix dtype: the rounded value is the new prefix
        # and the last source (as the spec's prefix.copy_(...) then re-read).
        p = (p.to(tl.float32) + d.to(tl.float32)).to(prefix_ptr.dtype.element_ty)
        tl.store(prefix_out_ptr + cols, p, mask=cmask)
    return p


@triton.jit
def _column_mask(cols, H, EVEN_H: tl.constexpr):
    """``cols < H``; all true at compile time where the tiles cover the row exactly
    (``EVEN_H``), so no load or store is predicated on it."""
    if EVEN_H:
        return tl.full(cols.shape, 1, tl.int1)
    return cols < H


@triton.jit
def _source_rows(blocks_row, s, num_blocks, blocks_block_stride, cols, cmask,
                 EVICTION: tl.constexpr):
    """Bank rows ``s`` of one token (``[len(s), len(cols)]``; rows from ``num_blocks`` on
    read as 0). ``EVICTION``: the load's L2 eviction policy ("" for the default)."""
    return tl.load(blocks_row + s.to(tl.int64)[:, None] * blocks_block_stride + cols[None, :],
                   mask=(s < num_blocks)[:, None] & cmask[None, :], other=0.0,
                   eviction_policy=EVICTION)


@triton.jit
def _store_output(out_ptr, mixed, cmask, out_norm_w_ptr, inv_rms,
                  HAS_OUT_NORM: tl.constexpr, OUT_WEIGHT_IN_FP32: tl.constexpr):
    """Store the rounded mix, or its RMSNorm given the row's ``inv_rms``."""
    if HAS_OUT_NORM:
        y = mixed.to(tl.float32)
        w_out = tl.load(out_norm_w_ptr, mask=cmask, other=0.0).to(tl.float32)
        if OUT_WEIGHT_IN_FP32:
            y = y * inv_rms * w_out
        else:
            # cast-then-weight: the normalized row is rounded before weighting.
            y = (y * inv_rms).to(mixed.dtype).to(tl.float32) * w_out
        tl.store(out_ptr, y.to(out_ptr.dtype.element_ty), mask=cmask)
    else:
        tl.store(out_ptr, mixed.to(out_ptr.dtype.element_ty), mask=cmask)


# ---------------------------------------------------------------------- row kernel


@triton.jit
def _add_pairs(a_0, a_1, b_0, b_1):
    return a_0 + b_0, a_1 + b_1


if interpreter_enabled():
    # Triton's interpreter runs a tuple reduction's combine function in Python, far
    # slower than tl.sum's numpy path (docs/experiments.md): two sums there, the
    # same math. The GPU form below is compiled for sm_90 by the CPU tests and run by the
    # GPU tests.
    @triton.jit
    def _sum_pair(a, b, axis: tl.constexpr):
        return tl.sum(a, axis=axis), tl.sum(b, axis=axis)
else:
    @triton.jit
    def _sum_pair(a, b, axis: tl.constexpr):
        """``sum(a)`` and ``sum(b)`` along ``axis`` in one reduction: one pass through
        shared memory and one barrier instead of two (same tree as ``tl.sum``, same bits;
        measured: docs/experiments.md, "kernels/attn_res.py")."""
        return tl.reduce((a, b), axis, _add_pairs)


@triton.jit
def _dots_and_squares(x, g, axis: tl.constexpr):
    """``sum(x * g)`` and ``sum(x * x)`` along ``axis``: a source's logit sums."""
    return _sum_pair(x * g, x * x, axis)


@triton.jit
def _online_step(m, den, acc, x, s, num_blocks, g, H, eps):
    """Fold a tile of source rows ``x`` (fp32; rows ``s``, those >= num_blocks masked)
    into the running max ``m``, denominator ``den`` and mix ``acc``."""
    smask = s < num_blocks
    dots, squares = _dots_and_squares(x, g[None, :], 1)
    logit = tl.rsqrt(squares / H + eps) * dots
    logit = tl.where(smask, logit, float("-inf"))
    m_new = tl.maximum(m, tl.max(logit, axis=0))
    scale = tl.exp(m - m_new)
    w = tl.exp(logit - m_new)  # 0 for the masked rows
    den = den * scale + tl.sum(w, axis=0)
    acc = acc * scale + tl.sum(w[:, None] * x, axis=0)
    return m_new, den, acc


@triton.jit(do_not_specialize=["block_write_idx"])
def _attn_res_kernel(
    prefix_ptr, prefix_stride,
    prefix_out_ptr, prefix_out_stride,
    delta_ptr, delta_stride,
    blocks_ptr, blocks_token_stride, blocks_block_stride,
    block_write_idx,
    norm_w_ptr, proj_w_ptr, out_norm_w_ptr,
    out_ptr, out_stride,
    H, eps, out_eps,
    BLOCK_H: tl.constexpr,
    NUM_BLOCKS: tl.constexpr,
    SOURCES_PER_TILE: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
    EARLY_TILE: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    WRITE_BLOCK: tl.constexpr,
    HAS_OUT_NORM: tl.constexpr,
    OUT_WEIGHT_IN_FP32: tl.constexpr,
    PDL: tl.constexpr,
    LATE_TRIGGER: tl.constexpr,
    MIX_TRIGGER: tl.constexpr,
    EVEN_H: tl.constexpr,
):
    """One program per token (``grid = (T,)``), online softmax over the sources."""
    dependent_start(PDL, LATE_TRIGGER)
    tok = tl.program_id(0).to(tl.int64)  # int64: token * stride overflows int32
    cols = tl.arange(0, BLOCK_H)
    cmask = _column_mask(cols, H, EVEN_H)
    dtype = prefix_ptr.dtype.element_ty

    blocks_row = blocks_ptr + tok * blocks_token_stride
    srcs = tl.arange(0, SOURCES_PER_TILE)
    if EARLY_TILE:
        # The first source tile does not depend on the prefix: issued before the prefix
        # load, the two HBM round trips overlap instead of following each other.
        # It is read once per call too, but was not measured with the loop's hint.
        x_first = _source_rows(blocks_row, srcs, NUM_BLOCKS, blocks_block_stride, cols, cmask,
                               "")
    p = _update_prefix(prefix_ptr + tok * prefix_stride, delta_ptr + tok * delta_stride,
                       prefix_out_ptr + tok * prefix_out_stride, cols, cmask, HAS_DELTA)
    if WRITE_BLOCK:
        tl.store(blocks_row + block_write_idx.to(tl.int64) * blocks_block_stride + cols, p,
                 mask=cmask)

    v = p.to(tl.float32)
    if NUM_BLOCKS == 0:
        # One source: its softmax weight is exactly 1, the mix is the prefix itself.
        mixed = v
    else:
        g = (tl.load(norm_w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
             * tl.load(proj_w_ptr + cols, mask=cmask, other=0.0).to(tl.float32))
        # The prefix (in registers already) seeds the running state: m = its logit,
        # den = exp(0) = 1, acc = v. No -inf start, so no exp(-inf - -inf).
        dots, squares = _dots_and_squares(v, g, 0)
        m = tl.rsqrt(squares / H + eps) * dots
        den = tl.full([], 1.0, tl.float32)
        acc = v
        first = 0
        if EARLY_TILE:
            m, den, acc = _online_step(m, den, acc, x_first.to(tl.float32), srcs, NUM_BLOCKS,
                                       g, H, eps)
            first = SOURCES_PER_TILE
        # LOOP_STAGES > 1: the next tiles' loads are in flight (cp.async into shared
        # memory) while this one is reduced; a plain loop waits a full HBM round trip
        # per tile (a loop without a dot is not pipelined by default).
        for s0 in tl.range(first, NUM_BLOCKS, SOURCES_PER_TILE, num_stages=LOOP_STAGES):
            s = s0 + srcs
            # Read once per call: let these lines go first, ahead of the rows this call
            # writes (docs/experiments.md, "kernels/attn_res.py").
            x = _source_rows(blocks_row, s, NUM_BLOCKS, blocks_block_stride, cols, cmask,
                             "evict_first").to(tl.float32)
            m, den, acc = _online_step(m, den, acc, x, s, NUM_BLOCKS, g, H, eps)
        mixed = acc / den

    # The spec rounds the mix to the model dtype (a module materializes it) before the
    # output norm reads it.
    mixed = mixed.to(dtype)
    dependents_may_start(PDL, MIX_TRIGGER)
    inv_rms = 0.0
    if HAS_OUT_NORM:
        y = mixed.to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(y * y, axis=0) / H + out_eps)
    _store_output(out_ptr + tok * out_stride + cols, mixed, cmask, out_norm_w_ptr + cols,
                  inv_rms, HAS_OUT_NORM, OUT_WEIGHT_IN_FP32)
    dependents_may_start(PDL, LATE_TRIGGER and not MIX_TRIGGER)


# ---------------------------------------------------------------------- split kernel


@triton.jit
def _launch_epoch(counter_ptr, chunk, N_CHUNKS: tl.constexpr):
    """This launch's epoch for one token (mod 2**32). The token's programs add
    ``SYNC_EPOCH`` in all to its counter (chunk 0 ``SYNC_EPOCH - (N_CHUNKS - 1)``, the
    others 1), so each reads an old value in ``[k * SYNC_EPOCH, (k + 1) * SYNC_EPOCH)``
    and all take ``k + 1``. Relaxed: it orders nothing, and its round trip overlaps the
    source loads issued after it."""
    add = 1 + (chunk == 0).to(tl.int64) * (SYNC_EPOCH - N_CHUNKS)
    old = tl.atomic_add(counter_ptr, add, sem="relaxed", scope="gpu")
    return (old // SYNC_EPOCH + 1).to(tl.int32)  # the low 32 bits


@triton.jit
def _publish(ptrs, values, epoch, PHASE: tl.constexpr):
    """Store fp32 partial sums, each as one 64-bit word ``epoch << 32 | bits``. In one
    launch (PHASE 0) a relaxed GPU-scope exchange: a morally strong, single-copy-atomic
    64-bit access (a reader sees the old word or the whole new one), issued once per
    element (Triton masks the lanes that hold replicas), its old value unused."""
    words = (epoch.to(tl.int64) << 32) | (values.to(tl.int32, bitcast=True).to(tl.int64)
                                           & 0xFFFFFFFF)
    if PHASE == 0:
        tl.atomic_xchg(ptrs, words, sem="relaxed", scope="gpu")
    else:
        tl.store(ptrs, words)


@triton.jit
def _collect(ptrs, need, epoch, PHASE: tl.constexpr):
    """The fp32 partial sums at ``ptrs`` (0 where not ``need``). In one launch (PHASE 0)
    each thread polls its own words (relaxed loads, ``ld.volatile`` in PTX) until they
    carry ``epoch``: no fence, and no CTA-wide reduction or barrier per poll. Separate
    launches (the interpreter) just read them."""
    if PHASE == 0:
        lo = tl.inline_asm_elementwise(
            """{
            .reg .pred p;
            .reg .b32 hi;
            .reg .b64 w;
            mov.u32 $0, 0;
            setp.eq.s32 p, $3, 0;
            @p bra DONE;
            WAIT:
            ld.volatile.global.b64 w, [$1];
            mov.b64 {$0, hi}, w;
            setp.ne.s32 p, hi, $2;
            @p bra WAIT;
            DONE:
            }""",
            "=r,l,r,r", [ptrs.to(tl.int64), tl.zeros_like(need.to(tl.int32)) + epoch,
                         need.to(tl.int32)],
            dtype=tl.int32, is_pure=False, pack=1)
    else:
        lo = (tl.load(ptrs, mask=need, other=0) & 0xFFFFFFFF).to(tl.int32)
    return tl.where(need, lo.to(tl.float32, bitcast=True), 0.0)


@triton.jit(do_not_specialize=["block_write_idx"])
def _attn_res_split_kernel(
    prefix_ptr, prefix_stride,
    prefix_out_ptr, prefix_out_stride,
    delta_ptr, delta_stride,
    blocks_ptr, blocks_token_stride, blocks_block_stride,
    block_write_idx,
    norm_w_ptr, proj_w_ptr, out_norm_w_ptr,
    out_ptr, out_stride,
    words_ptr,
    H, eps, out_eps,
    CHUNK: tl.constexpr,
    NUM_BLOCKS: tl.constexpr,
    N_CHUNKS: tl.constexpr,
    N_CHUNKS_PAD: tl.constexpr,
    S_PAD: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    WRITE_BLOCK: tl.constexpr,
    HAS_OUT_NORM: tl.constexpr,
    OUT_WEIGHT_IN_FP32: tl.constexpr,
    PHASE: tl.constexpr,
    PDL: tl.constexpr,
    LATE_TRIGGER: tl.constexpr,
    MIX_TRIGGER: tl.constexpr,
    EVEN_H: tl.constexpr,
):
    """``grid = (N_CHUNKS, T)``: program ``(c, t)`` owns columns ``[c*CHUNK, (c+1)*CHUNK)``
    of token ``t``. ``PHASE`` 0 runs all of it, exchanging through epoch-tagged words;
    the interpreter runs 1 (up to the source sums), 2 (up to the mix's sum of squares, or
    the output when there is no norm) and 3 (the normed output) as separate launches."""
    dependent_start(PDL, LATE_TRIGGER)
    chunk = tl.program_id(0)
    tok = tl.program_id(1).to(tl.int64)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    cmask = _column_mask(cols, H, EVEN_H)
    dtype = prefix_ptr.dtype.element_ty
    srcs = tl.arange(0, S_PAD)
    # A token's words: its launch counter, then one record per chunk -- sum(v*g) and
    # sum(v*v) per source, then the chunk's sum of squares of the rounded mix.
    REC: tl.constexpr = 2 * S_PAD + 1
    # One program per token (CHUNK covers the row): every sum is its own, nothing is
    # exchanged -- no words, no epoch, one launch in the interpreter too. Its source rows
    # are loaded first, so they, the prefix and the delta are in flight together.
    SOLO: tl.constexpr = N_CHUNKS == 1
    token_words = words_ptr + tok * (1 + N_CHUNKS_PAD * REC)
    recs = token_words + 1
    rec = recs + chunk * REC
    ks = tl.arange(0, N_CHUNKS_PAD)
    kmask = ks < N_CHUNKS
    epoch = tl.full([], 0, tl.int32)  # separate launches: no epochs
    if PHASE == 0 and not SOLO:
        epoch = _launch_epoch(token_words, chunk, N_CHUNKS)
    if SOLO:
        x_solo = _source_rows(blocks_ptr + tok * blocks_token_stride, srcs, NUM_BLOCKS,
                              blocks_block_stride, cols, cmask, "")

    if PHASE >= 2:
        # An earlier launch updated the prefix (prefix_out holds the rounded row).
        if HAS_DELTA:
            p = tl.load(prefix_out_ptr + tok * prefix_out_stride + cols, mask=cmask, other=0.0)
        else:
            p = tl.load(prefix_ptr + tok * prefix_stride + cols, mask=cmask, other=0.0)
    else:
        p = _update_prefix(prefix_ptr + tok * prefix_stride, delta_ptr + tok * delta_stride,
                           prefix_out_ptr + tok * prefix_out_stride, cols, cmask, HAS_DELTA)
        if WRITE_BLOCK:
            tl.store(blocks_ptr + tok * blocks_token_stride
                     + block_write_idx.to(tl.int64) * blocks_block_stride + cols, p, mask=cmask)

    # Every launch writes every word of its tokens' records, needed or not (zeros): so
    # before a launch's store a word holds the previous launch's epoch -- this one's
    # minus one -- and a poll can never accept a stale word (the launcher keeps one
    # buffer per record layout, counters included).
    zeros = tl.zeros([S_PAD], dtype=tl.float32)
    if NUM_BLOCKS == 0:
        # One source: softmax weight exactly 1, no logit (an overflowing row stays exact).
        mixed = p
        if PHASE <= 1 and not SOLO:
            _publish(rec + srcs, zeros, epoch, PHASE)
            _publish(rec + S_PAD + srcs, zeros, epoch, PHASE)
    else:
        # Every source's chunk at once: blocks in rows [0, NUM_BLOCKS), the prefix in
        # row NUM_BLOCKS, zeros below (they add nothing to any sum).
        if SOLO:
            x = x_solo
        else:
            x = _source_rows(blocks_ptr + tok * blocks_token_stride, srcs, NUM_BLOCKS,
                             blocks_block_stride, cols, cmask, "")
        x = tl.where((srcs == NUM_BLOCKS)[:, None], p[None, :], x).to(tl.float32)
        if PHASE <= 1:
            g = (tl.load(norm_w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
                 * tl.load(proj_w_ptr + cols, mask=cmask, other=0.0).to(tl.float32))
            dots, squares = _dots_and_squares(x, g[None, :], 1)
            if not SOLO:
                _publish(rec + srcs, dots, epoch, PHASE)
                _publish(rec + S_PAD + srcs, squares, epoch, PHASE)
        if PHASE != 1:
            if SOLO:
                sumsq = squares  # the whole row's sums: this program's own
            else:
                need = kmask[:, None] & (srcs <= NUM_BLOCKS)[None, :]
                ptrs = recs + ks[:, None] * REC + srcs[None, :]
                # Summed over chunks in chunk order: the same bits whoever arrived first.
                dots, sumsq = _sum_pair(_collect(ptrs, need, epoch, PHASE),
                                        _collect(ptrs + S_PAD, need, epoch, PHASE), 0)
            logit = tl.rsqrt(sumsq / H + eps) * dots
            logit = tl.where(srcs <= NUM_BLOCKS, logit, float("-inf"))
            e = tl.exp(logit - tl.max(logit, axis=0))
            w = e / tl.sum(e, axis=0)
            mixed = tl.sum(w[:, None] * x, axis=0).to(dtype)
    dependents_may_start(PDL, MIX_TRIGGER)
    if PHASE != 1:
        sq_ptr = rec + 2 * S_PAD  # the chunk's one word of the second exchange
        if HAS_OUT_NORM:
            # The norm reads the mix rounded to the model dtype (the spec): its sum of
            # squares needs every chunk, hence a second exchange.
            if SOLO:
                y = mixed.to(tl.float32)
                sq = tl.sum(y * y, axis=0)
            elif PHASE != 3:
                y = mixed.to(tl.float32)
                _publish(sq_ptr, tl.sum(y * y, axis=0), epoch, PHASE)
            if SOLO:
                _store_output(out_ptr + tok * out_stride + cols, mixed, cmask,
                              out_norm_w_ptr + cols, tl.rsqrt(sq / H + out_eps),
                              HAS_OUT_NORM, OUT_WEIGHT_IN_FP32)
            elif PHASE != 2:
                sq = tl.sum(_collect(recs + ks * REC + 2 * S_PAD, kmask, epoch, PHASE), axis=0)
                _store_output(out_ptr + tok * out_stride + cols, mixed, cmask,
                              out_norm_w_ptr + cols, tl.rsqrt(sq / H + out_eps),
                              HAS_OUT_NORM, OUT_WEIGHT_IN_FP32)
        else:
            if PHASE == 0 and not SOLO:
                _publish(sq_ptr, tl.full([], 0.0, tl.float32), epoch, PHASE)
            _store_output(out_ptr + tok * out_stride + cols, mixed, cmask,
                          out_norm_w_ptr + cols, 0.0, HAS_OUT_NORM, OUT_WEIGHT_IN_FP32)
    dependents_may_start(PDL, LATE_TRIGGER and not MIX_TRIGGER)


# ---------------------------------------------------------------------- launch


@dataclass(frozen=True)
class LaunchShape:
    """Which kernel and its tile: ``kind`` "split" (``chunk`` columns per program) or "row"
    (``sources_per_tile`` sources per load), warps per program, and the row tile."""

    kind: str
    num_warps: int
    block_h: int
    sources_per_tile: int = 0
    chunk: int = 0
    #: Row kernel: software-pipeline depth of its source loop (1: not pipelined).
    loop_stages: int = 1
    #: Row kernel: load the first source tile before the prefix (its own round trip).
    early_tile: bool = False
    #: Where a PDL launch lets the next launch start: ``"entry"`` (after its wait),
    #: ``"mix"`` (once its mix is computed, before the output norm and stores), ``"exit"``
    #: (after its last store) or ``"off"`` (not a PDL launch unless the caller asks for
    #: one). Table names: no suffix, ``M``, ``L``, ``N``.
    trigger: str = "entry"


_LABEL = re.compile(r"(?:r(\d+)x(\d+)(e?)(?:p(\d+))?|solo(\d+)|s(\d+)x(\d+))([MLN]?)")
#: A table name's suffix -> :attr:`LaunchShape.trigger`.
TRIGGERS = {"": "entry", "M": "mix", "L": "exit", "N": "off"}


@functools.lru_cache(maxsize=1024)  # every eager launch parses its table entry
def parse_shape(name: str, H: int) -> LaunchShape:
    """The :class:`LaunchShape` a :data:`LAUNCH_TABLE` name means at width ``H``."""
    m = _LABEL.fullmatch(name)
    if m is None:
        raise ValueError(f"not a launch shape name: {name!r}")
    spt, warps, early, stages, solo, chunk, split_warps, suffix = m.groups()
    block_h = triton.next_power_of_2(max(H, 1))
    trigger = TRIGGERS[suffix]
    if solo:
        return LaunchShape("split", int(solo), block_h, chunk=block_h, trigger=trigger)
    if chunk:
        return LaunchShape("split", int(split_warps), block_h, chunk=min(int(chunk), block_h),
                           trigger=trigger)
    return LaunchShape("row", int(warps), block_h, sources_per_tile=int(spt),
                       loop_stages=int(stages or 1), early_tile=bool(early), trigger=trigger)


def tile_rows(shape: LaunchShape, num_blocks: int) -> int:
    """Live rows of the source tile a program of ``shape`` holds in registers: the block
    count is compiled in, so the rows a power-of-two tile has past the sources are never
    loaded (a row tile holds blocks only; the split kernel's, every source)."""
    if shape.kind == "row":
        return min(shape.sources_per_tile, max(1, num_blocks))
    return num_blocks + 1


def table_shape(T: int, H: int, num_blocks: int, element_size: int = 2,
                gpu: str | None = None) -> LaunchShape | None:
    """The :func:`launch_table` shape for this point (``gpu``: the device's name), or None
    where the table does not apply: a row wider than its widest key, more blocks than its
    columns, a shape the kernels cannot launch here (the split kernel's grid and source
    limits, its PTX exchange on NVIDIA only, the pipeline's shared memory) or past
    :data:`TILE_MAX_PER_THREAD`."""
    table = launch_table(gpu)
    row_bytes = triton.next_power_of_2(max(H, 1)) * element_size
    key = next((k for k in sorted(table) if row_bytes <= k), None)
    if key is None or not 0 <= num_blocks:
        return None
    names = next(row for most, row in table[key] if most is None or T <= most).split()
    if num_blocks >= len(names):
        return None
    shape = parse_shape(names[num_blocks], H)
    width = shape.chunk or shape.block_h
    if tile_rows(shape, num_blocks) * width > TILE_MAX_PER_THREAD * 32 * shape.num_warps:
        return None
    if shape.kind == "split":
        n_chunks = cdiv(H, shape.chunk)
        if (T > SPLIT_MAX_GRID_Y or T * n_chunks > SPLIT_MAX_PROGRAMS
                or num_blocks + 1 > SPLIT_MAX_SOURCES
                or (n_chunks > 1 and torch.version.hip is not None)):
            return None
    elif ((shape.loop_stages - 1) * shape.sources_per_tile * shape.block_h * element_size
          > LOOP_SMEM_BYTES):
        return None
    return shape


def pick_launch_shape(T: int, H: int, num_blocks: int, *, prefill_tokens: int | None = None,
                      sources_per_tile: int = 0, num_warps: int = 0, kind: str = "auto",
                      chunk: int = 0, split_max_tokens: int | None = None,
                      loop_stages: int = 0, element_size: int = 2,
                      early_tile: bool | None = None, use_table: bool = True,
                      trigger: str | None = None, gpu: str | None = None) -> LaunchShape:
    """Launch shape for ``T`` tokens of width ``H`` with ``num_blocks`` completed blocks.

    Without overrides: the measured table (:func:`table_shape`; ``gpu``: the device's
    name, :func:`device_table_name`) where it applies. Otherwise (or with
    ``use_table=False``, or any of the override arguments below given) the rule:

    * split kernel for ``T <= split_max_tokens`` (default :data:`SPLIT_MAX_TOKENS`) and
      at most :data:`SPLIT_MAX_SOURCES` sources: :data:`SPLIT_CHUNK` columns per program
      (no wider than the row), :data:`SPLIT_NUM_WARPS` warps;
    * else the row kernel: decode shape (T < ``prefill_tokens``, default
      :data:`PREFILL_TOKENS`) :data:`DECODE_SOURCES_PER_TILE` sources per tile, 64 tile
      elements per thread, source loop not pipelined, the first source tile loaded
      before the prefix up to :data:`EARLY_TILE_MAX_TOKENS` tokens; prefill shape
      :data:`PREFILL_SOURCES_PER_TILE`, 32 per thread, :data:`PREFILL_LOOP_STAGES` deep
      (unpipelined where the buffers of ``element_size``-byte sources would take more
      than :data:`LOOP_SMEM_BYTES`); never more sources per tile than there are sources
      (rounded up to a power of two).

    ``kind`` ("split"/"row"), ``chunk``, ``sources_per_tile`` and ``num_warps``
    override (tests, the benchmark sweep); ``sources_per_tile > 0`` implies the row kernel,
    ``chunk > 0`` (without it) the split kernel; a ``loop_stages`` or ``early_tile`` given
    is taken as is. ``trigger`` (one of :data:`TRIGGERS`' values) replaces the chosen
    shape's PDL trigger, the table's or the rule's.
    """
    if trigger is not None:
        if trigger not in TRIGGERS.values():
            raise ValueError(f"trigger must be one of {sorted(TRIGGERS.values())}, "
                             f"got {trigger!r}")
        return replace(pick_launch_shape(
            T, H, num_blocks, prefill_tokens=prefill_tokens, sources_per_tile=sources_per_tile,
            num_warps=num_warps, kind=kind, chunk=chunk, split_max_tokens=split_max_tokens,
            loop_stages=loop_stages, element_size=element_size, early_tile=early_tile,
            use_table=use_table, gpu=gpu), trigger=trigger)
    if kind not in ("auto", "split", "row"):
        raise ValueError(f"kind must be 'auto', 'split' or 'row', got {kind!r}")
    if use_table and kind == "auto" and not (
            prefill_tokens is not None or sources_per_tile or num_warps or chunk
            or split_max_tokens is not None or loop_stages or early_tile is not None):
        shape = table_shape(T, H, num_blocks, element_size, gpu)
        if shape is not None:
            return shape
    block_h = triton.next_power_of_2(max(H, 1))
    if kind == "auto":
        most = SPLIT_MAX_TOKENS if split_max_tokens is None else split_max_tokens
        # The exchange is PTX (inline-asm polls): NVIDIA GPUs only.
        split = (sources_per_tile <= 0 and T <= min(most, SPLIT_MAX_GRID_Y)
                 and torch.version.hip is None
                 and num_blocks + 1 <= SPLIT_MAX_SOURCES
                 and T * cdiv(H, chunk or SPLIT_CHUNK) <= SPLIT_MAX_PROGRAMS)
        kind = "split" if split or (chunk > 0 and sources_per_tile <= 0) else "row"
    if kind == "split":
        if num_blocks + 1 > SPLIT_MAX_SOURCES:
            raise ValueError(f"the split kernel holds at most {SPLIT_MAX_SOURCES} sources, "
                             f"got num_blocks + 1 = {num_blocks + 1}")
        chunk = chunk or SPLIT_CHUNK
        if chunk & (chunk - 1):
            raise ValueError(f"chunk must be a power of two, got {chunk}")
        chunk = min(chunk, block_h)
        return LaunchShape("split", num_warps or SPLIT_NUM_WARPS, block_h, chunk=chunk)
    threshold = PREFILL_TOKENS if prefill_tokens is None else prefill_tokens
    prefill = T >= threshold
    if sources_per_tile <= 0:
        sources_per_tile = PREFILL_SOURCES_PER_TILE if prefill else DECODE_SOURCES_PER_TILE
        # No wider than the sources there are (num_blocks + the prefix).
        sources_per_tile = min(sources_per_tile, triton.next_power_of_2(num_blocks + 1))
    if sources_per_tile & (sources_per_tile - 1):
        raise ValueError(f"sources_per_tile must be a power of two, got {sources_per_tile}")
    if num_warps <= 0:
        # Measured: decode wants many threads in flight (64 tile elements per thread);
        # prefill one source row per step over 8 warps (32 per thread), pipelined.
        per_thread = 1024 if prefill else 2048
        num_warps = max(1, min(16, sources_per_tile * block_h // per_thread))
    if num_warps & (num_warps - 1):
        raise ValueError(f"num_warps must be a power of two, got {num_warps}")
    if isinstance(loop_stages, bool) or not isinstance(loop_stages, int) or loop_stages < 0:
        raise ValueError(f"loop_stages must be an int >= 0 (0: automatic), got {loop_stages!r}")
    if loop_stages == 0:
        loop_stages = PREFILL_LOOP_STAGES if prefill else 1
        if (loop_stages - 1) * sources_per_tile * block_h * element_size > LOOP_SMEM_BYTES:
            loop_stages = 1  # its buffers would not fit in shared memory
    if early_tile is None:
        early_tile = not prefill and T <= EARLY_TILE_MAX_TOKENS
    return LaunchShape("row", num_warps, block_h, sources_per_tile=sources_per_tile,
                       loop_stages=loop_stages, early_tile=bool(early_tile))


def pdl_flags(pdl: bool, asked: bool | None, shape: LaunchShape) -> tuple[bool, bool, bool]:
    """``(PDL, LATE_TRIGGER, MIX_TRIGGER)`` of a launch of ``shape``: ``pdl`` whether it can
    be a PDL launch (:func:`_launch.pdl_launch`), ``asked`` the caller's ``pdl``. The
    shape's trigger applies where the caller left PDL to the launch (None); ``pdl=True``
    keeps it a PDL launch even where the shape says ``"off"``. ``LATE_TRIGGER``: not at
    entry; ``MIX_TRIGGER``: at the mix (``LATE_TRIGGER`` moves it to the exit)."""
    if shape.trigger not in TRIGGERS.values():
        raise ValueError(f"shape.trigger must be one of {sorted(TRIGGERS.values())}, "
                         f"got {shape.trigger!r}")
    pdl = pdl and not (shape.trigger == "off" and asked is None)
    late = pdl and (LATE_TRIGGER or shape.trigger in ("exit", "mix"))
    return pdl, late, late and not LATE_TRIGGER and shape.trigger == "mix"


@on_tensor_device
def attn_res(
    prefix: torch.Tensor,
    blocks: torch.Tensor,
    num_blocks: int,
    norm_w: torch.Tensor,
    proj_w: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    *,
    delta: torch.Tensor | None = None,
    prefix_out: torch.Tensor | None = None,
    block_write_idx: int = -1,
    out_norm_w: torch.Tensor | None = None,
    out_eps: float = 1e-6,
    out_weight_in_fp32: bool = False,
    shape: LaunchShape | Mapping[str, Any] | None = None,
    split_phases: bool = False,
    words: torch.Tensor | None = None,
    pdl: bool | None = None,
) -> None:
    """Launch the AttnRes kernel on row views.

    ``prefix [T, H]``, ``delta [T, H]`` (optional), ``out [T, H]`` (preallocated; its
    dtype decides the store), ``blocks [T, NBmax, H]``: any token/row and block strides,
    last dim contiguous. With ``delta``, the rounded ``prefix + delta`` is written to
    ``prefix_out`` (pass ``prefix`` itself for the in-place update). ``block_write_idx
    >= 0`` writes that row into ``blocks[:, block_write_idx]``.

    Arguments are validated by the caller (``k3fusion.ops``); this only checks what the
    kernel itself needs. ``shape`` (benchmark sweeps, tests): the launch shape to use, or
    :func:`pick_launch_shape`'s overrides as a mapping (``{"kind": "row",
    "sources_per_tile": 2}``); None: its own choice. ``split_phases`` runs the split
    kernel as separate launches
    (one launch per phase, three with an output norm: what the interpreter always does;
    a GPU test compares the two forms). ``words`` (tests of the exchange protocol): the
    split kernel's words, given (at least ``T`` x words per token, int64) instead of fresh
    zeroed ones. ``pdl``: launch as the previous launch's programmatic dependent (None:
    wherever the GPU can, :func:`_launch.pdl_launch`; never for ``split_phases``).
    """
    tensors = [prefix, blocks, norm_w, proj_w, out]
    if delta is not None:
        if prefix_out is None:
            raise ValueError("prefix_out is required with delta (pass prefix to update in place)")
        tensors += [delta, prefix_out]
    if out_norm_w is not None:
        tensors.append(out_norm_w)
    check_launchable(*tensors)
    pdl_asked = pdl
    pdl = pdl_launch(prefix.device, pdl) and not split_phases
    T, H = prefix.shape
    if T == 0:
        return
    nb_max = blocks.shape[1]
    if not 0 <= num_blocks <= nb_max:
        raise ValueError(f"num_blocks {num_blocks} outside [0, {nb_max}]")
    write = block_write_idx >= 0
    if write and not num_blocks <= block_write_idx < nb_max:
        raise ValueError(f"block_write_idx {block_write_idx} outside [{num_blocks}, {nb_max})")
    if not isinstance(shape, LaunchShape):
        shape = pick_launch_shape(T, H, num_blocks, element_size=blocks.element_size(),
                                  gpu=device_table_name(prefix.device), **(shape or {}))
    pdl, late_trigger, mix_trigger = pdl_flags(pdl, pdl_asked, shape)
    has_delta = delta is not None
    has_norm = out_norm_w is not None
    common = (
        prefix, prefix.stride(0),
        prefix_out if has_delta else prefix, (prefix_out if has_delta else prefix).stride(0),
        delta if has_delta else prefix, (delta if has_delta else prefix).stride(0),
        blocks, blocks.stride(0), blocks.stride(1),
        int(block_write_idx) if write else 0,
        norm_w, proj_w, out_norm_w if has_norm else norm_w,
        out, out.stride(0),
    )
    flags = dict(HAS_DELTA=has_delta, WRITE_BLOCK=write, HAS_OUT_NORM=has_norm,
                 OUT_WEIGHT_IN_FP32=bool(out_weight_in_fp32), NUM_BLOCKS=int(num_blocks),
                 num_warps=shape.num_warps,
                 PDL=pdl, LATE_TRIGGER=late_trigger, MIX_TRIGGER=mix_trigger,
                 EVEN_H=ELIDE_FULL_MASKS and H % (shape.chunk or shape.block_h) == 0,
                 **({"launch_pdl": True} if pdl else {}))
    if shape.kind == "row":
        _attn_res_kernel[(T,)](*common, H, float(eps), float(out_eps),
                               BLOCK_H=shape.block_h, SOURCES_PER_TILE=shape.sources_per_tile,
                               LOOP_STAGES=shape.loop_stages, EARLY_TILE=shape.early_tile,
                               **flags)
        return
    n_chunks = cdiv(H, shape.chunk)
    if T > SPLIT_MAX_GRID_Y:
        raise ValueError(f"the split kernel takes at most {SPLIT_MAX_GRID_Y} tokens (its grid's "
                         f"second dim), got T={T}; use the row kernel")
    if n_chunks >= SYNC_EPOCH:
        raise ValueError(f"{n_chunks} programs per token: at most {SYNC_EPOCH.value - 1} "
                         f"(use a wider chunk)")
    n_chunks_pad = triton.next_power_of_2(n_chunks)
    # The sources' tile: the block count (and the prefix) rounded up to a power of two.
    s_pad = max(2, triton.next_power_of_2(num_blocks + 1))
    token_words = 1 + n_chunks_pad * (2 * s_pad + 1)
    interpreted = prefix.device.type == "cpu" and interpreter_enabled()
    if n_chunks == 1:
        # One program per token: no exchange, so no words (any int64 tensor stands in)
        # and one launch everywhere, the interpreter included.
        words = torch.empty(1, dtype=torch.int64, device=prefix.device)
        _attn_res_split_kernel[(1, T)](*common, words, H, float(eps), float(out_eps),
                                       CHUNK=shape.chunk, N_CHUNKS=1, N_CHUNKS_PAD=1,
                                       S_PAD=s_pad, PHASE=0, **flags)
        return
    split = dict(CHUNK=shape.chunk, N_CHUNKS=n_chunks, N_CHUNKS_PAD=n_chunks_pad, S_PAD=s_pad,
                 **flags)
    if interpreted or split_phases:
        # Separate launches need no epochs: a fresh buffer of their own.
        words = torch.zeros(T * token_words, dtype=torch.int64, device=prefix.device)
        args = (*common, words, H, float(eps), float(out_eps))
        for phase in (1, 2, 3) if has_norm else (1, 2):
            _attn_res_split_kernel[(n_chunks, T)](*args, PHASE=phase, **split)
        return
    # Counters and records no other launch uses (launch_scratch): zeroed for this launch,
    # or a captured launch's own for good -- each launch leaves them one epoch on, ready for
    # the next replay. A poll waits only for words this launch's programs of the same token
    # write (docs/design-notes.md, "Scratch memory": why it terminates). ``words`` (tests):
    # the caller's buffer instead.
    if words is None:
        words = launch_scratch(prefix.device, T * token_words, torch.int64, reusable=True)
    _attn_res_split_kernel[(n_chunks, T)](*common, words, H, float(eps), float(out_eps),
                                          PHASE=0, **split)
