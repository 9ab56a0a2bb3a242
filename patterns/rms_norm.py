"""Recognize every RMSNorm formulation in a post-grad graph as one canonical description.

The forms users write all lower to the same aten skeleton around one ``rsqrt``::

    x32      = x.to(float32)                   # absent when x is already fp32
    inv_rms  = rsqrt(mean(x32 ** 2, -1, keepdim=True) + eps)   # or x32 * x32
    normed   = x32 * inv_rms                   # either operand order
               # or x32 / sqrt(mean(...) + eps): the RMSNorm classes written from scratch
    cast-then-weight (HF, vLLM forward_native):   y = normed.to(x.dtype) * w
    weight-in-fp32 (F.rms_norm, nn.RMSNorm, ...): y = (normed * w.float()).to(x.dtype)

The pattern matcher of Inductor does no algebra, so instead of one traced pattern per
variant (pow vs. mul, operand order, dtype, dim -1 vs. ndim-1, add.Tensor vs. add.Scalar)
this module walks outward from each ``rsqrt`` (and each ``sqrt`` that a row is divided by)
and accepts exactly the variants above.

What it returns and what it refuses (near misses): docs/design-notes.md, "patterns/rms_norm.py".
"""

from __future__ import annotations

from typing import Optional

from dataclasses import dataclass, field
from numbers import Real

import torch
from torch.fx import Graph, Node

from k3fusion.reference import FLOAT_DTYPES, rms_norm_out_dtype

from ._fx import (NoMatch, aten, dtype_of, external_users, is_graph_input, is_op, only_user,
                  operands, prims, val)

__all__ = ["RMSNormMatch", "RMSNormRejection", "find_rms_norms", "match_rms_norm",
           "ANCHORS", "anchor_name", "starts_rms_norm", "divided_by_sqrt", "inverse_rms",
           "upcast_input", "parameter_weight", "derived_from_input", "same_input",
           "eps_op_args"]

_ADD = (aten.add.Tensor, aten.add.Scalar)
_MUL = (aten.mul.Tensor,)
_CAST = (prims.convert_element_type.default,)


@dataclass
class RMSNormMatch:
    """One recognized RMSNorm: ``out = rms_norm(x, weight, eps, weight_in_fp32)``.

    ``eps`` is a float, or the node of a 0-dim CPU tensor graph input holding it.
    """

    x: Node
    weight: Node
    eps: float | Node
    weight_in_fp32: bool
    out: Node
    #: Every node that computes ``out`` from ``x`` and ``weight`` (``out`` included).
    nodes: list[Node] = field(repr=False)
    #: Set when ``x`` is fp32 but the normalized value is cast to this 16-bit dtype
    #: (cast-then-weight): ``out = rms_norm(x, weight, eps, norm_dtype=x_round)``. Either a
    #: T5-style norm of a real fp32 input, or ``rms_norm(x.to(bf16))`` after Inductor
    #: removed the round trip as a pointless convert (it does on GPUs, e.g. for a latent
    #: accumulated in fp32); the graph cannot tell which, so a fusion that takes such a
    #: norm must compute exactly this form.
    x_round: Optional[torch.dtype] = None

    @property
    def width(self) -> int:
        return int(val(self.x).shape[-1])


@dataclass
class RMSNormRejection:
    """An ``rsqrt`` (or ``sqrt(variance + eps)``) that looked like the start of an RMSNorm
    but is not one we can fuse."""

    anchor: Node
    reason: str


#: Where a norm is anchored: ``x32 * rsqrt(variance + eps)`` or ``x32 / sqrt(variance + eps)``.
ANCHORS = (aten.rsqrt.default, aten.sqrt.default)


def anchor_name(anchor: Node) -> str:
    """``"rsqrt"`` or ``"sqrt"``: how the log lines name an anchor."""
    return "sqrt" if is_op(anchor, aten.sqrt.default) else "rsqrt"


def divided_by_sqrt(node: object) -> tuple[Node, Node] | None:
    """``row / sqrt(...)`` -> (row, the sqrt); None for anything else (what the sqrt
    computes is :func:`inverse_rms`'s to check)."""
    if (is_op(node, aten.div.Tensor) and is_op(node.args[1], aten.sqrt.default)
            and node.args[0] is not node.args[1]):
        return node.args[0], node.args[1]
    return None


def starts_rms_norm(node: object) -> bool:
    """``node`` is an anchor (:data:`ANCHORS`) of ``mean(x**2, -1) + eps``: the start of an
    RMSNorm, whether or not the rest is one a fusion takes."""
    if not is_op(node, *ANCHORS):
        return False
    try:
        inverse_rms(node)
    except (NoMatch, AttributeError, TypeError, IndexError):  # any op's arguments
        return False
    return True


