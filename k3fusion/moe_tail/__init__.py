"""The latent-MoE tail: ``all_reduce(shared) + rms_norm(all_reduce(routed)) @ up_w.T``, tiered.

One package per layer of the tail above the kernels:

* ``tiers``: the :class:`Tier` implementations, their selection from T and static facts,
  the registry of fused-tail implementations (the tp = 1 Triton kernel is registered
  there) and the entry points :func:`latent_moe_tail` / :func:`run_latent_moe_tail`;
* ``op``: ``torch.ops.k3fusion.latent_moe_tail``, what the graph pass inserts;
* ``symm_mem``: the opt-in fused tail for tp > 1 over symmetric memory.

The argument rules are ``k3fusion.moe_tail_args`` (shared with the kernel launcher); the
kernels are ``kernels/moe_tail.py`` and ``kernels/moe_tail_symm.py``. Importing this package
registers the op and the tp = 1 kernel, not the symmetric-memory tail.
"""

from ..moe_tail_args import check_latent_moe_tail_args
from . import op  # noqa: F401  registers torch.ops.k3fusion.latent_moe_tail
from .symm_mem import (SymmMemUnavailableError, check_symm_mem_tail_args, disable_symm_mem_tail,
                       enable_symm_mem_tail, one_shot_all_reduce, prepare_symm_mem_tail,
                       symm_mem_latent_moe_tail, symm_mem_tail_enabled)
from .tiers import (TRITON_SELECT_MAX_TOKENS, TailFusionImpl, Tier, TierUnavailableError,
                    as_tier, available_tiers, latent_moe_tail, register_tail_fusion,
                    reset_tier_counts, run_latent_moe_tail, select_tier, tail_fusion_impls,
                    tier_counts, tier_unavailable_reason, tp_size_and_rank,
                    unregister_tail_fusion)

__all__ = [
    "Tier", "TierUnavailableError", "TailFusionImpl", "register_tail_fusion",
    "unregister_tail_fusion", "tail_fusion_impls", "tier_unavailable_reason",
    "available_tiers", "select_tier", "latent_moe_tail", "run_latent_moe_tail",
    "check_latent_moe_tail_args", "tier_counts", "reset_tier_counts", "tp_size_and_rank",
    "TRITON_SELECT_MAX_TOKENS",
    "SymmMemUnavailableError", "enable_symm_mem_tail", "disable_symm_mem_tail",
    "symm_mem_tail_enabled", "prepare_symm_mem_tail", "check_symm_mem_tail_args",
    "one_shot_all_reduce", "symm_mem_latent_moe_tail",
]
