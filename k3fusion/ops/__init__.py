"""The ``torch.ops.k3fusion`` custom ops: what the graph passes insert and eager wrappers call.

Every op has

* a fake (meta) implementation, so it traces under torch.compile with dynamic shapes;
* a CPU and CUDA implementation (one registration for both where the bodies agree): the
  Triton kernel on CUDA; on CPU the kernel in Triton's interpreter when
  ``TRITON_INTERPRET=1`` (how the kernels are tested on CPU), else plain torch
  (``k3fusion.reference``).

Arguments are validated here, before any launch, with errors that name the argument.

One module per op family, named after its fusion: ``qkv_rmsnorm`` (the op ``dual_rms_norm``),
``rms_norm``, ``attn_res`` (``attn_res_`` and ``attn_res``); shared argument checks in
``_args``. Importing this package registers these ops; ``k3fusion::latent_moe_tail`` is
registered by ``k3fusion.moe_tail`` (built on these), and ``import k3fusion`` registers every op.
"""

from ._args import check_rms_norm_args
from .attn_res import attn_res, attn_res_, check_attn_res_args
from .qkv_rmsnorm import dual_rms_norm
from .rms_norm import rms_norm, rms_norm_and_copy

__all__ = ["check_rms_norm_args", "dual_rms_norm", "attn_res_", "attn_res", "check_attn_res_args",
           "latent_moe_tail", "resolve_group", "rms_norm", "rms_norm_and_copy"]


def __getattr__(name):
    # The tail op moved up to k3fusion.moe_tail.op (it builds on these ops); its old names here
    # stay reachable, imported on access since k3fusion.moe_tail imports this package.
    if name in ("latent_moe_tail", "resolve_group"):
        from ..moe_tail import op

        return getattr(op, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
