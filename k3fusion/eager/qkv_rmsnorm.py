"""Eager-mode wrappers: the same fused kernels for models that are not compiled.

Under ``torch.compile`` every wrapper computes the plain formulation instead, so the
graph pass sees ordinary ops and owns the fusion there (one source of truth per mode).

* :func:`fused_qkv_rmsnorm` -- the MLA q/kv RMSNorm pair as one launch.
* :func:`patch_model` -- switch every attention module with ``q_a_layernorm`` /
  ``kv_a_layernorm`` children of the standard RMSNorm kind to the fused pair.

How a patched module fuses without touching its ``forward``, and when the fused paths
step aside: docs/architecture.md, "Module design notes", "k3fusion/eager.py".
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from .. import ops, reference
from ..ops import check_rms_norm_args

__all__ = ["fused_qkv_rmsnorm", "RMSNormSpec", "rms_norm_spec", "FusedQKVRMSNorm",
           "patch_model", "PatchReport", "attn_res", "AttnResSpec", "attn_res_spec"]

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
        return (reference.rms_norm(q_c, q_weight, q_eps, q_weight_in_fp32),
                reference.rms_norm(kv_c, kv_weight, kv_eps, kv_weight_in_fp32))
    # Checked here too: the op's schema would turn eps=True into 1.0 and a string eps
    # into a RuntimeError before its own checks run.
    check_rms_norm_args(q_c, q_weight, q_eps, x_name="q_c", w_name="q_weight", eps_name="q_eps")
    check_rms_norm_args(kv_c, kv_weight, kv_eps, x_name="kv_c", w_name="kv_weight", eps_name="kv_eps")
    return torch.ops.k3fusion.dual_rms_norm(q_c, q_weight, q_eps, kv_c, kv_weight, kv_eps,
                                            q_weight_in_fp32, kv_weight_in_fp32)


@dataclass(frozen=True)
class RMSNormSpec:
    """What a norm module computes, in terms of ``k3fusion.reference.rms_norm``."""

    weight: nn.Parameter
    eps: float
    weight_in_fp32: bool


def _declared_spec(module: nn.Module) -> tuple[nn.Parameter, float] | None:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1:
        return None
    if isinstance(module, nn.RMSNorm):
        eps = module.eps if module.eps is not None else torch.finfo(weight.dtype).eps
    else:
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        return None
    return weight, float(eps)


@torch.no_grad()
def rms_norm_spec(module: nn.Module) -> RMSNormSpec | None:
    """The module's RMSNorm formulation, or None if it is not of the standard kind.

    Its weight and eps come from the usual attributes (``weight``; ``variance_epsilon``
    or ``eps``); the formulation is then *verified*: the module must reproduce one of
    the two reference formulations bit for bit on a probe input. Gemma's ``1 + w``,
    or anything else, fails that check and is left alone.
    """
    declared = _declared_spec(module)
    if declared is None:
        return None
    weight, eps = declared
    if weight.device.type == "meta":
        return None
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
    except Exception:  # not callable like a norm: not ours to patch
        return None
    finally:
        weight.data = original
    weight = probe_w
    for weight_in_fp32 in (False, True):
        want = reference.rms_norm(probe, weight, eps, weight_in_fp32)
        if got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want):
            return RMSNormSpec(module.weight, eps, weight_in_fp32)
    return None


class FusedQKVRMSNorm(nn.Module):
    """The q/kv norm pair of one attention module as a single fused call.

    Keeps the original norm modules (their parameters stay where they were).
    """

    def __init__(self, q_norm: nn.Module, kv_norm: nn.Module) -> None:
        super().__init__()
        q_spec, kv_spec = rms_norm_spec(q_norm), rms_norm_spec(kv_norm)
        if q_spec is None:
            raise TypeError(f"q_norm ({type(q_norm).__name__}) is not a standard RMSNorm")
        if kv_spec is None:
            raise TypeError(f"kv_norm ({type(kv_norm).__name__}) is not a standard RMSNorm")
        self.q_norm, self.kv_norm = q_norm, kv_norm
        self._q_fp32, self._kv_fp32 = q_spec.weight_in_fp32, kv_spec.weight_in_fp32
        self._q_eps, self._kv_eps = q_spec.eps, kv_spec.eps

    def forward(self, q_c: torch.Tensor, kv_c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return fused_qkv_rmsnorm(
            q_c, self.q_norm.weight, self._q_eps, kv_c, self.kv_norm.weight, self._kv_eps,
            q_weight_in_fp32=self._q_fp32, kv_weight_in_fp32=self._kv_fp32)


_NO_EPS = object()


def _raw_eps(module: nn.Module):
    """The attribute :func:`_declared_spec` reads eps from, as stored (a cheap check that
    it was not changed after patching)."""
    eps = module.__dict__.get("variance_epsilon", _NO_EPS)
    if eps is _NO_EPS:
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return eps


def _root(t: torch.Tensor) -> torch.Tensor:
    return t if t._base is None else t._base


class _Seen:
    """A tensor as a cached result saw it: its allocation (the view's base, held weakly:
    a freed tensor never matches, whatever reuses its address), the view, and the
    version of the contents (in-place writes through any view of the base bump it)."""

    __slots__ = ("root", "view", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.root = weakref.ref(_root(t))
        self.view = (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)
        self.version = t._version

    def matches(self, x: torch.Tensor) -> bool:
        return (isinstance(x, torch.Tensor) and self.root() is _root(x)
                and x._version == self.version
                and (x.data_ptr(), x.shape, x.stride(), x.dtype, x.device) == self.view)


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


def _records_grad(tensors, modules) -> bool:
    """Autograd would record a graph through these inputs and modules' parameters."""
    if not torch.is_grad_enabled():
        return False
    return (any(t is not None and t.requires_grad for t in tensors)
            or any(p.requires_grad for m in modules for p in m.parameters()))


