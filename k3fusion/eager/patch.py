"""``patch_model``: switch a model's modules to the fused eager kernels, one fusion at a time.

:data:`PATCHERS` lists each fusion's detector (does a module have the fusion's contract?)
and patcher (install it; say what was patched or why not), in the order they are tried on
each module; :class:`PatchReport` collects what they say.
"""

from __future__ import annotations

import importlib
import importlib.util
import weakref
from dataclasses import dataclass, field

from torch import nn

from ..patterns.registry import FUSIONS
from .patcher import Patcher

#: When a patched module runs its fused kernels, in :attr:`PatchReport.notes`.
FUSED_WHEN = ("patched modules run their fused kernels outside autocast, torch.compile and "
              "torch.func transforms; "
              "the MoE tail only where autograd records nothing "
              "(torch.no_grad(), or no input or parameter requires grad), the q/kv norms "
              "and AttnRes also while it records (their functional ops have a backward; "
              "AttnRes's is the fused backward kernel), the q/kv norms not in "
              "torch.inference_mode() (no version counters). Otherwise the original "
              "modules run (docs/eager.md).")


@dataclass
class PatchReport:
    """What :func:`patch_model` did: module names patched, and skipped with the reason;
    ``notes``: when the patched modules fall back to the original ones; :meth:`fallbacks`:
    the calls that did, counted as they happen."""

    patched: list[str]
    skipped: dict[str, str]
    notes: list[str] = field(default_factory=lambda: [FUSED_WHEN])
    model: object = field(default=None, repr=False, compare=False)  # weakref to the model

    def __len__(self) -> int:
        return len(self.patched)

    def fallbacks(self) -> dict[str, dict[str, int]]:
        """``{module name: {reason: calls}}``: calls of a patched, standard module that ran
        the original step because the fused op cannot express them (a ring-buffer bank
        written over a live source, a list bank shorter than ``num_blocks``, a latent
        norm or up-projection swapped for one of another kind), since patching."""
        model = self.model() if self.model is not None else None
        if model is None:
            return {}
        found = {}
        for name, m in model.named_modules():
            for step in (m.__dict__.get("_k3fusion_attn_res"), m.__dict__.get("tail")):
                counts = getattr(step, "fallbacks", None)
                if counts:
                    found[name] = {**found.get(name, {}), **counts}
        return found


def _patchers() -> tuple[Patcher, ...]:
    """Each registered fusion's ``PATCHER``, from its eager module ``k3fusion.eager.<fusion>``
    (a fusion without one has no eager path), in the order they are tried (``order``).
    Found by name, so that a new fusion's eager module needs no line here."""
    found = []
    for fusion in FUSIONS:
        module = f"{__package__}.{fusion.name}"
        if importlib.util.find_spec(module) is not None:
            found.append(importlib.import_module(module).PATCHER)
    return tuple(sorted(found, key=lambda p: p.order))


#: Every fusion's :class:`~k3fusion.eager.patcher.Patcher`, tried in this order on every
#: module (a module may have several contracts).
PATCHERS = _patchers()


def patch_model(model: nn.Module) -> PatchReport:
    """Switch ``model`` to the fused eager kernels.

    * MLA q/kv norms: a module qualifies when it has ``q_a_proj``, ``q_a_layernorm``,
      ``kv_a_proj_with_mqa`` and ``kv_a_layernorm`` children and both norms are of the
      standard RMSNorm kind (verified numerically, see :func:`rms_norm_spec`).
    * AttnRes: every module with an ``apply_attn_res`` method (the Kimi-K3 contract, see
      ``k3fusion.models.kimi_k3.apply_attn_res``) runs the fused kernel; calls whose
      AttnRes or norm modules are not standard (:func:`attn_res_spec`) run the original.
      Delta hand-off: such a module that also has a bool ``attn_res_handoff`` attribute
      (``KimiK3Model``: its layers then return their MLP output as the next layer's
      delta) gets it set, so each layer's closing ``prefix + mlp_out`` is added inside
      the next fused step (reported as ``<name>.attn_res_handoff``).
    * Latent-MoE tail: every module with ``latent_norm`` and ``up_proj`` children, a
      ``tail(routed_latent, shared)`` method and a ``tp_group`` attribute (the Kimi-K3
      contract, ``k3fusion.models.kimi_k3.KimiK3LatentMoE``) runs its tail through a
      :class:`MoETailRunner` (tier selected per call); a non-standard ``latent_norm``
      is skipped with the reason.

    Training: while autograd records (grad mode on and an input or parameter requires
    grad) the q/kv pair runs its fused op, whose backward is the reference formula's,
    AttnRes its functional op (the fused backward kernel where the kernels run), and the
    tail the original modules (its tier paths have no backward); see
    ``PatchReport.notes`` and ``docs/eager.md``.

    Idempotent. Returns a :class:`PatchReport` naming what was patched and what was
    skipped and why.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    report = PatchReport([], {}, model=weakref.ref(model))
    for name, module in list(model.named_modules()):
        for patcher in PATCHERS:
            if not patcher.detects(module):
                continue
            for key, why in patcher.patch(name, module):
                if why is None:
                    report.patched.append(key)
                else:
                    report.skipped[key] = why
    return report
