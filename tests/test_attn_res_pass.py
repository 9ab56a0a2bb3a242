"""The AttnRes graph pass (``patterns/attn_res.py`` via ``K3FusionPass``) on one-site modules.

Graphs come from :class:`graph_utils.CaptureBackend`: Inductor's real passes up to and
including post-grad (our pass runs as ``post_grad_custom_post_pass``), then the post-grad
graph runs eagerly, so a compile costs well under a second.

Each module below is one AttnRes site written as module code writes it (:class:`Site`):
an optional ``prefix + delta`` add, an optional tensor-bank block write, the sources (a
list bank ``stack``ed, or a tensor bank ``cat([bank[..., :n, :], prefix[..., None, :]])``),
the key RMSNorm, ``Linear(H, 1)``, a float softmax over the sources, the mix, and an
optional output RMSNorm. Every fused site is checked three ways:

* graph: exact ``match_counts()["attn_res"]``, no softmax over the sources (amax / exp /
  the key rsqrt) left, and the ``attn_res`` node's num_blocks / delta / output-norm
  arguments;
* wiring, bit for bit: the compiled outputs (under whatever CPU path the op takes here --
  the Triton kernel in its interpreter on a CPU-only box) equal one direct call of
  ``torch.ops.k3fusion.attn_res`` with the arguments the site means, and the updated prefix
  and the bank after a block write are exactly the spec's;
* semantics: with the op's plain-torch CPU path (the spec, rounding to nearest), the
  outputs equal eager within the rounding bound :func:`mix_bound` derives; the updated
  prefix (returned, and read by later code) and the bank after a block write bit for bit.

Near misses must leave the graph untouched (0 matches) and the debug log must say why.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import k3fusion
from k3fusion.kernels._launch import interpreter_enabled

from _kernel_paths import cpu_path
from graph_utils import (CaptureBackend, compile_capture, count_op, fresh_state,  # noqa: F401
                         graph_code, nodes_of)

pytestmark = [pytest.mark.usefixtures("fresh_state")]

aten = torch.ops.aten
ATTN_RES = torch.ops.k3fusion.attn_res.default
OP = torch.ops.k3fusion.attn_res
#: What a softmax over the sources leaves in a post-grad graph (and the key norm's rsqrt).
SOFTMAX_OPS = (aten.amax.default, aten.exp.default, aten.rsqrt.default)

H = 32
LEAD = (2, 3)  # [batch, seq]: 6 tokens
KEY_EPS, OUT_EPS = 1e-6, 1e-5  # distinct, so a swapped eps shows in the node's arguments
#: Source scales (cycled over the blocks), so the softmax mixes unlike magnitudes.
SCALES = (0.3, 2.0, 1.0, 4.0, 0.7)


# ----------------------------------------------------------------------------- the modules


def rms_hf(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: upcast, normalize, cast back, then weight (cast-then-weight)."""
    dt = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return w * x32.to(dt)


