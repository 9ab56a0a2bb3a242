"""Block Attention Residuals (``KimiK3Config.attn_res=True``) in the reference model.

Eager only (the compile checks live with the passes).  The spec of one AttnRes step is
``k3fusion.reference.attn_res``; the model's ``apply_attn_res`` is the user-code
spelling of it, in the model dtype ("model" precision) or all in fp32 ("fp32").
"""

from __future__ import annotations

import math

import pytest
import torch

from k3fusion import reference
from k3fusion.models import (
    KimiK3AttnRes,
    KimiK3Config,
    KimiK3ForCausalLM,
    KimiK3RMSNorm,
    apply_attn_res,
    count_attn_res_sites,
)
from k3fusion.models.kimi_k3 import (
    ATTN_RES_BANKS,
    ATTN_RES_PRECISIONS,
    NORM_STYLES,
    KimiK3DecoderLayer,
    KimiK3Model,
)

U_BF16 = 2.0**-8  # unit roundoff of bf16 (half an ulp at 1.0): the bound of one rounding
EPS = 1e-6


def _model(
    dtype: torch.dtype = torch.float32,
    *,
    num_layers: int = 3,
    block_size: int = 2,
    bank: str = "list",
    precision: str = "model",
    **kw: object,
) -> KimiK3ForCausalLM:
    cfg = KimiK3Config.tiny(
        dtype=dtype,
        num_layers=num_layers,
        attn_res=True,
        attn_res_block_size=block_size,
        attn_res_bank=bank,
        attn_res_precision=precision,
        **kw,
    )
    return KimiK3ForCausalLM(cfg, seed=0).eval()


def _ids(vocab: int = 128, batch: int = 2, seq: int = 7, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"attn_res": 1}, "attn_res"),
        ({"attn_res_block_size": 0}, "attn_res_block_size"),
        ({"attn_res_block_size": 2.0}, "attn_res_block_size"),
        ({"attn_res_block_size": True}, "attn_res_block_size"),
        ({"attn_res_bank": "dict"}, "attn_res_bank"),
        ({"attn_res_bank": None}, "attn_res_bank"),
        ({"attn_res_precision": "fp16"}, "attn_res_precision"),
        ({"attn_res_precision": "FP32"}, "attn_res_precision"),
    ],
)
def test_config_validation(change: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        KimiK3Config.tiny(**change)


def test_config_defaults_and_max_blocks() -> None:
    cfg = KimiK3Config.tiny()
    assert (cfg.attn_res, cfg.attn_res_block_size) == (False, 12)
    assert (cfg.attn_res_bank, cfg.attn_res_precision) == ("list", "model")
    assert ATTN_RES_BANKS == ("list", "tensor") and ATTN_RES_PRECISIONS == ("model", "fp32")
    assert KimiK3Config.k3(attn_res=True).attn_res_max_blocks == 6  # ceil(61 / 12)
    for layers, bs, nb in [(3, 1, 3), (3, 2, 2), (3, 3, 1), (3, 12, 1), (12, 12, 1), (13, 12, 2)]:
        assert KimiK3Config.tiny(num_layers=layers, attn_res_block_size=bs).attn_res_max_blocks == nb


# ---------------------------------------------------------------- structure


@pytest.mark.parametrize(("layers", "bs"), [(3, 1), (3, 2), (3, 3), (5, 2), (2, 12)])
def test_block_bookkeeping(layers: int, bs: int) -> None:
    model = _model(num_layers=layers, block_size=bs)
    assert model.model.max_blocks == math.ceil(layers / bs)
    for l, layer in enumerate(model.model.layers):
        assert layer.layer_idx == l
        assert layer.is_block_write_layer == (l % bs == 0)
        # number of block-write layers before l
        assert layer.prev_valid_blocks == sum(j % bs == 0 for j in range(l)) == math.ceil(l / bs)
        if layer.is_block_write_layer:
            assert layer.block_write_idx == l // bs == layer.prev_valid_blocks


def test_attn_res_sites_and_modules() -> None:
    model = _model(num_layers=3)
    assert model.attn_res_sites == count_attn_res_sites(model) == 2 * 3 + 1
    assert model.mla_layers == 3
    assert KimiK3ForCausalLM(KimiK3Config.tiny(num_layers=3), seed=0).attn_res_sites == 0
    for layer in model.model.layers:
        assert isinstance(layer.attn_res, KimiK3AttnRes) and isinstance(layer.mlp_res, KimiK3AttnRes)
    res = model.model.final_res
    assert isinstance(res.norm, KimiK3RMSNorm) and res.norm.norm_style == model.config.norm_style
    assert res.proj.weight.shape == (1, model.config.hidden_size) and res.proj.bias is None
    # Distinct weights per site; norm weights not ones (a dropped key norm shows up).
    qs = [m.proj.weight for m in model.modules() if isinstance(m, KimiK3AttnRes)]
    assert all(not torch.equal(qs[0], q) for q in qs[1:])
    assert not torch.allclose(res.norm.weight, torch.ones_like(res.norm.weight))


def test_plain_model_unchanged_by_new_fields() -> None:
    # attn_res=False builds and draws exactly as before; bank/precision are ignored.
    base = KimiK3ForCausalLM(KimiK3Config.tiny(dtype=torch.float32), seed=0)
    other = KimiK3ForCausalLM(
        KimiK3Config.tiny(dtype=torch.float32, attn_res_bank="tensor", attn_res_precision="fp32"),
        seed=0,
    )
    sd_a, sd_b = base.state_dict(), other.state_dict()
    assert list(sd_a) == list(sd_b) and all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)
    assert not any("res" in k for k in sd_a)


