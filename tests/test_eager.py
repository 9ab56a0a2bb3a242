"""Eager wrappers: fused q/kv norm function, module wrapper, and patch_model."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import k3fusion
from k3fusion import reference
from k3fusion.eager import FusedQKVRMSNorm, fused_qkv_rmsnorm, patch_model, rms_norm_spec
from k3fusion.models import KimiK3Config, KimiK3ForCausalLM, KimiK3RMSNorm

import os

from _tolerances import assert_matches_reference

DUAL = torch.ops.k3fusion.dual_rms_norm.default


class CountOps(TorchDispatchMode):
    """Counts dispatcher calls of one op (custom ops pass through dispatch modes)."""

    def __init__(self, op):
        super().__init__()
        self.op, self.calls = op, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is self.op
        return func(*args, **(kwargs or {}))


def _reference_kernels(monkeypatch):
    """Make the op's CPU kernel the plain-torch reference (bit-exact comparisons)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


class GemmaRMSNorm(nn.Module):
    """Gemma's norm scales by ``1 + w``: a different function, never patched."""

    def __init__(self, n, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n))
        self.variance_epsilon = eps

    def forward(self, x):
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


def test_fused_function_matches_reference_with_strided_kv():
    q = torch.randn(5, 48, dtype=torch.bfloat16)
    kv = torch.randn(5, 40, dtype=torch.bfloat16)
    qw, kvw = torch.rand(48, dtype=torch.bfloat16) + 0.5, torch.rand(32, dtype=torch.bfloat16) + 0.5
    with CountOps(DUAL) as counter:
        yq, ykv = fused_qkv_rmsnorm(q, qw, 1e-6, kv[:, :32], kvw, 1e-5)
    assert counter.calls == 1
    truncates = os.environ.get("TRITON_INTERPRET") == "1"  # the interpreter's bf16 casts
    assert_matches_reference(yq, q, qw, 1e-6, False, bf16_casts_truncate=truncates)
    assert_matches_reference(ykv, kv[:, :32], kvw, 1e-5, False, bf16_casts_truncate=truncates)


def test_fused_function_is_plain_ops_under_compile():
    """Under torch.compile the wrapper emits plain norms and the graph pass fuses them."""
    torch._dynamo.reset()
    k3fusion.reset_match_counts()

    def f(q, kv, qw, kvw):
        return fused_qkv_rmsnorm(q, qw, 1e-6, kv[:, :32], kvw, 1e-6)

    args = (torch.randn(3, 48), torch.randn(3, 40), torch.rand(48) + 0.5, torch.rand(32) + 0.5)
    with torch._inductor.config.patch(fx_graph_cache=False):
        out = torch.compile(f, backend="k3fusion")(*args)
    assert k3fusion.match_counts() == {"qkv_rmsnorm": 1, "attn_res": 0,
                                       "attn_res_delta_handoff": 0, "moe_tail": 0}
    for got, want in zip(out, reference.dual_rms_norm(args[0], args[2], 1e-6, args[1][:, :32], args[3], 1e-6)):
        torch.testing.assert_close(got, want, rtol=1.3e-6, atol=1e-6)


@pytest.mark.parametrize("style,weight_in_fp32", [
    ("hf", False), ("vllm", False), ("square", False), ("weight_fp32", True), ("torch", True)])
def test_rms_norm_spec_detects_formulation(style, weight_in_fp32):
    norm = KimiK3RMSNorm(24, eps=1e-5, norm_style=style).to(torch.bfloat16)
    spec = rms_norm_spec(norm)
    assert spec is not None and spec.weight_in_fp32 is weight_in_fp32 and spec.eps == 1e-5


def test_rms_norm_spec_rejects_other_norms():
    assert rms_norm_spec(GemmaRMSNorm(16)) is None
    assert rms_norm_spec(nn.LayerNorm(16)) is None
    assert rms_norm_spec(nn.RMSNorm(16, elementwise_affine=False)) is None
    torch_norm = rms_norm_spec(nn.RMSNorm(16, eps=1e-5, dtype=torch.bfloat16))
    assert torch_norm is not None and torch_norm.weight_in_fp32
    with pytest.raises(TypeError, match="q_norm"):
        FusedQKVRMSNorm(GemmaRMSNorm(16), nn.RMSNorm(8))


