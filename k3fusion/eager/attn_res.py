"""Eager AttnRes: :func:`attn_res` (one fused step, the spec's in-place effects) and the
fused ``apply_attn_res`` step :func:`k3fusion.eager.patch_model` installs.

A module qualifies when it has the K3 ``apply_attn_res`` contract and a child shaped like
an AttnRes module; each call checks that its AttnRes and output-norm modules are of the
standard kind (:func:`attn_res_spec`, verified on a probe, again whenever their weights,
eps, dtype or children change) and otherwise runs the original.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from .. import ops, reference
from ..patterns.attn_res import FUSION_NAME
from ._guards import records_grad, SeenTensor, transforms_active
from ._norm_spec import CheckedSpec, rms_norm_spec
from .patcher import Patcher


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
    fused kernel. The original step runs under torch.compile, for modules that are not
    standard, and for calls the op cannot express (counted in :attr:`fallbacks`): results
    never depend on what could be fused. While autograd records, the functional op runs
    (its backward the fused one where the kernels run).
    """

    def __init__(self, original) -> None:
        self.original = original
        # Keyed by the module itself, weakly: an id() could be reused by a later module.
        self._specs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._stacked: tuple[list[SeenTensor], torch.Tensor] | None = None
        #: {reason: calls} that ran the original step although the module is standard
        self.fallbacks: dict[str, int] = {}

    def _spec(self, module: nn.Module | None, fn):
        """The module's spec, derived again when its weights, eps, dtype or children
        change (:class:`CheckedSpec`); None for no module, False for a non-standard one."""
        if module is None:
            return None
        checked = self._specs.get(module)
        if checked is None:
            checked = self._specs[module] = CheckedSpec(fn)
        return checked.get(module) or False

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
        self._stacked = ([SeenTensor(b) for b in blocks], stacked)
        return stacked

    @staticmethod
    def _run_original(prefix) -> bool:
        """Compiling (the graph pass owns this case; probe nothing), a ``torch.func``
        transform, or autocasting (the module's Linear would run in another dtype)."""
        if (not isinstance(prefix, torch.Tensor) or torch.compiler.is_compiling()
                or transforms_active()):
            return True
        return torch.is_autocast_enabled(prefix.device.type)

    @staticmethod
    def _records_grad(prefix, bank, res, delta, output_norm) -> bool:
        tensors = [prefix, delta, *(bank if isinstance(bank, list) else [bank])]
        return records_grad(tensors, [m for m in (res, output_norm) if isinstance(m, nn.Module)])

    @staticmethod
    def _weights_are_parameters(res, output_norm, res_spec, out_spec) -> bool:
        """The spec's weights are the modules' own tensors, so gradients reach them."""
        return (res_spec.norm_w is res.norm.weight and res_spec.proj_w is res.proj.weight
                and (output_norm is None or out_spec.weight is output_norm.weight))

    def _step_with_grad(self, prefix, bank, num_blocks, block_write_idx, delta, args):
        """The functional op, whose backward is the fused one where its kernels run, in the
        original step's order of effects (its block write before the mix, so autograd
        saves what the mix read). Nothing is cached: a stack kept from an earlier call
        would carry that call's graph."""
        if delta is not None:
            prefix = prefix + delta
        if block_write_idx >= 0:
            if isinstance(bank, list):
                bank = bank + [prefix]
            else:
                bank[..., block_write_idx, :] = prefix
        if isinstance(bank, list):
            blocks = (torch.stack(bank[:num_blocks], dim=-2) if num_blocks
                      else prefix.unsqueeze(-2))
        else:
            # A copy of the live slots, as the original's cat makes: a later write into
            # the bank must not change what this step's backward reads.
            blocks = bank[..., :num_blocks, :].clone()
        out = torch.ops.k3fusion.attn_res(prefix, blocks, num_blocks, *args)[0]
        return out, prefix, bank

    @staticmethod
    def _inexpressible(bank, num_blocks, block_write_idx) -> str | None:
        """A call of the K3 contract the fused op cannot express, or None."""
        if isinstance(bank, list):
            if num_blocks > len(bank):  # the sources would include the block written now
                return "list bank shorter than num_blocks"
        elif isinstance(bank, torch.Tensor) and 0 <= block_write_idx < num_blocks:
            return "block written over a live source (a ring-buffer bank)"
        return None

    def _fall_back(self, why: str, *args, **kwargs):
        self.fallbacks[why] = self.fallbacks.get(why, 0) + 1
        return self.original(*args, **kwargs)

    def __call__(self, prefix, bank, res, num_blocks, *, delta=None, output_norm=None,
                 block_write_idx=-1):
        call = dict(delta=delta, output_norm=output_norm, block_write_idx=block_write_idx)
        if self._run_original(prefix):
            return self.original(prefix, bank, res, num_blocks, **call)
        res_spec = self._spec(res, attn_res_spec)
        out_spec = self._spec(output_norm, rms_norm_spec)
        if not res_spec or (output_norm is not None and not out_spec):
            return self.original(prefix, bank, res, num_blocks, **call)
        why = self._inexpressible(bank, num_blocks, block_write_idx)
        if why is not None:
            return self._fall_back(why, prefix, bank, res, num_blocks, **call)
        out_w, out_eps, out_fp32 = ((out_spec.weight, out_spec.eps, out_spec.weight_in_fp32)
                                    if out_spec else (None, 1e-6, False))
        norm_w, eps, proj_w = res_spec.norm_w, res_spec.eps, res_spec.proj_w.view(-1)
        if self._records_grad(prefix, bank, res, delta, output_norm):
            if not self._weights_are_parameters(res, output_norm, res_spec, out_spec):
                return self._fall_back("weights derived from the parameters under autograd",
                                       prefix, bank, res, num_blocks, **call)
            if delta is not None and delta.dtype != prefix.dtype:
                return self._fall_back("delta of another dtype under autograd",
                                       prefix, bank, res, num_blocks, **call)
            return self._step_with_grad(prefix, bank, num_blocks, block_write_idx, delta,
                                        (norm_w, proj_w, eps, None, out_w, out_eps, out_fp32))
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


