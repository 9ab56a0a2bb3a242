"""Small FX helpers shared by the pattern modules (matching is structural, on aten ops)."""

from __future__ import annotations

import contextlib
import contextvars
import operator
from typing import Callable, Iterable, Iterator, NamedTuple

import torch
from torch.fx import Graph, Node

aten = torch.ops.aten
prims = torch.ops.prims

__all__ = [
    "NoMatch", "aten", "prims", "is_op", "strip_casts", "matmul_operands", "val", "dtype_of", "operands", "only_user",
    "is_graph_input", "depends_on", "external_users", "hoist_before", "fake_call",
    "erase_unused", "VIEW_OPS", "RESHAPES", "plan_size_reads", "apply_size_reads",
    "row_padded", "through_row_padding", "unpad_product", "UnpaddedProduct",
    "unpadded_result", "decomposed_product", "product_of_result", "product_reading", "slice_args", "keepdim_of",
    "LAYOUT_OPS", "view_layout", "same_size", "inductor_lowers", "insert_call", "all_or_nothing",
    "snapshot", "restore", "CHANGE_HOOK", "before_change",
    "SavedValues", "saved_for_backward", "saving", "users", "is_backward_graph",
    "joint_backward_values", "recompute_in_backward",
]

# Reshapes (what a Linear's [B, S, K] -> [T, K] flattening lowers to).
RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)

# Ops that only reinterpret memory: walking through them keeps "the same value".
VIEW_OPS = frozenset({
    aten.view.default, aten.reshape.default, aten._unsafe_view.default,
    aten.slice.Tensor, aten.squeeze.dim, aten.squeeze.default, aten.unsqueeze.default,
    aten.split_with_sizes.default, aten.split.Tensor, operator.getitem,
})


class NoMatch(Exception):
    """A candidate site does not have the expected form; the message says why."""


def is_op(node: object, *targets) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def val(node: Node):
    """The fake tensor (or SymInt) the node computes, as traced."""
    v = node.meta.get("val") if isinstance(node, Node) else None
    if v is None:
        raise NoMatch(f"{getattr(node, 'name', node)} has no traced value")
    return v


def dtype_of(node: Node) -> torch.dtype:
    v = val(node)
    if not isinstance(v, torch.Tensor):
        raise NoMatch(f"{node.name} is not a tensor")
    return v.dtype


def operands(node: Node, other: Node) -> object:
    """For a binary commutative ``node`` known to read ``other``: its other operand."""
    a, b = node.args[0], node.args[1]
    if a is other and b is not other:
        return b
    if b is other and a is not other:
        return a
    raise NoMatch(f"{node.name} does not read {other.name} exactly once")


def slice_args(node: Node) -> tuple:
    """``aten.slice.Tensor``'s (dim, start, end, step), defaults filled in."""
    args = list(node.args[1:]) + [None] * 4
    dim, start, end, step = args[:4]
    dim = node.kwargs.get("dim", 0 if dim is None else dim)
    start = node.kwargs.get("start", start)
    end = node.kwargs.get("end", end)
    step = node.kwargs.get("step", 1 if step is None else step)
    return dim, start, end, step


def keepdim_of(node: Node) -> bool:
    """The keepdim argument of a reduction ``op(x, dims, keepdim=False, ...)``."""
    return bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))


def strip_casts(node: object) -> object:
    while is_op(node, prims.convert_element_type.default):
        node = node.args[0]
    return node


def row_padded(node: object) -> Node | None:
    """``h`` when ``node`` is ``constant_pad_nd(h, [0, 0, 0, p])`` (rows appended to a 2-D
    ``h``), else None. Inductor's ``pad_mm`` pads a 16-bit GEMM's rows to a multiple of 8
    this way where its benchmark favours it -- a timing, so one compile may see the
    padded form and the next not."""
    if not (is_op(node, aten.constant_pad_nd.default) and val(node.args[0]).dim() == 2):
        return None
    widths = list(node.args[1])
    return node.args[0] if len(widths) == 4 and widths[:3] == [0, 0, 0] else None


