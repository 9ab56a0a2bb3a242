"""Fusion 3: the latent-MoE tail -> ``torch.ops.k3fusion.latent_moe_tail`` (tiered at run time).

What a site computes (``KimiK3LatentMoE.tail``), in the post-grad graph::

    tensor parallel (tp > 1), functional collectives over one group ``g``:
        r   = wait_tensor(all_reduce(routed_partial, "sum", g))
        s   = wait_tensor(all_reduce(shared_partial, "sum", g))
        y   = s + mm(rms_norm(r), permute(up_w, [1, 0]))        # add in either order
            | addmm(s, rms_norm(r), permute(up_w, [1, 0]))       # `s + mm` as Inductor folds it
    tp = 1 (no collectives):
        y   = shared + mm(rms_norm(routed), permute(up_w, [1, 0]))   # or the addmm form

The views and padding it reads through, the tp = 1 rule and the near misses it refuses:
docs/design-notes.md, "patterns/moe_tail.py".
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field

import torch
from torch.fx import Graph, Node

import k3fusion.moe_tail  # noqa: F401  registers torch.ops.k3fusion.latent_moe_tail

from ._fx import (RESHAPES, NoMatch, all_or_nothing, apply_size_reads, aten,
                  decomposed_product, depends_on, erase_unused, external_users, fake_call,
                  insert_call, is_graph_input, is_op, plan_size_reads, through_row_padding, val)
from .fusion import Fusion, FusionResult
from .rms_norm import RMSNormMatch, eps_op_args

__all__ = ["FUSION", "FUSION_NAME", "MoETailSite", "match_moe_tail", "fuse_moe_tail"]

FUSION_NAME = "moe_tail"

_MM = (aten.mm.default, aten.addmm.default)


#: Marker: the shared partner is the product of the anchor addmm (``addmm(up, x, ws.T)``).
_SHARED_MM = object()


def _c10d():
    ns = torch.ops._c10d_functional
    return ns.all_reduce.default, ns.wait_tensor.default


@dataclass
class MoETailSite:
    anchor: Node                 # the add / addmm computing y
    norm: RMSNormMatch
    up_w: Node
    routed: Node                 # what the op reads: the partial (tp > 1) or the latent
    shared: Node | tuple        # a node, or (a, b) of the shared projection to rebuild
    group_name: str | None
    nodes: list[Node] = field(repr=False)   # what the op replaces (anchor included)
    #: the view the graph put on the up-projection before the add, applied to the op's
    #: result when the latent's rows are flat and the add's are not (``_flat_rows``)
    out_view: Node | None = None


def _through_views(node: object, chain: list[Node]) -> object:
    """Walk up single-user views; the views are appended to ``chain``."""
    while is_op(node, *RESHAPES):
        chain.append(node)
        node = node.args[0]
    return node


def _reduced(node: object) -> tuple[Node, str, list[Node]] | None:
    """``wait_tensor(all_reduce(x, "sum", g))`` -> (x, g, nodes); None if not a collective."""
    all_reduce, wait = _c10d()
    if not is_op(node, wait):
        return None
    waits = [node]
    # ``funcol.wait_tensor(funcol.all_reduce(x))`` traces to wait(wait(all_reduce(x))).
    while is_op(waits[-1].args[0], wait):
        if len(waits[-1].args[0].users) != 1:
            raise NoMatch(f"{waits[-1].args[0].name} is read outside the tail")
        waits.append(waits[-1].args[0])
    ar = waits[-1].args[0]
    if not is_op(ar, all_reduce):
        raise NoMatch(f"{node.name} waits on {getattr(ar, 'target', ar)}, not an all_reduce")
    op, group = ar.args[1], ar.args[2]
    if str(op).lower() != "sum":
        raise NoMatch(f"all_reduce {ar.name} reduces with {op!r}, not 'sum'")
    if len(ar.users) != 1:
        raise NoMatch(f"all_reduce {ar.name} has {len(ar.users)} users")
    return ar.args[0], group, [ar, *waits]


def _up_weight(wt: object) -> Node:
    if not (is_op(wt, aten.permute.default) and list(wt.args[1]) == [1, 0]):
        raise NoMatch("the up-projection weight is not read as up_w.permute(1, 0)")
    up_w = wt.args[0]
    if not is_graph_input(up_w) or val(up_w).dim() != 2:
        raise NoMatch("the up-projection weight is not a 2-D parameter")
    return up_w


def _is_projection(node: object) -> bool:
    """A bare projection output: ``mm``, or ``addmm`` with a 1-D bias (a biased Linear).
    ``addmm(h, a, W.T)`` with a full-shape input is a residual add Inductor folded into
    the GEMM (``h + o_proj(a)``): the residual stream, not a projection."""
    node = _through_views(node, [])
    # mode="max-autotune"'s one-row GEMM (its rounding is the partner's own business)
    product = decomposed_product(node, rounded=False)
    if product is not None and not product.batched:
        return True
    node, _ = through_row_padding(node, [])
    if is_op(node, aten.mm.default):
        return True
    return is_op(node, aten.addmm.default) and val(node.args[0]).dim() == 1


def match_moe_tail(anchor: Node, by_out: dict[Node, RMSNormMatch]) -> MoETailSite:
    """Describe the tail computed by ``anchor`` (an add or addmm); raise NoMatch if none."""
    if is_op(anchor, aten.addmm.default):
        if anchor.kwargs.get("beta", 1) != 1 or anchor.kwargs.get("alpha", 1) != 1:
            raise NoMatch("addmm with beta/alpha")
        # addmm(shared, h, W.T) -- or, when the user wrote `up + shared`, Inductor folds
        # the *shared* projection instead: addmm(up, x, ws.T); then the op's shared input
        # is that product, rebuilt as its own mm (``_SHARED_MM``).
        candidates = [(anchor.args[0], anchor), (_SHARED_MM, anchor.args[0])]
        up_chain: list[Node] = []
    elif is_op(anchor, aten.add.Tensor):
        if anchor.kwargs.get("alpha", 1) != 1:
            raise NoMatch("add with alpha")
        a, b = anchor.args[0], anchor.args[1]
        candidates = [(a, b), (b, a)]
        up_chain = None
    else:
        raise NoMatch("not an add")
    why = "no operand is an up-projection of an RMSNorm"
    for partner, up in candidates:
        if not isinstance(up, Node):
            continue
        if partner is _SHARED_MM:
            chain, partner = [], _SHARED_MM
        elif not isinstance(partner, Node):
            continue
        else:
            chain = [] if up_chain is None else list(up_chain)
        viewed = None if up is anchor else _through_views(up, chain)
        product = None if viewed is None else decomposed_product(viewed)
        if product is not None and not product.batched:  # mode="max-autotune", one row
            chain += product.nodes
            mm, h_in, wt = product.product, product.a, product.b
        else:
            mm, padded_h = (up, None) if up is anchor else through_row_padding(viewed, chain)
            if mm is not anchor and not is_op(mm, aten.mm.default):
                continue
            h_in, wt = (mm.args[1], mm.args[2]) if mm is anchor else (mm.args[0], mm.args[1])
            if padded_h is not None:
                h_in = padded_h
        norm_chain: list[Node] = []
        norm = by_out.get(_through_views(h_in, norm_chain))
        if norm is None:
            continue
        try:
            return _site(anchor, partner, mm, chain, norm_chain, wt, norm)
        except NoMatch as e:
            why = str(e)
    raise NoMatch(why)


def _flat_rows(anchor: Node, chain: list[Node], shared: Node,
               lead: tuple) -> tuple[Node, Node]:
    """A latent of flat ``[T, L]`` rows whose up-projection is viewed back (``[T, H] ->
    [B, S, H]``) before the add with a shared value of the add's shape (transformers'
    ``KimiK3MoE``: the experts' output is flat, the shared expert reads the unflattened
    hidden state). Both operands are reshapes of ``[T, H]`` values to one shape, so row
    for row the add is the op's ``shared + up(norm(latent))`` on ``[T, H]``: the op reads
    the shared value's ``[T, H]`` base (through its views) and its result takes the
    up-projection's outermost view. -> (that base, that view)."""
    views = []
    for n in chain:
        if not is_op(n, *RESHAPES):
            break
        views.append(n)
    base = shared
    while tuple(val(base).shape[:-1]) != lead and is_op(base, *RESHAPES):
        base = base.args[0]
    width = val(shared).shape[-1]
    if (not views or tuple(val(views[0]).shape) != tuple(val(anchor).shape)
            or tuple(val(base).shape[:-1]) != lead or val(base).shape[-1] != width):
        raise NoMatch(f"the shared value's rows {tuple(val(shared).shape[:-1])} are not the "
                      f"routed latent's {lead} (nor a view of a value with its rows)")
    return base, views[0]