def inverse_rms(rsqrt: Node, *, any_float: bool = False) -> tuple[Node, float | Node, list[Node]]:
    """``rsqrt(mean(x32**2, -1, keepdim=True) + eps)`` (or the ``sqrt`` a row is divided
    by) -> (x32, eps, nodes). ``x32`` is fp32 unless ``any_float`` (a norm computed in a
    16-bit dtype: the AttnRes key norm, whose keys only steer the softmax)."""
    add = rsqrt.args[0]
    if not is_op(add, *_ADD) or add.kwargs.get("alpha", 1) != 1:
        raise NoMatch(f"{anchor_name(rsqrt)} input is not `variance + eps`")
    mean, eps = add.args
    if not is_op(mean, aten.mean.dim):  # eps + variance
        mean, eps = eps, mean
    eps = _eps(eps)
    if not is_op(mean, aten.mean.dim):
        raise NoMatch("variance is not a mean")
    square, dims = mean.args[0], mean.args[1]
    keepdim = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
    if mean.kwargs.get("dtype") is not None:
        raise NoMatch("mean has a dtype argument")
    ndim = val(square).dim()
    if not keepdim or len(dims) != 1 or dims[0] not in (-1, ndim - 1):
        raise NoMatch(f"mean over dims {list(dims)} keepdim={keepdim}, not the last dim")
    if is_op(square, aten.pow.Tensor_Scalar) and square.args[1] == 2:
        x32 = square.args[0]
    elif is_op(square, *_MUL) and square.args[0] is square.args[1]:
        x32 = square.args[0]
    else:
        raise NoMatch("variance does not square its input")
    if dtype_of(x32) != torch.float32 and not (any_float and dtype_of(x32) in (
            torch.bfloat16, torch.float16)):
        raise NoMatch(f"sum of squares is computed in {dtype_of(x32)}, not float32")
    return x32, eps, [square, mean, add, rsqrt]


def _eps(node: object) -> float | Node:
    """eps as a constant, or as the 0-dim graph input ``torch.compile(dynamic=True)``
    makes of a module's float attribute (read through its cast to fp32)."""
    if isinstance(node, Real) and not isinstance(node, bool):
        return float(node)
    # The cast is not part of the match: one cast node may serve several norms (CSE),
    # and once unused it is dead code Inductor drops.
    scalar = node.args[0] if is_op(node, *_CAST) and node.args[1] == torch.float32 else node
    if (isinstance(scalar, Node) and scalar.op == "placeholder"
            and isinstance(val(scalar), torch.Tensor) and val(scalar).dim() == 0
            and val(scalar).dtype.is_floating_point and val(scalar).device.type == "cpu"):
        return scalar
    raise NoMatch("eps is neither a constant nor a scalar graph input")


def upcast_input(x32: Node) -> tuple[Node, list[Node]]:
    """The tensor before its fp32 upcast (x32 itself for an fp32 input)."""
    if is_op(x32, *_CAST):
        x = x32.args[0]
        if dtype_of(x) not in (torch.bfloat16, torch.float16):
            raise NoMatch(f"upcast from {dtype_of(x)}")
        return x, [x32]
    return x32, []


def same_input(operand: object, x32: Node) -> list[Node]:
    """Check that ``operand`` is the norm's input, as ``x32`` or another spelling of it:
    the un-upcast input (``x * rsqrt(...)``, T5 style: promotion makes it fp32, exactly),
    or a second ``x.float()`` of it. Returns the extra nodes to count as the norm's."""
    if operand is x32:
        return []
    x, upcast = upcast_input(x32)
    if upcast and operand is x:
        return []
    if (upcast and is_op(operand, *_CAST) and operand.args[0] is x
            and operand.args[1] == torch.float32):
        return [operand]
    raise NoMatch("rsqrt is not multiplied with the input")


#: Ops that derive a weight from a parameter without arithmetic: a row ``w[i]`` of a stacked
#: parameter, a view, a cast (the op then reads the cast value, exactly what eager uses).
_DERIVING = (aten.select.int, aten.view.default, aten.reshape.default, aten._unsafe_view.default,
             aten.squeeze.dim, aten.squeeze.default, aten.unsqueeze.default, *_CAST)


def derived_from_input(node: object) -> bool:
    """``node`` is a graph input, or a row, view or cast of one (no arithmetic)."""
    while is_op(node, *_DERIVING):
        if any(isinstance(a, Node) for a in node.args[1:]):
            return False
        node = node.args[0]
    return is_graph_input(node)