def _can_fuse(x: torch.Tensor) -> bool:
    """The fused kernels stand in for the modules only where they compute the same thing
    and a later in-place write to an input is visible: not while compiling, autocasting
    or in inference mode (inference tensors keep no version counter)."""
    return not (torch.compiler.is_compiling() or torch.is_inference_mode_enabled()
                or x.is_inference() or torch.is_autocast_enabled(x.device.type))


@dataclass
class _Stash:
    """One prefetch step's results, each handed out at most once, and only to a call
    whose input is the tensor (same base, view and version) the step computed it from,
    with the module's parameters unchanged."""

    hidden: _Seen
    kv_state: _ModuleState
    kv: torch.Tensor | None
    q_c: _Seen
    q_state: _ModuleState
    q_out: torch.Tensor | None
    kv_c: _Seen
    kv_norm_state: _ModuleState
    kv_out: torch.Tensor | None


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
        self._eps_at_patch = (_raw_eps(self.q_norm), _raw_eps(self.kv_norm))
        self.stash: _Stash | None = None

    def install(self) -> None:
        self.q_proj.forward = self.project_q
        self.kv_proj.forward = self.project_kv
        self.q_norm.forward = self.norm_q
        self.kv_norm.forward = self.norm_kv
        for m in self.original:
            m._k3fusion_prefetch = self

    def _fusable(self, x: torch.Tensor) -> bool:
        return (isinstance(x, torch.Tensor) and _can_fuse(x)
                and not _records_grad((x,), self.original))

    def _eps_unchanged(self) -> bool:
        return (_raw_eps(self.q_norm) == self._eps_at_patch[0]
                and _raw_eps(self.kv_norm) == self._eps_at_patch[1])

    def project_q(self, hidden: torch.Tensor) -> torch.Tensor:
        self.stash = None
        q_c = self.original[self.q_proj](hidden)
        if not self._fusable(hidden) or not self._eps_unchanged():
            return q_c
        try:  # the prefetch must not raise where the module would not have been called
            kv = self.original[self.kv_proj](hidden)
        except Exception as e:
            log.debug("k3fusion eager: q/kv prefetch skipped: %s", e)
            return q_c
        kv_c = kv[..., : self.kv_lora]
        try:
            check_rms_norm_args(q_c, self.q_norm.weight, self.fused._q_eps, x_name="q_c")
            check_rms_norm_args(kv_c, self.kv_norm.weight, self.fused._kv_eps, x_name="kv_c")
        except (TypeError, ValueError) as e:  # unusual layout: let the modules run as written
            log.debug("k3fusion eager: q/kv prefetch skipped: %s", e)
            return q_c
        q_out, kv_out = self.fused(q_c, kv_c)
        self.stash = _Stash(_Seen(hidden), _ModuleState(self.kv_proj), kv,
                            _Seen(q_c), _ModuleState(self.q_norm), q_out,
                            _Seen(kv_c), _ModuleState(self.kv_norm), kv_out)
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
                and s.q_state.unchanged() and self._fusable(x) and self._eps_unchanged()):
            out, s.q_out = s.q_out, None
            return out
        return self.original[self.q_norm](x)

    def norm_kv(self, x: torch.Tensor) -> torch.Tensor:
        s = self.stash
        if (s is not None and s.kv_out is not None and s.kv_c.matches(x)
                and s.kv_norm_state.unchanged() and self._fusable(x) and self._eps_unchanged()):
            out, s.kv_out = s.kv_out, None
            if s.q_out is None:
                self.stash = None  # the step is complete; drop the references
            return out
        return self.original[self.kv_norm](x)