@dataclass(frozen=True)
class Form:
    """One site's form. ``n``: completed blocks read (sources = n + 1)."""

    bank: str  # "list" (a Python list of [B, S, H] blocks) | "tensor" ([B, S, NB, H])
    n: int
    max_blocks: int | None = None  # tensor bank slots (default n)
    write: int = -1  # tensor bank: ``bank[..., write, :] = prefix`` before the sources
    delta: bool = False  # ``prefix = prefix + delta`` before everything
    out_norm: bool = False  # RMSNorm of the mix
    precision: str = "model"  # "model": keys, logits, mix in the model dtype; "fp32"
    dtype: torch.dtype = torch.bfloat16

    @property
    def slots(self) -> int:
        return self.n if self.max_blocks is None else self.max_blocks

    def __str__(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        s = f"{self.bank}-n{self.n}"
        if self.bank == "tensor":
            s += f"of{self.slots}" + (f"-write{self.write}" if self.write >= 0 else "")
        return s + ("-delta" if self.delta else "") + ("-outnorm" if self.out_norm else "") + \
            f"-{self.precision}-{dt}"


class Site(nn.Module):
    """One AttnRes site as module code writes it; ``variant`` makes a near miss.

    forward(prefix, bank, delta) -> (out, prefix, prefix * 2 [, leaked intermediate]):
    the updated prefix is returned and read by later code (the ``* 2``, exact).
    """

    VARIANTS = ("", "softmax_dim", "no_key_norm", "bias", "gemma", "leak_logits",
                "leak_weights", "broadcast_delta", "stack_dim", "stack_moved", "double_upcast",
                "row_padded")

    def __init__(self, form: Form, variant: str = "", seed: int = 0) -> None:
        super().__init__()
        assert variant in self.VARIANTS, variant
        self.f, self.variant = form, variant
        g = torch.Generator().manual_seed(seed)
        self.key_w = nn.Parameter(1 + 0.1 * torch.randn(H, generator=g))
        self.proj = nn.Linear(H, 1, bias=variant == "bias")
        with torch.no_grad():
            # |key| ~ sqrt(H): std 1.5 / sqrt(H) gives logits of std ~1.5 across sources
            self.proj.weight.copy_(1.5 * torch.randn(1, H, generator=g) / math.sqrt(H))
            if variant == "bias":
                self.proj.bias.fill_(0.25)
        self.out_w = nn.Parameter(1 + 0.1 * torch.randn(H, generator=g)) if form.out_norm else None
        if variant == "broadcast_delta":
            self.bias = nn.Parameter(0.5 * torch.randn(H, generator=g))
        self.to(form.dtype)

    @property
    def src_dim(self) -> int:
        return -3 if self.variant == "stack_dim" else -2

    def sources(self, prefix: torch.Tensor, bank) -> torch.Tensor:
        n = self.f.n
        if self.f.bank == "list":
            if self.variant == "stack_moved":  # stacked along dim 0, then moved to -2
                return torch.stack(bank[:n] + [prefix], dim=0).movedim(0, -2)
            return torch.stack(bank[:n] + [prefix], dim=self.src_dim)
        return torch.cat([bank[..., :n, :], prefix.unsqueeze(-2)], dim=-2)

    def keys(self, src: torch.Tensor) -> torch.Tensor:
        """``src``: the sources, already upcast for an "fp32" module."""
        if self.variant == "no_key_norm":
            return src
        if self.variant == "gemma":  # Gemma's (1 + w): a different function
            s32 = src.float()
            normed = s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + KEY_EPS)
            return (normed * (1.0 + self.key_w.float())).to(src.dtype)
        if self.f.precision == "fp32":
            return rms_hf(src, self.key_w.float(), KEY_EPS)
        return rms_hf(src, self.key_w, KEY_EPS)

    def upcast(self, src: torch.Tensor) -> torch.Tensor:
        """An "fp32" module upcasts the sources once (as ``KimiK3AttnRes`` does)."""
        return src.float() if self.f.precision == "fp32" else src

    def logits(self, src: torch.Tensor) -> torch.Tensor:
        if self.variant == "row_padded":
            # The Linear(H, 1) as Inductor's pad_mm may rewrite it (by a timing): rows
            # padded to a multiple of 8, the GEMM, the padded rows sliced off.
            keys = self.keys(src)
            flat = keys.reshape(-1, H)
            pad = 8 - flat.shape[0] % 8
            w = self.proj.weight.float() if self.f.precision == "fp32" else self.proj.weight
            out = (F.pad(flat, (0, 0, 0, pad)) @ w.T)[:-pad].view(*keys.shape[:-1], 1)
            return out.squeeze(-1).float()
        if self.f.precision == "fp32":
            bias = None if self.proj.bias is None else self.proj.bias.float()
            return F.linear(self.keys(src), self.proj.weight.float(), bias).squeeze(-1)
        return self.proj(self.keys(src)).squeeze(-1).float()

    def softmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Softmax over the sources, in fp32 (``[..., S]``)."""
        return logits.softmax(-2 if self.variant == "softmax_dim" else self.src_dim + 1)

    def weights(self, src: torch.Tensor) -> torch.Tensor:
        return self.softmax(self.logits(src))

    def mix(self, src: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """-> the mix in the model dtype; ``src`` as :meth:`upcast` gives."""
        d = self.src_dim
        if self.f.precision == "fp32":
            if self.variant == "double_upcast":  # handed the model-dtype sources: .float() again
                src = src.float()
            return (w.unsqueeze(-1) * src).sum(d).to(self.f.dtype)
        return (w.to(src.dtype).unsqueeze(-1) * src).sum(d)

    def forward(self, prefix, bank, delta=None):
        if self.variant == "broadcast_delta":
            prefix = prefix + self.bias  # [H]: broadcast, not the kernel's delta
        elif delta is not None:
            prefix = prefix + delta
        if self.f.write >= 0:
            bank[..., self.f.write, :] = prefix
        sources = self.sources(prefix, bank)
        src = self.upcast(sources)
        logits = self.logits(src)
        w = self.softmax(logits)
        out = self.mix(sources if self.variant == "double_upcast" else src, w)
        if self.out_w is not None:
            out = rms_hf(out, self.out_w, OUT_EPS)
        extra = ()
        if self.variant == "leak_logits":
            extra = (logits,)
        elif self.variant == "leak_weights":
            extra = (w,)
        return (out, prefix, prefix * 2) + extra


@dataclass
class Inputs:
    prefix: torch.Tensor
    bank: list[torch.Tensor] | torch.Tensor
    delta: torch.Tensor | None

    def clone(self) -> "Inputs":
        bank = [b.clone() for b in self.bank] if isinstance(self.bank, list) else self.bank.clone()
        return Inputs(self.prefix.clone(), bank, None if self.delta is None else self.delta.clone())

    def args(self):
        return self.prefix, self.bank, self.delta


def make_inputs(f: Form, seed: int = 1) -> Inputs:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randn(*LEAD, H, generator=g).to(f.dtype)
    delta = (0.5 * torch.randn(*LEAD, H, generator=g)).to(f.dtype) if f.delta else None
    blocks = [(SCALES[k % len(SCALES)] * torch.randn(*LEAD, H, generator=g)).to(f.dtype)
              for k in range(f.slots)]
    if f.bank == "list":
        return Inputs(prefix, blocks, delta)
    # Slots the site does not read hold NaN: proves the fused op never reads past n.
    bank = torch.full((*LEAD, f.slots, H), float("nan"), dtype=f.dtype)
    for k in range(f.n):
        bank[..., k, :] = blocks[k]
    return Inputs(prefix, bank, delta)


# ----------------------------------------------------------------------------- helpers


def attn_res_count() -> int:
    return k3fusion.match_counts().get("attn_res", 0)


@contextlib.contextmanager
def spec_path():
    """Run ``k3fusion::attn_res`` on its plain-torch CPU path (``k3fusion.reference``, which
    rounds to nearest like eager) instead of the Triton interpreter: the op reads
    ``TRITON_INTERPRET`` at call time."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET", raising=False)
        yield


def node_args(node) -> dict:
    """The attn_res node's arguments by schema name (defaults filled in)."""
    schema = node.target._schema.arguments
    args = {a.name: a.default_value if a.has_default_value() else None for a in schema}
    args.update(zip([a.name for a in schema], node.args))
    args.update(node.kwargs)
    return args


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    assert torch.equal(bits(actual), bits(expected)), \
        f"{what}: {int((bits(actual) != bits(expected)).sum())} elements differ"


