"""Fusion 2: the Block AttnRes chain -> ``torch.ops.k3fusion.attn_res`` (one kernel).

What a site computes, as module code writes it (source dim -2)::

    prefix  = prefix + delta                          # optional: becomes the kernel's delta
    sources = stack(blocks + [prefix], -2)            # list bank (cat + reshape in aten)
            | cat([bank[..., :n, :], prefix[..., None, :]], -2)      # tensor bank
    keys    = RMSNorm_g(sources)                      # model dtype or fp32
    logits  = keys @ w.T                              # Linear(H, 1), squeezed (its rows
                                                      # possibly padded by Inductor's pad_mm)
    p       = softmax(logits.float(), -1)
    mixed   = sum(p[..., None] * sources, -2)         # model dtype or fp32, cast back
    out     = RMSNorm(mixed)                          # optional: folded in as the output norm

The kernel computes keys, logits and the mix in fp32 (``k3fusion.reference.attn_res``);
a module that rounds its keys or mix to bf16 gets the same function up to that rounding.

Other spellings (MoonshotAI's reference), the checks, the sources and the delta hand-off:
docs/design-notes.md, "patterns/attn_res.py".
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field

import torch
from torch.fx import Graph, Node

import k3fusion.ops  # noqa: F401  registers torch.ops.k3fusion.* (the ops this pass inserts)
from ._fx import (RESHAPES, NoMatch, all_or_nothing, apply_size_reads, aten, depends_on, LAYOUT_OPS,
                  view_layout, dtype_of, erase_unused, external_users, fake_call, hoist_before,
                  insert_call, is_graph_input, is_op, keepdim_of, slice_args, matmul_operands,
                  only_user, operands, plan_size_reads, prims, product_of_result, product_reading,
                  same_size, strip_casts, UnpaddedProduct, users, val)
from .fusion import Fusion, FusionResult
from .rms_norm import (RMSNormMatch, derived_from_input, divided_by_sqrt, eps_op_args,
                       inverse_rms, parameter_weight, same_input, upcast_input)

__all__ = ["FUSION", "FUSION_NAME", "HANDOFF_NAME", "AttnResSite", "match_attn_res",
           "fuse_attn_res", "count_handoffs"]

FUSION_NAME = "attn_res"
#: Folds of a layer's closing ``prefix + mlp_out`` into the next site (a sub-count of the
#: sites' folds; the sites themselves count under FUSION_NAME).
HANDOFF_NAME = "attn_res_delta_handoff"

_CAST = prims.convert_element_type.default
_MUL = aten.mul.Tensor


def _online_softmax_ops() -> tuple:
    """Inductor's online-softmax prim (GPU graphs; one reduction for max and sum of exp),
    where this torch has it."""
    op = getattr(prims, "prepare_softmax_online", None)
    return (op.default,) if op is not None else ()


@dataclass
class AttnResSite:
    """One recognized AttnRes mix (before the optional folds)."""

    prefix: Node
    #: List bank: the block tensors, oldest first. Tensor bank: None.
    blocks: list[Node] | None
    #: Tensor bank: the bank (a version whose first ``num_blocks`` slots are the blocks).
    bank: Node | None
    num_blocks: int
    #: None: an unweighted key norm (weight 1).
    norm_w: Node | None
    proj_w: Node
    eps: float | Node
    #: The site's result in the model dtype (what the output norm, if any, reads).
    mixed: Node
    nodes: list[Node] = field(repr=False)
    #: The sources' dim (non-negative) in the module's layout: rank - 2 sources-last,
    #: 0 sources-first (``torch.stack(blocks + [partial])``); the op reads a tensor bank
    #: through a view moving it to -2, in place.
    src_dim: int = -1
    #: The prefix source as the sources hold it, with a size-1 dim at ``src_dim``
    #: (``h.view(-1, 1, H).float()`` cat'ed to a bank): the op reads ``prefix.squeeze(d)``.
    prefix_unit_dim: int | None = None

    @property
    def round_dropped(self) -> bool:
        """An fp32 mix of 16-bit sources: the module's ``.to(dtype)`` before its next norm
        was dropped by Inductor as a round trip (the norm's ``x_round`` restores it)."""
        return dtype_of(self.mixed) != dtype_of(self.prefix)


def _dim_is(node: Node, dim: int, want: int) -> bool:
    """``dim`` of ``node``'s value is its ``want``-th dim from the end (want < 0)."""
    return isinstance(dim, int) and dim in (want, val(node).dim() + want)


def _norm_dim(node: Node, dim) -> int:
    """``dim`` of ``node``'s value as a non-negative index (NoMatch if not an int in range)."""
    rank = val(node).dim()
    if isinstance(dim, bool) or not isinstance(dim, int) or not -rank <= dim < rank:
        raise NoMatch(f"dim {dim!r} of a rank-{rank} value")
    return dim % rank


def _one_dim(node: Node, dims) -> int:
    """The single dim of a reduction's ``dims`` argument, non-negative."""
    if not isinstance(dims, (list, tuple)) or len(dims) != 1:
        raise NoMatch(f"reduction over dims {dims!r}, not one dim")
    return _norm_dim(node, dims[0])


#: Pure ops a traced graph may compute twice from the same inputs (besides the layout
#: ops): a cast, a slice (``bank[:n + 1]`` repeated), and a cat -- ``torch.stack(sources)``
#: written once for the keys and again for the mix lowers to two cats of the same items.
_REPEATABLE = (_CAST, aten.slice.Tensor, aten.cat.default)


def _same_value(a: object, b: object, depth: int = 4) -> bool:
    """``a`` and ``b`` compute the same tensor: the same node, or the same pure view /
    cast / slice / cat op of the same inputs (lists compared item by item, in order)."""
    if a is b:
        return True
    if not (depth and isinstance(a, Node) and isinstance(b, Node) and a.op == b.op == "call_function"
            and a.target is b.target and a.kwargs == b.kwargs and len(a.args) == len(b.args)
            and (a.target in LAYOUT_OPS or a.target in _REPEATABLE)):
        return False
    return all(_same_arg(x, y, depth - 1) for x, y in zip(a.args, b.args))


def _same_arg(x: object, y: object, depth: int) -> bool:
    """One argument of :func:`_same_value`'s ops: nodes by value, a cat's list of items
    item by item (same length, same order), anything else by equality."""
    if isinstance(x, Node):
        return _same_value(x, y, depth)
    if isinstance(x, (list, tuple)):
        return (isinstance(y, (list, tuple)) and len(x) == len(y)
                and all(_same_arg(a, b, depth) for a, b in zip(x, y)))
    return not isinstance(y, Node) and x == y


def _repeat_nodes(copy: object, original: object) -> list[Node]:
    """The nodes of ``copy`` that repeat ``original``'s (:func:`_same_value` holds), down to
    the nodes both read: they go with the site (a second stack is dead once it is fused)."""
    if copy is original or not isinstance(copy, Node):
        return []
    found = [copy]
    for x, y in zip(copy.args, original.args):
        if isinstance(x, (list, tuple)):
            for a, b in zip(x, y):
                found += _repeat_nodes(a, b)
        else:
            found += _repeat_nodes(x, y)
    return found


def _softmax(div: Node) -> tuple[Node, int, list[Node]]:
    """``exp(l - amax(l, d)) / sum(exp(...), d)`` -> (fp32 logits, d >= 0, nodes)."""
    if not is_op(div, aten.div.Tensor):
        raise NoMatch("not a division")
    exp, denom = div.args
    if not is_op(exp, aten.exp.default):
        raise NoMatch("not a softmax numerator")
    sub = exp.args[0]
    # Inductor's forms of softmax(l * 1): the where-form (torch 2.13+); torch 2.11 writes
    # its first branch alone, (l * 1 - amax(l * 1)) * 1
    outer, scaled = _unit_stripped(sub)
    if is_op(outer, aten.where.self, aten.sub.Tensor):
        sub = outer
    else:
        scaled = []
    if is_op(sub, aten.where.self):
        logits, amax, branches = _unit_scaled_shift(sub)
        of, scaled = branches[0], branches + scaled  # the max is of l * 1
    elif is_op(sub, _MUL) and is_op(sub.args[0], aten.where.self, aten.sub.Tensor):
        raise NoMatch("softmax of scaled logits (a temperature)")
    elif not (is_op(sub, aten.sub.Tensor) and sub.kwargs.get("alpha", 1) == 1):
        raise NoMatch("softmax without max subtraction")
    else:
        of, amax = sub.args
        logits, unit = _unit_stripped(of)
        scaled += unit
    if not isinstance(logits, Node) or val(sub).shape != val(logits).shape:
        raise NoMatch("softmax subtracts a broadcast value")
    if scaled and not is_op(denom, aten.sum.dim_IntList):
        raise NoMatch("not a softmax denominator")
    if is_op(denom, operator.getitem) and is_op(denom.args[0], *_online_softmax_ops()):
        # CUDA: prepare_softmax_online(logits, dim) -> (max, sum of exp)
        online = denom.args[0]
        if not (online.args[0] is logits and denom.args[1] == 1 and is_op(amax, operator.getitem)
                and amax.args[0] is online and amax.args[1] == 0):
            raise NoMatch("not an online softmax of the logits")
        d = _norm_dim(logits, online.args[1])
        nodes = [online, amax, denom, sub, exp, div]
    else:
        if not (is_op(denom, aten.sum.dim_IntList) and denom.args[0] is exp
                and keepdim_of(denom) and denom.kwargs.get("dtype") is None):
            raise NoMatch("not a softmax denominator")
        d = _one_dim(exp, denom.args[1])
        shift = _kept_max(amax)
        if not (shift and shift[0] is of and _one_dim(logits, shift[1]) == d):
            raise NoMatch("softmax without a max over its own dim")
        nodes = scaled + shift[2] + [sub, exp, denom, div]
    if dtype_of(logits) != torch.float32:
        raise NoMatch(f"softmax in {dtype_of(logits)}, not float32")
    if dtype_of(div) != torch.float32 or val(div).shape != val(logits).shape:
        raise NoMatch("softmax result is not the logits' shape in float32")
    return logits, d, nodes


def _kept_max(node: object) -> tuple[Node, list, list[Node]] | None:
    """``amax(x, dims, keepdim=True)``, or ``x.max(d, keepdim=True).values`` (``max.dim``,
    whose indices nothing else reads: a module that also uses them needs the reduction)
    -> (x, dims, nodes); None for anything else."""
    if is_op(node, aten.amax.default) and keepdim_of(node):
        return node.args[0], node.args[1], [node]
    if is_op(node, operator.getitem) and node.args[1] == 0:
        red = node.args[0]
        if is_op(red, aten.max.dim) and keepdim_of(red) and users(red) == [node]:
            return red.args[0], [red.args[1]], [node, red]
    return None


def _times_one(node: object) -> Node | None:
    """``x * 1`` or ``x / 1`` (exact) -> ``x``; None for anything else."""
    if (is_op(node, _MUL, aten.div.Tensor) and isinstance(node.args[0], Node)
            and isinstance(node.args[1], (int, float)) and not isinstance(node.args[1], bool)
            and node.args[1] == 1):
        return node.args[0]
    return None


def _unit_stripped(node: object) -> tuple[object, list[Node]]:
    """``node`` read through exact ``* 1`` / ``/ 1`` ops -> (what they multiply, the ops)."""
    ops = []
    while (inner := _times_one(node)) is not None:
        ops.append(node)
        node = inner
    return node, ops


def _unit_free(node: object) -> tuple[object, list[Node]]:
    """``node`` read through exact ``* 1`` / ``/ 1`` ops and fp32 casts -> (a key equal for
    equal values, the nodes read through)."""
    inner = _times_one(node)
    if inner is not None:
        key, chain = _unit_free(inner)
        return key, [node, *chain]
    if is_op(node, _CAST) and node.args[1] == torch.float32:
        key, chain = _unit_free(node.args[0])
        return ("float", key), [node, *chain]
    return node, []


def _unit_scaled_shift(where: Node) -> tuple[Node, Node, list[Node]]:
    """Inductor's rewrite of ``softmax(l * s)`` (or ``l / s``): ``where(finite(l * s), (l *
    sign - amax(l * sign)) * |s|, l * s - amax(l * s))``. With ``s = 1`` both branches are
    exactly ``l - amax(l)``, whatever the test picks (a 16-bit ``l`` is cast to fp32 in
    each branch, before or after the exact ``* 1``) -> (the first branch's fp32 ``l``, the
    second branch's amax, nodes: the second branch's ``l * s`` first, the test's nodes
    included). Any other ``s`` is a temperature the op does not take: NoMatch."""
    test, first, second = where.args
    if not (is_op(second, aten.sub.Tensor) and second.kwargs.get("alpha", 1) == 1):
        raise NoMatch("softmax without max subtraction")
    scaled, amax = second.args
    key, chain = _unit_free(scaled)
    inner = _times_one(first)
    if not (any(_times_one(n) is not None for n in chain) and is_op(inner, aten.sub.Tensor)
            and inner.kwargs.get("alpha", 1) == 1):
        raise NoMatch("softmax of scaled logits (a temperature)")
    signed, signed_max = inner.args
    logits = _times_one(signed)
    if not (logits is not None and _unit_free(logits)[0] == key
            and is_op(signed_max, aten.amax.default)
            and signed_max.args[0] is signed and is_op(amax, aten.amax.default)
            and list(signed_max.args[1]) == list(amax.args[1])
            and keepdim_of(signed_max) == keepdim_of(amax)):
        raise NoMatch("softmax of scaled logits: branches differ")
    return logits, amax, [*chain, second, signed, signed_max, inner, first,
                          *_computed_from(test, scaled), where]


def _computed_from(node: Node, root: Node) -> list[Node]:
    """The nodes computing ``node`` from ``root`` and constants alone (``root`` excluded)."""
    found, stack = [], [node]
    while stack:
        n = stack.pop()
        if n is root or n in found:
            continue
        if not isinstance(n, Node) or n.op != "call_function":
            raise NoMatch("softmax of scaled logits: the branch test reads other values")
        found.append(n)
        stack.extend(n.all_input_nodes)
    return found


def _minus_max(logits: Node, d: int) -> tuple[Node, list[Node]]:
    """``l - max(l, d, keepdim=True)`` (or amax) written by the module before its softmax:
    the softmax is shift-invariant, so the site reads ``l`` -> (l, nodes)."""
    if not (is_op(logits, aten.sub.Tensor) and logits.kwargs.get("alpha", 1) == 1):
        return logits, []
    raw, mx = logits.args
    if not isinstance(raw, Node) or val(logits).shape != val(raw).shape:
        return logits, []
    shift = _kept_max(mx)
    if shift and shift[0] is raw and _one_dim(raw, shift[1]) == d:
        return raw, [logits, *shift[2]]
    return logits, []


def _query_vector(node: object) -> tuple[Node, list[Node]]:
    """The pseudo-query ``w [H]``: a ``[1, H]`` or ``[H]`` graph input (a Linear(H, 1)
    weight), one row ``q[i]`` of a ``[sites, H]`` one, or a graph input of at most two dims
    viewed in row-major order as ``[H]`` (``proj.weight.squeeze()``), optionally
    ``.float()``; else a vector the graph computes from parameters (:func:`_computed_query`).
    -> (a node whose value views as ``[H]``, nodes of the site)."""
    original, nodes = node, []
    if is_op(node, _CAST) and node.args[1] == torch.float32:
        nodes.append(node)
        node = node.args[0]
    if is_graph_input(node) and (val(node).dim() == 1 or (val(node).dim() == 2
                                                          and val(node).shape[0] == 1)):
        return node, nodes
    if (is_op(node, aten.select.int) and is_graph_input(node.args[0])
            and val(node.args[0]).dim() == 2 and node.args[1] in (0, -2)):
        return node, nodes + [node]
    if is_op(node, *LAYOUT_OPS) and val(node).dim() == 1:
        # proj.weight.squeeze() as a matmul's vector: a [1, H] / [H] parameter viewed as [H]
        base, layout, chain = view_layout(node)
        if is_op(base, _CAST) and base.args[1] == torch.float32 and not nodes:
            # w.float().squeeze(): the exact upcast before the view (same dims)
            nodes, base = [base], base.args[0]
            layout = [tuple((base, i) for _, i in group) for group in layout]
        if is_graph_input(base) and val(base).dim() in (1, 2) and layout == [
                tuple((base, i) for i, n in enumerate(val(base).shape) if not _one(n))]:
            return node, nodes + chain
    if _computed_query(original):
        return original, []  # the op reads the vector the graph computes
    raise NoMatch("pseudo-query is not a [1, H] / [H] parameter or a row of a [sites, H] one")


def _computed_query(node: object) -> bool:
    """A query vector of parameters, as the graph computes it: a row, view or cast of a
    graph input (``q[i].to(x.dtype)``), or the product of two such values (Kimi-K3's
    ``norm.weight.float() * proj.weight.squeeze(0).float()``: the key-norm weight folded
    into the query) or of one and a number (fla's ``query * scale``), possibly cast after
    the product (``(query * norm.weight).float()``, folded in the model dtype). Read as the
    graph computes it, the value is exactly eager's."""
    if not isinstance(node, Node) or val(node).dim() != 1:
        return False
    if is_op(node, _CAST) and is_op(node.args[0], _MUL):  # (q * w).float(): folded, then cast
        node = node.args[0]
    if is_op(node, _MUL):  # a folded weight, or a scale knob (``query * scale``)
        return all((isinstance(a, Node) and val(a).dim() <= 1 and derived_from_input(a))
                   or (isinstance(a, (int, float)) and not isinstance(a, bool))
                   for a in node.args[:2])
    return derived_from_input(node)


def _leading_layout(t: Node, skip: int | None = None) -> list[tuple]:
    """The layout of a value with ``t``'s dims but the last (and ``skip``), in
    :func:`view_layout`'s atoms ``(t, dim)``."""
    shape = val(t).shape
    return [() if _one(shape[i]) else ((t, i),) for i in range(len(shape) - 1) if i != skip]


def _one(size) -> bool:
    return same_size(size, 1)


def _operand_layouts(product: UnpaddedProduct, stops=()) -> list[tuple]:
    """bmm / mm operands (before ``pad_mm``'s padding) as (base, [batch, rows, inner],
    chain) each."""
    sides = []
    for k, x in enumerate((product.a, product.b)):
        base, layout, chain = view_layout(x, stops=stops)
        if not product.batched:
            layout = [()] + layout
        if len(layout) != 3:
            raise NoMatch(f"{product.name}: operand of rank {len(layout)}")
        if k == 1:  # [batch, inner, cols] -> [batch, cols, inner]
            layout = [layout[0], layout[2], layout[1]]
        sides.append((base, layout, chain))
    return sides


def _result_layout(node: Node, product: UnpaddedProduct, batch: tuple, a_rows: tuple,
                   b_cols: tuple) -> tuple[list, list]:
    """``node``'s layout (in the operands' atoms) when it views the product."""
    out = [batch, a_rows, b_cols] if product.batched else [a_rows, b_cols]
    _, layout, chain = view_layout(node, start=(product.result, out))
    return layout, chain


def _contraction_projection(logits: Node) -> tuple[Node, Node, list[Node]]:
    """Logits as an einsum / matmul lowers them: ``bmm``/``mm`` of the keys and the
    pseudo-query, wrapped in reshapes and permutes (``einsum('d, ...d -> ...', w, K)``)."""
    node, product = logits, product_of_result(logits)
    while product is None and is_op(node, *LAYOUT_OPS):
        node = node.args[0]
        product = product_of_result(node)
    if product is None:
        raise NoMatch("logits are neither a projection nor a contraction with a query")
    sides = _operand_layouts(product)
    for (wb, wl, wc), (kb, kl, kc), w_first in ((sides[0], sides[1], True),
                                                 (sides[1], sides[0], False)):
        try:
            proj_w, w_nodes = _query_vector(wb)
        except NoMatch:
            continue
        keys = kb
        width = val(keys).shape[-1]
        w_atoms = [(wb, i) for i, s in enumerate(val(wb).shape) if not _one(s)]
        r = val(keys).dim()
        if not (wl[0] == () and kl[0] == () and wl[1] == () and len(w_atoms) == 1
                and wl[2] == tuple(w_atoms) and kl[2] == ((keys, r - 1),)
                and val(wb).shape[w_atoms[0][1]] == width):
            raise NoMatch("the contraction with the query is not over the keys' last dim")
        rows, cols = (wl[1], kl[1]) if w_first else (kl[1], wl[1])
        layout, out_chain = _result_layout(logits, product, (), rows, cols)
        if layout != _leading_layout(keys):
            raise NoMatch("logits do not keep the keys' leading dims in order")
        return keys, proj_w, out_chain + [product.product, *product.nodes] + wc + kc + w_nodes
    raise NoMatch("contraction without a pseudo-query parameter")


def _mul_sum_projection(logits: Node) -> tuple[Node, Node, list[Node]]:
    """``(keys * q).sum(-1)`` with a pseudo-query vector ``q``; or ``keys @ q`` as torch's
    matrix-vector decomposition lowers it: the keys flattened to rows (and cast to fp32),
    ``(rows * q).sum(1)``, cast back and viewed as the keys' leading dims."""
    views, out = [], logits
    while is_op(out, *LAYOUT_OPS):
        views.append(out)
        out = out.args[0]
    rounded = None
    if views and is_op(out, _CAST):  # the fp32 sums rounded back to the keys' dtype
        rounded, out = out, out.args[0]
    if not (is_op(out, aten.sum.dim_IntList) and not keepdim_of(out)
            and out.kwargs.get("dtype") is None):
        raise NoMatch("logits are not a projection")
    prod = out.args[0]
    if not is_op(prod, _MUL) or _one_dim(prod, out.args[1]) != val(prod).dim() - 1:
        raise NoMatch("logits are not a projection")
    for k_in, q in (prod.args, prod.args[::-1]):
        if not isinstance(k_in, Node) or not isinstance(q, Node):
            continue
        try:
            proj_w, w_nodes = _query_vector(q)
        except NoMatch:
            continue
        if (val(q).dim() != 1 or val(prod).shape != val(k_in).shape
                or not same_size(val(q).shape[0], val(k_in).shape[-1])):
            raise NoMatch("the query broadcasts over more than the keys' rows")
        if not views:
            return k_in, proj_w, [logits, prod] + w_nodes
        return _flattened_keys(logits, out, rounded, k_in, proj_w, [prod] + w_nodes)
    raise NoMatch("logits are not a projection")


def _flattened_keys(logits: Node, sums: Node, rounded: Node | None, k_in: Node, proj_w: Node,
                    nodes: list[Node]) -> tuple[Node, Node, list[Node]]:
    """The matrix-vector form's keys: ``k_in`` views (after an fp32 cast) the keys as rows
    x their last dim, and ``logits`` views the row sums as the keys' leading dims, in order."""
    if is_op(k_in, _CAST) and k_in.args[1] == torch.float32:
        nodes.append(k_in)
        k_in = k_in.args[0]
    keys, k_layout, k_chain = view_layout(k_in)
    r = val(keys).dim()
    if len(k_layout) != 2 or k_layout[1] != ((keys, r - 1),):
        raise NoMatch("the product with the query is not over the keys' last dim")
    if rounded is not None and rounded.args[1] not in (torch.float32, val(keys).dtype):
        raise NoMatch("logits are rounded to a dtype other than the keys' or fp32")
    _, layout, chain = view_layout(logits, start=(rounded or sums, [k_layout[0]]))
    if layout != _leading_layout(keys):
        raise NoMatch("logits do not keep the keys' leading dims in order")
    return keys, proj_w, chain + ([rounded] if rounded is not None else []) + [sums] + nodes + k_chain


def _projection(logits: Node) -> tuple[Node, Node, list[Node]]:
    """The keys' logits -> (keys, pseudo-query [H] (a view of it), nodes)."""
    nodes = []
    if is_op(logits, _CAST) and logits.args[1] == torch.float32:  # logits.float()
        nodes.append(logits)
        logits = logits.args[0]
    try:
        keys, proj_w, more = _linear_projection(logits)
    except NoMatch as first:
        try:
            keys, proj_w, more = _contraction_projection(logits)
        except NoMatch:
            try:
                keys, proj_w, more = _mul_sum_projection(logits)
            except NoMatch:
                raise first from None
    return keys, proj_w, nodes + more


def _unit_moved(logits: object) -> list[int | None] | None:
    """``Linear(H, 1)(keys)`` (``[..., S, 1]``) permuted with only its unit projection dim
    moved (``scores.transpose(1, 2)`` -> ``[T, 1, S]``, transformers' Kimi K3): per logits
    dim, the keys' leading dim it is (None for the projection's unit dim); None for any
    other node. The other dims keep their order, so the logits are the keys' leading dims
    with a size-1 dim inserted."""
    if not is_op(logits, aten.permute.default):
        return None
    view, perm = logits.args[0], [int(d) for d in logits.args[1]]
    n = val(view).dim() - 1
    if not (is_op(view, *RESHAPES) and n >= 1 and _one(val(view).shape[-1])):
        return None
    kept = [d for d in perm if d != n]
    if kept != sorted(kept) or perm[-1] == n:
        return None
    return [d if d != n else None for d in perm]


def _linear_projection(logits: Node) -> tuple[Node, Node, list[Node]]:
    """``Linear(H, 1)`` of the keys, squeezed (or its ``[M, 1]`` output reshaped straight to
    the leading dims, ``.reshape(T, R)``) -> (keys, proj weight param, nodes). Keys normed
    as flattened rows ``[M, H]`` come back as such: :func:`_flattened_rows` ties them to
    the sources."""
    if is_op(logits, aten.squeeze.dim) and _dim_is(logits.args[0], logits.args[1], -1):
        view = logits.args[0]
        if not (is_op(view, *RESHAPES) and val(view).shape[-1] == 1):
            raise NoMatch("projection output is not [..., S, 1]")
        leading = tuple(val(view).shape[:-1])
    elif is_op(logits, *RESHAPES) and val(logits.args[0]).dim() == 2 \
            and same_size(val(logits.args[0]).shape[-1], 1):
        view, leading = logits, tuple(val(logits).shape)
    elif _unit_moved(logits) is not None:  # [..., S, 1] with the 1 moved: match_attn_res maps
        view = logits.args[0]
        leading = tuple(val(view).shape[:-1])
    else:
        raise NoMatch("logits are not a squeezed projection")
    product = matmul_operands(view.args[0])
    if product is None:
        raise NoMatch("projection is not a matrix multiply")
    # the fp32 upcasts around a decomposed one-row product belong to the site too
    flat_keys, w_t = (strip_casts(x) for x in product)
    if not (is_op(w_t, aten.permute.default) and list(w_t.args[1]) == [1, 0]):
        raise NoMatch("projection weight is not transposed")
    proj_w, w_nodes = parameter_weight_2d(w_t.args[0])
    nodes = [logits, view, w_t, *w_nodes] + _between({flat_keys, w_t}, view.args[0])
    if not is_op(flat_keys, *RESHAPES):
        if view is logits and val(flat_keys).dim() == 2:
            return flat_keys, proj_w, nodes  # rows normed flat: _flattened_rows checks them
        raise NoMatch("keys are not flattened for the projection")
    keys, clones = flat_keys.args[0], []
    while is_op(keys, aten.clone.default):  # made contiguous first (permuted keys): same values
        clones.append(keys)
        keys = keys.args[0]
    # [..., H] -> [M, H] -> [M, 1] -> [..., 1]: the rows keep their order only when the
    # flattening keeps the last dim and the view restores exactly the keys' leading dims.
    if not (isinstance(keys, Node) and val(flat_keys).dim() == 2
            and val(flat_keys).shape[-1] == val(keys).shape[-1]
            and leading == tuple(val(keys).shape[:-1])):
        raise NoMatch("the projection's flattening does not keep the keys' rows")
    # Everything between the keys and the logits belongs to the site (a decomposed
    # product adds unsqueezes, casts and a sum around the multiply).
    return keys, proj_w, nodes + [flat_keys, *clones]


def _flattened_rows(x: Node, logits: Node) -> tuple[Node, list[Node]]:
    """Keys normed as rows ``x = rows.reshape(M, H)`` whose logits are reshaped back to
    ``rows``' leading dims (a serving framework's reference path) -> (rows, nodes)."""
    if not is_op(x, *RESHAPES):
        raise NoMatch("keys have fewer dims than the logits and are no view of the sources")
    rows = x.args[0]
    r = val(rows).dim()
    _, layout, chain = view_layout(x, stops={rows})
    atoms = tuple((rows, i) for i in range(r - 1) if not _one(val(rows).shape[i]))
    if (val(x).dim() != 2 or layout != [atoms, ((rows, r - 1),)]
            or tuple(val(logits).shape) != tuple(val(rows).shape[:-1])):
        raise NoMatch("the flattened keys' rows are not the sources' rows in order")
    return rows, chain


def _between(stops: set[Node], end: Node) -> list[Node]:
    """``end`` and what it is computed from, walking back no further than ``stops``."""
    found, stack = [], [end]
    while stack:
        n = stack.pop()
        if n in stops or n in found:
            continue
        if n.op != "call_function":
            raise NoMatch(f"projection reads {n.name} besides the keys and the weight")
        found.append(n)
        stack.extend(n.all_input_nodes)
    return found


def parameter_weight_2d(node: object) -> tuple[Node, list[Node]]:
    """A ``[1, H]`` Linear weight parameter, optionally through ``.float()``."""
    nodes = []
    if is_op(node, _CAST) and node.args[1] == torch.float32:
        nodes.append(node)
        node = node.args[0]
    if not is_graph_input(node) or val(node).dim() != 2 or val(node).shape[0] != 1:
        raise NoMatch("projection weight is not a [1, H] parameter")
    return node, nodes


def _whole_slice(node: object) -> bool:
    """A step-1 slice that keeps every element (``x[..., -H:]`` of rows ``H`` wide)."""
    return (is_op(node, aten.slice.Tensor) and isinstance(node.args[0], Node)
            and (node.args[4] if len(node.args) > 4 else node.kwargs.get("step", 1)) == 1
            and val(node).shape == val(node.args[0]).shape)


def _key_norm(keys: Node) -> tuple[Node, Node | None, float | Node, Node, list[Node]]:
    """RMSNorm of the sources -> (sources, norm weight or None (weight 1), eps, x32, nodes).

    Accepts cast-then-weight keys in the model dtype, keys weighted in fp32 (cast back or
    not) and unweighted keys (``F.rms_norm(V, (H,))``): the kernel computes them in fp32
    either way. Every cast must round to the sources' dtype (or keep fp32).
    """
    nodes = []
    step = keys
    if is_op(step, _CAST):  # weight-in-fp32 keys cast back to the model dtype
        nodes.append(step)
        step = step.args[0]
    if divided_by_sqrt(step):
        candidates = [(keys, None)]  # x32 / sqrt(...) (cast back): no weight
        nodes = []
    elif not is_op(step, _MUL):
        raise NoMatch("keys are not a weighted norm")
    elif any(is_op(o, aten.rsqrt.default) for o in step.args):
        candidates = [(keys, None)]  # x32 * rsqrt(...) (cast back): no weight
        nodes = []
    else:
        nodes.append(step)
        candidates = [(step.args[0], step.args[1]), (step.args[1], step.args[0])]
    for normed_side, w_side in candidates:
        inner = normed_side
        cast = None
        if is_op(inner, _CAST):
            cast, inner = inner, inner.args[0]
        divided = divided_by_sqrt(inner)
        if divided:
            # x32 / sqrt(...): the rsqrt form's function (patterns/rms_norm.py)
            row, sqrt = divided
            x32, eps, rms_nodes = inverse_rms(sqrt, any_float=True)
            try:
                rms_nodes += same_input(row, x32)
            except NoMatch:
                if w_side is not None or not is_op(row, _MUL):
                    raise
                # (w * x32) / sqrt(...): the weight multiplied in first
                rms_nodes += [row]
                w_side = _weight_beside(row, x32, rms_nodes)
        else:
            if not is_op(inner, _MUL):
                continue
            scale = next((o for o in inner.args if is_op(o, aten.rsqrt.default)
                          or (is_op(o, _CAST) and is_op(o.args[0], aten.rsqrt.default))), None)
            if scale is None:
                continue
            # x * rsqrt(...).to(x.dtype): the scale rounded to the sources' dtype (checked
            # below), the product in it; the kernel keeps both in fp32
            rsqrt = scale.args[0] if is_op(scale, _CAST) else scale
            x32, eps, rms_nodes = inverse_rms(rsqrt, any_float=True)
            rms_nodes += same_input(operands(inner, scale), x32)
            if scale is not rsqrt:
                rms_nodes.append(scale)
        if w_side is None:
            norm_w, w_nodes = None, []
        else:
            norm_w, w_nodes = parameter_weight(w_side, allow_upcast=True)
        sources, upcast = upcast_input(x32)
        if _whole_slice(sources):  # keys from values[..., -H:]: the whole rows
            upcast, sources = upcast + [sources], sources.args[0]
        for c in [cast] + [n for n in nodes + rms_nodes if is_op(n, _CAST) and n not in upcast]:
            if c is not None and c.args[1] not in (dtype_of(sources), torch.float32):
                raise NoMatch(f"keys rounded to {c.args[1]}, the sources are {dtype_of(sources)}")
        if val(keys).shape != val(sources).shape:
            raise NoMatch("key norm weight broadcasts beyond the rows")
        nodes += [inner, *rms_nodes, *w_nodes, *upcast] + ([cast] if cast is not None else [])
        return sources, norm_w, eps, x32, nodes
    raise NoMatch("keys are not RMSNorm(sources) * weight")


def _weight_beside(product: Node, x32: Node, nodes: list[Node]) -> Node:
    """The operand of ``product`` that is not the norm's input (``x32`` in a spelling of
    :func:`same_input`; its extra nodes go to ``nodes``); NoMatch if neither is."""
    for mine, other in (product.args, product.args[::-1]):
        try:
            nodes += same_input(mine, x32)
        except NoMatch:
            continue
        return other
    raise NoMatch("rsqrt is not multiplied with the input")


def _is_source(operand: object, sources: Node, x32: Node) -> list[Node]:
    """``operand`` is the sources (or their fp32 upcast, or a repeat of either) -> extra
    nodes; NoMatch otherwise."""
    try:
        return same_input(operand, x32)
    except NoMatch:
        pass
    for ref in (sources, x32):
        if _same_value(operand, ref):
            return _repeat_nodes(operand, ref)
    if is_op(operand, _CAST) and operand.args[1] == torch.float32 \
            and _same_value(operand.args[0], sources):
        inner = operand.args[0]
        return [operand] + (_repeat_nodes(inner, sources) if inner is not sources else [inner])
    raise NoMatch("softmax weights do not scale the sources")


def _mix(div: Node, sources: Node, x32: Node, sd: int,
         pmap: list[int | None] | None = None) -> tuple[Node, list[Node]]:
    """``sum(p[..., None] * sources, sd)`` or ``einsum('s..., s...h -> ...h', p, V)``
    (cast back if computed in fp32; an fp32 mix of 16-bit sources is returned as it is:
    see ``AttnResSite.round_dropped``) -> (mixed, nodes)."""
    nodes = []
    p = only_user(div)
    for _ in range(2):  # softmax(bf16 logits) rounds to bf16; .float() may follow
        if not is_op(p, _CAST):
            break
        if p.args[1] not in (dtype_of(sources), torch.float32):
            raise NoMatch(f"softmax weights rounded to {p.args[1]}")
        nodes.append(p)
        p = only_user(p)
    if pmap is not None:  # the weights' dims are not the sources' (one of them moved)
        total, more = _contraction_mix(p, sources, x32, sd, pmap)
    elif is_op(p, aten.unsqueeze.default) and _dim_is(p, p.args[1], -1):
        weighted = only_user(p)
        if is_op(weighted, _MUL):
            total, more = _mul_sum_mix(p, weighted, sources, x32, sd)
        else:
            total, more = _contraction_mix(p, sources, x32, sd)
    else:
        total, more = _contraction_mix(p, sources, x32, sd)
    nodes += more
    mixed = total
    if dtype_of(total) != dtype_of(sources):
        user = only_user_or_none(total)
        if is_op(user, _CAST) and user.args[1] == dtype_of(sources):
            mixed = user
            nodes.append(mixed)
        elif dtype_of(total) != torch.float32:
            raise NoMatch(f"mix is not cast back to {dtype_of(sources)}")
        # else an fp32 mix: its cast back may be a round trip Inductor dropped before a
        # norm (``_plan`` requires that norm, with the rounding restored: x_round)
    want = tuple(s for i, s in enumerate(val(sources).shape) if i != sd)
    if tuple(val(mixed).shape) != want:
        raise NoMatch("the mix keeps the source dim or broadcasts")
    return mixed, nodes


def _mul_sum_mix(p: Node, weighted: Node, sources: Node, x32: Node, sd: int):
    try:
        nodes = _is_source(operands(weighted, p), sources, x32)
    except NoMatch:
        raise NoMatch("softmax weights do not scale the sources") from None
    if val(weighted).shape != val(sources).shape:
        raise NoMatch("softmax weights broadcast over the sources")
    total = only_user(weighted)
    if not (is_op(total, aten.sum.dim_IntList)
            and _one_dim(weighted, total.args[1]) == sd):
        raise NoMatch("weighted sources are not summed over the source dim")
    if keepdim_of(total) or total.kwargs.get("dtype") is not None:
        raise NoMatch("the mix's sum keeps the source dim (keepdim=True) or has a dtype")
    return total, nodes + [p, weighted, total]


def _contraction_mix(p: Node, sources: Node, x32: Node, sd: int,
                     pmap: list[int | None] | None = None):
    """The mix as an einsum lowers it: views of p and the sources into one bmm/mm whose
    inner dim is the source dim, viewed back to the sources' layout without it."""
    chain = [p] if is_op(p, *LAYOUT_OPS) else []
    n = p
    while is_op(n, *LAYOUT_OPS):
        n = only_user(n)
        if is_op(n, *LAYOUT_OPS):
            chain.append(n)
    product = product_reading(n)  # through pad_mm's padding of the source dim, or upcasts
    if product is None:
        raise NoMatch("softmax weights feed neither a weighted sum nor a contraction")
    views = [product.result]  # the product and the single-user views after it
    while is_op(only_user_or_none(views[-1]), *LAYOUT_OPS):
        views.append(only_user(views[-1]))
    stops = {sources, x32, *_repeated_sources(product, sources, x32)}
    sides = _operand_layouts(product, stops=stops)
    div_like = p.args[0] if chain else p
    r = val(sources).dim()
    named = {}  # atoms of p's and the sources' dims, in the sources' dim numbering
    for k, (base, layout, _) in enumerate(sides):
        if base is div_like or _same_value(base, div_like) or base in (p,):
            named[k] = "p"
        else:
            _is_source(base, sources, x32)
            named[k] = "v"
    if sorted(named.values()) != ["p", "v"]:
        raise NoMatch("the contraction does not read the weights and the sources")

    def canon(group):
        return tuple(a[1] for a in group)

    def canon_p(group):  # the weights' dims in the sources' numbering
        return tuple(a[1] if pmap is None else pmap[a[1]] for a in group)

    (pa, pl, pc), (va, vl, vc) = (sides[0], sides[1]) if named[0] == "p" else (sides[1], sides[0])
    if not (canon_p(pl[2]) == (sd,) and canon(vl[2]) == (sd,) and canon_p(pl[0]) == canon(vl[0])
            and pl[1] == () and canon(vl[1]) == (r - 1,)
            and all(a[0] is pa for g in pl for a in g) and all(a[0] is va for g in vl for a in g)):
        raise NoMatch("the contraction is not over the source dim, row by row")
    rows, cols = ((pl[1], vl[1]) if named[0] == "p" else (vl[1], pl[1]))
    # The mix is the first view with the sources' layout without the source dim (later
    # views, e.g. a Linear's flattening of the mix, belong to its reader); batch atoms
    # come from both sides with equal dims: name them by the sources' dims.
    # With size-1 dims (T = 1) several views can have that layout: the last one is the
    # mix (the earlier ones are steps of the einsum's own view-back).
    want = [() if _one(s) else (i,) for i, s in enumerate(val(sources).shape) if i != sd]
    found = None
    for view in views:
        try:
            layout, out_chain = _result_layout(view, product, vl[0], rows, cols)
        except NoMatch:
            continue
        if [tuple(a[1] for a in g) for g in layout] == want and (
                found is None or tuple(val(view).shape) == tuple(val(found[0]).shape)):
            found = (view, out_chain)
    if found is None:
        raise NoMatch("the contraction's result is not the sources' layout without the source dim")
    total, out_chain = found
    if canon_p(pl[0]) != canon(vl[0]):
        raise NoMatch("the contraction's result is not the sources' layout without the source dim")
    extra = [] if va is sources or va is x32 else _is_source(va, sources, x32)
    return total, chain + pc + vc + [product.product, *product.nodes] + out_chain + extra


def _repeated_sources(product: UnpaddedProduct, sources: Node, x32: Node) -> list[Node]:
    """Repeats of the sources on the views into ``product`` (the mix's own
    ``torch.stack(sources)``): the layout walk stops there as at the sources, whose dims
    they have (walking on, a dim-0 stack's view of its cat splits a dim)."""
    found = []
    for x in (product.a, product.b):
        while is_op(x, *LAYOUT_OPS):
            if _same_value(x, sources) or _same_value(x, x32):
                found.append(x)
                break
            x = x.args[0]
    return found


def only_user_or_none(node: Node):
    found = users(node)
    return found[0] if len(found) == 1 else None


def _older_bank_version(bank: Node, n: int, sd: int) -> Node:
    """Skip writes of slots >= n (``select_scatter``): the first n slots are unchanged."""
    while (is_op(bank, aten.select_scatter.default) and _norm_dim(bank, bank.args[2]) == sd
           and isinstance(bank.args[3], int) and bank.args[3] >= n):
        bank = bank.args[0]
    return bank


def _bank_slice(blocks: Node, sd: int, n_want=None) -> Node:
    """``bank[:n]`` over the source dim (a step or a start is another tensor) -> bank."""
    dim, start, _, step = slice_args(blocks)
    if not (_norm_dim(blocks, dim) == sd and start in (0, None) and step == 1):
        raise NoMatch(f"blocks are bank[{start}::{step}] over dim {dim}, not a leading "
                      f"slice bank[:n] of the source dim")
    return blocks.args[0]


def _source_layout(sources: Node, sd: int
                   ) -> tuple[Node, list[Node] | None, Node | None, int, list[Node]]:
    """Sources stacked / sliced on dim ``sd`` -> (prefix, blocks or None, bank or None,
    num_blocks, nodes)."""
    shape = val(sources).shape
    r = len(shape)
    width = shape[-1]
    rest = tuple(s for i, s in enumerate(shape) if i != sd)
    if is_op(sources, aten.permute.default):
        # stack(items).movedim(0, sd): a stack over another dim, only that dim moved (the
        # others keep their order); the op reads the items, not the stacked tensor.
        perm = [d % r for d in sources.args[1]]
        inner_sd = perm[sd % r]
        if [p for i, p in enumerate(perm) if i != sd % r] != [i for i in range(r) if i != inner_sd]:
            raise NoMatch("sources are permuted beyond moving the source dim")
        prefix, blocks, _, n, nodes = _source_layout(sources.args[0], inner_sd)
        if blocks is None:
            raise NoMatch("a permuted tensor bank (only stacks are moved)")
        return prefix, blocks, None, n, nodes + [sources]
    if is_op(sources, aten.unsqueeze.default) and _norm_dim(sources, sources.args[1]) == sd:
        return sources.args[0], [], None, 0, [sources]  # a single source: the prefix
    if (is_op(sources, *RESHAPES) and not is_op(sources.args[0], aten.cat.default)
            and _one(shape[sd]) and tuple(val(sources.args[0]).shape) == rest):
        return sources.args[0], [], None, 0, [sources]  # stack([prefix], sd) as a view
    if is_op(sources, *RESHAPES) and is_op(sources.args[0], aten.cat.default):
        # stack(items, sd) lowers to cat(items, sd) viewed as [..., S, item dim sd, ...]
        cat = sources.args[0]
        items = list(cat.args[0])
        dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
        item_shape = tuple(val(items[0]).shape) if items else ()
        if not (items and len(item_shape) == r - 1 and all(
                tuple(val(i).shape) == item_shape for i in items)
                and _norm_dim(items[0], dim) == sd and item_shape == rest
                and shape[sd] == len(items)):
            raise NoMatch("sources are not a stack over the source dim")
        return items[-1], items[:-1], None, len(items) - 1, [cat, sources]
    if is_op(sources, aten.cat.default):
        dim = sources.args[1] if len(sources.args) > 1 else sources.kwargs.get("dim", 0)
        if _norm_dim(sources, dim) != sd:
            raise NoMatch("sources are concatenated over another dim")
        parts = list(sources.args[0])
        if len(parts) != 2:
            raise NoMatch("tensor-bank sources are not [bank slice, prefix]")
        blocks, last = parts
        if is_op(last, aten.unsqueeze.default) and _norm_dim(last, last.args[1]) == sd:
            prefix, last_nodes = last.args[0], [last]
        elif _one(val(last).shape[sd]):
            # any value with a size-1 dim there is the prefix with that dim inserted (a
            # view ``h.view(-1, 1, H)``, its fp32 copy): the op reads ``last.squeeze(sd)``
            # (``_prefix_in``); ``last`` itself stays, read by the op
            prefix, last_nodes = last, []
        else:
            raise NoMatch("last source is not the prefix")
        n = int(val(blocks).shape[sd])
        if is_op(blocks, aten.slice.Tensor):
            bank, nodes = _bank_slice(blocks, sd), [sources, blocks, *last_nodes]
        else:  # the slice of the whole bank was simplified away
            bank, nodes = blocks, [sources, *last_nodes]
        return prefix, None, _older_bank_version(bank, n, sd), n, nodes
    # a preallocated bank holding the prefix in its slot n: bank[n] = prefix; bank[:n + 1]
    written, nodes = sources, []
    if is_op(sources, aten.slice.Tensor):
        written, nodes = _bank_slice(sources, sd), [sources]
    if is_op(written, aten.select_scatter.default):
        n = int(shape[sd]) - 1
        if not (_norm_dim(written, written.args[2]) == sd and written.args[3] in (n, n - int(
                val(written).shape[sd]))):
            raise NoMatch("the prefix is not written to the slot after the blocks")
        prefix = written.args[1]
        bank = _older_bank_version(written.args[0], n, sd)
        return prefix, None, bank, n, nodes
    raise NoMatch("sources are neither a stack of blocks and prefix nor a bank slice + prefix")


def _stacked_parts(logits: Node, d: int) -> tuple[list[Node], list[Node]] | None:
    """``torch.stack(parts, d)`` as aten writes it: ``cat([p.unsqueeze(d), ...], d)``, or
    for ``d = 0`` ``cat(parts).view(n, *shape)`` -> (parts, nodes); None for anything else."""
    if is_op(logits, *RESHAPES) and d == 0 and is_op(logits.args[0], aten.cat.default):
        cat = logits.args[0]
        parts = list(cat.args[0])
        if (len(cat.args) < 2 or cat.args[1] == 0) and parts and all(
                isinstance(q, Node) and tuple(val(q).shape) == tuple(val(logits).shape[1:])
                for q in parts) and val(logits).shape[0] == len(parts):
            return parts, [logits, cat]
        return None
    if is_op(logits, aten.cat.default) and len(logits.args) > 1 \
            and _norm_dim(logits, logits.args[1]) == d:
        ups = list(logits.args[0])
        if ups and all(is_op(u, aten.unsqueeze.default) and _norm_dim(u, u.args[1]) == d
                       for u in ups):
            return [u.args[0] for u in ups], [logits, *ups]
    return None


def _per_source_sum(p: Node, sources: list[Node], x32s: list[Node], d: int
                    ) -> tuple[Node, list[Node]]:
    """``p[0][..., None] * v_0 + p[1][..., None] * v_1 + ...`` (each weight read by its
    index, the sum in any order, from zeros or not) -> (the sum, nodes)."""
    nodes, terms = [], {}
    for sel in users(p):
        if not (is_op(sel, aten.select.int) and _norm_dim(p, sel.args[1]) == d
                and isinstance(sel.args[2], int) and 0 <= sel.args[2] < len(sources)
                and sel.args[2] not in terms):
            raise NoMatch("softmax weights are read other than one source each")
        up = only_user(sel)
        if not (is_op(up, aten.unsqueeze.default) and _dim_is(up, up.args[1], -1)):
            raise NoMatch("a source's weight is not unsqueezed over the hidden dim")
        term = only_user(up)
        i = sel.args[2]
        if not is_op(term, _MUL):
            raise NoMatch("a source's weight does not scale it")
        try:
            nodes += _is_source(operands(term, up), sources[i], x32s[i])
        except NoMatch:
            raise NoMatch(f"weight {i} does not scale source {i}") from None
        if val(term).shape != val(sources[i]).shape:
            raise NoMatch("softmax weights broadcast over the sources")
        terms[i] = term
        nodes += [sel, up, term]
    if len(terms) != len(sources):
        raise NoMatch("not every source is mixed")

    def leaves(node, inner: list[Node]) -> list[Node]:
        """The terms a sum adds (its zeros and adds go to ``inner``)."""
        if node in terms.values():
            return [node]
        if is_op(node, aten.full.default) and node.args[1] == 0:
            inner.append(node)
            return []
        if is_op(node, aten.add.Tensor) and node.kwargs.get("alpha", 1) == 1:
            inner.append(node)
            return leaves(node.args[0], inner) + leaves(node.args[1], inner)
        raise NoMatch("not a sum of weighted sources")

    total = terms[0]
    while True:  # up to the last add that adds weighted sources only
        up = users(total)
        if len(up) != 1 or not is_op(up[0], aten.add.Tensor):
            break
        try:
            leaves(up[0], [])
        except NoMatch:
            break
        total = up[0]
    inner: list[Node] = []
    if sorted(leaves(total, inner), key=id) != sorted(terms.values(), key=id):
        raise NoMatch("the sum misses or repeats a weighted source")
    return total, nodes + inner


def _match_per_source(div: Node, stacked: tuple[list[Node], list[Node]], sd: int,
                      nodes: list[Node]) -> AttnResSite:
    """A read that norms and projects each source on its own and stacks only the logits
    (``stacked``: :func:`_stacked_parts`'s parts and nodes):
    ``softmax(stack([w . RMSNorm(v) for v in sources]), d)``, mixed as ``sum_i p[i] * v_i``
    (Megatron-derived and community "two-pass" forms). The op reads the sources as a list
    bank: the older ones its blocks, the newest its prefix."""
    parts, stack_nodes = stacked
    read = [_projection(part) for part in parts]
    norms = [_key_norm(keys) for keys, _, _ in read]
    proj_w, (_, norm_w, eps, _, _) = read[0][1], norms[0]
    for (_, q, _), (_, w, e, _, _) in zip(read, norms):
        if not (_same_value(q, proj_w) and (w is norm_w or _same_value(w, norm_w))
                and e == eps):
            raise NoMatch("sources are read with different queries, norm weights or eps")
    sources = [n[0] for n in norms]
    x32s = [n[3] for n in norms]
    shape, dtype = tuple(val(sources[0]).shape), dtype_of(sources[0])
    if any(tuple(val(v).shape) != shape or dtype_of(v) != dtype for v in sources):
        raise NoMatch("sources differ in shape or dtype")
    if any(val(k).dim() != val(part).dim() + 1 for (k, _, _), part in zip(read, parts)):
        raise NoMatch("keys are not the logits' rows")
    p, cast = div, []
    if len(users(div)) == 1 and is_op(users(div)[0], _CAST):  # probs.to(v.dtype)
        p = users(div)[0]
        if p.args[1] not in (dtype, torch.float32):
            raise NoMatch(f"softmax weights rounded to {p.args[1]}")
        cast = [p]
    mixed, mix_nodes = _per_source_sum(p, sources, x32s, sd)
    if dtype_of(mixed) != dtype:  # an fp32 sum: cast back, or a dropped round trip
        user = only_user_or_none(mixed)
        if is_op(user, _CAST) and user.args[1] == dtype:
            mixed = user
            mix_nodes.append(user)
        elif dtype_of(mixed) != torch.float32:
            raise NoMatch(f"mix in {dtype_of(mixed)}")
    nodes = list(dict.fromkeys(nodes + stack_nodes + cast + mix_nodes
                               + [n for _, _, more in read for n in more]
                               + [n for *_, more in norms for n in more]))
    leaks = external_users(nodes, mixed)
    if leaks:
        inner, user = leaks[0]
        raise NoMatch(f"intermediate {inner.name} is also read by {user.name}")
    return AttnResSite(prefix=sources[-1], blocks=sources[:-1], bank=None,
                       num_blocks=len(sources) - 1, norm_w=norm_w, proj_w=proj_w, eps=eps,
                       mixed=mixed, nodes=nodes, src_dim=len(shape) - 1)


def match_attn_res(div: Node) -> AttnResSite:
    """Describe the AttnRes site whose softmax ends at ``div``, or raise NoMatch."""
    logits, sd, nodes = _softmax(div)
    logits, shift_nodes = _minus_max(logits, sd)
    if shift_nodes:  # l - max(l) in the model dtype, then .float(): read through both
        pass
    elif is_op(logits, _CAST) and logits.args[1] == torch.float32:
        raw, shift_nodes = _minus_max(logits.args[0], sd)
        if shift_nodes:
            shift_nodes = [logits] + shift_nodes
            logits = raw
    try:
        keys, proj_w, proj_nodes = _projection(logits)
    except NoMatch:
        raw = logits.args[0] if is_op(logits, _CAST) and logits.args[1] == torch.float32 \
            else logits
        stacked = _stacked_parts(raw, sd)
        if stacked is None:
            raise
        return _match_per_source(div, stacked, sd, nodes + shift_nodes + ([logits] if raw
                                                                           is not logits else []))
    sources, norm_w, eps, x32, key_nodes = _key_norm(keys)
    # logits permuted with the projection's unit dim moved: their dims -> the keys' dims
    pmap = _unit_moved(logits.args[0] if is_op(logits, _CAST) and logits.args[1] == torch.float32
                       else logits)
    if pmap is not None and val(keys).dim() == val(logits).dim():
        if pmap[sd] is None:
            raise NoMatch("softmax over the projection's unit dim")
        sd = pmap[sd]
    elif val(keys).dim() != val(logits).dim() + 1:  # rows normed flat, logits reshaped back
        pmap = None
        sources, flat_nodes = _flattened_rows(sources, logits)
        key_nodes += flat_nodes
    else:
        pmap = None
    r = val(sources).dim()
    if sd >= r - 1:
        raise NoMatch("softmax over the hidden dim, not the sources")
    mixed, mix_nodes = _mix(div, sources, x32, sd, pmap)
    prefix, blocks, bank, n, source_nodes = _source_layout(sources, sd)
    nodes += shift_nodes + proj_nodes + key_nodes + mix_nodes + source_nodes

    width = val(sources).shape[-1]
    if val(proj_w).numel() != width or (norm_w is not None and val(norm_w).shape[0] != width):
        raise NoMatch("weights do not match the hidden width")
    rest = tuple(s for i, s in enumerate(val(sources).shape) if i != sd)
    unit_dim = sd if val(prefix).dim() == r else None  # the prefix as the sources hold it
    shape = tuple(s for i, s in enumerate(val(prefix).shape) if i != unit_dim)
    if shape != rest or dtype_of(prefix) != dtype_of(sources):
        raise NoMatch("prefix shape or dtype differs from the sources")
    if bank is not None and (val(bank).dim() != r or dtype_of(bank) != dtype_of(sources)
                             or tuple(s for i, s in enumerate(val(bank).shape) if i != sd)
                             != rest):
        raise NoMatch("bank shape or dtype differs from the sources")
    nodes = list(dict.fromkeys(nodes))
    leaks = external_users(nodes, mixed)
    if leaks:
        inner, user = leaks[0]
        raise NoMatch(f"intermediate {inner.name} is also read by {user.name}")
    return AttnResSite(prefix=prefix, blocks=blocks, bank=bank, num_blocks=n, norm_w=norm_w,
                       proj_w=proj_w, eps=eps, mixed=mixed, nodes=nodes, src_dim=sd,
                       prefix_unit_dim=unit_dim)


def _delta_of(prefix: Node) -> tuple[Node, Node] | None:
    """``prefix = prev + delta`` in the prefix dtype, no broadcasting -> (prev, delta)."""
    if not (is_op(prefix, aten.add.Tensor) and prefix.kwargs.get("alpha", 1) == 1):
        return None
    prev, delta = prefix.args
    if not all(isinstance(t, Node) and isinstance(val(t), torch.Tensor) for t in (prev, delta)):
        return None
    if any(val(t).shape != val(prefix).shape or val(t).dtype != val(prefix).dtype for t in (prev, delta)):
        return None
    return prev, delta


_call = insert_call


def _unit_weight(graph: Graph, like: Node, width) -> Node:
    """The weight 1 of an unweighted key norm, as a node Inductor lowers (``full``)."""
    v = val(like)
    return insert_call(graph, aten.full.default, ([width], 1.0),
                       {"dtype": v.dtype, "device": v.device, "pin_memory": False})


class _BlockStacks:
    """One ``stack(blocks, -2)`` per distinct list of block tensors, shared by its sites."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.stacks: dict[tuple[Node, ...], Node] = {}

    def get(self, blocks: list[Node], prefix: Node, point: Node) -> Node:
        key = tuple(blocks)
        if key in self.stacks and getattr(self.stacks[key], "_erased", False):
            del self.stacks[key]  # built for a site whose rewrite was rolled back
        if key in self.stacks:
            hoist_before(self.graph, [self.stacks[key]], point)  # no-op when already earlier
        else:
            g = self.graph
            with g.inserting_before(point):
                if blocks:
                    parts = [_call(g, aten.unsqueeze.default, (b, -2)) for b in blocks]
                    self.stacks[key] = _call(g, aten.cat.default, (parts, -2))
                else:  # no blocks: any [..., 0+, H] tensor of the right dtype will do
                    return _call(g, aten.unsqueeze.default, (prefix, -2))
        return self.stacks[key]


@dataclass
class _Rewrite:
    """Everything the rewrite of one site needs, checked before the graph is touched."""

    site: AttnResSite
    prefix_in: Node           # the prefix before the folded add (or the prefix itself)
    delta: Node | None
    out_norm: RMSNormMatch | None
    outputs: list[Node]       # values the op replaces: [out] or [out, updated prefix]
    erase: set[Node]          # nodes the op makes dead
    point: Node               # the op goes right before this node
    size_reads: list


def _plan(graph: Graph, site: AttnResSite, by_input: dict[Node, RMSNormMatch],
          claimed: set[Node]) -> _Rewrite:
    """Decide the folds and check the op accepts the site; raises NoMatch saying why not."""
    out_norm = by_input.get(site.mixed)
    if out_norm is not None and (any(u not in out_norm.nodes for u in users(site.mixed))
                                 or out_norm.out in claimed
                                 or out_norm.x_round != (dtype_of(site.prefix)
                                                         if site.round_dropped else None)):
        out_norm = None  # the mix is read elsewhere too (an fp32 norm reads it twice: fine)
    if site.round_dropped and out_norm is None:
        raise NoMatch(f"the mix stays fp32 (not rounded to {dtype_of(site.prefix)}) into "
                      "something other than an RMSNorm of its rounding")
    handoff = _delta_of(site.prefix) if site.prefix_unit_dim is None else None
    older = site.blocks if site.blocks is not None else [site.bank]
    if handoff and any(depends_on(b, [site.prefix]) for b in older):
        # The updated prefix is also an older source (``blocks.append(partial)`` before the
        # stack, or CSE of two equal adds): the op would read its own output. Keep the add.
        handoff = None
    prefix_in, delta = handoff if handoff else (site.prefix, None)
    outputs = [site.mixed if out_norm is None else out_norm.out] + ([site.prefix] if delta else [])
    inside = set(site.nodes) | set(out_norm.nodes if out_norm else ())
    erase = inside | ({site.prefix} if delta else set())
    order = {n: i for i, n in enumerate(graph.nodes)}
    readers = [u for o in outputs for u in o.users if u not in inside]
    if not readers:
        raise NoMatch("result unused")
    # Size reads of the chain (dynamic shapes) move to its inputs, defined before them.
    size_reads = plan_size_reads(erase, [prefix_in, delta, *(site.blocks or []), site.bank])
    plan = _Rewrite(site, prefix_in, delta, out_norm, outputs, erase,
                    min(readers, key=order.__getitem__), size_reads)
    try:  # the op's own checks (dtypes, strides, devices), on fake values
        if site.blocks:  # what _BlockStacks will build: the blocks stacked on dim -2
            bank = fake_call(aten.cat.default, (
                [fake_call(aten.unsqueeze.default, (b, -2)) for b in site.blocks], -2))
        elif site.blocks is not None:
            bank = fake_call(aten.unsqueeze.default, (prefix_in, -2))
        else:
            bank = fake_call(aten.permute.default, (site.bank, _to_sources_last(site)))
        proj = fake_call(aten.view.default, (site.proj_w, [val(site.proj_w).shape[-1]]))
        norm_w = (site.norm_w if site.norm_w is not None
                  else val(plan.prefix_in).new_ones([_width(site)]))  # what _unit_weight builds
        prefix = (plan.prefix_in if site.prefix_unit_dim is None
                  else fake_call(aten.squeeze.dim, (plan.prefix_in, site.prefix_unit_dim)))
        fake_call(torch.ops.k3fusion.attn_res.default, _op_args(plan, bank, proj, norm_w, prefix))
    except (TypeError, ValueError) as e:
        raise NoMatch(f"the fused op refuses these inputs: {e}") from None
    return plan


def _width(site: AttnResSite) -> int:
    return val(site.prefix).shape[-1]


def _to_sources_last(site: AttnResSite) -> list[int]:
    """The permutation that views a bank ``[..., S at src_dim, ..., H]`` as ``[..., S, H]``
    (the identity for a sources-last bank): the op reads it in place through its strides."""
    r = val(site.bank).dim()
    dims = [d for d in range(r - 1) if d != site.src_dim]
    return dims + [site.src_dim, r - 1]


def _op_args(plan: _Rewrite, bank, proj, norm_w, prefix) -> tuple:
    site, norm = plan.site, plan.out_norm
    eps, eps_t = eps_op_args(site.eps)
    out_eps, out_eps_t = eps_op_args(norm.eps) if norm else (1e-6, None)
    return (prefix, bank, site.num_blocks, norm_w, proj, eps, plan.delta,
            norm.weight if norm else None, out_eps, norm.weight_in_fp32 if norm else False,
            eps_t, out_eps_t)


def _rewrite(graph: Graph, plan: _Rewrite, stacks: _BlockStacks) -> Node:
    """Insert the op for ``plan`` and erase what it replaces; -> the op's node."""
    site = plan.site
    needed = [plan.prefix_in, site.proj_w] + ([plan.delta] if plan.delta else [])
    needed += [site.norm_w] if site.norm_w is not None else []
    needed += site.blocks if site.blocks is not None else [site.bank]
    hoist_before(graph, needed, plan.point)  # raises NoMatch before changing anything
    with all_or_nothing(graph), graph.inserting_before(plan.point):
        bank = (stacks.get(site.blocks, plan.prefix_in, plan.point) if site.blocks is not None
                else site.bank)
        if site.blocks is None and _to_sources_last(site) != list(range(val(site.bank).dim())):
            bank = _call(graph, aten.permute.default, (bank, _to_sources_last(site)))
        proj = _call(graph, aten.view.default, (site.proj_w, [val(site.proj_w).shape[-1]]))
        norm_w = site.norm_w
        if norm_w is None:  # an unweighted key norm: weight 1
            norm_w = _unit_weight(graph, plan.prefix_in, _width(site))
        prefix = plan.prefix_in
        if site.prefix_unit_dim is not None:  # the prefix as the sources hold it: [.., 1, ..]
            prefix = _call(graph, aten.squeeze.dim, (prefix, site.prefix_unit_dim))
        node = _call(graph, torch.ops.k3fusion.attn_res.default,
                     _op_args(plan, bank, proj, norm_w, prefix))
        results = [_call(graph, operator.getitem, (node, i)) for i in range(len(plan.outputs))]
    for old, new in zip(plan.outputs, results):
        old.replace_all_uses_with(new, delete_user_cb=lambda user: user not in plan.erase)
    apply_size_reads(plan.size_reads)
    erase_unused(graph, plan.erase)
    return node


def _miss(div: Node, why: str) -> str:
    """The debug log's line for a softmax left alone (read back by :data:`MISS_LINE`)."""
    return f"AttnRes site not fused: softmax {div.name}: {why}"


MISS_LINE = re.compile(r"^AttnRes site not fused: softmax (\S+): (.*)$")


def fuse_attn_res(graph: Graph, norms: list[RMSNormMatch]) -> FusionResult:
    """Replace every AttnRes site. Counts the sites fused and, when there are any, the
    layer hand-offs among their folded deltas (:data:`HANDOFF_NAME`, see
    :func:`count_handoffs`); claims each site's key norm and output norm."""
    claimed: set[Node] = set()
    # (a norm whose fp32 input lost its 16-bit round trip, x_round, folds only into a site
    # whose mix lost it: _plan)
    by_input = {m.x: m for m in norms}
    stacks = _BlockStacks(graph)
    fused, misses = 0, []
    sites: dict[Node, Node | None] = {}  # every recognized site -> the delta it folded
    for div in [n for n in graph.nodes if is_op(n, aten.div.Tensor)]:
        try:
            site = match_attn_res(div)
        except NoMatch as e:
            if is_op(div.args[0], aten.exp.default):  # a softmax: say why it is not a site
                misses.append(_miss(div, str(e)))
            continue
        except Exception as e:  # noqa: BLE001  a form the matcher did not foresee: a miss,
            # never a failed compile (matching only reads the graph)
            misses.append(_miss(div, f"not understood ({type(e).__name__}: {e})"))
            continue
        try:
            plan = _plan(graph, site, by_input, claimed)
            node = _rewrite(graph, plan, stacks)
        except NoMatch as e:
            misses.append(_miss(div, str(e)))
            sites[site.mixed] = None  # still a site of the chain (untouched, no fold)
            continue
        sites[node] = plan.delta
        claimed |= plan.erase  # the key norm and the output norm are part of the site now
        fused += 1
    handoffs = count_handoffs(graph, sites) if fused else 0
    counts = {FUSION_NAME: fused, **({HANDOFF_NAME: handoffs} if handoffs else {})}
    return FusionResult(counts, frozenset(m.out for m in norms if m.out in claimed),
                        tuple(misses))


def _longest_chains(graph: Graph, sites) -> tuple[dict[Node, int], dict[Node, int], dict[Node, int]]:
    """-> (sites before, sites after, reach): for each site the most sites on one data
    path before it / after it; ``reach[n]``: the most sites on one path into ``n`` (``n``
    included), i.e. 0 for a node computed from no site."""
    reach, before = {}, {}
    for n in graph.nodes:
        r = max((reach[i] for i in n.all_input_nodes), default=0)
        if n in sites:
            before[n] = r
            r += 1
        reach[n] = r
    down, after = {}, {}
    for n in reversed(graph.nodes):
        r = max((down[u] for u in n.users), default=0)
        if n in sites:
            after[n] = r
            r += 1
        down[n] = r
    return before, after, reach


def count_handoffs(graph: Graph, sites: dict[Node, Node | None]) -> int:
    """How many of the folded deltas are a layer's closing ``prefix + mlp_out``.

    ``sites``: every site of the graph (the fused op node, or an unfused site's mix) ->
    the delta folded into it (None: no fold).

    The criterion is the chain the sites form: a K3 decoder runs two sites per layer
    (attention-side, then MLP-side), each reading the previous one's result (its output
    through the sublayer, as the delta or the restarted prefix, and the prefix stream),
    and the final site after the last layer. Counting sites along the longest data path,
    the attention-side sites and the final one are those an even number of sites from
    *both* ends (the chain of a whole model has 2L + 1 sites); a fold there whose delta is
    computed from the site just before (the MLP output) is the hand-off. The add can be
    written at the end of a layer or inside the next layer's AttnRes step: same graph.
    A graph cut inside a layer (a graph break, one layer compiled alone) or a site in
    the chain that was not recognized gives a chain whose ends disagree (an even number
    of sites): it counts nothing rather than take a layer's own ``prefix + attn_out``
    for a hand-off. The first site of a graph has no site before it: not counted.
    """
    before, after, reach = _longest_chains(graph, sites)
    n = 0
    for site, delta in sites.items():
        depth = before.get(site)  # (None: no longer in the graph)
        if (delta is not None and depth and depth % 2 == 0 and after[site] % 2 == 0
                and reach.get(delta) == depth):
            n += 1
    return n


#: AttnRes claims first (docs/architecture.md, "Claims between fusions"): its key norms
#: and the output norm that reads its mix are part of the site.
FUSION = Fusion(name=FUSION_NAME, switch="attn_res", claim_priority=10, run=fuse_attn_res,
                count_names=(FUSION_NAME, HANDOFF_NAME), miss_kind="AttnRes step (softmax)",
                miss_line=MISS_LINE)