def parameter_weight(node: object, *, allow_upcast: bool) -> tuple[Node, list[Node]]:
    """A norm weight: a parameter, optionally through an exact ``.float()`` upcast (the op
    then reads the parameter, its formulation says fp32), or a row / view / cast of one
    (``w[i]``, ``w.to(x.dtype)``: the op reads that value as it is)."""
    if allow_upcast and is_op(node, *_CAST) and node.args[1] == torch.float32 \
            and is_graph_input(node.args[0]):
        param, nodes = parameter_weight(node.args[0], allow_upcast=False)
        return param, nodes + [node]
    if not derived_from_input(node):
        what = node.target if isinstance(node, Node) and node.op == "call_function" else node
        raise NoMatch(f"weight is computed in the graph ({what}), not a parameter")
    w = val(node)
    if w.dim() != 1 or w.dtype not in FLOAT_DTYPES:
        raise NoMatch(f"weight has shape {tuple(w.shape)} and dtype {w.dtype}")
    return node, []


def match_rms_norm(rsqrt: Node) -> RMSNormMatch:
    """Describe the RMSNorm anchored at ``rsqrt``; raise :class:`NoMatch` saying why not."""
    x32, eps, nodes = inverse_rms(rsqrt)
    x, upcast = upcast_input(x32)
    nodes += upcast
    x_dtype = dtype_of(x)

    normed = only_user(rsqrt)
    if is_op(rsqrt, aten.sqrt.default):
        # x32 / sqrt(...): the same function; the op's rsqrt-and-multiply differs from the
        # division in the last fp32 place, below any 16-bit output's rounding
        row, sqrt = divided_by_sqrt(normed) or (None, None)
        if sqrt is not rsqrt:
            raise NoMatch("the input is not divided by sqrt")
        nodes += same_input(row, x32) + [normed]
    elif not is_op(normed, *_MUL):
        raise NoMatch("rsqrt is not multiplied with the input")
    else:
        nodes += same_input(operands(normed, rsqrt), x32) + [normed]

    step = only_user(normed)
    x_round = None
    if is_op(step, *_CAST):
        # cast-then-weight: normed.to(x.dtype) * w
        if step.args[1] != x_dtype:
            if x_dtype != torch.float32 or step.args[1] not in (torch.bfloat16, torch.float16):
                raise NoMatch(f"normalized value cast to {step.args[1]}, input is {x_dtype}")
            # An fp32 input whose 16-bit round trip Inductor removed (see x_round).
            x_round = x_dtype = step.args[1]
        out = only_user(step)
        if not is_op(out, *_MUL):
            raise NoMatch("cast normalized value is not multiplied by a weight")
        weight, w_nodes = parameter_weight(operands(out, step), allow_upcast=False)
        nodes += [step, *w_nodes, out]
        weight_in_fp32 = False
    elif is_op(step, *_MUL):
        # weight-in-fp32: (normed * w.float()).to(x.dtype); no cast when x is fp32
        weight, w_nodes = parameter_weight(operands(step, normed), allow_upcast=True)
        nodes += [*w_nodes, step]
        out = step
        if x_dtype != torch.float32:
            out = only_user(step)
            if not is_op(out, *_CAST) or out.args[1] != x_dtype:
                raise NoMatch(f"weighted value is not cast back to {x_dtype}")
            nodes.append(out)
        weight_in_fp32 = True
    else:
        raise NoMatch(f"normalized value feeds {step.target}, not a weight multiply")

    w = val(weight)
    if w.shape[0] != val(x).shape[-1]:
        raise NoMatch(f"weight has {w.shape[0]} elements, rows are {val(x).shape[-1]} wide")
    expected = rms_norm_out_dtype(x_dtype, w.dtype, weight_in_fp32)
    if dtype_of(out) != expected:
        raise NoMatch(f"output is {dtype_of(out)}, the canonical op would give {expected}")
    leaks = external_users(nodes, out)
    if leaks:
        inner, user = leaks[0]
        raise NoMatch(f"intermediate {inner.name} is also read by {user.name}")
    return RMSNormMatch(x=x, weight=weight, eps=eps, weight_in_fp32=weight_in_fp32,
                        out=out, nodes=nodes, x_round=x_round)


def eps_op_args(eps: float | Node) -> tuple[float, Node | None]:
    """An eps as the ops take it: ``(eps, None)`` for a constant, ``(0.0, node)`` for the
    0-dim graph input ``torch.compile(dynamic=True)`` makes of it (the ops' ``*_tensor``
    argument then replaces the float)."""
    return (0.0, eps) if isinstance(eps, Node) else (eps, None)


def find_rms_norms(graph: Graph) -> tuple[list[RMSNormMatch], list[RMSNormRejection]]:
    """All RMSNorms in ``graph`` (in graph order), and the rsqrt sites that were not (and
    the ``sqrt(variance + eps)`` ones: any other sqrt is no candidate at all)."""
    matches, rejections = [], []
    for node in graph.nodes:
        if not is_op(node, *ANCHORS):
            continue
        try:
            matches.append(match_rms_norm(node))
        except NoMatch as e:
            if is_op(node, aten.sqrt.default) and not starts_rms_norm(node):
                continue
            rejections.append(RMSNormRejection(node, str(e)))
    return matches, rejections
