"""The GEMM forms a GPU build makes, read as the GEMM they compute, and nothing else:
``patterns._fx.unpad_product`` (``pad_mm``: zero-padded operands, the result sliced back)
and ``decomposed_product`` (``mode="max-autotune"``: a one-row / one-column GEMM as an fp32
broadcast multiply and sum)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from k3fusion.patterns._fx import (NoMatch, decomposed_product, is_op, matmul_operands,
                                   product_of_result, product_reading, unpad_product,
                                   unpadded_result)

aten = torch.ops.aten


def _graph_of(fn, *tensors):
    """The graph with Inductor's decompositions (casts as ``convert_element_type``)."""
    from torch._inductor.decomposition import select_decomp_table
    return make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="fake")(
        *tensors).graph


def _graph(fn, *shapes):
    return _graph_of(fn, *(torch.randn(s) for s in shapes))


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
    assert unpadded_result(up.result) == up
    assert unpadded_result(up.product) == (up if up.result is up.product else None)
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


def _upcast(x):
    return x.float() if x.dtype != torch.float32 else x


def _bmm_decomposed(a, b):  # Inductor's GPU bmm decomposition under coordinate descent
    return (_upcast(a).unsqueeze(-1) * _upcast(b).unsqueeze(1)).sum(dim=2).to(a.dtype)


def _mm_decomposed(a, b):
    return (_upcast(a).unsqueeze(2) * _upcast(b).unsqueeze(0)).sum(dim=1).to(a.dtype)


def _output(graph):
    return [n for n in graph.nodes if n.op == "output"][0].args[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batched", [True, False], ids=["bmm", "mm"])
def test_decomposed_product_is_its_operands_product(batched, dtype):
    shapes = [(4, 1, 3), (4, 3, 16)] if batched else [(1, 13), (13, 5)]
    fn = _bmm_decomposed if batched else _mm_decomposed
    g = _graph_of(fn, *(torch.randn(s, dtype=dtype) for s in shapes))
    a, b = _placeholders(g)
    product = decomposed_product(_output(g))
    assert (product.a, product.b, product.batched) == (a, b, batched)
    assert product.result is _output(g) and product_of_result(_output(g)) == product
    assert all(product_reading(next(iter(x.users))) == product for x in (a, b))
    casts = dtype != torch.float32
    assert len(product.nodes) == 3 + 3 * casts  # unsqueezes and mul (+ 2 upcasts, 1 back)


@pytest.mark.parametrize("case", ["other_dim", "keepdim", "unsqueeze_elsewhere", "mixed_dtypes"])
def test_other_sums_of_products_are_no_gemm(case):
    """A sum of broadcast products that is not the decomposition: over another dim, with
    keepdim, operands unsqueezed elsewhere, or a 16-bit result of fp32 operands."""
    def fn(a, b):
        if case == "other_dim":
            return (a.unsqueeze(-1) * b.unsqueeze(1)).sum(dim=3)
        if case == "keepdim":
            return (a.unsqueeze(-1) * b.unsqueeze(1)).sum(dim=2, keepdim=True)
        if case == "unsqueeze_elsewhere":  # sum_k a[i, m, n] * b[i, k, n]: no matmul
            return (a.unsqueeze(2) * b.unsqueeze(1)).sum(dim=2)
        return (a.float().unsqueeze(-1) * b.unsqueeze(1)).sum(dim=2).to(torch.bfloat16)
    shapes = [(4, 3, 3), (4, 3, 3)]
    dtypes = (torch.bfloat16, torch.float32) if case == "mixed_dtypes" else (torch.float32,) * 2
    g = _graph_of(fn, *(torch.randn(s, dtype=d) for s, d in zip(shapes, dtypes)))
    assert decomposed_product(_output(g)) is None
    assert product_of_result(_output(g)) is None