def through_row_padding(node: object, chain: list[Node]) -> tuple[object, object]:
    """``(mm, h)`` for Inductor's row padding of a GEMM, ``(node, None)`` for anything else:
    ``slice(mm(constant_pad_nd(h, [0, 0, 0, p]), wt), 0, 0, -p)`` (``pad_mm``) computes
    ``mm(h, wt)`` row for row. The slice and the pad go into ``chain``."""
    if not is_op(node, aten.slice.Tensor):
        return node, None
    mm, dim, start, end, step = (list(node.args) + [0, None, None, 1][len(node.args) - 1:])[:5]
    h = row_padded(mm.args[0]) if is_op(mm, aten.mm.default) else None
    if h is None:
        return node, None
    # The slice keeps exactly h's rows, the first ones (the pad appended the others).
    if not (dim in (0, -2) and start in (0, None) and step == 1 and end is not None
            and val(node).shape[0] == val(h).shape[0]):
        return node, None
    chain += [node, mm.args[0]]
    return mm, h


def _end_padding(node: object) -> tuple[object, list[int]]:
    """``(x, [pad after the last dim, after the one before, ...])`` for a zero
    ``constant_pad_nd(x, pad)`` that pads only at the ends; ``(node, [])`` for anything else."""
    if not is_op(node, aten.constant_pad_nd.default):
        return node, []
    value = node.args[2] if len(node.args) > 2 else node.kwargs.get("value", 0)
    pad = list(node.args[1])
    if value != 0 or any(pad[i] != 0 for i in range(0, len(pad), 2)):
        return node, []
    return node.args[0], pad[1::2]


class UnpaddedProduct(NamedTuple):
    """A ``mm``/``bmm`` seen through Inductor's rewrites of it: ``a @ b`` (``batched``:
    a ``bmm``); ``result`` the node holding that product (after ``pad_mm``'s slices back,
    or a decomposition's cast back); ``product`` the GEMM node (a decomposition's sum);
    ``nodes`` the other nodes of the rewrite (pads, slices, casts, unsqueezes, the mul)."""

    product: Node
    a: Node
    b: Node
    result: Node
    nodes: list[Node]
    batched: bool = False


def unpad_product(product: Node) -> UnpaddedProduct:
    """``pad_mm``'s form of ``a @ b`` (it pads 16-bit GEMMs to multiples of 8 where its
    benchmark says so -- a timing, so one compile may see it and the next not)::

        c = mm(constant_pad_nd(a, [0, k, 0, m]), constant_pad_nd(b, [0, n, 0, k]))
        c = c[:-m, :][:, :-n]                            # the rows / cols sliced back

    (``bmm`` alike, with a batch dim): the padded terms of the inner dim are zeros, so this
    computes ``a @ b``. Unpadded products come back as they are; anything else padded is
    ``NoMatch``."""
    a, pa = _end_padding(product.args[0])
    b, pb = _end_padding(product.args[1])
    k, m = (pa + [0, 0])[:2]
    n, kb = (pb + [0, 0])[:2]
    if any(pa[2:] + pb[2:]) or k != kb:
        raise NoMatch(f"{product.name}: operands padded other than pad_mm pads them")
    nodes = [x for x, base in ((product.args[0], a), (product.args[1], b)) if x is not base]
    result = product
    for pad, dim in ((m, -2), (n, -1)):
        if not pad:
            continue
        cut = only_user(result)
        rank = val(result).dim()
        d, start, end, step = slice_args(cut) if is_op(cut, aten.slice.Tensor) else (None,) * 4
        if not (d in (dim, rank + dim) and start in (0, None) and step == 1
                and end in (-pad, val(result).shape[dim] - pad)):
            raise NoMatch(f"{product.name}: padded, but not sliced back to its size")
        nodes.append(cut)
        result = cut
    return UnpaddedProduct(product, a, b, result, nodes, is_op(product, aten.bmm.default))


