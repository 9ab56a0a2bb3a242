"""Fusion 1: the MLA q/kv RMSNorm pair -> ``torch.ops.k3fusion.dual_rms_norm``.

In an MLA block both latents are projections of the same hidden state::

    q_c        = q_a_layernorm(q_a_proj(h))
    kv_c, k_pe = kv_a_proj_with_mqa(h).split([kv_lora, rope], -1)
    kv_c       = kv_a_layernorm(kv_c)          # a strided view: 512 of a 576-wide row
    (or one fused projection split into q_c, kv_c, k_pe)

Two recognized RMSNorms pair when neither depends on the other and their inputs share a
source (``pairing_source``: projections of one activation -- or of its casts to one dtype,
as autocast casts it once per projection --, views of one tensor, or region inputs). Among norms of one source, pairs follow the projection structure (``_pair_score``):
each latent starts at column 0 of its projection, or right after the other in a fused one;
such pairs are *strong*, and no other fusion claims their norms. The pair becomes one
``dual_rms_norm`` node before the first reader of either output; an input's
``.contiguous()`` copy is skipped when the op reads the strided rows.

The rules and near misses: docs/design-notes.md, "patterns/qkv_rmsnorm.py".
"""

from __future__ import annotations

import itertools
import operator
import re
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.fx import Graph, Node

import k3fusion.ops  # noqa: F401  registers torch.ops.k3fusion.* (the op this pass inserts)
from k3fusion.config import env_name

from ._fx import (VIEW_OPS, NoMatch, all_or_nothing, apply_size_reads, aten, depends_on,
                  erase_unused, fake_call, hoist_before, insert_call, is_graph_input, is_op,
                  matmul_operands, plan_size_reads, prims, row_padded, slice_args, users, val,
                  view_base, written_buffers)
from .fusion import Fusion, FusionResult, Reservation
from .rms_norm import RMSNormMatch, eps_op_args

__all__ = ["FUSION", "FUSION_NAME", "REGION_INPUTS", "STRONG", "pairing_source",
           "pair_qkv_norms", "fuse_qkv_rmsnorm"]

FUSION_NAME = "qkv_rmsnorm"

#: The shared source of every norm whose input is (a view of) a graph input.
REGION_INPUTS = "region inputs"

#: Pair scores from this one up follow the projection structure (strong pairs).
STRONG = 2


def _strip_views(node: object) -> object:
    while is_op(node, *VIEW_OPS) or _is_copy(node):
        node = node.args[0]
    return node


def _is_copy(node: object) -> bool:
    """``x.contiguous()`` / ``x.clone()``: the same values in a new buffer."""
    return is_op(node, aten.clone.default) and len(node.args) == 1


def _is_row_reshape(node: object) -> bool:
    """A reshape or squeeze of the leading dims (the last dim kept)."""
    return bool(is_op(node, *_RESHAPES_AND_SQUEEZES) and val(node.args[0]).dim()
                and _int(val(node.args[0]).shape[-1]) == _int(val(node).shape[-1]))


def _through_row_reshapes(node: object) -> object:
    """``node`` before reshapes of its leading dims."""
    while _is_row_reshape(node):
        node = node.args[0]
    return node


def _projection(node: object) -> tuple[Node, Node] | None:
    """``matmul_operands`` of a projection, also when its bias add is a node of its own:
    ``bias + a @ b`` (either order, ``bias`` one row wide), as Inductor's post-grad pass
    splits an ``addmm`` that only pointwise ops read, on GPUs."""
    if is_op(node, aten.add.Tensor) and len(node.args) == 2 and not node.kwargs:
        for mm, bias in (node.args, node.args[::-1]):
            mm = _through_row_reshapes(mm)
            if (is_op(mm, aten.mm.default) and isinstance(bias, Node)
                    and val(bias).dim() == 1 and val(bias).shape == val(node).shape[-1:]
                    and val(bias).dtype == val(node).dtype):
                return matmul_operands(mm)
    return matmul_operands(node)


def pairing_source(x: Node) -> object:
    """What ``x`` is computed from, for pairing (see the module docstring)."""
    base = _strip_views(x)
    product = _projection(base)
    if product is not None:
        a = _strip_views(product[0])
        # Each projection's own row padding (pad_mm) of the one hidden state: that state.
        padded = row_padded(a)
        a = a if padded is None else _strip_views(padded)
        # Autocast casts the hidden state once per projection: casts of one state to one
        # dtype are that state.
        if is_op(a, prims.convert_element_type.default):
            return ("cast", _strip_views(a.args[0]), a.args[1])
        return a
    if isinstance(base, Node) and base.op in ("placeholder", "get_attr"):
        return REGION_INPUTS
    return base


@dataclass(frozen=True)
class Columns:
    """Which columns of which projection a norm's rows are: ``[start, start + size)`` of
    ``proj`` (``width`` wide); ``proj`` None when the input is no projection's columns."""

    proj: Node | None
    start: int = 0
    size: int = 0
    width: int = 0

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.size == self.width


def _int(x) -> int | None:
    try:
        return int(x)
    except (TypeError, ValueError):  # symbolic
        return None


