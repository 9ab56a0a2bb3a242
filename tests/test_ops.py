"""``torch.ops.k3fusion.dual_rms_norm``: both CPU paths, the fake impl, argument checks.

The CPU implementation runs the Triton kernel (in Triton's interpreter) when
``TRITON_INTERPRET=1`` at call time, else ``k3fusion.reference``. On a CUDA machine the
kernel-path tests run on the GPU instead.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from _kernel_paths import cpu_path, spy_on_launcher
from _tolerances import assert_matches_reference
from k3fusion import reference
from k3fusion.config import get_config, set_config

op = torch.ops.k3fusion.dual_rms_norm
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = KERNEL_DEVICE == "cpu"  # fp32 -> bf16 casts truncate in the interpreter

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def launcher_calls():
    """Count calls of the kernel launcher the op imports (``k3fusion.kernels.dual_rms_norm``)."""
    return spy_on_launcher("dual_rms_norm", "rows_per_program")


@contextlib.contextmanager
def rows_per_program(rows: int):
    saved = get_config()
    set_config(saved.replace(dual_norm_rows_per_program=rows))
    try:
        yield
    finally:
        set_config(saved)


# --------------------------------------------------------------- generated inputs


@dataclass(frozen=True)
class OpMember:
    """``x`` of shape ``lead + (width,)``, the first ``width`` columns of rows ``width + pad``
    wide; ``permuted``: the two leading dims are a transpose (rows cannot be flattened
    into one stride, so the op must copy)."""

    lead: tuple[int, ...]
    width: int
    pad: int
    permuted: bool
    x_dtype: torch.dtype
    w_fp32: bool
    weight_in_fp32: bool
    eps: float
    log2_scale: int
    # eps passed as a 0-dim CPU tensor (torch.compile(dynamic=True)'s form), with a decoy
    # float eps that it must replace.
    eps_tensor: bool = False

    @property
    def w_dtype(self) -> torch.dtype:
        return torch.float32 if self.w_fp32 else self.x_dtype

    @property
    def out_dtype(self) -> torch.dtype:
        return reference.rms_norm_out_dtype(self.x_dtype, self.w_dtype, self.weight_in_fp32)

    def eps_args(self) -> tuple[float, torch.Tensor | None]:
        """``(eps, eps_tensor)`` as passed to the op."""
        if self.eps_tensor:
            return EPS_DECOY, torch.tensor(self.eps, dtype=torch.float64)
        return self.eps, None

    def make(self, gen: torch.Generator, device: str):
        """``(x_parent, x, w)``."""
        lead = self.lead
        if self.permuted and len(lead) >= 2:
            stored = (lead[1], lead[0], *lead[2:])
        else:
            stored = lead
        # In-place scaling keeps randn's standard strides ("* scale" can give an empty
        # tensor a 0 stride in a size-1 dim, which the op rejects: see
        # test_size_one_dims_with_any_stride_are_accepted).
        parent = torch.randn(*stored, self.width + self.pad, generator=gen).mul_(2.0**self.log2_scale)
        parent = parent.to(device=device, dtype=self.x_dtype)
        x = parent.transpose(0, 1) if stored != lead else parent
        x = x[..., : self.width]
        assert x.shape == (*lead, self.width)
        w = (torch.rand(self.width, generator=gen) * 4 - 2).to(device=device, dtype=self.w_dtype)
        return parent, x, w


EPS_DECOY = 0.25  # not one of the generated eps values

ROWS = st.one_of(st.sampled_from([0, 1, 2, 3, 5, 64, 67, 70]), st.integers(0, 70))
LEAD = st.one_of(
    st.tuples(ROWS),
    st.tuples(st.integers(0, 8), st.integers(0, 8)),
    st.tuples(st.integers(0, 4), st.integers(0, 4), st.integers(0, 4)),
)
WIDTHS = st.one_of(st.sampled_from([1, 3, 64, 100, 127, 128, 129, 300]), st.integers(1, 300))


@st.composite
def op_members(draw) -> OpMember:
    return OpMember(
        lead=draw(LEAD),
        width=draw(WIDTHS),
        pad=draw(st.sampled_from([0, 1, 8, 64])),
        permuted=draw(st.booleans()),
        x_dtype=draw(st.sampled_from(DTYPES)),
        w_fp32=draw(st.booleans()),
        weight_in_fp32=draw(st.booleans()),
        eps=draw(st.sampled_from([1e-6, 1e-5, 1e-3, 0.1])),
        log2_scale=draw(st.sampled_from([-6, 0, 6])),
        eps_tensor=draw(st.booleans()),
    )


_MLA_Q = OpMember((2, 5), 96, 0, False, torch.bfloat16, False, False, 1e-6, 0)
_MLA_KV = OpMember((2, 5), 48, 8, False, torch.bfloat16, False, False, 1e-5, 0, True)


def _call(m1: OpMember, m2: OpMember, seed: int, device: str, *, permuted_contiguous: bool = True):
    """Run the op on generated inputs; check inputs untouched and the outputs' metadata is
    the fake impl's (shape of x, promoted dtype, contiguous). ``permuted_contiguous=False``
    skips the contiguity check for permuted inputs (a known bug of the reference path:
    test_reference_path_strides_match_fake_impl)."""
    gen = torch.Generator().manual_seed(seed)
    p1, x1, w1 = m1.make(gen, device)
    p2, x2, w2 = m2.make(gen, device)
    saved = [t.clone() for t in (p1, w1, p2, w2)]
    (eps1, eps1_t), (eps2, eps2_t) = m1.eps_args(), m2.eps_args()
    y1, y2 = op(x1, w1, eps1, x2, w2, eps2, m1.weight_in_fp32, m2.weight_in_fp32,
                eps1_tensor=eps1_t, eps2_tensor=eps2_t)
    for name, before, after in zip(("x1", "w1", "x2", "w2"), saved, (p1, w1, p2, w2)):
        assert torch.equal(before, after), f"{name} (or its parent rows) was modified"
    for i, (m, x, y) in enumerate(((m1, x1, y1), (m2, x2, y2)), 1):
        assert y.shape == x.shape, f"y{i} shape {tuple(y.shape)} != {tuple(x.shape)}"
        assert y.dtype == m.out_dtype, f"y{i} dtype {y.dtype} != {m.out_dtype}"
        assert y.device == x.device
        if permuted_contiguous or not m.permuted:
            assert y.is_contiguous(), f"y{i} strides {y.stride()}: the fake impl says contiguous"
    return (x1, w1, y1), (x2, w2, y2)


# --------------------------------------------------------------- the two paths


@given(m1=op_members(), m2=op_members(), rows=st.sampled_from([0, 1, 2, 4]),
       seed=st.integers(0, 2**31 - 1))
@example(m1=_MLA_Q, m2=_MLA_KV, rows=0, seed=0)
@example(m1=OpMember((3, 4, 5), 129, 64, True, torch.bfloat16, True, False, 0.1, -6),
         m2=OpMember((1,), 7, 1, False, torch.float16, False, True, 1e-6, 6, True), rows=4, seed=1)
@example(m1=OpMember((0,), 16, 0, False, torch.float32, False, False, 1e-6, 0),
         m2=OpMember((2, 0, 3), 5, 8, True, torch.bfloat16, True, True, 1e-6, 0), rows=1, seed=2)
def test_kernel_path_matches_reference(m1: OpMember, m2: OpMember, rows: int, seed: int) -> None:
    with cpu_path("kernel"), rows_per_program(rows), launcher_calls() as calls:
        members = _call(m1, m2, seed, KERNEL_DEVICE)
    assert calls == [rows], "the op did not launch the Triton kernel once"
    for i, (m, (x, w, y)) in enumerate(zip((m1, m2), members), 1):
        assert_matches_reference(y, x, w, m.eps, m.weight_in_fp32,
                                 bf16_casts_truncate=INTERPRETED, msg=f"y{i} {m}")


@given(m1=op_members(), m2=op_members(), seed=st.integers(0, 2**31 - 1))
@example(m1=_MLA_Q, m2=_MLA_KV, seed=0)
def test_reference_path_is_bit_exact(m1: OpMember, m2: OpMember, seed: int) -> None:
    with cpu_path("reference"), launcher_calls() as calls:
        members = _call(m1, m2, seed, "cpu", permuted_contiguous=False)
    assert calls == [], "TRITON_INTERPRET unset: the CPU op must not launch the kernel"
    for i, (m, (x, w, y)) in enumerate(zip((m1, m2), members), 1):
        expected = reference.rms_norm(x, w, m.eps, m.weight_in_fp32)
        assert torch.equal(y, expected), f"y{i} differs from k3fusion.reference ({m})"


def test_interpreter_path_is_chosen_at_call_time() -> None:
    """The same bf16 inputs give the reference's bits with TRITON_INTERPRET unset and the
    interpreter's (truncating) bits with it set: the switch is read per call."""
    if not INTERPRETED:
        pytest.skip("CUDA machine: kernels are compiled, the interpreter path is unused")
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(8, 64, generator=gen).to(torch.bfloat16)
    w = (torch.rand(64, generator=gen) + 0.5).to(torch.bfloat16)
    with cpu_path("kernel"):
        y_kernel = op(x, w, 1e-6, x, w, 1e-6, True, True)[0]
    with cpu_path("reference"):
        y_ref = op(x, w, 1e-6, x, w, 1e-6, True, True)[0]
    with cpu_path("kernel"):
        y_kernel2 = op(x, w, 1e-6, x, w, 1e-6, True, True)[0]
    assert torch.equal(y_ref, reference.rms_norm(x, w, 1e-6, True))
    assert not torch.equal(y_kernel, y_ref)  # truncation shows in some of 512 elements
    assert torch.equal(y_kernel, y_kernel2)


