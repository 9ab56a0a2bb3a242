"""Triton kernels: one module per kernel family, each with its launcher.

Launchers take already-validated 2-D row views and preallocated outputs; argument
checking and dispatch live in ``k3fusion.ops``.
"""

from .attn_res import attn_res
from .dual_rms_norm import dual_rms_norm

__all__ = ["attn_res", "dual_rms_norm"]
