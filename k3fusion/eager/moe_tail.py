"""Eager latent-MoE tail: :class:`MoETailRunner` runs ``AR(shared) + up_proj(norm(AR(routed
latent)))`` through the tier ``k3fusion.moe_tail`` selects per call, and
:func:`k3fusion.eager.patch_model` swaps a K3 latent MoE's ``tail`` for one
(:func:`moe_tail_runners` lists them).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ..config import get_config
from ..moe_tail import as_tier, run_latent_moe_tail
from ..patterns.moe_tail import FUSION_NAME
from ._guards import records_grad, transforms_active
from ._norm_spec import CheckedSpec, rms_norm_spec, why_not_standard
from .patcher import Patcher


class MoETailRunner(nn.Module):
    """The latent-MoE tail ``AR(shared) + up_proj(norm(AR(routed_latent)))`` through the
    tier :func:`k3fusion.moe_tail.select_tier` picks for each call's token count.

    ``norm`` must be an RMSNorm of the standard kind (:func:`rms_norm_spec`; its
    formulation, eps and weight are read from it), ``up_proj`` an ``nn.Linear(L, H)``
    without bias, ``group`` the tensor-parallel process group (None: tp=1). ``tier``
    forces a tier for every call (else ``FusionConfig.moe_tail_tier`` / auto).

    Which tier ran: :attr:`last_tier`, :attr:`tier_counts` (this runner) and
    ``k3fusion.moe_tail.tier_counts()`` (all runners and calls). The runner holds its
    ``norm`` and ``up_proj`` as submodules; :func:`patch_model` installs it without
    registering it, so a patched model's ``state_dict`` keys do not change. The norm's
    eps and formulation are read again when its parameters, dtype or eps change (a norm
    that is no longer standard then is a TypeError).
    """

    def __init__(self, norm: nn.Module, up_proj: nn.Module, group=None, *, tier=None) -> None:
        super().__init__()
        spec = rms_norm_spec(norm)
        if spec is None:
            raise TypeError(f"norm: {why_not_standard(norm)}")
        if not isinstance(up_proj, nn.Linear) or up_proj.bias is not None:
            raise TypeError("up_proj must be an nn.Linear without bias")
        if up_proj.in_features != spec.weight.shape[0]:
            raise ValueError(f"up_proj takes {up_proj.in_features} features but norm is "
                             f"{spec.weight.shape[0]} wide")
        self.norm, self.up_proj, self.group = norm, up_proj, group
        self._norm_spec = CheckedSpec(rms_norm_spec)
        self._norm_spec.get(norm)
        self.tier = None if tier is None else as_tier(tier)
        self.last_tier = None
        # Load the config now (reads the environment): a first load inside a compiled
        # region would not trace.
        get_config()
        self.tier_counts: dict[str, int] = {}

    def forward(self, routed_latent: torch.Tensor, shared: torch.Tensor, *,
                donate_shared: bool = False) -> torch.Tensor:
        """Per-rank partials ``routed_latent [..., L]``, ``shared [..., H]`` -> ``[..., H]``.
        ``donate_shared``: ``shared`` is a temporary the tail may overwrite."""
        spec = self.norm_spec()
        if spec is None:
            raise TypeError(f"norm ({type(self.norm).__name__}) is no longer a standard RMSNorm "
                            "(it changed after the runner was made)")
        y, tier = run_latent_moe_tail(
            routed_latent, shared, self.norm.weight, spec.eps, self.up_proj.weight, self.group,
            weight_in_fp32=spec.weight_in_fp32, tier=self.tier, donate_shared=donate_shared)
        if not torch.compiler.is_compiling():
            self.last_tier = tier
            self.tier_counts[tier.value] = self.tier_counts.get(tier.value, 0) + 1
        return y

    def norm_spec(self):
        """The norm's spec as it is now (derived again after a change), or None."""
        return self._norm_spec.get(self.norm)

    def extra_repr(self) -> str:
        return f"tier={'auto' if self.tier is None else self.tier.value}"


class _MoETailStep:
    """Replaces a latent MoE's ``tail(routed_latent, shared)``: the module's partials are
    its own temporaries, so the runner may accumulate into ``shared``. Follows the
    module: a swapped ``latent_norm`` or ``up_proj`` gets a new runner; one that is not of
    the fused kind runs the original tail (counted in :attr:`fallbacks`)."""

    def __init__(self, runner: MoETailRunner, original, owner: nn.Module) -> None:
        self.runner, self.original = runner, original
        self._owner = weakref.ref(owner)
        self.fallbacks: dict[str, int] = {}

    def _current_runner(self) -> MoETailRunner | str:
        owner = self._owner()
        norm, up = owner.latent_norm, owner.up_proj
        if self.runner.norm is not norm or self.runner.up_proj is not up:
            try:
                self.runner = MoETailRunner(norm, up, owner.tp_group)
            except (TypeError, ValueError) as e:
                return str(e)
            owner.__dict__["_k3fusion_moe_tail"] = self.runner
        if self.runner.norm_spec() is None:
            return "latent_norm is no longer a standard RMSNorm"
        if not isinstance(up, nn.Linear) or up.bias is not None:
            return "up_proj is no longer an nn.Linear without bias"
        return self.runner

    def __call__(self, routed_latent, shared):
        if transforms_active() or records_grad((routed_latent, shared),
                                               (self.runner.norm, self.runner.up_proj)):
            # torch.func transforms: the tiers have no batching rules; grad: no backward.
            return self.original(routed_latent, shared)
        runner = self._current_runner()
        if isinstance(runner, str):
            self.fallbacks[runner] = self.fallbacks.get(runner, 0) + 1
            return self.original(routed_latent, shared)
        return runner(routed_latent, shared, donate_shared=True)


def is_latent_moe(module: nn.Module) -> bool:
    """The K3 latent-MoE contract: ``latent_norm`` and ``up_proj`` children, a ``tail``
    method, and a ``tp_group`` attribute (None at tp=1)."""
    return (isinstance(getattr(module, "latent_norm", None), nn.Module)
            and isinstance(getattr(module, "up_proj", None), nn.Module)
            and callable(getattr(module, "tail", None)) and hasattr(module, "tp_group"))


def _swap_tail(module: nn.Module) -> str | None:
    """Swap ``module.tail`` for a :class:`MoETailRunner` step; None, or why skipped."""
    if getattr(module, "_k3fusion_moe_tail", None) is not None:
        return "already patched"
    why = why_not_standard(module.latent_norm)
    if why is not None:
        return f"latent_norm: {why}"
    try:
        runner = MoETailRunner(module.latent_norm, module.up_proj, module.tp_group)
    except (TypeError, ValueError) as e:
        return str(e)
    # Through __dict__: nn.Module.__setattr__ would register the runner as a child.
    module.__dict__["tail"] = _MoETailStep(runner, module.tail, module)
    module.__dict__["_k3fusion_moe_tail"] = runner
    return None


def patch_moe_tail(name: str, module: nn.Module) -> list[tuple[str, str | None]]:
    """``[(report key, None if patched else why skipped)]`` for the module's ``tail``."""
    return [(f"{name}.tail" if name else "tail", _swap_tail(module))]


#: Tried on a module first.
PATCHER = Patcher(FUSION_NAME, is_latent_moe, patch_moe_tail, order=0)


def moe_tail_runners(model: nn.Module) -> dict[str, MoETailRunner]:
    """``{module name: runner}`` for every latent-MoE tail :func:`patch_model` patched."""
    return {name: m.__dict__["_k3fusion_moe_tail"] for name, m in model.named_modules()
            if m.__dict__.get("_k3fusion_moe_tail") is not None}