# --------------------------------------------------------------- zero rows, fake impl


@pytest.mark.parametrize("path", ["kernel", "reference"])
@pytest.mark.parametrize(
    "shape1, shape2",
    [((0, 16), (0, 8)), ((2, 0, 16), (3, 8)), ((3, 16), (0, 8)), ((1, 0, 5), (0, 1, 4))],
    ids=["both-empty", "x1-empty-3d", "x2-empty", "both-empty-3d"],
)
def test_zero_rows(path: str, shape1: tuple, shape2: tuple) -> None:
    device = KERNEL_DEVICE if path == "kernel" else "cpu"
    x1 = torch.randn(*shape1, device=device, dtype=torch.bfloat16)
    w1 = torch.ones(shape1[-1], device=device)  # fp32 weight: promotes
    x2 = torch.randn(*shape2, device=device, dtype=torch.float16)
    w2 = torch.ones(shape2[-1], device=device, dtype=torch.float16)
    with cpu_path(path):
        y1, y2 = op(x1, w1, 1e-6, x2, w2, 1e-6, False, True)
    assert (y1.shape, y1.dtype) == (x1.shape, torch.float32)
    assert (y2.shape, y2.dtype) == (x2.shape, torch.float16)
    for x, w, y, flag in ((x1, w1, y1, False), (x2, w2, y2, True)):
        if x.numel():
            assert_matches_reference(y, x, w, 1e-6, flag, bf16_casts_truncate=INTERPRETED
                                     and path == "kernel")


