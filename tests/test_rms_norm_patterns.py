"""The RMSNorm recognizer (``k3fusion.patterns.rms_norm``) on real post-grad graphs.

Each test compiles a small function with :class:`graph_utils.CaptureBackend` (Inductor's own
passes, no codegen, no k3fusion pass) and runs ``find_rms_norms`` on the graph our pass
would see. Recognized forms must come back as exactly one match whose canonical description
(x, weight, eps, formulation) reproduces the eager function through
``k3fusion.reference.rms_norm``; near misses must come back as a rejection saying why.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch import fx

from k3fusion import reference
from k3fusion.patterns.rms_norm import find_rms_norms

from graph_utils import RSQRT, compile_capture, count_op, fresh_state  # noqa: F401

pytestmark = [
    pytest.mark.usefixtures("fresh_state"),
    # F.rms_norm warns when it cannot use its fused CPU kernel (mixed dtypes): expected.
    pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight"),
]

F32 = torch.float32


# ----------------------------------------------------------------------------- formulations
# Each takes (x, w, eps) and is written the way users write it.


def hf(x, w, eps):  # HF LlamaRMSNorm: weight on the left, after the downcast
    dt = x.dtype
    x = x.to(torch.float32)
    var = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(var + eps)
    return w * x.to(dt)


def vllm(x, w, eps):  # vLLM forward_native: weight on the right
    orig = x.dtype
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(dim=-1, keepdim=True)
    x32 = x32 * torch.rsqrt(variance + eps)
    return x32.to(orig) * w


def weight_fp32(x, w, eps):  # weight applied in fp32, one downcast
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def square(x, w, eps):  # x * x instead of pow
    x32 = x.float()
    return w * (x32 * torch.rsqrt((x32 * x32).mean(-1, keepdim=True) + eps)).to(x.dtype)


def eps_first(x, w, eps):  # eps + variance
    x32 = x.float()
    return (x32 * torch.rsqrt(eps + x32.pow(2).mean(-1, keepdim=True))).to(x.dtype) * w


def rsqrt_first(x, w, eps):  # rsqrt * x32
    x32 = x.float()
    return (torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * x32).to(x.dtype) * w


def last_dim_index(x, w, eps):  # mean over dim=ndim-1 instead of -1
    x32 = x.float()
    var = x32.pow(2).mean(x.dim() - 1, keepdim=True)
    return w * (x32 * torch.rsqrt(var + eps)).to(x.dtype)


def functional(x, w, eps):  # F.rms_norm
    return F.rms_norm(x, (x.shape[-1],), w, eps)


# name -> (fn, spells the weight-in-fp32 form, eager is the same op sequence as the reference)
FORMS = {
    "hf": (hf, False, True),
    "vllm": (vllm, False, True),
    "weight_fp32": (weight_fp32, True, True),
    "square": (square, False, True),
    "eps_first": (eps_first, False, True),
    "rsqrt_first": (rsqrt_first, False, True),
    "last_dim_index": (last_dim_index, False, True),
    "functional": (functional, True, False),
}

# (x dtype, weight dtype)
DTYPES = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.float32),  # mixed: cast-then-weight promotes to fp32
]


def _inputs(shape, x_dtype, w_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(shape, generator=g)).to(x_dtype)
    w = (1 + 0.2 * torch.randn(shape[-1], generator=g)).to(w_dtype)
    return x, w


def _placeholders(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if n.op == "placeholder"]


def _output_values(graph: fx.Graph) -> list:
    (out,) = [n for n in graph.nodes if n.op == "output"]
    return list(out.args[0])


def _check_recognized(graph, x, w, *, eps, weight_in_fp32, eager, exact):
    """One match, no rejection; its description is the eager function."""
    matches, rejected = find_rms_norms(graph)
    assert [r.reason for r in rejected] == []
    assert len(matches) == 1
    m = matches[0]
    x_node, w_node = _placeholders(graph)
    assert m.x is x_node and m.weight is w_node
    assert m.out is _output_values(graph)[0]
    assert m.width == x.shape[-1]
    assert m.eps == pytest.approx(eps, rel=1e-6)  # F.rms_norm's decomposition rounds to fp32
    assert m.weight_in_fp32 is weight_in_fp32
    assert m.out.meta["val"].dtype == eager.dtype
    # The canonical op with this description computes what the user wrote.
    canon = reference.rms_norm(x, w, m.eps, m.weight_in_fp32)
    assert canon.dtype == eager.dtype
    if exact:
        torch.testing.assert_close(canon, eager, rtol=0, atol=0)
    else:
        torch.testing.assert_close(canon, eager)
    # every node the match claims lies between x/weight and out, rsqrt included
    assert sum(n.target is RSQRT for n in m.nodes) == 1 and m.out in m.nodes


# ----------------------------------------------------------------------------- recognized


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(7, 48), (2, 3, 40)], ids=["2d", "3d"])
@pytest.mark.parametrize("x_dtype,w_dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("form", list(FORMS))
def test_formulation_recognized(form, x_dtype, w_dtype, shape):
    fn, wfp32, exact = FORMS[form]
    x, w = _inputs(shape, x_dtype, w_dtype)
    eps = 1e-5
    eager = fn(x, w, eps)
    out, be = compile_capture(lambda a, b: fn(a, b, eps), x, w, fusion_pass=None)
    torch.testing.assert_close(out, eager, rtol=0, atol=0)  # the harness runs aten eagerly
    # fp32 inputs have no casts: every form is then the weight-in-fp32 form.
    expected_flag = wfp32 or x_dtype == torch.float32
    _check_recognized(be.graph_before, x, w, eps=eps, weight_in_fp32=expected_flag,
                      eager=eager, exact=exact)
    if not expected_flag:  # cast-then-weight promotes with the weight
        assert eager.dtype == torch.promote_types(x_dtype, w_dtype)
    else:
        assert eager.dtype == x_dtype


@pytest.mark.parametrize("eps", [1e-6, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nn_rmsnorm_module_recognized(dtype, eps):
    norm = torch.nn.RMSNorm(24, eps=eps).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(24))
    x = torch.randn(5, 24).to(dtype)
    with torch.no_grad():
        eager = norm(x)
    out, be = compile_capture(norm, x, fusion_pass=None)
    torch.testing.assert_close(out, eager)
    matches, rejected = find_rms_norms(be.graph_before)
    assert len(matches) == 1 and not rejected
    (m,) = matches
    # eps=None means the fp32 machine epsilon (the computation dtype's)
    assert m.eps == pytest.approx(eps if eps is not None else torch.finfo(F32).eps, rel=1e-6)
    assert m.weight_in_fp32 is True and m.width == 24
    torch.testing.assert_close(reference.rms_norm(x, norm.weight.detach(), m.eps, True), eager)


def test_several_norms_found_in_graph_order():
    """Two norms and one near miss: matches in graph order, the near miss rejected."""
    def f(a, b, c, wa, wb, wc):
        ya = vllm(a, wa, 1e-6)
        yb = weight_fp32(b, wb, 1e-3)
        yc = gemma(c, wc, 1e-6)
        return ya, yb, yc
    args = [torch.randn(4, n, dtype=torch.bfloat16) for n in (16, 24, 32)]
    args += [torch.randn(n, dtype=torch.bfloat16) for n in (16, 24, 32)]
    _, be = compile_capture(f, *args, fusion_pass=None)
    matches, rejected = find_rms_norms(be.graph_before)
    by_width = {m.width: m for m in matches}
    assert sorted(by_width) == [16, 24] and len(matches) == 2
    assert (by_width[16].eps, by_width[16].weight_in_fp32) == (1e-6, False)
    assert (by_width[24].eps, by_width[24].weight_in_fp32) == (1e-3, True)
    assert len(rejected) == 1 and "computed in the graph" in rejected[0].reason
    order = {n: i for i, n in enumerate(be.graph_before.nodes)}
    assert [order[m.out] for m in matches] == sorted(order[m.out] for m in matches)


# explicit budget: every example is a compile (~0.1 s); the "dev" profile gets more.
# No shrinking: each shrink step is another compile; the failing example is still reported.
_NO_SHRINK = [Phase.explicit, Phase.reuse, Phase.generate]
_EXAMPLES = 20 if settings.default.max_examples <= 25 else 100


@settings(max_examples=_EXAMPLES, deadline=None, derandomize=True, phases=_NO_SHRINK,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    form=st.sampled_from(sorted(FORMS)),
    dtypes=st.sampled_from(DTYPES),
    width=st.integers(1, 300),
    rows=st.integers(1, 9),
    three_d=st.booleans(),
    eps=st.floats(1e-12, 1e-1),
)
def test_recognized_any_width_dtype_eps(form, dtypes, width, rows, three_d, eps):
    """Random widths (mostly not powers of two), dtypes and eps: one exact description."""
    fn, wfp32, exact = FORMS[form]
    shape = (2, rows, width) if three_d else (rows, width)
    x, w = _inputs(shape, *dtypes, seed=width)
    eager = fn(x, w, eps)
    _, be = compile_capture(lambda a, b: fn(a, b, eps), x, w, fusion_pass=None)
    _check_recognized(be.graph_before, x, w, eps=eps,
                      weight_in_fp32=wfp32 or dtypes[0] == torch.float32,
                      eager=eager, exact=exact)


# ----------------------------------------------------------------------------- near misses


def gemma(x, w, eps):  # (1 + w): a different function
    x32 = x.float()
    out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + w.float())).to(x.dtype)


def gemma_cast_first(x, w, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * (1 + w)


def other_cast_dtype(x, w, eps):  # bf16 input, normalized value cast to fp16
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(torch.float16) * w


def narrowed_weight(x, w, eps):  # fp32 weight rounded to fp16 in the weight-in-fp32 form
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * w.half()).to(x.dtype)


def other_dim(x, w, eps):  # mean over dim 1 of a 3-D input
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(1, keepdim=True) + eps)).to(x.dtype)


def no_keepdim(x, w, eps):  # square input: mean(-1) without keepdim broadcasts over columns
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1) + eps)).to(x.dtype)


def normed_returned(x, w, eps):  # the fp32 normalized value is an output too
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return normed.to(x.dtype) * w, normed


def upcast_reused(x, w, eps):  # x32 feeds something else
    x32 = x.float()
    y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w
    return y, x32.sum(-1)


def variance_reused(x, w, eps):
    x32 = x.float()
    var = x32.pow(2).mean(-1, keepdim=True)
    return (x32 * torch.rsqrt(var + eps)).to(x.dtype) * w, var


def no_weight(x, w, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def no_weight_fp32(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def bf16_math(x, w, eps):  # no fp32 upcast: the sum of squares is rounded to bf16
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def mean_not_square(x, w, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.abs().mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def tensor_eps(x, w, eps):  # eps is a tensor input, not a constant
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + w[:1].float())).to(x.dtype) * w


NEAR_MISSES = {
    # name: (fn, x shape, x dtype, w dtype, reason pattern)
    "gemma": (gemma, (5, 32), torch.bfloat16, torch.bfloat16, r"computed in the graph"),
    "gemma_cast_first": (gemma_cast_first, (5, 32), torch.bfloat16, torch.bfloat16,
                         r"computed in the graph"),
    "other_cast_dtype": (other_cast_dtype, (5, 32), torch.bfloat16, torch.float16,
                         r"cast to torch\.float16.*bfloat16"),
    "other_dim": (other_dim, (3, 4, 32), torch.bfloat16, torch.bfloat16, r"dims \[1\]"),
    "no_keepdim": (no_keepdim, (32, 32), torch.bfloat16, torch.bfloat16, r"keepdim=False"),
    "normed_returned": (normed_returned, (5, 32), torch.bfloat16, torch.bfloat16,
                        r"users|also read"),
    "upcast_reused": (upcast_reused, (5, 32), torch.bfloat16, torch.bfloat16,
                      r"also read|users"),
    "variance_reused": (variance_reused, (5, 32), torch.bfloat16, torch.bfloat16,
                        r"also read|users"),
    "no_weight": (no_weight, (5, 32), torch.bfloat16, torch.bfloat16, r"weight"),
    "no_weight_fp32": (no_weight_fp32, (5, 32), torch.float32, torch.float32,
                       r"not a weight multiply"),
    "bf16_math": (bf16_math, (5, 32), torch.bfloat16, torch.bfloat16, r"not float32"),
    "mean_not_square": (mean_not_square, (5, 32), torch.bfloat16, torch.bfloat16,
                        r"does not square"),
    "tensor_eps": (tensor_eps, (5, 32), torch.bfloat16, torch.bfloat16, r"eps"),
}


@pytest.mark.parametrize("name", list(NEAR_MISSES))
def test_near_miss_not_recognized(name):
    fn, shape, x_dtype, w_dtype, reason = NEAR_MISSES[name]
    x, w = _inputs(shape, x_dtype, w_dtype)
    eager = fn(x, w, 1e-6)
    out, be = compile_capture(lambda a, b: fn(a, b, 1e-6), x, w)  # with the k3fusion pass
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    graph = be.graph_before
    assert count_op(graph, RSQRT) == 1
    matches, rejected = find_rms_norms(graph)
    assert matches == []
    assert len(rejected) == 1 and rejected[0].anchor.target is RSQRT
    assert re.search(reason, rejected[0].reason), rejected[0].reason
    # and the k3fusion pass left the graph exactly as it was
    assert be.graph_after.python_code("self").src == graph.python_code("self").src


def test_unrecognized_norm_width_is_not_guessed():
    """A weight whose length differs from the row width (broadcast [1]) is refused."""
    def f(x, w):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    w = torch.randn(1, dtype=torch.bfloat16)
    _, be = compile_capture(f, x, w, fusion_pass=None)
    matches, rejected = find_rms_norms(be.graph_before)
    assert matches == [] and len(rejected) == 1
    assert re.search(r"1 elements|shape", rejected[0].reason), rejected[0].reason


# ------------------------------------------------------------------- other spellings of x
# Same function as the canonical cast-then-weight op, although the value multiplied by
# rsqrt is not the very node the variance squared (patterns.rms_norm.same_input).


def t5_style(x, w, eps):  # HF T5LayerNorm: the *un-upcast* input times the fp32 rsqrt
    var = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(var + eps)
    return w * x.to(w.dtype)


def two_upcasts(x, w, eps):  # x.float() spelled twice (Inductor does not CSE the casts)
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


@pytest.mark.parametrize("fn", [t5_style, two_upcasts], ids=lambda f: f.__name__)
def test_equivalent_spellings_recognized(fn):
    x, w = _inputs((5, 32), torch.bfloat16, torch.bfloat16)
    eager = fn(x, w, 1e-6)
    _, be = compile_capture(lambda a, b: fn(a, b, 1e-6), x, w, fusion_pass=None)
    _check_recognized(be.graph_before, x, w, eps=1e-6, weight_in_fp32=False, eager=eager,
                      exact=True)


def test_weight_read_as_the_graph_casts_it():
    """``(normed * w.half()).to(x.dtype)`` with an fp32 ``w``: the norm multiplies by the
    fp16-rounded weight. The match's weight is that cast node (the op reads the rounded
    values), not the parameter: the canonical op on it is the eager function bit for bit.
    (Before issue 27 any weight computed in the graph was refused.)"""
    x, w = _inputs((5, 32), torch.bfloat16, torch.float32)
    eager = narrowed_weight(x, w, 1e-6)
    _, be = compile_capture(lambda a, b: narrowed_weight(a, b, 1e-6), x, w, fusion_pass=None)
    (m,), rejected = find_rms_norms(be.graph_before)
    assert rejected == []
    assert m.weight.target is torch.ops.prims.convert_element_type.default
    assert m.weight.args[1] == torch.float16 and m.weight_in_fp32
    torch.testing.assert_close(reference.rms_norm(x, w.half(), m.eps, True), eager,
                               rtol=0, atol=0)


def test_fp32_input_with_a_dropped_round_trip_is_recognized_as_such():
    """An fp32 input whose normalized value is cast to bf16 (cast-then-weight): what a
    norm of ``acc.to(bf16)`` becomes once Inductor drops the round trip on GPUs. It is
    recognized with ``x_round = bf16`` -- the rounding a fusion must restore -- and the
    pass leaves a lone one untouched (only the MoE tail takes such norms)."""
    def dropped(acc, w, eps):
        return (acc * torch.rsqrt(acc.pow(2).mean(-1, keepdim=True) + eps)).to(w.dtype) * w

    acc, w = _inputs((5, 32), torch.float32, torch.bfloat16)
    out, be = compile_capture(lambda a, b: dropped(a, b, 1e-6), acc, w)
    torch.testing.assert_close(out, dropped(acc, w, 1e-6), rtol=0, atol=0)
    (m,), rejected = find_rms_norms(be.graph_before)
    assert rejected == [] and m.x_round == torch.bfloat16 and not m.weight_in_fp32
    assert m.x.meta["val"].dtype == torch.float32
    assert be.graph_after.python_code("self").src == be.graph_before.python_code("self").src
    # An ordinary norm of a 16-bit input has none. (The input arrives in bf16: a round
    # trip acc.to(bf16).float() inside the graph is itself dropped by torch 2.11.)
    (plain,), _ = find_rms_norms(compile_capture(
        lambda a, b: dropped(a.float(), b, 1e-6), acc.to(w.dtype), w)[1].graph_before)
    assert plain.x_round is None