def _site(anchor, partner, mm, chain, norm_chain, wt, norm: RMSNormMatch) -> MoETailSite:
    up_w = _up_weight(wt)
    hidden, latent = val(up_w).shape
    if latent != norm.width:
        raise NoMatch(f"up_w is [{hidden}, {latent}] but the norm is {norm.width} wide")
    nodes = [anchor, *chain, *norm_chain, *norm.nodes, wt]
    if mm is not anchor:
        nodes.append(mm)
    if partner is _SHARED_MM:  # tp = 1 only: the product is the shared projection itself
        if _reduced(norm.x) is not None:
            raise NoMatch("one operand is all-reduced and the other is not")
        if depends_on(anchor.args[1], [norm.out]) or depends_on(anchor.args[2], [norm.out]):
            raise NoMatch("tp=1: the add partner is computed from the normed latent")
        shared = (anchor.args[1], anchor.args[2])
        leaks = external_users(nodes, anchor)
        if leaks:
            inner, user = leaks[0]
            raise NoMatch(f"intermediate {inner.name} is also read by {user.name}")
        return MoETailSite(anchor, norm, up_w, norm.x, shared, None, nodes)
    routed_red = _reduced(norm.x)
    shared_red = _reduced(partner)
    if (routed_red is None) != (shared_red is None):
        raise NoMatch("one operand is all-reduced and the other is not")
    if routed_red is not None:
        routed, g1, n1 = routed_red
        shared, g2, n2 = shared_red
        if g1 != g2:
            raise NoMatch(f"the all-reduces use different groups ({g1!r}, {g2!r})")
        nodes += n1 + n2
        group = g1
    else:
        # tp = 1: only a projection output is a shared-expert partial (see module docstring).
        if not _is_projection(partner):
            raise NoMatch("tp=1: the add partner is not a projection output (a residual add)")
        if depends_on(partner, [norm.out]):
            raise NoMatch("tp=1: the add partner is computed from the normed latent")
        routed, shared, group = norm.x, partner, None
    if tuple(val(anchor).shape) != tuple(val(shared).shape):
        raise NoMatch(f"the add broadcasts: {tuple(val(shared).shape)} -> "
                      f"{tuple(val(anchor).shape)}")
    out_view, lead = None, tuple(val(routed).shape[:-1])
    if tuple(val(shared).shape[:-1]) != lead:
        shared, out_view = _flat_rows(anchor, chain, shared, lead)
    leaks = external_users(nodes, anchor)
    if leaks:
        inner, user = leaks[0]
        raise NoMatch(f"intermediate {inner.name} is also read by {user.name}")
    return MoETailSite(anchor, norm, up_w, routed, shared, group, nodes, out_view)