@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("w_fp32", [False, True])
@pytest.mark.parametrize("weight_in_fp32", [False, True])
def test_fake_impl_shapes_and_dtypes(x_dtype, w_fp32, weight_in_fp32) -> None:
    w_dtype = torch.float32 if w_fp32 else x_dtype
    x1 = torch.empty(2, 3, 16, device="meta", dtype=x_dtype)[..., :12]
    w1 = torch.empty(12, device="meta", dtype=w_dtype)
    x2 = torch.empty(0, 5, device="meta", dtype=x_dtype)
    w2 = torch.empty(5, device="meta", dtype=w_dtype)
    y1, y2 = op(x1, w1, 1e-6, x2, w2, 1e-5, weight_in_fp32, weight_in_fp32)
    out = reference.rms_norm_out_dtype(x_dtype, w_dtype, weight_in_fp32)
    assert (y1.shape, y1.dtype, y1.device.type) == (x1.shape, out, "meta")
    assert (y2.shape, y2.dtype) == (x2.shape, out)
    # The reference on meta tensors agrees on the output dtype.
    assert reference.rms_norm(x1, w1, 1e-6, weight_in_fp32).dtype == out


@pytest.mark.parametrize(
    "args",
    [
        (torch.randn(2, 3, 16, dtype=torch.bfloat16), torch.rand(16), 1e-6,
         torch.randn(5, 12, dtype=torch.bfloat16)[:, :8], torch.rand(8, dtype=torch.bfloat16),
         1e-5, False, True),
        (torch.randn(4, 32, dtype=torch.float16), torch.rand(32, dtype=torch.float16), 1e-5,
         torch.randn(1, 7), torch.rand(7), 0.1, True, False),
        (torch.randn(0, 32, dtype=torch.bfloat16), torch.rand(32, dtype=torch.bfloat16), 1e-5,
         torch.randn(3, 1, 7), torch.rand(7), 1e-6),
        (torch.randn(3, 16, dtype=torch.bfloat16), torch.rand(16, dtype=torch.bfloat16), 0.25,
         torch.randn(3, 8), torch.rand(8), 0.25, False, True,
         torch.tensor(1e-6, dtype=torch.float64), torch.tensor(1e-3)),
    ],
    ids=["bf16-fp32w-strided-kv", "fp16-fp32", "zero-rows-defaults", "eps-tensors"],
)
def test_opcheck(args) -> None:
    with cpu_path("reference"):
        torch.library.opcheck(op.default, args)