#: When a patched module runs its fused kernels, in :attr:`PatchReport.notes`.
FUSED_WHEN = ("patched modules run their fused kernels only where autograd records nothing "
              "(torch.no_grad(), or no input or parameter requires grad), outside autocast "
              "and torch.compile; the q/kv norms also not in torch.inference_mode() (no "
              "version counters). Otherwise the original modules run (docs/eager.md).")


@dataclass
class PatchReport:
    """What :func:`patch_model` did: module names patched, and skipped with the reason;
    ``notes``: when the patched modules fall back to the original ones."""

    patched: list[str]
    skipped: dict[str, str]
    notes: list[str] = field(default_factory=lambda: [FUSED_WHEN])

    def __len__(self) -> int:
        return len(self.patched)


_PAIR_CHILDREN = ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm")


def patch_model(model: nn.Module) -> PatchReport:
    """Switch ``model`` to the fused eager kernels.

    * MLA q/kv norms: a module qualifies when it has ``q_a_proj``, ``q_a_layernorm``, ``kv_a_proj_with_mqa``
    and ``kv_a_layernorm`` children and both norms are of the standard RMSNorm kind
    (verified numerically, see :func:`rms_norm_spec`).
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
    grad) the patched modules run the original ones, so a backward pass is exact; the
    fused kernels have no backward (see ``PatchReport.notes`` and ``docs/eager.md``).

    Idempotent. Returns a :class:`PatchReport` naming what was patched and what was
    skipped and why.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    report = PatchReport([], {})
    for name, module in list(model.named_modules()):
        if _is_latent_moe(module):
            why = _patch_moe_tail(module)
            if why is None:
                report.patched.append(f"{name}.tail" if name else "tail")
            else:
                report.skipped[f"{name}.tail" if name else "tail"] = why
        if callable(getattr(module, "apply_attn_res", None)) and _has_attn_res_child(module):
            why = _patch_attn_res(module)
            if why is None:
                report.patched.append(f"{name}.apply_attn_res" if name else "apply_attn_res")
            else:
                report.skipped[f"{name}.apply_attn_res"] = why
            if isinstance(getattr(module, "attn_res_handoff", None), bool):
                key = f"{name}.attn_res_handoff" if name else "attn_res_handoff"
                if module.attn_res_handoff:
                    report.skipped[key] = "already patched"
                else:
                    module.attn_res_handoff = True
                    report.patched.append(key)
        if not all(hasattr(module, c) for c in _PAIR_CHILDREN[1::2]):
            continue
        if hasattr(module.q_a_layernorm, "_k3fusion_prefetch"):
            report.skipped[name] = "already patched"
            continue
        missing = [c for c in _PAIR_CHILDREN if not isinstance(getattr(module, c, None), nn.Module)]
        if missing:
            report.skipped[name] = f"no {', '.join(missing)} child"
            continue
        try:
            prefetch = _QKVPrefetch(module)
        except TypeError as e:
            report.skipped[name] = str(e)
            continue
        prefetch.install()
        report.patched.append(name)
    return report


# --------------------------------------------------------------------------------------
# AttnRes
# --------------------------------------------------------------------------------------


def attn_res(
    prefix: torch.Tensor,
    blocks: torch.Tensor,
    num_blocks: int,
    norm_w: torch.Tensor,
    proj_w: torch.Tensor,
    eps: float,
    delta: torch.Tensor | None = None,
    block_write_idx: int = -1,
    out_norm_w: torch.Tensor | None = None,
    out_eps: float = 1e-6,
    out_weight_in_fp32: bool = False,
) -> torch.Tensor:
    """One fused AttnRes step with the spec's in-place effects (``k3fusion.reference.attn_res``):
    ``prefix`` is updated in place when ``delta`` is given and ``blocks[:, block_write_idx]``
    is written. Runs the same op (and launch heuristics) as the compiled path.

    Arguments may share memory (the result is the spec's, whose steps read before they
    write); a tensor it writes must not require grad while grad mode is on (RuntimeError,
    as for torch's in-place ops: the op has no backward). See ``docs/eager.md``."""
    if torch.compiler.is_compiling():
        return torch.ops.k3fusion.attn_res_(prefix, blocks, num_blocks, norm_w, proj_w, eps,
                                            delta, block_write_idx, out_norm_w, out_eps,
                                            out_weight_in_fp32)
    return ops.attn_res_(prefix, blocks, num_blocks, norm_w, proj_w, eps, delta, block_write_idx,
                         out_norm_w, out_eps, out_weight_in_fp32)


@dataclass(frozen=True)
class AttnResSpec:
    """What a ``KimiK3AttnRes``-like module computes: key-norm weight/eps and the query."""

    norm_w: torch.Tensor
    eps: float
    proj_w: torch.Tensor


@torch.no_grad()
def attn_res_spec(res: nn.Module) -> AttnResSpec | None:
    """The module's AttnRes parameters, or None if it is not the standard AttnRes mix.

    Standard: a ``norm`` child of the standard RMSNorm kind (:func:`rms_norm_spec`), a
    ``proj`` ``Linear(H, 1)`` without bias, and ``forward(sources [..., S, H])`` that
    computes the reference mix -- verified on a probe, to within the rounding of a
    module that keeps keys and mix in its own dtype.
    """
    norm, proj = getattr(res, "norm", None), getattr(res, "proj", None)
    if not isinstance(norm, nn.Module) or not isinstance(proj, nn.Linear):
        return None
    spec = rms_norm_spec(norm)
    if spec is None or proj.bias is not None or proj.weight.shape != (1, spec.weight.shape[0]):
        return None
    h = spec.weight.shape[0]
    gen = torch.Generator(device="cpu").manual_seed(0)
    probe = torch.randn(4, 3, h, generator=gen).to(spec.weight.device, spec.weight.dtype)
    try:
        got = res(probe)
    except Exception:
        return None
    prefix, blocks = probe[:, -1].clone(), probe[:, :-1].clone()
    want = reference.attn_res(prefix, blocks, 2, spec.weight, proj.weight.view(-1), spec.eps)
    if got.shape != want.shape or got.dtype != want.dtype:
        return None
    # A model-dtype module rounds keys, logits and the mix: a few ulps of its dtype.
    tol = 4 * torch.finfo(want.dtype).eps * float(want.abs().max()) + 1e-6
    if not float((got.float() - want.float()).abs().max()) <= tol:
        return None
    return AttnResSpec(spec.weight, spec.eps, proj.weight)


class _FusedAttnResStep:
    """Replaces a module's ``apply_attn_res(prefix, bank, res, num_blocks, *, delta,
    output_norm, block_write_idx) -> (out, prefix, bank)`` (the K3 contract) with the
    fused kernel; falls back to the original under torch.compile or for non-standard
    modules, so results never depend on what could be fused.
    """

    def __init__(self, original) -> None:
        self.original = original
        # Keyed by the module itself, weakly: an id() could be reused by a later module.
        self._specs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._stacked: tuple[list[_Seen], torch.Tensor] | None = None

    def _spec(self, module: nn.Module | None, fn):
        if module is None:
            return None
        if module not in self._specs:
            self._specs[module] = fn(module) or False
        return self._specs[module]

    def _stack(self, blocks: list[torch.Tensor], prefix: torch.Tensor) -> torch.Tensor:
        """The list bank's blocks as one [..., n, H] tensor, reused while they are the same
        tensors (held weakly), views and versions -- a freed block never matches."""
        if not blocks:
            return prefix.unsqueeze(-2)  # nothing is read from it
        if torch.is_inference_mode_enabled() or any(b.is_inference() for b in blocks):
            self._stacked = None  # no version counters: an in-place edit would go unseen
            return torch.stack(blocks, dim=-2)
        cached = self._stacked
        if (cached is not None and len(cached[0]) == len(blocks)
                and all(seen.matches(b) for seen, b in zip(cached[0], blocks))):
            return cached[1]
        stacked = torch.stack(blocks, dim=-2)
        self._stacked = ([_Seen(b) for b in blocks], stacked)
        return stacked

    @staticmethod
    def _run_original(prefix, bank, res, delta, output_norm) -> bool:
        """Compiling (the graph pass owns this case; probe nothing), autocasting (the
        module's Linear would run in another dtype), or autograd recording."""
        if not isinstance(prefix, torch.Tensor) or torch.compiler.is_compiling():
            return True
        if torch.is_autocast_enabled(prefix.device.type):
            return True
        if not torch.is_grad_enabled():
            return False
        tensors = [prefix, delta, *(bank if isinstance(bank, list) else [bank])]
        return _records_grad(tensors, [m for m in (res, output_norm) if isinstance(m, nn.Module)])

    def __call__(self, prefix, bank, res, num_blocks, *, delta=None, output_norm=None,
                 block_write_idx=-1):
        if self._run_original(prefix, bank, res, delta, output_norm):
            return self.original(prefix, bank, res, num_blocks, delta=delta,
                                 output_norm=output_norm, block_write_idx=block_write_idx)
        res_spec = self._spec(res, attn_res_spec)
        out_spec = self._spec(output_norm, rms_norm_spec)
        if not res_spec or (output_norm is not None and not out_spec):
            return self.original(prefix, bank, res, num_blocks, delta=delta,
                                 output_norm=output_norm, block_write_idx=block_write_idx)
        out_w, out_eps, out_fp32 = ((out_spec.weight, out_spec.eps, out_spec.weight_in_fp32)
                                    if out_spec else (None, 1e-6, False))
        norm_w, eps, proj_w = res_spec.norm_w, res_spec.eps, res_spec.proj_w.view(-1)
        if isinstance(bank, torch.Tensor) and delta is None:
            # The kernel writes the block in place; the prefix is not modified.
            out = torch.ops.k3fusion.attn_res_(prefix, bank, num_blocks, norm_w, proj_w, eps,
                                               None, block_write_idx, out_w, out_eps, out_fp32)
            return out, prefix, bank
        # A delta makes a new prefix (the caller's tensor may be referenced elsewhere,
        # e.g. as a block of a list bank): the functional op returns it.
        blocks = self._stack(bank[:num_blocks], prefix) if isinstance(bank, list) else bank
        res_out = torch.ops.k3fusion.attn_res(prefix, blocks, num_blocks, norm_w, proj_w, eps,
                                              delta, out_w, out_eps, out_fp32)
        out = res_out[0]
        if delta is not None:
            prefix = res_out[1]
        if block_write_idx >= 0:
            if isinstance(bank, list):
                bank = bank + [prefix]
            else:
                bank[..., block_write_idx, :] = prefix
        return out, prefix, bank


def _has_attn_res_child(module: nn.Module) -> bool:
    """A direct child shaped like an AttnRes module (a ``norm`` and a ``Linear(H, 1)``)."""
    return any(isinstance(getattr(c, "norm", None), nn.Module)
               and isinstance(getattr(c, "proj", None), nn.Linear)
               and c.proj.out_features == 1 for c in module.children())


def _patch_attn_res(module: nn.Module) -> str | None:
    """Swap ``module.apply_attn_res`` for the fused step; None, or why it was skipped."""
    if getattr(module, "_k3fusion_attn_res", None) is not None:
        return "already patched"
    step = _FusedAttnResStep(module.apply_attn_res)
    module.apply_attn_res = step
    module._k3fusion_attn_res = step
    return None


# --------------------------------------------------------------------------------------
# Latent-MoE tail
# --------------------------------------------------------------------------------------

__all__ += ["MoETailRunner", "moe_tail_runners"]

from ..config import get_config  # noqa: E402


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
    registering it, so a patched model's ``state_dict`` keys do not change.
    """

    def __init__(self, norm: nn.Module, up_proj: nn.Module, group=None, *, tier=None) -> None:
        super().__init__()
        from .. import moe_tail

        spec = rms_norm_spec(norm)
        if spec is None:
            raise TypeError(f"norm ({type(norm).__name__}) is not a standard RMSNorm")
        if not isinstance(up_proj, nn.Linear) or up_proj.bias is not None:
            raise TypeError("up_proj must be an nn.Linear without bias")
        if up_proj.in_features != spec.weight.shape[0]:
            raise ValueError(f"up_proj takes {up_proj.in_features} features but norm is "
                             f"{spec.weight.shape[0]} wide")
        self.norm, self.up_proj, self.group = norm, up_proj, group
        self._eps, self._weight_in_fp32 = spec.eps, spec.weight_in_fp32
        self.tier = None if tier is None else moe_tail._as_tier(tier)
        self.last_tier = None
        # Load the config now (reads the environment): a first load inside a compiled
        # region would not trace.
        get_config()
        self.tier_counts: dict[str, int] = {}

    def forward(self, routed_latent: torch.Tensor, shared: torch.Tensor, *,
                donate_shared: bool = False) -> torch.Tensor:
        """Per-rank partials ``routed_latent [..., L]``, ``shared [..., H]`` -> ``[..., H]``.
        ``donate_shared``: ``shared`` is a temporary the tail may overwrite."""
        from .. import moe_tail

        y, tier = moe_tail.run_latent_moe_tail(
            routed_latent, shared, self.norm.weight, self._eps, self.up_proj.weight, self.group,
            weight_in_fp32=self._weight_in_fp32, tier=self.tier, donate_shared=donate_shared)
        if not torch.compiler.is_compiling():
            self.last_tier = tier
            self.tier_counts[tier.value] = self.tier_counts.get(tier.value, 0) + 1
        return y

    def extra_repr(self) -> str:
        return f"tier={'auto' if self.tier is None else self.tier.value}"


class _MoETailStep:
    """Replaces a latent MoE's ``tail(routed_latent, shared)``: the module's partials are
    its own temporaries, so the runner may accumulate into ``shared``."""

    def __init__(self, runner: MoETailRunner, original) -> None:
        self.runner, self.original = runner, original

    def __call__(self, routed_latent, shared):
        if _records_grad((routed_latent, shared), (self.runner.norm, self.runner.up_proj)):
            return self.original(routed_latent, shared)  # the fused tiers have no backward
        return self.runner(routed_latent, shared, donate_shared=True)


def _is_latent_moe(module: nn.Module) -> bool:
    """The K3 latent-MoE contract: ``latent_norm`` and ``up_proj`` children, a ``tail``
    method, and a ``tp_group`` attribute (None at tp=1)."""
    return (isinstance(getattr(module, "latent_norm", None), nn.Module)
            and isinstance(getattr(module, "up_proj", None), nn.Module)
            and callable(getattr(module, "tail", None)) and hasattr(module, "tp_group"))


def _patch_moe_tail(module: nn.Module) -> str | None:
    """Swap ``module.tail`` for a :class:`MoETailRunner` step; None, or why skipped."""
    if getattr(module, "_k3fusion_moe_tail", None) is not None:
        return "already patched"
    try:
        runner = MoETailRunner(module.latent_norm, module.up_proj, module.tp_group)
    except (TypeError, ValueError) as e:
        return str(e)
    # Through __dict__: nn.Module.__setattr__ would register the runner as a child.
    module.__dict__["tail"] = _MoETailStep(runner, module.tail)
    module.__dict__["_k3fusion_moe_tail"] = runner
    return None


def moe_tail_runners(model: nn.Module) -> dict[str, MoETailRunner]:
    """``{module name: runner}`` for every latent-MoE tail :func:`patch_model` patched."""
    return {name: m.__dict__["_k3fusion_moe_tail"] for name, m in model.named_modules()
            if m.__dict__.get("_k3fusion_moe_tail") is not None}
