"""Gradients of the functional ops (issue 28): ``rms_norm``, ``dual_rms_norm`` (the q/kv
pair), ``attn_res`` (mix, prefix update, output norm) and ``latent_moe_tail`` (tp = 1)
differentiate their reference formulas (``k3fusion/ops/_backward.py``); AttnRes has a
fused backward kernel on the kernel path.

Three checks per draw: the op's gradients are bit for bit those of ``k3fusion.reference``
under autograd in the same dtype, on the plain-torch path and with the forward in the
Triton interpreter (the backward recomputes the reference), except AttnRes's fused
backward, held to twice the reference's own error (the largest over 9 summation orders
of the width) plus 4 ulps; its second
derivatives (a double backward through the first gradients, as a gradient penalty takes
it); and fp32 gradients within 2**-17 of the largest (64 fp32 ulps, rows of at most 40)
of the fp64 reference's. Random token counts (0 and
1 included), widths that are not powers of two, fp32 / bf16 / fp16, strided row views,
block counts and flags."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

import k3fusion
from k3fusion import reference

from _exact import attn_res_fp64
from _kernel_paths import cpu_path

ops = torch.ops.k3fusion
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _leaf(t: torch.Tensor, dtype=None) -> torch.Tensor:
    return t.detach().to(dtype or t.dtype).requires_grad_()


def _rows(tokens: int, width: int, dtype, g, strided: bool) -> torch.Tensor:
    """[tokens, width] values; ``strided``: a row view of a wider buffer (row stride > width)."""
    full = torch.randn(tokens, width + 5 * strided, generator=g).to(dtype)
    return full[:, :width]


def _grads(fn, inputs, weights, create_graph=False):
    """Gradients of ``sum(w_i * out_i)`` over the outputs of ``fn(*inputs)``."""
    outs = fn(*inputs)
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    loss = sum((o.double() * w).sum() for o, w in zip(outs, weights))
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    return torch.autograd.grad(loss, leaves, allow_unused=True, create_graph=create_graph)


def _second_grads(fn, inputs, weights, g):
    """Gradients of ``sum(v_j * grad_j)`` over the first gradients (a double backward, as a
    gradient penalty takes it); None where no first gradient depends on the inputs."""
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    firsts = [f for f in _grads(fn, inputs, weights, create_graph=True)
              if f is not None and f.requires_grad]
    if not firsts:
        return None
    penalty = sum((f.double() * torch.randn(f.shape, generator=g, dtype=torch.float64)).sum()
                  for f in firsts)
    return torch.autograd.grad(penalty, leaves, allow_unused=True)


def _max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if b.numel() else 0.0


def _check_fused_backward(got, want, exact, dtype, reordered=()):
    """A fused backward (fp32 throughout, one rounding at the end) against the exact
    gradients: at most twice the reference's own error in ``dtype`` (fp32 sums; in 16-bit
    dtypes its roundings, of intermediate gradients too) plus 4 units in the last place
    of the largest. ``reordered``: the reference's gradients with its sums taken in other
    orders (:func:`_reordered_grads`); the largest of their errors counts as its own (the
    kernel's order is one more: where the terms cancel, the error of one order is luck)."""
    for i, (a, b, e) in enumerate(zip(got, want, exact)):
        assert (a is None) == (b is None)
        if a is None or not e.numel():
            continue
        assert a.dtype == b.dtype and a.shape == b.shape
        spacing = float(torch.finfo(dtype).eps) * (float(e.abs().max()) + 1)
        own = max([_max_error(b, e)] + [_max_error(r[i], e) for r in reordered])
        bound = 2 * own + 4 * spacing
        assert _max_error(a, e) <= bound, ("fused backward", _max_error(a, e), bound)


#: Summation orders of the width the reference is also run in (:func:`_reordered_grads`).
REORDERINGS = 8


def _reordered_grads(fn, tensors, weights):
    """``fn``'s gradients with the last dim of every input and output permuted (fixed
    permutations, undone on the gradients): the same math, its sums over that dim taken
    in other orders -- for an op whose every tensor ends in the row width (AttnRes)."""
    out = []
    for i in range(REORDERINGS):
        width = tensors[0].shape[-1]
        perm = torch.randperm(width, generator=torch.Generator().manual_seed(i))
        back = torch.argsort(perm)
        grads = _grads(fn, [_leaf(t[..., perm]) for t in tensors], [w[..., perm] for w in weights])
        out.append([None if x is None else x[..., back] for x in grads])
    return out


def _check(op_fn, ref_fn, tensors, dtype, g, out_shapes, exact_fn=None):
    """``exact_fn`` (the op's math in fp64, rounding nothing): the kernel path's first
    gradients come from a fused backward kernel, held to :func:`_check_fused_backward`
    against ``exact_fn``'s instead of the reference's bits."""
    weights = [torch.randn(s, generator=g, dtype=torch.float64) for s in out_shapes]
    want = _grads(ref_fn, [_leaf(t) for t in tensors], weights)
    exact = _grads(ref_fn, [_leaf(t, torch.float64) for t in tensors], weights)
    for path in ("reference", "kernel"):
        with cpu_path(path):
            got = _grads(op_fn, [_leaf(t) for t in tensors], weights)
        if exact_fn is not None and path == "kernel":
            _check_fused_backward(got, want, _grads(
                exact_fn, [_leaf(t, torch.float64) for t in tensors], weights), dtype,
                _reordered_grads(ref_fn, tensors, weights))
            continue
        for a, b in zip(got, want):
            assert (a is None) == (b is None)
            if a is not None:
                assert a.dtype == b.dtype and torch.equal(a, b), (path, (a - b).abs().max())
    # Second order: the op's backward differentiable itself (a silent zero before).
    state = g.get_state()
    want2 = _second_grads(ref_fn, [_leaf(t) for t in tensors], weights, g)
    for path in ("reference", "kernel"):
        g.set_state(state)
        with cpu_path(path):
            got2 = _second_grads(op_fn, [_leaf(t) for t in tensors], weights, g)
        assert (got2 is None) == (want2 is None), path
        for a, b in zip(got2 or (), want2 or ()):
            assert (a is None) == (b is None)
            if a is not None:
                assert torch.equal(a, b), (path, "second order", (a - b).abs().max())
    if dtype == torch.float32:  # against the exact gradients
        for a, b in zip(want, exact):
            if a is not None and b.numel():
                assert float((a.double() - b).abs().max()) <= 2**-17 * (float(b.abs().max()) + 1)


@given(tokens=st.sampled_from([0, 1, 3, 7]), width=st.sampled_from([8, 24, 40]),
       dtype=st.sampled_from(DTYPES), weight_in_fp32=st.booleans(), strided=st.booleans(),
       seed=st.integers(0, 2**16))
def test_rms_norm_gradients(tokens, width, dtype, weight_in_fp32, strided, seed):
    g = torch.Generator().manual_seed(seed)
    x = _rows(tokens, width, dtype, g, strided)
    w = (1 + 0.3 * torch.randn(width, generator=g)).to(dtype)
    _check(lambda x, w: ops.rms_norm(x, w, 1e-6, weight_in_fp32),
           lambda x, w: reference.rms_norm(x, w, 1e-6, weight_in_fp32), [x, w], dtype, g,
           [(tokens, width)])


@given(tokens=st.sampled_from([0, 1, 5]), dtype=st.sampled_from(DTYPES),
       strided=st.booleans(), seed=st.integers(0, 2**16))
def test_dual_rms_norm_gradients(tokens, dtype, strided, seed):
    g = torch.Generator().manual_seed(seed)
    # the q/kv shape: q rows and the first 24 of a 28-wide kv row (a slice of a projection)
    q = _rows(tokens, 40, dtype, g, strided)
    kv = _rows(tokens, 28, dtype, g, False)[:, :24]
    w1 = (1 + 0.3 * torch.randn(40, generator=g)).to(dtype)
    w2 = (1 + 0.3 * torch.randn(24, generator=g)).to(dtype)
    _check(lambda a, b, c, d: ops.dual_rms_norm(a, b, 1e-6, c, d, 1e-5),
           lambda a, b, c, d: reference.dual_rms_norm(a, b, 1e-6, c, d, 1e-5),
           [q, w1, kv, w2], dtype, g, [(tokens, 40), (tokens, 24)])


def _attn_res_reference(prefix, blocks, num_blocks, norm_w, proj_w, delta, out_norm_w):
    rows = prefix.clone()
    out = reference.attn_res(rows, blocks, num_blocks, norm_w, proj_w, 1e-6, delta, -1,
                             out_norm_w, 1e-5)
    return [out] if delta is None else [out, rows]


@given(tokens=st.sampled_from([0, 1, 4]), width=st.sampled_from([16, 40]),
       nb_max=st.integers(1, 4), data=st.data(), dtype=st.sampled_from(DTYPES),
       with_delta=st.booleans(), out_norm=st.booleans(), seed=st.integers(0, 2**16))
def test_attn_res_gradients(tokens, width, nb_max, data, dtype, with_delta, out_norm, seed):
    num_blocks = data.draw(st.integers(0, nb_max))
    _attn_res_gradients(tokens, width, nb_max, num_blocks, dtype, with_delta, out_norm, seed)


@pytest.mark.parametrize("tokens,width,nb_max,num_blocks,seed", [(1, 40, 4, 2, 33),
                                                                 (1, 16, 1, 1, 275)])
def test_attn_res_gradients_where_the_terms_cancel(tokens, width, nb_max, num_blocks, seed):
    """Draws of the property (fp32, no delta, no output norm) where ``d proj_w`` is a small
    difference of large terms: at seed 33 the fused backward's weight-gradient form before
    2026-12-06 was 19 ulps of the largest off (the reference 1; held to the reference's own
    order there: ``test_weight_gradients_share_the_references_softmax_term``, where the old
    form fails); at seed 275 (largest
    gradient 0.054) the reference itself is 7.3e-7 off in its own order and up to 1.4e-6
    in others, the kernel 2.3e-6: within twice the worst order's, plus 4 ulps."""
    _attn_res_gradients(tokens, width, nb_max, num_blocks, torch.float32, False, False, seed)


def _attn_res_gradients(tokens, width, nb_max, num_blocks, dtype, with_delta, out_norm, seed):
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randn(tokens, width, generator=g).to(dtype)
    blocks = torch.randn(tokens, nb_max, width, generator=g).to(dtype)
    norm_w = (1 + 0.3 * torch.randn(width, generator=g)).to(dtype)
    proj_w = (torch.randn(width, generator=g) / width**0.5).to(dtype)
    delta = torch.randn(tokens, width, generator=g).to(dtype) if with_delta else None
    out_w = (1 + 0.3 * torch.randn(width, generator=g)).to(dtype) if out_norm else None
    tensors = [t for t in (prefix, blocks, norm_w, proj_w, delta, out_w) if t is not None]

    def unpack(ts):
        it = iter(ts)
        p, b, nw, pw = next(it), next(it), next(it), next(it)
        d = next(it) if with_delta else None
        ow = next(it) if out_norm else None
        return p, b, nw, pw, d, ow

    def op_fn(*ts):
        p, b, nw, pw, d, ow = unpack(ts)
        return ops.attn_res(p, b, num_blocks, nw, pw, 1e-6, d, ow, 1e-5)

    def ref_fn(*ts):
        p, b, nw, pw, d, ow = unpack(ts)
        return _attn_res_reference(p, b, num_blocks, nw, pw, d, ow)

    def exact_fn(*ts):
        p, b, nw, pw, d, ow = unpack(ts)
        out, new_prefix = attn_res_fp64(p, b, num_blocks, nw, pw, d, ow)
        return [out] if d is None else [out, new_prefix]

    _check(op_fn, ref_fn, tensors, dtype, g,
           [(tokens, width)] * (2 if with_delta else 1), exact_fn=exact_fn)


@given(tokens=st.sampled_from([0, 1, 6]), dtype=st.sampled_from([torch.float32,
                                                                torch.bfloat16]),
       weight_in_fp32=st.booleans(), seed=st.integers(0, 2**16))
def test_latent_moe_tail_gradients(tokens, dtype, weight_in_fp32, seed):
    g = torch.Generator().manual_seed(seed)
    latent, hidden = 24, 40
    routed = torch.randn(tokens, latent, generator=g).to(dtype)
    shared = torch.randn(tokens, hidden, generator=g).to(dtype)
    norm_w = (1 + 0.3 * torch.randn(latent, generator=g)).to(dtype)
    up_w = (torch.randn(hidden, latent, generator=g) / latent**0.5).to(dtype)
    _check(lambda r, s, n, u: ops.latent_moe_tail(r, s, n, 1e-6, u, None, weight_in_fp32),
           lambda r, s, n, u: reference.latent_moe_tail(r, s, n, 1e-6, u, None,
                                                        weight_in_fp32),
           [routed, shared, norm_w, up_w], dtype, g, [(tokens, hidden)])


def test_gradients_only_for_inputs_that_require_them():
    x = torch.randn(3, 8, requires_grad=True)
    w = torch.randn(8)  # a frozen weight
    ops.rms_norm(x, w, 1e-6).sum().backward()
    assert x.grad is not None and w.grad is None


def test_a_compiled_function_of_an_op_differentiates_it():
    """Dynamo and AOTAutograd trace the registered backward (the reference's ops)."""
    def f(x, w):
        return ops.rms_norm(x, w, 1e-6).square().sum()

    x, w = torch.randn(5, 12, requires_grad=True), torch.randn(12, requires_grad=True)
    want = torch.autograd.grad(f(x, w), (x, w))
    with cpu_path("reference"):
        got = torch.autograd.grad(torch.compile(f, backend="aot_eager")(x, w), (x, w))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_mutating_ops_still_refuse_autograd():
    p = torch.randn(2, 8, requires_grad=True)
    b, nw, pw = torch.randn(2, 3, 8), torch.ones(8), torch.randn(8)
    with pytest.raises(RuntimeError):
        ops.attn_res_(p, b, 1, nw, pw, 1e-6).sum().backward()
    assert k3fusion  # imported for the op registrations
