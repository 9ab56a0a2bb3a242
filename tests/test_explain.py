"""``k3fusion.explain``: one compile of the call as the user makes it, what was fused, and
why each other candidate was not, pointing at the model's own line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import k3fusion
from k3fusion.cli import main
from k3fusion.explain import REFUSED_NORM

from graph_utils import fresh_state  # noqa: F401

pytestmark = [pytest.mark.usefixtures("fresh_state")]

H = 16


class Step(nn.Module):
    """One sources-last AttnRes step; ``temperature`` makes it a near miss."""

    def __init__(self, temperature: float = 1.0) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(H))
        self.proj = nn.Linear(H, 1, bias=False)
        self.t = temperature

    def forward(self, bank, prefix):
        V = torch.cat([bank, prefix.unsqueeze(-2)], -2)
        x = V.float()
        keys = self.w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).to(V.dtype)
        logits = self.proj(keys).squeeze(-1).float()
        if self.t != 1.0:
            logits = logits / self.t
        p = logits.softmax(-1)  # THE SOFTMAX LINE
        return (p.to(V.dtype).unsqueeze(-1) * V).sum(-2)


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 3, 2, H, generator=g), torch.randn(2, 3, H, generator=g)


def _real_compile_counts(module: nn.Module, *inputs) -> dict[str, int]:
    """What ``torch.compile(backend="k3fusion")`` fuses in this call, as the user runs it."""
    torch._dynamo.reset()
    k3fusion.reset_match_counts()
    torch.compile(module, backend="k3fusion")(*inputs)
    return k3fusion.match_counts()


def test_fused_site_is_counted(capsys):
    with torch.no_grad():
        r = k3fusion.explain(Step(), *_inputs())
    assert r.matches["attn_res"] == 1
    assert not [c for c in r.not_fused if c.kind.startswith("AttnRes")]
    assert "attn_res: 1 fused" in capsys.readouterr().out


def test_near_miss_says_why_and_where(capsys):
    with torch.no_grad():
        r = k3fusion.explain(Step(temperature=2.0), *_inputs())
    assert r.matches["attn_res"] == 0
    (c,) = [c for c in r.not_fused if c.kind.startswith("AttnRes")]
    # Inductor folds logits / t into the softmax's exp: no plain softmax of the logits
    assert "softmax" in c.reason or "projection" in c.reason, c.reason
    assert "test_explain.py" in c.where and "THE SOFTMAX LINE" in c.where, c.where
    out = capsys.readouterr().out
    assert "AttnRes step (softmax) at test_explain.py:" in out


def test_explain_keeps_the_callers_config():
    mine = k3fusion.set_config(attn_res=False)
    with torch.no_grad():
        r = k3fusion.explain(Step(), *_inputs(), quiet=True)
        real = _real_compile_counts(Step(), *_inputs())
    assert r.matches["attn_res"] == 0 and r.matches == real
    assert k3fusion.get_config() is mine  # debug was on for explain's compile only
    # the reasons were still collected: the norm AttnRes would have taken is left alone
    assert [c.kind for c in r.not_fused] == ["RMSNorm"], r.not_fused


def test_explain_keeps_the_callers_grad_mode(capsys):
    r = k3fusion.explain(Step(), *_inputs())  # grad mode on, parameters require grad
    assert r.matches == _real_compile_counts(Step(), *_inputs())
    out = capsys.readouterr().out
    assert "note: autograd records this call" in out and "torch.no_grad()" in out
    with torch.no_grad():
        without_grad = k3fusion.explain(Step(), *_inputs(), quiet=True)
    assert not without_grad.notes
    assert r.matches == without_grad.matches and r.matches["attn_res"] == 1


class GemmaNorm(nn.Module):
    """Gemma's RMSNorm scales by ``1 + w``: another function, never fused."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n))

    def forward(self, x):
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)  # THE GEMMA RSQRT LINE
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class GemmaMLA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_a_proj = nn.Linear(32, 24, bias=False)
        self.q_a_layernorm = GemmaNorm(24)
        self.kv_a_proj_with_mqa = nn.Linear(32, 20, bias=False)
        self.kv_a_layernorm = GemmaNorm(16)

    def forward(self, h):
        kv_c, k_pe = self.kv_a_proj_with_mqa(h).split([16, 4], dim=-1)
        return self.q_a_layernorm(self.q_a_proj(h)), self.kv_a_layernorm(kv_c), k_pe