def _fp32_operand(node: object, nodes: list[Node]) -> object:
    """``node`` before the fp32 upcast ``pw_cast_for_opmath`` puts on a 16-bit operand."""
    if is_op(node, prims.convert_element_type.default) and node.args[1] == torch.float32:
        nodes.append(node)
        return node.args[0]
    return node


def decomposed_product(node: object, rounded: bool = True) -> UnpaddedProduct | None:
    """Inductor's decomposition of a skinny GEMM on GPUs under coordinate-descent tuning
    (``mode="max-autotune"``), when ``node`` is its result: one row or one column, in
    fp32 (16-bit operands upcast, the sum cast back)::

        bmm: (a.unsqueeze(-1) * b.unsqueeze(1)).sum(2)     # [B, M, K] @ [B, K, N]
        mm:  (a.unsqueeze(2) * b.unsqueeze(0)).sum(1)      # [M, K] @ [K, N]

    None for anything else, and (``rounded``) where the product is not rounded as the
    GEMM's: upcast 16-bit operands with no cast back, or one not upcast (Inductor drops a
    cast pair between two GEMMs, torch 2.11)."""
    nodes: list[Node] = []
    total = node
    if is_op(total, prims.convert_element_type.default):
        nodes.append(total)
        total = total.args[0]
    if not (is_op(total, aten.sum.dim_IntList) and not keepdim_of(total)
            and total.kwargs.get("dtype") is None and isinstance(total.args[0], Node)
            and is_op(total.args[0], aten.mul.Tensor) and len(total.args[0].args) == 2):
        return None
    mul = total.args[0]
    (dim,), rank = list(total.args[1]), val(mul).dim()
    batched = rank == 4 and dim in (2, -2)
    if not (batched or (rank == 3 and dim in (1, -2))):
        return None
    at_a, at_b = (3, 1) if batched else (2, 0)  # where each operand gets its new dim
    x, y = mul.args
    for first, second in ((x, y), (y, x)):
        if all(is_op(u, aten.unsqueeze.default) and u.args[1] % rank == d
               for u, d in ((first, at_a), (second, at_b))):
            a = _fp32_operand(first.args[0], nodes)
            b = _fp32_operand(second.args[0], nodes)
            if val(a).dim() == val(b).dim() == rank - 1 and (not rounded or nodes == [] or (
                    val(node).dtype == val(a).dtype == val(b).dtype)):
                return UnpaddedProduct(total, a, b, node,
                                       nodes + [first, second, mul], batched)
    return None


def product_of_result(node: object) -> UnpaddedProduct | None:
    """The GEMM whose result ``node`` is: a ``mm``/``bmm`` (through ``pad_mm``'s padding,
    :func:`unpad_product`: ``node`` its last slice back) or its decomposition
    (:func:`decomposed_product`); None when ``node`` is no GEMM's result."""
    return unpadded_result(node) or decomposed_product(node)


def product_reading(node: Node) -> UnpaddedProduct | None:
    """The GEMM that reads ``node`` as an operand (its only reader, through ``pad_mm``'s
    pad or a decomposition's upcast and unsqueeze); None when no GEMM does."""
    n = node
    for _ in range(3):
        if is_op(n, aten.mm.default, aten.bmm.default):
            return unpad_product(n)
        if is_op(n, aten.mul.Tensor):
            total = only_user(n)
            after = users(total)
            result = after[0] if len(after) == 1 and is_op(
                after[0], prims.convert_element_type.default) else total
            product = decomposed_product(result)
            if product is None and result is not total:
                product = decomposed_product(total)
            return product
        if not is_op(n, aten.constant_pad_nd.default, aten.unsqueeze.default,
                     prims.convert_element_type.default):
            return None
        n = only_user(n)
    return None


def unpadded_result(node: object) -> UnpaddedProduct | None:
    """The :func:`unpad_product` of the ``mm``/``bmm`` whose result ``node`` is: the GEMM
    itself (``NoMatch`` where it is padded other than ``pad_mm`` pads), or its last slice
    back; None for any other node."""
    product = node
    for _ in range(2):
        if not is_op(product, aten.slice.Tensor):
            break
        product = product.args[0]
    if not is_op(product, aten.mm.default, aten.bmm.default):
        return None
    if product is node:
        up = unpad_product(product)
    else:
        try:
            up = unpad_product(product)
        except NoMatch:  # a slice of some other padded GEMM's result: not its result
            return None
    return up if up.result is node else None