def _op_args(site: MoETailSite, shared=None) -> tuple:
    eps = site.norm.eps
    eps, eps_t = eps_op_args(eps)
    shared = site.shared if shared is None else shared
    # A norm of an fp32 input whose normalized value is cast to 16 bits (``x_round``):
    # the op casts there too (its norm_dtype), exactly what the graph computes.
    return (site.routed, shared, site.norm.weight, eps, site.up_w, site.group_name,
            site.norm.weight_in_fp32, eps_t, site.norm.x_round)


def _insert_tail(graph: Graph, site: MoETailSite, shared) -> Node:
    """The op call replacing the tail: ``k3fusion::latent_moe_tail_`` (the result written
    into ``shared``, ``routed`` clobbered) under ``auto_functionalized``, so that Inductor's
    reinplacing passes the partials that nothing reads afterwards in place (the tiers
    then copy neither) and clones the others. (The op's dtype rule makes ``shared`` the
    result's dtype; _plan checked the functional op's shape against the graph's.)"""
    op = torch.ops.k3fusion.latent_moe_tail_.default
    names = [a.name for a in op._schema.arguments]  # auto_functionalized takes them by name
    mutated = insert_call(graph, torch.ops.higher_order.auto_functionalized, (op,),
                          dict(zip(names, _op_args(site, shared))))
    return insert_call(graph, operator.getitem, (mutated, 2))  # (None, routed, shared)


