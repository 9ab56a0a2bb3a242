"""Cross-layer delta hand-off: a layer's closing ``prefix = prefix + mlp_out`` goes into
the next layer's first AttnRes site (or the final one) as the kernel's delta.

Compiled (``patterns/attn_res.py``): every such add folds into the next site, whose
kernel returns the updated prefix (its second result) to whatever else reads the sum
(the next site, a block write, a hook) -- no add kernel materializes it. Each of these
folds counts as ``match_counts()["attn_res_delta_handoff"]``: one per layer (layer l's
add goes to layer l+1's attention-side site, the last layer's to the final site), while
the sites still count under ``"attn_res"`` (2 per layer + the final one).

Eager (``k3fusion.eager.patch_model``): the patched model's layers return their MLP
output and the next fused AttnRes step adds it (``KimiK3Model.attn_res_handoff``).

Block sizes: 1 puts a block boundary at every layer (the first and the last included);
2 with 2 layers at the first only (the last layer's MLP-side site folds its attention
output), with 3 layers at the first and the last. A real compile of the 2-layer tiny
model costs ~7 s here (~20 s with ``dynamic=True``), so the file compiles it twice with
``backend="k3fusion"`` (block sizes 1 and 2; T=1 and an odd T); the dynamic-T compile's
hand-offs are checked on ``test_compile_attn_res``'s dynamic compile of the 3-layer
model (tensor bank, block size 1: one compile for both files, every token count off it
matching eager); the near misses use the cheaper ``CaptureBackend`` (Inductor's real
passes up to post-grad, the post-grad graph run eagerly); the eager tests draw block sizes
1-4 over 1-4 layers (1-3 patched).
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import k3fusion
from k3fusion.eager import patch_model
from k3fusion.kernels._launch import interpreter_enabled
from k3fusion.models import KimiK3Config, KimiK3ForCausalLM

from _kernel_paths import cpu_path
from graph_utils import CaptureBackend, fresh_state, nodes_of

_FIXTURES = (fresh_state,)  # used by name (usefixtures)
pytestmark = [
    pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight"),
]

aten = torch.ops.aten
ATTN_RES = torch.ops.k3fusion.attn_res.default
ATTN_RES_OPS = (torch.ops.k3fusion.attn_res.default, torch.ops.k3fusion.attn_res_.default)
HANDOFF = "attn_res_delta_handoff"
#: Few examples for what the profile runs many of (an eager model forward is ~0.1 s).
FEW = max(2, settings.default.max_examples // 5)


def _model(bank: str, layers: int, block_size: int, *, seed: int = 0,
           dtype=torch.bfloat16, precision: str = "model") -> KimiK3ForCausalLM:
    cfg = KimiK3Config.tiny(num_layers=layers, attn_res=True, attn_res_bank=bank,
                            attn_res_block_size=block_size, attn_res_precision=precision,
                            dtype=dtype)
    return KimiK3ForCausalLM(cfg, seed=seed).eval()


def _ids(model, batch: int, seq: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)


def _write_layers(model) -> int:
    return sum(layer.is_block_write_layer for layer in model.model.layers)


# ----------------------------------------------------------------------------- graph checks


def is_residual_add(n, model) -> bool:
    """``a + b`` of two hidden-width activations in the model dtype: a residual-stream add
    (a layer's closing ``prefix + mlp_out``, or the ``prefix + attn_out`` of a layer that
    starts no block)."""
    if n.op != "call_function" or n.target is not aten.add.Tensor:
        return False
    v = n.meta["val"]
    return (v.shape[-1] == model.config.hidden_size and v.dtype == model.config.dtype
            and all(isinstance(a, torch.fx.Node) and a.meta["val"].shape == v.shape
                    for a in n.args[:2]))


def residual_adds(graph, model) -> list:
    return [n for n in graph.nodes if is_residual_add(n, model)]


def prefix_readers(site) -> list:
    """What reads the updated prefix a site's kernel writes (its second result)."""
    return [u for g in site.users if g.args[1] == 1 for u in g.users]