_RESHAPES_AND_SQUEEZES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default,
                          aten.squeeze.dim, aten.squeeze.default, aten.unsqueeze.default)


def columns(x: Node) -> Columns:
    """Walk from a norm input back to a projection through last-dim slices and splits,
    views that keep the last dim, and copies, adding up the column offset."""
    node, start = x, 0
    size = _int(val(x).shape[-1])
    while isinstance(node, Node):
        if _is_copy(node):
            node = node.args[0]
        elif is_op(node, aten.slice.Tensor):
            dim, s, _, step = slice_args(node)
            base = node.args[0]
            if dim not in (-1, val(base).dim() - 1) or step != 1:
                break
            s = 0 if s is None else _int(s)
            if s is None or s < 0:
                break
            start, node = start + s, base
        elif is_op(node, operator.getitem) and is_op(
                node.args[0], aten.split_with_sizes.default, aten.split.Tensor):
            split, i = node.args[0], node.args[1]
            base = split.args[0]
            dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
            if dim not in (-1, val(base).dim() - 1):
                break
            sizes = split.args[1]
            if is_op(split, aten.split.Tensor):
                sizes = [sizes] * (i + 1)
            before = [_int(n) for n in sizes[:i]]
            if None in before:
                break
            start, node = start + sum(before), base
        elif _is_row_reshape(node):
            node = node.args[0]
        else:
            break
    if size is None or _projection(node) is None:
        return Columns(None)
    width = _int(val(node).shape[-1])
    return Columns(node, start, size, width) if width is not None else Columns(None)


def _pair_score(a: Columns, b: Columns) -> int:
    """How well two norms of one source fit the MLA structure: 3 for the latents (one at
    column 0 of its projection, the other at column 0 of another projection, not both a
    whole projection -- or right after it in the same projection), 2 for two norms at
    column 0 of two projections, 1 for anything else (a later slice, no projection)."""
    if a.proj is None or b.proj is None:
        return 1
    if a.proj is b.proj:
        first, second = sorted((a, b), key=lambda c: c.start)
        return 3 if first.start == 0 and second.start == first.start + first.size else 1
    if a.start == 0 and b.start == 0:
        return 3 if a.whole != b.whole else 2
    return 1


@dataclass
class QKVPairing:
    #: (first, second, score), in the order they were chosen.
    pairs: list[tuple[RMSNormMatch, RMSNormMatch, int]]
    #: Norms left unpaired, with the reason (for the debug log).
    unpaired: list[tuple[RMSNormMatch, str]]

    def strong_members(self) -> set[Node]:
        """The outputs of norms in pairs that follow the projection structure."""
        return {m.out for a, b, score in self.pairs if score >= STRONG for m in (a, b)}


def pair_qkv_norms(graph: Graph, norms: list[RMSNormMatch]) -> QKVPairing:
    """Pair norms of one source, best-fitting pairs first (ties: graph order)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    by_source: dict[object, list[RMSNormMatch]] = defaultdict(list)
    unpaired: list[tuple[RMSNormMatch, str]] = []
    for norm in norms:
        by_source[pairing_source(norm.x)].append(norm)

    pairs = []
    for group in by_source.values():
        group.sort(key=lambda m: order[m.out])
        cols = {id(m): columns(m.x) for m in group}
        candidates, dependant = [], {}
        for a, b in itertools.combinations(group, 2):
            if depends_on(b.x, a.nodes, order):
                # b is computed from a's result: one launch cannot do both
                dependant.setdefault(id(a), b)
                continue
            score = _pair_score(cols[id(a)], cols[id(b)])
            candidates.append((-score, order[a.out], order[b.out], a, b))
        taken: set[int] = set()
        for neg, _, _, a, b in sorted(candidates, key=lambda c: c[:3]):
            if id(a) in taken or id(b) in taken:
                continue
            pairs.append((a, b, -neg))
            taken |= {id(a), id(b)}
        for m in group:
            if id(m) in taken:
                continue
            if id(m) in dependant:
                unpaired.append((m, f"{dependant[id(m)].out.name} depends on it"))
            else:
                unpaired.append((m, "no other norm shares its source (a projection of the "
                                    "same hidden state, a view of the same tensor, or a "
                                    "region input)"))
    return QKVPairing(pairs, unpaired)


def _through_copy(norm: RMSNormMatch) -> Node:
    """The norm's input, or the strided tensor its ``.contiguous()`` copy reads."""
    x = norm.x
    if _is_copy(x) and len(users(x)) == 1 and x.args[0] is not None:
        return x.args[0]
    return x


def _pair_args(a: RMSNormMatch, b: RMSNormMatch, xa: Node, xb: Node,
               weights_early: bool = False) -> tuple:
    (eps_a, eps_a_tensor), (eps_b, eps_b_tensor) = eps_op_args(a.eps), eps_op_args(b.eps)
    return (xa, a.weight, eps_a, xb, b.weight, eps_b, a.weight_in_fp32, b.weight_in_fp32,
            eps_a_tensor, eps_b_tensor, weights_early)


