"""When a patched module may hand out a fused or cached result instead of running itself.

Shared by the q/kv prefetch and the AttnRes step: a tensor as a result saw it
(:class:`SeenTensor`), and whether autograd would record a graph (the fused kernels have
no backward, so the original modules run then).
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["SeenTensor", "records_grad", "transforms_active"]


def _root(t: torch.Tensor) -> torch.Tensor:
    return t if t._base is None else t._base


class SeenTensor:
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


def transforms_active() -> bool:
    """A ``torch.func`` transform (``grad``, ``vmap``, ``jacrev``, ...) is running: its
    wrapped tensors reach the modules, and the fused path's checks (the norm probe draws
    random rows, reads ``.data``) and ops (no batching rule) do not work on them."""
    return torch._C._are_functorch_transforms_active()


def records_grad(tensors, modules) -> bool:
    """Autograd would record a graph through these inputs and modules' parameters."""
    if not torch.is_grad_enabled():
        return False
    return (any(t is not None and t.requires_grad for t in tensors)
            or any(p.requires_grad for m in modules for p in m.parameters()))
