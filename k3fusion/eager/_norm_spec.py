"""Which norm modules the eager fusions may replace: the standard RMSNorm kind, verified.

Shared by every fusion that reads a norm's weight and eps from a module (the q/kv pair,
AttnRes's key and output norms, the MoE tail's latent norm).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from .. import reference


@dataclass(frozen=True)
class RMSNormSpec:
    """What a norm module computes, in terms of ``k3fusion.reference.rms_norm``."""

    weight: nn.Parameter
    eps: float
    weight_in_fp32: bool


#: What :func:`rms_norm_spec` requires of a norm module, as its reasons say it.
EXPECTED = ("a 1-D `weight` tensor, a number `eps` or `variance_epsilon`, and x * rsqrt(mean(x**2, "
            "-1) + eps) * weight (the weight applied in the input dtype or in fp32)")


def _found_attributes(module: nn.Module) -> str:
    names = [*module._parameters, *(k for k, v in module.__dict__.items()
                                    if not k.startswith("_") and type(v) in (int, float))]
    return ", ".join(names) or "none"


def _declared_spec(module: nn.Module) -> tuple[nn.Parameter, float] | str:
    """The module's weight and eps, or what was found instead of them."""
    weight = getattr(module, "weight", None)
    if weight is None:
        return f"no `weight` (parameters and number attributes: {_found_attributes(module)})"
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        return f"`weight` of {'shape ' if isinstance(weight, torch.Tensor) else 'type '}{shape}"
    if isinstance(module, nn.RMSNorm):
        eps = module.eps if module.eps is not None else torch.finfo(weight.dtype).eps
    else:
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if eps is None:
        return (f"no `eps` or `variance_epsilon` (parameters and number attributes: "
                f"{_found_attributes(module)})")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        return f"eps {eps!r} of type {type(eps).__name__}, not a number"
    return weight, float(eps)


@torch.no_grad()
def _spec_or_reason(module: nn.Module) -> RMSNormSpec | str:
    declared = _declared_spec(module)
    if isinstance(declared, str):
        return declared
    weight, eps = declared
    if weight.device.type == "meta":
        return "its weight on the meta device (load the weights first)"
    gen = torch.Generator(device="cpu").manual_seed(0)
    n = weight.shape[0]
    probe = torch.randn(8, n, generator=gen).mul_(3).to(weight.device, weight.dtype)
    # Probe with a random weight (swapped in through .data, the user's storage is not
    # touched): with a fresh all-ones weight both formulations agree and the probe
    # could not tell which one the module computes once real weights are loaded.
    probe_w = (1 + 0.5 * torch.randn(n, generator=gen)).to(weight.device, weight.dtype)
    original = weight.data
    weight.data = probe_w
    try:
        got = module(probe)
    except Exception as e:  # not callable like a norm: not ours to patch
        return f"a call on a [8, {n}] input raised {type(e).__name__}: {e}"
    finally:
        weight.data = original
    weight = probe_w
    for weight_in_fp32 in (False, True):
        want = reference.rms_norm(probe, weight, eps, weight_in_fp32)
        if (isinstance(got, torch.Tensor) and got.dtype == want.dtype
                and got.shape == want.shape and torch.equal(got, want)):
            return RMSNormSpec(module.weight, eps, weight_in_fp32)
    if not isinstance(got, torch.Tensor):
        return f"a call that returns {type(got).__name__}, not a tensor"
    if got.shape != want.shape or got.dtype not in (want.dtype, probe.dtype):
        return (f"an output of shape {tuple(got.shape)} and dtype {got.dtype} for a "
                f"{tuple(probe.shape)} {probe.dtype} input")
    return (f"another function of weight {tuple(weight.shape)} and eps {eps:g} on a probe "
            "input (Gemma's 1 + weight, say)")


def rms_norm_spec(module: nn.Module) -> RMSNormSpec | None:
    """The module's RMSNorm formulation, or None if it is not of the standard kind.

    Its weight and eps come from the usual attributes (``weight``; ``variance_epsilon``
    or ``eps``); the formulation is then *verified*: the module must reproduce one of
    the two reference formulations bit for bit on a probe input. Gemma's ``1 + w``,
    or anything else, fails that check and is left alone (:func:`why_not_standard`).
    """
    spec = _spec_or_reason(module)
    return None if isinstance(spec, str) else spec


def why_not_standard(module: nn.Module) -> str | None:
    """None for a standard RMSNorm (:func:`rms_norm_spec`), else one line: what a norm
    needs and what this one has instead."""
    spec = _spec_or_reason(module)
    if not isinstance(spec, str):
        return None
    return f"{type(module).__name__} is not a standard RMSNorm: expected {EXPECTED}; found {spec}"


_NO_EPS = object()


def _raw_eps(module: nn.Module):
    """The attribute :func:`_declared_spec` reads eps from, as stored (a cheap check that
    it was not changed after patching)."""
    eps = module.__dict__.get("variance_epsilon", _NO_EPS)
    if eps is _NO_EPS:
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return eps


_PLAIN = (str, int, float, bool, type(None))


def _settings(m: nn.Module) -> tuple:
    """A module's class, its instance ``forward`` if one was set, and its plain attributes
    (eps, a norm style, a precision flag...): what decides its function besides tensors."""
    plain = tuple((k, v) for k, v in m.__dict__.items()
                  if isinstance(v, _PLAIN) and not k.startswith("_k3fusion"))
    return type(m), m.__dict__.get("forward"), plain


class ModuleState:
    """What a spec of ``root`` was derived from, to check cheaply that it still holds: every
    submodule (the objects, weakly: a replaced child shows), its :func:`_settings` (eps, a
    norm style, a precision flag, a replaced ``forward``), and each parameter (the object,
    weakly -- ``load_state_dict(assign=True)`` replaces it -- with its dtype and device:
    ``.to(dtype)`` keeps the object and changes its data). Values are not part of it: a
    spec reads its weights at call time."""

    __slots__ = ("_entries",)

    def __init__(self, root: nn.Module) -> None:
        self._entries = [(weakref.ref(m), _settings(m),
                          [(weakref.ref(p), p.dtype, p.device) for p in m._parameters.values()
                           if p is not None])
                         for m in root.modules()]

    def holds(self, root: nn.Module) -> bool:
        mods = list(root.modules())
        if len(mods) != len(self._entries):
            return False
        for m, (ref, settings, params) in zip(mods, self._entries):
            if ref() is not m or _settings(m) != settings:
                return False
            now = [p for p in m._parameters.values() if p is not None]
            if len(now) != len(params) or any(
                    r() is not p or p.dtype != dt or p.device != dev
                    for p, (r, dt, dev) in zip(now, params)):
                return False
        return True


class CheckedSpec:
    """``derive(module)`` (a spec, or None), derived again whenever the module's
    :class:`ModuleState` changes: a patched module follows its weights, eps, dtype and
    children instead of serving what it saw first."""

    __slots__ = ("derive", "_state", "_spec")

    def __init__(self, derive) -> None:
        self.derive = derive
        self._state: ModuleState | None = None
        self._spec = None

    def get(self, module: nn.Module):
        if self._state is None or not self._state.holds(module):
            self._spec = self.derive(module)
            self._state = ModuleState(module)
        return self._spec