def has_attn_res_step(module: nn.Module) -> bool:
    """The K3 contract: an ``apply_attn_res`` method and an AttnRes-shaped child."""
    return callable(getattr(module, "apply_attn_res", None)) and _has_attn_res_child(module)


def _has_attn_res_child(module: nn.Module) -> bool:
    """A direct child shaped like an AttnRes module (a ``norm`` and a ``Linear(H, 1)``)."""
    return any(isinstance(getattr(c, "norm", None), nn.Module)
               and isinstance(getattr(c, "proj", None), nn.Linear)
               and c.proj.out_features == 1 for c in module.children())


def _swap_step(module: nn.Module) -> str | None:
    """Swap ``module.apply_attn_res`` for the fused step; None, or why it was skipped."""
    if getattr(module, "_k3fusion_attn_res", None) is not None:
        return "already patched"
    step = _FusedAttnResStep(module.apply_attn_res)
    module.apply_attn_res = step
    module._k3fusion_attn_res = step
    return None


def patch_attn_res(name: str, module: nn.Module) -> list[tuple[str, str | None]]:
    """Install the fused step, then turn on the delta hand-off where the module has a bool
    ``attn_res_handoff``: ``[(report key, None if patched else why skipped)]``."""
    why = _swap_step(module)
    if why is None:
        entries = [(f"{name}.apply_attn_res" if name else "apply_attn_res", None)]
    else:  # a skipped root module reads ".apply_attn_res", as it always has
        entries = [(f"{name}.apply_attn_res", why)]
    if isinstance(getattr(module, "attn_res_handoff", None), bool):
        key = f"{name}.attn_res_handoff" if name else "attn_res_handoff"
        if module.attn_res_handoff:
            entries.append((key, "already patched"))
        else:
            module.attn_res_handoff = True
            entries.append((key, None))
    return entries


#: Tried on a module after the MoE tail's patcher, before the q/kv one.
PATCHER = Patcher(FUSION_NAME, has_attn_res_step, patch_attn_res, order=1)
