"""Autograd for the functional custom ops: the backward of their plain-torch formulas
(``k3fusion.reference``), recomputed from the inputs saved at the call, or a fused
backward op where one exists (AttnRes).

Recomputing rather than saving intermediates keeps the forward kernels unchanged and the
saved state to the inputs; the gradient is the reference's, whatever kernel ran forward
(docs/ops.md, "Gradients"). Ops that write into their inputs (``attn_res_``,
``rms_norm_and_copy``) have none: torch refuses them while autograd records.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["differentiate_by_reference"]


def _flat(values) -> list:
    out = []
    for v in values:
        out.extend(_flat(v) if isinstance(v, (list, tuple)) else [v])
    return out


def differentiate_by_reference(op, formula: Callable, fused: Callable | None = None) -> None:
    """Register autograd for custom op ``op``: ``formula`` takes the op's arguments (in
    schema order) and computes what the op returns with differentiable torch ops.

    ``fused(args, grads)`` (optional) computes the gradients of every argument directly
    (a list in schema order, None where there is none), or returns None where it does not
    apply; it is not used under ``create_graph`` (its result would not be differentiable).
    """

    def setup_context(ctx, inputs, output) -> None:
        ctx.positions = [i for i, a in enumerate(inputs) if isinstance(a, torch.Tensor)]
        ctx.others = [None if isinstance(a, torch.Tensor) else a for a in inputs]
        ctx.save_for_backward(*(inputs[i] for i in ctx.positions))

    def backward(ctx, *grads):
        args, wanted = list(ctx.others), []
        # Grad mode is on inside a backward only under create_graph (a double backward):
        # then the formula runs on the saved inputs themselves, so the gradients it returns
        # carry their graph back to those inputs and to ``grads``.
        create_graph = torch.is_grad_enabled()
        # The dispatcher drops trailing arguments equal to their defaults: gradients are
        # returned for the arguments it passed, which ``needs_input_grad`` lists.
        passed = len(ctx.needs_input_grad)
        for i, t in zip(ctx.positions, ctx.saved_tensors):
            want = i < passed and ctx.needs_input_grad[i] and t.is_floating_point()
            if not create_graph:
                t = t.detach().requires_grad_(want)
            if want:
                wanted.append(i)
            args[i] = t
        result = [None] * passed
        if not wanted:
            return tuple(result)
        if fused is not None and not create_graph:
            found = fused(args, _flat(grads))
            if found is not None:
                for i in wanted:
                    result[i] = found[i]
                return tuple(result)
        with torch.enable_grad():
            outs = _flat([formula(*args)])
        pairs = [(o, g) for o, g in zip(outs, _flat(grads))
                 if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
        if not pairs:
            return tuple(result)
        found = torch.autograd.grad([o for o, _ in pairs], [args[i] for i in wanted],
                                    [g for _, g in pairs], allow_unused=True,
                                    create_graph=create_graph)
        for i, g in zip(wanted, found):
            result[i] = g
        return tuple(result)

    op.register_autograd(backward, setup_context=setup_context)
