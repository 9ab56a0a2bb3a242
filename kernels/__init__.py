"""Triton kernels: one module per kernel family, each with its launcher.

Launchers take already-validated 2-D row views and preallocated outputs; argument
checking and dispatch live in ``k3fusion.ops``.
"""

from .dual_rms_norm import dual_rms_norm

__all__ = ["dual_rms_norm"]
