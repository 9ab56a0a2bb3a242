"""``patch_model``'s skip reasons (issue 31): keyed by the path of the module the reason is
about, never ``''``; each says what a norm needs and what this one has instead."""

from __future__ import annotations

import torch
from torch import nn

from k3fusion.eager import patch_model
from k3fusion.eager._norm_spec import EXPECTED
from k3fusion.models import KimiK3RMSNorm


class NormW(nn.Module):
    """A standard RMSNorm whose weight is named ``w``."""

    def __init__(self, n: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.w * normed.to(x.dtype)


class NormEpsilon(KimiK3RMSNorm):
    """A standard RMSNorm whose eps is named ``epsilon``."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.epsilon = self.__dict__.pop("variance_epsilon")

    @property
    def eps(self):  # what the base class's forward reads
        return None

    def forward(self, x):
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True)
                                                + self.epsilon)).to(x.dtype)


class GemmaNorm(KimiK3RMSNorm):
    def forward(self, x):
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class MLA(nn.Module):
    def __init__(self, q_norm=None, kv_norm=None, q_proj=True) -> None:
        super().__init__()
        if q_proj:
            self.q_a_proj = nn.Linear(32, 24, bias=False)
        self.q_a_layernorm = q_norm or KimiK3RMSNorm(24)
        self.kv_a_proj_with_mqa = nn.Linear(32, 20, bias=False)
        self.kv_a_layernorm = kv_norm or KimiK3RMSNorm(16)


def test_a_weight_named_w_is_keyed_by_the_norm_and_says_what_is_needed():
    report = patch_model(MLA(q_norm=NormW(24)))  # the attention module is the model itself
    assert report.patched == [] and list(report.skipped) == ["q_a_layernorm"]
    why = report.skipped["q_a_layernorm"]
    assert why == ("NormW is not a standard RMSNorm: expected " + EXPECTED
                   + "; found no `weight` (parameters and number attributes: w, eps)")
    assert "a 1-D `weight` tensor, a number `eps` or `variance_epsilon`" in EXPECTED


def test_a_nested_module_is_keyed_by_its_full_path():
    model = nn.Module()
    model.layers = nn.ModuleList([MLA(), MLA(kv_norm=NormEpsilon(16))])
    report = patch_model(model)
    assert report.patched == ["layers.0"]
    why = report.skipped["layers.1.kv_a_layernorm"]
    assert why.endswith("found no `eps` or `variance_epsilon` (parameters and number "
                        "attributes: weight, epsilon)"), why


def test_another_function_says_so():
    why = patch_model(MLA(kv_norm=GemmaNorm(16))).skipped["kv_a_layernorm"]
    assert why.startswith("GemmaNorm is not a standard RMSNorm: expected ")
    assert why.endswith("found another function of weight (16,) and eps 1e-06 on a probe "
                        "input (Gemma's 1 + weight, say)"), why


def test_a_missing_projection_is_keyed_by_its_path():
    report = patch_model(MLA(q_proj=False))
    assert report.skipped == {"q_a_proj": "expected a `q_a_proj` child module next to "
                              "q_a_layernorm, kv_a_proj_with_mqa, kv_a_layernorm; found nothing"}


class LatentMoE(nn.Module):
    """The latent-MoE tail contract (``is_latent_moe``)."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.latent_norm, self.up_proj, self.tp_group = norm, nn.Linear(8, 16, bias=False), None

    def tail(self, routed_latent, shared):
        return shared + self.up_proj(self.latent_norm(routed_latent))


def test_a_latent_norm_says_what_it_lacks():
    report = patch_model(LatentMoE(NormW(8)))
    assert report.skipped == {"tail": "latent_norm: NormW is not a standard RMSNorm: expected "
                              + EXPECTED + "; found no `weight` (parameters and number "
                              "attributes: w, eps)"}
