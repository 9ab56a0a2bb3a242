"""A compile never fails because of k3fusion (issue 27): every node a rewrite inserts is an
op Inductor lowers (checked when the replacement is built: a refusal is a logged miss), a
fusion's own error leaves the graph as it was (a warning, default Inductor's compile),
every op's fake impl takes the layouts Inductor gives zero-element buffers, and a site
whose updated prefix is also an older source fuses without reading its own output.

Graphs go through Inductor's lowering and code generation (``graph_utils.LoweringBackend``)
or, where named, a real ``backend="k3fusion"`` compile.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import k3fusion
import k3fusion.pass_manager as pass_manager
from k3fusion.models import KimiK3Config, KimiK3ForCausalLM
from k3fusion.patterns import _fx, attn_res as attn_res_pattern

from graph_utils import LoweringBackend, count_op, fresh_state  # noqa: F401

pytestmark = [pytest.mark.usefixtures("fresh_state"),
              pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")]

aten = torch.ops.aten
ATTN_RES = torch.ops.k3fusion.attn_res.default
H = 32


class UnweightedKeys(nn.Module):
    """The README's step with a parameter-free key norm (``F.rms_norm(V, (H,))``): the
    rewrite needs a unit weight, which once was ``aten.new_ones`` -- an op Inductor cannot
    lower ("both a fallback and a decomp"), a failed compile."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(H, 1, bias=False)

    def forward(self, b0, b1, partial):
        V = torch.stack([b0, b1, partial])
        logits = torch.einsum("d, n b t d -> n b t", self.proj.weight.squeeze(),
                              F.rms_norm(V, (H,)))
        return torch.einsum("n b t, n b t d -> b t d", logits.softmax(0), V)


def _inputs(tokens: int, n: int = 3, dtype=torch.float32) -> tuple:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(2, tokens, H, generator=g).to(dtype) for _ in range(n))


def _lower(module, args, dynamic=False):
    be = LoweringBackend()
    compiled = torch.compile(module, backend=be, dynamic=dynamic, fullgraph=True)
    with torch.no_grad():
        return compiled(*args), be


@pytest.mark.parametrize("tokens", [64, 1, 0])
def test_unweighted_key_norm_compiles(tokens):
    m = UnweightedKeys()
    args = _inputs(tokens)
    out, be = _lower(m, args)
    # (at T = 0 a torch may fold the zero-size chain away before the pass: nothing to fuse)
    assert k3fusion.match_counts()["attn_res"] == (1 if tokens else
                                                   count_op(be.graph_final, ATTN_RES))
    assert count_op(be.graph_final, aten.full.default) == count_op(be.graph_final, ATTN_RES)
    with torch.no_grad():
        torch.testing.assert_close(out, m(*args), rtol=1e-5, atol=1e-5)