def matmul_operands(node: object) -> tuple[Node, Node] | None:
    """``(a, b)`` when ``node`` computes ``a @ b`` (2-D), else None.

    Besides ``mm``/``addmm``, Inductor's own rewrites of skinny products:
    ``(a.unsqueeze(2) * b.unsqueeze(0)).sum(1)`` on GPUs under coordinate-descent
    tuning (max-autotune), ``sum(a.squeeze(0) * b.squeeze(-1), 0, True).unsqueeze(0)``
    for one row on CPU -- with the fp32 upcasts ``pw_cast_for_opmath`` adds around them --
    and ``pad_mm``'s padding (:func:`unpad_product`).
    """
    node = strip_casts(node)
    try:
        up = unpadded_result(node)
    except NoMatch:
        up = None
    if up is not None and not up.batched:
        return up.a, up.b
    if is_op(node, aten.mm.default):
        return node.args[0], node.args[1]
    if is_op(node, aten.addmm.default):
        return node.args[1], node.args[2]
    if is_op(node, aten.unsqueeze.default) and node.args[1] == 0:  # CPU one-row form
        total = node.args[0]
        if is_op(total, aten.sum.dim_IntList) and list(total.args[1]) == [0]:
            prod = total.args[0]
            if is_op(prod, aten.mul.Tensor):
                a, b = (strip_casts(x) for x in prod.args)
                if (is_op(a, aten.squeeze.dim) and a.args[1] == 0
                        and is_op(b, aten.squeeze.dim) and b.args[1] == -1):
                    return a.args[0], b.args[0]
        return None
    if is_op(node, aten.sum.dim_IntList) and list(node.args[1]) == [1]:
        prod = node.args[0]
        if is_op(prod, aten.mul.Tensor):
            a, b = (strip_casts(x) for x in prod.args)
            if (is_op(a, aten.unsqueeze.default) and a.args[1] == 2
                    and is_op(b, aten.unsqueeze.default) and b.args[1] == 0):
                return strip_casts(a.args[0]), strip_casts(b.args[0])
    return None


# --------------------------------------------------------------------------- saved values
# A graph traced while autograd records is the forward of a training pair: it returns,
# after the module's outputs, the values its backward reads (often through ops that only
# prepare them, a transpose for a matmul's backward, say). Such reads are no reason to
# leave a site unfused: what they read stays computed (erase_unused keeps a node
# something reads) while the fused op serves the forward's own readers.

class SavedValues(NamedTuple):
    """``saved``: the nodes a forward returns for its backward; ``backward_only``: the nodes
    whose every value goes only there (into the backward's inputs, or in a joint graph into
    the backward's own nodes, ``backward``)."""

    saved: frozenset = frozenset()
    backward_only: frozenset = frozenset()
    backward: frozenset = frozenset()


_SAVED: contextvars.ContextVar[SavedValues] = contextvars.ContextVar(
    "k3fusion_saved", default=SavedValues())


def saved_for_backward(graph: Graph) -> SavedValues:
    """What ``graph`` returns only for a backward: the outputs after the module's own
    (Inductor's ``user_visible_output_idxs``, recorded on the output node before post-grad
    passes run; the positions before them are the module's outputs and the inputs it
    writes back), and the nodes computed only for those. Empty for an inference graph,
    or where the mark is missing."""
    out = next((n for n in reversed(graph.nodes) if n.op == "output"), None)
    visible = out.meta.get("user_visible_output_idxs") if out is not None else None
    if not visible or not isinstance(out.args[0], (tuple, list)):
        return SavedValues()
    values, end = list(out.args[0]), max(visible) + 1
    kept = {v for v in values[:end] if isinstance(v, Node)}
    saved = frozenset(v for v in values[end:] if isinstance(v, Node) and v not in kept)
    only = _feeding_only(graph, lambda n, u: u is out and n in saved)
    return SavedValues(saved, frozenset(only))


