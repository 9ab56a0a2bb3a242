"""Eager q/kv RMSNorm pair: :func:`fused_qkv_rmsnorm` (both MLA norms in one launch),
:class:`FusedQKVRMSNorm`, and the prefetch :func:`k3fusion.eager.patch_model` installs.

The prefetch fuses an MLA module's norms without touching its ``forward``: the q
projection computes both projections and both norms in one launch, and the kv projection
and the two norms hand back those results only for the very tensors it produced
(docs/design-notes.md, "k3fusion/eager/").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from .. import reference
from ..ops import check_rms_norm_args
from ..patterns.qkv_rmsnorm import FUSION_NAME
from ._guards import SeenTensor, transforms_active
from ._norm_spec import CheckedSpec, rms_norm_spec, why_not_standard
from .patcher import Patcher

log = logging.getLogger("k3fusion")


def fused_qkv_rmsnorm(
    q_c: torch.Tensor,
    q_weight: torch.Tensor,
    q_eps: float,
    kv_c: torch.Tensor,
    kv_weight: torch.Tensor,
    kv_eps: float,
    *,
    q_weight_in_fp32: bool = False,
    kv_weight_in_fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(q_c), rms_norm(kv_c))`` in one kernel launch (plain ops when compiling).

    ``kv_c`` may be a strided view (the first ``kv_lora`` columns of the kv projection).
    """
    if torch.compiler.is_compiling():
        return reference.dual_rms_norm(q_c, q_weight, q_eps, kv_c, kv_weight, kv_eps,
                                       q_weight_in_fp32, kv_weight_in_fp32)
    # Checked here too: the op's schema would turn eps=True into 1.0 and a string eps
    # into a RuntimeError before its own checks run.
    check_rms_norm_args(q_c, q_weight, q_eps, x_name="q_c", w_name="q_weight", eps_name="q_eps")
    check_rms_norm_args(kv_c, kv_weight, kv_eps, x_name="kv_c", w_name="kv_weight", eps_name="kv_eps")
    return torch.ops.k3fusion.dual_rms_norm(q_c, q_weight, q_eps, kv_c, kv_weight, kv_eps,
                                            q_weight_in_fp32, kv_weight_in_fp32)


