"""``torch.ops.k3fusion.attn_res_`` (in place, the spec) and ``torch.ops.k3fusion.attn_res``
(functional): both CPU paths, the fake impls, argument checks.

The CPU implementations run the Triton kernel (in Triton's interpreter) when
``TRITON_INTERPRET=1`` at call time, else ``k3fusion.reference``. On a CUDA machine the
kernel-path tests run on the GPU instead. Kernel results are checked stage by stage as in
``test_attn_res_kernel`` (whose helpers and tolerances this module reuses).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from _kernel_paths import cpu_path, spy_on_launcher
from k3fusion import reference
from test_attn_res_kernel import Case, bits, check_mix_and_norm, expected_new_prefix

op_ = torch.ops.k3fusion.attn_res_
op = torch.ops.k3fusion.attn_res
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = KERNEL_DEVICE == "cpu"  # fp32 -> bf16 casts truncate in the interpreter

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS_DECOY = 0.25  # not one of the generated eps values


def launcher_calls():
    """Record calls of the launcher the ops import (``k3fusion.kernels.attn_res``)."""
    return spy_on_launcher("attn_res", "block_write_idx")


# --------------------------------------------------------------- generated inputs

#: Prefix layouts: "contiguous"; "padded" (rows of a wider tensor: mergeable leading
#: dims, row stride H + pad); "transposed" (the first two leading dims swapped: the rows
#: cannot be viewed as [T, H] without a copy).
PREFIXES = ("contiguous", "padded", "transposed")
#: Bank layouts: "rows" ([..., NBmax, H + pad]); "stacked" (blocks stacked along dim 0,
#: then moved next to H: token stride H, block stride T * H); "transposed" (leading dims
#: swapped: no [T, NBmax, H] view).
BANKS = ("rows", "stacked", "transposed")


@dataclass(frozen=True)
class OpCase:
    lead: tuple[int, ...]
    H: int
    nb_max: int
    num_blocks: int
    write_idx: int
    dtype: torch.dtype
    has_delta: bool
    out_norm: str            # "none", "cast", "fp32w"
    w_fp32: bool
    prefix_layout: str
    bank: str
    eps: float
    out_eps: float
    log2_scale: int
    eps_tensor: bool = False  # functional op: eps/out_eps as 0-dim CPU tensors, decoy floats

    @property
    def T(self) -> int:
        return math.prod(self.lead)

    @property
    def w_dtype(self) -> torch.dtype:
        return torch.float32 if self.w_fp32 else self.dtype

    @property
    def kernel_case(self) -> Case:
        """The same case as ``test_attn_res_kernel`` describes it (for its checks)."""
        return Case(T=self.T, H=self.H, nb_max=self.nb_max, num_blocks=self.num_blocks,
                    write_idx=self.write_idx, dtype=self.dtype, has_delta=self.has_delta,
                    out_norm=self.out_norm, w_fp32=self.w_fp32, bank="rows", pad=0,
                    inplace=True, eps=self.eps, out_eps=self.out_eps,
                    log2_scale=self.log2_scale)

    @property
    def out_dtype(self) -> torch.dtype:
        return self.kernel_case.out_dtype

    @property
    def swapped(self) -> bool:
        """The "transposed" layouts need two leading dims."""
        return len(self.lead) >= 2

    def prefix_view(self, parent: torch.Tensor) -> torch.Tensor:
        if self.prefix_layout == "transposed" and self.swapped:
            return parent.transpose(0, 1)
        return parent[..., : self.H]

    def bank_view(self, parent: torch.Tensor) -> torch.Tensor:
        if self.bank == "stacked":
            return parent.movedim(0, -2)
        if self.bank == "transposed" and self.swapped:
            return parent.transpose(0, 1)
        return parent[..., : self.H]

    def make(self, seed: int, device: str):
        """``(prefix_parent, bank_parent, delta, norm_w, proj_w, out_norm_w)``, generated on
        ``device`` (meta: on the CPU, then moved). Bank slots >= num_blocks and padding
        columns hold NaN."""
        gen_device = "cpu" if device == "meta" else device
        gen = torch.Generator(device=gen_device).manual_seed(seed)
        scale = 2.0**self.log2_scale
        lead, H = self.lead, self.H
        swap = (lead[1], lead[0], *lead[2:]) if self.swapped else lead

        def randn(*shape):
            return torch.randn(*shape, generator=gen, device=gen_device).mul_(scale)

        def rand(n):
            return torch.rand(n, generator=gen, device=gen_device)

        def full(shape):
            return torch.full(shape, float("nan"), device=gen_device, dtype=self.dtype)

        if self.prefix_layout == "padded":
            pshape = (*lead, H + 8)
        elif self.prefix_layout == "transposed":
            pshape = (*swap, H)
        else:
            pshape = (*lead, H)
        prefix_parent = full(pshape)
        self.prefix_view(prefix_parent)[...] = randn(*lead, H)
        if self.bank == "stacked":
            bshape = (self.nb_max, *lead, H)
        elif self.bank == "transposed":
            bshape = (*swap, self.nb_max, H)
        else:
            bshape = (*lead, self.nb_max, H + 3)
        bank_parent = full(bshape)
        self.bank_view(bank_parent)[..., : self.num_blocks, :] = randn(*lead, self.num_blocks, H)
        delta = randn(*lead, H).to(self.dtype) if self.has_delta else None
        norm_w = (rand(H) * 2).to(self.w_dtype)
        proj_w = (randn(H) / scale / max(H, 1) ** 0.5 * 4).to(self.w_dtype)
        out_norm_w = None if self.out_norm == "none" else (rand(H) * 4 - 2).to(self.w_dtype)
        tensors = (prefix_parent, bank_parent, delta, norm_w, proj_w, out_norm_w)
        return tuple(None if t is None else t.to(device) for t in tensors)

    def kwargs(self) -> dict:
        return dict(out_eps=self.out_eps, out_weight_in_fp32=self.out_norm == "fp32w")


def rows(t: torch.Tensor, H: int) -> torch.Tensor:
    """``[T, H]`` (explicit T: ``-1`` is ambiguous for empty tensors)."""
    return t.reshape(math.prod(t.shape[:-1]), H)


def block_rows(t: torch.Tensor, H: int) -> torch.Tensor:
    return t.reshape(math.prod(t.shape[:-2]), t.shape[-2], H)


def check_out_meta(c: OpCase, out: torch.Tensor, prefix: torch.Tensor) -> None:
    assert out.shape == prefix.shape, f"out shape {tuple(out.shape)} != {tuple(prefix.shape)}"
    assert out.dtype == c.out_dtype, f"out dtype {out.dtype} != {c.out_dtype}"
    assert out.device == prefix.device
    assert out.is_contiguous(), f"out strides {out.stride()}: the fake impl says contiguous"


def run_inplace(c: OpCase, seed: int, device: str, path: str):
    """Call ``attn_res_``; check the in-place effects exactly. Returns what the checks of
    the mix need: ``(new_prefix rows, blocks rows, weights, out, before)``."""
    pp, bp, delta, nw, pw, ow = c.make(seed, device)
    prefix, blocks = c.prefix_view(pp), c.bank_view(bp)
    before = (pp.clone(), bp.clone(), None if delta is None else delta.clone())
    with cpu_path(path), launcher_calls() as calls:
        out = op_(prefix, blocks, c.num_blocks, nw, pw, c.eps, delta, c.write_idx, ow,
                  **c.kwargs())
    assert calls == ([c.write_idx] if path == "kernel" else []), calls
    check_out_meta(c, out, prefix)
    if delta is not None:
        assert torch.equal(bits(delta), bits(before[2])), "delta was modified"
    # prefix: updated (rounded as the path rounds) where the view is, untouched elsewhere.
    expect_pp = before[0].clone()
    c.prefix_view(expect_pp)[...] = expected_new_prefix(
        c.prefix_view(before[0]), delta,
        bf16_casts_truncate=INTERPRETED and path == "kernel")
    assert torch.equal(bits(pp), bits(expect_pp)), f"{c}: prefix (or its padding) wrong"
    # bank: only the write slot, to the new prefix.
    expect_bp = before[1].clone()
    if c.write_idx >= 0:
        c.bank_view(expect_bp)[..., c.write_idx, :] = prefix
    assert torch.equal(bits(bp), bits(expect_bp)), f"{c}: bank differs beyond the write slot"
    return rows(prefix, c.H), block_rows(blocks, c.H), (nw, pw, ow), out, before


def run_functional(c: OpCase, seed: int, device: str, path: str):
    pp, bp, delta, nw, pw, ow = c.make(seed, device)
    prefix, blocks = c.prefix_view(pp), c.bank_view(bp)
    saved = [t.clone() for t in (pp, bp, delta, nw, pw, ow) if t is not None]
    eps, out_eps = c.eps, c.out_eps
    eps_t = out_eps_t = None
    if c.eps_tensor:
        eps, out_eps = EPS_DECOY, EPS_DECOY
        eps_t = torch.tensor(c.eps, dtype=torch.float64)
        out_eps_t = torch.tensor(c.out_eps)
    with cpu_path(path), launcher_calls() as calls:
        res = op(prefix, blocks, c.num_blocks, nw, pw, eps, delta, ow, out_eps,
                 c.out_norm == "fp32w", eps_t, out_eps_t)
    assert calls == ([-1] if path == "kernel" else []), calls
    after = [t for t in (pp, bp, delta, nw, pw, ow) if t is not None]
    for before, now in zip(saved, after):
        assert torch.equal(bits(before), bits(now)), f"{c}: the functional op mutated an input"
    assert isinstance(res, list) and len(res) == (2 if c.has_delta else 1)
    out = res[0]
    check_out_meta(c, out, prefix)
    new_prefix = prefix
    if c.has_delta:
        new_prefix = res[1]
        assert (new_prefix.shape, new_prefix.dtype) == (prefix.shape, prefix.dtype)
        assert new_prefix.is_contiguous()
        assert torch.equal(bits(new_prefix), bits(expected_new_prefix(
            prefix, delta, bf16_casts_truncate=INTERPRETED and path == "kernel")))
    return rows(new_prefix, c.H), block_rows(blocks, c.H), (nw, pw, ow), out


LEAD = st.one_of(
    st.tuples(st.one_of(st.sampled_from([0, 1, 2, 5]), st.integers(0, 12))),
    st.tuples(st.integers(0, 4), st.integers(0, 4)),
    st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 2)),
)
WIDTHS = st.one_of(st.sampled_from([1, 3, 64, 100, 129]), st.integers(1, 160))


@st.composite
def op_cases(draw, inplace: bool) -> OpCase:
    nb_max = draw(st.integers(0, 9))
    num_blocks = draw(st.integers(0, nb_max))
    write_idx = -1
    if inplace and num_blocks < nb_max:
        write_idx = draw(st.one_of(st.just(-1), st.integers(num_blocks, nb_max - 1)))
    has_delta = draw(st.booleans())
    prefix_layout = draw(st.sampled_from(PREFIXES))
    bank = draw(st.sampled_from(BANKS))
    if inplace and has_delta and prefix_layout == "transposed":
        prefix_layout = "padded"  # written: must be viewable (tested separately)
    if inplace and write_idx >= 0 and bank == "transposed":
        bank = "stacked"
    return OpCase(
        lead=draw(LEAD), H=draw(WIDTHS), nb_max=nb_max, num_blocks=num_blocks,
        write_idx=write_idx, dtype=draw(st.sampled_from(DTYPES)), has_delta=has_delta,
        out_norm=draw(st.sampled_from(["none", "cast", "fp32w"])), w_fp32=draw(st.booleans()),
        prefix_layout=prefix_layout, bank=bank, eps=draw(st.sampled_from([1e-6, 1e-5, 0.1])),
        out_eps=draw(st.sampled_from([1e-6, 1e-3])), log2_scale=draw(st.sampled_from([-6, 0, 6])),
        eps_tensor=False if inplace else draw(st.booleans()),
    )


# The Kimi-K3 decode step scaled down: [batch 2, 3 tokens], 8 blocks + the prefix, delta,
# append into slot 8 of a stacked bank, output norm.
_K3 = OpCase(lead=(2, 3), H=96, nb_max=9, num_blocks=8, write_idx=8, dtype=torch.bfloat16,
             has_delta=True, out_norm="cast", w_fp32=False, prefix_layout="contiguous",
             bank="stacked", eps=1e-6, out_eps=1e-6, log2_scale=0)
_K3_F = replace(_K3, write_idx=-1, eps_tensor=True)


# --------------------------------------------------------------- the in-place op


@given(c=op_cases(inplace=True), seed=st.integers(0, 2**31 - 1))
@example(c=_K3, seed=0)
@example(c=replace(_K3, lead=(0,), dtype=torch.float16), seed=1)
@example(c=replace(_K3, num_blocks=0, write_idx=0, out_norm="fp32w", prefix_layout="padded",
                   bank="rows", lead=(7,), H=129), seed=2)
@example(c=replace(_K3, has_delta=False, write_idx=-1, prefix_layout="transposed",
                   bank="transposed", w_fp32=True, dtype=torch.float32, lead=(3, 2, 2)), seed=3)
def test_inplace_kernel_path(c: OpCase, seed: int) -> None:
    new_prefix, blocks, (nw, pw, ow), out, _ = run_inplace(c, seed, KERNEL_DEVICE, "kernel")
    check_mix_and_norm(c.kernel_case, new_prefix, blocks, nw, pw, rows(out, c.H), ow,
                       bf16_casts_truncate=INTERPRETED, device=KERNEL_DEVICE, msg=str(c))


@given(c=op_cases(inplace=True), seed=st.integers(0, 2**31 - 1))
@example(c=_K3, seed=0)
def test_inplace_reference_path_is_bit_exact(c: OpCase, seed: int) -> None:
    _, _, (nw, pw, ow), out, (pp, bp, delta) = run_inplace(c, seed, "cpu", "reference")
    # The spec on row views of copies of the inputs.
    prefix2 = rows(c.prefix_view(pp), c.H).clone()
    blocks2 = block_rows(c.bank_view(bp), c.H).clone()
    expected = reference.attn_res(prefix2, blocks2, c.num_blocks, nw, pw, c.eps,
                                  None if delta is None else rows(delta, c.H), c.write_idx, ow,
                                  **c.kwargs())
    assert torch.equal(bits(out.reshape(-1, c.H)), bits(expected)), f"{c}: out differs"


# --------------------------------------------------------------- the functional op


@given(c=op_cases(inplace=False), seed=st.integers(0, 2**31 - 1))
@example(c=_K3_F, seed=0)
@example(c=replace(_K3_F, prefix_layout="transposed", bank="transposed", lead=(3, 2)), seed=1)
@example(c=replace(_K3_F, lead=(2, 0, 3), has_delta=False), seed=2)
def test_functional_kernel_path(c: OpCase, seed: int) -> None:
    new_prefix, blocks, (nw, pw, ow), out = run_functional(c, seed, KERNEL_DEVICE, "kernel")
    check_mix_and_norm(c.kernel_case, new_prefix, blocks, nw, pw, rows(out, c.H), ow,
                       bf16_casts_truncate=INTERPRETED, device=KERNEL_DEVICE, msg=str(c))


@given(c=op_cases(inplace=False), seed=st.integers(0, 2**31 - 1))
@example(c=_K3_F, seed=0)
def test_functional_reference_path_is_bit_exact(c: OpCase, seed: int) -> None:
    new_prefix, blocks, (nw, pw, ow), out = run_functional(c, seed, "cpu", "reference")
    expected = reference.attn_res(new_prefix.clone(), blocks.clone(), c.num_blocks, nw, pw, c.eps,
                                  None, -1, ow, **c.kwargs())
    assert torch.equal(bits(rows(out, c.H)), bits(expected)), f"{c}: out differs"


@pytest.mark.parametrize("path", ["kernel", "reference"])
@pytest.mark.parametrize("has_delta", [False, True])
def test_functional_and_inplace_agree(path: str, has_delta: bool) -> None:
    """Same inputs: the functional op's out and new prefix are bit for bit what the
    in-place op returns and leaves in ``prefix`` (one kernel, one reference)."""
    c = replace(_K3, has_delta=has_delta)
    device = KERNEL_DEVICE if path == "kernel" else "cpu"
    pp, bp, delta, nw, pw, ow = c.make(5, device)
    prefix, blocks = c.prefix_view(pp), c.bank_view(bp)
    with cpu_path(path):
        res = op(prefix, blocks, c.num_blocks, nw, pw, c.eps, delta, ow, c.out_eps)
        out = op_(prefix, blocks, c.num_blocks, nw, pw, c.eps, delta, c.write_idx, ow, c.out_eps)
    assert torch.equal(bits(res[0]), bits(out))
    if has_delta:
        assert torch.equal(bits(res[1]), bits(prefix))


# --------------------------------------------------------------- layouts that need a copy


@pytest.mark.parametrize("path", ["kernel", "reference"])
def test_inplace_refuses_writes_through_a_copy(path: str) -> None:
    """A tensor the in-place op writes must be viewable as rows; else the write would land
    in a copy. ValueError naming it, before any launch; reads may go through a copy."""
    device = KERNEL_DEVICE if path == "kernel" else "cpu"
    c = replace(_K3, prefix_layout="transposed")
    with cpu_path(path), launcher_calls() as calls:
        pp, bp, delta, nw, pw, ow = c.make(0, device)
        with pytest.raises(ValueError, match=r"\bprefix\b.*without a copy"):
            op_(c.prefix_view(pp), c.bank_view(bp), 8, nw, pw, 1e-6, delta, 8, ow)
        c = replace(_K3, bank="transposed")
        pp, bp, delta, nw, pw, ow = c.make(0, device)
        with pytest.raises(ValueError, match=r"\bblocks\b.*without a copy"):
            op_(c.prefix_view(pp), c.bank_view(bp), 8, nw, pw, 1e-6, delta, 8, ow)
        assert calls == []
    # Read only: fine (prefix without delta, bank without a write).
    c = replace(_K3, prefix_layout="transposed", bank="transposed", has_delta=False, write_idx=-1)
    new_prefix, blocks, (nw, pw, ow), out, _ = run_inplace(c, 1, device, path)
    check_mix_and_norm(c.kernel_case, new_prefix, blocks, nw, pw, rows(out, c.H), ow,
                       bf16_casts_truncate=INTERPRETED and path == "kernel", device=device,
                       msg=str(c))


@pytest.mark.parametrize("path", ["kernel", "reference"])
@pytest.mark.parametrize("lead", [(0,), (2, 0, 3), (0, 4)], ids=["0", "2x0x3", "0x4"])
def test_zero_tokens(path: str, lead: tuple) -> None:
    device = KERNEL_DEVICE if path == "kernel" else "cpu"
    c = replace(_K3, lead=lead, w_fp32=True)  # bf16 with fp32 weights: fp32 out
    run_inplace(c, 0, device, path)
    run_functional(replace(c, write_idx=-1), 0, device, path)


# --------------------------------------------------------------- fake impls, opcheck


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("w_fp32", [False, True])
@pytest.mark.parametrize("out_norm", ["none", "cast", "fp32w"])
def test_fake_impl_shapes_and_dtypes(dtype, w_fp32, out_norm) -> None:
    c = replace(_K3, dtype=dtype, w_fp32=w_fp32, out_norm=out_norm, lead=(2, 3))
    pp, bp, delta, nw, pw, ow = c.make(0, "meta")
    prefix, blocks = c.prefix_view(pp), c.bank_view(bp)
    out = op_(prefix, blocks, 8, nw, pw, 1e-6, delta, 8, ow, 1e-6, out_norm == "fp32w")
    assert (out.shape, out.dtype, out.device.type) == (prefix.shape, c.out_dtype, "meta")
    assert out.is_contiguous()
    res = op(prefix, blocks, 8, nw, pw, 1e-6, delta, ow, 1e-6, out_norm == "fp32w")
    assert [(r.shape, r.dtype) for r in res] == [(prefix.shape, c.out_dtype),
                                                 (prefix.shape, dtype)]
    assert len(op(prefix, blocks, 8, nw, pw, 1e-6, None, ow)) == 1
    # The reference on meta tensors agrees on the output dtype.
    ref = reference.attn_res(rows(prefix, 96), block_rows(blocks, 96), 8, nw, pw, 1e-6, None,
                             -1, ow, 1e-6, out_norm == "fp32w")
    assert ref.dtype == c.out_dtype


def _opcheck_args(c: OpCase, inplace: bool, device: str = "cpu"):
    pp, bp, delta, nw, pw, ow = c.make(0, device)
    prefix, blocks = c.prefix_view(pp).clone(), c.bank_view(bp)
    # opcheck compares runs: no NaN poison (NaN != NaN), zeros in the unused slots.
    blocks = torch.nan_to_num(blocks, nan=0.0)
    if inplace:
        return (prefix, blocks, c.num_blocks, nw, pw, c.eps, delta, c.write_idx, ow, c.out_eps,
                c.out_norm == "fp32w")
    eps_t = torch.tensor(c.eps, dtype=torch.float64) if c.eps_tensor else None
    return (prefix, blocks, c.num_blocks, nw, pw, EPS_DECOY if c.eps_tensor else c.eps, delta,
            ow, c.out_eps, c.out_norm == "fp32w", eps_t, None)


_OPCHECK = [
    ("k3", _K3),
    ("fp16-no-delta-fp32w", replace(_K3, dtype=torch.float16, has_delta=False, out_norm="fp32w",
                                    lead=(4,), bank="rows")),
    ("fp32-zero-blocks-no-norm", replace(_K3, dtype=torch.float32, num_blocks=0, write_idx=2,
                                         nb_max=3, out_norm="none", lead=(3,))),
    ("zero-tokens", replace(_K3, lead=(0, 2))),
]


@pytest.mark.parametrize("case", [c for _, c in _OPCHECK], ids=[i for i, _ in _OPCHECK])
def test_opcheck(case: OpCase) -> None:
    with cpu_path("reference"):
        torch.library.opcheck(op_.default, _opcheck_args(case, True))
        torch.library.opcheck(op.default, _opcheck_args(replace(case, write_idx=-1,
                                                                eps_tensor=True), False))


def test_opcheck_kernel_path() -> None:
    with cpu_path("kernel"):
        c = replace(_K3, lead=(3,))
        torch.library.opcheck(op_.default, _opcheck_args(c, True, KERNEL_DEVICE))
        torch.library.opcheck(op.default, _opcheck_args(replace(c, write_idx=-1), False,
                                                        KERNEL_DEVICE))


def test_traces_under_compile_with_dynamic_shapes() -> None:
    """The fake impls under torch.compile(dynamic=True) (aot_eager: fake tensors and
    functionalization, no codegen), the in-place op included; two token counts."""
    def step(prefix, bank, delta, nw, pw, ow):
        out = torch.ops.k3fusion.attn_res_(prefix, bank, 2, nw, pw, 1e-6, delta, 2, ow)
        out2, new_prefix = torch.ops.k3fusion.attn_res(prefix, bank, 3, nw, pw, 1e-6, delta, ow)
        return out + out2, new_prefix

    compiled = torch.compile(step, backend="aot_eager", dynamic=True, fullgraph=True)
    for T in (3, 5):
        c = replace(_K3, lead=(T,), nb_max=4, num_blocks=2, write_idx=2, bank="rows")
        pp, bp, delta, nw, pw, ow = c.make(T, "cpu")
        bank = torch.nan_to_num(c.bank_view(bp), nan=0.0)
        args = (c.prefix_view(pp).contiguous(), bank, delta, nw, pw, ow)
        eager_args = tuple(a.clone() for a in args)
        with cpu_path("reference"):
            got = compiled(*args)
            want = step(*eager_args)
        for g, w in zip(got, want):
            assert torch.equal(g, w)
        assert torch.equal(args[0], eager_args[0]) and torch.equal(args[1], eager_args[1])


# --------------------------------------------------------------- bad inputs


def _args(device: str = "cpu", fn: str = "inplace", **over):
    T, NB, H = 3, 4, 16
    args = dict(
        prefix=torch.randn(T, H, device=device, dtype=torch.bfloat16),
        blocks=torch.randn(T, NB, H, device=device, dtype=torch.bfloat16),
        num_blocks=2, norm_w=torch.ones(H, device=device), proj_w=torch.ones(H, device=device),
        eps=1e-6, delta=torch.randn(T, H, device=device, dtype=torch.bfloat16),
        out_norm_w=torch.ones(H, device=device, dtype=torch.bfloat16), out_eps=1e-6,
    )
    if fn == "inplace":
        args["block_write_idx"] = 2
    args.update(over)
    return args


def _bf16(*shape, device):
    return torch.randn(*shape, device=device, dtype=torch.bfloat16)


# (id, builder(device, fn) -> kwargs, exception, message pattern); every message names the
# offending argument. Cases for both ops unless the id says "inplace".
BAD = [
    ("prefix-0d", lambda d, f: _args(d, f, prefix=torch.tensor(1.0, device=d)), ValueError,
     r"\bprefix\b"),
    ("prefix-float64", lambda d, f: _args(d, f, prefix=torch.randn(3, 16, device=d,
                                                                   dtype=torch.float64)),
     TypeError, r"\bprefix\b.*float64"),
    ("prefix-last-dim-strided", lambda d, f: _args(d, f, prefix=_bf16(3, 32, device=d)[:, ::2]),
     ValueError, r"\bprefix\b.*stride"),
    ("norm_w-size", lambda d, f: _args(d, f, norm_w=torch.ones(15, device=d)), ValueError,
     r"\bnorm_w\b.*15"),
    ("proj_w-2d", lambda d, f: _args(d, f, proj_w=torch.ones(1, 16, device=d)), ValueError,
     r"\bproj_w\b.*1-D"),
    ("proj_w-int", lambda d, f: _args(d, f, proj_w=torch.ones(16, device=d, dtype=torch.int32)),
     TypeError, r"\bproj_w\b"),
    ("out_norm_w-size", lambda d, f: _args(d, f, out_norm_w=torch.ones(17, device=d)),
     ValueError, r"\bout_norm_w\b"),
    ("out_norm_w-float64", lambda d, f: _args(d, f, out_norm_w=torch.ones(
        16, device=d, dtype=torch.float64)), TypeError, r"\bout_norm_w\b"),
    ("norm_w-strided", lambda d, f: _args(d, f, norm_w=torch.ones(32, device=d)[::2]),
     ValueError, r"\bnorm_w\b"),
    ("blocks-width", lambda d, f: _args(d, f, blocks=_bf16(3, 4, 8, device=d)), ValueError,
     r"\bblocks\b.*8 wide"),
    ("blocks-dims", lambda d, f: _args(d, f, blocks=_bf16(3, 16, device=d)), ValueError,
     r"\bblocks\b"),
    ("blocks-leading", lambda d, f: _args(d, f, blocks=_bf16(4, 4, 16, device=d)), ValueError,
     r"\bblocks\b leading dims"),
    ("blocks-dtype", lambda d, f: _args(d, f, blocks=torch.randn(3, 4, 16, device=d)),
     TypeError, r"\bblocks\b.*dtype"),
    ("blocks-last-dim-strided",
     lambda d, f: _args(d, f, blocks=_bf16(3, 4, 32, device=d)[..., ::2]),
     ValueError, r"\bblocks\b.*stride"),
    ("delta-dtype", lambda d, f: _args(d, f, delta=torch.randn(3, 16, device=d,
                                                               dtype=torch.float16)),
     TypeError, r"\bdelta\b.*dtype"),
    ("delta-shape", lambda d, f: _args(d, f, delta=_bf16(1, 16, device=d)), ValueError,
     r"\bdelta\b.*shape"),
    ("delta-width", lambda d, f: _args(d, f, delta=_bf16(3, 8, device=d)), ValueError,
     r"\bdelta\b"),
    ("delta-last-dim-strided", lambda d, f: _args(d, f, delta=_bf16(16, 3, device=d).t()),
     ValueError, r"\bdelta\b.*stride"),
    ("num_blocks-negative", lambda d, f: _args(d, f, num_blocks=-1), ValueError,
     r"\bnum_blocks\b"),
    ("num_blocks-above-NBmax", lambda d, f: _args(d, f, num_blocks=5, **(
        {"block_write_idx": -1} if f == "inplace" else {})), ValueError, r"\bnum_blocks\b.*5"),
    ("eps-negative", lambda d, f: _args(d, f, eps=-1e-6), ValueError, r"\beps\b"),
    ("eps-nan", lambda d, f: _args(d, f, eps=math.nan), ValueError, r"\beps\b"),
    ("out_eps-inf", lambda d, f: _args(d, f, out_eps=math.inf), ValueError, r"\bout_eps\b"),
    ("out_eps-negative-no-norm", lambda d, f: _args(d, f, out_eps=-1.0, out_norm_w=None),
     ValueError, r"\bout_eps\b"),
    ("inplace-write-live-source", lambda d, f: _args(d, f, block_write_idx=1), ValueError,
     r"\bblock_write_idx\b 1 would overwrite a live source"),
    ("inplace-write-first-live-source", lambda d, f: _args(d, f, block_write_idx=0), ValueError,
     r"\bblock_write_idx\b.*live source"),
    ("inplace-write-past-NBmax", lambda d, f: _args(d, f, block_write_idx=4), ValueError,
     r"\bblock_write_idx\b.*\[2, 4\)"),
    ("inplace-write-negative", lambda d, f: _args(d, f, block_write_idx=-2), ValueError,
     r"\bblock_write_idx\b"),
    ("inplace-prefix-overlapping",
     lambda d, f: _args(d, f, prefix=_bf16(1, 16, device=d).expand(3, 16)),
     ValueError, r"\bprefix\b rows overlap"),
    ("inplace-blocks-overlapping",
     lambda d, f: _args(d, f, blocks=_bf16(1, 4, 16, device=d).expand(3, 4, 16)),
     ValueError, r"\bblocks\b rows overlap"),
    ("inplace-prefix-not-viewable", lambda d, f: _args(
        d, f, prefix=_bf16(3, 1, 16, device=d).expand(3, 2, 16).transpose(0, 1),
        blocks=_bf16(2, 3, 4, 16, device=d), delta=_bf16(2, 3, 16, device=d)),
     ValueError, r"\bprefix\b.*without a copy"),
]
BAD_FUNCTIONAL = [
    ("eps_tensor-1d", lambda d, f: _args(d, f, eps_tensor=torch.tensor([1e-6])), ValueError,
     r"\beps_tensor\b.*0-dim"),
    ("out_eps_tensor-int", lambda d, f: _args(d, f, out_eps_tensor=torch.tensor(0)), ValueError,
     r"\bout_eps_tensor\b.*floating"),
]
# Device mismatches (CPU tensors against meta ones): CPU only.
BAD_DEVICE = [
    ("norm_w-device", lambda d, f: _args(d, f, norm_w=torch.ones(16, device="meta")),
     ValueError, r"\bnorm_w\b.*meta"),
    ("blocks-device", lambda d, f: _args(d, f, blocks=_bf16(3, 4, 16, device="meta")),
     ValueError, r"\bblocks\b.*meta"),
    ("delta-device", lambda d, f: _args(d, f, delta=_bf16(3, 16, device="meta")),
     ValueError, r"\bdelta\b.*meta"),
    ("out_norm_w-device", lambda d, f: _args(d, f, out_norm_w=torch.ones(16, device="meta")),
     ValueError, r"\bout_norm_w\b.*meta"),
]


def _cases(fn: str, cases):
    out = []
    for cid, build, exc, pattern in cases:
        if cid.startswith("inplace") and fn != "inplace":
            continue
        out.append(pytest.param(fn, build, exc, pattern, id=f"{fn}-{cid}"))
    return out


ALL_BAD = (_cases("inplace", BAD + BAD_DEVICE) + _cases("functional", BAD + BAD_DEVICE)
           + _cases("functional", BAD_FUNCTIONAL))


@pytest.mark.parametrize("path", ["kernel", "reference"])
@pytest.mark.parametrize("fn, build, exc, pattern", ALL_BAD)
def test_bad_inputs_raise_before_launch(fn, build, exc, pattern, path: str) -> None:
    device = KERNEL_DEVICE if path == "kernel" else "cpu"
    kwargs = build(device, fn)
    saved = {k: v.clone() for k, v in kwargs.items()
             if isinstance(v, torch.Tensor) and v.device.type != "meta"}
    with cpu_path(path), launcher_calls() as calls:
        with pytest.raises(exc, match=pattern):
            (op_ if fn == "inplace" else op)(**kwargs)
    assert calls == [], "the kernel was launched with bad arguments"
    for k, v in saved.items():
        assert torch.equal(bits(v), bits(kwargs[k])), f"{k} modified by a rejected call"


@pytest.mark.parametrize("fn, build, exc, pattern",
                         _cases("inplace", BAD) + _cases("functional", BAD + BAD_FUNCTIONAL))
def test_bad_inputs_rejected_by_fake_impl(fn, build, exc, pattern) -> None:
    """What torch.compile traces with: the fake impls validate the same way."""
    with pytest.raises(exc, match=pattern):
        (op_ if fn == "inplace" else op)(**build("meta", fn))


@pytest.mark.parametrize("path", ["kernel", "reference"])
@pytest.mark.parametrize("name", ["eps_tensor", "out_eps_tensor"])
@pytest.mark.parametrize("value", [-1e-6, math.nan], ids=["negative", "nan"])
def test_bad_eps_tensor_value_rejected(path: str, name: str, value: float) -> None:
    device = KERNEL_DEVICE if path == "kernel" else "cpu"
    with cpu_path(path), launcher_calls() as calls:
        with pytest.raises(ValueError, match=rf"\b{name}\b"):
            op(**_args(device, "functional", **{name: torch.tensor(value)}))
    assert calls == []


def test_int_arguments_are_checked_by_the_schema() -> None:
    """A non-int num_blocks / block_write_idx is rejected by the dispatcher's schema check
    (a RuntimeError from torch, before k3fusion's check); the message names the argument."""
    for name, value in (("num_blocks", 2.0), ("block_write_idx", "2")):
        with pytest.raises(RuntimeError, match=rf"argument '{name}'"):
            op_(**_args(**{name: value}))


# --------------------------------------------------------------- real sizes, GPU only


@pytest.mark.cuda
class TestAttnResOpCuda:
    """Kimi-K3 sizes through the ops on the GPU: bf16, H = 7168, [batch, tokens] leading
    dims, a stacked bank of 9 slots."""

    @pytest.mark.parametrize("T", [1, 7, 128, 4099])
    @pytest.mark.parametrize("out_norm", ["none", "cast", "fp32w"])
    def test_inplace(self, T: int, out_norm: str) -> None:
        for nb in (0, 1, 4, 8):
            c = OpCase(lead=(1, T), H=7168, nb_max=9, num_blocks=nb, write_idx=nb,
                       dtype=torch.bfloat16, has_delta=True, out_norm=out_norm, w_fp32=False,
                       prefix_layout="contiguous", bank="stacked", eps=1e-6, out_eps=1e-6,
                       log2_scale=0)
            new_prefix, blocks, (nw, pw, ow), out, _ = run_inplace(c, nb, "cuda", "kernel")
            check_mix_and_norm(c.kernel_case, new_prefix, blocks, nw, pw, rows(out, c.H), ow,
                               bf16_casts_truncate=False, device="cuda", msg=str(c))

    @pytest.mark.parametrize("T", [1, 7, 128, 4099])
    @pytest.mark.parametrize("has_delta", [False, True])
    def test_functional(self, T: int, has_delta: bool) -> None:
        for nb in (0, 3, 8):
            c = OpCase(lead=(T,), H=7168, nb_max=9, num_blocks=nb, write_idx=-1,
                       dtype=torch.bfloat16, has_delta=has_delta, out_norm="cast", w_fp32=False,
                       prefix_layout="padded", bank="rows", eps=1e-6, out_eps=1e-6, log2_scale=0,
                       eps_tensor=True)
            new_prefix, blocks, (nw, pw, ow), out = run_functional(c, nb, "cuda", "kernel")
            check_mix_and_norm(c.kernel_case, new_prefix, blocks, nw, pw, rows(out, c.H), ow,
                               bf16_casts_truncate=False, device="cuda", msg=str(c))