def is_tangent(node: Node) -> bool:
    """An incoming gradient of AOTAutograd's joint or backward graph (``tangents_*``)."""
    return node.op == "placeholder" and str(node.target).startswith("tangents")


def _tangents(graph: Graph) -> list[Node]:
    return [n for n in graph.nodes if is_tangent(n)]


def is_backward_graph(graph: Graph) -> bool:
    """A graph that takes the backward's incoming gradients (AOTAutograd's ``tangents_*``):
    the backward of a training pair, or a joint graph."""
    return bool(_tangents(graph))


def _feeding_only(graph: Graph, serves_backward: Callable[[Node, Node], bool]) -> set:
    """The computed nodes whose every read (by ``u`` of ``n``) serves the backward, directly
    (``serves_backward(n, u)``) or through another such node."""
    only: set[Node] = set()
    for n in reversed(graph.nodes):
        if n.op == "call_function" and n.users and all(
                u in only or serves_backward(n, u) for u in n.users):
            only.add(n)
    return only


def joint_backward_values(graph: Graph) -> SavedValues | None:
    """For a joint forward + backward graph (a training compile's, before AOTAutograd
    partitions it): the backward's nodes (those that read an incoming gradient) and the
    forward nodes computed only for them, as :func:`users` should not count them. None for
    a graph without a backward."""
    tangents = _tangents(graph)
    if not tangents:
        return None
    backward = set(tangents)
    for n in graph.nodes:
        if n.op != "output" and any(i in backward for i in n.all_input_nodes):
            backward.add(n)
    feeding = _feeding_only(graph, lambda n, u: u in backward) - backward
    return SavedValues(frozenset(), frozenset(backward | feeding), frozenset(backward))


def recompute_in_backward(graph: Graph, values: SavedValues) -> int:
    """Mark the forward nodes that a rewrite left computed only for the backward (a fused
    site's chain, still read by its gradient formulas) to be recomputed there: the
    partitioner then keeps them out of the forward, which runs the fused op alone.
    Returns how many were marked."""
    from torch.utils.checkpoint import CheckpointPolicy

    backward = set(values.backward) & set(graph.nodes)  # (some were erased by the rewrite)
    new = _feeding_only(graph, lambda n, u: u in backward) - backward - values.backward_only
    for n in new:
        n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    return len(new)


@contextlib.contextmanager
def saving(values: SavedValues) -> Iterator[None]:
    """Within: :func:`users` does not count reads that serve only the backward."""
    token = _SAVED.set(values)
    try:
        yield
    finally:
        _SAVED.reset(token)


def users(node: Node) -> list[Node]:
    """``node``'s users, without those that serve only the backward (:func:`saving`)."""
    saved, only, _ = _SAVED.get()
    if not saved and not only:
        return list(node.users)
    return [u for u in node.users
            if u not in only and not (u.op == "output" and node in saved)]


def only_user(node: Node) -> Node:
    found = users(node)
    if len(found) != 1:
        raise NoMatch(f"{node.name} has {len(found)} users, expected 1")
    return found[0]


def is_graph_input(node: object) -> bool:
    """Parameters reach post-grad graphs as placeholders (or get_attr when frozen)."""
    return isinstance(node, Node) and node.op in ("placeholder", "get_attr")


def written_buffers(graph: Graph) -> set[Node]:
    """The nodes whose buffers some node of ``graph`` may write (through a view or not): an
    op's arguments its schema marks written; everything a higher-order op reads (its
    schema says nothing of its effects)."""
    written = set()
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        if isinstance(target, torch._ops.HigherOrderOperator):
            torch.fx.node.map_arg((node.args, node.kwargs),
                                  lambda n: written.add(view_base(n)))
            continue
        if not isinstance(target, torch._ops.OpOverload):
            continue
        for i, arg in enumerate(target._schema.arguments):
            info = arg.alias_info
            if info is None or not info.is_write:
                continue
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            for v in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(v, Node):
                    written.add(view_base(v))
    return written


