"""A patched model follows its modules (issue 29, items 3 and 4): weights replaced by
``load_state_dict(assign=True)``, an eps or a norm style changed, a child swapped, the
model converted with ``.to(bf16)`` after patching -- each call after the change computes
what the unpatched model computes with the same change. And the patched AttnRes step
accepts every call the K3 contract accepts (a ring-buffer bank written over a live slot,
a list bank shorter than ``num_blocks``: the original step runs, and the report counts it).

Comparisons run the ops on their plain-torch CPU path (``k3fusion.reference``): the q/kv
pair and the MoE tail are then bit for bit the modules' functions; the AttnRes op keeps
keys, logits and mix in fp32, which a model-dtype module rounds: equal within that
rounding (docs/eager.md, "What is bit for bit").
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from k3fusion.eager import patch_model
from k3fusion.models import KimiK3Config, KimiK3ForCausalLM
from k3fusion.models.kimi_k3 import apply_attn_res

pytestmark = pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")


@pytest.fixture(autouse=True)
def reference_path(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def _pair(dtype=torch.float32, **kw):
    """(unpatched, patched) copies of one tiny K3 model."""
    config = KimiK3Config.tiny(dtype=dtype, **kw)
    plain = KimiK3ForCausalLM(config, seed=0).eval()
    patched = copy.deepcopy(plain)
    report = patch_model(patched)
    return plain, patched, report


def _ids(seq=7):
    return torch.randint(0, 128, (2, seq), generator=torch.Generator().manual_seed(1))


def _logits(model, ids):
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out


def _close(a, b, dtype, exact):
    if exact:
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    else:  # within the AttnRes module's own roundings of keys, logits and mix
        tol = 2e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * b.abs().max().item())


def _other_state(model, seed=5):
    g = torch.Generator().manual_seed(seed)
    return {k: (v + 0.3 * torch.randn(v.shape, generator=g).to(v.dtype)
                if v.is_floating_point() else v) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("attn_res", [False, True], ids=["qkv", "attn_res"])
def test_load_state_dict_assign_is_followed(attn_res):
    plain, patched, _ = _pair(attn_res=attn_res)
    ids = _ids()
    _logits(patched, ids)  # the first call sees (and once cached) the old weights
    state = _other_state(plain)
    plain.load_state_dict(state, assign=True)
    patched.load_state_dict(copy.deepcopy(state), assign=True)
    _close(_logits(patched, ids), _logits(plain, ids), torch.float32, exact=not attn_res)


def test_attn_res_eps_change_is_followed():
    plain, patched, _ = _pair(attn_res=True)
    ids = _ids()
    _logits(patched, ids)
    for model in (plain, patched):  # layer 1 reads two sources: its keys matter
        model.model.layers[1].attn_res.norm.variance_epsilon = 0.5
        model.model.layers[1].mlp_res.norm.variance_epsilon = 0.25
    _close(_logits(patched, ids), _logits(plain, ids), torch.float32, exact=False)


@pytest.mark.parametrize("change", ["norm_style", "eps"])
def test_qkv_pair_norm_changes_are_followed(change):
    """bf16, where the two formulations round differently: bit for bit after the change,
    and the pair still fused (one dual launch per layer)."""
    from test_eager import DUAL, CountOps

    plain, patched, _ = _pair(dtype=torch.bfloat16)
    ids = _ids()
    _logits(patched, ids)
    for model in (plain, patched):
        for layer in model.model.layers:
            if change == "norm_style":
                layer.self_attn.q_a_layernorm.norm_style = "weight_fp32"
            else:
                layer.self_attn.kv_a_layernorm.variance_epsilon = 0.25
    with CountOps(DUAL) as counter:
        got = _logits(patched, ids)
    _close(got, _logits(plain, ids), torch.bfloat16, exact=True)
    assert counter.calls == len(patched.model.layers)


def test_swapped_attn_res_child_is_followed():
    plain, patched, _ = _pair(attn_res=True)
    ids = _ids()
    _logits(patched, ids)
    g = torch.Generator().manual_seed(9)
    new = nn.Linear(64, 1, bias=False)
    with torch.no_grad():
        new.weight.copy_(torch.randn(1, 64, generator=g))
    plain.model.layers[1].attn_res.proj = new
    patched.model.layers[1].attn_res.proj = copy.deepcopy(new)
    _close(_logits(patched, ids), _logits(plain, ids), torch.float32, exact=False)


@pytest.mark.parametrize("style", ["weight_fp32", "torch"])
def test_converted_to_bf16_after_patching(style):
    """Patched in fp32, where both norm formulations agree, then ``.to(bf16)``: the q/kv
    pair and the tail use the formulation the norm has in bf16 (bit for bit), and an
    ``nn.RMSNorm``-like norm the bf16 probe refuses runs unfused, as the module."""
    plain, patched, _ = _pair(norm_style=style, latent_moe=True)
    ids = _ids()
    _logits(patched, ids)
    plain, patched = plain.to(torch.bfloat16), patched.to(torch.bfloat16)
    _close(_logits(patched, ids), _logits(plain, ids), torch.bfloat16, exact=True)


def test_swapped_latent_moe_children_are_followed():
    plain, patched, report = _pair(latent_moe=True)
    ids = _ids()
    _logits(patched, ids)
    g = torch.Generator().manual_seed(3)
    for model in (plain, patched):
        moe = model.model.layers[0].mlp
        up = nn.Linear(moe.up_proj.in_features, moe.up_proj.out_features, bias=False)
        with torch.no_grad():
            up.weight.copy_(torch.randn(up.weight.shape, generator=torch.Generator().manual_seed(3)))
        moe.up_proj = up
        moe.latent_norm.variance_epsilon = 0.1
    _close(_logits(patched, ids), _logits(plain, ids), torch.float32, exact=True)
    # a latent norm of another kind: the original tail runs, and the report counts it
    for model in (plain, patched):
        model.model.layers[1].mlp.latent_norm.norm_style = "hf"
        model.model.layers[1].mlp.latent_norm.forward = (
            lambda x, n=model.model.layers[1].mlp.latent_norm: n.weight * x)  # not a norm
    _close(_logits(patched, ids), _logits(plain, ids), torch.float32, exact=True)
    assert report.fallbacks() == {
        "model.layers.1.mlp": {"latent_norm is no longer a standard RMSNorm": 1}}


def _step(model, i=0):
    layer = model.model.layers[i]
    return layer, layer.attn_res


def test_ring_buffer_bank_written_over_a_live_slot_runs_the_original():
    plain, patched, report = _pair(attn_res=True)
    _, res = _step(plain)
    g = torch.Generator().manual_seed(2)
    prefix, delta = torch.randn(2, 3, 64, generator=g), torch.randn(2, 3, 64, generator=g)
    bank = torch.randn(2, 3, 4, 64, generator=g)
    layer = patched.model.layers[0]
    with torch.no_grad():
        want = apply_attn_res(prefix, bank.clone(), res, 3, delta=delta, block_write_idx=1)
        got = layer.apply_attn_res(prefix, bank.clone(), layer.attn_res, 3, delta=delta,
                                   block_write_idx=1)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert report.fallbacks() == {
        "model.layers.0": {"block written over a live source (a ring-buffer bank)": 1}}


def test_list_bank_shorter_than_num_blocks_runs_the_original():
    """The contract writes first, then reads ``bank[:num_blocks]``: with one block and
    ``num_blocks=2`` the written prefix is a source too."""
    plain, patched, report = _pair(attn_res=True)
    _, res = _step(plain)
    g = torch.Generator().manual_seed(4)
    prefix, b0 = torch.randn(2, 3, 64, generator=g), torch.randn(2, 3, 64, generator=g)
    layer = patched.model.layers[0]
    with torch.no_grad():
        want = apply_attn_res(prefix, [b0], res, 2, block_write_idx=1)
        got = layer.apply_attn_res(prefix, [b0], layer.attn_res, 2, block_write_idx=1)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    assert len(got[2]) == len(want[2]) == 2
    assert report.fallbacks() == {"model.layers.0": {"list bank shorter than num_blocks": 1}}


@pytest.mark.parametrize("dtype,precision", [(torch.float32, "model"), (torch.bfloat16, "model"),
                                             (torch.bfloat16, "fp32")])
def test_patched_attn_res_model_within_the_stated_bound(dtype, precision):
    """docs/eager.md: the AttnRes step keeps keys, logits and mix in fp32 and rounds once;
    the module rounds as it is written -- equal within that rounding, no closer claimed."""
    plain, patched, _ = _pair(dtype=dtype, attn_res=True, attn_res_precision=precision)
    ids = _ids(9)
    _close(_logits(patched, ids), _logits(plain, ids), dtype, exact=False)
