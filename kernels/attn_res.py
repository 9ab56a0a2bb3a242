"""Block Attention Residuals (AttnRes) in one Triton launch: the prefix update, the block
write, the depth-softmax over the sources and the output RMSNorm.

Semantics are ``k3fusion.reference.attn_res`` (the spec), computed in fp32. Per token
(one program per token, ``grid = (T,)``):

1. ``HAS_DELTA``: ``p = (prefix + delta).to(prefix.dtype)`` (fp32 add, one rounding),
   stored to ``prefix_out`` -- the prefix itself for the in-place op, a new buffer for
   the functional one. The *rounded* value is the last source, as in the spec.
2. ``WRITE_BLOCK``: the same rounded row is stored to ``blocks[t, block_write_idx]``.
3. An online (streaming) softmax over the sources, so every source row is read from
   memory exactly once: the prefix (already in registers) seeds the running state, then
   ``blocks[t, :num_blocks]`` are streamed ``SOURCES_PER_TILE`` rows at a time. For a
   source ``v``: ``logit = rsqrt(sum(v*v)/H + eps) * sum(v * g)`` with
   ``g = norm_w * proj_w`` (fp32), and with the running max ``m``, denominator ``den``
   and mix ``acc[H]``::

       m' = max(m, logit); acc = acc * exp(m - m') + exp(logit - m') * v
       den = den * exp(m - m') + exp(logit - m'); m = m'

   ``mixed = (acc / den).to(prefix.dtype)``. (``g`` is formed once per program; the
   spec's ``(v * norm_w) * proj_w`` differs from ``v * g`` by an fp32 rounding per term,
   part of the fp32 evaluation-order drift the tests allow for.)
4. ``HAS_OUT_NORM``: RMSNorm of the *rounded* mix (the spec rounds it to the model dtype
   first), in either formulation of ``k3fusion.reference.rms_norm``:
   cast-then-weight rounds the normalized row to the prefix dtype before the weight
   multiply; ``OUT_WEIGHT_IN_FP32`` does not.

``num_blocks == 0`` is a fast path: one source, softmax weight 1, ``mixed = p``; no
reductions, no exp.

What is constexpr and why: the four feature switches (dead code is compiled out, so the
in-place decode variant carries no delta/norm registers it does not use), the tile
shape (``BLOCK_H = next_pow2(H)``: the whole fp32 ``acc`` row lives in registers;
``SOURCES_PER_TILE``: the load shape). ``num_blocks`` and ``block_write_idx`` are
*runtime* arguments and explicitly not specialized (``do_not_specialize``): the count of
completed blocks grows layer by layer (0, 1, ..., 8 for Kimi-K3), and a new value must
never cost a recompile -- Triton would otherwise specialize an int argument equal to 1
or divisible by 16.

Launch shapes (:func:`pick_launch_shape`): a *decode* shape loads several sources per
tile (one ``[SOURCES_PER_TILE, BLOCK_H]`` load: more bytes in flight for the few
programs a small batch gives), a *prefill* shape one source per tile (smaller tiles,
fewer registers, more programs resident). Offsets are int64: ``T * token_stride`` and
``block * block_stride`` overflow int32 at long prefill sizes (a bank stacked along dim
0 has a block stride of ``T * H``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._launch import check_launchable

__all__ = ["attn_res", "pick_launch_shape", "LaunchShape", "PREFILL_TOKENS",
           "DECODE_SOURCES_PER_TILE", "PREFILL_SOURCES_PER_TILE"]

#: From this many tokens on, the prefill shape is used. Measured on the H200 (bf16,
#: H = 7168, 9 sources; docs/benchmarks.md): the decode shape is best up to T = 512
#: (4x16: 35.5 us vs 37.1 for 1x8) and the prefill shape from 4096 on (2x4: 241 us vs 245).
PREFILL_TOKENS = 1024
#: Sources per tile of the decode shape (4x16 was fastest from T = 1 to 512).
DECODE_SOURCES_PER_TILE = 4
#: Sources per tile of the prefill shape (2x4 was fastest at T = 4096).
PREFILL_SOURCES_PER_TILE = 2


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
    HAS_DELTA: tl.constexpr,
    WRITE_BLOCK: tl.constexpr,
    HAS_OUT_NORM: tl.constexpr,
    OUT_WEIGHT_IN_FP32: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)  # int64: token * stride overflows int32
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    dtype = prefix_ptr.dtype.element_ty

    p = tl.load(prefix_ptr + tok * prefix_stride + cols, mask=cmask, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptr + tok * delta_stride + cols, mask=cmask, other=0.0)
        # fp32 add, one rounding to the prefix dtype: the rounded value is the new prefix
        # and the last source (as the spec's prefix.copy_(...) then re-read).
        p = (p.to(tl.float32) + d.to(tl.float32)).to(dtype)
        tl.store(prefix_out_ptr + tok * prefix_out_stride + cols, p, mask=cmask)
    blocks_row = blocks_ptr + tok * blocks_token_stride
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
        srcs = tl.arange(0, SOURCES_PER_TILE)
        for s0 in range(0, num_blocks, SOURCES_PER_TILE):
            s = s0 + srcs
            smask = s < num_blocks
            x = tl.load(
                blocks_row + s.to(tl.int64)[:, None] * blocks_block_stride + cols[None, :],
                mask=smask[:, None] & cmask[None, :],
                other=0.0,
            ).to(tl.float32)
            logit = tl.rsqrt(tl.sum(x * x, axis=1) / H + eps) * tl.sum(x * g[None, :], axis=1)
            logit = tl.where(smask, logit, float("-inf"))
            m_new = tl.maximum(m, tl.max(logit, axis=0))
            scale = tl.exp(m - m_new)
            w = tl.exp(logit - m_new)  # 0 for the masked rows
            den = den * scale + tl.sum(w, axis=0)
            acc = acc * scale + tl.sum(w[:, None] * x, axis=0)
            m = m_new
        mixed = acc / den

    # The spec rounds the mix to the model dtype (a module materializes it) before the
    # output norm reads it.
    mixed = mixed.to(dtype)
    if HAS_OUT_NORM:
        y = mixed.to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(y * y, axis=0) / H + out_eps)
        w_out = tl.load(out_norm_w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        if OUT_WEIGHT_IN_FP32:
            y = y * inv_rms * w_out
        else:
            # cast-then-weight: the normalized row is rounded before weighting.
            y = (y * inv_rms).to(dtype).to(tl.float32) * w_out
        tl.store(out_ptr + tok * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=cmask)
    else:
        tl.store(out_ptr + tok * out_stride + cols, mixed.to(out_ptr.dtype.element_ty),
                 mask=cmask)


@dataclass(frozen=True)
class LaunchShape:
    """Sources loaded per tile (1: the prefill shape), warps per program, row tile width."""

    sources_per_tile: int
    num_warps: int
    block_h: int


def pick_launch_shape(T: int, H: int, num_blocks: int, *, prefill_tokens: int | None = None,
                      sources_per_tile: int = 0, num_warps: int = 0) -> LaunchShape:
    """Launch shape for ``T`` tokens of width ``H`` with ``num_blocks`` completed blocks.

    * decode (T < ``prefill_tokens``, default :data:`PREFILL_TOKENS`):
      :data:`DECODE_SOURCES_PER_TILE` sources per tile, 64 tile elements per thread;
    * prefill: :data:`PREFILL_SOURCES_PER_TILE` sources per tile, 128 per thread;
    * never more sources per tile than there are sources (rounded up to a power of two).

    At H = 7168 (BLOCK_H 8192) that is 4 sources x 16 warps and 2 x 4, the fastest shapes
    of the H200 sweep (docs/benchmarks.md). ``num_blocks`` is a runtime argument of the
    kernel: it only picks among these shapes, it never adds a compiled variant.
    Register use (ptxas, sm_90, triton 3.7, bf16, every switch on): 4 x 16 128 registers,
    no spills. ``sources_per_tile``/``num_warps`` > 0 override (tests, the sweep).
    """
    block_h = triton.next_power_of_2(max(H, 1))
    threshold = PREFILL_TOKENS if prefill_tokens is None else prefill_tokens
    prefill = T >= threshold
    if sources_per_tile <= 0:
        sources_per_tile = PREFILL_SOURCES_PER_TILE if prefill else DECODE_SOURCES_PER_TILE
        # No wider than the sources there are (num_blocks + the prefix).
        sources_per_tile = min(sources_per_tile, triton.next_power_of_2(num_blocks + 1))
    if sources_per_tile & (sources_per_tile - 1):
        raise ValueError(f"sources_per_tile must be a power of two, got {sources_per_tile}")
    if num_warps <= 0:
        # Measured: decode wants many threads in flight (64 tile elements per thread),
        # prefill fewer, fatter programs (128 per thread) so more tokens are resident.
        per_thread = 4096 if prefill else 2048
        num_warps = max(1, min(16, sources_per_tile * block_h // per_thread))
    if num_warps & (num_warps - 1):
        raise ValueError(f"num_warps must be a power of two, got {num_warps}")
    return LaunchShape(sources_per_tile, num_warps, block_h)


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
) -> None:
    """Launch the AttnRes kernel on row views.

    ``prefix [T, H]``, ``delta [T, H]`` (optional), ``out [T, H]`` (preallocated; its
    dtype decides the store), ``blocks [T, NBmax, H]``: any token/row and block strides,
    last dim contiguous. With ``delta``, the rounded ``prefix + delta`` is written to
    ``prefix_out`` (pass ``prefix`` itself for the in-place update). ``block_write_idx
    >= 0`` writes that row into ``blocks[:, block_write_idx]``.

    Arguments are validated by the caller (``k3fusion.ops``); this only checks what the
    kernel itself needs. ``prefill_tokens``, ``sources_per_tile`` and ``num_warps``
    override :func:`pick_launch_shape` (benchmark sweeps, tests).
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
                              sources_per_tile=sources_per_tile, num_warps=num_warps)
    has_delta = delta is not None
    has_norm = out_norm_w is not None
    _attn_res_kernel[(T,)](
        prefix, prefix.stride(0),
        prefix_out if has_delta else prefix, (prefix_out if has_delta else prefix).stride(0),
        delta if has_delta else prefix, (delta if has_delta else prefix).stride(0),
        blocks, blocks.stride(0), blocks.stride(1),
        int(num_blocks),
        int(block_write_idx) if write else 0,
        norm_w, proj_w, out_norm_w if has_norm else norm_w,
        out, out.stride(0),
        H, float(eps), float(out_eps),
        BLOCK_H=shape.block_h,
        SOURCES_PER_TILE=shape.sources_per_tile,
        HAS_DELTA=has_delta,
        WRITE_BLOCK=write,
        HAS_OUT_NORM=has_norm,
        OUT_WEIGHT_IN_FP32=bool(out_weight_in_fp32),
        num_warps=shape.num_warps,
    )
