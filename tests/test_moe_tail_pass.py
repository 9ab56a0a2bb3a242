"""The latent-MoE tail graph pass (``patterns/moe_tail.py``) and its op
``torch.ops.k3fusion.latent_moe_tail``.

* the op: fake/CPU impls against the reference, inputs untouched, dtype checks;
* fast graph tests (CaptureBackend: real post-grad graphs, no codegen): the tail forms
  (mm + add in either order, through views, Inductor's ``addmm(shared, h, W.T)``, dynamic
  T, other eps, bf16 cast-then-weight) and near misses (a residual ``h + norm(x) @ W.T``,
  a dense-MLP model, Gemma's norm, intermediates read elsewhere) left untouched;
* the tiny Kimi-K3 with latent MoE (+ AttnRes) through real Inductor (``backend="k3fusion"``);
* tp=2 and tp=4 over gloo (spawned ranks): a compiled tail equals the eager tail and the
  pass matched it once per rank; a tail whose reduced routed latent is read elsewhere is
  refused, and so are tails with a ``"max"`` all-reduce or two different process groups.
"""

from __future__ import annotations


import pytest
import torch

import k3fusion
from _gloo import run_ranks
import k3fusion.ops  # noqa: F401  registers torch.ops.k3fusion.*
from k3fusion import reference
from k3fusion.models import KimiK3Config, KimiK3ForCausalLM
from k3fusion.models.kimi_k3 import count_latent_moe_layers

from graph_utils import (CaptureBackend, compile_capture, count_op, fresh_state,  # noqa: F401
                         k3_calls, no_compile_caches, op_histogram)

pytestmark = [
    pytest.mark.usefixtures("fresh_state"),
    pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight"),
]

TAIL = torch.ops.k3fusion.latent_moe_tail.default
L, H = 40, 64


def _rms_hf(x, w, eps=1e-6):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _rms_gemma(x, w, eps=1e-6):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * (1 + w)


