"""The small-T latent-MoE tail across GPUs (``TAIL_FUSION`` for tp > 1) over symmetric memory.

    y = all_reduce(shared) + rms_norm(all_reduce(routed_latent), norm_w, eps) @ up_w.T

At decode sizes the partials are small enough that a one-shot all-reduce (every rank reads
every peer's buffer over NVLink) beats NCCL's per-call latency (docs/benchmarks.md,
"Latent-MoE tail tiers across GPUs"). One Triton launch (``kernels/moe_tail_symm.py``)
sums both partials over ``torch.distributed._symmetric_memory``, in fp32 and rank order
(bit-identical on every rank); the single-GPU fused tail kernel (``kernels/moe_tail.py``)
then finishes the tail. Two launches, no host synchronization, CUDA-graph safe.

Opt-in (:func:`enable_symm_mem_tail`); its selection, workspace and ordering rules:
docs/design-notes.md, "k3fusion/moe_tail/symm_mem.py".
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from .. import reference
from ..kernels import moe_tail as fused_tail
from ..kernels.moe_tail_symm import PeerBuffers, one_shot_all_reduce_pair, packed_layout
from ..moe_tail_args import check_latent_moe_tail_args
from ..reference import FLOAT_DTYPES
from .tiers import (TailFusionImpl, register_tail_fusion, tail_fusion_impls, tp_size_and_rank,
                    unregister_tail_fusion)

__all__ = [
    "IMPL_NAME", "MAX_TOKENS", "SymmMemUnavailableError", "SymmMemWorkspace",
    "enable_symm_mem_tail", "disable_symm_mem_tail", "symm_mem_tail_enabled", "supports",
    "unavailable_reason", "group_unavailable_reason", "prepare_symm_mem_tail",
    "check_symm_mem_tail_args", "one_shot_all_reduce", "symm_mem_latent_moe_tail",
]

log = logging.getLogger("k3fusion")

#: The name this implementation registers under.
IMPL_NAME = "symm_mem"

#: Largest T: the workspace holds this many rows (the single-GPU kernel's limit too).
#: Selection additionally stops at ``FusionConfig.fused_tail_max_tokens`` (64).
MAX_TOKENS = 64

#: Largest T at which selection picks it: it beat the fastest NCCL tier at every T up to
#: its buffer's 64 rows (docs/benchmarks.md, "Latent-MoE tail tiers across GPUs (`torchrun -m k3fusion.bench.moe_tail_tp`)").
SELECT_MAX_TOKENS = 64

#: Signal-pad size assumed when torch does not report it (its smallest default).
_DEFAULT_PAD_BYTES = 2048


class SymmMemUnavailableError(RuntimeError):
    """The group or this process cannot use symmetric memory (the message says why)."""


# ---------------------------------------------------------------------- availability


def _process_unavailable_reason() -> Optional[str]:
    """Why this process cannot use symmetric memory at all (None: it can, as far as can be
    told without a group)."""
    import torch.distributed as dist

    if not dist.is_available():
        return "torch.distributed is not available in this torch build"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
        from torch._C._distributed_c10d import _SymmetricMemory
    except ImportError as e:
        return f"this torch build has no symmetric memory ({e})"
    if not hasattr(_SymmetricMemory, "rendezvous"):
        return "this torch build's symmetric memory has no rendezvous"
    if not torch.cuda.is_available():
        return "CUDA is not available in this process"
    return None


def _static_reason(tokens: int, tp: int, device: torch.device) -> Optional[str]:
    if device.type != "cuda":
        return f"runs on CUDA devices, not on {device.type!r}"
    if tp < 2:
        return (f"tp={tp}: there is no all-reduce to fuse (the single-GPU 'triton' kernel "
                "covers tp=1)")
    if not 0 < tokens <= MAX_TOKENS:
        return (f"T={tokens} is outside 1..{MAX_TOKENS} (the symmetric buffers hold "
                f"{MAX_TOKENS} rows)")
    return None


def supports(tokens: int, hidden: int, tp: int, device) -> Optional[str]:
    """The registered ``TailFusionImpl.supports``: None when a call with these facts can run
    here, else why not. The group itself is checked when the call runs (module docstring)."""
    device = device if isinstance(device, torch.device) else torch.device(device)
    return _static_reason(tokens, tp, device) or _process_unavailable_reason()


# Groups whose workspace could not be set up, by (group name, device index): the reason.
_failures: dict[tuple[str, int], str] = {}


def group_unavailable_reason(group) -> Optional[str]:
    """Why ``group`` cannot run the symmetric-memory tail, or None. No collective runs: it
    checks the group's backend and this process, and reports a failed earlier rendezvous.

    Only NCCL groups are accepted: their ranks drive CUDA devices, which is what
    symmetric memory maps (a gloo group's ranks are CPU processes as far as it knows).
    """
    if group is None:
        return "no process group (tp=1): there is nothing to all-reduce"
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return "torch.distributed is not initialized"
    backend = str(dist.get_backend(group)).lower()
    if "nccl" not in backend:
        return (f"the group's backend is {backend!r}: the symmetric-memory tail needs a group "
                "whose ranks drive CUDA devices (NCCL)")
    why = _process_unavailable_reason()
    if why is not None:
        return why
    for (name, _), failure in _failures.items():
        if name == group.group_name:
            return failure
    return None


def unavailable_reason(tokens: int, hidden: int, group, device) -> Optional[str]:
    """:func:`supports` with the group: None when ``symm_mem`` can run the call."""
    device = device if isinstance(device, torch.device) else torch.device(device)
    tp, _ = tp_size_and_rank(group)
    return _static_reason(tokens, tp, device) or group_unavailable_reason(group)


# ---------------------------------------------------------------------- workspace


@dataclass(frozen=True)
class SymmMemWorkspace:
    """One (group, device)'s symmetric buffer, its handle, and what the kernel needs to
    reach every rank's buffer and signal pad (``peers``)."""

    group_name: str
    device: torch.device
    buffer: torch.Tensor
    handle: object
    peers: PeerBuffers


_workspaces: dict[tuple[str, int], SymmMemWorkspace] = {}
# Replaced workspaces, never freed: a captured CUDA graph may still address them.
_retired: list[SymmMemWorkspace] = []


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _rendezvous(buffer: torch.Tensor, group):
    import torch.distributed._symmetric_memory as symm_mem

    name = group.group_name
    try:
        return symm_mem.rendezvous(buffer, name)
    except RuntimeError as e:
        if "group info" not in str(e):
            raise
    # Older torch releases need the group registered first (it is a no-op to ask for
    # on newer ones, which deprecate the call); the lookup that failed is local, so
    # every rank takes this path together.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        symm_mem.enable_symm_mem_for_group(name)
    return symm_mem.rendezvous(buffer, name)


def _signal_pad_bytes(handle) -> int:
    size = getattr(handle, "signal_pad_size", None)
    if not size:
        import torch.distributed._symmetric_memory as symm_mem

        get = getattr(symm_mem, "get_signal_pad_size", None)
        size = get() if get is not None else _DEFAULT_PAD_BYTES
    return int(size)


def _create(group, device: torch.device, nbytes: int) -> SymmMemWorkspace:
    """Allocate and rendezvous a buffer of at least ``nbytes`` (collective, not capturing)."""
    import torch.distributed._symmetric_memory as symm_mem

    world, rank = tp_size_and_rank(group)
    with torch.cuda.device(device):
        buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        handle = _rendezvous(buffer, group)
        if (handle.world_size, handle.rank) != (world, rank):
            raise SymmMemUnavailableError(
                f"symmetric-memory handle reports rank {handle.rank} of {handle.world_size}, "
                f"the group rank {rank} of {world}")
        # Peers' buffers hold this tensor at the same offset from their allocation's start
        # as ours (the handle's bases are allocation starts on newer torch, the tensor
        # itself on older), so one locally measured offset serves every rank.
        bases = [int(p) for p in handle.buffer_ptrs]
        offset = buffer.data_ptr() - bases[rank]
        size = int(getattr(handle, "buffer_size", offset + nbytes))
        if offset < 0 or offset + nbytes > size:
            raise SymmMemUnavailableError(
                f"unexpected symmetric-memory layout: the buffer starts {offset} bytes from "
                f"this rank's allocation of {size} bytes")
        peers = PeerBuffers(
            rank=rank, world=world,
            buffer_ptrs=torch.tensor([b + offset for b in bases], dtype=torch.int64,
                                     device=device),
            pad_ptrs=torch.tensor([int(p) for p in handle.signal_pad_ptrs], dtype=torch.int64,
                                  device=device),
            buffer_bytes=nbytes, pad_bytes=_signal_pad_bytes(handle), keepalive=handle)
        # Every rank's signal pad is zero (the kernel's protocol starts there) before any
        # rank can launch: a device-side barrier, ordered after the allocation's zeroing
        # on every rank, leaving the pads as it found them.
        handle.barrier(channel=0)
        torch.cuda.synchronize(device)
    log.debug("k3fusion moe_tail symm_mem: %d-byte workspace for group %s on %s (rank %d of %d, "
              "%d-byte signal pads)", nbytes, group.group_name, device, rank, world,
              peers.pad_bytes)
    return SymmMemWorkspace(group.group_name, device, buffer, handle, peers)


def _workspace(group, device: torch.device, tokens: int, latent: int, hidden: int,
               routed_dtype: torch.dtype, shared_dtype: torch.dtype) -> SymmMemWorkspace:
    """The (group, device) workspace, large enough for this call: created now (sized for
    MAX_TOKENS rows, so calls with any T share it) or grown, collectively, if needed."""

    need = packed_layout(tokens, latent, hidden, routed_dtype, shared_dtype)[1]
    key = (group.group_name, _device_index(device))
    ws = _workspaces.get(key)
    if ws is not None and ws.peers.buffer_bytes >= need:
        return ws
    if torch.cuda.is_current_stream_capturing():
        have = "does not exist yet" if ws is None else \
            f"has {ws.peers.buffer_bytes} bytes where {need} are needed"
        raise RuntimeError(
            f"the symmetric-memory workspace of group {group.group_name!r} on {device} {have}, "
            "and it cannot be allocated during CUDA-graph capture (allocation and rendezvous "
            "are collective host operations): call k3fusion.moe_tail."
            "prepare_symm_mem_tail(group, latent, hidden, dtype) on every rank before "
            "capturing, or run the tail once eagerly first")
    why = group_unavailable_reason(group)
    if why is not None:
        raise SymmMemUnavailableError(f"symm_mem tail: {why}")
    size = packed_layout(MAX_TOKENS, latent, hidden, routed_dtype, shared_dtype)[1]
    try:
        new = _create(group, device, max(size, ws.peers.buffer_bytes if ws else 0))
    except Exception as e:
        _failures[key] = f"symmetric-memory setup failed ({type(e).__name__}: {e})"
        raise SymmMemUnavailableError(f"symm_mem tail: {_failures[key]}") from e
    if ws is not None:
        _retired.append(ws)
    _workspaces[key] = new
    return new


def prepare_symm_mem_tail(group, latent: int, hidden: int, dtype: torch.dtype, *,
                          shared_dtype: Optional[torch.dtype] = None,
                          device=None) -> SymmMemWorkspace:
    """Set up ``group``'s workspace on ``device`` (default: the current CUDA device) for
    calls of up to :data:`MAX_TOKENS` rows with an ``[T, latent]`` routed partial of
    ``dtype`` and an ``[T, hidden]`` shared partial of ``shared_dtype`` (default
    ``dtype``). Collective: every rank of ``group`` must call it, outside any CUDA-graph
    capture. Raises :class:`SymmMemUnavailableError` with the reason where symmetric
    memory cannot be used."""
    for name, v in (("latent", latent), ("hidden", hidden)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    shared_dtype = dtype if shared_dtype is None else shared_dtype
    for name, dt in (("dtype", dtype), ("shared_dtype", shared_dtype)):
        if dt not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be float32, bfloat16 or float16, got {dt}")
    why = group_unavailable_reason(group)
    if why is not None:
        raise SymmMemUnavailableError(f"symm_mem tail: {why}")
    device = torch.device("cuda", torch.cuda.current_device()) if device is None \
        else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {device}")
    return _workspace(group, device, MAX_TOKENS, latent, hidden, dtype, shared_dtype)


# ---------------------------------------------------------------------- the tail


def check_symm_mem_tail_args(routed_latent, shared, norm_w, eps, up_w, group,
                             weight_in_fp32: bool = False) -> None:
    """Validate a call; TypeError/ValueError naming the argument. On top of
    :func:`k3fusion.moe_tail.check_latent_moe_tail_args` (its ``direct`` form: 2-D
    ``[T, L]`` / ``[T, H]`` partials): ``T <= MAX_TOKENS``, a process group (any size:
    tp = 1 runs too, for smoke tests, though selection never routes it here) and CUDA
    tensors."""
    check_latent_moe_tail_args(routed_latent, shared, norm_w, eps, up_w,
                               weight_in_fp32=weight_in_fp32, direct=True)
    if routed_latent.shape[0] > MAX_TOKENS:
        raise ValueError(f"routed_latent has T={routed_latent.shape[0]} rows; the "
                         f"symmetric-memory tail takes at most {MAX_TOKENS}")
    _check_group(group)
    if routed_latent.device.type != "cuda":
        raise ValueError(f"routed_latent is on {routed_latent.device}: the symmetric-memory "
                         "tail runs on CUDA tensors")


def _check_group(group) -> None:
    if group is None:
        raise ValueError("group must be the tensor-parallel process group, got None")
    if not hasattr(group, "group_name"):
        raise TypeError(f"group must be a torch.distributed ProcessGroup, got "
                        f"{type(group).__name__}")


def one_shot_all_reduce(routed_latent: torch.Tensor, shared: torch.Tensor,
                        group) -> tuple[torch.Tensor, torch.Tensor]:
    """``(all_reduce(routed_latent), all_reduce(shared))`` over ``group`` in one symmetric-
    memory launch: bit-identical on every rank (fp32 sums in rank order, rounded once).
    ``[T, L]`` and ``[T, H]`` CUDA partials, ``T <= MAX_TOKENS``; every rank calls it."""
    for name, t in (("routed_latent", routed_latent), ("shared", shared)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if routed_latent.shape[0] > MAX_TOKENS:
        raise ValueError(f"routed_latent has T={routed_latent.shape[0]} rows; at most "
                         f"{MAX_TOKENS}")
    _check_group(group)
    for name, t in (("routed_latent", routed_latent), ("shared", shared)):
        if t.device.type != "cuda":
            raise ValueError(f"{name} is on {t.device}: the one-shot all-reduce runs on CUDA")
    return _reduce_pair(routed_latent, shared, group)


def _reduce_pair(routed, shared, group):

    tokens, latent = routed.shape
    ws = _workspace(group, routed.device, tokens, latent, shared.shape[1], routed.dtype,
                    shared.dtype)
    return one_shot_all_reduce_pair(routed, shared, ws.peers)


def _tail_after_reduce(routed_sum, shared_sum, norm_w, eps, up_w, weight_in_fp32,
                       use_kernel: Optional[bool] = None) -> torch.Tensor:
    """``shared_sum + rms_norm(routed_sum) @ up_w.T``: the single-GPU fused kernel where it
    exists (``use_kernel=None``), else (or with ``use_kernel=False``) the reference math."""
    if use_kernel is not False and routed_sum.shape[0] <= fused_tail.MAX_TOKENS:
        return fused_tail.latent_moe_tail_fused(routed_sum, shared_sum, norm_w, eps, up_w,
                                                weight_in_fp32=weight_in_fp32)
    h = reference.rms_norm(routed_sum, norm_w, eps, weight_in_fp32)
    return shared_sum + h @ up_w.T


def symm_mem_latent_moe_tail(routed_latent: torch.Tensor, shared: torch.Tensor,
                             norm_w: torch.Tensor, eps: float, up_w: torch.Tensor, group, *,
                             weight_in_fp32: bool = False) -> torch.Tensor:
    """``all_reduce(shared) + rms_norm(all_reduce(routed_latent), norm_w, eps) @ up_w.T``
    with the all-reduces done by the symmetric-memory one-shot kernel (module docstring).
    Arguments as :func:`check_symm_mem_tail_args`; inputs are not modified; returns a new
    ``[T, H]`` tensor, bit-identical on every rank. Every rank of ``group`` calls it."""
    check_symm_mem_tail_args(routed_latent, shared, norm_w, eps, up_w, group, weight_in_fp32)
    routed_sum, shared_sum = _reduce_pair(routed_latent, shared, group)
    return _tail_after_reduce(routed_sum, shared_sum, norm_w, eps, up_w, weight_in_fp32)


def _run(routed, shared, norm_w, eps, up_w, group, weight_in_fp32, norm_dtype=None):
    # The registry's run(): TailFusionImpl calls with 2-D [T, L] / [T, H] partials.
    if norm_dtype is not None:
        raise NotImplementedError(
            "the symm_mem tail does not take a norm cast to another dtype (norm_dtype="
            f"{norm_dtype}); disable it (disable_symm_mem_tail()) for such models")
    return symm_mem_latent_moe_tail(routed, shared, norm_w, eps, up_w, group,
                                    weight_in_fp32=weight_in_fp32)


# ---------------------------------------------------------------------- opt-in switch


def symm_mem_tail_enabled() -> bool:
    return any(i.name == IMPL_NAME for i in tail_fusion_impls())


def enable_symm_mem_tail() -> bool:
    """Offer ``"symm_mem"`` to ``TAIL_FUSION`` selection (after any implementation already
    registered). Idempotent; returns whether it was newly registered. Every rank of a
    group must make the same choice, or ranks would select different tiers."""
    if symm_mem_tail_enabled():
        return False
    register_tail_fusion(TailFusionImpl(IMPL_NAME, supports, _run, ("cuda",),
                                        select_max_tokens=SELECT_MAX_TOKENS))
    return True


def disable_symm_mem_tail() -> bool:
    """Withdraw ``"symm_mem"`` (workspaces stay allocated). Idempotent; returns whether it
    was registered."""
    if not symm_mem_tail_enabled():
        return False
    unregister_tail_fusion(IMPL_NAME)
    return True
