"""The latent-MoE tail, tiered: ``all_reduce(shared) + rms_norm(all_reduce(routed)) @ up_w.T``.

The op contract is ``k3fusion.reference.latent_moe_tail`` (``docs/ops.md``): ``routed_latent``
and ``shared`` are per-rank partial sums over the tensor-parallel group, ``up_w`` is
replicated. Every tier (:class:`Tier`) computes that function; they differ in where the
up-projection FLOPs and the collectives go: ``TAIL_FUSION`` (small T: one fused kernel,
where a registered implementation supports the platform and tp), ``ALLREDUCE_OVERLAP``
(shared-expert all-reduce concurrent with the replicated up-projection),
``COLUMN_PARALLEL`` (each rank up-projects its ``H/tp`` columns; one all-reduce) and
``REPLICATED`` (the plain baseline). :func:`select_tier` looks only at T and static facts,
so every rank of a group picks the same tier without communicating.

The tiers, the selection rules and their defaults, tracing, :func:`tier_counts`:
docs/design-notes.md, "k3fusion/moe_tail/tiers.py".
"""

from __future__ import annotations

import enum
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .. import kernels, reference
from ..config import FusionConfig, get_config
from ..moe_tail_args import check_latent_moe_tail_args

__all__ = [
    "Tier", "TierUnavailableError", "TailFusionImpl", "register_tail_fusion",
    "unregister_tail_fusion", "tail_fusion_impls", "tier_unavailable_reason",
    "available_tiers", "select_tier", "latent_moe_tail", "run_latent_moe_tail",
    "tier_counts", "reset_tier_counts", "tp_size_and_rank", "TRITON_SELECT_MAX_TOKENS",
    "as_tier",
]

log = logging.getLogger("k3fusion")


class Tier(str, enum.Enum):
    """Implementations of the latent-MoE tail (values are ``FusionConfig.moe_tail_tier``)."""

    TAIL_FUSION = "tail_fusion"
    ALLREDUCE_OVERLAP = "allreduce_overlap"
    COLUMN_PARALLEL = "column_parallel"
    REPLICATED = "replicated"

    def __str__(self) -> str:
        return self.value


class TierUnavailableError(ValueError):
    """A forced tier cannot run this call (says which tier, the call's facts and why)."""


# ---------------------------------------------------------------------- fused-tail registry


@dataclass(frozen=True)
class TailFusionImpl:
    """One fused-tail implementation (``"triton"``, the Triton kernel, is registered below).

    ``supports(tokens, hidden, tp, device)`` returns None when it can run such a call,
    else why not (it must depend on static facts and T only, like the selection).
    ``run(routed_latent [T, L], shared [T, H], norm_w, eps, up_w, group, weight_in_fp32)``
    (and ``norm_dtype=`` when the normalized latent is cast to another dtype; an
    implementation without that keyword cannot run such a tail)
    returns ``[T, H]`` and must not modify its inputs. ``device_types``: the device types
    (``"cuda"``, ...) it is for, None for any; an implementation is not asked about other
    devices (so a CPU call reports that none is registered for ``'cpu'``).
    ``select_max_tokens``: the largest T at which automatic selection picks it -- its
    measured crossover against the other tiers (None: up to ``fused_tail_max_tokens``);
    it still runs any T its ``supports`` accepts when the tier is forced.
    ``takes_out``: ``run`` also takes ``out=``, a donated ``shared`` to write the result
    into in place (then it returns ``out``).
    """

    name: str
    supports: Callable[[int, int, int, torch.device], Optional[str]]
    run: Callable[..., torch.Tensor]
    device_types: Optional[tuple[str, ...]] = None
    select_max_tokens: Optional[int] = None
    takes_out: bool = False


_TAIL_FUSION_IMPLS: list[TailFusionImpl] = []


