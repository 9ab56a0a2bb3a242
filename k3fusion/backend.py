"""``torch.compile(model, backend="k3fusion")``: Inductor plus the k3fusion post-grad pass.

Registered through the ``torch_dynamo_backends`` entry point, so it needs no import.
:func:`install` instead adds the pass to every plain ``backend="inductor"`` compile.
"""

from __future__ import annotations

from typing import Any

import torch

from .pass_manager import K3FusionPass, compose_with

__all__ = ["k3fusion_backend", "install", "uninstall"]


def k3fusion_backend(gm: torch.fx.GraphModule, example_inputs, *, mode: str | None = None,
                     options: dict[str, Any] | None = None, **kwargs):
    """A dynamo backend: ``compile_fx`` with the k3fusion pass after the user's own.

    ``mode`` and ``options`` mean what they mean for ``backend="inductor"``.
    """
    from torch._inductor import config as inductor_config
    from torch._inductor import list_mode_options
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
    return compile_fx(gm, example_inputs, config_patches=patches)


_previous: list[Any] = []


def install() -> None:
    """Add the k3fusion pass to every ``backend="inductor"`` compile in this process.

    Composes with a ``post_grad_custom_post_pass`` already set (that one runs first).
    Idempotent; :func:`uninstall` restores what was there.
    """
    from torch._inductor import config as inductor_config

    current = inductor_config.post_grad_custom_post_pass
    composed = compose_with(current, K3FusionPass())
    if composed is not current:
        _previous.append(current)
        inductor_config.post_grad_custom_post_pass = composed


def uninstall() -> None:
    """Undo :func:`install` (no-op when not installed)."""
    from torch._inductor import config as inductor_config

    if _previous:
        inductor_config.post_grad_custom_post_pass = _previous.pop()