def round_to(x32: torch.Tensor, dtype: torch.dtype, *, truncate: bool) -> torch.Tensor:
    """fp32 -> dtype as the op rounds: to nearest even, or (bf16 in Triton's interpreter)
    toward zero."""
    if truncate and dtype == torch.bfloat16:
        return (x32.contiguous().view(torch.int32) & ~0xFFFF).view(torch.float32).to(dtype)
    return x32.to(dtype)


def ulp(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of ``dtype`` at |v| (float64), floored at the smallest normal's."""
    mant = {torch.float32: 23, torch.bfloat16: 7}[dtype]
    _, e = torch.frexp(v.double().abs())
    return torch.pow(2.0, ((e - 1).clamp_min(-126) - mant).double())


# ----------------------------------------------------------------------------- the tolerance

U32 = 2.0**-24  # unit roundoff of fp32


def unit_roundoff(dtype: torch.dtype) -> float:
    return {torch.float32: U32, torch.bfloat16: 2.0**-8}[dtype]


def mix_bound(m: Site, src: torch.Tensor, w_eager: torch.Tensor) -> torch.Tensor:
    """Per-element bound (float64) on |mix_compiled - mix_eager| for the same sources.

    Let v_s be the (bf16 or fp32) sources, w*_s the exact softmax weights of the exact
    logits ``rsqrt(mean(v_s**2) + eps) * sum(v_s * g * p)``, m* = sum_s w*_s v_s the exact
    mix and A = sum_s w*_s |v_s| (the mix's absolute size; m* may cancel, A does not).
    u is the unit roundoff of the model dtype (2**-8 bf16, 2**-24 fp32). To first order:

    * eager, its weights: a "model" module rounds each key element twice (the normalized
      value, then the weight product) and the logit once to the model dtype, then takes an
      fp32 softmax; an "fp32" module only has fp32 noise. Whatever that error is, its
      effect on the mix is at most ``sum_s |w_eager,s - w*_s| |v_s|`` -- *measured* here
      from the module's own softmax output rather than bounded (a worst-case bound on the
      rounded logits, 3u sum_i |k_i p_i| per logit, is ~25u A at H=32: far looser than the
      few u A that happen, see tests/test_model_attn_res.py);
    * eager, its mix: a "model" module rounds the weights to the model dtype and each
      product w_s v_s (u relative each: 2u A; an fp32 mix rounds its products in fp32:
      2 * 2**-24 A), accumulates the sum in fp32 and rounds it once (u |m*|);
    * the op (spec and kernel): keys, logits, softmax and mix in fp32, then one rounding
      of the mix: half an ulp to nearest (the spec, the GPU), < 1 ulp toward zero (bf16 in
      Triton's interpreter): ``ulp(m*)`` either way;
    * fp32 evaluation order, both sides (as ``tests/test_attn_res_kernel.mix_atol``): a
      logit's fp32 error is ~u32 * A_s (A_s = rsqrt_s * sum|v_s g p|), moving weights by
      <= 6 u32 max_s A_s relatively; the sums add (2 S + 4) u32 A.

    A wrong source, weight or block count moves the mix by a sizeable fraction of A; this
    bound is a few u A.
    """
    f = m.f
    v = src.detach().double()
    g = m.key_w.detach().double() * m.proj.weight.detach().double()[0]
    inv_rms = torch.rsqrt(v.pow(2).mean(-1) + KEY_EPS)
    w_true = torch.softmax(inv_rms * (v * g).sum(-1), dim=-1)
    a_s = inv_rms * (v * g).abs().sum(-1)
    mix = (w_true.unsqueeze(-1) * v).sum(-2)
    a = (w_true.unsqueeze(-1) * v.abs()).sum(-2)
    n_src = v.shape[-2]
    u = unit_roundoff(f.dtype)
    u_mix = U32 if f.precision == "fp32" else u
    eager_weights = ((w_eager.double() - w_true).abs().unsqueeze(-1) * v.abs()).sum(-2)
    eager_mix = 2 * u_mix * a + u * mix.abs()
    op_rounding = ulp(mix, f.dtype) if f.dtype != torch.float32 else U32 * mix.abs()
    fp32_order = U32 * a * (6 * a_s.amax(-1, keepdim=True) + 2 * n_src + 4)
    return eager_weights + eager_mix + op_rounding + fp32_order


def out_bound(m: Site, mix_eager: torch.Tensor, e_mix: torch.Tensor,
              truncate: bool) -> torch.Tensor:
    """Per-element bound on |out_compiled - out_eager| where out = rms_norm(mix, g_o).

    o_i = g_i m_i / rms(m): an error e in the mix moves o_i by at most
    ``|g_i| / rms(m) * (e_i + |m_i| rms(e) / rms(m))`` (first order; the second term is the
    rms's change, by Cauchy-Schwarz). Then each side's norm rounds twice (the normalized
    value, then the weight product; cast-then-weight): 2u |o| to nearest, < 2 * 2u |o|
    toward zero (the interpreter), plus a few fp32 ulps (mean, rsqrt).
    """
    x = mix_eager.double()
    go = m.out_w.detach().double()
    rms = (x.pow(2).mean(-1, keepdim=True) + OUT_EPS).sqrt()
    out = go * x / rms
    rms_e = e_mix.pow(2).mean(-1, keepdim=True).sqrt()
    u = unit_roundoff(m.f.dtype) if m.f.dtype != torch.float32 else 0.0
    own = (2 * u + (4 * u if truncate else 2 * u) + 8 * U32) * out.abs()
    return go.abs() / rms * (e_mix + x.abs() * rms_e / rms) + own


def assert_within(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor,
                  what: str) -> None:
    """|actual - expected| <= 1.1 * bound (10%: the bounds are first order)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    err = (actual.double() - expected.double()).abs()
    ratio = err / (1.1 * bound).clamp_min(1e-300)
    worst = float(ratio.max())
    assert worst <= 1.0, (f"{what}: |compiled - eager| exceeds the rounding bound by {worst:.2f}x "
                          f"(max |diff| {float(err.max()):.3e})")


# ----------------------------------------------------------------------------- running


def run_site(m: Site, x: Inputs):
    """Eager and compiled runs on separate copies -> (eager out, eager inputs after,
    compiled out, compiled inputs after, compiled callable, backend)."""
    xe, xc = x.clone(), x.clone()
    with torch.no_grad():
        expected = m(*xe.args())
    torch._dynamo.reset()
    be = CaptureBackend()
    compiled = torch.compile(m, backend=be, dynamic=False, fullgraph=True)
    with torch.no_grad():
        out = compiled(*xc.args())
    return expected, xe, out, xc, compiled, be


def attn_res_node(be: CaptureBackend):
    (node,) = nodes_of(be.graph_after, ATTN_RES)
    assert count_op(be.graph_final, ATTN_RES) == 1  # survives the rest of post-grad
    return node


def assert_no_source_softmax(graph, rsqrt: int = 0) -> None:
    """No amax / exp left, and no rsqrt but ``rsqrt`` unfolded norms of the mix."""
    left = {str(t): count_op(graph, t) for t in SOFTMAX_OPS}
    assert left == {"aten.amax.default": 0, "aten.exp.default": 0, "aten.rsqrt.default": rsqrt}, \
        f"softmax over the sources (or its key norm) left in the graph: {left}"


def assert_untouched(be: CaptureBackend) -> None:
    assert attn_res_count() == 0
    assert count_op(be.graph_after, ATTN_RES) == 0
    assert graph_code(be.graph_after) == graph_code(be.graph_before)


def check_fused_site(m: Site, x: Inputs, *, fold_delta: bool | None = None) -> dict:
    """Everything a fused site must satisfy (see the module docstring) -> the node's args."""
    f = m.f
    fold_delta = f.delta if fold_delta is None else fold_delta
    expected, xe, out, xc, compiled, be = run_site(m, x)

    # -- graph
    assert attn_res_count() == 1
    assert count_op(be.graph_before, aten.amax.default) == 1
    node = attn_res_node(be)
    a = node_args(node)
    out_norm_folded = a["out_norm_w"] is not None  # must equal f.out_norm: checked last
    assert_no_source_softmax(be.graph_after, rsqrt=int(f.out_norm and not out_norm_folded))
    assert a["num_blocks"] == f.n
    assert a["eps"] == KEY_EPS and a["eps_tensor"] is None
    assert a["norm_w"].op == "placeholder"
    assert a["proj_w"].target == aten.view.default and a["proj_w"].args[0].op == "placeholder"
    if fold_delta:
        assert a["delta"] is not None and a["delta"].op == "placeholder"
        assert a["prefix"].op == "placeholder"
        assert len(node.users) == 2  # [out, new prefix]
    else:
        assert a["delta"] is None
    if out_norm_folded:
        assert a["out_norm_w"].op == "placeholder" and a["out_eps"] == OUT_EPS
        assert a["out_weight_in_fp32"] == (f.dtype == torch.float32)  # fp32: no casts
    if f.bank == "tensor" and f.n:  # read in place, no copy of the bank
        assert a["blocks"].op == "placeholder" or a["blocks"].target == aten.select_scatter.default

    # -- wiring, bit for bit, on the path the op takes here
    truncate = interpreter_enabled()
    if m.variant == "broadcast_delta":
        prefix_in, delta = x.prefix + m.bias.detach(), None  # what the graph's own add gives
    elif f.delta and not fold_delta:  # the graph's own add (rounds to nearest), then the op
        prefix_in = round_to(x.prefix.float() + x.delta.float(), f.dtype, truncate=False)
        delta = None
    else:
        prefix_in, delta = x.prefix, (x.delta if fold_delta else None)
    new_prefix = prefix_in if delta is None else \
        round_to(prefix_in.float() + delta.float(), f.dtype, truncate=truncate)
    if f.bank == "list":
        blocks = torch.stack(x.bank[:f.n], -2) if f.n else prefix_in.unsqueeze(-2)
    else:
        # slots < n as the site reads them: a write at an index >= n leaves them alone
        blocks = xe.bank if 0 <= f.write < f.n else x.bank
    with torch.no_grad():
        want = OP(prefix_in, blocks, f.n, m.key_w, m.proj.weight.view(H), KEY_EPS, delta,
                  m.out_w if out_norm_folded else None, OUT_EPS, a["out_weight_in_fp32"])
        want_out = want[0] if out_norm_folded or not f.out_norm else \
            rms_hf(want[0], m.out_w, OUT_EPS)  # the graph's own aten norm, run eagerly
    assert_bits_equal(out[0], want_out, "out vs the op called directly")
    if fold_delta:
        assert_bits_equal(want[1], new_prefix, "the op's new prefix vs the spec's rounding")
    assert_bits_equal(out[1], new_prefix, "returned prefix")
    assert_bits_equal(out[2], new_prefix * 2, "prefix read by later code")
    check_bank(f, x, xc, new_prefix)

    # -- semantics: vs eager, with the op on its spec path (rounds to nearest, like eager)
    xs = x.clone()
    with spec_path(), torch.no_grad():
        out_s = compiled(*xs.args())  # the same compiled graph (the op reads the env per call)
    assert be.compiles == 1
    for k in (1, 2):  # the rounded prefix (step 1) is an exact bf16/fp32 add: bit-exact
        assert_bits_equal(out_s[k], expected[k], f"prefix output {k} vs eager")
    if f.bank == "tensor":
        assert torch.equal(xs.bank.nan_to_num(7.0), xe.bank.nan_to_num(7.0)), "bank vs eager"
    src = m.upcast(m.sources(expected[1], xe.bank))
    with torch.no_grad():
        w_eager = m.weights(src)
        mix_eager = m.mix(src, w_eager)
    e_mix = mix_bound(m, src, w_eager)
    if f.out_norm:
        with torch.no_grad():
            assert torch.equal(rms_hf(mix_eager, m.out_w, OUT_EPS), expected[0])
        bound = out_bound(m, mix_eager, e_mix, truncate=False)
    else:
        assert torch.equal(mix_eager, expected[0])
        bound = e_mix
    assert_within(out_s[0], expected[0], bound, "out (spec path) vs eager")
    # ... and the kernel's output on this box, against the same bound with its rounding
    # (not when the interpreter truncated a folded prefix update: the last source differs)
    if not (truncate and fold_delta and f.dtype == torch.bfloat16):
        bound_k = out_bound(m, mix_eager, e_mix, truncate=truncate) if f.out_norm else e_mix
        assert_within(out[0], expected[0], bound_k, "out (op path) vs eager")
    if f.n == 0:  # one source: weight exactly 1, the mix is the prefix on every side
        assert_bits_equal(out_s[0], expected[0], "one source: out vs eager")
    assert out_norm_folded == f.out_norm, "the output RMSNorm was not folded into the site"
    return a


def check_bank(f: Form, x: Inputs, xc: Inputs, new_prefix: torch.Tensor) -> None:
    """The compiled run's bank: a list is never touched; a tensor bank has the written slot
    equal to the (rounded) new prefix and every other slot as it was (NaNs included)."""
    if f.bank == "list":
        for b0, b1 in zip(x.bank, xc.bank):
            assert_bits_equal(b1, b0, "list bank block")
        return
    expect = x.bank.clone()
    if f.write >= 0:
        expect[..., f.write, :] = new_prefix
    assert_bits_equal(xc.bank, expect, "tensor bank after the site")


# ----------------------------------------------------------------------------- fusion

BF16, FP32 = torch.bfloat16, torch.float32

FUSED = [
    # list bank: stack(blocks + [prefix], -2)
    Form("list", 0),
    Form("list", 1, delta=True, out_norm=True),
    Form("list", 2, delta=True, precision="fp32"),
    Form("list", 5, out_norm=True, dtype=FP32),
    Form("list", 16, delta=True, out_norm=True),
    Form("list", 2, out_norm=True, precision="fp32", dtype=FP32),
    # tensor bank: cat([bank[..., :n, :], prefix[..., None, :]], -2)
    Form("tensor", 0, max_blocks=1, out_norm=True),
    Form("tensor", 1, max_blocks=3, delta=True),
    Form("tensor", 2, out_norm=True, dtype=FP32),  # n == max_blocks: the whole bank
    Form("tensor", 16, delta=True, out_norm=True, precision="fp32"),  # whole bank, 16
    # block write before the site: an append (index >= n) ...
    Form("tensor", 0, max_blocks=2, write=0, delta=True, out_norm=True),
    Form("tensor", 2, max_blocks=4, write=2, delta=True, out_norm=True),
    Form("tensor", 5, max_blocks=8, write=6, precision="fp32", dtype=FP32),
    # ... or into a slot the site reads (the written version is the source), whole bank
    Form("tensor", 5, write=4, out_norm=True, precision="fp32"),
    Form("tensor", 2, max_blocks=3, write=1, dtype=FP32),
]


@pytest.mark.slow
@pytest.mark.parametrize("form", FUSED, ids=str)
def test_site_fused(form):
    m = Site(form)
    check_fused_site(m, make_inputs(form))


@pytest.mark.parametrize("form", [Form("list", 3, delta=True, out_norm=True),
                                  Form("tensor", 2, max_blocks=3, write=2, precision="fp32")],
                         ids=str)
def test_site_fused_through_a_row_padded_projection(form):
    """Inductor's pad_mm may pad the rows of the keys' Linear(H, 1) GEMM, depending on a
    benchmark: the site still fuses, and the pad, GEMM and slice go with it."""
    m = Site(form, "row_padded")
    check_fused_site(m, make_inputs(form))
    k3fusion.reset_match_counts()
    be = run_site(m, make_inputs(form))[-1]
    pad = aten.constant_pad_nd.default
    assert count_op(be.graph_before, pad) == 1 and count_op(be.graph_before, aten.mm.default) == 1
    assert count_op(be.graph_after, pad) == 0 and count_op(be.graph_after, aten.mm.default) == 0


def test_broadcast_prefix_add_is_not_the_delta():
    # prefix + bias[H] broadcasts: not the kernel's delta (same shape required). The site
    # still fuses, on the sum as its prefix; the add stays a graph op.
    form = Form("tensor", 2, max_blocks=3, out_norm=True)
    a = check_fused_site(Site(form, "broadcast_delta"), make_inputs(form), fold_delta=False)
    add = a["prefix"]
    assert add.target == aten.add.Tensor and a["delta"] is None
    assert {tuple(x.meta["val"].shape) for x in add.args} == {(H,), (*LEAD, H)}


def test_fp32_mix_with_its_own_upcast_fused():
    # ``src.float()`` written twice (keys and mix): the same value, not CSE'd post-grad.
    form = Form("tensor", 2, max_blocks=3, delta=True, precision="fp32")
    check_fused_site(Site(form, "double_upcast"), make_inputs(form))


# ----------------------------------------------------------------------------- near misses


@pytest.fixture
def debug_log(caplog):
    """debug=True and the k3fusion log captured; the config is re-read afterwards."""
    k3fusion.set_config(debug=True)
    caplog.set_level(logging.INFO, logger="k3fusion")
    try:
        yield caplog
    finally:
        k3fusion.set_config(None)


def not_fused_reasons(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "k3fusion" and r.getMessage().startswith("AttnRes site not fused")]


#: variant -> (form, why the debug log says it was not fused)
NEAR_MISSES = {
    # softmax over the token dim, not the sources
    "softmax_dim": (Form("tensor", 2, max_blocks=3, delta=True, out_norm=True),
                    r"not summed over the source dim"),
    # logits straight from the sources: no key RMSNorm
    "no_key_norm": (Form("list", 2, out_norm=True), r"keys are not a weighted norm"),
    # Linear(H, 1) with a bias (addmm). The constant shift would cancel in the softmax, but
    # the pass does no algebra: a form it does not know is refused, never guessed at
    "bias": (Form("list", 2, delta=True), r"projection"),
    # Gemma's (1 + w) key norm weight
    "gemma": (Form("tensor", 2, max_blocks=2), r"computed in the graph"),
    # the logits (an intermediate) also returned
    "leak_logits": (Form("list", 2, delta=True, out_norm=True), r"also read by output"),
    # the softmax weights also returned
    "leak_weights": (Form("tensor", 2, max_blocks=3, out_norm=True), r"div\S* has 2 users"),
}


@pytest.mark.parametrize("variant", list(NEAR_MISSES))
def test_near_miss_untouched_and_logged(variant, debug_log):
    form, why = NEAR_MISSES[variant]
    m = Site(form, variant)
    x = make_inputs(form)
    expected, xe, out, xc, _, be = run_site(m, x)
    assert_untouched(be)
    assert count_op(be.graph_after, aten.amax.default) == 1  # the softmax is still there
    reasons = not_fused_reasons(debug_log)
    assert len(reasons) == 1 and re.search(why, reasons[0]), reasons
    # untouched: the post-grad graph computes what eager does (up to Inductor's own
    # decompositions, e.g. of softmax: fp32 noise then at most one rounding)
    assert len(out) == len(expected)
    for a, b in zip(out, expected):
        torch.testing.assert_close(a, b)
    if form.bank == "tensor":
        assert torch.equal(xc.bank.nan_to_num(7.0), xe.bank.nan_to_num(7.0))


def test_sources_on_another_dim_fused():
    # Sources stacked along dim -3 (softmax and mix over it): the same op on another
    # layout (issue 15: the source dim is read from the softmax, not assumed).
    form = Form("list", 2, delta=True)
    expected, _, out, _, _, be = run_site(Site(form, "stack_dim"), make_inputs(form))
    assert attn_res_count() == 1
    assert count_op(be.graph_after, aten.amax.default) == 0
    for a, b in zip(out, expected):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("form", [Form("list", 2, out_norm=True), Form("list", 3, delta=True)],
                         ids=["out_norm", "delta"])
def test_sources_stacked_then_moved_fused(form):
    # torch.stack(blocks + [prefix]).movedim(0, -2): the stack's source dim moved to the
    # softmax's (the keys made contiguous first, a clone): the items are the op's sources.
    # A miss until 2026-12-02.
    expected, _, out, _, _, be = run_site(Site(form, "stack_moved"), make_inputs(form))
    assert attn_res_count() == 1
    assert count_op(be.graph_after, aten.amax.default) == 0
    for a, b in zip(out, expected):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


def test_block_write_into_a_source_slot_with_delta_fused_without_the_fold():
    # bank[..., 4, :] = prefix + delta, then all 5 slots and the prefix are the sources: the
    # written bank depends on the add, so folding it would make the op read its own output
    # (a cycle). The site fuses with the add left in the graph (it was refused before).
    form = Form("tensor", 5, write=4, delta=True, out_norm=True)
    check_fused_site(Site(form), make_inputs(form), fold_delta=False)


def test_disabled_by_config(debug_log):
    k3fusion.set_config(attn_res=False, debug=True)
    form = Form("list", 2, delta=True, out_norm=True)
    expected, _, out, _, _, be = run_site(Site(form), make_inputs(form))
    assert k3fusion.match_counts()["attn_res"] == 0
    assert_untouched(be)
    assert not not_fused_reasons(debug_log)  # nothing tried, nothing to explain
    for a, b in zip(out, expected):
        torch.testing.assert_close(a, b)


def test_debug_off_logs_no_reasons(caplog):
    caplog.set_level(logging.INFO, logger="k3fusion")
    form, _ = NEAR_MISSES["gemma"]
    _, _, _, _, _, be = run_site(Site(form, "gemma"), make_inputs(form))
    assert_untouched(be)
    assert not not_fused_reasons(caplog)
    assert any("attn_res 0 matches" in r.getMessage() for r in caplog.records)


# ----------------------------------------------------------------------------- more shapes


def test_two_sites_share_one_block_stack():
    # The model's pattern within a layer: site 1 on (blocks, prefix); later code adds its
    # (here: doubled) output to the prefix; site 2 on (blocks, prefix + that) -- the add
    # folds into site 2 as its delta, and both sites read one stack of the blocks.
    form = Form("list", 1, out_norm=True)

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Site(form, seed=0), Site(form, seed=1)

        def forward(self, prefix, bank):
            out1, _, _ = self.a(prefix, bank)
            out2, prefix2, _ = self.b(prefix, bank, out1 * 2)
            return out1, out2, prefix2

    m = Two()
    x = make_inputs(form)
    with torch.no_grad():
        expected = m(x.prefix, x.bank)
    out, be = compile_capture(m, x.prefix, x.bank)
    assert attn_res_count() == 2
    assert_no_source_softmax(be.graph_after)
    nodes = nodes_of(be.graph_after, ATTN_RES)
    a1, a2 = (node_args(n) for n in nodes)
    assert a1["blocks"] is a2["blocks"] and a1["blocks"].target == aten.cat.default
    assert count_op(be.graph_after, aten.cat.default) == 1
    assert a1["delta"] is None and a2["delta"] is not None and a2["prefix"] is a1["prefix"]
    assert (a1["num_blocks"], a2["num_blocks"]) == (1, 1)
    # site 2's delta is site 1's output, doubled: the graph reads the op's first result
    assert a2["delta"].target == aten.mul.Tensor
    assert a2["delta"].args[0].args[0] is nodes[0]
    # wiring, bit for bit, on the op's path here
    blocks = torch.stack(x.bank, -2)
    with torch.no_grad():
        w1 = OP(x.prefix, blocks, 1, m.a.key_w, m.a.proj.weight.view(H), KEY_EPS, None,
                m.a.out_w, OUT_EPS)[0]
        w2, p2 = OP(x.prefix, blocks, 1, m.b.key_w, m.b.proj.weight.view(H), KEY_EPS, w1 * 2,
                    m.b.out_w, OUT_EPS)
    for got, want, what in zip(out, (w1, w2, p2), ("out1", "out2", "prefix2")):
        assert_bits_equal(got, want, what)
    # and eager, loosely (site 2 reads site 1's output: errors compound; the per-site
    # bounds are checked in test_site_fused)
    for got, want in zip(out, expected):
        torch.testing.assert_close(got, want, rtol=2**-5, atol=2**-5 * float(want.abs().max()))


def test_rounding_bound_rejects_a_wrong_site():
    # The bound of mix_bound is a few roundings: a site computed with a wrong block count,
    # key weight, query sign or eps is far outside it (the right one is inside).
    form = Form("tensor", 5, max_blocks=6)
    m = Site(form)
    x = make_inputs(form)
    with torch.no_grad():
        expected = m(x.prefix, x.bank.clone())[0]
        src = m.sources(x.prefix, x.bank)
        w_eager = m.weights(src)
    bound = mix_bound(m, src, w_eager)
    kw, pw = m.key_w.detach(), m.proj.weight.detach().view(H)

    def site(n=5, key_w=kw, proj_w=pw, eps=KEY_EPS):
        with spec_path(), torch.no_grad():
            return OP(x.prefix, x.bank, n, key_w, proj_w, eps)[0]

    assert_within(site(), expected, bound, "the right site")
    wrong = {"one block fewer": site(n=4), "unit key weight": site(key_w=torch.ones_like(kw)),
             "negated query": site(proj_w=-pw), "eps 0.1": site(eps=0.1)}
    for what, out in wrong.items():
        with pytest.raises(AssertionError, match="exceeds the rounding bound"):
            assert_within(out, expected, bound, what)


@pytest.mark.slow
def test_tiny_model_dynamic_square_ids_every_site_fused(debug_log):
    # ids [2, 2] under dynamic=True: batch and seq share one symbol (duck sizing), and
    # Inductor reads that size off an intermediate of the first site's chain
    # (``sym_size(view, 1)``). Only a size is read there, no value: the site should fuse.
    from k3fusion.models import KimiK3Config, KimiK3ForCausalLM

    cfg = KimiK3Config.tiny(num_layers=1, attn_res=True, attn_res_bank="tensor",
                            attn_res_block_size=1)
    model = KimiK3ForCausalLM(cfg, seed=0).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 2), generator=torch.Generator().manual_seed(0))
    compile_capture(model, ids, dynamic=True)
    reasons = [r for r in not_fused_reasons(debug_log) if "squeezed projection" not in r]
    assert attn_res_count() == model.attn_res_sites, reasons