def test_pseudo_query_init_is_not_degenerate() -> None:
    # Softmax weights neither ~uniform (0.02 init) nor ~one-hot.
    model = _model(num_layers=4, block_size=1)
    max_w: list[float] = []

    def hook(mod: KimiK3AttnRes, args: tuple[torch.Tensor]) -> None:
        s = args[0]
        if s.shape[-2] > 1:
            w = mod.proj(mod.norm(s)).squeeze(-1).softmax(-1)
            max_w.append(w.max(-1).values.mean().item() * s.shape[-2])  # 1 = uniform

    for m in model.modules():
        if isinstance(m, KimiK3AttnRes):
            m.register_forward_pre_hook(hook)
    with torch.no_grad():
        model(_ids())
    assert len(max_w) == 2 * 4 + 1 - 1  # layer 0's attention site has one source
    # n * mean(max weight): 1.0 for uniform, n for one-hot
    assert sum(max_w) / len(max_w) > 1.15
    assert all(mw < 0.9 * n for mw, n in zip(max_w, [2, 2, 3, 3, 4, 4, 5, 5]))


# ---------------------------------------------------------------- forward


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("precision", ATTN_RES_PRECISIONS)
@pytest.mark.parametrize("bank", ATTN_RES_BANKS)
@pytest.mark.parametrize("block_size", [1, 2, 3, 12])
def test_forward_shape_dtype_finite(
    dtype: torch.dtype, precision: str, bank: str, block_size: int
) -> None:
    # num_layers=3: bs=1 puts a boundary at every layer (first and last), bs=2 at
    # layers 0 and 2 (last), bs=3 and 12 only at layer 0 (one block).
    model = _model(dtype, block_size=block_size, bank=bank, precision=precision)
    assert all(p.dtype == dtype for p in model.parameters())
    with torch.no_grad():
        logits = model(_ids())
    assert logits.shape == (2, 7, model.config.vocab_size) and logits.dtype == dtype
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("style", NORM_STYLES)
def test_forward_all_norm_styles(style: str) -> None:
    out = {}
    for bank in ATTN_RES_BANKS:
        with torch.no_grad():
            out[bank] = _model(torch.bfloat16, bank=bank, norm_style=style)(_ids())
        assert torch.isfinite(out[bank]).all()
    assert torch.equal(out["list"], out["tensor"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("precision", ATTN_RES_PRECISIONS)
@pytest.mark.parametrize("block_size", [1, 2, 3])
def test_list_and_tensor_bank_bit_identical(dtype: torch.dtype, precision: str, block_size: int) -> None:
    # Both banks build the same contiguous [B, S, n+1, H] sources (stack vs cat of the
    # same values) and run the same arithmetic on them: bit-identical, bf16 included.
    logits = {}
    for bank in ATTN_RES_BANKS:
        with torch.no_grad():
            logits[bank] = _model(dtype, block_size=block_size, bank=bank, precision=precision)(_ids())
    assert torch.equal(logits["list"], logits["tensor"])


@pytest.mark.parametrize("bank", ATTN_RES_BANKS)
def test_fp32_model_precisions_bit_identical(bank: str) -> None:
    # In an fp32 model the "model" path has no casts to drop: same ops, same bits.
    with torch.no_grad():
        a = _model(torch.float32, bank=bank, precision="model")(_ids())
        b = _model(torch.float32, bank=bank, precision="fp32")(_ids())
    assert torch.equal(a, b)


def test_bf16_precisions_differ_but_close() -> None:
    with torch.no_grad():
        a = _model(torch.bfloat16, precision="model")(_ids())
        b = _model(torch.bfloat16, precision="fp32")(_ids())
        c = _model(torch.float32, precision="fp32")(_ids())
    assert not torch.equal(a, b)
    scale = c.abs().max()
    assert (a.float() - c).abs().max() < 0.1 * scale and (b.float() - c).abs().max() < 0.1 * scale


def test_not_the_plain_residual_model() -> None:
    plain = KimiK3ForCausalLM(KimiK3Config.tiny(dtype=torch.float32, num_layers=3), seed=0).eval()
    with torch.no_grad():
        assert not torch.allclose(plain(_ids()), _model(num_layers=3)(_ids()))


@pytest.mark.parametrize("bank", ATTN_RES_BANKS)
def test_causal(bank: str) -> None:
    model = _model(torch.float32, bank=bank)
    ids = _ids(seq=10)
    j = 6
    ids2 = ids.clone()
    ids2[:, j] = (ids2[:, j] + 1) % model.config.vocab_size
    with torch.no_grad():
        a, b = model(ids), model(ids2)
    torch.testing.assert_close(a[:, :j], b[:, :j], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, j:], b[:, j:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_first_attention_input_is_normed_embedding(dtype: torch.dtype) -> None:
    # Layer 0 has one source (the embedding): softmax weight exactly 1, mix exact.
    model = _model(dtype, bank="tensor")
    seen: list[torch.Tensor] = []
    model.model.layers[0].self_attn.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    ids = _ids()
    with torch.no_grad():
        model(ids)
        expected = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
    assert torch.equal(seen[0], expected)


def test_backward_matches_between_banks() -> None:
    # Training works with the in-place tensor bank too (nothing saved for backward is
    # overwritten); the gradients agree with the list bank.
    grads = {}
    for b in ATTN_RES_BANKS:
        model = _model(torch.float32, bank=b).train()
        model(_ids()).float().square().mean().backward()
        grads[b] = {n: p.grad for n, p in model.named_parameters()}
    for name, g in grads["list"].items():
        assert g is not None, name
        torch.testing.assert_close(grads["tensor"][name], g, rtol=1e-5, atol=1e-7, msg=name)
    assert grads["list"]["model.final_res.proj.weight"].abs().sum() > 0


# ---------------------------------------------------------------- bank contents


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("layers", "bs"), [(3, 1), (3, 2), (3, 3), (5, 2)])
def test_tensor_bank_holds_block_boundary_prefixes(dtype: torch.dtype, layers: int, bs: int) -> None:
    model = _model(dtype, num_layers=layers, block_size=bs, bank="tensor")
    max_blocks = model.model.max_blocks
    boundary: list[torch.Tensor] = []  # prefixes entering the block-write layers
    snapshots: list[torch.Tensor] = []  # the bank as each layer receives it
    final: list[torch.Tensor] = []

    def pre(layer: KimiK3DecoderLayer, args: tuple[torch.Tensor, torch.Tensor]) -> None:
        prefix, bank = args
        snapshots.append(bank.clone())
        if layer.is_block_write_layer:
            boundary.append(prefix.clone())

    for layer in model.model.layers:
        layer.register_forward_pre_hook(pre)
    model.model.layers[-1].register_forward_hook(lambda m, a, out: final.append(out[1].clone()))
    ids = _ids()
    with torch.no_grad():
        model(ids)
        emb = model.model.embed_tokens(ids)

    assert len(boundary) == max_blocks and torch.equal(boundary[0], emb)
    for l, (layer, bank) in enumerate(zip(model.model.layers, snapshots)):
        assert bank.shape == (2, 7, max_blocks, model.config.hidden_size) and bank.dtype == dtype
        n = layer.prev_valid_blocks  # slots written by the layers before l
        for k in range(max_blocks):
            expected = boundary[k] if k < n else torch.zeros_like(emb)
            assert torch.equal(bank[..., k, :], expected), (l, k)
    # After the last layer every slot is written (max_blocks = number of write layers).
    for k in range(max_blocks):
        assert torch.equal(final[0][..., k, :], boundary[k]), k


def test_list_bank_contents_and_not_mutated() -> None:
    model = _model(torch.bfloat16, num_layers=5, block_size=2, bank="list")
    received: list[tuple[int, list[torch.Tensor], list[torch.Tensor]]] = []
    for layer in model.model.layers:
        layer.register_forward_hook(
            lambda m, args, out: received.append((len(args[1]), args[1], out[1]))
        )
    with torch.no_grad():
        model(_ids())
    for layer, (n_in, bank_in, bank_out) in zip(model.model.layers, received):
        assert len(bank_in) == n_in == layer.prev_valid_blocks  # input never grew
        assert len(bank_out) == layer.prev_valid_blocks + layer.is_block_write_layer
        if layer.is_block_write_layer:
            assert bank_out is not bank_in and all(a is b for a, b in zip(bank_in, bank_out))


@pytest.mark.parametrize("precision", ATTN_RES_PRECISIONS)
def test_apply_attn_res_list_not_mutated(precision: str) -> None:
    res = _res(32, "hf", precision, torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    blocks = [torch.randn(2, 3, 32, generator=g).bfloat16() for _ in range(2)]
    bank = list(blocks)
    prefix = torch.randn(2, 3, 32, generator=g).bfloat16()
    delta = torch.randn(2, 3, 32, generator=g).bfloat16()
    prefix_before = prefix.clone()
    out, new_prefix, new_bank = apply_attn_res(prefix, bank, res, 2, delta=delta, block_write_idx=2)
    assert len(bank) == 2 and all(a is b for a, b in zip(bank, blocks))
    assert torch.equal(prefix, prefix_before)  # the caller's prefix is not updated in place
    assert len(new_bank) == 3 and new_bank[2] is new_prefix
    assert torch.equal(new_prefix, prefix + delta)
    assert out.shape == prefix.shape and out.dtype == torch.bfloat16
    # without a write the same list object comes back
    _, _, same = apply_attn_res(prefix, bank, res, 2)
    assert same is bank


def test_layer_and_model_methods_are_the_call_sites() -> None:
    # The eager patch swaps KimiK3DecoderLayer.apply_attn_res / KimiK3Model.apply_attn_res;
    # every AttnRes site must go through them.
    model = _model(num_layers=3, block_size=2)
    calls: list[tuple[str, int, int, bool]] = []

    def spy(owner: str, orig):  # noqa: ANN001, ANN202
        def wrapped(prefix, bank, res, num_blocks, **kw):  # noqa: ANN001, ANN202
            calls.append((owner, num_blocks, kw.get("block_write_idx", -1), kw.get("delta") is not None))
            return orig(prefix, bank, res, num_blocks, **kw)

        return wrapped

    for layer in model.model.layers:
        layer.apply_attn_res = spy("layer", layer.apply_attn_res)
    model.model.apply_attn_res = spy("model", model.model.apply_attn_res)
    with torch.no_grad():
        model(_ids())
    # (site, num_blocks, block_write_idx, has delta) for layers 0 (write), 1, 2 (write), final.
    # Attention sites never carry a delta (the previous MLP output is already in the
    # prefix); the MLP site after a write has none either (the prefix restarted).
    assert calls == [
        ("layer", 0, 0, False), ("layer", 1, -1, False),
        ("layer", 1, -1, False), ("layer", 1, -1, True),
        ("layer", 1, 1, False), ("layer", 2, -1, False),
        ("model", 2, -1, False),
    ]
    assert callable(KimiK3DecoderLayer.apply_attn_res) and callable(KimiK3Model.apply_attn_res)


# ---------------------------------------------------------------- numerics vs the spec


def _res(hidden: int, style: str, precision: str, dtype: torch.dtype, seed: int = 0) -> KimiK3AttnRes:
    g = torch.Generator().manual_seed(seed)
    res = KimiK3AttnRes(hidden, EPS, style, precision)
    with torch.no_grad():
        res.norm.weight.copy_(1 + 0.1 * torch.randn(hidden, generator=g))
        res.proj.weight.copy_(torch.randn(1, hidden, generator=g) / math.sqrt(hidden))
    return res.to(dtype)


def _bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    """bf16 spacing at each |v| (float64): 2**(floor(log2|v|) - 7), floored at normals."""
    _, exp = torch.frexp(v.double().abs())
    return torch.pow(2.0, (exp - 1).clamp_min(-126).double() - 7)


def _truth(sources: torch.Tensor, res: KimiK3AttnRes, out_norm: KimiK3RMSNorm | None):
    """float64 AttnRes on the (exactly representable) bf16 sources and weights.

    Returns (out, error bound for "model" precision, error bound for "fp32" precision,
    "a few roundings": the error of 4 roundings of the absolute mix, 4u A, carried to out).

    Error model, one bf16 rounding = relative u = 2**-8 (first order):

    "fp32": key norm, logits, softmax, mix all in fp32 (relative errors ~H * 2**-24,
      negligible: 1e-5 of the absolute mix A = sum_s w_s |v_s| covers them), then ONE
      bf16 rounding of the mix:  E = u |m| + 1e-5 A.
    "model": keys k = round(round(v * rsqrt) * g) (hf style; 2 roundings, at most 2u
      relative per element), logit = round(sum_i k_i p_i) (fp32 accumulation, one
      rounding), so |dlogit_s| <= D = 3u max_s sum_i |k_i p_i|; a logit shift of at
      most D changes every softmax weight by a factor within exp(+-2D); the weights are
      rounded to bf16 (u), each product w_s v_s is rounded (u), and the bf16 sum over
      sources accumulates in fp32 and rounds once (u |m|):
        E = ((1 + u)^2 exp(2D) - 1) A + u |m|.
      D is a worst case (all roundings aligned); observed errors are a few u * A.
    With the output norm o = g_o * m / rms(m): an error e in m moves o_i by at most
      |g_o,i| / rms(m) * (e_i + |m_i| rms(e) / rms(m)), plus the norm's own <= 2
      roundings (2u |o_i|).
    """
    s = sources.double()
    g, p = res.norm.weight.double(), res.proj.weight.double()[0]
    keys = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS) * g
    w = (keys @ p).softmax(-1)
    m = (w.unsqueeze(-1) * s).sum(-2)
    a = (w.unsqueeze(-1) * s.abs()).sum(-2)
    d = 3 * U_BF16 * (keys * p).abs().sum(-1).amax(-1, keepdim=True)
    e_model = ((1 + U_BF16) ** 2 * torch.exp(2 * d) - 1) * a + U_BF16 * m.abs()
    e_fp32 = U_BF16 * m.abs() + 1e-5 * a
    e_few = 4 * U_BF16 * a
    if out_norm is None:
        return m, e_model, e_fp32, e_few
    rms = m.pow(2).mean(-1, keepdim=True).add(out_norm.eps).sqrt()
    go = out_norm.weight.double()
    out = go * m / rms

    def through_norm(e: torch.Tensor) -> torch.Tensor:
        rms_e = e.pow(2).mean(-1, keepdim=True).sqrt()
        return go.abs() / rms * (e + m.abs() * rms_e / rms) + 2 * U_BF16 * out.abs()

    return out, through_norm(e_model), through_norm(e_fp32), through_norm(e_few)


@pytest.mark.parametrize("style", NORM_STYLES)
@pytest.mark.parametrize("precision", ATTN_RES_PRECISIONS)
@pytest.mark.parametrize("with_out_norm", [False, True])
@pytest.mark.parametrize(("num_blocks", "with_delta", "write_idx"), [(0, False, 0), (2, True, -1), (2, True, 2), (3, False, -1)])
def test_apply_attn_res_matches_reference(
    style: str, precision: str, with_out_norm: bool, num_blocks: int, with_delta: bool, write_idx: int
) -> None:
    hidden, bsz, seq, max_blocks = 64, 3, 5, 4
    dt = torch.bfloat16
    g = torch.Generator().manual_seed(7 + num_blocks)
    res = _res(hidden, style, precision, dt)
    out_norm = None
    if with_out_norm:
        out_norm = KimiK3RMSNorm(hidden, EPS, style)
        with torch.no_grad():
            out_norm.weight.copy_(1 + 0.1 * torch.randn(hidden, generator=g))
        out_norm = out_norm.to(dt)
    prefix = torch.randn(bsz, seq, hidden, generator=g).to(dt)
    delta = torch.randn(bsz, seq, hidden, generator=g).to(dt) if with_delta else None
    # Blocks of different scales, so the softmax mixes unlike magnitudes.
    scales = torch.tensor([0.3, 2.0, 1.0, 4.0])[:, None]
    bank = torch.zeros(bsz, seq, max_blocks, hidden, dtype=dt)
    bank[..., :num_blocks, :] = (torch.randn(bsz, seq, max_blocks, hidden, generator=g) * scales)[
        ..., :num_blocks, :
    ].to(dt)
    bank_list = [bank[..., k, :].clone() for k in range(num_blocks)]

    # The spec, on flattened tokens (it updates its prefix/blocks in place).
    ref_prefix = prefix.reshape(-1, hidden).clone()
    ref_blocks = bank.reshape(-1, max_blocks, hidden).clone()
    ref_out = reference.attn_res(
        ref_prefix, ref_blocks, num_blocks, res.norm.weight, res.proj.weight[0], EPS,
        delta=None if delta is None else delta.reshape(-1, hidden),
        block_write_idx=write_idx,
        out_norm_w=None if out_norm is None else out_norm.weight,
        out_eps=EPS,
        out_weight_in_fp32=style in ("weight_fp32", "torch"),
    ).reshape(bsz, seq, hidden)

    n_src = num_blocks + (1 if write_idx >= 0 else 0)  # after a write the block is a source
    outs = {}
    with torch.no_grad():
        for kind, bk in (("tensor", bank.clone()), ("list", list(bank_list))):
            # A write appends at num_blocks; the step after it reads the new block too.
            out, new_prefix, new_bank = apply_attn_res(
                prefix, bk, res, num_blocks, delta=delta, output_norm=out_norm,
                block_write_idx=write_idx,
            )
            outs[kind] = out
            # Step 1 is bit-exact: a bf16 add is the fp32 add rounded once.
            assert torch.equal(new_prefix.reshape(-1, hidden), ref_prefix)
            if kind == "tensor":
                assert torch.equal(new_bank.reshape(-1, max_blocks, hidden), ref_blocks)
            else:
                assert len(new_bank) == n_src
                if write_idx >= 0:
                    assert new_bank[-1] is new_prefix
    assert torch.equal(outs["list"], outs["tensor"])
    out = outs["tensor"]
    assert out.dtype == dt and out.shape == prefix.shape

    sources = torch.cat([bank[..., :num_blocks, :], ref_prefix.reshape(bsz, seq, 1, hidden)], -2)
    truth, e_model, e_fp32, e_few = _truth(sources, res, out_norm)
    err = (out.double() - truth).abs()
    ref_err = (ref_out.double() - truth).abs()
    # the spec itself is one-rounding accurate
    assert (ref_err <= e_fp32 * 1.01 + 1e-9).all(), (ref_err / e_fp32).max()
    if precision == "fp32":
        assert (err <= e_fp32 * 1.01 + 1e-9).all(), (err / e_fp32).max()
    else:
        assert (err <= e_model * 1.01 + 1e-9).all(), (err / e_model).max()  # worst case
        assert (err <= e_few).all(), (err / e_few).max()  # what holds: a few roundings
        assert not torch.equal(out, ref_out) or num_blocks == 0  # it really is another spelling
    if num_blocks == 0:
        # one source: weight exactly 1, the mix is the prefix itself
        expected = new_prefix if out_norm is None else out_norm(new_prefix)
        assert torch.equal(out, expected)
        assert torch.equal(out, ref_out)
    elif precision == "fp32" and out_norm is None:
        # fp32 path vs fp32 spec: the same real number up to fp32 noise, rounded once to
        # bf16 each: equal, or (at a rounding boundary) one bf16 ulp apart.
        assert ((out.double() - ref_out.double()).abs() <= _bf16_ulp(ref_out)).all()