_PERMUTED = torch.randn(3, 2, 8).transpose(0, 1)  # [2, 3, 8], strides (8, 16, 1)


def test_reference_path_strides_match_fake_impl() -> None:
    # (torch 2.13's opcheck reports this as a test_faketensor stride mismatch; 2.11's
    # does not, so the strides are compared directly.)
    w = torch.rand(8)
    args = (_PERMUTED, w, 1e-6, torch.randn(2, 4), torch.rand(4), 1e-6)
    with cpu_path("reference"):
        y1, _ = op(*args)
    fake1, _ = op(*(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args))
    assert y1.stride() == fake1.stride()


def test_kernel_path_strides_match_fake_impl() -> None:
    w = torch.rand(8, device=KERNEL_DEVICE)
    x = _PERMUTED.to(KERNEL_DEVICE)
    args = (x, w, 1e-6, torch.randn(2, 4, device=KERNEL_DEVICE), torch.rand(4, device=KERNEL_DEVICE), 1e-6)
    with cpu_path("kernel"):
        y1, _ = op(*args)
    fake1, _ = op(*(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args))
    assert y1.stride() == fake1.stride() == (24, 8, 1)
    assert_matches_reference(y1, x, w, 1e-6, False, bf16_casts_truncate=INTERPRETED)


# --------------------------------------------------------------- bad inputs


def _args(device: str = "cpu", **over):
    args = dict(
        x1=torch.randn(3, 16, device=device), w1=torch.ones(16, device=device), eps1=1e-6,
        x2=torch.randn(3, 8, device=device), w2=torch.ones(8, device=device), eps2=1e-5,
    )
    args.update(over)
    return args


# (id, builder(device) -> kwargs, exception, message pattern). Every message must name the
# offending argument.
BAD = [
    ("w1-2d", lambda d: _args(d, w1=torch.ones(1, 16, device=d)), ValueError, r"\bw1\b.*1-D"),
    ("w2-0d", lambda d: _args(d, w2=torch.tensor(1.0, device=d)), ValueError, r"\bw2\b"),
    ("x1-0d", lambda d: _args(d, x1=torch.tensor(1.0, device=d), w1=torch.ones(1, device=d)),
     ValueError, r"\bx1\b.*0-dim"),
    ("x2-0d", lambda d: _args(d, x2=torch.tensor(1.0, device=d), w2=torch.ones(1, device=d)),
     ValueError, r"\bx2\b"),
    ("w1-size", lambda d: _args(d, w1=torch.ones(15, device=d)), ValueError, r"\bw1\b.*15"),
    ("w2-size", lambda d: _args(d, w2=torch.ones(16, device=d)), ValueError, r"\bw2\b"),
    ("x1-zero-width", lambda d: _args(d, x1=torch.empty(3, 0, device=d),
                                      w1=torch.empty(0, device=d)), ValueError, r"\bx1\b"),
    ("x1-last-dim-strided", lambda d: _args(d, x1=torch.randn(3, 32, device=d)[:, ::2]),
     ValueError, r"\bx1\b.*stride"),
    ("x2-last-dim-strided", lambda d: _args(d, x2=torch.randn(8, 3, device=d).t()),
     ValueError, r"\bx2\b.*stride"),
    ("w1-strided", lambda d: _args(d, w1=torch.ones(32, device=d)[::2]), ValueError, r"\bw1\b"),
    ("x1-float64", lambda d: _args(d, x1=torch.randn(3, 16, device=d, dtype=torch.float64)),
     TypeError, r"\bx1\b.*float64"),
    ("w2-float64", lambda d: _args(d, w2=torch.ones(8, device=d, dtype=torch.float64)),
     TypeError, r"\bw2\b"),
    ("x2-int32", lambda d: _args(d, x2=torch.ones(3, 8, device=d, dtype=torch.int32)),
     TypeError, r"\bx2\b.*int32"),
    ("w1-int64", lambda d: _args(d, w1=torch.ones(16, device=d, dtype=torch.int64)),
     TypeError, r"\bw1\b"),
    ("eps1-negative", lambda d: _args(d, eps1=-1e-6), ValueError, r"\beps1\b"),
    ("eps2-nan", lambda d: _args(d, eps2=math.nan), ValueError, r"\beps2\b"),
    ("eps1-inf", lambda d: _args(d, eps1=math.inf), ValueError, r"\beps1\b"),
    # eps as a 0-dim CPU tensor (always on the CPU, whatever the device of x).
    ("eps1_tensor-1d", lambda d: _args(d, eps1_tensor=torch.tensor([1e-6])), ValueError,
     r"\beps1_tensor\b.*0-dim"),
    ("eps2_tensor-int", lambda d: _args(d, eps2_tensor=torch.tensor(0)), ValueError,
     r"\beps2_tensor\b.*floating"),
]
# Device mismatches (the CPU tensors against meta ones): CPU only.
BAD_DEVICE = [
    ("w1-device", lambda d: _args(d, w1=torch.ones(16, device="meta")), ValueError, r"\bw1\b.*meta"),
    ("w2-device", lambda d: _args(d, w2=torch.ones(8, device="meta")), ValueError, r"\bw2\b.*meta"),
    ("eps2_tensor-device", lambda d: _args(d, eps2_tensor=torch.tensor(1e-6, device="meta")),
     ValueError, r"\beps2_tensor\b.*CPU"),
    ("x1-x2-devices", lambda d: _args(d, x2=torch.randn(3, 8, device="meta"),
                                      w2=torch.ones(8, device="meta")), ValueError, r"\bx2\b.*meta"),
]


