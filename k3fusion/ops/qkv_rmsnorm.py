"""``k3fusion::dual_rms_norm``: two RMSNorms in one launch (the MLA q/kv norm pair)."""

from __future__ import annotations

from typing import Optional

import torch

from .. import kernels, reference
from ..config import dual_norm_rows_for_widths, get_config
from ._args import (check_eps_tensor, eps_value, new_norm_output, as_rows, runs_kernel,
                    check_rms_norm_args)
from ._backward import differentiate_by_reference

__all__ = ["dual_rms_norm"]


def _check_dual(x1, w1, eps1, x2, w2, eps2, eps1_tensor=None, eps2_tensor=None) -> None:
    check_rms_norm_args(x1, w1, eps1, x_name="x1", w_name="w1", eps_name="eps1")
    check_rms_norm_args(x2, w2, eps2, x_name="x2", w_name="w2", eps_name="eps2")
    check_eps_tensor(eps1_tensor, "eps1_tensor")
    check_eps_tensor(eps2_tensor, "eps2_tensor")
    if x1.device != x2.device:
        raise ValueError(f"x1 is on {x1.device} but x2 is on {x2.device}")


@torch.library.custom_op("k3fusion::dual_rms_norm", mutates_args=())
def dual_rms_norm_op(
    x1: torch.Tensor,
    w1: torch.Tensor,
    eps1: float,
    x2: torch.Tensor,
    w2: torch.Tensor,
    eps2: float,
    weight_in_fp32_1: bool = False,
    weight_in_fp32_2: bool = False,
    eps1_tensor: Optional[torch.Tensor] = None,
    eps2_tensor: Optional[torch.Tensor] = None,
    weights_early: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two RMSNorms in one launch; see ``k3fusion.reference.dual_rms_norm``.

    ``eps1_tensor``/``eps2_tensor`` are the compiler's form of eps: with
    ``torch.compile(dynamic=True)`` a module's float eps becomes a 0-dim CPU tensor
    input of the graph. When given, it replaces ``eps1``/``eps2``. ``weights_early``: the
    kernel may read ``w1``/``w2`` before the previous launch has finished (set by the
    graph pass only where no launch before it in the graph writes them; same results).
    """
    raise NotImplementedError(f"k3fusion::dual_rms_norm has no kernel for {x1.device.type}")


@dual_rms_norm_op.register_fake
def _(x1, w1, eps1, x2, w2, eps2, weight_in_fp32_1=False, weight_in_fp32_2=False,
      eps1_tensor=None, eps2_tensor=None, weights_early=False):
    _check_dual(x1, w1, eps1, x2, w2, eps2, eps1_tensor, eps2_tensor)
    return new_norm_output(x1, w1, weight_in_fp32_1), new_norm_output(x2, w2, weight_in_fp32_2)


@dual_rms_norm_op.register_kernel(("cpu", "cuda"))
def _(x1, w1, eps1, x2, w2, eps2, weight_in_fp32_1=False, weight_in_fp32_2=False,
      eps1_tensor=None, eps2_tensor=None, weights_early=False):
    _check_dual(x1, w1, eps1, x2, w2, eps2, eps1_tensor, eps2_tensor)
    eps1 = eps_value(eps1, eps1_tensor, "eps1_tensor")
    eps2 = eps_value(eps2, eps2_tensor, "eps2_tensor")
    if not runs_kernel(x1):
        y1, y2 = reference.dual_rms_norm(x1, w1, eps1, x2, w2, eps2, weight_in_fp32_1,
                                         weight_in_fp32_2)
        # Same layout as the fake impl promises (the reference keeps permuted inputs' strides).
        return y1.contiguous(), y2.contiguous()
    y1 = new_norm_output(x1, w1, weight_in_fp32_1)
    y2 = new_norm_output(x2, w2, weight_in_fp32_2)
    # The launcher is looked up per call: tests swap in a spy (tests/_kernel_paths.py).
    kernels.qkv_rmsnorm.dual_rms_norm(
        as_rows(x1), w1, eps1, as_rows(x2), w2, eps2, as_rows(y1), as_rows(y2),
        weight_in_fp32_1, weight_in_fp32_2,
        rows_per_program=dual_norm_rows_for_widths(get_config(), x1.shape[-1], x2.shape[-1]),
        weights_early=weights_early,
    )
    return y1, y2


def _dual_formula(x1, w1, eps1, x2, w2, eps2, weight_in_fp32_1=False, weight_in_fp32_2=False,
                  eps1_tensor=None, eps2_tensor=None, weights_early=False):
    return reference.dual_rms_norm(x1, w1, eps_value(eps1, eps1_tensor, "eps1_tensor"), x2, w2,
                                   eps_value(eps2, eps2_tensor, "eps2_tensor"),
                                   weight_in_fp32_1, weight_in_fp32_2)


differentiate_by_reference(dual_rms_norm_op, _dual_formula)


def dual_rms_norm(x1, w1, eps1, x2, w2, eps2, weight_in_fp32_1=False, weight_in_fp32_2=False,
                  eps1_tensor=None, eps2_tensor=None):
    """``torch.ops.k3fusion.dual_rms_norm`` after checking the arguments as given (the
    op's schema would turn ``eps1=True`` or a 0-dim tensor into a float first)."""
    _check_dual(x1, w1, eps1, x2, w2, eps2, eps1_tensor, eps2_tensor)
    return torch.ops.k3fusion.dual_rms_norm(x1, w1, eps1, x2, w2, eps2, weight_in_fp32_1,
                                            weight_in_fp32_2, eps1_tensor, eps2_tensor)