class _DroppedRoundTrip(nn.Module):
    """A site whose ``mixed.to(bf16)`` before the next norm's upcast Inductor dropped as a
    round trip (torch 2.11 does, on CPU and CUDA): the fp32 mix feeds the norm, whose
    normalized row is cast to bf16 (``x_round``). Written here in that dropped form."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.key_w = nn.Parameter((1 + 0.1 * torch.randn(H, generator=g)).bfloat16())
        self.proj = nn.Linear(H, 1, bias=False).bfloat16()
        with torch.no_grad():  # not the global RNG's init: the same values in any test order
            self.proj.weight.copy_(torch.randn(1, H, generator=g) / H**0.5)
        self.out_w = nn.Parameter((1 + 0.1 * torch.randn(H, generator=g)).bfloat16())

    def forward(self, b0, b1, prefix):
        rows = torch.stack([b0, b1, prefix], -2)
        rf = rows.float()
        keys = (rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + KEY_EPS)).to(rows.dtype)
        p = torch.softmax(self.proj(keys * self.key_w).squeeze(-1).float(), -1)
        mix32 = (p.unsqueeze(-1) * rf).sum(-2)
        normed = mix32 * torch.rsqrt(mix32.pow(2).mean(-1, keepdim=True) + OUT_EPS)
        return normed.to(torch.bfloat16) * self.out_w


def test_fp32_mix_whose_round_trip_was_dropped_folds_its_output_norm():
    """The site fuses with the output norm folded (before issue 27: 'has 2 users'), and
    equals the graph within one bf16 rounding of the mix (the op rounds it first, as the
    module before Inductor's drop did). The op on its plain-torch CPU path, which rounds
    to nearest as the GPU kernels do (the interpreter's casts truncate: up to three more
    ulps, which a clean-clone run once drew)."""
    m = _DroppedRoundTrip()
    g = torch.Generator().manual_seed(1)
    args = tuple(torch.randn(2, 3, H, generator=g).bfloat16() for _ in range(3))
    with torch.no_grad():
        expected = m(*args)
    with cpu_path("reference"):
        out, be = compile_capture(m, *args)
    assert attn_res_count() == 1
    a = node_args(attn_res_node(be))
    assert a["out_norm_w"] is not None and a["num_blocks"] == 2
    assert count_op(be.graph_after, aten.rsqrt.default) == 0
    torch.testing.assert_close(out, expected, rtol=2 ** -7, atol=2 ** -7 * expected.abs().max().item())


class _FoldedQueryFp32Mix(nn.Module):
    """KartikVashishta/attention-residuals' ``DepthResidual``: the key-norm weight folded
    into the query in the model dtype, then ``.float()``; unweighted fp32 keys; an einsum
    mix over ``sources.float()`` cast back."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.query = nn.Parameter(torch.randn(16, generator=g) / 4)
        self.norm_w = nn.Parameter(1 + 0.2 * torch.randn(16, generator=g))

    def forward(self, *sources):
        s = torch.stack(sources, dim=0)
        q = (self.query * self.norm_w).float()
        x = s.float()
        keys = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-8)
        w = torch.einsum("d, n b t d -> n b t", q, keys).softmax(dim=0)
        return torch.einsum("n b t, n b t d -> b t d", w, s.float()).to(s.dtype)