def _ids(cases):
    return [c[0] for c in cases]


@pytest.mark.parametrize("path", ["kernel", "reference"])
@pytest.mark.parametrize("case", BAD + BAD_DEVICE, ids=_ids(BAD + BAD_DEVICE))
def test_bad_inputs_raise_before_launch(case, path: str) -> None:
    _, build, exc, pattern = case
    device = KERNEL_DEVICE if path == "kernel" else "cpu"
    with cpu_path(path), launcher_calls() as calls:
        with pytest.raises(exc, match=pattern):
            op(**build(device))
    assert calls == [], "the kernel was launched with bad arguments"


@pytest.mark.parametrize("case", BAD, ids=_ids(BAD))
def test_bad_inputs_rejected_by_fake_impl(case) -> None:
    """What torch.compile traces with: the meta/fake impl validates the same way."""
    _, build, exc, pattern = case
    with pytest.raises(exc, match=pattern):
        op(**build("meta"))


def test_eps_not_a_number_names_the_argument() -> None:
    """A non-number eps is rejected by the dispatcher's schema check (a RuntimeError from
    torch, before k3fusion's own check runs); the message still names the argument."""
    for name in ("eps1", "eps2"):
        with pytest.raises(RuntimeError, match=rf"'float' for argument '{name}'"):
            op(**_args(**{name: "1e-6"}))
        with pytest.raises(RuntimeError, match=rf"argument '{name}'"):
            op(**_args(**{name: None}))


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="the op schema converts a bool eps to 1.0 before "
                   "check_rms_norm_args' bool rejection runs (k3fusion/ops/_args.py); "
                   "k3fusion.ops.dual_rms_norm refuses it (tests/test_op_entry_points.py)")
def test_eps_bool_rejected() -> None:
    try:
        op(**_args(eps1=True))
    except (TypeError, ValueError) as e:
        assert "eps1" in str(e)
        return
    raise AssertionError("eps1=True was accepted (as 1.0)")


@pytest.mark.parametrize(
    "x1, w1",
    [
        (torch.randn(0, 1) * 2.0, torch.ones(1)),  # torch gives this empty tensor stride (1, 0)
        (torch.randn(4, 3).t()[:, :1], torch.ones(1)),  # [3, 1] column, strides (1, 3)
        (torch.randn(3, 1), torch.ones(4)[::4]),  # 1-element weight with stride 4
    ],
    ids=["empty-stride-0", "column-of-transpose", "weight-stride-4"],
)
def test_size_one_dims_with_any_stride_are_accepted(x1, w1) -> None:
    """A size-1 dim's stride is never used (torch calls these tensors contiguous), so the
    op should accept them and produce the reference result."""
    assert x1.is_contiguous() or x1.shape[-1] == 1
    with cpu_path("reference"):
        y1, _ = op(x1, w1, 1e-6, torch.randn(2, 8), torch.ones(8), 1e-6)
    assert torch.equal(y1, reference.rms_norm(x1, w1, 1e-6))


@pytest.mark.parametrize("path", ["kernel", "reference"])
@pytest.mark.parametrize("value", [-1e-6, math.nan], ids=["negative", "nan"])
def test_bad_eps_tensor_value_rejected(path: str, value: float) -> None:
    device = KERNEL_DEVICE if path == "kernel" else "cpu"
    with cpu_path(path), launcher_calls() as calls:
        try:
            op(**_args(device, eps1_tensor=torch.tensor(value)))
        except ValueError as e:
            assert "eps1" in str(e) and calls == []
            return
    raise AssertionError(f"eps1_tensor={value} was accepted")
