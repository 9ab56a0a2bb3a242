"""Triton kernels: one module per kernel family, each with its launcher.

Launchers take already-validated 2-D row views and preallocated outputs; argument
checking and dispatch live in ``k3fusion.ops``. The fused latent-MoE tail
(``latent_moe_tail_fused``, reached through ``k3fusion.moe_tail``'s tier registry)
validates its own arguments and returns a new output.
"""

from .attn_res import attn_res
from .qkv_rmsnorm import dual_rms_norm
from .moe_tail import latent_moe_tail_fused
from .rms_norm import rms_norm

__all__ = ["attn_res", "dual_rms_norm", "latent_moe_tail_fused", "rms_norm"]
