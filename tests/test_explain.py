"""``k3fusion.explain``: one compile, what was fused, and why each other candidate was
not, pointing at the model's own line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import k3fusion
from k3fusion.explain import main_explain

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


def test_fused_site_is_counted(capsys):
    r = k3fusion.explain(Step(), *_inputs())
    assert r.matches["attn_res"] == 1
    assert not [c for c in r.not_fused if c.kind.startswith("AttnRes")]
    assert "attn_res: 1 fused" in capsys.readouterr().out


def test_near_miss_says_why_and_where(capsys):
    r = k3fusion.explain(Step(temperature=2.0), *_inputs())
    assert r.matches["attn_res"] == 0
    (c,) = [c for c in r.not_fused if c.kind.startswith("AttnRes")]
    # Inductor folds logits / t into the softmax's exp: no plain softmax of the logits
    assert "softmax" in c.reason or "projection" in c.reason, c.reason
    assert "test_explain.py" in c.where and "THE SOFTMAX LINE" in c.where, c.where
    out = capsys.readouterr().out
    assert "AttnRes step (softmax) at test_explain.py:" in out


def test_cli_explain_on_the_built_in_model(capsys):
    assert main_explain(["--tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "attn_res:" in out and "qkv_rmsnorm:" in out