def _inputs(t=6, dtype=torch.float32, lead=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    lead = (t,) if lead is None else lead
    r = torch.randn(*lead, L, generator=g).to(dtype)
    x = torch.randn(*lead, H, generator=g).to(dtype)
    ws = (torch.randn(H, H, generator=g) / 8).to(dtype)
    nw = (1 + 0.1 * torch.randn(L, generator=g)).to(dtype)
    up = (torch.randn(H, L, generator=g) / 6).to(dtype)
    return r, x, ws, nw, up


def _fused(fn, *args, dynamic=False):
    k3fusion.reset_match_counts()
    out, be = compile_capture(fn, *args, dynamic=dynamic)
    return out, be, k3fusion.match_counts().get("moe_tail", 0)


# ============================================================================ the op


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_in_fp32", [False, True])
def test_op_equals_reference_and_keeps_inputs(dtype, weight_in_fp32):
    r, x, _, nw, up = _inputs(dtype=dtype, lead=(2, 3))
    kept = [t.clone() for t in (r, x, nw, up)]
    y = TAIL(r, x, nw, 1e-5, up, None, weight_in_fp32)
    want = reference.latent_moe_tail(r, x, nw, 1e-5, up, None, weight_in_fp32)
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    assert all(torch.equal(a, b) for a, b in zip((r, x, nw, up), kept))
    assert y.data_ptr() != x.data_ptr()
    y2 = TAIL(r, x, nw, 0.0, up, None, weight_in_fp32, torch.tensor(1e-5, dtype=torch.float64))
    torch.testing.assert_close(y2, want, rtol=0, atol=0)
    with torch._subclasses.FakeTensorMode() as mode:
        fake = TAIL(*(mode.from_tensor(t) for t in (r, x, nw)), 1e-5, mode.from_tensor(up), None,
                    weight_in_fp32)
    assert fake.shape == y.shape and fake.dtype == y.dtype


def test_op_rejects_bad_arguments():
    r, x, _, nw, up = _inputs()
    with pytest.raises(TypeError, match="dtypes must agree"):
        TAIL(r, x.double(), nw, 1e-6, up, None)
    with pytest.raises(ValueError, match="up_w"):
        TAIL(r, x, nw, 1e-6, up[:, :8], None)
    assert TAIL(r[:0], x[:0], nw, 1e-6, up, None).shape == (0, H)  # T = 0


# ============================================================================ graph: forms


def _tail_add(r, x, ws, nw, up):  # shared (a projection) + up(norm(routed)); 3-D: views
    shared = x @ ws.T
    return shared + _rms_hf(r, nw) @ up.T


def _tail_add_swapped(r, x, ws, nw, up):
    shared = x @ ws.T
    return _rms_hf(r, nw) @ up.T + shared


def _tail_linear(r, x, ws, nw, up):  # F.linear spelling, weight-in-fp32 norm
    shared = torch.nn.functional.linear(x, ws)
    return shared + torch.nn.functional.linear(
        torch.nn.functional.rms_norm(r, (L,), nw, 1e-5), up)


@pytest.mark.parametrize("fn", [_tail_add, _tail_add_swapped, _tail_linear])
@pytest.mark.parametrize("lead", [(6,), (2, 3)], ids=["2d-addmm", "3d-views-mm"])
def test_tail_forms_match(fn, lead):
    args = _inputs(lead=lead)
    out, be, n = _fused(fn, *args)
    assert n == 1
    assert len(k3_calls(be.graph_after, "latent_moe_tail")) == 1
    assert count_op(be.graph_after, torch.ops.aten.rsqrt.default) == 0
    with torch.no_grad():
        torch.testing.assert_close(out, fn(*args), rtol=1e-5, atol=1e-5)
    if lead == (6,):  # Inductor folds `shared + mm` into addmm(shared, h, W.T)
        assert count_op(be.graph_before, torch.ops.aten.addmm.default) == 1


def _flat_latent_viewed_back(r, x, ws, nw, up):
    """transformers' ``KimiK3MoE``: the latent flat ``[T, L]`` (the experts' output), the
    up-projection viewed back to ``[B, S, H]``, then the shared expert's output (a
    projection of the unflattened ``[B, S, H]`` hidden state) added."""
    routed = _rms_hf(r.view(-1, L), nw) @ up.T
    return routed.view(*x.shape) + x @ ws.T


def _flat_latent_viewed_back_swapped(r, x, ws, nw, up):
    return x @ ws.T + (_rms_hf(r.view(-1, L), nw) @ up.T).view(*x.shape)


@pytest.mark.parametrize("fn", [_flat_latent_viewed_back, _flat_latent_viewed_back_swapped])
@pytest.mark.parametrize("dynamic", [False, True])
def test_tail_over_a_flat_latent_viewed_back_before_the_add(fn, dynamic):
    """The norm reads ``[T, L]`` rows, the add is at ``[B, S, H]``: the same rows in the
    same order (both sides reshape a ``[T, H]`` GEMM output), so the op takes the shared
    value's flat ``[T, H]`` base and its result is viewed as the add's (before 2026-12-06
    refused: "shared leading dims (2, 3) differ from routed_latent leading dims (6,)")."""
    args = _inputs(lead=(2, 3))
    out, be, n = _fused(fn, *args, dynamic=dynamic)
    assert n == 1
    (tail,) = k3_calls(be.graph_after, "latent_moe_tail")
    assert count_op(be.graph_after, torch.ops.aten.rsqrt.default) == 0
    with torch.no_grad():
        want = fn(*args)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        assert out.shape == want.shape == (2, 3, H)


def test_flat_latent_with_a_shared_value_of_other_rows_is_refused():
    """The add broadcasts a ``[1, S, H]`` shared value over the viewed-back rows: not the
    op's function (each row its own shared row), left alone."""
    def fn(r, x, ws, nw, up):
        return (_rms_hf(r.view(-1, L), nw) @ up.T).view(2, 3, H) + x[:1] @ ws.T

    args = _inputs(lead=(2, 3))
    out, be, n = _fused(fn, *args)
    assert n == 0
    with torch.no_grad():
        torch.testing.assert_close(out, fn(*args))


def _routed_given(r, x, ws, nw, up):  # the routed partial is the caller's tensor
    return x @ ws.T + _rms_hf(r, nw) @ up.T


def _both_computed(r, x, ws, nw, up):  # both partials are temporaries only the tail reads
    return x @ ws.T + _rms_hf(r * 2, nw) @ up.T


def _both_read_after(r, x, ws, nw, up):  # both partials are read again after the tail
    shared, routed = x @ ws.T, r * 2
    return shared + _rms_hf(routed, nw) @ up.T, shared * 2, routed + 1


@pytest.mark.parametrize("fn, cloned", [(_routed_given, (True, False)),
                                        (_both_computed, (False, False)),
                                        (_both_read_after, (True, True))],
                         ids=["routed-given", "both-computed", "both-read-after"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tail_writes_into_its_partials_only_where_nothing_reads_them_after(fn, cloned, dtype):
    """The pass inserts ``latent_moe_tail_`` (result into ``shared``, ``routed``
    clobbered) under ``auto_functionalized``: Inductor hands it the partials themselves
    where nothing reads them after the tail (the tiers then copy neither), copies where
    something does or where they are the caller's; the caller's tensors and every later
    read are as eager has them."""
    args = _inputs(dtype=dtype)
    saved = [a.clone() for a in args]
    out, be, n = _fused(fn, *args)
    assert n == 1
    (call,) = [c for c in be.final[-1].graph.nodes
               if c.target is torch.ops.k3fusion.latent_moe_tail_.default]

    def is_copy(node):  # decompose_auto_functionalized's clone, seen through its views
        while node.target is torch.ops.aten.as_strided.default:
            node = node.args[0]
        return node.target is torch.ops.aten.clone.default

    assert (is_copy(call.args[0]), is_copy(call.args[1])) == cloned
    for a, b in zip(args, saved):
        assert torch.equal(a, b)
    with torch.no_grad():
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(out, fn(*args), rtol=tol, atol=tol)


def _base_read_after(r, x, ws, nw, up):  # 3-D: the partials are views; their bases read after
    buf, routed = x @ ws.T, r * 2
    return buf + _rms_hf(routed, nw) @ up.T, buf.sum(-1), routed[..., :5] * 1


def _view_of_routed_read_after(r, x, ws, nw, up):
    routed = r * 2
    return x @ ws.T + _rms_hf(routed, nw) @ up.T, routed.reshape(-1, L)[2] + 1


@pytest.mark.parametrize("fn", [_routed_given, _both_computed, _both_read_after,
                                _base_read_after, _view_of_routed_read_after])
def test_in_place_tail_through_inductor_keeps_every_other_read(fn):
    """Through the whole Inductor pipeline (codegen, buffer reuse): the generated code
    runs the in-place tail; the caller's tensors are untouched and every output -- reads
    of a partial, of its base or of another view after the tail included -- is eager's."""
    from torch._inductor.utils import run_and_get_code

    args = _inputs(lead=(2, 3), dtype=torch.bfloat16)
    saved = [a.clone() for a in args]
    torch._dynamo.reset()
    k3fusion.reset_match_counts()
    with torch.no_grad():
        out, code = run_and_get_code(torch.compile(fn, backend="k3fusion", fullgraph=True),
                                     *args)
        want = fn(*args)
    assert k3fusion.match_counts()["moe_tail"] == 1
    assert "k3fusion.latent_moe_tail_.default" in code[0]
    assert all(torch.equal(a, b) for a, b in zip(args, saved))
    for got, ref in zip(out if isinstance(out, tuple) else (out,),
                        want if isinstance(want, tuple) else (want,)):
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)


def test_a_training_compile_counts_a_tail_on_its_in_place_node():
    """A training compile's counts ride on the first fused op of the joint graph into the
    forward's post-grad pass (pass_manager._first_fused_op); the tail's in-place form under
    ``auto_functionalized`` is one such op."""
    from k3fusion.pass_manager import _first_fused_op

    _, be, n = _fused(_both_computed, *_inputs(dtype=torch.bfloat16))
    assert n == 1
    node = _first_fused_op(be.graph_after)
    assert node is not None and node.target is torch.ops.higher_order.auto_functionalized
    assert node.args[0] is torch.ops.k3fusion.latent_moe_tail_.default


def test_inplace_op_writes_the_functional_result_into_shared():
    r, x, ws, nw, up = _inputs(dtype=torch.bfloat16)
    shared = x @ ws.T
    want = TAIL(r, shared, nw, 1e-6, up, None)
    mine, routed = shared.clone(), r.clone()
    assert torch.ops.k3fusion.latent_moe_tail_(routed, mine, nw, 1e-6, up, None) is None
    assert torch.equal(mine, want) and torch.equal(routed, r)  # tp = 1: no all-reduce
    with pytest.raises(TypeError, match="dtypes must agree"):
        torch.ops.k3fusion.latent_moe_tail_(r, shared.float(), nw, 1e-6, up, None)


def test_tail_bf16_dynamic_t_and_other_eps():
    def fn(r, x, ws, nw, up):
        return x @ ws.T + _rms_hf(r, nw, 1e-5) @ up.T

    k3fusion.reset_match_counts()
    torch._dynamo.reset()
    be = CaptureBackend()
    compiled = torch.compile(fn, backend=be, dynamic=True, fullgraph=True)
    with torch.no_grad():
        for t in (7, 3, 12):
            a = _inputs(t=t, dtype=torch.bfloat16, seed=t)
            torch.testing.assert_close(compiled(*a), fn(*a), rtol=2e-2, atol=2e-2)
    assert be.compiles == 1 and k3fusion.match_counts()["moe_tail"] == 1
    (tail,) = k3_calls(be.graph_after, "latent_moe_tail")
    assert tail["eps"] == 1e-5 and tail["weight_in_fp32"] is False  # cast-then-weight


def test_tail_whose_norm_casts_an_fp32_latent():
    """An fp32 latent whose normalized value is cast to bf16: a T5-style norm of a real
    fp32 input, or (on GPUs) ``norm(acc.to(bf16))`` after Inductor removed the round trip
    as a pointless convert. The graph cannot tell which, so the op computes exactly the
    graph's form (``norm_dtype``): bit for bit the compiled function's own result, the
    latent never rounded before the norm."""
    def t5(acc, x, ws, nw, up):
        n = (acc * torch.rsqrt(acc.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
        return x @ ws.T + (n * nw) @ up.T

    r, x, ws, nw, up = _inputs(t=5, dtype=torch.bfloat16)
    acc = r.float() + torch.randn(r.shape, generator=torch.Generator().manual_seed(1)) / 300
    out, be, n = _fused(t5, acc, x, ws, nw, up)
    assert n == 1
    (tail,) = k3_calls(be.graph_after, "latent_moe_tail")
    assert tail["routed_latent"].meta["val"].dtype == torch.float32  # the latent, not rounded
    assert tail["norm_dtype"] == torch.bfloat16
    assert count_op(be.graph_after, torch.ops.aten.rsqrt.default) == 0
    with torch.no_grad():
        want = reference.latent_moe_tail(acc, x @ ws.T, nw, 1e-6, up, None, False,
                                         torch.bfloat16)
        assert torch.equal(out, want)
        torch.testing.assert_close(out, t5(acc, x, ws, nw, up), rtol=2e-2, atol=2e-2)
        # and it is not the rounded-latent form (which would change T5's results)
        rounded = reference.latent_moe_tail(acc.to(torch.bfloat16), x @ ws.T, nw, 1e-6, up)
        assert not torch.equal(out, rounded)


def test_fp32_input_rounded_to_another_width_is_no_norm():
    """Only a 16-bit rounding of an fp32 input is read as a dropped round trip: fp16 input
    cast to bf16 (or fp32 cast to fp64) stays a near miss, untouched."""
    def fn(r, x, ws, nw, up):
        n = (r.float() * torch.rsqrt(r.float().pow(2).mean(-1, keepdim=True) + 1e-6))
        return x @ ws.T + (n.to(torch.bfloat16) * nw) @ up.T

    r, x, ws, nw, up = _inputs(t=5, dtype=torch.bfloat16)
    _, be, n = _fused(fn, r.half(), x, ws, nw, up)
    assert n == 0
    _unchanged(be)


# ============================================================================ graph: near misses


def _row_padded(h, w, p=2):
    """``h @ w.T`` as Inductor's ``pad_mm`` rewrites it where its benchmark favours
    padding the rows to a multiple of 8: pad, GEMM, slice the rows back."""
    return (torch.nn.functional.pad(h, (0, 0, 0, p)) @ w.T)[:-p]


def test_tail_with_row_padded_gemms_matches():
    """pad_mm pads by a timing, so whether a compile sees the padded form can change from
    run to run (seen on the H200: the same test matched or not depending on what ran
    before). Both GEMMs padded: the tail still matches; the up-projection's pad, GEMM and
    slice are gone, the shared projection's stay."""
    def fn(r, x, ws, nw, up):
        return _row_padded(x, ws) + _row_padded(_rms_hf(r, nw), up)

    args = _inputs(t=6, dtype=torch.bfloat16)
    out, be, n = _fused(fn, *args)
    pad, mm, sl = (torch.ops.aten.constant_pad_nd.default, torch.ops.aten.mm.default,
                   torch.ops.aten.slice.Tensor)
    assert n == 1 and len(k3_calls(be.graph_after, "latent_moe_tail")) == 1
    assert [count_op(be.graph_before, op) for op in (pad, mm, sl)] == [2, 2, 2]
    assert [count_op(be.graph_after, op) for op in (pad, mm, sl)] == [1, 1, 1]
    assert count_op(be.graph_after, torch.ops.aten.rsqrt.default) == 0
    with torch.no_grad():
        torch.testing.assert_close(out, fn(*args), rtol=2e-2, atol=2e-2)


def test_row_padding_that_keeps_a_padded_row_refused():
    """A slice that keeps a padded row is not ``mm(h, W.T)``: left alone."""
    def fn(r, x, ws, nw, up):
        up_part = (torch.nn.functional.pad(_rms_hf(r, nw), (0, 0, 0, 2)) @ up.T)[:-1]
        return torch.nn.functional.pad(x, (0, 0, 0, 1)) @ ws.T + up_part

    args = _inputs(t=6, dtype=torch.bfloat16)
    out, be, n = _fused(fn, *args)
    assert n == 0
    _unchanged(be)
    with torch.no_grad():
        torch.testing.assert_close(out, fn(*args), rtol=2e-2, atol=2e-2)


def _unchanged(be):
    assert op_histogram(be.graph_after) == op_histogram(be.graph_before)


def test_residual_add_is_not_a_tail():
    # h is the residual stream (a graph input / an add), not a projection output.
    def residual(h, r, nw, up):
        return h + _rms_hf(r, nw) @ up.T

    def residual_after_proj(h, a, wo, r, nw, up):  # h2 = h + o_proj(a); h2 + up(norm(r))
        h2 = h + a @ wo.T
        return h2 + _rms_hf(r, nw) @ up.T

    r, x, ws, nw, up = _inputs()
    for fn, args in ((residual, (x, r, nw, up)), (residual_after_proj, (x, x, ws, r, nw, up))):
        out, be, n = _fused(fn, *args)
        assert n == 0
        assert not k3_calls(be.graph_after, "latent_moe_tail")
        with torch.no_grad():
            torch.testing.assert_close(out, fn(*args))


def test_gemma_norm_and_leaked_intermediates_refused():
    def gemma(r, x, ws, nw, up):
        return x @ ws.T + _rms_gemma(r, nw) @ up.T

    def normed_read(r, x, ws, nw, up):
        h = _rms_hf(r, nw)
        return x @ ws.T + h @ up.T, h * 2

    def up_read(r, x, ws, nw, up):
        u = _rms_hf(r, nw) @ up.T
        return x @ ws.T + u, u.sum()

    args = _inputs(lead=(2, 3))
    for fn in (gemma, normed_read, up_read):
        out, be, n = _fused(fn, *args)
        assert n == 0, fn.__name__
        _unchanged(be)


def test_debug_log_names_tail_near_misses_only(caplog):
    """``K3FUSION_DEBUG``: a tail refused for a reason is logged with it; adds that are no
    tail candidate at all (no up-projection of a norm) are not logged as misses."""
    import logging

    def fn(r, x, ws, nw, up):
        h = _rms_hf(r, nw)
        plain = x + x * 2                      # an add, no norm anywhere near it
        return x @ ws.T + h @ up.T, h * 2, plain

    k3fusion.set_config(debug=True)
    with caplog.at_level(logging.INFO, logger="k3fusion"):
        _, be, n = _fused(fn, *_inputs(lead=(2, 3)))
    assert n == 0
    misses = [r.getMessage() for r in caplog.records if "MoE-tail site not fused" in r.getMessage()]
    assert len(misses) == 1 and "is also read by" in misses[0], misses


def test_partner_computed_from_the_norm_refused():
    def fn(r, x, ws, nw, up):
        h = _rms_hf(r, nw)
        return (h @ up.T) @ ws.T + h @ up.T

    out, be, n = _fused(fn, *_inputs(lead=(2, 3)))
    assert n == 0


# ============================================================================ the model


def _ids(batch=2, seq=5, seed=1):
    return torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.slow
def test_dense_model_has_no_tail():
    for kw in ({}, {"attn_res": True}):
        model = KimiK3ForCausalLM(KimiK3Config.tiny(dtype=torch.float32, **kw), seed=0).eval()
        _, _, n = _fused(model, _ids())
        assert n == 0, kw


@pytest.mark.slow
def test_latent_moe_model_capture_counts_every_layer():
    model = KimiK3ForCausalLM(KimiK3Config.tiny(latent_moe=True), seed=0).eval()
    ids = _ids()
    out, be, n = _fused(model, ids)
    assert n == count_latent_moe_layers(model) == model.config.num_layers
    # Against the same capture with only this fusion off (the other fusions' kernels run
    # in Triton's interpreter here, whose bf16 casts truncate): the tail is the same ops.
    from k3fusion.config import FusionConfig
    k3fusion.set_config(FusionConfig(moe_tail=False))
    want, _, n_off = _fused(model, ids)
    assert n_off == 0
    torch.testing.assert_close(out.float(), want.float(), rtol=1e-2, atol=1e-2)
    # (eager equivalence, tight, in fp32 through real Inductor: the test below)


@pytest.mark.slow
def test_latent_moe_attn_res_model_real_inductor():
    model = KimiK3ForCausalLM(KimiK3Config.tiny(latent_moe=True, attn_res=True,
                                                dtype=torch.float32), seed=0).eval()
    k3fusion.reset_match_counts()
    compiled = torch.compile(model, backend="k3fusion", dynamic=False)
    ids = _ids()
    with torch.no_grad():
        out, want = compiled(ids), model(ids)
    counts = k3fusion.match_counts()
    assert counts["moe_tail"] == count_latent_moe_layers(model) == 2
    assert counts["attn_res"] > 0
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


# ============================================================================ tp = 2, 4 (gloo)


def _tail_on_rank(rank: int, world: int, group, device: str = "cpu") -> dict:
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from k3fusion import moe_tail
    from k3fusion.models.kimi_k3 import KimiK3LatentMoE

    result = {}
    device = torch.device("cuda", rank) if device == "cuda" else torch.device(device)
    torch.manual_seed(0)  # same replicated weights on every rank
    moe = KimiK3LatentMoE(KimiK3Config.tiny(latent_moe=True, dtype=torch.float32),
                          tp_group=group).eval().to(device)
    g = torch.Generator().manual_seed(100 + rank)  # per-rank partials
    r, s = torch.randn(5, L, generator=g).to(device), torch.randn(5, H, generator=g).to(device)
    moe_tail.reset_tier_counts()

    torch._dynamo.reset()
    k3fusion.reset_match_counts()
    compiled = torch.compile(moe.tail, backend="k3fusion", dynamic=False)
    with torch.no_grad(), no_compile_caches():  # a cache hit would skip the pass
        got, want = compiled(r, s), moe.tail(r, s)
    result["compiled_err"] = float((got - want).abs().max())
    result["compiled_matches"] = k3fusion.match_counts().get("moe_tail", 0)
    result["tiers_run"] = moe_tail.tier_counts()  # the compiled op's run-time choice

    def leaky(r, s):  # the reduced routed latent is also returned: refuse
        rr = funcol.wait_tensor(funcol.all_reduce(r, "sum", group))
        ss = funcol.wait_tensor(funcol.all_reduce(s, "sum", group))
        return ss + moe.up_proj(moe.latent_norm(rr)), rr

    k3fusion.reset_match_counts()
    out, be = compile_capture(leaky, r, s)
    with torch.no_grad():
        ref = leaky(r, s)
    result["leaky_matches"] = k3fusion.match_counts().get("moe_tail", 0)
    result["leaky_err"] = max(float((a - b).abs().max()) for a, b in zip(out, ref))
    result["group"] = dist.group.WORLD.group_name
    return result


def _check_ranks(results):
    for rank, res in enumerate(results):
        assert "error" not in res, f"rank {rank}:\n{res['error']}"
        assert res["compiled_matches"] == 1, res
        assert res["compiled_err"] <= 1e-5, res
        assert res["leaky_matches"] == 0, res
        assert res["leaky_err"] == 0.0, res
        # The compiled op ran one tier (the same on every rank), chosen at run time.
        assert sum(res["tiers_run"].values()) >= 1 and res["tiers_run"] == results[0]["tiers_run"], \
            (rank, res["tiers_run"], results[0]["tiers_run"])


@pytest.mark.slow
def test_gloo_compiled_tail_equals_eager():
    """tp = 4 (more ranks than two, so rank-specific slicing shows; tp = 2 runs in the
    tiers' and the latent model's distributed tests): on every rank the compiled tail (one
    match, the group read from the graph) equals the eager tail; a tail whose reduced
    latent leaks is refused."""
    _check_ranks(run_ranks(_tail_on_rank, 4))


def _near_misses_on_rank(rank: int, world: int, group) -> dict:
    """Tails whose all-reduces are not one ``"sum"`` over one group: not the op's math
    (the op sums both operands over one group). Each must be left alone, equal to eager."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from k3fusion.models.kimi_k3 import KimiK3LatentMoE

    torch.manual_seed(0)  # same replicated weights on every rank
    moe = KimiK3LatentMoE(KimiK3Config.tiny(latent_moe=True, dtype=torch.float32),
                          tp_group=group).eval()
    # Same ranks, another communicator: a different group name in the graph.
    other = dist.new_group(list(range(world)))
    g = torch.Generator().manual_seed(100 + rank)  # per-rank partials
    r, s = torch.randn(5, L, generator=g), torch.randn(5, H, generator=g)

    def ar(x, op, grp):
        return funcol.wait_tensor(funcol.all_reduce(x, op, grp))

    def max_routed(r, s):  # the routed latent reduced with "max"
        return ar(s, "sum", group) + moe.up_proj(moe.latent_norm(ar(r, "max", group)))

    def max_shared(r, s):  # the shared partial reduced with "max"
        return ar(s, "max", group) + moe.up_proj(moe.latent_norm(ar(r, "sum", group)))

    def two_groups(r, s):  # each operand summed over its own group
        return ar(s, "sum", other) + moe.up_proj(moe.latent_norm(ar(r, "sum", group)))

    result = {}
    for fn in (max_routed, max_shared, two_groups):
        torch._dynamo.reset()
        k3fusion.reset_match_counts()
        with no_compile_caches():
            out, be = compile_capture(fn, r, s)
        with torch.no_grad():
            want = fn(r, s)
        result[fn.__name__] = dict(
            matches=k3fusion.match_counts().get("moe_tail", 0),
            tail_ops=len(k3_calls(be.graph_after, "latent_moe_tail")),
            equal=bool(torch.equal(out, want)),
            # how far the fused (summed) tail would be: the near miss must be a real one
            summed_err=float((want - reference.latent_moe_tail(
                r, s, moe.latent_norm.weight, moe.latent_norm.eps, moe.up_proj.weight,
                group)).abs().max()))
    dist.destroy_process_group(other)
    return result


def test_gloo_non_sum_or_two_group_tails_are_refused():
    """tp = 2 over gloo: a tail with an ``all_reduce(..., "max")`` (routed or shared), or
    with its two all-reduces over different process groups, is not fused (0 matches, no
    op in the graph) and the compiled output equals eager bit for bit. The pattern's
    refusal, checked for real: with the reduce-op or group check removed, these fuse and
    are wrong (``summed_err``: what the op's sum would give instead)."""
    results = run_ranks(_near_misses_on_rank, 2)
    for rank, res in enumerate(results):
        for name, r in res.items():
            assert r["matches"] == 0 and r["tail_ops"] == 0, (rank, name, r)
            assert r["equal"], (rank, name, r)
    # The "max" tails differ from the summed one (so a misfire would show).
    assert all(res[n]["summed_err"] > 0.1 for res in results
               for n in ("max_routed", "max_shared")), results


@pytest.mark.cuda
@pytest.mark.parametrize("world", [2, 4, 8])
def test_nccl_compiled_tail_equals_eager(world):
    """The same over NCCL, one GPU per rank: the group name read from the FX graph resolves
    to the NCCL group at run time (torch's process-group registry), and the tail equals the
    eager one on every rank."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, {torch.cuda.device_count()} visible")
    _check_ranks(run_ranks(_tail_on_rank, world, "cuda", backend="nccl", timeout_s=600.0))


def test_op_dtype_rule_follows_weight_in_fp32_and_up_w_layout():
    """bf16 latent, fp32 norm weight, weight-in-fp32: the normed latent is bf16, so a bf16
    up_w is right (with cast-then-weight it would be fp32, and a bf16 up_w wrong); an
    up_w that is not contiguous in its last dim is refused by name."""
    r, x, _, nw, up = _inputs(dtype=torch.bfloat16)
    nw32 = nw.float()
    y = TAIL(r, x, nw32, 1e-6, up, None, True)
    want = reference.latent_moe_tail(r, x, nw32, 1e-6, up, None, True)
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    with pytest.raises(TypeError, match="dtypes must agree"):
        TAIL(r, x, nw32, 1e-6, up, None, False)
    with pytest.raises(ValueError, match="up_w must be contiguous"):
        TAIL(r, x, nw, 1e-6, up.t().contiguous().t(), None, False)