def writes_block(reader, slot: int) -> bool:
    """``reader`` (of an updated prefix) stores it as block ``slot``: a tensor-bank write
    (``select_scatter``, after reinplacing a ``copy`` into the slot's view), or a list
    bank's block, stacked (``unsqueeze`` + ``cat``) for the later sites."""
    if reader.target is aten.copy.default:
        reader = next(iter(reader.users))
    if reader.target is aten.select_scatter.default:
        return reader.args[3] == slot
    return reader.target is aten.unsqueeze.default and all(
        u.target is aten.cat.default for u in reader.users)


def assert_handoffs_folded(model, before, after) -> None:
    """Every layer's closing add folded into the next site, counted as a hand-off."""
    layers = model.config.num_layers
    counts = k3fusion.match_counts()
    assert counts[HANDOFF] == layers
    assert counts["attn_res"] == model.attn_res_sites == 2 * layers + 1
    # before: the L closing adds and one prefix + attn_out per layer that writes no block
    assert len(residual_adds(before, model)) == layers + layers - _write_layers(model)
    # after: none left -- no sum is materialized by an add that only feeds a site
    assert residual_adds(after, model) == []
    sites = nodes_of(after, ATTN_RES)
    assert len(sites) == 2 * layers + 1
    for k, site in enumerate(sites):
        delta = site.args[6]
        if k % 2 == 0 and k > 0:  # layer k/2's attention-side site, or the final one
            assert delta is not None, k
            # the delta is the previous layer's MLP output (its down projection, viewed)
            while delta.target in (aten.reshape.default, aten.view.default):
                delta = delta.args[0]
            assert delta.target in (aten.mm.default, aten.addmm.default), (k, delta.target)
            layer = model.model.layers[k // 2] if k < 2 * layers else None
            readers = prefix_readers(site)
            if layer is None:  # the final site: nothing reads the updated prefix
                assert readers == [], readers
            elif layer.is_block_write_layer:  # the block written is the updated prefix
                assert any(writes_block(r, layer.block_write_idx) for r in readers), \
                    (k, readers)
            else:  # the layer's MLP-side site adds the attention output to it
                assert sites[k + 1] in readers and sites[k + 1].args[0] in site.users, k
        if k % 2 == 1:  # MLP-side: a delta (attn_out) unless the layer started a block
            assert (delta is None) == model.model.layers[k // 2].is_block_write_layer, k


# ----------------------------------------------------------------------------- numerics


def assert_matches_eager(model, run, ids: torch.Tensor, *, kernel: bool = True) -> None:
    """``run(ids)`` matches the unpatched eager model within bf16 rounding.

    Both are compared with an fp64 copy of the model (the oracle), as in
    ``test_compile_attn_res.assert_matches_eager``: the fused op rounds where eager does
    or less often, so its mean error must stay within 1.5x of eager's (measured <= 1.1x)
    and its largest -- an extreme over ~10^3 logits, noisier -- within 2x (measured up to
    1.5x); on the Triton interpreter, whose bf16 casts truncate (up to twice the error,
    all of one sign), 3x both. Checked for the op's plain-torch path and (``kernel``) for
    the Triton kernel, which the interpreter runs slowly (seconds a forward) on CPU. A
    missing or doubled delta is off by the size of an MLP output.
    """
    with torch.no_grad():
        eager = model(ids)
        oracle = copy.deepcopy(model).double()(ids)
        with cpu_path("reference"):
            out_spec = run(ids)
        out = run(ids) if kernel else None
    err_eager = (eager.double() - oracle).abs()
    assert float(err_eager.max()) < 2**-5 * float(oracle.abs().max())
    truncates = interpreter_enabled()
    for got, (f_max, f_mean), what in ((out_spec, (2.0, 1.5), "spec path"),
                                       (out, (3.0, 3.0) if truncates else (2.0, 1.5), "op path")):
        if got is None:
            continue
        assert got.dtype == eager.dtype and got.shape == eager.shape
        err = (got.double() - oracle).abs()
        # Plus one bf16 rounding of the largest logit: with a handful of logits (one layer,
        # a few tokens) both statistics are a few elements, and an element eager happens
        # to round well can be one rounding off on the other path (seen: 2.4x eager's max).
        top_ulp = 2.0**-8 * float(oracle.abs().max())
        assert float(err.max()) <= f_max * float(err_eager.max()) + top_ulp, \
            (what, "max", float(err.max()), float(err_eager.max()), top_ulp)
        assert float(err.mean()) <= f_mean * float(err_eager.mean()) + top_ulp / 4, \
            (what, "mean", float(err.mean()), float(err_eager.mean()), top_ulp)


# ----------------------------------------------------------------------------- compiled


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_state")
@pytest.mark.parametrize("bank,layers,block_size,shape,patched", [
    ("list", 2, 1, (1, 1), False),
    ("tensor", 2, 2, (1, 7), True),
], ids=["list-bs1-T1", "tensor-bs2-T7-patched"])
def test_k3fusion_backend_folds_every_handoff(pass_runs, bank, layers, block_size, shape,
                                              patched):
    """backend="k3fusion", static shapes: T=1 and an odd T; block size 1 (a boundary at
    every layer) and 2 (the last layer starts no block: its MLP-side site folds the
    attention output); a model patched for the eager hand-off compiles to the same graph
    (the add moved into the next layer's AttnRes step is the same add). At T=1 the
    single-source first site's projection is Inductor's one-row product with fp32
    upcasts around its operands (it used to be missed, and with it every hand-off)."""
    model = _model(bank, layers, block_size)
    ref = copy.deepcopy(model)
    if patched:
        assert "model.attn_res_handoff" in patch_model(model).patched
    compiled = torch.compile(model, backend="k3fusion")
    ids = _ids(model, *shape)
    with torch.no_grad():
        compiled(ids)
    assert len(pass_runs) == 1
    assert_handoffs_folded(model, *pass_runs[0])
    assert_matches_eager(ref, compiled, ids)
    assert len(pass_runs) == 1  # (no recompile)


def capture(fn):
    """``fn`` compiled through :class:`CaptureBackend` (static shapes) -> (compiled, backend)."""
    be = CaptureBackend()
    return torch.compile(fn, backend=be, fullgraph=True, dynamic=False), be


@pytest.mark.usefixtures("fresh_state")
def test_hook_reading_the_sum_gets_the_kernels_prefix():
    """Near miss: a forward hook keeps every layer's ``prefix + mlp_out`` (graph outputs
    now). The adds still fold -- each sum is the next site's updated prefix, which the
    kernel writes because the hook reads it -- and the hook sees the same values."""
    model = _model("tensor", 2, 1)
    seen: list[torch.Tensor] = []
    for layer in model.model.layers:
        layer.register_forward_hook(lambda m, args, out: seen.append(out[0]))

    def run(ids):
        seen.clear()
        return model(ids), list(seen)

    ids = _ids(model, 2, 5)
    with torch.no_grad():
        want, want_seen = run(ids)
    compiled, be = capture(run)
    with torch.no_grad(), cpu_path("reference"):
        got, got_seen = compiled(ids)
    layers = model.config.num_layers
    assert k3fusion.match_counts()[HANDOFF] == layers
    assert k3fusion.match_counts()["attn_res"] == 2 * layers + 1
    assert residual_adds(be.graph_after, model) == []
    # each hooked sum is the updated prefix of the next site (or the final one), and the
    # graph returns what its kernel wrote
    sites = nodes_of(be.graph_after, ATTN_RES)
    for k in range(layers):
        assert any(u.op == "output" for u in prefix_readers(sites[2 * k + 2])), k
    # eager within a few bf16 roundings of the largest value (measured <= 1.2%); the MLP
    # output is ~20% of the stream's largest value, so a hook missing it is far outside
    assert len(got_seen) == len(want_seen) == layers
    for g, w in zip([got, *got_seen], [want, *want_seen]):
        torch.testing.assert_close(g, w, rtol=0, atol=2**-5 * float(w.abs().max()))


@pytest.mark.usefixtures("fresh_state")
def test_closing_add_in_fp32_is_not_a_handoff():
    """Near miss: ``(prefix.float() + mlp_out.float()).to(bf16)`` (same value) is no
    same-dtype add: not folded, so no hand-off counted; the sites still fuse and the
    model still computes the same."""
    model = _model("list", 2, 2)
    inner = model.model

    def run(ids):
        prefix, bank = inner.embed_tokens(ids), []
        for layer in inner.layers:
            prefix, bank, h = layer(prefix, bank, handoff=True)
            prefix = (prefix.float() + h.float()).to(prefix.dtype)
        out, _, _ = inner.apply_attn_res(prefix, bank, inner.final_res, inner.max_blocks)
        return model.lm_head(inner.norm(out))

    ids = _ids(model, 2, 5)
    with torch.no_grad():
        assert torch.equal(run(ids), model(ids))  # the same function, eagerly
    compiled, be = capture(run)
    with torch.no_grad():
        compiled(ids)
    assert k3fusion.match_counts().get(HANDOFF, 0) == 0
    assert k3fusion.match_counts()["attn_res"] == model.attn_res_sites
    sites = nodes_of(be.graph_after, ATTN_RES)
    assert [s.args[6] is not None for s in sites] == [False, False, False, True, False]
    assert_matches_eager(model, compiled, ids, kernel=False)
    assert be.compiles == 1


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_state")
def test_one_layer_alone_counts_no_handoff():
    """A graph cut inside the stack: one layer (starting no block) compiled alone. Its
    MLP-side site folds ``prefix + attn_out``, which is no hand-off; its closing add
    has no next site. Both sites fuse, no hand-off is counted."""
    model = _model("list", 2, 2)
    layer = model.model.layers[1]
    g = torch.Generator().manual_seed(0)
    prefix, block = (torch.randn(2, 5, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    compiled, be = capture(layer)
    with torch.no_grad():
        compiled(prefix, [block])
    assert k3fusion.match_counts()["attn_res"] == 2
    assert k3fusion.match_counts().get(HANDOFF, 0) == 0
    attn_site, mlp_site = nodes_of(be.graph_after, ATTN_RES)
    assert attn_site.args[6] is None and mlp_site.args[6] is not None


# ----------------------------------------------------------------------------- eager


class CountResidualAdds(TorchDispatchMode):
    """Counts ``a + b`` of two hidden-width activations (the residual-stream adds) and
    fused AttnRes calls with a delta."""

    def __init__(self, hidden: int):
        super().__init__()
        self.hidden, self.adds, self.fused_deltas = hidden, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.add.Tensor and all(isinstance(a, torch.Tensor) for a in args[:2]):
            a, b = args[:2]
            self.adds += a.shape == b.shape and a.dim() >= 2 and a.shape[-1] == self.hidden
        if func in ATTN_RES_OPS and (len(args) > 6 and args[6] is not None
                                     or kwargs.get("delta") is not None):
            self.fused_deltas += 1
        return func(*args, **kwargs)


@pytest.mark.slow
@settings(max_examples=FEW)
@example(bank="tensor", layers=3, block_size=1, seed=0, batch=1, seq=1)
@example(bank="list", layers=3, block_size=2, seed=1, batch=1, seq=7)
@given(bank=st.sampled_from(["list", "tensor"]), layers=st.integers(1, 4),
       block_size=st.integers(1, 4), seed=st.integers(0, 2**16), batch=st.integers(1, 3),
       seq=st.integers(1, 7))
def test_handoff_loop_is_the_reference_math(bank, layers, block_size, seed, batch, seq):
    """``attn_res_handoff`` on the unpatched model changes where the add is written, not
    what is computed: logits and the final bank bit for bit."""
    model = _model(bank, layers, block_size, seed=seed % 7)
    ids = _ids(model, batch, seq, seed)
    banks = []
    model.model.layers[-1].register_forward_hook(lambda m, a, out: banks.append(out[1]))
    with torch.no_grad():
        want = model(ids)
        model.model.attn_res_handoff = True
        got = model(ids)
    assert torch.equal(got, want)
    if bank == "list":  # the same blocks, as many of them
        assert len(banks[0]) == len(banks[1])
        assert all(torch.equal(a, b) for a, b in zip(*banks))
    else:
        assert torch.equal(*banks)


@pytest.mark.slow
@settings(max_examples=max(1, FEW // 2))  # each example patches and deep-copies a model
@example(bank="tensor", layers=3, block_size=1, seed=0, batch=1, seq=1)
@example(bank="list", layers=3, block_size=2, seed=1, batch=3, seq=5)
@given(bank=st.sampled_from(["list", "tensor"]), layers=st.integers(1, 3),
       block_size=st.integers(1, 4), seed=st.integers(0, 2**16), batch=st.integers(1, 3),
       seq=st.integers(1, 7))
def test_patched_model_hands_off_and_matches_unpatched(bank, layers, block_size, seed,
                                                       batch, seq):
    """The patched model adds no residual stream itself: every layer's MLP output is the
    next fused step's delta (plus each non-block layer's attention output), and the
    logits equal the unpatched model's within bf16 rounding."""
    model = _model(bank, layers, block_size, seed=seed % 7)
    patched = copy.deepcopy(model)
    keys = list(model.state_dict())
    report = patch_model(patched)
    assert "model.attn_res_handoff" in report.patched and patched.model.attn_res_handoff
    assert list(patched.state_dict()) == keys
    ids = _ids(model, batch, seq, seed)
    hidden = model.config.hidden_size
    with torch.no_grad(), cpu_path("reference"), CountResidualAdds(hidden) as counted:
        patched(ids)
    assert counted.adds == 0
    assert counted.fused_deltas == 2 * layers - _write_layers(model)
    with torch.no_grad(), CountResidualAdds(hidden) as counted:
        model(ids)
    assert counted.adds == 2 * layers - _write_layers(model) and counted.fused_deltas == 0
    assert_matches_eager(model, patched, ids, kernel=False)


@pytest.mark.slow
@pytest.mark.parametrize("bank", ["list", "tensor"])
def test_patched_model_hands_off_through_the_kernel(bank):
    """The same through the Triton kernel (its interpreter on CPU: one small example)."""
    model = _model(bank, 2, 1)
    patched = copy.deepcopy(model)
    patch_model(patched)
    assert_matches_eager(model, patched, _ids(model, 3, 5))


def test_patch_report_and_idempotence():
    model = _model("list", 2, 1)
    report = patch_model(model)
    assert report.patched.count("model.attn_res_handoff") == 1
    again = patch_model(model)
    assert again.patched == [] and again.skipped["model.attn_res_handoff"] == "already patched"
    # hooks on a handing-off layer see (prefix, bank, mlp_out)
    outs = []
    model.model.layers[0].register_forward_hook(lambda m, a, out: outs.append(out))
    with torch.no_grad():
        model(_ids(model, 1, 3))
    assert len(outs[0]) == 3
    # a model without AttnRes has nothing to hand off
    plain = KimiK3ForCausalLM(KimiK3Config.tiny(), seed=0)
    assert not any("handoff" in p for p in patch_model(plain).patched)
    assert not plain.model.attn_res_handoff
    with pytest.raises(ValueError, match="attn_res"):
        plain.model.layers[0](torch.zeros(1, 1, 64, dtype=torch.bfloat16), handoff=True)