def register_tail_fusion(impl: TailFusionImpl) -> None:
    """Make ``impl`` a candidate for ``TAIL_FUSION`` (first registered that supports a call runs)."""
    if not isinstance(impl, TailFusionImpl):
        raise TypeError(f"impl must be a TailFusionImpl, got {type(impl).__name__}")
    types = impl.device_types
    if types is not None and (not isinstance(types, tuple)
                              or not all(isinstance(t, str) for t in types)):
        raise TypeError(f"device_types must be None or a tuple of device type names, got {types!r}")
    most = impl.select_max_tokens
    if most is not None and (isinstance(most, bool) or not isinstance(most, int) or most < 0):
        raise TypeError(f"select_max_tokens must be None or an int >= 0, got {most!r}")
    if any(i.name == impl.name for i in _TAIL_FUSION_IMPLS):
        raise ValueError(f"a tail-fusion implementation named {impl.name!r} is registered already")
    _TAIL_FUSION_IMPLS.append(impl)


def unregister_tail_fusion(name: str) -> None:
    """Remove the implementation registered as ``name`` (KeyError if there is none)."""
    for i, impl in enumerate(_TAIL_FUSION_IMPLS):
        if impl.name == name:
            del _TAIL_FUSION_IMPLS[i]
            return
    raise KeyError(name)


def tail_fusion_impls() -> tuple[TailFusionImpl, ...]:
    return tuple(_TAIL_FUSION_IMPLS)


def _tail_fusion_impl(tokens: int, hidden: int, tp: int, device: torch.device,
                      selecting: bool = False):
    """(the first implementation supporting the call, None) or (None, why none does).
    ``selecting``: automatic selection, which also honours each one's ``select_max_tokens``."""
    candidates = [i for i in _TAIL_FUSION_IMPLS
                  if i.device_types is None or device.type in i.device_types]
    if not candidates:
        others = ", ".join(f"{i.name} ({'/'.join(i.device_types)})" for i in _TAIL_FUSION_IMPLS)
        return None, (f"no fused-tail implementation supports device {device.type!r}, tp={tp}: "
                      f"none is registered for {device.type!r}"
                      + (f" (registered: {others})" if others else ""))
    whys = []
    for impl in candidates:
        why = impl.supports(tokens, hidden, tp, device)
        if why is None and selecting and impl.select_max_tokens is not None \
                and tokens > impl.select_max_tokens:
            why = (f"T={tokens} is above its select_max_tokens={impl.select_max_tokens} "
                   "(where the other tiers were measured faster)")
        if why is None:
            return impl, None
        whys.append(f"{impl.name}: {why}")
    return None, "no fused-tail implementation supports the call (" + "; ".join(whys) + ")"


# ---------------------------------------------------------------------- selection


def _device(device) -> torch.device:
    return device if isinstance(device, torch.device) else torch.device(device)


