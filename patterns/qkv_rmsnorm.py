"""Fusion 1: the MLA q/kv RMSNorm pair -> ``torch.ops.k3fusion.dual_rms_norm``.

In an MLA block both latents are projections of the same hidden state::

    q_c        = q_a_layernorm(q_a_proj(h))
    kv_c, k_pe = kv_a_proj_with_mqa(h).split([kv_lora, rope], -1)
    kv_c       = kv_a_layernorm(kv_c)          # a strided view: 512 of a 576-wide row

Two recognized RMSNorms are paired when neither depends on the other and their inputs
share a source (``pairing_source``):

* projections (mm/addmm, up to views) of the same activation -- the MLA block above --
  also where Inductor's ``pad_mm`` gave each projection its own row-padded copy of it;
* views of the same tensor -- a fused ``q_a + kv_a`` projection split into q_c and kv_c;
* inputs of the compiled region -- their producer lies outside the graph, and two
  independent norms of inputs are always safe to run in one launch.

The pair becomes one ``dual_rms_norm`` node placed before the first reader of either
output; the pure ops computing the later input move up to make room.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.fx import Graph, Node

import k3fusion.ops  # noqa: F401  registers torch.ops.k3fusion.* (the op this pass inserts)
from ._fx import (VIEW_OPS, NoMatch, apply_size_reads, depends_on, erase_unused, fake_call,
                  hoist_before, is_op, matmul_operands, plan_size_reads, row_padded)
from .rms_norm import RMSNormMatch, eps_op_args

__all__ = ["FUSION_NAME", "REGION_INPUTS", "pairing_source", "pair_qkv_norms", "fuse_qkv_rmsnorm"]

FUSION_NAME = "qkv_rmsnorm"


def _strip_views(node: object) -> object:
    while is_op(node, *VIEW_OPS):
        node = node.args[0]
    return node


#: The shared source of every norm whose input is (a view of) a graph input.
REGION_INPUTS = "region inputs"


def pairing_source(x: Node) -> object:
    """What ``x`` is computed from, for pairing (see the module docstring)."""
    base = _strip_views(x)
    product = matmul_operands(base)
    if product is not None:
        a = _strip_views(product[0])
        # Each projection's own row padding (pad_mm) of the one hidden state: that state.
        padded = row_padded(a)
        return a if padded is None else _strip_views(padded)
    if isinstance(base, Node) and base.op in ("placeholder", "get_attr"):
        return REGION_INPUTS
    return base


@dataclass
class QKVPairing:
    pairs: list[tuple[RMSNormMatch, RMSNormMatch]]
    #: Norms left unpaired, with the reason (for the debug log).
    unpaired: list[tuple[RMSNormMatch, str]]


def pair_qkv_norms(graph: Graph, norms: list[RMSNormMatch]) -> QKVPairing:
    """Pair norms of projections of one hidden state, in graph order, two at a time."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    by_source: dict[object, list[RMSNormMatch]] = defaultdict(list)
    unpaired: list[tuple[RMSNormMatch, str]] = []
    for norm in norms:
        by_source[pairing_source(norm.x)].append(norm)

    pairs = []
    for group in by_source.values():
        group.sort(key=lambda m: order[m.out])
        while len(group) >= 2:
            first, second = group[0], group[1]
            if depends_on(second.x, first.nodes, order):
                unpaired.append((first, f"{second.out.name} depends on it"))
                group.pop(0)
                continue
            pairs.append((first, second))
            del group[:2]
        unpaired += [(m, "no other norm shares its source (a projection of the same "
                         "hidden state, a view of the same tensor, or a region input)")
                     for m in group]
    return QKVPairing(pairs, unpaired)


def _replace_pair(graph: Graph, a: RMSNormMatch, b: RMSNormMatch) -> None:
    """One ``dual_rms_norm`` before the first reader of either output.

    The q norm's readers usually come before the kv projection in graph order, so the
    pure ops that compute the later input are moved up first (``hoist_before``).
    """
    op = torch.ops.k3fusion.dual_rms_norm.default

    (eps_a, eps_a_tensor), (eps_b, eps_b_tensor) = eps_op_args(a.eps), eps_op_args(b.eps)
    args = (a.x, a.weight, eps_a, b.x, b.weight, eps_b, a.weight_in_fp32, b.weight_in_fp32,
            eps_a_tensor, eps_b_tensor)
    try:  # the op's own checks (strides, devices...) before the graph is touched
        fused_val = fake_call(op, args)
    except (TypeError, ValueError) as e:
        raise NoMatch(f"the fused op refuses these inputs: {e}") from None
    size_reads = plan_size_reads(a.nodes + b.nodes, [a.x, b.x])  # defined before the reads
    order = {n: i for i, n in enumerate(graph.nodes)}
    point = min((u for m in (a, b) for u in m.out.users), key=order.__getitem__)
    hoist_before(graph, [a.x, a.weight, b.x, b.weight], point)
    with graph.inserting_before(point):
        fused = graph.call_function(op, args)
        outs = [graph.call_function(operator.getitem, (fused, i)) for i in range(2)]
    fused.meta["val"] = fused_val
    for i, (norm, y) in enumerate(zip((a, b), outs)):
        y.meta["val"] = fused.meta["val"][i]
        norm.out.replace_all_uses_with(y)
    apply_size_reads(size_reads)
    erase_unused(graph, a.nodes + b.nodes)


def fuse_qkv_rmsnorm(graph: Graph, norms: list[RMSNormMatch]) -> tuple[int, list[tuple[RMSNormMatch, str]]]:
    """Replace every q/kv pair among ``norms``; returns (pairs fused, norms left and why)."""
    rounded = [(m, "fp32 input with a dropped 16-bit round trip (x_round): the pair kernel "
                   "reads the model dtype") for m in norms if m.x_round is not None]
    pairing = pair_qkv_norms(graph, [m for m in norms if m.x_round is None])
    fused, unpaired = 0, rounded + list(pairing.unpaired)
    for a, b in pairing.pairs:
        try:
            _replace_pair(graph, a, b)
            fused += 1
        except NoMatch as e:  # raised before the graph is touched
            unpaired += [(a, str(e)), (b, str(e))]
    return fused, unpaired
