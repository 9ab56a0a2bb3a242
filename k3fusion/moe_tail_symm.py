"""``k3fusion.moe_tail_symm``: the documented path of the symmetric-memory tail (README's
``enable_symm_mem_tail()``), kept for compatibility; it re-exports the public names of
``k3fusion.moe_tail.symm_mem``, where the implementation lives."""

from .moe_tail.symm_mem import (IMPL_NAME, MAX_TOKENS, SymmMemUnavailableError, SymmMemWorkspace,
                                check_symm_mem_tail_args, disable_symm_mem_tail,
                                enable_symm_mem_tail, group_unavailable_reason,
                                one_shot_all_reduce, prepare_symm_mem_tail, supports,
                                symm_mem_latent_moe_tail, symm_mem_tail_enabled,
                                unavailable_reason)

__all__ = [
    "IMPL_NAME", "MAX_TOKENS", "SymmMemUnavailableError", "SymmMemWorkspace",
    "enable_symm_mem_tail", "disable_symm_mem_tail", "symm_mem_tail_enabled", "supports",
    "unavailable_reason", "group_unavailable_reason", "prepare_symm_mem_tail",
    "check_symm_mem_tail_args", "one_shot_all_reduce", "symm_mem_latent_moe_tail",
]