def view_base(node: Node) -> Node:
    """The node whose buffer ``node`` views (itself if it is no view op)."""
    while is_op(node, *VIEW_OPS):
        node = node.args[0]
    return node


def depends_on(node: Node, targets: Iterable[Node], order: dict[Node, int] | None = None) -> bool:
    """Whether ``node`` reads any of ``targets``, directly or through its inputs. With
    ``order`` (each node's graph position), inputs placed before the first target are not
    walked: in a topologically ordered graph they cannot read it."""
    targets = set(targets)
    first = min(order[t] for t in targets) if order is not None else None
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n in targets:
            return True
        if n in seen or (first is not None and order[n] < first):
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return False


# Reads of a tensor's size (dynamic shapes): they need the size, not the value, so a
# chain they read can still be replaced once they read the size from a surviving tensor.
_SIZE_READS = (aten.sym_size.int,)


def external_users(nodes: Iterable[Node], output: Node) -> list[tuple[Node, Node]]:
    """(intermediate, user) pairs where a user outside ``nodes`` reads the value."""
    inside = set(nodes)
    return [(n, u) for n in inside if n is not output for u in users(n)
            if u not in inside and not is_op(u, *_SIZE_READS)]


def plan_size_reads(nodes: Iterable[Node], survivors: Iterable[Node]) -> list[tuple[Node, tuple]]:
    """For every size read of a node about to be erased: new args reading the same
    symbolic size from a surviving tensor. Raises NoMatch if one has no such survivor.

    ``survivors`` must be defined before any of the reads (inputs of the chain are).
    """
    inside, plan = set(nodes), []
    survivors = [s for s in survivors if isinstance(s, Node)
                 and isinstance(s.meta.get("val"), torch.Tensor)]
    for n in inside:
        for u in n.users:
            if u in inside or not is_op(u, *_SIZE_READS):
                continue
            want = val(n).shape[u.args[1]]
            for s in survivors:
                dims = [k for k, size in enumerate(val(s).shape) if same_size(size, want)]
                if dims:
                    plan.append((u, (s, dims[0])))
                    break
            else:
                raise NoMatch(f"{u.name} reads a size ({want}) of {n.name} that no surviving "
                              f"tensor has: {[(s.name, tuple(val(s).shape)) for s in survivors]}")
    return plan


def same_size(a, b) -> bool:
    """Whether two (symbolic) sizes are provably equal, without adding a guard."""
    return _known(a == b)


def apply_size_reads(plan: list[tuple[Node, tuple]]) -> None:
    for user, args in plan:
        user.args = args


def hoist_before(graph: Graph, needed: Iterable[Node], point: Node) -> None:
    """Move whatever ``needed`` is computed from, where it comes after ``point``, to just
    before ``point`` (relative order kept), so a node inserted there can read ``needed``.

    Only pure ops move: a graph with a side effect in that cone raises :class:`NoMatch`.
    """
    order = {n: i for i, n in enumerate(graph.nodes)}
    limit = order[point]
    cone, stack = set(), [n for n in needed if order[n] >= limit]
    while stack:
        n = stack.pop()
        if n in cone:
            continue
        if n is point or n.op != "call_function" or n.is_impure():
            raise NoMatch(f"{n.name} cannot move before {point.name}")
        cone.add(n)
        stack.extend(i for i in n.all_input_nodes if order[i] >= limit)
    if cone:
        before_change(graph)
    for n in sorted(cone, key=order.__getitem__):
        point.prepend(n)


def fake_call(target, args: tuple, kwargs: dict | None = None):
    """Run ``target`` on the traced fake values of ``args`` to get the new node's meta."""
    from torch._guards import detect_fake_mode

    from torch.fx.node import map_arg
    from torch.utils._pytree import tree_leaves

    vals = map_arg(args, lambda n: n.meta["val"])
    kw = map_arg(kwargs or {}, lambda n: n.meta["val"])
    mode = detect_fake_mode([v for v in tree_leaves(vals) if isinstance(v, torch.Tensor)])
    if mode is None:
        return target(*vals, **kw)
    with mode:
        return target(*vals, **kw)