def weights_early(rows: list[Node], weights: list[Node], written: set[Node]) -> bool:
    """Whether the fused kernel may read the weights before the launch ahead of it has
    finished (``dual_rms_norm(weights_early=True)``): the weights are the graph's inputs
    and no node of the graph writes them, and both row inputs are computed in the graph,
    so the launch ahead of the kernel is one of the graph's own (it runs after the rows'
    producer) and everything before that one has finished (docs/design-notes.md,
    "Weights read before the PDL wait"). ``written``: the graph's
    :func:`~._fx.written_buffers`."""
    bases = {view_base(w) for w in weights}  # views only: a copy is written in the graph
    if not all(is_graph_input(w) for w in bases):
        return False
    if any(is_graph_input(view_base(x)) for x in rows):
        return False
    return not bases & written


def _replace_pair(graph: Graph, a: RMSNormMatch, b: RMSNormMatch, written: set[Node]) -> None:
    """One ``dual_rms_norm`` before the first reader of either output.

    The q norm's readers usually come before the kv projection in graph order, so the
    pure ops that compute the later input are moved up first (``hoist_before``).
    """
    op = torch.ops.k3fusion.dual_rms_norm.default
    xa, xb = a.x, b.x
    for through in ((_through_copy(a), _through_copy(b)), (_through_copy(a), b.x),
                    (a.x, _through_copy(b))):
        try:  # skip a .contiguous() copy the op does not need (it reads strided rows)
            fake_call(op, _pair_args(a, b, *through))
        except (TypeError, ValueError):
            continue
        xa, xb = through
        break
    args = _pair_args(a, b, xa, xb, weights_early([xa, xb], [a.weight, b.weight], written))
    try:  # the op's own checks (strides, devices...) before the graph is touched
        fake_call(op, args)
    except (TypeError, ValueError) as e:
        raise NoMatch(f"the fused op refuses these inputs: {e}") from None
    size_reads = plan_size_reads(a.nodes + b.nodes, [xa, xb])  # defined before the reads
    order = {n: i for i, n in enumerate(graph.nodes)}
    point = min((u for m in (a, b) for u in m.out.users), key=order.__getitem__)
    hoist_before(graph, [xa, a.weight, xb, b.weight], point)
    with all_or_nothing(graph), graph.inserting_before(point):
        fused = insert_call(graph, op, args)
        outs = [insert_call(graph, operator.getitem, (fused, i)) for i in range(2)]
    for norm, y in zip((a, b), outs):
        norm.out.replace_all_uses_with(y)
    apply_size_reads(size_reads)
    copies = [m.x for m, x in ((a, xa), (b, xb)) if x is not m.x]  # now unread
    erase_unused(graph, a.nodes + b.nodes + copies)


def _miss(norm: RMSNormMatch, why: str) -> str:
    """The debug log's line for a norm left unfused (read back by :data:`MISS_LINE`)."""
    return f"RMSNorm {norm.out.name} (x={norm.x.name}) not fused: {why}"


MISS_LINE = re.compile(r"^RMSNorm (\S+) \(x=\S+\) not fused: (.*)$")


def fuse_qkv_rmsnorm(graph: Graph, norms: list[RMSNormMatch]) -> FusionResult:
    """Replace every q/kv pair among ``norms``; every norm left has a miss line saying why."""
    rounded = [(m, "fp32 input with a dropped 16-bit round trip (x_round): the pair kernel "
                   "reads the model dtype") for m in norms if m.x_round is not None]
    pairing = pair_qkv_norms(graph, [m for m in norms if m.x_round is None])
    fused, unpaired, claimed = 0, rounded + list(pairing.unpaired), set()
    written = written_buffers(graph)  # the pairs' ops write nothing: valid for every pair
    for a, b, _ in pairing.pairs:
        try:
            _replace_pair(graph, a, b, written)
            fused += 1
            claimed |= {a.out, b.out}
        except NoMatch as e:  # raised before the graph is touched
            unpaired += [(a, str(e)), (b, str(e))]
    return FusionResult({FUSION_NAME: fused}, frozenset(claimed),
                        tuple(_miss(m, why) for m, why in unpaired))


def _strong_pairs(graph: Graph, norms: list[RMSNormMatch]) -> set[Node]:
    return pair_qkv_norms(graph, norms).strong_members()


def _switched_off(norms: list[RMSNormMatch]) -> tuple[str, ...]:
    why = f"{FUSION_NAME} is disabled ({env_name(FUSION.switch)}=0)"
    return tuple(_miss(m, why) for m in norms)


#: The q/kv pass claims last, and pairs what is left (norms of region inputs, the weakest
#: evidence, only then); but the pairs that follow the projection structure are reserved
#: before the MoE tail claims (docs/architecture.md, "Claims between fusions").
FUSION = Fusion(name=FUSION_NAME, switch="qkv_rmsnorm", claim_priority=40,
                run=fuse_qkv_rmsnorm, count_names=(FUSION_NAME,), miss_kind="RMSNorm",
                miss_line=MISS_LINE, reservation=Reservation(20, _strong_pairs),
                when_off=_switched_off)