def test_refused_norms_are_in_the_default_output_with_their_line(capsys):
    with torch.no_grad():
        r = k3fusion.explain(GemmaMLA(), torch.randn(3, 32))
    assert r.matches["qkv_rmsnorm"] == 0
    refused = [c for c in r.not_fused if c.kind == REFUSED_NORM]
    assert len(refused) == 2, r.not_fused
    for c in refused:
        assert "weight is computed in the graph" in c.reason, c.reason
        assert c.where.startswith("test_explain.py:") and "THE GEMMA RSQRT LINE" in c.where, \
            c.where
    out = capsys.readouterr().out
    assert out.count(f"{REFUSED_NORM} at test_explain.py:") == 2, out
    assert "nothing left unfused" not in out


class GemmaNormBySqrt(GemmaNorm):
    """The same Gemma norm written as a division by ``sqrt``, and a sqrt that is no norm."""

    def forward(self, x):
        x32 = x.float()
        y = x32 / torch.sqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)  # THE SQRT LINE
        return (y * (1.0 + self.weight.float())).to(x.dtype) + torch.sqrt(x32.abs())


def test_a_refused_norm_written_with_sqrt_is_listed_and_other_sqrts_are_not(capsys):
    model = GemmaMLA()
    model.q_a_layernorm, model.kv_a_layernorm = GemmaNormBySqrt(24), GemmaNormBySqrt(16)
    with torch.no_grad():
        r = k3fusion.explain(model, torch.randn(3, 32), verbose=True)
    assert r.matches["qkv_rmsnorm"] == 0
    refused = [c for c in r.not_fused if c.kind == REFUSED_NORM]
    assert len(refused) == 2, r.not_fused
    assert all("weight is computed in the graph" in c.reason and "THE SQRT LINE" in c.where
               for c in refused), refused
    assert len(r.not_fused) == 2, r.not_fused  # sqrt(|x|) is no candidate, even verbose


def test_progress_is_a_line_per_compiled_graph(capsys):
    with torch.no_grad():
        k3fusion.explain(Step(), *_inputs())
    err = capsys.readouterr().err.splitlines()
    assert all(line.startswith("[k3fusion explain ") for line in err), err
    assert [line.split("] ")[1].split(":")[0] for line in err] == [
        "compiling the call with backend='k3fusion' and running it (no grad); a line per "
        "compiled graph follows", "graph 1", "done"]
    k3fusion.explain(Step(), *_inputs(), quiet=True)
    assert capsys.readouterr() == ("", "")


def test_a_node_without_a_stack_trace_points_near_the_closest_one():
    from k3fusion.explain import Candidate, _where

    g = torch.fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.ops.aten.exp.default, (x,))
    z = g.call_function(torch.ops.aten.neg.default, (y,))
    g.output(z)
    z.meta["stack_trace"] = 'File "/src/model.py", line 7, in forward\n    out = (-x.exp())\n'
    assert _where(z) == "model.py:7  out = (-x.exp())"
    assert _where(y) == "near model.py:7  out = (-x.exp())"  # Inductor made it: no trace
    assert _where(x, max_steps=1) == ""  # the search stops
    assert str(Candidate("RMSNorm", "y", "why", _where(y))) == \
        "RMSNorm near model.py:7  out = (-x.exp()) not fused: why"


def test_cli_explain_on_the_built_in_model(capsys):
    assert main(["explain", "--tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "attn_res: 5 fused" in out and "qkv_rmsnorm: 2 fused" in out  # under no_grad