def inductor_lowers(target) -> bool:
    """Whether Inductor can lower a call of ``target`` in a post-grad graph: an op with an
    Inductor lowering, a ``k3fusion`` op (a fallback kernel), ``getitem``, or
    ``auto_functionalized`` (of a ``k3fusion`` op: Inductor reinplaces it, then decomposes it
    into clones and the op before lowering). Any other op reaches ``make_fallback`` at
    lowering, which fails for an op that has a decomposition (``aten.new_ones``: "both a
    fallback and a decomp for same op")."""
    from torch._inductor.lowering import lowerings

    if (target is operator.getitem or target in lowerings
            or target is torch.ops.higher_order.auto_functionalized):
        return True
    return isinstance(target, torch._ops.OpOverload) and target.namespace == "k3fusion"


def insert_call(graph: Graph, target, args: tuple, kwargs: dict | None = None) -> Node:
    """``graph.call_function`` at the current insertion point, with its traced value; raises
    :class:`NoMatch` (inserting nothing) for an op Inductor does not lower or one that
    refuses the arguments. Use inside :func:`all_or_nothing`."""
    kwargs = kwargs or {}
    if not inductor_lowers(target):
        raise NoMatch(f"the rewrite would insert {target}, which Inductor does not lower")
    try:
        value = fake_call(target, args, kwargs)
    except (TypeError, ValueError, RuntimeError) as e:
        raise NoMatch(f"{target} refuses the rewrite's inputs: {e}") from None
    before_change(graph)
    node = graph.call_function(target, args, kwargs)
    node.meta["val"] = value
    return node


@contextlib.contextmanager
def all_or_nothing(graph: Graph) -> Iterator[None]:
    """A rewrite that raises :class:`NoMatch` part-way leaves no inserted node behind (nodes
    it only moved, with ``hoist_before``, compute the same values where they now stand)."""
    before = set(graph.nodes)
    try:
        yield
    except NoMatch:
        for n in reversed(list(graph.nodes)):
            if n not in before and not n.users:
                graph.erase_node(n)
        raise


#: Attribute a caller may set on a graph: called before the first change a rewrite makes
#: (the pass manager takes its copy for an undo there, only when something is rewritten).
CHANGE_HOOK = "_k3fusion_before_change"


def before_change(graph: Graph) -> None:
    """Every rewrite calls this before it changes ``graph`` (``insert_call`` and
    ``hoist_before`` do)."""
    hook = getattr(graph, CHANGE_HOOK, None)
    if hook is not None:
        hook()


def snapshot(graph: Graph) -> Graph:
    """A copy of ``graph`` (nodes and their meta) for :func:`restore`."""
    saved, val_map = Graph(), {}
    out = saved.graph_copy(graph, val_map)
    old_output = next(n for n in reversed(graph.nodes) if n.op == "output")
    saved.output(out).meta.update(old_output.meta)
    return saved


def restore(graph: Graph, saved: Graph) -> None:
    """Make ``graph`` compute what ``saved`` (a :func:`snapshot`) computes, in place. Nodes
    are new objects (names may gain a suffix); placeholder targets, and so the graph's
    signature, stay."""
    for n in reversed(list(graph.nodes)):
        graph.erase_node(n)
    val_map = {}
    out = graph.graph_copy(saved, val_map)
    old_output = next(n for n in reversed(saved.nodes) if n.op == "output")
    graph.output(out).meta.update(old_output.meta)