def _plan(site: MoETailSite) -> list:
    rebuilt = isinstance(site.shared, tuple)
    survivors = [site.routed, site.up_w] + (list(site.shared) if rebuilt else [site.shared])
    size_reads = plan_size_reads(site.nodes, survivors)
    try:  # the op's own checks (dtypes, shapes, strides), on fake values
        shared = fake_call(aten.mm.default, site.shared) if rebuilt else None
        out = fake_call(torch.ops.k3fusion.latent_moe_tail.default, _op_args(site, shared))
    except (TypeError, ValueError) as e:
        raise NoMatch(f"the fused op refuses these inputs: {e}") from None
    want = tuple(val(site.anchor).shape)
    if site.out_view is not None:  # the op gives the latent's rows; the view, the add's
        want = tuple(val(site.routed).shape[:-1]) + want[-1:]
    if out.dtype != val(site.anchor).dtype or tuple(out.shape) != want:
        raise NoMatch(f"the op would give {out.dtype}{tuple(out.shape)}, the graph has "
                      f"{val(site.anchor).dtype}{want}")
    return size_reads


def _miss(anchor: Node, why: str) -> str:
    """The debug log's line for a tail left alone (read back by :data:`MISS_LINE`)."""
    return f"MoE-tail site not fused: {anchor.name}: {why}"


MISS_LINE = re.compile(r"^MoE-tail site not fused: (?:\S+ )?(\S+?):? (.*)$")


def fuse_moe_tail(graph: Graph, norms: list[RMSNormMatch]) -> FusionResult:
    """Replace every latent-MoE tail; claims each tail's latent norm. Counted only where
    the graph has a tail fused (a dense model reports no key)."""
    by_out = {m.out: m for m in norms}
    claimed: set[Node] = set()
    fused, misses = 0, []
    anchors = [n for n in graph.nodes if is_op(n, aten.add.Tensor, aten.addmm.default)]
    for anchor in anchors:
        if anchor.graph is not graph or anchor in claimed:
            continue
        try:
            site = match_moe_tail(anchor, by_out)
            size_reads = _plan(site)
        except NoMatch as e:
            if "no operand is an up-projection" not in str(e):
                misses.append(_miss(anchor, str(e)))
            continue
        try:
            with all_or_nothing(graph), graph.inserting_before(site.anchor):
                shared = None
                if isinstance(site.shared, tuple):
                    shared = insert_call(graph, aten.mm.default, site.shared)
                node = _insert_tail(graph, site, shared)
                if site.out_view is not None:  # the graph's own view, on the op's result
                    node = insert_call(graph, site.out_view.target,
                                       (node, *site.out_view.args[1:]), dict(site.out_view.kwargs))
        except NoMatch as e:
            misses.append(_miss(anchor, str(e)))
            continue
        site.anchor.replace_all_uses_with(node)
        apply_size_reads(size_reads)
        erase_unused(graph, site.nodes)
        claimed.add(site.norm.out)
        by_out.pop(site.norm.out, None)
        fused += 1
    return FusionResult({FUSION_NAME: fused} if fused else {}, frozenset(claimed), tuple(misses))


#: The tail claims after AttnRes and after the q/kv pass has reserved its strong pairs
#: (docs/architecture.md, "Claims between fusions"): a norm that forms a q/kv pair is
#: never a tail's latent norm.
FUSION = Fusion(name=FUSION_NAME, switch="moe_tail", claim_priority=30, run=fuse_moe_tail,
                count_names=(FUSION_NAME,), miss_kind="MoE tail", miss_line=MISS_LINE)