@pytest.mark.parametrize("style", ["hf", "torch"])
def test_patch_model_is_exact_and_uses_one_launch_per_layer(style, monkeypatch):
    _reference_kernels(monkeypatch)
    cfg = KimiK3Config.tiny(norm_style=style)
    model = KimiK3ForCausalLM(cfg, seed=1).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    keys = list(model.state_dict())
    with torch.no_grad():
        want = model(ids)
        report = patch_model(model)
        assert report.patched == [f"model.layers.{i}.self_attn" for i in range(cfg.num_layers)]
        with CountOps(DUAL) as counter:
            got = model(ids)
    assert counter.calls == cfg.num_layers
    assert torch.equal(got, want)  # same arithmetic as the reference: bit for bit
    assert list(model.state_dict()) == keys
    again = patch_model(model)
    assert again.patched == [] and set(again.skipped.values()) == {"already patched"}


def test_patch_model_through_the_kernel_matches_eager():
    cfg = KimiK3Config.tiny()
    model = KimiK3ForCausalLM(cfg, seed=2).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids)
        patch_model(model)
        got = model(ids)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)  # bf16 through 2 layers


class UserMLA(nn.Module):
    """DeepSeek-style MLA code a user may have, with an optional in-place edit of q_c."""

    def __init__(self, norm_cls=KimiK3RMSNorm, edit_q=False):
        super().__init__()
        self.q_a_proj = nn.Linear(32, 24, bias=False)
        self.q_a_layernorm = norm_cls(24)
        self.kv_a_proj_with_mqa = nn.Linear(32, 20, bias=False)
        self.kv_a_layernorm = norm_cls(16)
        self.edit_q = edit_q
        self.calls = 0
        self.kv_a_proj_with_mqa.register_forward_hook(self._count)

    def _count(self, *_):
        self.calls += 1

    def forward(self, h):
        q_c = self.q_a_proj(h)
        if self.edit_q:
            q_c.mul_(2)  # after this, a prefetched q norm would be stale
        kv_c, k_pe = self.kv_a_proj_with_mqa(h).split([16, 4], dim=-1)
        return self.q_a_layernorm(q_c), self.kv_a_layernorm(kv_c), k_pe


def test_patch_model_falls_back_when_the_input_changed(monkeypatch):
    _reference_kernels(monkeypatch)
    torch.manual_seed(0)
    mod = UserMLA(edit_q=True)
    h = torch.randn(3, 32)
    with torch.no_grad():
        want = mod(h)
        assert patch_model(mod).patched == [""]
        got = mod(h)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert mod.calls == 2  # forward hooks of the patched projection still run


def test_patch_model_skips_nonstandard_norms():
    mod = UserMLA(norm_cls=GemmaRMSNorm)
    report = patch_model(mod)
    assert report.patched == [] and "not a standard RMSNorm" in report.skipped["q_a_layernorm"]
    with pytest.raises(TypeError, match="nn.Module"):
        patch_model("model")


def test_patched_model_compiles_to_the_graph_fusion():
    """A patched model under torch.compile: the wrappers step aside, the pass fuses."""
    cfg = KimiK3Config.tiny(dtype=torch.float32)
    model = KimiK3ForCausalLM(cfg, seed=3).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(ids)
        patch_model(model)
        torch._dynamo.reset()
        k3fusion.reset_match_counts()
        with torch._inductor.config.patch(fx_graph_cache=False):
            got = torch.compile(model, backend="k3fusion")(ids)
    assert k3fusion.match_counts()["qkv_rmsnorm"] == cfg.num_layers
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bank", ["list", "tensor"])
def test_patch_model_runs_every_attn_res_site_fused(bank, monkeypatch):
    """Every AttnRes site of a patched model runs a k3fusion AttnRes op, and the logits
    equal the unpatched model's (fp32: only summation order differs)."""
    _reference_kernels(monkeypatch)
    cfg = KimiK3Config.tiny(dtype=torch.float32, attn_res=True, attn_res_bank=bank,
                            attn_res_block_size=1, attn_res_precision="fp32", num_layers=3)
    model = KimiK3ForCausalLM(cfg, seed=4).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
    ops = (torch.ops.k3fusion.attn_res.default, torch.ops.k3fusion.attn_res_.default)
    with torch.no_grad():
        want = model(ids)
        report = patch_model(model)
        assert sum(name.endswith("apply_attn_res") for name in report.patched) == cfg.num_layers + 1
        with CountOps(ops[0]) as functional, CountOps(ops[1]) as in_place:
            got = model(ids)
    assert functional.calls + in_place.calls == model.attn_res_sites
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
