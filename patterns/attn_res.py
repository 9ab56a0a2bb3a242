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

Sources: for a list bank the completed blocks are stacked once per distinct block list
(the sites of one block share it) instead of restacking blocks *and* prefix at every
site; a tensor bank is read in place. A block write into a tensor bank
(``bank[..., i, :] = prefix``) stays the graph's own op; the site reads the bank version
before that write (the write index is >= n, so those slots are equal).

Delta hand-off across layers: a layer ends with ``prefix = prefix + mlp_out``, which the
next layer's first site (or the final one) reads straight back. That add folds like any
other: the kernel adds ``delta`` and returns the updated prefix as its second result,
which the block write and any other reader of the sum then read (no add kernel). Such
folds are also counted as ``attn_res_delta_handoff`` (:func:`count_handoffs` says which
folds are a layer's closing add).
"""

from __future__ import annotations

import importlib
import operator
from dataclasses import dataclass, field

import torch
from torch.fx import Graph, Node

from ._fx import (RESHAPES, NoMatch, apply_size_reads, aten, dtype_of, erase_unused,
                  external_users, fake_call, hoist_before, is_graph_input, is_op, keepdim_of, slice_args,
                  matmul_operands, only_user, operands, plan_size_reads, prims, strip_casts,
                  val)
from .rms_norm import (RMSNormMatch, eps_op_args, inverse_rms, parameter_weight, same_input,
                       upcast_input)

__all__ = ["FUSION_NAME", "HANDOFF_NAME", "AttnResSite", "match_attn_res", "fuse_attn_res",
           "count_handoffs"]

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
    norm_w: Node
    proj_w: Node
    eps: float | Node
    #: The site's result in the model dtype (what the output norm, if any, reads).
    mixed: Node
    nodes: list[Node] = field(repr=False)


def _last_dim(node: Node, dims) -> bool:
    ndim = val(node).dim()
    return len(dims) == 1 and dims[0] in (-1, ndim - 1)


def _dim_is(node: Node, dim: int, want: int) -> bool:
    """``dim`` of ``node``'s value is its ``want``-th dim from the end (want < 0)."""
    return dim in (want, val(node).dim() + want)


def _softmax(div: Node) -> tuple[Node, list[Node]]:
    """``exp(l - amax(l)) / sum(exp(...))`` over the last dim -> (fp32 logits, nodes)."""
    if not is_op(div, aten.div.Tensor):
        raise NoMatch("not a division")
    exp, denom = div.args
    if not is_op(exp, aten.exp.default):
        raise NoMatch("not a softmax numerator")
    sub = exp.args[0]
    if not is_op(sub, aten.sub.Tensor):
        raise NoMatch("softmax without max subtraction")
    logits, amax = sub.args
    if is_op(denom, operator.getitem) and is_op(denom.args[0], *_online_softmax_ops()):
        # CUDA: prepare_softmax_online(logits, dim) -> (max, sum of exp)
        online = denom.args[0]
        if not (online.args[0] is logits and _dim_is(logits, online.args[1], -1)
                and denom.args[1] == 1 and is_op(amax, operator.getitem)
                and amax.args[0] is online and amax.args[1] == 0):
            raise NoMatch("not an online softmax over the last dim")
        nodes = [online, amax, denom, sub, exp, div]
    else:
        if not (is_op(denom, aten.sum.dim_IntList) and denom.args[0] is exp
                and _last_dim(exp, denom.args[1])
                and (denom.args[2] if len(denom.args) > 2 else denom.kwargs.get("keepdim"))):
            raise NoMatch("not a softmax denominator")
        if not (is_op(amax, aten.amax.default) and amax.args[0] is logits
                and _last_dim(logits, amax.args[1])):
            raise NoMatch("softmax without amax")
        nodes = [amax, sub, exp, denom, div]
    if dtype_of(logits) != torch.float32:
        raise NoMatch(f"softmax in {dtype_of(logits)}, not float32")
    return logits, nodes


def _projection(logits: Node) -> tuple[Node, Node, list[Node]]:
    """``Linear(H, 1)`` of the keys, squeezed -> (keys, proj weight param, nodes)."""
    nodes = []
    if is_op(logits, _CAST):  # logits.float() of model-dtype logits
        nodes.append(logits)
        logits = logits.args[0]
    if not (is_op(logits, aten.squeeze.dim) and _dim_is(logits.args[0], logits.args[1], -1)):
        raise NoMatch("logits are not a squeezed projection")
    view = logits.args[0]
    if not (is_op(view, *RESHAPES) and val(view).shape[-1] == 1):
        raise NoMatch("projection output is not [..., S, 1]")
    product = matmul_operands(view.args[0])
    if product is None:
        raise NoMatch("projection is not a matrix multiply")
    # the fp32 upcasts around a decomposed one-row product belong to the site too
    flat_keys, w_t = (strip_casts(x) for x in product)
    if not (is_op(w_t, aten.permute.default) and list(w_t.args[1]) == [1, 0]):
        raise NoMatch("projection weight is not transposed")
    proj_w, w_nodes = parameter_weight_2d(w_t.args[0])
    if not is_op(flat_keys, *RESHAPES):
        raise NoMatch("keys are not flattened for the projection")
    # Everything between the keys and the logits belongs to the site (a decomposed
    # product adds unsqueezes, casts and a sum around the multiply).
    nodes += [logits, view, w_t, flat_keys, *w_nodes] + _between({flat_keys, w_t}, view.args[0])
    return flat_keys.args[0], proj_w, nodes


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


def _key_norm(keys: Node) -> tuple[Node, Node, float | Node, Node, list[Node]]:
    """RMSNorm of the sources -> (sources, norm weight, eps, x32, nodes).

    Accepts cast-then-weight keys in the model dtype and keys weighted in fp32 (cast
    back or not): the kernel computes them in fp32 either way.
    """
    nodes = []
    step = keys
    if is_op(step, _CAST):  # weight-in-fp32 keys cast back to the model dtype
        nodes.append(step)
        step = step.args[0]
    if not is_op(step, _MUL):
        raise NoMatch("keys are not a weighted norm")
    nodes.append(step)
    a, b = step.args
    for normed_side, w_side in ((a, b), (b, a)):
        inner = normed_side
        cast = None
        if is_op(inner, _CAST):
            cast, inner = inner, inner.args[0]
        if not is_op(inner, _MUL):
            continue
        rsqrt = next((o for o in inner.args if is_op(o, aten.rsqrt.default)), None)
        if rsqrt is None:
            continue
        x32, eps, rms_nodes = inverse_rms(rsqrt)
        rms_nodes += same_input(operands(inner, rsqrt), x32)
        norm_w, w_nodes = parameter_weight(w_side, allow_upcast=True)
        sources, upcast = upcast_input(x32)
        nodes += [inner, *rms_nodes, *w_nodes, *upcast] + ([cast] if cast is not None else [])
        return sources, norm_w, eps, x32, nodes
    raise NoMatch("keys are not RMSNorm(sources) * weight")


def _mix(div: Node, sources: Node, x32: Node) -> tuple[Node, list[Node]]:
    """``sum(p[..., None] * sources, -2)`` (cast back if computed in fp32) -> (mixed, nodes)."""
    nodes = []
    p = only_user(div)
    if is_op(p, _CAST):
        nodes.append(p)
        p = only_user(p)
    if not (is_op(p, aten.unsqueeze.default) and _dim_is(p, p.args[1], -1)):
        raise NoMatch("softmax weights are not unsqueezed for the mix")
    weighted = only_user(p)
    if not is_op(weighted, _MUL):
        raise NoMatch("softmax weights do not scale the sources")
    try:
        nodes += same_input(operands(weighted, p), x32)  # sources, or their fp32 upcast
    except NoMatch:
        raise NoMatch("softmax weights do not scale the sources") from None
    total = only_user(weighted)
    if not (is_op(total, aten.sum.dim_IntList) and len(total.args[1]) == 1
            and _dim_is(weighted, total.args[1][0], -2)):
        raise NoMatch("weighted sources are not summed over the source dim")
    if keepdim_of(total) or total.kwargs.get("dtype") is not None:
        raise NoMatch("the mix's sum keeps the source dim (keepdim=True) or has a dtype")
    nodes += [p, weighted, total]
    mixed = total
    if dtype_of(total) != dtype_of(sources):
        mixed = only_user(total)
        if not (is_op(mixed, _CAST) and mixed.args[1] == dtype_of(sources)):
            raise NoMatch(f"mix is not cast back to {dtype_of(sources)}")
        nodes.append(mixed)
    return mixed, nodes


def _older_bank_version(bank: Node, n: int) -> Node:
    """Skip writes of slots >= n (``select_scatter``): the first n slots are unchanged."""
    while (is_op(bank, aten.select_scatter.default) and _dim_is(bank, bank.args[2], -2)
           and bank.args[3] >= n):
        bank = bank.args[0]
    return bank


def _source_layout(sources: Node) -> tuple[Node, list[Node] | None, Node | None, int, list[Node]]:
    """-> (prefix, blocks or None, bank or None, num_blocks, nodes)."""
    width = val(sources).shape[-1]
    if is_op(sources, aten.unsqueeze.default) and _dim_is(sources, sources.args[1], -2):
        return sources.args[0], [], None, 0, [sources]  # a single source: the prefix
    if (is_op(sources, *RESHAPES) and not is_op(sources.args[0], aten.cat.default)
            and val(sources).shape[-2] == 1
            and val(sources.args[0]).shape == val(sources).shape[:-2] + (width,)):
        return sources.args[0], [], None, 0, [sources]  # stack([prefix], -2) as a view
    if is_op(sources, *RESHAPES) and is_op(sources.args[0], aten.cat.default):
        # stack(items, -2) lowers to cat(items, -1) viewed as [..., S, H]
        cat = sources.args[0]
        items = list(cat.args[0])
        dim = cat.args[1] if len(cat.args) > 1 else 0
        if not (_dim_is(items[0], dim, -1) and val(sources).shape[-2] == len(items)
                and all(val(i).shape == val(items[0]).shape for i in items)
                and val(items[0]).shape[-1] == width):
            raise NoMatch("sources are not a stack over dim -2")
        return items[-1], items[:-1], None, len(items) - 1, [cat, sources]
    if is_op(sources, aten.cat.default) and _dim_is(sources, sources.args[1], -2):
        parts = list(sources.args[0])
        if len(parts) != 2:
            raise NoMatch("tensor-bank sources are not [bank slice, prefix]")
        blocks, last = parts
        if not (is_op(last, aten.unsqueeze.default) and _dim_is(last, last.args[1], -2)):
            raise NoMatch("last source is not the prefix")
        n = int(val(blocks).shape[-2])
        if is_op(blocks, aten.slice.Tensor):
            dim, start, _, step = slice_args(blocks)
            if not (_dim_is(blocks, dim, -2) and start in (0, None) and step == 1):
                raise NoMatch(f"blocks are bank[{start}::{step}] over dim {dim}, not a "
                              f"leading slice bank[:n] of the source dim")
            bank, nodes = blocks.args[0], [sources, blocks, last]
        else:  # the slice of the whole bank was simplified away
            bank, nodes = blocks, [sources, last]
        bank = _older_bank_version(bank, n)
        return last.args[0], None, bank, n, nodes
    raise NoMatch("sources are neither a stack of blocks and prefix nor a bank slice + prefix")


def match_attn_res(div: Node) -> AttnResSite:
    """Describe the AttnRes site whose softmax ends at ``div``, or raise NoMatch."""
    logits, nodes = _softmax(div)
    keys, proj_w, proj_nodes = _projection(logits)
    sources, norm_w, eps, x32, key_nodes = _key_norm(keys)
    mixed, mix_nodes = _mix(div, sources, x32)
    prefix, blocks, bank, n, source_nodes = _source_layout(sources)
    nodes += proj_nodes + key_nodes + mix_nodes + source_nodes

    width = val(sources).shape[-1]
    if val(proj_w).shape[-1] != width or val(norm_w).shape[0] != width:
        raise NoMatch("weights do not match the hidden width")
    if val(prefix).shape != val(sources).shape[:-2] + (width,) or dtype_of(prefix) != dtype_of(sources):
        raise NoMatch("prefix shape or dtype differs from the sources")
    leaks = external_users(nodes, mixed)
    if leaks:
        inner, user = leaks[0]
        raise NoMatch(f"intermediate {inner.name} is also read by {user.name}")
    return AttnResSite(prefix=prefix, blocks=blocks, bank=bank, num_blocks=n, norm_w=norm_w,
                       proj_w=proj_w, eps=eps, mixed=mixed, nodes=nodes)


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


def _call(graph: Graph, target, args: tuple) -> Node:
    node = graph.call_function(target, args)
    node.meta["val"] = fake_call(target, args)
    return node


class _BlockStacks:
    """One ``stack(blocks, -2)`` per distinct list of block tensors, shared by its sites."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.stacks: dict[tuple[Node, ...], Node] = {}

    def get(self, blocks: list[Node], prefix: Node, point: Node) -> Node:
        key = tuple(blocks)
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
    if out_norm is not None and (any(u not in out_norm.nodes for u in site.mixed.users)
                                 or out_norm.out in claimed):
        out_norm = None  # the mix is read elsewhere too (an fp32 norm reads it twice: fine)
    handoff = _delta_of(site.prefix)
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
            bank = site.bank
        proj = fake_call(aten.view.default, (site.proj_w, [val(site.proj_w).shape[-1]]))
        fake_call(torch.ops.k3fusion.attn_res.default, _op_args(plan, bank, proj))
    except (TypeError, ValueError) as e:
        raise NoMatch(f"the fused op refuses these inputs: {e}") from None
    return plan


def _op_args(plan: _Rewrite, bank, proj) -> tuple:
    site, norm = plan.site, plan.out_norm
    eps, eps_t = eps_op_args(site.eps)
    out_eps, out_eps_t = eps_op_args(norm.eps) if norm else (1e-6, None)
    return (plan.prefix_in, bank, site.num_blocks, site.norm_w, proj, eps, plan.delta,
            norm.weight if norm else None, out_eps, norm.weight_in_fp32 if norm else False,
            eps_t, out_eps_t)


def _rewrite(graph: Graph, plan: _Rewrite, stacks: _BlockStacks) -> Node:
    """Insert the op for ``plan`` and erase what it replaces; -> the op's node."""
    site = plan.site
    needed = [plan.prefix_in, site.norm_w, site.proj_w] + ([plan.delta] if plan.delta else [])
    needed += site.blocks if site.blocks is not None else [site.bank]
    hoist_before(graph, needed, plan.point)  # raises NoMatch before changing anything
    bank = (stacks.get(site.blocks, plan.prefix_in, plan.point) if site.blocks is not None
            else site.bank)
    with graph.inserting_before(plan.point):
        proj = _call(graph, aten.view.default, (site.proj_w, [val(site.proj_w).shape[-1]]))
        node = _call(graph, torch.ops.k3fusion.attn_res.default, _op_args(plan, bank, proj))
        results = []
        for i in range(len(plan.outputs)):
            r = graph.call_function(operator.getitem, (node, i))
            r.meta["val"] = node.meta["val"][i]
            results.append(r)
    for old, new in zip(plan.outputs, results):
        old.replace_all_uses_with(new, delete_user_cb=lambda user: user not in plan.erase)
    apply_size_reads(plan.size_reads)
    erase_unused(graph, plan.erase)
    return node


def fuse_attn_res(graph: Graph, norms: list[RMSNormMatch]
                  ) -> tuple[int, int, list[RMSNormMatch], list[str]]:
    """Replace every AttnRes site; returns (sites fused, layer hand-offs among their
    folded deltas -- see :func:`count_handoffs` --, norms still unclaimed, misses)."""
    importlib.import_module("k3fusion.ops")  # registers torch.ops.k3fusion.*

    claimed: set[Node] = set()
    # Not (yet) norms whose fp32 input lost its 16-bit round trip (RMSNormMatch.x_round).
    by_input = {m.x: m for m in norms if m.x_round is None}
    stacks = _BlockStacks(graph)
    fused, misses = 0, []
    sites: dict[Node, Node | None] = {}  # every recognized site -> the delta it folded
    for div in [n for n in graph.nodes if is_op(n, aten.div.Tensor)]:
        try:
            site = match_attn_res(div)
        except NoMatch as e:
            if is_op(div.args[0], aten.exp.default):  # a softmax: say why it is not a site
                misses.append(f"softmax {div.name}: {e}")
            continue
        try:
            plan = _plan(graph, site, by_input, claimed)
            node = _rewrite(graph, plan, stacks)
        except NoMatch as e:
            misses.append(f"softmax {div.name}: {e}")
            sites[site.mixed] = None  # still a site of the chain (untouched, no fold)
            continue
        sites[node] = plan.delta
        claimed |= plan.erase  # the key norm and the output norm are part of the site now
        fused += 1
    handoffs = count_handoffs(graph, sites) if fused else 0
    left = [m for m in norms if m.out not in claimed]
    return fused, handoffs, left, misses


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