def erase_unused(graph: Graph, nodes: Iterable[Node]) -> None:
    """Erase ``nodes`` that no longer have users, consumers first."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for n in sorted(set(nodes), key=order.__getitem__, reverse=True):
        if not n.users:
            graph.erase_node(n)


# --------------------------------------------------------------------------- view layouts

#: Ops that only rearrange a tensor's elements without changing a value (einsum and
#: matmul lowerings wrap their bmm in chains of these).
LAYOUT_OPS = frozenset({
    aten.view.default, aten.reshape.default, aten._unsafe_view.default,
    aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default,
    aten.squeeze.dims, aten.clone.default, aten.alias.default,
    aten.expand.default,  # matmul's own no-op expand to its operands' shapes (else NoMatch)
})


def _known(cond) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(cond))


def view_layout(node: Node, start: tuple[Node, list] | None = None, stops=()
                ) -> tuple[Node, list[tuple], list[Node]]:
    """Follow a chain of :data:`LAYOUT_OPS` back to its base tensor.

    -> (base, layout, chain): ``layout[d]`` lists the base dims (atoms ``(base, i)``, in
    row-major order) that ``node``'s dim ``d`` merges, size-1 dims listing none; ``chain``
    the ops walked (never past ``stops``). ``start=(base, layout)`` stops the walk at ``base`` and gives its
    layout in other atoms (a product's result in its operands' atoms). A reshape that
    would split an atom (a layout this algebra cannot name) raises NoMatch, as does a
    size it cannot prove equal (dynamic shapes: no guard is ever added).
    """
    chain = []
    n = node
    while is_op(n, *LAYOUT_OPS) and (start is None or n is not start[0]) and n not in stops:
        chain.append(n)
        n = n.args[0]
    base = n
    if start is not None:
        if base is not start[0]:
            raise NoMatch(f"{node.name} is not a view of {start[0].name}")
        layout = list(start[1])
    else:
        layout = [() if _known(s == 1) else ((base, i),) for i, s in enumerate(val(base).shape)]
    for op in reversed(chain):
        layout = _layout_step(op, layout)
    if len(layout) != val(node).dim():
        raise NoMatch(f"{node.name}: layout of rank {len(layout)} for a rank-{val(node).dim()} value")
    return base, layout, chain


def _atom_size(atom):
    return val(atom[0]).shape[atom[1]]


def _layout_step(op: Node, layout: list) -> list:
    rank_in = len(layout)
    out_shape = val(op).shape
    if op.target in (aten.clone.default, aten.alias.default):
        return layout
    if op.target is aten.expand.default:
        if not all(same_size(a, b) for a, b in zip(val(op.args[0]).shape, out_shape)) \
                or len(out_shape) != rank_in:
            raise NoMatch(f"{op.name}: an expand that broadcasts")
        return layout
    if op.target is aten.permute.default:
        dims = [d % rank_in for d in op.args[1]]
        if sorted(dims) != list(range(rank_in)):
            raise NoMatch(f"{op.name}: not a permutation")
        return [layout[d] for d in dims]
    if op.target is aten.unsqueeze.default:
        d = op.args[1] % (rank_in + 1)
        return layout[:d] + [()] + layout[d:]
    if op.target in (aten.squeeze.dim, aten.squeeze.default, aten.squeeze.dims):
        in_shape = val(op.args[0]).shape
        if op.target is aten.squeeze.default:
            cand = range(rank_in)
        elif op.target is aten.squeeze.dim:
            cand = [op.args[1] % rank_in] if rank_in else []
        else:
            cand = [d % rank_in for d in op.args[1]]
        drop = [d for d in cand if _known(in_shape[d] == 1)]
        if rank_in - len(drop) != len(out_shape):
            raise NoMatch(f"{op.name}: cannot tell which dims it squeezes")
        return [x for d, x in enumerate(layout) if d not in drop]
    # reshape / view: regroup the atoms in row-major order
    flat = [a for group in layout for a in group]
    out, k = [], 0
    for s in out_shape:
        if _known(s == 1):
            out.append(())
            continue
        group, prod = [], 1
        while True:
            if k >= len(flat):
                raise NoMatch(f"{op.name}: reshape splits a dim")
            group.append(flat[k])
            prod = prod * _atom_size(flat[k])
            k += 1
            if _known(prod == s):
                break
        out.append(tuple(group))
    if k != len(flat):
        raise NoMatch(f"{op.name}: reshape splits a dim")
    return out