def _check_facts(tokens, hidden, tp) -> None:
    for name, value, low in (("tokens", tokens, 0), ("hidden", hidden, 1), ("tp", tp, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < low:
            raise ValueError(f"{name} must be >= {low}, got {value}")


def tier_unavailable_reason(tier, tokens: int, hidden: int, tp: int, device) -> str | None:
    """None if ``tier`` can compute a call with these facts, else why it cannot."""
    tier = as_tier(tier)
    _check_facts(tokens, hidden, tp)
    device = _device(device)
    if tier is Tier.TAIL_FUSION:
        return _tail_fusion_impl(tokens, hidden, tp, device)[1]
    if tier is Tier.COLUMN_PARALLEL and hidden % tp:
        return (f"hidden size H={hidden} is not divisible by tp={tp}: the up-projection "
                "columns cannot be split evenly across ranks")
    return None


def available_tiers(tokens: int, hidden: int, tp: int, device) -> tuple[Tier, ...]:
    """The tiers that can compute a call with ``tokens`` rows, ``hidden`` width, ``tp`` ranks."""
    return tuple(t for t in Tier if tier_unavailable_reason(t, tokens, hidden, tp, device) is None)


def as_tier(tier) -> Tier:
    """``tier`` as a :class:`Tier`: a Tier, or its value (any case)."""
    if isinstance(tier, Tier):
        return tier
    try:
        return Tier(str(tier).lower())
    except ValueError:
        raise ValueError(f"unknown latent-MoE tail tier {tier!r}; one of "
                         f"{[t.value for t in Tier]}") from None


def _select(tokens, hidden, tp, device, config: FusionConfig | None, force) -> tuple[Tier, str]:
    """(tier, why): the rules of the module docstring."""
    config = get_config() if config is None else config
    if not isinstance(config, FusionConfig):
        raise TypeError(f"config must be a FusionConfig, got {type(config).__name__}")
    _check_facts(tokens, hidden, tp)
    device = _device(device)
    if force is not None:
        forced, by = as_tier(force), "the tier argument"
    elif config.moe_tail_tier != "auto":
        forced, by = as_tier(config.moe_tail_tier), "FusionConfig.moe_tail_tier (K3FUSION_MOE_TAIL_TIER)"
    else:
        forced = None
    if forced is not None:
        why = tier_unavailable_reason(forced, tokens, hidden, tp, device)
        if why is not None:
            raise TierUnavailableError(
                f"latent_moe_tail tier {forced.value!r} was forced by {by} but is unavailable "
                f"for T={tokens}, H={hidden}, tp={tp}, device {device.type!r}: {why}")
        return forced, f"forced by {by}"
    if not config.moe_tail:
        return Tier.REPLICATED, "moe_tail is off (K3FUSION_MOE_TAIL=0)"
    if 0 < tokens <= config.fused_tail_max_tokens:
        why = _tail_fusion_impl(tokens, hidden, tp, device, selecting=True)[1]
        if why is None:
            return Tier.TAIL_FUSION, f"0 < T <= fused_tail_max_tokens={config.fused_tail_max_tokens}"
        small = f"tail_fusion unavailable ({why}); "
    else:
        small = ""
    threshold = config.shared_experts_stream_token_threshold
    if 0 < tokens <= threshold and not config.disable_shared_experts_stream:
        return Tier.ALLREDUCE_OVERLAP, f"{small}0 < T <= shared_experts_stream_token_threshold={threshold}"
    big = ("shared-experts stream disabled" if config.disable_shared_experts_stream
           else "T = 0" if tokens == 0
           else f"T > shared_experts_stream_token_threshold={threshold}")
    if tp == 1:
        # No all-reduce to save and no columns to split: the plain form costs the same
        # as a one-shard addmm_.
        return Tier.REPLICATED, f"{small}{big}; tp=1"
    why = tier_unavailable_reason(Tier.COLUMN_PARALLEL, tokens, hidden, tp, device)
    if why is None:
        return Tier.COLUMN_PARALLEL, f"{small}{big}"
    return Tier.REPLICATED, f"{small}{big}; column_parallel unavailable ({why})"


def select_tier(tokens: int, hidden: int, tp: int, device, config: FusionConfig | None = None,
                *, force=None) -> Tier:
    """The tier a call with ``tokens`` rows of width ``hidden`` over ``tp`` ranks runs.

    Depends only on these facts and ``config`` (default: :func:`k3fusion.get_config`), so
    all ranks agree. ``force`` (a :class:`Tier` or its value) overrides the config's
    ``moe_tail_tier``; a forced tier that is unavailable raises :class:`TierUnavailableError`.
    """
    return _select(tokens, hidden, tp, device, config, force)[0]


# ---------------------------------------------------------------------- counters


_counts: Counter[str] = Counter()


def tier_counts() -> dict[str, int]:
    """``{tier value: eager calls}`` since :func:`reset_tier_counts` (tiers that ran)."""
    return dict(_counts)


def reset_tier_counts() -> None:
    _counts.clear()


def _record(tier: Tier, why: str, tokens: int, hidden: int, tp: int, config: FusionConfig | None) -> None:
    _counts[tier.value] += 1
    debug = (get_config() if config is None else config).debug
    level = logging.INFO if debug else logging.DEBUG
    if log.isEnabledFor(level):
        log.log(level, "k3fusion moe_tail: T=%d H=%d tp=%d -> %s (%s)", tokens, hidden, tp,
                tier.value, why)


# ---------------------------------------------------------------------- implementations


def tp_size_and_rank(group) -> tuple[int, int]:
    """``(world size, this process's rank)`` in ``group``; ``(1, 0)`` for None (no TP)."""
    if group is None:
        return 1, 0
    import torch.distributed as dist

    return dist.get_world_size(group), dist.get_rank(group)


def _all_reduce_async(t: torch.Tensor, group):
    """Issue the all-reduce; :func:`_wait` gives the result (eager: work runs meanwhile)."""
    import torch.distributed._functional_collectives as funcol

    return funcol.all_reduce(t, "sum", group)


def _wait(t: torch.Tensor) -> torch.Tensor:
    import torch.distributed._functional_collectives as funcol

    # A trace has emitted wait_tensor already (funcol waits when tracing).
    return t.trigger_wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def _reduced_latent(routed, group, donate_routed: bool = False):
    """``all_reduce(routed)``: in place on a donated partial in eager calls (no copy for
    the functional collective to make), else functional."""
    # (A collective takes a contiguous buffer: a donated row view is copied like any other.)
    if (donate_routed and group is not None and routed.is_contiguous()
            and not torch.compiler.is_compiling()):
        import torch.distributed as dist

        dist.all_reduce(routed, group=group)
        return routed
    return reference.all_reduce(routed, group)


def _normed_latent(routed, group, norm_w, eps, weight_in_fp32, norm_dtype,
                   donate_routed: bool = False):
    """The unfused tiers' ``rms_norm(all_reduce(routed))``. On CUDA the norm is
    ``k3fusion::rms_norm``: one Triton launch, where the reference's eager sequence is
    about eight kernels (docs/experiments.md, "kernels/rms_norm.py"); it agrees with the
    reference within the fp32 sum's order.
    Under torch.compile (Inductor fuses the norm itself) and on CPU: the reference's ops,
    bit for bit."""
    x = _reduced_latent(routed, group, donate_routed)
    if x.is_cuda and not torch.compiler.is_compiling():
        return torch.ops.k3fusion.rms_norm(x, norm_w, eps, weight_in_fp32, norm_dtype)
    return reference.rms_norm(x, norm_w, eps, weight_in_fp32, norm_dtype)


def _replicated(routed, shared, norm_w, eps, up_w, group, weight_in_fp32, norm_dtype,
                donate_shared, donate_routed=False):
    # The reference's op sequence (on CPU bit for bit), the norm as above; tp = 1 on CUDA
    # adds in cuBLAS's epilogue instead (_norm_then_beta_add).
    if group is None and routed.is_cuda and not torch.compiler.is_compiling():
        return _norm_then_beta_add(routed, shared, norm_w, eps, up_w, weight_in_fp32,
                                   norm_dtype, donate_shared)
    h = _normed_latent(routed, group, norm_w, eps, weight_in_fp32, norm_dtype, donate_routed)
    return reference.all_reduce(shared, group) + h @ up_w.T


def _norm_then_beta_add(routed, shared, norm_w, eps, up_w, weight_in_fp32, norm_dtype,
                        donate_shared):
    """tp = 1: two launches instead of three (norm, GEMM, add). The norm's launch also
    copies ``shared`` (``k3fusion::rms_norm_and_copy``) and cuBLAS beta-adds the GEMM into
    that copy in place; a donated ``shared`` is the GEMM's output itself (no copy at all).
    ``torch.addmm(shared, h, w.T)`` would copy ``shared`` in a launch of its own. The add
    rounds once (fp32 product + shared), not twice: the column-parallel tier's numerics
    (docs/experiments.md, "Latent-MoE tail vs cuBLAS (issue 17), 2026-12-02", phase 2)."""
    if donate_shared:
        h = torch.ops.k3fusion.rms_norm(routed, norm_w, eps, weight_in_fp32, norm_dtype)
        out = shared
    else:
        h, out = torch.ops.k3fusion.rms_norm_and_copy(routed, norm_w, eps, shared,
                                                      weight_in_fp32, norm_dtype)
    return out.addmm_(h, up_w.t())


# Per CUDA device: (side stream, event "shared ready", event "shared reduced").
_side_streams: dict[int, tuple] = {}


def _side_stream(device: torch.device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _side_streams:
        _side_streams[index] = (torch.cuda.Stream(device=index), torch.cuda.Event(),
                                torch.cuda.Event())
    return _side_streams[index]


def _overlap(routed, shared, norm_w, eps, up_w, group, weight_in_fp32, norm_dtype,
             donate_shared, donate_routed=False):
    if group is None:  # tp=1: no all-reduce to hide; the replicated form is the whole tail
        return _replicated(routed, shared, norm_w, eps, up_w, group, weight_in_fp32, norm_dtype,
                           donate_shared)
    if shared.is_cuda and not torch.compiler.is_compiling():
        main = torch.cuda.current_stream(shared.device)
        side, ready, done = _side_stream(shared.device)
        ready.record(main)             # the shared partial is complete on the main stream
        side.wait_event(ready)
        with torch.cuda.stream(side):
            shared_sum = _wait(_all_reduce_async(shared, group))
            done.record(side)
        h = _normed_latent(routed, group, norm_w, eps, weight_in_fp32, norm_dtype,
                           donate_routed)
        up = h @ up_w.T                # overlaps the shared all-reduce
        main.wait_event(done)
        shared_sum.record_stream(main)  # allocated on the side stream, released on main
        return shared_sum + up
    # CPU / traced: issue the shared all-reduce first and wait for it only after the GEMM
    # (gloo runs it on its worker threads meanwhile; a trace leaves placement to Inductor).
    pending = _all_reduce_async(shared, group)
    h = _normed_latent(routed, group, norm_w, eps, weight_in_fp32, norm_dtype, donate_routed)
    up = h @ up_w.T
    return _wait(pending) + up


def _column_parallel(routed, shared, norm_w, eps, up_w, group, weight_in_fp32, norm_dtype,
                     donate_shared, donate_routed=False):
    tp, rank = tp_size_and_rank(group)
    hidden = shared.shape[-1]
    shard = hidden // tp
    start = rank * shard
    up_shard = up_w.narrow(0, start, shard)
    # The buffer the all-reduce runs on must be contiguous: a donated row view is not used.
    donate_shared = donate_shared and shared.is_contiguous()
    if _fused_shard(routed, up_w, tp):
        # The tail kernel on this rank's columns, in place on the donated partial or into
        # a new buffer the same launch copies the partial's other columns into.
        x = _reduced_latent(routed, group, donate_routed)
        out = kernels.moe_tail.latent_moe_tail_fused(
            x, shared, norm_w, eps, up_shard, out=shared if donate_shared else None,
            column_offset=start, weight_in_fp32=weight_in_fp32, norm_dtype=norm_dtype)
        return _all_reduce_owned(out, group)
    # The caller's partial is written only when donated; otherwise a private copy is.
    out = shared if donate_shared else shared.clone(memory_format=torch.contiguous_format)
    cols = out.narrow(-1, start, shard)
    h = _normed_latent(routed, group, norm_w, eps, weight_in_fp32, norm_dtype, donate_routed)
    # Beta-add epilogue: out[:, cols] = out[:, cols] + h @ up_w[cols].T.
    cols.addmm_(h, up_shard.t())
    # One all-reduce sums the ranks' partials and stitches the column shards.
    return _all_reduce_owned(out, group)


#: Up to this many tokens the column-parallel tier runs its shard through the tail kernel
#: (docs/experiments.md, "2026-12-04: the column-parallel shard's launch shapes").
COLUMN_FUSED_MAX_TOKENS = 32


#: The shard kernel on CPU through Triton's interpreter (tests only: the interpreter
#: truncates its bf16 casts, so a model run on it drifts further than on a GPU).
SHARD_KERNEL_ON_CPU = False


def _fused_shard(routed, up_w, tp: int) -> bool:
    """Whether the column-parallel tier runs its shard with the fused kernel: eager calls
    (a trace keeps the reference's ops) of 1..COLUMN_FUSED_MAX_TOKENS tokens at tp > 1 on
    an NVIDIA GPU, with 16-bit weights."""
    tokens = routed.shape[0]
    if routed.is_cuda:
        here = torch.version.hip is None
    else:
        here = (SHARD_KERNEL_ON_CPU and routed.device.type == "cpu"
                and kernels.moe_tail.kernels_are_interpreted())
    return (here and tp > 1 and 0 < tokens <= COLUMN_FUSED_MAX_TOKENS
            and up_w.dtype in (torch.bfloat16, torch.float16)
            and not torch.compiler.is_compiling() and get_config().moe_tail)


def _all_reduce_owned(out: torch.Tensor, group) -> torch.Tensor:
    """The all-reduce of a buffer this tier owns: in place in eager calls (no copy for the
    functional collective to make), functional in a trace."""
    if group is None or torch.compiler.is_compiling():
        return reference.all_reduce(out, group)
    import torch.distributed as dist

    dist.all_reduce(out, group=group)
    return out


def _tail_fusion(routed, shared, norm_w, eps, up_w, group, weight_in_fp32, norm_dtype,
                 donate_shared, donate_routed=False):
    tp, _ = tp_size_and_rank(group)
    facts = (routed.shape[0], shared.shape[-1], tp, shared.device)
    # The implementation automatic selection chose (its select_max_tokens admits T); a
    # forced tier above every such limit runs the first that supports T at all.
    impl, why = _tail_fusion_impl(*facts, selecting=True)
    if impl is None:
        impl, why = _tail_fusion_impl(*facts)
    if impl is None:  # selection checked this; a registry change in between lands here
        raise TierUnavailableError(f"tail_fusion: {why}")
    kw = {} if norm_dtype is None else {"norm_dtype": norm_dtype}
    if donate_shared and impl.takes_out:
        kw["out"] = shared
    return impl.run(routed, shared, norm_w, eps, up_w, group, weight_in_fp32, **kw)


_IMPLS = {
    Tier.TAIL_FUSION: _tail_fusion,
    Tier.ALLREDUCE_OVERLAP: _overlap,
    Tier.COLUMN_PARALLEL: _column_parallel,
    Tier.REPLICATED: _replicated,
}


# ---------------------------------------------------------------------- entry points


def run_latent_moe_tail(
    routed_latent: torch.Tensor,
    shared: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
    up_w: torch.Tensor,
    group=None,
    *,
    weight_in_fp32: bool = False,
    norm_dtype: torch.dtype | None = None,
    tier=None,
    config: FusionConfig | None = None,
    donate_shared: bool = False,
    donate_routed: bool = False,
) -> tuple[torch.Tensor, Tier]:
    """:func:`latent_moe_tail`, also returning the tier that ran."""
    check_latent_moe_tail_args(routed_latent, shared, norm_w, eps, up_w, norm_dtype,
                               weight_in_fp32)
    latent, hidden = routed_latent.shape[-1], shared.shape[-1]
    lead = tuple(shared.shape[:-1])
    routed2 = routed_latent.reshape(-1, latent)
    shared2 = shared.reshape(-1, hidden)
    tokens = routed2.shape[0]
    tp, _ = tp_size_and_rank(group)
    if torch.compiler.is_compiling() and tier is None and (
            config or get_config()).moe_tail_tier == "auto":
        # The plain form: the graph pass owns the tail in compiled graphs (dynamic T).
        chosen = Tier.REPLICATED
    else:
        chosen, why = _select(tokens, hidden, tp, shared.device, config, tier)
        if not torch.compiler.is_compiling():
            _record(chosen, why, tokens, hidden, tp, config)
    y = _IMPLS[chosen](routed2, shared2, norm_w, eps, up_w, group, weight_in_fp32, norm_dtype,
                       donate_shared, donate_routed)
    return y.reshape(*lead, hidden), chosen


def latent_moe_tail(
    routed_latent: torch.Tensor,
    shared: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
    up_w: torch.Tensor,
    group=None,
    *,
    weight_in_fp32: bool = False,
    norm_dtype: torch.dtype | None = None,
    tier=None,
    config: FusionConfig | None = None,
    donate_shared: bool = False,
    donate_routed: bool = False,
) -> torch.Tensor:
    """``all_reduce(shared) + rms_norm(all_reduce(routed_latent), norm_w, eps) @ up_w.T``
    through the tier :func:`select_tier` picks for this call's token count.

    ``routed_latent [..., L]`` and ``shared [..., H]``: this rank's partial sums over
    ``group`` (a ``torch.distributed`` process group; None = tp 1, no collective);
    ``up_w [H, L]`` replicated. ``tier`` forces a tier (else ``config.moe_tail_tier``);
    ``config`` defaults to :func:`k3fusion.get_config`. ``norm_dtype``: the cast of the
    normalized latent (cast-then-weight) when it is not the latent's own dtype
    (``k3fusion.reference.rms_norm``).

    Inputs are never modified unless donated (pass a flag when that tensor is a temporary
    the caller no longer needs): with ``donate_shared=True`` the column-parallel tier, and
    at tp = 1 on CUDA the replicated and overlap tiers and the fused-tail implementations
    that take ``out=``, may write into ``shared`` in place instead of into a copy; with ``donate_routed=True`` the tiers may all-reduce
    ``routed_latent`` in place (tp > 1, eager calls). Every rank of ``group`` must make the
    call with the same T and config. Returns ``[..., H]``, equal on all ranks.

    Under torch.compile the config must already be loaded (any eager call, or
    :func:`k3fusion.get_config`, before compiling; :class:`k3fusion.eager.MoETailRunner`
    does it when built): reading the environment does not trace.
    """
    return run_latent_moe_tail(routed_latent, shared, norm_w, eps, up_w, group,
                               weight_in_fp32=weight_in_fp32, norm_dtype=norm_dtype,
                               tier=tier, config=config,
                               donate_shared=donate_shared, donate_routed=donate_routed)[0]


# ---------------------------------------------------------------------- the Triton kernel


def _triton_supports(tokens: int, hidden: int, tp: int, device: torch.device) -> Optional[str]:
    if device.type != "cuda":
        return f"runs on CUDA, not on device {device.type!r}"
    if torch.version.hip is not None:
        return "ROCm: the kernel's split-K fence is PTX (NVIDIA GPUs only)"
    if tp != 1:
        return (f"tp={tp}: the kernel computes one rank's whole tail (tp=1 only; with tp > 1 "
                "the all-reduces between norm and GEMM cannot be fused into it)")
    if not 0 < tokens <= kernels.moe_tail.MAX_TOKENS:
        return f"T={tokens} is outside the kernel's range 1..{kernels.moe_tail.MAX_TOKENS}"
    return None


def _triton_run(routed, shared, norm_w, eps, up_w, group, weight_in_fp32, norm_dtype=None,
                out=None):
    # tp == 1 (supports() said so): a one-rank group's all-reduces are identities. The
    # launcher is looked up per call: the tests spy on the module's attribute.
    return kernels.moe_tail.latent_moe_tail_fused(routed, shared, norm_w, eps, up_w,
                                                  weight_in_fp32=weight_in_fp32,
                                                  norm_dtype=norm_dtype, out=out)


#: Largest T at which selection picks the tp = 1 kernel over the two-launch unfused form
#: (docs/experiments.md, "2026-12-02: the tail as a norm launch + a GEMM (issue 17)").
TRITON_SELECT_MAX_TOKENS = 32

register_tail_fusion(TailFusionImpl("triton", _triton_supports, _triton_run, ("cuda",),
                                    select_max_tokens=TRITON_SELECT_MAX_TOKENS,
                                    takes_out=True))
