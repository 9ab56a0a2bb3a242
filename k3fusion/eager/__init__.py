"""Eager-mode wrappers: the same fused kernels for models that are not compiled.

Under ``torch.compile`` every wrapper computes the plain formulation instead, so the
graph pass sees ordinary ops and owns the fusion there (one source of truth per mode).
One module per fusion, named as its pattern, op and kernel are:

* ``qkv_rmsnorm``: :func:`fused_qkv_rmsnorm`, the MLA q/kv RMSNorm pair as one launch;
* ``attn_res``: :func:`attn_res`, one fused AttnRes step with the spec's in-place effects;
* ``moe_tail``: :class:`MoETailRunner`, the latent-MoE tail through its tiers;
* ``patch``: :func:`patch_model`, which switches a model's modules to them (each fusion
  module's ``PATCHER``, a detector and a patcher, :data:`~k3fusion.eager.patch.PATCHERS`).

How a patched module fuses without touching its ``forward``, and when the fused paths
step aside: docs/design-notes.md, "k3fusion/eager/".
"""

from ._norm_spec import RMSNormSpec, rms_norm_spec
from .attn_res import AttnResSpec, attn_res, attn_res_spec
from .moe_tail import MoETailRunner, moe_tail_runners
from .patch import FUSED_WHEN, PatchReport, patch_model
from .qkv_rmsnorm import FusedQKVRMSNorm, fused_qkv_rmsnorm

__all__ = ["fused_qkv_rmsnorm", "RMSNormSpec", "rms_norm_spec", "FusedQKVRMSNorm",
           "patch_model", "PatchReport", "attn_res", "AttnResSpec", "attn_res_spec",
           "MoETailRunner", "moe_tail_runners"]
