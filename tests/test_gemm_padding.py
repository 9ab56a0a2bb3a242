"""``patterns._fx.unpad_product``: Inductor's ``pad_mm`` form of a GEMM (zero-padded
operands, the result sliced back) read as the GEMM it computes, and nothing else."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from k3fusion.patterns._fx import (NoMatch, is_op, matmul_operands, product_under_slices,
                                   unpad_product)

aten = torch.ops.aten


def _graph(fn, *shapes):
    args = [torch.randn(s) for s in shapes]
    return make_fx(fn, tracing_mode="fake")(*args).graph


def _node(graph, op):
    (node,) = [n for n in graph.nodes if n.target == op]
    return node


def _placeholders(graph):
    return [n for n in graph.nodes if n.op == "placeholder"]


def _padded_mm(m, k, n, value_a=0.0, value_b=0.0, cut_m=None, cut_n=None):
    def fn(a, b):
        c = torch.mm(F.pad(a, (0, k, 0, m), value=value_a), F.pad(b, (0, n, 0, k), value=value_b))
        if cut_m if cut_m is not None else m:
            c = c[:-(cut_m if cut_m is not None else m)]
        if cut_n if cut_n is not None else n:
            c = c[:, :-(cut_n if cut_n is not None else n)]
        return c
    return fn


@pytest.mark.parametrize("m,k,n", [(0, 3, 0), (6, 0, 0), (0, 0, 5), (6, 3, 5)])
def test_padded_mm_is_its_operands_product(m, k, n):
    g = _graph(_padded_mm(m, k, n), (10, 13), (13, 3))
    a, b = _placeholders(g)
    up = unpad_product(_node(g, aten.mm.default))
    assert (up.a, up.b) == (a, b)
    assert up.result.meta["val"].shape == (10, 3)
    assert product_under_slices(up.result) is up.product
    assert matmul_operands(up.result) == (a, b)
    assert sum(is_op(x, aten.constant_pad_nd.default) for x in up.nodes) == 2
    assert sum(is_op(x, aten.slice.Tensor) for x in up.nodes) == (m > 0) + (n > 0)


def test_padded_bmm_inner_dim():
    def fn(w, v):  # the AttnRes mix: [B, 1, S] @ [B, S, H], S padded 3 -> 8
        return torch.bmm(F.pad(w, (0, 5)), F.pad(v, (0, 0, 0, 5)))
    g = _graph(fn, (4, 1, 3), (4, 3, 16))
    up = unpad_product(_node(g, aten.bmm.default))
    assert (up.a, up.b) == tuple(_placeholders(g)) and up.result is up.product


@pytest.mark.parametrize("case", ["value_a", "value_b", "k_mismatch", "short_cut", "no_cut"])
def test_other_paddings_are_no_match(case):
    """Not pad_mm's form, so not seen through: a non-zero pad value on either side (the
    padded terms are no zeros), an inner dim padded on one side only, rows sliced back
    to another count, or not at all."""
    if case == "k_mismatch":  # b's 16 rows are its own, not a padding of 13
        g = _graph(lambda a, b: torch.mm(F.pad(a, (0, 3)), b), (10, 13), (16, 3))
    else:
        kw = {"value_a": dict(value_a=1.0), "value_b": dict(value_b=1.0),
              "short_cut": dict(cut_m=2), "no_cut": dict(cut_m=0)}[case]
        g = _graph(_padded_mm(6, 3, 0, **kw), (10, 13), (13, 3))
    mm = _node(g, aten.mm.default)
    with pytest.raises(NoMatch):
        unpad_product(mm)
    assert matmul_operands([n for n in g.nodes if n.op == "output"][0].args[0]) in (
        None, tuple(mm.args))  # the padded operands, as they are