@pytest.mark.usefixtures("fresh_state")
@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp32_einsum_mix_cast_back_at_one_token(tokens, dtype):
    """At T = 1 the einsum's view-back of an fp32 mix passes through several views with the
    mix's layout (size-1 dims); the cast back reads the last, and the site fuses (before
    2026-12-05 the first was taken and the mix looked left in fp32: a miss at decode)."""
    model = _FoldedQueryFp32Mix().to(dtype)
    g = torch.Generator().manual_seed(tokens)
    sources = [torch.randn(2, tokens, 16, generator=g).to(dtype) for _ in range(3)]
    with torch.no_grad():
        expected = model(*sources)
    out, be = compile_capture(model, *sources)
    assert count_op(be.graph_after, ATTN_RES) == 1
    bound = dict(atol=3e-2, rtol=3e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.float(), expected.float(), **bound)


class _TransposedLinearLogits(nn.Module):
    """transformers' ``KimiK3AttentionResidual``: an fp32 ``[T, N, H]`` stack
    ``cat((bank, h.view(-1, 1, H).float()), 1)``, the key norm on the whole stack,
    ``Linear(H, 1)`` -> ``[T, N, 1]``, ``scores.transpose(1, 2).softmax(-1)`` (``[T, 1, N]``:
    the projection's unit dim moved in front of the sources), ``matmul(probs, stack)``,
    ``squeeze(1)``, cast back. ``near_miss``: the logits permuted so that the softmax runs
    over the tokens (``"reordered"``: ``[1, N, T]``; ``"in_order"``: ``[1, T, N]``, softmax
    over dim 1)."""

    def __init__(self, near_miss: str | None = None) -> None:
        super().__init__()
        self.pseudo_queries = nn.Linear(H, 1, bias=False)
        self.norm_weight = nn.Parameter(1 + 0.3 * torch.randn(H, generator=torch.Generator().manual_seed(3)))
        self.near_miss = near_miss

    def forward(self, hidden_states, block_residual):
        b, s, h = hidden_states.shape
        dtype = hidden_states.dtype
        kv = torch.cat((block_residual, hidden_states.view(-1, 1, h).float()), dim=1)
        x = kv.to(torch.float32)  # an HF RMSNorm of the fp32 stack (its weight fp32 too)
        keys = self.norm_weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + KEY_EPS)).to(kv.dtype)
        scores = self.pseudo_queries(keys)  # fp32 (kept so in any model dtype)
        if self.near_miss == "reordered":  # [1, N, T]: a softmax over the tokens
            probs = scores.permute(2, 1, 0).softmax(-1)
            return torch.matmul(probs, kv.transpose(0, 1)).squeeze(0).to(dtype)
        if self.near_miss == "in_order":  # [1, T, N]: the unit dim moved, softmax over T
            probs = scores.permute(2, 0, 1).softmax(1)
            return (probs.squeeze(0).unsqueeze(-1) * kv).sum(0).to(dtype)
        probs = scores.transpose(1, 2).softmax(-1)
        return torch.matmul(probs, kv).squeeze(1).to(dtype).view(b, s, h)


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_linear_logits_transposed_before_the_softmax_fused(tokens, dtype):
    """``Linear(H, 1)(keys).transpose(1, 2).softmax(-1)`` and ``matmul(probs, sources)``
    (transformers' Kimi K3): the transpose moves only the projection's unit dim, so the
    logits are the keys' leading dims and the softmax is over the sources. A miss until
    2026-12-06 ("logits are not a squeezed projection")."""
    model = _TransposedLinearLogits()
    g = torch.Generator().manual_seed(tokens)
    hidden = torch.randn(2, tokens, H, generator=g).to(dtype)
    bank = (torch.randn(2 * tokens, 3, H, generator=g) * 2).float()
    with torch.no_grad():
        expected = model(hidden, bank)
    out, be = compile_capture(model, hidden, bank)
    assert attn_res_count() == 1
    (node,) = nodes_of(be.graph_after, ATTN_RES)
    assert count_op(be.graph_after, aten.amax.default) == 0
    bound = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.float(), expected.float(), **bound)


@pytest.mark.parametrize("near_miss", ["reordered", "in_order"])
def test_linear_logits_permuted_to_a_softmax_over_the_tokens_refused(near_miss, debug_log):
    model = _TransposedLinearLogits(near_miss=near_miss)
    g = torch.Generator().manual_seed(0)
    hidden, bank = torch.randn(2, 3, H, generator=g), torch.randn(6, 3, H, generator=g)
    with torch.no_grad():
        expected = model(hidden, bank)
    out, be = compile_capture(model, hidden, bank)
    assert attn_res_count() == 0
    assert count_op(be.graph_after, ATTN_RES) == 0
    torch.testing.assert_close(out, expected)
