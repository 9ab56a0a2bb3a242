"""``k3fusion::latent_moe_tail``: the latent-MoE tail as one op that picks its tier from T.

What the graph pass (``patterns/moe_tail.py``) inserts for
``all_reduce(shared) + rms_norm(all_reduce(routed_latent)) @ up_w.T``. The process group
travels by name (what ``_c10d_functional.all_reduce`` nodes carry), so the op schema has
no opaque group object; the implementation resolves it and calls the tiers
(:func:`k3fusion.moe_tail.latent_moe_tail`), which select from the actual T at run time
(dynamic T). Functional: the inputs are never modified. It lives with the tiers, not in
``k3fusion.ops``: the ops are the lower layer the tiers build on.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import reference
from ..kernels._launch import same_view
from ..moe_tail_args import check_latent_moe_tail_args
from ..ops._args import check_eps_tensor, eps_value
from ..ops._backward import differentiate_by_reference
from . import tiers

__all__ = ["latent_moe_tail", "resolve_group"]


def resolve_group(group_name: Optional[str]):
    """The process group registered under ``group_name`` (None: tp=1, no group).

    ``torch.distributed.distributed_c10d._resolve_process_group`` exists under that name
    in torch 2.11 and 2.13 (older builds only had it in ``torch._C._distributed_c10d``).
    """
    if group_name is None:
        return None
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group
    except ImportError:  # pragma: no cover - older torch
        from torch._C._distributed_c10d import _resolve_process_group
    return _resolve_process_group(group_name)


def _check_tail(routed_latent, shared, norm_w, eps, up_w, group_name, eps_tensor,
                norm_dtype=None, weight_in_fp32=False) -> None:
    check_latent_moe_tail_args(routed_latent, shared, norm_w, eps, up_w, norm_dtype,
                               weight_in_fp32)
    check_eps_tensor(eps_tensor, "eps_tensor")
    if group_name is not None and not isinstance(group_name, str):
        raise TypeError(f"group_name must be a str or None, got {type(group_name).__name__}")


def _tail_out_dtype(routed_latent, shared, norm_w, up_w, weight_in_fp32: bool,
                    norm_dtype=None) -> torch.dtype:
    normed = reference.rms_norm_out_dtype(routed_latent.dtype, norm_w.dtype, weight_in_fp32,
                                          norm_dtype)
    return torch.promote_types(shared.dtype, torch.promote_types(normed, up_w.dtype))


@torch.library.custom_op("k3fusion::latent_moe_tail", mutates_args=())
def latent_moe_tail_op(
    routed_latent: torch.Tensor,
    shared: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
    up_w: torch.Tensor,
    group_name: Optional[str],
    weight_in_fp32: bool = False,
    eps_tensor: Optional[torch.Tensor] = None,
    norm_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """``all_reduce(shared) + rms_norm(all_reduce(routed_latent), norm_w, eps) @ up_w.T``
    over the process group named ``group_name`` (None: tp=1); see
    ``k3fusion.reference.latent_moe_tail``. The tier is selected per call from T.
    ``eps_tensor`` (a 0-dim CPU tensor, ``torch.compile(dynamic=True)``'s form of a float
    eps) replaces ``eps``. ``norm_dtype``: the normalized latent's cast when it is not the
    latent's dtype (a T5-style norm of an fp32 input, or one whose 16-bit round trip
    Inductor removed). Returns a new ``[..., H]`` tensor; inputs are not modified.
    """
    raise NotImplementedError(f"k3fusion::latent_moe_tail has no kernel for {shared.device.type}")


@latent_moe_tail_op.register_fake
def _(routed_latent, shared, norm_w, eps, up_w, group_name, weight_in_fp32=False,
      eps_tensor=None, norm_dtype=None):
    _check_tail(routed_latent, shared, norm_w, eps, up_w, group_name, eps_tensor, norm_dtype,
                weight_in_fp32)
    dtype = _tail_out_dtype(routed_latent, shared, norm_w, up_w, weight_in_fp32, norm_dtype)
    return shared.new_empty(shared.shape, dtype=dtype)


def _run_tiers(routed_latent, shared, norm_w, eps, up_w, group_name, weight_in_fp32,
               eps_tensor, norm_dtype, donate: bool) -> torch.Tensor:
    """Both ops' kernel: the arguments checked, the tiers run (``donate``: on both partials)."""
    _check_tail(routed_latent, shared, norm_w, eps, up_w, group_name, eps_tensor, norm_dtype,
                weight_in_fp32)
    return tiers.latent_moe_tail(routed_latent, shared, norm_w,
                                 eps_value(eps, eps_tensor, "eps_tensor"), up_w,
                                 resolve_group(group_name), weight_in_fp32=weight_in_fp32,
                                 norm_dtype=norm_dtype, donate_shared=donate,
                                 donate_routed=donate)