class FusedQKVRMSNorm(nn.Module):
    """The q/kv norm pair of one attention module as a single fused call.

    Keeps the original norm modules (their parameters stay where they were); their eps and
    formulation are read again whenever their parameters, dtype or eps change.
    """

    def __init__(self, q_norm: nn.Module, kv_norm: nn.Module) -> None:
        super().__init__()
        self._q_spec, self._kv_spec = CheckedSpec(rms_norm_spec), CheckedSpec(rms_norm_spec)
        if self._q_spec.get(q_norm) is None:
            raise TypeError(f"q_norm: {why_not_standard(q_norm)}")
        if self._kv_spec.get(kv_norm) is None:
            raise TypeError(f"kv_norm: {why_not_standard(kv_norm)}")
        self.q_norm, self.kv_norm = q_norm, kv_norm

    def specs(self):
        """Both norms' specs as they are now (None where a norm is no longer standard)."""
        return self._q_spec.get(self.q_norm), self._kv_spec.get(self.kv_norm)

    def forward(self, q_c: torch.Tensor, kv_c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q_spec, kv_spec = self.specs()
        if q_spec is None or kv_spec is None:
            raise TypeError("a norm is no longer a standard RMSNorm (it changed after this "
                            "module was made)")
        return fused_qkv_rmsnorm(
            q_c, self.q_norm.weight, q_spec.eps, kv_c, self.kv_norm.weight, kv_spec.eps,
            q_weight_in_fp32=q_spec.weight_in_fp32, kv_weight_in_fp32=kv_spec.weight_in_fp32)


def _module_tensors(module: nn.Module) -> list[torch.Tensor]:
    if module._modules:
        return [*module.parameters(), *module.buffers()]
    return [t for d in (module._parameters, module._buffers) for t in d.values() if t is not None]


class _ModuleState:
    """A module's parameters and buffers as a result saw them (object, data, version)."""

    __slots__ = ("module", "key")

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.key = [(t, t.data_ptr(), t._version) for t in _module_tensors(module)]

    def unchanged(self) -> bool:
        now = _module_tensors(self.module)
        return len(now) == len(self.key) and all(
            t is k and t.data_ptr() == p and t._version == v for t, (k, p, v) in zip(now, self.key))


def _can_fuse(x: torch.Tensor) -> bool:
    """The fused kernels stand in for the modules only where they compute the same thing
    and a later in-place write to an input is visible: not while compiling, under a
    ``torch.func`` transform, autocasting or in inference mode (inference tensors keep no
    version counter)."""
    return not (torch.compiler.is_compiling() or transforms_active()
                or torch.is_inference_mode_enabled()
                or x.is_inference() or torch.is_autocast_enabled(x.device.type))


@dataclass
class _Stash:
    """One prefetch step's results, each handed out at most once, and only to a call
    whose input is the tensor (same base, view and version) the step computed it from,
    with the module's parameters unchanged."""

    hidden: SeenTensor
    kv_state: _ModuleState
    kv: torch.Tensor | None
    q_c: SeenTensor
    q_state: _ModuleState
    q_out: torch.Tensor | None
    kv_c: SeenTensor
    kv_norm_state: _ModuleState
    kv_out: torch.Tensor | None
    #: the norms' specs the results were computed with (the same objects while they hold)
    specs: tuple


class _QKVPrefetch:
    """Fuses one attention module's q/kv norms by overriding four children's ``forward``.

    The children stay the same modules (state_dict keys, parameters and hooks are
    unchanged); only their instance ``forward`` is replaced, and the originals are kept.
    """

    def __init__(self, attn: nn.Module) -> None:
        self.fused = FusedQKVRMSNorm(attn.q_a_layernorm, attn.kv_a_layernorm)
        self.q_proj, self.kv_proj = attn.q_a_proj, attn.kv_a_proj_with_mqa
        self.q_norm, self.kv_norm = attn.q_a_layernorm, attn.kv_a_layernorm
        self.original = {m: m.forward for m in (self.q_proj, self.kv_proj, self.q_norm, self.kv_norm)}
        self.kv_lora = int(self.kv_norm.weight.shape[0])
        self.stash: _Stash | None = None

    def install(self) -> None:
        self.q_proj.forward = self.project_q
        self.kv_proj.forward = self.project_kv
        self.q_norm.forward = self.norm_q
        self.kv_norm.forward = self.norm_kv
        for m in self.original:
            m._k3fusion_prefetch = self

    def _fusable(self, x: torch.Tensor) -> bool:
        # While autograd records too: the pair's op has a backward (the reference's).
        return isinstance(x, torch.Tensor) and _can_fuse(x)

    def _specs_hold(self, used=None) -> bool:
        """Both norms are still of the standard kind (their specs follow any change) --
        and, given the specs a stashed result used, still those very specs."""
        now = self.fused.specs()
        if used is not None:
            return all(a is b for a, b in zip(now, used))
        return None not in now

    def project_q(self, hidden: torch.Tensor) -> torch.Tensor:
        self.stash = None
        q_c = self.original[self.q_proj](hidden)
        if not self._fusable(hidden) or not self._specs_hold():
            return q_c
        try:  # the prefetch must not raise where the module would not have been called
            kv = self.original[self.kv_proj](hidden)
        except Exception as e:
            log.debug("k3fusion eager: q/kv prefetch skipped: %s", e)
            return q_c
        kv_c = kv[..., : self.kv_lora]
        q_spec, kv_spec = self.fused.specs()
        try:
            check_rms_norm_args(q_c, self.q_norm.weight, q_spec.eps, x_name="q_c")
            check_rms_norm_args(kv_c, self.kv_norm.weight, kv_spec.eps, x_name="kv_c")
        except (TypeError, ValueError) as e:  # unusual layout: let the modules run as written
            log.debug("k3fusion eager: q/kv prefetch skipped: %s", e)
            return q_c
        q_out, kv_out = self.fused(q_c, kv_c)
        self.stash = _Stash(SeenTensor(hidden), _ModuleState(self.kv_proj), kv,
                            SeenTensor(q_c), _ModuleState(self.q_norm), q_out,
                            SeenTensor(kv_c), _ModuleState(self.kv_norm), kv_out, (q_spec, kv_spec))
        return q_c

    def project_kv(self, hidden: torch.Tensor) -> torch.Tensor:
        s = self.stash
        if (s is not None and s.kv is not None and s.hidden.matches(hidden)
                and s.kv_state.unchanged() and self._fusable(hidden)):
            kv, s.kv = s.kv, None
            return kv
        return self.original[self.kv_proj](hidden)

    def norm_q(self, x: torch.Tensor) -> torch.Tensor:
        s = self.stash
        if (s is not None and s.q_out is not None and s.q_c.matches(x)
                and s.q_state.unchanged() and self._fusable(x) and self._specs_hold(s.specs)):
            out, s.q_out = s.q_out, None
            return out
        return self.original[self.q_norm](x)

    def norm_kv(self, x: torch.Tensor) -> torch.Tensor:
        s = self.stash
        if (s is not None and s.kv_out is not None and s.kv_c.matches(x)
                and s.kv_norm_state.unchanged() and self._fusable(x) and self._specs_hold(s.specs)):
            out, s.kv_out = s.kv_out, None
            if s.q_out is None:
                self.stash = None  # the step is complete; drop the references
            return out
        return self.original[self.kv_norm](x)


_PAIR_CHILDREN = ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm")


def has_qkv_norms(module: nn.Module) -> bool:
    """Has the MLA norm pair (``q_a_layernorm`` and ``kv_a_layernorm``): a candidate; the
    patcher reports what else it lacks."""
    return all(hasattr(module, c) for c in _PAIR_CHILDREN[1::2])


def _path(name: str, child: str) -> str:
    return f"{name}.{child}" if name else child


def patch_qkv_rmsnorm(name: str, module: nn.Module) -> list[tuple[str, str | None]]:
    """Install the q/kv prefetch on ``module``: ``[(report key, None if patched else why
    skipped)]``. Patched: the module's own path. Skipped: the path of the child the reason
    is about (a refused norm, a missing projection), so no key is empty."""
    if hasattr(module.q_a_layernorm, "_k3fusion_prefetch"):
        return [(name or _path(name, "q_a_layernorm"), "already patched")]
    for child in _PAIR_CHILDREN:
        found = getattr(module, child, None)
        if not isinstance(found, nn.Module):
            what = "nothing" if found is None else f"a {type(found).__name__}"
            return [(_path(name, child), f"expected a `{child}` child module next to "
                     f"{', '.join(c for c in _PAIR_CHILDREN if c != child)}; found {what}")]
    for child in _PAIR_CHILDREN[1::2]:
        why = why_not_standard(getattr(module, child))
        if why is not None:
            return [(_path(name, child), why)]
    _QKVPrefetch(module).install()
    return [(name, None)]


#: Tried on a module last.
PATCHER = Patcher(FUSION_NAME, has_qkv_norms, patch_qkv_rmsnorm, order=2)
