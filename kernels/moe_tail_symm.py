"""One-shot all-reduce of the latent-MoE tail's two partial sums over symmetric memory.

The multi-GPU fused tail (``k3fusion.moe_tail_symm``) needs
``all_reduce(routed_latent [T, L])`` and ``all_reduce(shared [T, H])`` for decode-sized T
(a few hundred KB per rank), where latency, not bandwidth, is the cost. In a one-shot
all-reduce every rank reads every peer's partial directly (over NVLink) and sums them
itself: one step, no ring. This module is that kernel, for both tensors in one launch.

Every rank copies its partials into its own symmetric buffer, meets every peer at a
signal-pad barrier, sums every peer's tile in fp32 in rank order (bit-identical sums on
every rank), and meets them again before the buffer is reused.

The steps, the signal-pad protocol and what the caller must keep: docs/design-notes.md, "kernels/moe_tail_symm.py".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import triton
import triton.language as tl

from ._fences import fence_system
from ._launch import TL_DTYPES, cdiv

__all__ = ["MAX_PROGRAMS", "PeerBuffers", "channel_programs", "packed_layout",
           "pick_programs", "one_shot_all_reduce_pair", "reduce_in_rank_order"]

#: Largest grid of one launch (every program must be resident while it waits).
MAX_PROGRAMS = 64

#: Barrier channels a launch uses (in, out); each holds one slot row per program.
CHANNELS = 2

#: Byte alignment of the shared segment in a buffer (16: vector loads stay aligned).
_ALIGN = 16


# ---------------------------------------------------------------------- barrier halves


@triton.jit
def _swap_flags(flags, live, FROM: tl.constexpr, TO: tl.constexpr, SEM: tl.constexpr):
    """Turn every live lane's flag from ``FROM`` into ``TO``, retrying a lane while its flag
    holds the other value (a raise waits for the previous flag to be consumed, a consume
    for the flag to arrive). Lanes already done compare-and-swap 2 -> 2 (flags are 0 or 1):
    nothing is written."""
    todo = live
    while tl.max(todo.to(tl.int32), axis=0) > 0:
        old = tl.atomic_cas(flags, tl.where(todo, FROM, 2), tl.where(todo, TO, 2), sem=SEM,
                            scope="sys")
        todo = todo & (old != FROM)


@triton.jit
def _put_flags(pad_ptrs, slot, rank, WORLD: tl.constexpr, WORLD_P2: tl.constexpr,
               SEM: tl.constexpr):
    """Raise this rank's flag in ``slot`` of every rank's signal pad (its own included)."""
    peers = tl.arange(0, WORLD_P2)
    live = peers < WORLD
    # Padding lanes (WORLD not a power of two) aim at this rank's own flag and never write.
    pads = tl.load(pad_ptrs + tl.where(live, peers, rank)).to(tl.pointer_type(tl.int32))
    _swap_flags(pads + slot * WORLD + rank, live, 0, 1, SEM)


@triton.jit
def _wait_flags(pad_ptrs, slot, rank, WORLD: tl.constexpr, WORLD_P2: tl.constexpr,
                SEM: tl.constexpr):
    """Consume every rank's flag in ``slot`` of this rank's signal pad (1 -> 0)."""
    peers = tl.arange(0, WORLD_P2)
    live = peers < WORLD
    mine = tl.load(pad_ptrs + rank).to(tl.pointer_type(tl.int32))
    _swap_flags(mine + slot * WORLD + tl.where(live, peers, rank), live, 1, 0, SEM)


# ---------------------------------------------------------------------- data movement


@triton.jit
def _pack(src_ptr, src_stride, dst_ptr, N, WIDTH, pid, nprog, BLOCK: tl.constexpr):
    """Copy this program's tiles of a ``[rows, WIDTH]`` row view (any row stride) into the
    packed ``[N = rows * WIDTH]`` segment at ``dst_ptr``."""
    for tile in range(pid, tl.cdiv(N, BLOCK), nprog):
        f = tile * BLOCK + tl.arange(0, BLOCK)
        mask = f < N
        row = f // WIDTH
        col = f - row * WIDTH
        v = tl.load(src_ptr + row.to(tl.int64) * src_stride + col, mask=mask)
        tl.store(dst_ptr + f, v, mask=mask)


@triton.jit
def _reduce(buf_ptrs, seg_offset, out_ptr, N, pid, nprog, WORLD: tl.constexpr,
            BLOCK: tl.constexpr):
    """``out[f] = round(sum over r = 0..WORLD-1 of buffer_r[seg_offset:][f])`` for this
    program's tiles, the sum in fp32 in rank order (the same on every rank)."""
    for tile in range(pid, tl.cdiv(N, BLOCK), nprog):
        f = tile * BLOCK + tl.arange(0, BLOCK)
        mask = f < N
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD):
            base = tl.load(buf_ptrs + r) + seg_offset
            seg = tl.multiple_of(base.to(tl.pointer_type(out_ptr.dtype.element_ty)), 16)
            # .cg: read through L2, never an L1 line left from the previous launch.
            v = tl.load(seg + f, mask=mask, other=0.0, cache_modifier=".cg")
            acc += v.to(tl.float32)
        tl.store(out_ptr + f, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _one_shot_pair_kernel(
    x_ptr, x_stride,            # this rank's routed-latent partial [T, L]
    s_ptr, s_stride,            # this rank's shared partial [T, H]
    xo_ptr, so_ptr,             # reduced, contiguous [T, L] and [T, H]
    buf_ptrs,                   # int64 [WORLD]: every rank's symmetric buffer address
    pad_ptrs,                   # int64 [WORLD]: every rank's signal pad address
    rank,
    N_X, L, N_S, H,             # N_X = T * L, N_S = T * H
    S_OFFSET,                   # bytes from a buffer's start to its shared segment
    CHANNEL_PROGRAMS,           # slot rows per barrier channel (>= the grid)
    WORLD: tl.constexpr,
    WORLD_P2: tl.constexpr,
    BLOCK: tl.constexpr,
    GPU_FENCE: tl.constexpr,    # off in Triton's interpreter (no inline PTX there)
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    mine = tl.load(buf_ptrs + rank)
    my_x = tl.multiple_of(mine.to(tl.pointer_type(x_ptr.dtype.element_ty)), 16)
    my_s = tl.multiple_of((mine + S_OFFSET).to(tl.pointer_type(s_ptr.dtype.element_ty)), 16)

    # 1. copy-in: this program's tiles of both partials into this rank's buffer.
    _pack(x_ptr, x_stride, my_x, N_X, L, pid, nprog, BLOCK)
    _pack(s_ptr, s_stride, my_s, N_S, H, pid, nprog, BLOCK)

    # 2. barrier in: the stores above (every thread's, ordered by the CTA barrier) are
    #    released with this rank's flag; the acquire of every rank's flag, handed on by
    #    the second CTA barrier, makes their copied tiles visible to every thread here.
    if GPU_FENCE:
        # Every thread fences its own copy-in at system scope first (peers read it over
        # NVLink): the split AttnRes barrier read stale partials on the GPU with only a
        # CTA barrier and one release atomic (kernels/attn_res.py); not risked here.
        fence_system()
    tl.debug_barrier()
    _put_flags(pad_ptrs, pid, rank, WORLD, WORLD_P2, "release")
    _wait_flags(pad_ptrs, pid, rank, WORLD, WORLD_P2, "acquire")
    tl.debug_barrier()

    # 3. reduce in rank order, from every rank's buffer.
    _reduce(buf_ptrs, 0, xo_ptr, N_X, pid, nprog, WORLD, BLOCK)
    _reduce(buf_ptrs, S_OFFSET, so_ptr, N_S, pid, nprog, WORLD, BLOCK)

    # 4. barrier out: every rank's program `pid` is done reading these tiles from every
    #    buffer, so the next launch may overwrite them.
    tl.debug_barrier()
    _put_flags(pad_ptrs, CHANNEL_PROGRAMS + pid, rank, WORLD, WORLD_P2, "relaxed")
    _wait_flags(pad_ptrs, CHANNEL_PROGRAMS + pid, rank, WORLD, WORLD_P2, "relaxed")


# ---------------------------------------------------------------------- host side


@dataclass(frozen=True)
class PeerBuffers:
    """What a launch needs to reach every rank: this rank's index, the group size, and on
    the launch device an int64 ``[world]`` tensor of every rank's buffer address and one
    of every rank's signal-pad address (as this process maps them), with the sizes of
    one buffer and one pad in bytes. Every rank's buffers have the same size and layout.
    ``keepalive`` holds whatever owns the memory (symmetric-memory handle, mappings)."""

    rank: int
    world: int
    buffer_ptrs: torch.Tensor
    pad_ptrs: torch.Tensor
    buffer_bytes: int
    pad_bytes: int
    keepalive: Any = None

    def __post_init__(self):
        for name in ("rank", "world", "buffer_bytes", "pad_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"PeerBuffers.{name} must be an int, got {type(v).__name__}")
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ValueError(f"PeerBuffers: rank {self.rank} is not in a group of {self.world}")
        for name in ("buffer_ptrs", "pad_ptrs"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or \
                    tuple(t.shape) != (self.world,) or not t.is_contiguous():
                raise ValueError(f"PeerBuffers.{name} must be a contiguous int64 tensor of "
                                 f"shape ({self.world},), got {_describe(t)}")
        if self.pad_ptrs.device != self.buffer_ptrs.device:
            raise ValueError("PeerBuffers: buffer_ptrs and pad_ptrs are on different devices")
        if channel_programs(self.world, self.pad_bytes) < 1:
            raise ValueError(f"PeerBuffers: a signal pad of {self.pad_bytes} bytes has no room "
                             f"for {CHANNELS} barrier slots of {self.world} ranks")


def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{t.dtype} {tuple(t.shape)}"


def channel_programs(world: int, pad_bytes: int) -> int:
    """Programs the signal pad has slots for: ``CHANNELS`` rows of ``world`` uint32 flags
    per program."""
    return pad_bytes // (4 * world * CHANNELS)


def packed_layout(tokens: int, latent: int, hidden: int, routed_dtype: torch.dtype,
                  shared_dtype: torch.dtype) -> tuple[int, int]:
    """``(shared segment offset, bytes used)`` of one rank's buffer for a call."""
    routed_bytes = tokens * latent * routed_dtype.itemsize
    offset = cdiv(routed_bytes, _ALIGN) * _ALIGN
    return offset, offset + tokens * hidden * shared_dtype.itemsize


def pick_programs(n_routed: int, n_shared: int, block: int, world: int, pad_bytes: int) -> int:
    """Grid size: one program per tile of the larger segment, at most :data:`MAX_PROGRAMS`
    and at most what the signal pad has slots for. Depends only on facts every rank shares."""
    tiles = max(cdiv(n_routed, block), cdiv(n_shared, block), 1)
    return max(1, min(tiles, MAX_PROGRAMS, channel_programs(world, pad_bytes)))


def _check_partial(name: str, t, width_name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [T, {width_name}], got shape {tuple(t.shape)}")
    if t.dtype not in TL_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got stride {t.stride(1)}")


def one_shot_all_reduce_pair(routed: torch.Tensor, shared: torch.Tensor, peers: PeerBuffers,
                             *, block: int = 1024, programs: int = 0,
                             num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """``(all_reduce(routed), all_reduce(shared))`` over the ranks ``peers`` reaches, in one
    launch (module docstring); new contiguous tensors in the inputs' dtypes.

    ``routed [T, L]`` and ``shared [T, H]``: this rank's partials (any row strides, last
    dim contiguous; they are not modified). Every rank must make the same call (same
    shapes, dtypes and options). ``programs`` (0: :func:`pick_programs`) and ``block``
    (elements per tile, a power of two >= 16) are for tuning and tests.
    """
    _check_partial("routed", routed, "L")
    _check_partial("shared", shared, "H")
    if not isinstance(peers, PeerBuffers):
        raise TypeError(f"peers must be a PeerBuffers, got {type(peers).__name__}")
    if routed.shape[0] != shared.shape[0]:
        raise ValueError(f"routed has {routed.shape[0]} rows but shared has {shared.shape[0]}")
    for name, t in (("shared", shared), ("peers.buffer_ptrs", peers.buffer_ptrs)):
        if t.device != routed.device:
            raise ValueError(f"{name} is on {t.device} but routed is on {routed.device}")
    for name, v in (("block", block), ("programs", programs), ("num_warps", num_warps)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 16, got {block}")
    cap = min(MAX_PROGRAMS, channel_programs(peers.world, peers.pad_bytes))
    if not 0 <= programs <= cap:
        raise ValueError(f"programs must be 0 (automatic) or in [1, {cap}], got {programs}")
    tokens, latent = routed.shape
    hidden = shared.shape[1]
    s_offset, used = packed_layout(tokens, latent, hidden, routed.dtype, shared.dtype)
    if used > peers.buffer_bytes:
        raise ValueError(f"T={tokens} rows of L={latent} ({routed.dtype}) and H={hidden} "
                         f"({shared.dtype}) need {used} bytes of symmetric buffer; it has "
                         f"{peers.buffer_bytes}")
    routed_sum = torch.empty((tokens, latent), dtype=routed.dtype, device=routed.device)
    shared_sum = torch.empty((tokens, hidden), dtype=shared.dtype, device=shared.device)
    if tokens == 0:
        return routed_sum, shared_sum
    n_x, n_s = tokens * latent, tokens * hidden
    grid = programs or pick_programs(n_x, n_s, block, peers.world, peers.pad_bytes)
    _one_shot_pair_kernel[(grid,)](
        routed, routed.stride(0), shared, shared.stride(0), routed_sum, shared_sum,
        peers.buffer_ptrs, peers.pad_ptrs, peers.rank,
        n_x, latent, n_s, hidden, s_offset,
        channel_programs(peers.world, peers.pad_bytes),
        WORLD=peers.world, WORLD_P2=triton.next_power_of_2(peers.world), BLOCK=block,
        GPU_FENCE=routed.device.type == "cuda", num_warps=num_warps,
    )
    return routed_sum, shared_sum


def reduce_in_rank_order(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The kernel's reduction in plain torch: ``fp32(0) + parts[0] + parts[1] + ...`` (each
    part cast to fp32, added left to right), rounded once to the parts' dtype. This fixed
    order is what makes every rank's sum bit-identical."""
    if isinstance(parts, torch.Tensor) or len(parts) == 0:
        raise ValueError("parts must be a non-empty sequence of tensors (one per rank, in rank order)")
    first = parts[0]
    for i, p in enumerate(parts):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"parts[{i}] must be a Tensor, got {type(p).__name__}")
        if p.shape != first.shape or p.dtype != first.dtype:
            raise ValueError(f"parts[{i}] is {p.dtype} {tuple(p.shape)} but parts[0] is "
                             f"{first.dtype} {tuple(first.shape)}")
    acc = torch.zeros(first.shape, dtype=torch.float32, device=first.device)
    for p in parts:
        acc = acc + p.float()
    return acc.to(first.dtype)