# One implementation for both devices: the tiers pick the CPU or CUDA path themselves.
@latent_moe_tail_op.register_kernel(("cpu", "cuda"))
def _(routed_latent, shared, norm_w, eps, up_w, group_name, weight_in_fp32=False,
      eps_tensor=None, norm_dtype=None):
    y = _run_tiers(routed_latent, shared, norm_w, eps, up_w, group_name, weight_in_fp32,
                   eps_tensor, norm_dtype, donate=False)
    # Same layout as the fake impl promises; a fresh tensor, never an alias of an input.
    y = y.contiguous()
    if y.data_ptr() == shared.data_ptr() and shared.numel():
        y = y.clone()
    return y


@torch.library.custom_op("k3fusion::latent_moe_tail_", mutates_args=("routed_latent", "shared"))
def latent_moe_tail_inplace_op(
    routed_latent: torch.Tensor,
    shared: torch.Tensor,
    norm_w: torch.Tensor,
    eps: float,
    up_w: torch.Tensor,
    group_name: Optional[str],
    weight_in_fp32: bool = False,
    eps_tensor: Optional[torch.Tensor] = None,
    norm_dtype: Optional[torch.dtype] = None,
) -> None:
    """:func:`latent_moe_tail_op` with its result written into ``shared`` (the argument
    rules give it the result's dtype); ``routed_latent`` is clobbered (all-reduced in place
    at tp > 1).
    What the graph pass inserts, through ``auto_functionalized``, so that Inductor passes
    the partials in place where nothing reads them afterwards and clones them where
    something does: the tiers then take both as donated (no copy of their own)."""
    raise NotImplementedError(
        f"k3fusion::latent_moe_tail_ has no kernel for {shared.device.type}")


@latent_moe_tail_inplace_op.register_fake
def _(routed_latent, shared, norm_w, eps, up_w, group_name, weight_in_fp32=False,
      eps_tensor=None, norm_dtype=None):
    _check_tail(routed_latent, shared, norm_w, eps, up_w, group_name, eps_tensor, norm_dtype,
                weight_in_fp32)


@latent_moe_tail_inplace_op.register_kernel(("cpu", "cuda"))
def _(routed_latent, shared, norm_w, eps, up_w, group_name, weight_in_fp32=False,
      eps_tensor=None, norm_dtype=None):
    y = _run_tiers(routed_latent, shared, norm_w, eps, up_w, group_name, weight_in_fp32,
                   eps_tensor, norm_dtype, donate=True)
    # The tiers that accumulate into a donated partial return it; the others a new tensor.
    if not same_view(y, shared):
        shared.copy_(y)


def _tail_formula(routed_latent, shared, norm_w, eps, up_w, group_name, weight_in_fp32=False,
                  eps_tensor=None, norm_dtype=None):
    if group_name is not None:
        raise NotImplementedError(
            "k3fusion::latent_moe_tail has no backward over a process group (group_name="
            f"{group_name!r}); differentiate the unfused tail for tensor-parallel training")
    return reference.latent_moe_tail(routed_latent, shared, norm_w,
                                     eps_value(eps, eps_tensor, "eps_tensor"), up_w, None,
                                     weight_in_fp32, norm_dtype)


differentiate_by_reference(latent_moe_tail_op, _tail_formula)


def latent_moe_tail(routed_latent, shared, norm_w, eps, up_w, group_name, weight_in_fp32=False,
                    eps_tensor=None, norm_dtype=None):
    """``torch.ops.k3fusion.latent_moe_tail`` after checking the arguments as given (the
    op's schema would turn ``eps=True`` or a 0-dim tensor into a float first)."""
    _check_tail(routed_latent, shared, norm_w, eps, up_w, group_name, eps_tensor, norm_dtype,
                weight_in_fp32)
    return torch.ops.k3fusion.latent_moe_tail(routed_latent, shared, norm_w, eps, up_w,
                                              group_name, weight_in_fp32, eps_tensor, norm_dtype)
