"""Block Attention Residuals (AttnRes) in one Triton launch: the prefix update, the block
write, the depth-softmax over the sources and the output RMSNorm.

Semantics are ``k3fusion.reference.attn_res`` (the spec), computed in fp32. Per token:

1. ``HAS_DELTA``: ``p = (prefix + delta).to(prefix.dtype)`` (fp32 add, one rounding),
   stored to ``prefix_out`` -- the prefix itself for the in-place op, a new buffer for
   the functional one. The *rounded* value is the last source, as in the spec.
2. ``WRITE_BLOCK``: the same rounded row is stored to ``blocks[t, block_write_idx]``.
3. A softmax over the sources ``blocks[t, :num_blocks]`` and ``p``, keyed by
   ``logit = rsqrt(sum(v*v)/H + eps) * sum(v * g)`` with ``g = norm_w * proj_w`` (fp32),
   ``mixed = (sum_s softmax_s * v_s).to(prefix.dtype)``. (The spec's
   ``(v * norm_w) * proj_w`` differs from ``v * g`` by an fp32 rounding per term, part
   of the fp32 evaluation-order drift the tests allow for.)
4. ``HAS_OUT_NORM``: RMSNorm of the mix in either formulation of
   ``k3fusion.reference.rms_norm`` (cast-then-weight rounds the normalized row to the
   prefix dtype before the weight multiply; ``OUT_WEIGHT_IN_FP32`` does not).

Two kernels (the four feature switches are constexpr in both, so dead code compiles out);
the row kernel runs by default at every T, the split kernel is opt-in:

* **split** (opt-in; T <= :data:`SPLIT_MAX_TOKENS`, 0 by default): ``cdiv(H, CHUNK)`` programs per
  token, each holding its ``CHUNK`` columns of *every* source in registers at once (a
  ``[S_PAD, CHUNK]`` tile), so a token's bytes are in flight on many SMs at the same time
  instead of one source after the other on one SM. The logits need whole-row sums: each
  program stores its partial ``sum(v*g)`` and ``sum(v*v)`` per source, the token's
  programs meet at a barrier, and each sums the partials, forms the softmax weights and
  mixes its own chunk. The output norm needs the sum of squares of the whole *rounded*
  mix (the spec): a second partial-sum exchange. (Taking it from the Gram matrix of the
  sources instead -- one exchange -- squares the unrounded mix, which differs from the
  spec by the rounding's bias: ~1% under the interpreter's truncating casts.)
* **row** (the default, every T): one program per token and an online (streaming) softmax
  over sources, each source row read once: the prefix (already in registers) seeds the
  running max ``m``, denominator ``den`` and mix ``acc[H]``; blocks are streamed
  ``SOURCES_PER_TILE`` rows at a time::

       m' = max(m, logit); acc = acc * exp(m - m') + exp(logit - m') * v
       den = den * exp(m - m') + exp(logit - m'); m = m'

  Many tokens fill the GPU, so no cross-program exchange is needed.

The split kernel's barrier: programs of one token add to that token's int64 counter in
``sync``; the adds of one exchange total exactly ``SYNC_EPOCH`` (chunk 0 adds
``SYNC_EPOCH - (n - 1)``, the others 1), so the counter is a multiple of ``SYNC_EPOCH``
between the exchanges of a launch, and each program waits for the next multiple. So a
launch leaves every counter at a multiple of ``SYNC_EPOCH`` -- a valid start for the next
launch, whatever it was before (zero, as a fresh buffer is, included); nothing is reset,
which would cost every program one more atomic round trip at its end (a departure counter
did: 6.6 -> 8.1 us at T = 1 on the H200). CUDA-graph replays in any order are fine for the
same reason (``_launch.counter_buffer``). Requirements: all programs of a token must be resident together (a token's programs
are adjacent in the grid and blocks are dispatched in order, so earlier tokens always
finish; split launches are small anyway), and two launches must not use one counter
concurrently (one buffer per device and stream). Under Triton's CPU interpreter programs
run one after another, so a barrier would wait forever: there the split kernel runs as
separate launches per ``PHASE`` -- the same arithmetic, which a GPU test compares bit for
bit with the one-launch form.

What the barrier costs: measured on the H200, each exchange (CTA barrier, release atomic,
acquire poll, reading the partials back from L2) adds ~1.2 us to a token -- about what
spreading a token's loads over 7 SMs saves, so the split kernel only ever tied the row
kernel at T <= 8 and is opt-in since the row kernel's early first tile (docs/benchmarks.md).

``num_blocks == 0`` is a fast path in both: one source, softmax weight exactly 1,
``mixed = p``; no logit is computed (a row whose sum of squares overflows stays exact).

``num_blocks`` and ``block_write_idx`` are *runtime* arguments, explicitly not
specialized (``do_not_specialize``): the count of completed blocks grows layer by layer
(0, 1, ..., 8 for Kimi-K3) and a new value must never cost a recompile. The split
kernel's source tile ``S_PAD`` is the source count rounded up to a power of two: Kimi-K3's
nine counts share four compiled variants (2, 4, 8, 16 rows), all built in the first
step. Offsets are int64: ``T * token_stride``
and ``block * block_stride`` overflow int32 at long prefill sizes (a bank stacked along
dim 0 has a block stride of ``T * H``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._fences import fence_gpu
from ._launch import cdiv, check_launchable, counter_buffer, interpreter_enabled

__all__ = ["attn_res", "pick_launch_shape", "LaunchShape", "PREFILL_TOKENS", "SPLIT_NUM_WARPS",
           "DECODE_SOURCES_PER_TILE", "PREFILL_SOURCES_PER_TILE", "SPLIT_MAX_TOKENS",
           "SPLIT_CHUNK", "SPLIT_MAX_PROGRAMS", "SPLIT_MAX_SOURCES", "PREFILL_LOOP_STAGES",
           "EARLY_TILE_MAX_TOKENS"]

#: From this many tokens on, the row kernel uses its prefill shape. Measured on the H200
#: (bf16, H = 7168, 9 sources; docs/benchmarks.md): the decode shape 4x16 (unpipelined)
#: best up to T = 128 (8.94 us at 32, 11.70 against 12.38 at 128), the pipelined prefill
#: shape 1x8 from T = 256 (17.42 us against 20.09; 30.78 against 35.81 at 512, 206.6
#: against 241.5 at 4096).
PREFILL_TOKENS = 256
#: Sources per tile of the row kernel's decode shape.
DECODE_SOURCES_PER_TILE = 4
#: Sources per tile of the row kernel's prefill shape: one source row per loop step ...
PREFILL_SOURCES_PER_TILE = 1
#: ... software-pipelined three deep (two rows in flight while one is reduced).
PREFILL_LOOP_STAGES = 3
#: Most shared memory the automatic choice lets the pipelined source loop take (its
#: ``LOOP_STAGES - 1`` buffers of a source tile); wider rows run unpipelined (the H200 has
#: 227 KiB per block; H = 7168 bf16 takes 32 KiB).
LOOP_SMEM_BYTES = 160 * 1024
#: Up to this many tokens the row kernel's decode shape loads its first source tile
#: before the prefix (``EARLY_TILE``: the two HBM round trips overlap instead of following
#: each other). Measured on the H200 (bf16, H = 7168, 9 sources, two interleaved runs;
#: docs/benchmarks.md): 7.09 -> 6.81 us at T = 1, 8.96 -> 8.17 at 16, 9.00 -> 8.23 at 32,
#: 9.87 -> 9.37 at 64, 10.7 -> 10.6 at 96, but 11.4 -> 11.7 at 128.
EARLY_TILE_MAX_TOKENS = 64
#: Up to this many tokens the split kernel runs: none by default (it is opt-in, ``kind=
#: "split"`` or ``split_max_tokens``). Measured on the H200 (same runs): the row kernel
#: with its early tile took 6.81 / 6.96 us at T = 1 against the split kernel's 7.00 /
#: 7.67, 6.88 against 7.57 at 4, and 7.00 / 7.26 against 6.67 / 7.79 at 8 -- no T where
#: the split kernel's two barrier exchanges (~1.2 us each) reliably paid for themselves.
SPLIT_MAX_TOKENS = 0
#: Columns per program of the split kernel (7 programs per 7168-wide token) ...
SPLIT_CHUNK = 1024
#: ... and warps: 1024 x 4 was the fastest or within 0.1 us of it at T = 1 and 8 in the
#: final barrier's sweep (7.03 / 6.64 us; 512 x 4: 7.61 / 6.69; H200, docs/benchmarks.md).
SPLIT_NUM_WARPS = 4
#: Most programs one split launch may have (forced launches included): a token's programs
#: must be resident together while they wait at the barrier; in-order dispatch keeps that
#: true for any grid, this bound keeps it far from the limits of the counter buffer.
SPLIT_MAX_PROGRAMS = 1 << 20
#: Tokens are the split kernel's second grid dim, which CUDA caps at 65535.
SPLIT_MAX_GRID_Y = 65535
#: Most sources (blocks + prefix) the split kernel holds in registers at once.
SPLIT_MAX_SOURCES = 32
#: What the programs of one token add to its barrier counter per exchange (> programs per token).
SYNC_EPOCH = tl.constexpr(1 << 16)


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
def _online_step(m, den, acc, x, s, num_blocks, g, H, eps):
    """Fold a tile of source rows ``x`` (fp32; rows ``s``, those >= num_blocks masked)
    into the running max ``m``, denominator ``den`` and mix ``acc``."""
    smask = s < num_blocks
    logit = tl.rsqrt(tl.sum(x * x, axis=1) / H + eps) * tl.sum(x * g[None, :], axis=1)
    logit = tl.where(smask, logit, float("-inf"))
    m_new = tl.maximum(m, tl.max(logit, axis=0))
    scale = tl.exp(m - m_new)
    w = tl.exp(logit - m_new)  # 0 for the masked rows
    den = den * scale + tl.sum(w, axis=0)
    acc = acc * scale + tl.sum(w[:, None] * x, axis=0)
    return m_new, den, acc


@triton.jit(do_not_specialize=["num_blocks", "block_write_idx"])
def _attn_res_kernel(
    prefix_ptr, prefix_stride,
    prefix_out_ptr, prefix_out_stride,
    delta_ptr, delta_stride,
    blocks_ptr, blocks_token_stride, blocks_block_stride,
    num_blocks,
    block_write_idx,
    norm_w_ptr, proj_w_ptr, out_norm_w_ptr,
    out_ptr, out_stride,
    H, eps, out_eps,
    BLOCK_H: tl.constexpr,
    SOURCES_PER_TILE: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
    EARLY_TILE: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    WRITE_BLOCK: tl.constexpr,
    HAS_OUT_NORM: tl.constexpr,
    OUT_WEIGHT_IN_FP32: tl.constexpr,
):
    """One program per token (``grid = (T,)``), online softmax over the sources."""
    tok = tl.program_id(0).to(tl.int64)  # int64: token * stride overflows int32
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    dtype = prefix_ptr.dtype.element_ty

    blocks_row = blocks_ptr + tok * blocks_token_stride
    srcs = tl.arange(0, SOURCES_PER_TILE)
    if EARLY_TILE:
        # The first source tile does not depend on the prefix: issued before the prefix
        # load, the two HBM round trips overlap instead of following each other.
        x_first = tl.load(
            blocks_row + srcs.to(tl.int64)[:, None] * blocks_block_stride + cols[None, :],
            mask=(srcs < num_blocks)[:, None] & cmask[None, :], other=0.0)
    p = _update_prefix(prefix_ptr + tok * prefix_stride, delta_ptr + tok * delta_stride,
                       prefix_out_ptr + tok * prefix_out_stride, cols, cmask, HAS_DELTA)
    if WRITE_BLOCK:
        tl.store(blocks_row + block_write_idx.to(tl.int64) * blocks_block_stride + cols, p,
                 mask=cmask)

    v = p.to(tl.float32)
    if num_blocks == 0:
        # One source: its softmax weight is exactly 1, the mix is the prefix itself.
        mixed = v
    else:
        g = (tl.load(norm_w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
             * tl.load(proj_w_ptr + cols, mask=cmask, other=0.0).to(tl.float32))
        # The prefix (in registers already) seeds the running state: m = its logit,
        # den = exp(0) = 1, acc = v. No -inf start, so no exp(-inf - -inf).
        m = tl.rsqrt(tl.sum(v * v, axis=0) / H + eps) * tl.sum(v * g, axis=0)
        den = tl.full([], 1.0, tl.float32)
        acc = v
        first = 0
        if EARLY_TILE:
            m, den, acc = _online_step(m, den, acc, x_first.to(tl.float32), srcs, num_blocks,
                                       g, H, eps)
            first = SOURCES_PER_TILE
        # LOOP_STAGES > 1: the next tiles' loads are in flight (cp.async into shared
        # memory) while this one is reduced; a plain loop waits a full HBM round trip
        # per tile (a loop without a dot is not pipelined by default).
        for s0 in tl.range(first, num_blocks, SOURCES_PER_TILE, num_stages=LOOP_STAGES):
            s = s0 + srcs
            x = tl.load(
                blocks_row + s.to(tl.int64)[:, None] * blocks_block_stride + cols[None, :],
                mask=(s < num_blocks)[:, None] & cmask[None, :],
                other=0.0,
            ).to(tl.float32)
            m, den, acc = _online_step(m, den, acc, x, s, num_blocks, g, H, eps)
        mixed = acc / den

    # The spec rounds the mix to the model dtype (a module materializes it) before the
    # output norm reads it.
    mixed = mixed.to(dtype)
    inv_rms = 0.0
    if HAS_OUT_NORM:
        y = mixed.to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(y * y, axis=0) / H + out_eps)
    _store_output(out_ptr + tok * out_stride + cols, mixed, cmask, out_norm_w_ptr + cols,
                  inv_rms, HAS_OUT_NORM, OUT_WEIGHT_IN_FP32)


# ---------------------------------------------------------------------- split kernel


@triton.jit
def _token_barrier(counter_ptr, chunk, N_CHUNKS: tl.constexpr, EPOCH: tl.constexpr):
    """Wait until every program of this token has arrived (see the module docstring).

    Every thread fences its own partial-sum stores at GPU scope, a CTA barrier, then one
    thread's acq_rel atomic arrives; one thread polls with acquire loads, and a CTA
    barrier hands that on. Measured: without the per-thread fence (a CTA barrier and a
    release atomic alone) programs read stale partial sums at T = 128 and 1000 on the
    H200 -- the GPU test comparing one launch with the phased launches catches it."""
    fence_gpu()
    tl.debug_barrier()
    add = 1 + (chunk == 0).to(tl.int64) * (EPOCH - N_CHUNKS)
    old = tl.atomic_add(counter_ptr, add, sem="acq_rel", scope="gpu")
    target = (old // EPOCH + 1) * EPOCH
    seen = old + add
    while seen < target:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()
    # 0 -- the counter stays far below 2**62 (2**45 launches per token slot) -- but not
    # provably so: the caller adds it to the addresses of the partial sums it reads next,
    # so no compiler pass can hoist those loads above the wait (on the H200, stale
    # partials were read at 2 warps per program before this dependency existed).
    return (seen >> 62).to(tl.int32)


@triton.jit(do_not_specialize=["num_blocks", "block_write_idx"])
def _attn_res_split_kernel(
    prefix_ptr, prefix_stride,
    prefix_out_ptr, prefix_out_stride,
    delta_ptr, delta_stride,
    blocks_ptr, blocks_token_stride, blocks_block_stride,
    num_blocks,
    block_write_idx,
    norm_w_ptr, proj_w_ptr, out_norm_w_ptr,
    out_ptr, out_stride,
    partials_ptr, sync_ptr,
    H, eps, out_eps,
    CHUNK: tl.constexpr,
    N_CHUNKS: tl.constexpr,
    N_CHUNKS_PAD: tl.constexpr,
    S_PAD: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    WRITE_BLOCK: tl.constexpr,
    HAS_OUT_NORM: tl.constexpr,
    OUT_WEIGHT_IN_FP32: tl.constexpr,
    PHASE: tl.constexpr,
):
    """``grid = (N_CHUNKS, T)``: program ``(c, t)`` owns columns ``[c*CHUNK, (c+1)*CHUNK)``
    of token ``t``. ``PHASE`` 0 runs all of it with the barriers; the interpreter runs
    1 (up to the source sums), 2 (up to the mix's sum of squares, or the output when
    there is no norm) and 3 (the normed output) as separate launches."""
    chunk = tl.program_id(0)
    tok = tl.program_id(1).to(tl.int64)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    cmask = cols < H
    dtype = prefix_ptr.dtype.element_ty
    srcs = tl.arange(0, S_PAD)
    # Partial sums, one record per (token, chunk): sum(v*g) and sum(v*v) per source, then
    # the chunk's sum of squares of the rounded mix.
    REC: tl.constexpr = 2 * S_PAD + 1
    token_recs = partials_ptr + tok * N_CHUNKS_PAD * REC
    rec_ptr = token_recs + chunk * REC
    # Every chunk's record of this token ([N_CHUNKS_PAD]); .cg loads: from L2, where the
    # other programs stored them, never a stale L1 line.
    ks = tl.arange(0, N_CHUNKS_PAD)
    kmask = ks < N_CHUNKS
    counter = sync_ptr + tok

    if PHASE >= 2:
        # An earlier launch updated the prefix (prefix_out holds the rounded row).
        if HAS_DELTA:
            p = tl.load(prefix_out_ptr + tok * prefix_out_stride + cols, mask=cmask, other=0.0)
        else:
            p = tl.load(prefix_ptr + tok * prefix_stride + cols, mask=cmask, other=0.0)
    else:
        p = _update_prefix(prefix_ptr + tok * prefix_stride, delta_ptr + tok * delta_stride,
                           prefix_out_ptr + tok * prefix_out_stride, cols, cmask, HAS_DELTA)
        blocks_row = blocks_ptr + tok * blocks_token_stride
        if WRITE_BLOCK:
            tl.store(blocks_row + block_write_idx.to(tl.int64) * blocks_block_stride + cols, p,
                     mask=cmask)

    if num_blocks == 0 and not HAS_OUT_NORM:
        # One source and no norm: nothing needs the other chunks.
        if PHASE == 0 or PHASE == 2:
            tl.store(out_ptr + tok * out_stride + cols, p.to(out_ptr.dtype.element_ty),
                     mask=cmask)
    else:
        if num_blocks == 0:
            # One source: softmax weight exactly 1, no logit (an overflowing row stays exact).
            mixed = p
        else:
            # Every source's chunk at once: blocks in rows [0, num_blocks), the prefix in
            # row num_blocks, zeros below (they add nothing to any sum).
            smask = srcs < num_blocks
            x = tl.load(blocks_ptr + tok * blocks_token_stride
                        + srcs.to(tl.int64)[:, None] * blocks_block_stride + cols[None, :],
                        mask=smask[:, None] & cmask[None, :], other=0.0)
            x = tl.where((srcs == num_blocks)[:, None], p[None, :], x).to(tl.float32)
            if PHASE <= 1:
                g = (tl.load(norm_w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
                     * tl.load(proj_w_ptr + cols, mask=cmask, other=0.0).to(tl.float32))
                tl.store(rec_ptr + srcs, tl.sum(x * g[None, :], axis=1))
                tl.store(rec_ptr + S_PAD + srcs, tl.sum(x * x, axis=1))
            after = 0
            if PHASE == 0:
                after = _token_barrier(counter, chunk, N_CHUNKS, SYNC_EPOCH)
            if PHASE != 1:
                recs = token_recs + after + ks[:, None] * REC + srcs[None, :]
                dots = tl.sum(tl.load(recs, mask=kmask[:, None], other=0.0,
                                      cache_modifier=".cg"), axis=0)
                sumsq = tl.sum(tl.load(recs + S_PAD, mask=kmask[:, None], other=0.0,
                                       cache_modifier=".cg"), axis=0)
                logit = tl.rsqrt(sumsq / H + eps) * dots
                logit = tl.where(srcs <= num_blocks, logit, float("-inf"))
                e = tl.exp(logit - tl.max(logit, axis=0))
                w = e / tl.sum(e, axis=0)
                mixed = tl.sum(w[:, None] * x, axis=0).to(dtype)
        if PHASE != 1:
            if HAS_OUT_NORM:
                # The norm reads the mix rounded to the model dtype (the spec): its sum of
                # squares needs every chunk, hence a second exchange.
                if PHASE != 3:
                    y = mixed.to(tl.float32)
                    tl.store(rec_ptr + 2 * S_PAD, tl.sum(y * y, axis=0))
                after2 = 0
                if PHASE == 0:
                    after2 = _token_barrier(counter, chunk, N_CHUNKS, SYNC_EPOCH)
                if PHASE != 2:
                    sq = tl.sum(tl.load(token_recs + after2 + ks * REC + 2 * S_PAD, mask=kmask,
                                        other=0.0, cache_modifier=".cg"), axis=0)
                    _store_output(out_ptr + tok * out_stride + cols, mixed, cmask,
                                  out_norm_w_ptr + cols, tl.rsqrt(sq / H + out_eps),
                                  HAS_OUT_NORM, OUT_WEIGHT_IN_FP32)
            else:
                _store_output(out_ptr + tok * out_stride + cols, mixed, cmask,
                              out_norm_w_ptr + cols, 0.0, HAS_OUT_NORM, OUT_WEIGHT_IN_FP32)


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


def pick_launch_shape(T: int, H: int, num_blocks: int, *, prefill_tokens: int | None = None,
                      sources_per_tile: int = 0, num_warps: int = 0, kind: str = "auto",
                      chunk: int = 0, split_max_tokens: int | None = None,
                      loop_stages: int = 0, element_size: int = 2,
                      early_tile: bool | None = None) -> LaunchShape:
    """Launch shape for ``T`` tokens of width ``H`` with ``num_blocks`` completed blocks.

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

    ``num_blocks`` is a runtime argument of both kernels: it only picks among these
    shapes. ``kind`` ("split"/"row"), ``chunk``, ``sources_per_tile`` and ``num_warps``
    override (tests, the benchmark sweep); ``sources_per_tile > 0`` implies the row kernel,
    ``chunk > 0`` (without it) the split kernel; a ``loop_stages`` or ``early_tile`` given
    is taken as is.
    """
    if kind not in ("auto", "split", "row"):
        raise ValueError(f"kind must be 'auto', 'split' or 'row', got {kind!r}")
    block_h = triton.next_power_of_2(max(H, 1))
    if kind == "auto":
        most = SPLIT_MAX_TOKENS if split_max_tokens is None else split_max_tokens
        # The barrier is PTX (fences, acquire/release atomics): NVIDIA GPUs only.
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
    prefill_tokens: int | None = None,
    sources_per_tile: int = 0,
    num_warps: int = 0,
    kind: str = "auto",
    chunk: int = 0,
    split_max_tokens: int | None = None,
    split_phases: bool = False,
    loop_stages: int = 0,
    early_tile: bool | None = None,
) -> None:
    """Launch the AttnRes kernel on row views.

    ``prefix [T, H]``, ``delta [T, H]`` (optional), ``out [T, H]`` (preallocated; its
    dtype decides the store), ``blocks [T, NBmax, H]``: any token/row and block strides,
    last dim contiguous. With ``delta``, the rounded ``prefix + delta`` is written to
    ``prefix_out`` (pass ``prefix`` itself for the in-place update). ``block_write_idx
    >= 0`` writes that row into ``blocks[:, block_write_idx]``.

    Arguments are validated by the caller (``k3fusion.ops``); this only checks what the
    kernel itself needs. ``prefill_tokens``, ``sources_per_tile``, ``num_warps``,
    ``kind``, ``chunk`` and ``split_max_tokens`` override :func:`pick_launch_shape`
    (benchmark sweeps, tests); ``split_phases`` runs the split kernel as separate launches
    (one launch per phase, three with an output norm: what the interpreter always does;
    a GPU test compares the two forms).
    """
    tensors = [prefix, blocks, norm_w, proj_w, out]
    if delta is not None:
        if prefix_out is None:
            raise ValueError("prefix_out is required with delta (pass prefix to update in place)")
        tensors += [delta, prefix_out]
    if out_norm_w is not None:
        tensors.append(out_norm_w)
    check_launchable(*tensors)
    T, H = prefix.shape
    if T == 0:
        return
    nb_max = blocks.shape[1]
    if not 0 <= num_blocks <= nb_max:
        raise ValueError(f"num_blocks {num_blocks} outside [0, {nb_max}]")
    write = block_write_idx >= 0
    if write and not num_blocks <= block_write_idx < nb_max:
        raise ValueError(f"block_write_idx {block_write_idx} outside [{num_blocks}, {nb_max})")
    shape = pick_launch_shape(T, H, num_blocks, prefill_tokens=prefill_tokens,
                              sources_per_tile=sources_per_tile, num_warps=num_warps,
                              kind=kind, chunk=chunk, split_max_tokens=split_max_tokens,
                              loop_stages=loop_stages, element_size=blocks.element_size(),
                              early_tile=early_tile)
    has_delta = delta is not None
    has_norm = out_norm_w is not None
    common = (
        prefix, prefix.stride(0),
        prefix_out if has_delta else prefix, (prefix_out if has_delta else prefix).stride(0),
        delta if has_delta else prefix, (delta if has_delta else prefix).stride(0),
        blocks, blocks.stride(0), blocks.stride(1),
        int(num_blocks),
        int(block_write_idx) if write else 0,
        norm_w, proj_w, out_norm_w if has_norm else norm_w,
        out, out.stride(0),
    )
    flags = dict(HAS_DELTA=has_delta, WRITE_BLOCK=write, HAS_OUT_NORM=has_norm,
                 OUT_WEIGHT_IN_FP32=bool(out_weight_in_fp32), num_warps=shape.num_warps)
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
    # Bucketed so the block counts of a model (0..8 for Kimi-K3) share a few variants,
    # all compiled in the first step; num_blocks itself stays a runtime argument.
    s_pad = max(2, triton.next_power_of_2(num_blocks + 1))
    partials = torch.empty((T, n_chunks_pad, 2 * s_pad + 1), dtype=torch.float32,
                           device=prefix.device)
    interpreted = prefix.device.type == "cpu" and interpreter_enabled()
    # Per token: its barrier counter (left at a multiple of SYNC_EPOCH by every launch).
    sync = partials if interpreted else counter_buffer("attn_res", prefix.device, T,
                                                       torch.int64)
    split = dict(CHUNK=shape.chunk, N_CHUNKS=n_chunks, N_CHUNKS_PAD=n_chunks_pad, S_PAD=s_pad,
                 **flags)
    args = (*common, partials, sync, H, float(eps), float(out_eps))
    if interpreted or split_phases:
        for phase in (1, 2, 3) if has_norm else (1, 2):
            _attn_res_split_kernel[(n_chunks, T)](*args, PHASE=phase, **split)
    else:
        _attn_res_split_kernel[(n_chunks, T)](*args, PHASE=0, **split)