def test_inserting_an_op_inductor_cannot_lower_is_a_logged_miss(monkeypatch, caplog):
    """Plant the old unit weight (``aten.new_ones``) in the AttnRes rewrite: the site is
    left unfused with a reason, the graph as it was, and the compile succeeds."""
    def planted(graph, like, width):
        return _fx.insert_call(graph, aten.new_ones.default, (like, [width]))

    monkeypatch.setattr(attn_res_pattern, "_unit_weight", planted)
    k3fusion.set_config(debug=True)
    caplog.set_level(logging.INFO, logger="k3fusion")
    m = UnweightedKeys()
    args = _inputs(4)
    out, be = _lower(m, args)
    assert k3fusion.match_counts()["attn_res"] == 0
    assert count_op(be.graph_final, aten.new_ones.default) == 0
    assert count_op(be.graph_final, ATTN_RES) == 0
    assert any("aten.new_ones.default, which Inductor does not lower" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    with torch.no_grad():
        torch.testing.assert_close(out, m(*args), rtol=1e-5, atol=1e-5)


def test_insert_call_refuses_what_inductor_does_not_lower_and_leaves_no_node():
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(2, 3, device="meta")
    with pytest.raises(_fx.NoMatch, match="does not lower"):
        with _fx.all_or_nothing(g):
            _fx.insert_call(g, aten.unsqueeze.default, (x, 0))   # lowered: inserted
            _fx.insert_call(g, aten.new_ones.default, (x, [3]))  # no lowering: refused
    assert [n.op for n in g.nodes] == ["placeholder"]  # the unsqueeze was rolled back
    for target in (aten.full.default, aten.cat.default, aten.view.default,
                   torch.ops.k3fusion.attn_res.default):
        assert _fx.inductor_lowers(target), target
    for target in (aten.new_ones.default, aten.t.default, aten.ones.default):
        assert not _fx.inductor_lowers(target), target


def test_an_error_inside_a_fusion_leaves_the_graph_unfused_with_a_warning(monkeypatch, caplog):
    """A bug in a fusion (here: an exception after the AttnRes rewrite has changed the
    graph) must not fail the user's compile: the graph goes back to what it was and
    default Inductor compiles it; the warning says so."""
    monkeypatch.setattr(pass_manager, "RAISE_INTERNAL_ERRORS", False)
    real = attn_res_pattern.count_handoffs

    def broken(graph, sites):
        real(graph, sites)
        raise RuntimeError("planted bug")

    monkeypatch.setattr(attn_res_pattern, "count_handoffs", broken)
    monkeypatch.setattr(pass_manager, "fuse_attn_res", attn_res_pattern.fuse_attn_res)
    caplog.set_level(logging.WARNING, logger="k3fusion")
    m = UnweightedKeys()
    args = _inputs(4)
    out, be = _lower(m, args)
    assert count_op(be.graph_final, ATTN_RES) == 0
    assert k3fusion.match_counts()["attn_res"] == 0
    assert any("a fusion failed on this graph" in r.getMessage()
               for r in caplog.records)
    with torch.no_grad():
        torch.testing.assert_close(out, m(*args), rtol=1e-5, atol=1e-5)


class PrefixAlsoABlock(nn.Module):
    """``blocks.append(partial)`` before ``torch.stack(blocks + [partial])``, the prefix
    updated by a delta just before: the updated prefix is also an older source. Folding
    the add into the op made the op read its own output (a cycle, then a KeyError inside
    Inductor); the site fuses with the add kept."""

    def __init__(self, cse: bool) -> None:
        super().__init__()
        self.cse = cse
        self.norm = nn.RMSNorm(H, eps=1e-6)
        self.proj = nn.Linear(H, 1, bias=False)

    def forward(self, b0, partial, delta):
        updated = partial + delta
        # the one tensor appended, or the same add written twice (CSE merges them)
        blocks = [b0, partial + delta if self.cse else updated]
        V = torch.stack(blocks + [updated])
        logits = torch.einsum("d, n b t d -> n b t", self.proj.weight.squeeze(), self.norm(V))
        return torch.einsum("n b t, n b t d -> b t d", logits.softmax(0), V), updated


@pytest.mark.parametrize("cse", [False, True], ids=["appended", "cse"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_updated_prefix_that_is_also_a_block_fuses_without_the_fold(dynamic, cse):
    m = PrefixAlsoABlock(cse=cse)
    args = _inputs(5)
    out, be = _lower(m, args, dynamic=dynamic)
    assert k3fusion.match_counts()["attn_res"] == 1
    (node,) = [n for n in be.graph_final.nodes if n.target == ATTN_RES]
    if not cse:  # (two equal adds that stay two may fold the one that is only the prefix)
        assert node.args[6] is None  # no delta folded: the add stays in the graph
    with torch.no_grad():
        for a, b in zip(out, m(*args)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("latent_moe", [False, True], ids=["dense", "latent_moe"])
def test_tiny_model_compiles_at_zero_tokens(latent_moe):
    """``[2, 0]`` input ids: every fusion's op sees zero-element buffers, which Inductor
    lays out with stride 0 (the ops' fake impls refused them: every fusion failed to
    compile at T = 0)."""
    config = KimiK3Config.tiny(attn_res=True, latent_moe=latent_moe, dtype=torch.bfloat16)
    model = KimiK3ForCausalLM(config, seed=0).eval()
    ids = torch.zeros(2, 0, dtype=torch.long)
    out, be = _lower(model, (ids,))
    # What fuses at T = 0 depends on what the torch leaves of zero-size chains (2.13: every
    # site; 2.11 folds the AttnRes chains away first): the point is the compile.
    counts = k3fusion.match_counts()
    assert counts["qkv_rmsnorm"] <= 2 and counts["attn_res"] <= 5
    assert counts["moe_tail"] <= (2 if latent_moe else 0)
    with torch.no_grad():
        want = model(ids)
    want = want.logits if hasattr(want, "logits") else want
    out = out.logits if hasattr(out, "logits") else out
    assert out.shape == want.shape == (2, 0, config.vocab_size)


def test_tiny_model_compiles_at_zero_tokens_for_real():
    """The same through a real ``backend="k3fusion"`` compile (C++ built and run)."""
    config = KimiK3Config.tiny(attn_res=True, dtype=torch.bfloat16)
    model = KimiK3ForCausalLM(config, seed=0).eval()
    ids = torch.zeros(2, 0, dtype=torch.long)
    with torch.no_grad():
        out = torch.compile(model, backend="k3fusion")(ids)
    out = out.logits if hasattr(out, "logits") else out
    assert out.shape == (2, 0, config.vocab_size)
