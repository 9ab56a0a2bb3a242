"""``torch.compile(model, backend="k3fusion")``: Inductor plus the k3fusion post-grad pass.

Registered through the ``torch_dynamo_backends`` entry point, so it needs no import.
:func:`install` instead adds the pass to every plain ``backend="inductor"`` compile.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._inductor import config as inductor_config
from torch._inductor import list_mode_options

from .pass_manager import K3FusionPass, K3JointPass, compose_with

__all__ = ["k3fusion_backend", "install", "uninstall"]


def k3fusion_backend(gm: torch.fx.GraphModule, example_inputs, *, mode: str | None = None,
                     options: dict[str, Any] | None = None, **kwargs):
    """A dynamo backend: ``compile_fx`` with the k3fusion pass after the user's own.

    ``mode`` and ``options`` mean what they mean for ``backend="inductor"``.
    """
    # Here, not at the top: importing compile_fx is slow (``import k3fusion``'s startup)
    # and only a compile needs it.
    from torch._inductor.compile_fx import compile_fx

    if kwargs:
        raise TypeError(f"k3fusion backend got unexpected arguments: {sorted(kwargs)}")
    patches: dict[str, Any] = {}
    if mode not in (None, "default"):
        patches.update(list_mode_options(mode))
    if options:
        if not isinstance(options, dict):
            raise TypeError(f"options must be a dict, got {type(options).__name__}")
        patches.update(options)
    user_pass = patches.get("post_grad_custom_post_pass", inductor_config.post_grad_custom_post_pass)
    patches["post_grad_custom_post_pass"] = compose_with(user_pass)
    user_joint = patches.get("joint_custom_pre_pass", inductor_config.joint_custom_pre_pass)
    patches["joint_custom_pre_pass"] = compose_with(user_joint, K3JointPass())
    return compile_fx(gm, example_inputs, config_patches=patches)


#: The Inductor settings install() composes with, and the pass it adds to each.
_HOOKS = (("post_grad_custom_post_pass", K3FusionPass), ("joint_custom_pre_pass", K3JointPass))

#: One record per effective :func:`install`, per setting it changed: (what was there, what
#: install put there, k3fusion's own pass, the installed list's contents when it was a list).
_previous: list[dict[str, tuple[Any, Any, K3FusionPass, list | None]]] = []


def install() -> None:
    """Add the k3fusion passes to every ``backend="inductor"`` compile in this process: the
    post-grad pass, and the joint-graph pass that fuses training compiles' forwards.

    Composes with a ``post_grad_custom_post_pass`` / ``joint_custom_pre_pass`` already set
    (that one runs first). Idempotent; :func:`uninstall` takes them out again. A pass you
    set *after* install() replaces the composition (torch's config holds one value): set
    yours first, or set ``k3fusion.pass_manager.compose_with(yours)`` to keep both.
    """
    records = {}
    for key, make in _HOOKS:
        current = getattr(inductor_config, key)
        ours = make()
        composed = compose_with(current, ours)
        if composed is not current:
            records[key] = (current, composed, ours,
                            list(composed) if isinstance(composed, list) else None)
            setattr(inductor_config, key, composed)
    if records:
        _previous.append(records)


def _as_items(p) -> list:
    if p is None:
        return []
    return list(p) if isinstance(p, (list, tuple)) else [p]


def _without(current, previous, installed, ours, snapshot):
    """``current`` with what :func:`install` added taken out; everything else kept."""
    if current is installed and (snapshot is None or list(current) == snapshot):
        return previous  # untouched since install: exactly what was there before
    if isinstance(current, (list, tuple)):
        items, found = [], False
        for p in current:
            if p is installed or p is ours:
                found = True
                if p is installed:
                    items += _as_items(previous)
            else:
                items.append(p)
        if current is installed:  # our list, extended in place: keep the user's additions
            items = [p for p in current if p is not ours]
            found = True
        return type(current)(items) if found else current
    return current  # the user replaced the pass since: theirs stays


def uninstall() -> None:
    """Undo :func:`install` (no-op when not installed): restores what was there before,
    and leaves a pass set or added since in place (only k3fusion's passes go)."""
    if _previous:
        for key, (previous, installed, ours, snapshot) in _previous.pop().items():
            setattr(inductor_config, key, _without(getattr(inductor_config, key), previous,
                                                   installed, ours, snapshot))
