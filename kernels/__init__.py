"""Triton kernels: one module per kernel family, each with its launcher.

Launchers take already-validated 2-D row views and preallocated outputs; argument
checking and dispatch live in ``k3fusion.ops``. The fused latent-MoE tail
(``latent_moe_tail_fused``, reached through ``k3fusion.moe_tail``'s tier registry)
validates its own arguments and returns a new output.

The package holds the modules, not their launchers (``kernels.attn_res`` is the module;
its launcher is ``kernels.attn_res.attn_res``): no attribute shadows a module.
"""

from . import attn_res, attn_res_backward, moe_tail, qkv_rmsnorm, rms_norm

__all__ = ["attn_res", "attn_res_backward", "moe_tail", "qkv_rmsnorm", "rms_norm"]
