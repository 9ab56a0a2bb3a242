"""Tests for the plain-PyTorch reference model k3fusion.models.kimi_k3."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from k3fusion.models import KimiK3Attention, KimiK3Config, KimiK3ForCausalLM, KimiK3RMSNorm
from k3fusion.models.kimi_k3 import NORM_STYLES, count_mla_layers

# Unit roundoff (half an ulp at 1.0) per dtype: the error bound of one rounding.
_UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _tiny_model(dtype: torch.dtype = torch.float32, **kw: object) -> KimiK3ForCausalLM:
    return KimiK3ForCausalLM(KimiK3Config.tiny(dtype=dtype, **kw), seed=0).eval()


def _ids(cfg: KimiK3Config, batch: int = 2, seq: int = 9, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)


# ---------------------------------------------------------------- model / config


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_forward_shape_dtype_finite(dtype: torch.dtype) -> None:
    model = _tiny_model(dtype)
    cfg = model.config
    assert all(p.dtype == dtype for p in model.parameters())
    with torch.no_grad():
        logits = model(_ids(cfg))
    assert logits.shape == (2, 9, cfg.vocab_size)
    assert logits.dtype == dtype
    assert torch.isfinite(logits).all()


def test_k3_preset_widths() -> None:
    cfg = KimiK3Config.k3()  # never instantiate the model: it is ~tens of GB
    assert (cfg.hidden_size, cfg.q_lora_rank, cfg.kv_lora_rank) == (7168, 1536, 512)
    assert (cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim) == (64, 128, 128)
    assert (cfg.num_heads, cfg.vocab_size, cfg.num_layers) == (64, 163840, 61)
    assert cfg.intermediate_size == 18432
    assert cfg.rms_norm_eps == 1e-6
    assert cfg.qk_head_dim == 192


def test_tiny_preset_and_replace() -> None:
    cfg = KimiK3Config.tiny()
    assert cfg.q_lora_rank == 48 and cfg.q_lora_rank & (cfg.q_lora_rank - 1)  # not a power of 2
    assert cfg.dtype == torch.bfloat16 and cfg.norm_style == "hf"
    assert cfg.replace(norm_style="vllm").norm_style == "vllm"
    with pytest.raises(ValueError, match="hidden_size"):
        cfg.replace(hidden_size=0)  # replace re-validates


def test_init_is_seeded_and_norm_weights_not_ones() -> None:
    a, b = _tiny_model(), _tiny_model()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    c = KimiK3ForCausalLM(a.config, seed=1)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    norm_w = a.model.layers[0].self_attn.kv_a_layernorm.weight
    assert not torch.allclose(norm_w, torch.ones_like(norm_w))


def test_mla_layer_count() -> None:
    model = _tiny_model(num_layers=3)
    assert model.mla_layers == count_mla_layers(model) == 3
    norms = [m for m in model.modules() if isinstance(m, KimiK3RMSNorm)]
    # per layer: input, post-attn, q_a, kv_a; plus the final norm
    assert len(norms) == 4 * 3 + 1
    assert all(isinstance(layer.self_attn, KimiK3Attention) for layer in model.model.layers)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"norm_style": "llama"}, "norm_style"),
        ({"num_heads": 0}, "num_heads"),
        ({"kv_lora_rank": -4}, "kv_lora_rank"),
        ({"hidden_size": 64.0}, "hidden_size"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
        ({"dtype": torch.float64}, "dtype"),
        ({"attn_res": 1}, "attn_res"),
    ],
)
def test_config_validation(change: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        KimiK3Config.tiny(**change)


# ---------------------------------------------------------------- RMSNorm styles


def _norms(hidden: int, dtype: torch.dtype, weight: torch.Tensor) -> dict[str, KimiK3RMSNorm]:
    out = {}
    for style in NORM_STYLES:
        n = KimiK3RMSNorm(hidden, eps=1e-6, norm_style=style).to(dtype)
        with torch.no_grad():
            n.weight.copy_(weight)
        out[style] = n
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("hidden", [64, 48])
def test_norm_styles_agree(dtype: torch.dtype, hidden: int) -> None:
    g = torch.Generator().manual_seed(hidden)
    x = (3 * torch.randn(4, 7, hidden, generator=g)).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    norms = _norms(hidden, dtype, w)
    with torch.no_grad():
        outs = {s: n(x) for s, n in norms.items()}
    assert norms["hf"].eps == norms["hf"].variance_epsilon == 1e-6

    # Exact reference: x and w are representable in float64, so only the
    # style's own roundings separate it from `ref`.
    x64, w64 = x.double(), w.double()
    ref = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w64

    for style, out in outs.items():
        assert out.dtype == dtype, style
        assert out.shape == x.shape, style
    if dtype == torch.float32:
        for style, out in outs.items():
            torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6, msg=style)
        return

    u = _UNIT_ROUNDOFF[dtype]
    # hf / vllm / square are the same op sequence up to commutation -> same bits.
    assert torch.equal(outs["hf"], outs["vllm"])
    assert torch.equal(outs["hf"], outs["square"])
    # They round twice (after normalizing, after the weight multiply) ...
    err = (outs["hf"].double() - ref).abs()
    assert (err <= (2 * u + 1e-5) * ref.abs() + 1e-6).all()
    # ... while weight_fp32 and F.rms_norm round once, at the end.
    for style in ("weight_fp32", "torch"):
        err = (outs[style].double() - ref).abs()
        assert (err <= (u + 1e-5) * ref.abs() + 1e-6).all(), style


def test_norm_handles_strided_input() -> None:
    # The kv_a_layernorm input is a column slice; every style must accept it.
    x = torch.randn(2, 5, 40)[..., :32]
    w = 1 + 0.1 * torch.randn(32)
    for style, n in _norms(32, torch.float32, w).items():
        with torch.no_grad():
            torch.testing.assert_close(n(x), n(x.contiguous()), msg=style)


def test_model_norm_styles_match() -> None:
    # Same seed -> same weights; only the norm spelling differs.
    ids = _ids(KimiK3Config.tiny())
    with torch.no_grad():
        logits = {s: _tiny_model(norm_style=s)(ids) for s in NORM_STYLES}
    for style, out in logits.items():
        torch.testing.assert_close(out, logits["hf"], rtol=1e-5, atol=1e-5, msg=style)


# ---------------------------------------------------------------- attention structure


def test_kv_c_is_strided_view() -> None:
    model = _tiny_model(torch.bfloat16)
    cfg = model.config
    seen: list[torch.Tensor] = []
    q_seen: list[torch.Tensor] = []
    for layer in model.model.layers:
        layer.self_attn.kv_a_layernorm.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
        layer.self_attn.q_a_layernorm.register_forward_pre_hook(lambda m, a: q_seen.append(a[0]))
    with torch.no_grad():
        model(_ids(cfg, batch=2, seq=6))

    assert len(seen) == len(q_seen) == cfg.num_layers
    for kv_c in seen:
        assert kv_c.shape == (2, 6, cfg.kv_lora_rank)
        assert not kv_c.is_contiguous()
        assert kv_c.stride(-1) == 1
        assert kv_c.stride(-2) == cfg.kv_lora_rank + cfg.qk_rope_head_dim
    for q_c in q_seen:
        assert q_c.shape == (2, 6, cfg.q_lora_rank) and q_c.is_contiguous()


def test_causal() -> None:
    model = _tiny_model(torch.float32)
    ids = _ids(model.config, batch=2, seq=10)
    j = 6
    ids2 = ids.clone()
    ids2[:, j] = (ids2[:, j] + 1) % model.config.vocab_size
    with torch.no_grad():
        a, b = model(ids), model(ids2)
    torch.testing.assert_close(a[:, :j], b[:, :j], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, j:], b[:, j:])  # and the change is visible from j on
