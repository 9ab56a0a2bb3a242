"""The two AttnRes near misses of issue 15 that the pass once got wrong, compiled for real
(``backend="k3fusion"``: the crash was in Inductor's lowering of the rewritten graph).

* a tensor bank sliced with a step (``bank[..., 0:4:2, :]``) was read as if its slots were
  contiguous: a silent wrong result (max error ~2);
* a mix summed with ``keepdim=True`` was replaced by the op's ``[..., H]`` result: the
  compile failed with an ``InductorError``.

Both must compile and equal eager; neither is a site the op computes as written.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import k3fusion

from graph_utils import fresh_state  # noqa: F401

pytestmark = [pytest.mark.usefixtures("fresh_state")]

H = 64


class _Site(nn.Module):
    def __init__(self, sources: str) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.rand(H, generator=g) + 0.5)
        self.proj = nn.Linear(H, 1, bias=False)
        self.kind = sources

    def forward(self, bank, prefix):
        if self.kind == "strided":
            src = torch.cat([bank[..., 0:4:2, :], prefix.unsqueeze(-2)], -2)
        else:
            src = torch.stack([bank, prefix], -2)
        x = src.float()
        keys = self.w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).to(src.dtype)
        p = self.proj(keys).squeeze(-1).float().softmax(-1)
        weighted = p.unsqueeze(-1) * src  # fp32 (for bf16 sources too): cast back below
        if self.kind == "strided":
            return weighted.sum(-2).to(src.dtype)
        if self.kind == "keepdim":
            return weighted.sum(-2, keepdim=True).to(src.dtype)
        return weighted.sum(-2, keepdim=True).squeeze(-2).to(src.dtype)  # "keepdim_squeeze"


def _inputs(kind: str, dtype, tokens: int):
    g = torch.Generator().manual_seed(1)
    bank_shape = (2, tokens, 4, H) if kind == "strided" else (2, tokens, H)
    return (torch.randn(bank_shape, generator=g).to(dtype),
            torch.randn(2, tokens, H, generator=g).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind,tokens", [("strided", 5), ("keepdim", 5), ("keepdim_squeeze", 1)])
def test_issue_15_repro_compiles_and_equals_eager(kind, tokens, dtype):
    m = _Site(kind).to(dtype).eval()
    args = _inputs(kind, dtype, tokens)
    with torch.no_grad():
        expected = m(*args)
        out = torch.compile(m, backend="k3fusion", fullgraph=True)(*args)
    # Not a site the op computes as written: left alone, Inductor's own code runs.
    assert k3fusion.match_counts().get("attn_res", 0) == 0
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, expected, **tol)
