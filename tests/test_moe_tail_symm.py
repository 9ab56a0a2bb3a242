"""The symmetric-memory latent-MoE tail (``k3fusion.moe_tail_symm``, kernel in
``k3fusion.kernels.moe_tail_symm``).

CPU (always run):

* the opt-in switch: nothing registered on import, enable/disable idempotent, selection
  unchanged where the implementation does not apply;
* ``supports`` / ``unavailable_reason`` reasons (CPU device, tp = 1, T out of range, no
  CUDA, a gloo group -- real gloo ranks through ``_gloo.run_ranks``);
* argument validation (TypeError/ValueError naming the argument);
* the rank-order reduction in plain torch;
* the one-shot kernel and its signal-pad protocol for real, in Triton's interpreter: W
  spawned processes share memory-mapped files as their "symmetric" buffers and signal
  pads, each builds the address arrays as it maps them, and every rank runs the
  production launcher back to back with no other synchronization. Their sums must be
  bit-identical, equal to the rank-order reduction, and the pads must end all zero;
* the kernel compiles for sm_90 with the barrier as system-scope release/acquire CAS.

GPU (``cuda`` marker; NCCL ranks, one per GPU): a world-size-1 smoke test on one GPU
and 2/4/8-GPU tests, each skipped with the reason when too few GPUs are visible.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile

import pytest
import torch

from _gloo import run_ranks
from _ptx import hopper_ptxs
from k3fusion import moe_tail, reference
from k3fusion.config import get_config
from k3fusion.kernels.moe_tail_symm import (PeerBuffers, channel_programs, one_shot_all_reduce_pair,
                                            packed_layout, pick_programs, reduce_in_rank_order)
from k3fusion.moe_tail import Tier, TierUnavailableError
from k3fusion.moe_tail import symm_mem as moe_tail_symm
from k3fusion.moe_tail.symm_mem import SymmMemUnavailableError

EPS = 1e-6


@pytest.fixture
def symm_enabled():
    """The implementation registered for the test, and withdrawn after it."""
    was = moe_tail_symm.symm_mem_tail_enabled()
    moe_tail_symm.enable_symm_mem_tail()
    yield
    if not was:
        moe_tail_symm.disable_symm_mem_tail()


def round_to(x32: torch.Tensor, dtype: torch.dtype, *, truncate: bool) -> torch.Tensor:
    """fp32 -> ``dtype`` as the kernel rounds: to nearest even, or (bf16 in Triton's
    interpreter) toward zero."""
    if truncate and dtype == torch.bfloat16:
        return (x32.contiguous().view(torch.int32) & ~0xFFFF).view(torch.float32).to(dtype)
    return x32.to(dtype)


# ============================================================================ the switch


@pytest.mark.slow
def test_importing_registers_nothing():
    """A fresh interpreter: importing the module leaves the registry as it was."""
    code = ("import k3fusion.moe_tail as m, k3fusion.moe_tail_symm as s; "
            "print(sorted(i.name for i in m.tail_fusion_impls()), s.symm_mem_tail_enabled())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    names, enabled = done.stdout.strip().rsplit(" ", 1)
    assert "symm_mem" not in names and enabled == "False", done.stdout


def test_enable_disable_idempotent():
    was = moe_tail_symm.symm_mem_tail_enabled()
    try:
        moe_tail_symm.disable_symm_mem_tail()
        before = [i.name for i in moe_tail.tail_fusion_impls()]
        assert moe_tail_symm.enable_symm_mem_tail() is True
        assert moe_tail_symm.enable_symm_mem_tail() is False
        names = [i.name for i in moe_tail.tail_fusion_impls()]
        assert names == before + ["symm_mem"], names  # once, after what was there
        impl = next(i for i in moe_tail.tail_fusion_impls() if i.name == "symm_mem")
        assert impl.device_types == ("cuda",) and impl.supports is moe_tail_symm.supports
        assert moe_tail_symm.symm_mem_tail_enabled()
        assert moe_tail_symm.disable_symm_mem_tail() is True
        assert moe_tail_symm.disable_symm_mem_tail() is False
        assert [i.name for i in moe_tail.tail_fusion_impls()] == before
    finally:
        if was:
            moe_tail_symm.enable_symm_mem_tail()
        else:
            moe_tail_symm.disable_symm_mem_tail()


def test_enabled_leaves_cpu_selection_alone(symm_enabled):
    assert moe_tail.select_tier(4, 64, 2, "cpu") is Tier.COLUMN_PARALLEL
    why = moe_tail.tier_unavailable_reason("tail_fusion", 4, 64, 2, "cpu")
    assert "none is registered for 'cpu'" in why and "symm_mem (cuda)" in why
    if not torch.cuda.is_available():
        # A CUDA call is asked about, and says why not here.
        why = moe_tail.tier_unavailable_reason("tail_fusion", 4, 64, 2, "cuda")
        assert "symm_mem: CUDA is not available" in why, why
        assert moe_tail.select_tier(4, 64, 2, "cuda") is Tier.COLUMN_PARALLEL


# ============================================================================ reasons


@pytest.mark.parametrize("tokens,tp,device,match", [
    (4, 2, "cpu", "runs on CUDA devices, not on 'cpu'"),
    (4, 2, "meta", "not on 'meta'"),
    (4, 1, "cuda", "tp=1: there is no all-reduce"),
    (0, 2, "cuda", r"T=0 is outside 1\.\.64"),
    (65, 8, "cuda", r"T=65 is outside 1\.\.64"),
])
def test_supports_reasons(tokens, tp, device, match):
    import re

    why = moe_tail_symm.supports(tokens, 7168, tp, device)
    assert why is not None and re.search(match, why), why
    assert moe_tail_symm.unavailable_reason(tokens, 7168, None, device) is not None


def test_supports_static_facts_ok():
    why = moe_tail_symm.supports(16, 7168, 8, torch.device("cuda"))
    if torch.cuda.is_available():
        assert why is None
    else:
        assert why == "CUDA is not available in this process"
    assert moe_tail_symm.supports(64, 7168, 2, "cuda") == why  # MAX_TOKENS is inclusive


def test_group_reasons_without_a_group():
    assert "no process group" in moe_tail_symm.group_unavailable_reason(None)
    if not torch.distributed.is_initialized():
        class Fake:
            group_name = "fake"
        assert "not initialized" in moe_tail_symm.group_unavailable_reason(Fake())


def _gloo_reasons(rank, world, group):
    """On every rank of a real gloo group: what the symm_mem tail says about it."""
    out = {
        "group": moe_tail_symm.group_unavailable_reason(group),
        "cuda-call": moe_tail_symm.unavailable_reason(4, 64, group, "cuda"),
        "cpu-call": moe_tail_symm.unavailable_reason(4, 64, group, "cpu"),
        "big-call": moe_tail_symm.unavailable_reason(65, 64, group, "cuda"),
    }
    try:
        moe_tail_symm.prepare_symm_mem_tail(group, 40, 64, torch.bfloat16)
        out["prepare"] = None
    except SymmMemUnavailableError as e:
        out["prepare"] = str(e)
    # Enabled, the tiered tail on gloo/CPU still runs (and matches) the column-parallel
    # tier (the default above the fused tail at tp > 1), and forcing tail_fusion says why
    # it cannot.
    moe_tail_symm.enable_symm_mem_tail()
    g = torch.Generator().manual_seed(rank)
    x, s = torch.randn(3, 40, generator=g), torch.randn(3, 64, generator=g)
    w = torch.ones(40)
    up = torch.randn(64, 40, generator=torch.Generator().manual_seed(99))
    y, tier = moe_tail.run_latent_moe_tail(x, s, w, EPS, up, group)
    out["tier"] = tier.value
    # fp32: one addmm_ rounding against the reference's GEMM-then-add
    out["matches"] = torch.allclose(y, reference.latent_moe_tail(x, s, w, EPS, up, group),
                                    rtol=1e-5, atol=1e-5)
    try:
        moe_tail.latent_moe_tail(x, s, w, EPS, up, group, tier="tail_fusion")
        out["forced"] = None
    except TierUnavailableError as e:
        out["forced"] = str(e)
    return out


@pytest.mark.slow
def test_gloo_group_is_unavailable():
    for out in run_ranks(_gloo_reasons, 2):
        assert "backend is 'gloo'" in out["group"] and "NCCL" in out["group"], out
        assert out["cuda-call"] == out["group"], out
        assert "not on 'cpu'" in out["cpu-call"], out
        assert "T=65" in out["big-call"], out
        assert out["prepare"] is not None and "gloo" in out["prepare"], out
        assert out["tier"] == "column_parallel" and out["matches"], out
        assert "none is registered for 'cpu'" in out["forced"], out


# ============================================================================ validation


def _args(T=3, L=8, H=16, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(0)
    return dict(routed_latent=torch.randn(T, L, generator=g).to(dtype).to(device),
                shared=torch.randn(T, H, generator=g).to(dtype).to(device),
                norm_w=torch.ones(L, dtype=dtype, device=device), eps=EPS,
                up_w=torch.randn(H, L, generator=g).to(dtype).to(device))


class _FakeGroup:
    group_name = "not-a-real-group"


@pytest.mark.parametrize("change,exc,match", [
    (dict(routed_latent=[1.0]), TypeError, "routed_latent must be a Tensor"),
    (dict(shared=None), TypeError, "shared must be a Tensor"),
    (dict(routed_latent=torch.zeros(1, 3, 8)), ValueError, r"routed_latent must be 2-D \[T, L\]"),
    (dict(shared=torch.zeros(3)), ValueError, r"shared must be 2-D \[T, H\]"),
    (dict(shared=torch.zeros(3, 15)), ValueError, "shared must be"),
    (dict(shared=torch.zeros(4, 16)), ValueError, "leading dims"),
    (dict(up_w=torch.zeros(16, 9)), ValueError, "up_w is"),
    (dict(norm_w=torch.ones(7)), ValueError, "norm_w has 7 elements"),
    (dict(eps=-1.0), ValueError, "eps must be finite"),
    (dict(eps="1e-6"), TypeError, "eps must be a float"),
    (dict(up_w=torch.zeros(16, 8, dtype=torch.bfloat16)), TypeError, "dtypes must agree"),
    (dict(routed_latent=torch.zeros(3, 8, dtype=torch.float64)), TypeError,
     "routed_latent must be float32, bfloat16 or float16"),
    (dict(shared=torch.zeros(3, 32)[:, ::2]), ValueError, "shared must be contiguous"),
    (dict(routed_latent=torch.zeros(65, 8), shared=torch.zeros(65, 16)), ValueError,
     "T=65 rows; the symmetric-memory tail takes at most 64"),
    (dict(weight_in_fp32=1), TypeError, "weight_in_fp32 must be a bool"),
    (dict(group=None), ValueError, "group must be the tensor-parallel process group"),
    (dict(group="tp"), TypeError, "group must be a torch.distributed ProcessGroup"),
    ({}, ValueError, "routed_latent is on cpu: the symmetric-memory tail runs on CUDA"),
    (dict(shared=torch.zeros(3, 16, device="meta")), ValueError, "shared is on meta"),
])
def test_tail_argument_errors(change, exc, match):
    kw = _args() | dict(group=_FakeGroup(), weight_in_fp32=False) | change
    with pytest.raises(exc, match=match):
        moe_tail_symm.symm_mem_latent_moe_tail(**kw)


def test_other_entry_point_errors():
    a = _args()
    x, s = a["routed_latent"], a["shared"]
    with pytest.raises(ValueError, match="group must be"):
        moe_tail_symm.one_shot_all_reduce(x, s, None)
    with pytest.raises(ValueError, match="routed_latent is on cpu"):
        moe_tail_symm.one_shot_all_reduce(x, s, _FakeGroup())
    with pytest.raises(ValueError, match="at most 64"):
        moe_tail_symm.one_shot_all_reduce(torch.zeros(65, 8), torch.zeros(65, 16), _FakeGroup())
    with pytest.raises(TypeError, match="shared must be a Tensor"):
        moe_tail_symm.one_shot_all_reduce(x, [0.0], _FakeGroup())
    with pytest.raises(ValueError, match="latent must be >= 1"):
        moe_tail_symm.prepare_symm_mem_tail(_FakeGroup(), 0, 16, torch.bfloat16)
    with pytest.raises(TypeError, match="hidden must be an int"):
        moe_tail_symm.prepare_symm_mem_tail(_FakeGroup(), 8, 16.0, torch.bfloat16)
    with pytest.raises(TypeError, match="shared_dtype must be float32"):
        moe_tail_symm.prepare_symm_mem_tail(_FakeGroup(), 8, 16, torch.bfloat16,
                                            shared_dtype=torch.float64)
    with pytest.raises(SymmMemUnavailableError, match="no process group"):
        moe_tail_symm.prepare_symm_mem_tail(None, 8, 16, torch.bfloat16)


def _peers(world=2, rank=0, nbytes=4096, pad_bytes=2048):
    return PeerBuffers(rank, world, torch.zeros(world, dtype=torch.int64),
                       torch.zeros(world, dtype=torch.int64), nbytes, pad_bytes)


def test_kernel_launcher_errors():
    x, s = torch.zeros(3, 8, dtype=torch.bfloat16), torch.zeros(3, 16)
    p = _peers()
    for kw, exc, match in [
        (dict(block=48), ValueError, "block must be a power of two"),
        (dict(block=8), ValueError, "block must be a power of two >= 16"),
        (dict(programs=65), ValueError, r"programs must be 0 \(automatic\) or in \[1, 64\]"),
        (dict(programs=True), TypeError, "programs must be an int"),
    ]:
        with pytest.raises(exc, match=match):
            one_shot_all_reduce_pair(x, s, p, **kw)
    with pytest.raises(ValueError, match=r"need 240 bytes of symmetric buffer; it has 128"):
        one_shot_all_reduce_pair(x, s, _peers(nbytes=128))
    with pytest.raises(ValueError, match="routed has 3 rows but shared has 2"):
        one_shot_all_reduce_pair(x, s[:2], p)
    with pytest.raises(TypeError, match="routed must be float32"):
        one_shot_all_reduce_pair(x.double(), s, p)
    with pytest.raises(TypeError, match="peers must be a PeerBuffers"):
        one_shot_all_reduce_pair(x, s, object())
    with pytest.raises(ValueError, match="rank 2 is not in a group of 2"):
        _peers(rank=2)
    with pytest.raises(ValueError, match=r"buffer_ptrs must be a contiguous int64 tensor of shape \(3,\)"):
        PeerBuffers(0, 3, torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int64),
                    64, 2048)
    with pytest.raises(ValueError, match="no room"):
        _peers(world=8, pad_bytes=32)


def test_layout_and_grid():
    # [T*L bf16 | pad to 16 bytes | T*H fp32]
    assert packed_layout(3, 5, 7, torch.bfloat16, torch.float32) == (32, 32 + 84)
    assert packed_layout(0, 5, 7, torch.bfloat16, torch.float32) == (0, 0)
    assert channel_programs(8, 2048) == 32 and channel_programs(2, 9216) == 576
    assert pick_programs(3584, 7168, 1024, 8, 2048) == 7
    assert pick_programs(16 * 3584, 16 * 7168, 1024, 8, 2048) == 32  # the pad's slots
    assert pick_programs(16 * 3584, 16 * 7168, 1024, 2, 9216) == 64  # MAX_PROGRAMS
    assert pick_programs(0, 0, 1024, 2, 2048) == 1


# ============================================================================ rank order


def test_reduce_in_rank_order_is_a_fixed_order():
    one, big = torch.tensor([1.0]), torch.tensor([1e8])
    # 1 + 1e8 rounds to 1e8 in fp32: the order decides the result.
    assert reduce_in_rank_order([one, big, -big]).item() == 0.0
    assert reduce_in_rank_order([-big, big, one]).item() == 1.0


def test_reduce_in_rank_order_accumulates_in_fp32_and_rounds_once():
    parts = [torch.tensor([1.0], dtype=torch.bfloat16), torch.tensor([2.0**-8], dtype=torch.bfloat16),
             torch.tensor([2.0**-8], dtype=torch.bfloat16)]
    stepwise = (parts[0] + parts[1]) + parts[2]  # bf16 after each add: the 2^-8s are lost
    assert stepwise.item() == 1.0
    got = reduce_in_rank_order(parts)
    assert got.dtype == torch.bfloat16 and got.item() == 1.0 + 2.0**-7


def test_reduce_in_rank_order_basics():
    g = torch.Generator().manual_seed(3)
    parts = [torch.randn(4, 5, generator=g).half() for _ in range(3)]
    got = reduce_in_rank_order(parts)
    assert got.dtype == torch.float16 and got.shape == (4, 5)
    assert torch.equal(got, (parts[0].float() + parts[1].float() + parts[2].float()).half())
    assert torch.equal(reduce_in_rank_order(parts[:1]), parts[0])
    with pytest.raises(ValueError, match="non-empty sequence"):
        reduce_in_rank_order([])
    with pytest.raises(ValueError, match="non-empty sequence"):
        reduce_in_rank_order(parts[0])
    with pytest.raises(ValueError, match=r"parts\[1\] is"):
        reduce_in_rank_order([parts[0], parts[1].float()])
    with pytest.raises(TypeError, match=r"parts\[1\] must be a Tensor"):
        reduce_in_rank_order([parts[0], 1.0])


# ============================================================================ the kernel, for real
#
# Each rank maps every rank's buffer and signal pad (files, MAP_SHARED) at addresses of its
# own, as CUDA maps peers' symmetric memory, and runs the production launcher. Nothing else
# orders the ranks between calls: the kernel's barriers must.

#: (T, L, H, routed dtype, shared dtype, block, programs, strided rows)
_CASES = [
    (3, 40, 64, torch.bfloat16, torch.float32, 64, 3, False),
    (1, 40, 64, torch.bfloat16, torch.bfloat16, 1024, 0, True),
    (5, 40, 64, torch.float16, torch.float16, 32, 0, True),
    (0, 40, 64, torch.bfloat16, torch.bfloat16, 1024, 0, False),
    (4, 24, 48, torch.float32, torch.float32, 16, 0, False),
]
_PAD_BYTES = 96  # few slots: the grid is capped by the pad (2 programs at world 3)
_BUFFER_BYTES = max(packed_layout(c[0], c[1], c[2], c[3], c[4])[1] for c in _CASES)


def _partials(case_id: int, rank: int, case):
    tokens, latent, hidden, xdt, sdt, _, _, strided = case
    g = torch.Generator().manual_seed(1000 * case_id + rank)
    x = torch.randn(tokens, latent + 8 * strided, generator=g).to(xdt)[:, :latent]
    s = torch.randn(tokens, hidden + 4 * strided, generator=g).to(sdt)[:, :hidden]
    return x, s


def _weights(case):
    _, latent, hidden, _, sdt, *_ = case
    g = torch.Generator().manual_seed(77)
    return ((1 + 0.5 * torch.randn(latent, generator=g)).to(sdt),
            (torch.randn(hidden, latent, generator=g) / math.sqrt(latent)).to(sdt))


def _shared_file_rank(rank, world, group, tmp):
    import torch.distributed as dist

    from k3fusion.moe_tail.symm_mem import _tail_after_reduce

    bufs = [torch.from_file(os.path.join(tmp, f"buf{r}"), shared=True, size=_BUFFER_BYTES,
                            dtype=torch.uint8) for r in range(world)]
    pads = [torch.from_file(os.path.join(tmp, f"pad{r}"), shared=True, size=_PAD_BYTES,
                            dtype=torch.uint8) for r in range(world)]
    peers = PeerBuffers(rank, world,
                        torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64),
                        torch.tensor([p.data_ptr() for p in pads], dtype=torch.int64),
                        _BUFFER_BYTES, _PAD_BYTES, keepalive=(bufs, pads))
    out = []
    for sweep in range(2):  # the second sweep reuses buffers and pads, unsynchronized
        for i, case in enumerate(_CASES):
            x, s = _partials(i, rank, case)
            x0, s0 = x.clone(), s.clone()
            xr, sr = one_shot_all_reduce_pair(x, s, peers, block=case[5], programs=case[6])
            y = None
            if case[0] and sweep == 0:
                norm_w, up_w = _weights(case)
                y = _tail_after_reduce(xr, sr, norm_w, EPS, up_w, False)
            out.append(dict(case=i, sweep=sweep, xr=xr, sr=sr, y=y,
                            untouched=torch.equal(x, x0) and torch.equal(s, s0)))
    dist.barrier(group)  # every rank's last launch is over: the pads must be at rest
    last = _CASES[-1]
    x, s = _partials(len(_CASES) - 1, rank, last)
    offset, used = packed_layout(last[0], last[1], last[2], last[3], last[4])
    mine = bufs[rank]
    packed_x = mine[:last[0] * last[1] * x.element_size()].view(last[3]).view(last[0], last[1])
    packed_s = mine[offset:used].view(last[4]).view(last[0], last[2])
    return dict(results=out, pads_at_rest=all(int(p.count_nonzero()) == 0 for p in pads),
                own_buffer=torch.equal(packed_x, x) and torch.equal(packed_s, s))


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_one_shot_kernel_across_processes(world):
    from k3fusion.kernels.moe_tail_symm import _one_shot_pair_kernel
    from k3fusion.moe_tail.symm_mem import _tail_after_reduce
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(_one_shot_pair_kernel, InterpretedFunction):
        pytest.skip("runs the kernel in Triton's interpreter (CPU-only machines)")
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(world):
            for name, size in ((f"buf{r}", _BUFFER_BYTES), (f"pad{r}", _PAD_BYTES)):
                with open(os.path.join(tmp, name), "wb") as f:
                    f.write(bytes(size))
        ranks = run_ranks(_shared_file_rank, world, tmp, timeout_s=300)
    for r, got in enumerate(ranks):
        assert got["pads_at_rest"], f"rank {r}: signal pad not all zero after the launches"
        assert got["own_buffer"], f"rank {r}: its buffer does not hold its packed partials"
    for k, first in enumerate(ranks[0]["results"]):
        i, case = first["case"], _CASES[first["case"]]
        what = f"world {world} case {i} {case[:5]} sweep {first['sweep']}"
        parts = [_partials(i, r, case) for r in range(world)]
        for j, dt in ((0, case[3]), (1, case[4])):
            # The fp32 sum in rank order, rounded as the interpreter rounds.
            want = round_to(reduce_in_rank_order([p[j].float() for p in parts]), dt, truncate=True)
            key = ("xr", "sr")[j]
            for r, got in enumerate(ranks):
                res = got["results"][k]
                assert res["untouched"], f"{what}: rank {r} inputs modified"
                assert res[key].dtype == dt and res[key].is_contiguous()
                assert torch.equal(res[key], want), f"{what}: rank {r} {key} differs"
        if first["y"] is not None:
            norm_w, up_w = _weights(case)
            xr, sr = first["xr"], first["sr"]
            want = _tail_after_reduce(xr, sr, norm_w, EPS, up_w, False)
            for r, got in enumerate(ranks):
                assert torch.equal(got["results"][k]["y"], want), f"{what}: rank {r} tail differs"
            # and the tail is the spec's function of the reduced partials
            close = reference.latent_moe_tail(xr, sr, norm_w, EPS, up_w).double()
            scale = close.abs().max().item()
            # (16-bit inputs: the interpreter truncates the kernel's bf16 roundings)
            tol = 1e-5 if case[3] == case[4] == torch.float32 else 2.0**-6
            assert (want.double() - close).abs().max().item() <= tol * scale, what


def test_one_shot_kernel_single_rank():
    """World 1 in-process: the rank signals itself; sums are the inputs, pads end at zero."""
    from k3fusion.kernels.moe_tail_symm import _one_shot_pair_kernel
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(_one_shot_pair_kernel, InterpretedFunction):
        pytest.skip("runs the kernel in Triton's interpreter (CPU-only machines)")
    buf, pad = torch.zeros(4096, dtype=torch.uint8), torch.zeros(256, dtype=torch.uint8)
    peers = PeerBuffers(0, 1, torch.tensor([buf.data_ptr()]), torch.tensor([pad.data_ptr()]),
                        4096, 256, keepalive=(buf, pad))
    g = torch.Generator().manual_seed(0)
    for block, programs in ((32, 0), (1024, 1), (16, 5)):
        x = torch.randn(3, 40, generator=g).to(torch.float16)
        s = torch.randn(3, 64, generator=g)
        xr, sr = one_shot_all_reduce_pair(x, s, peers, block=block, programs=programs)
        assert torch.equal(xr, x) and torch.equal(sr, s)
        assert int(pad.count_nonzero()) == 0


# ============================================================================ sm_90 code

#: one compile per world size, all in one interpreter (each start imports torch and triton)
BARRIER_WORLDS = (1, 3, 8)


@pytest.mark.slow
def test_barrier_compiles_for_hopper():
    """The barriers never really run on CPU: compile for sm_90 at world sizes 1, 3 and 8
    and check each PTX holds one system-scope release CAS (put, barrier in), one acquire
    CAS (wait, barrier in), two relaxed ones (barrier out), CTA barriers, and L2-only
    loads of the peers' tiles."""
    ptxs = hopper_ptxs(
        "k3fusion.kernels.moe_tail_symm:_one_shot_pair_kernel", "the one-shot kernel",
        [dict(WORLD=w, WORLD_P2=1 << (w - 1).bit_length(), BLOCK=1024, GPU_FENCE=True)
         for w in BARRIER_WORLDS],
        pointers=dict(buf_ptrs="*i64", pad_ptrs="*i64", s_ptr="*fp32", so_ptr="*fp32"))
    for world, ptx in zip(BARRIER_WORLDS, ptxs, strict=True):
        _check_barrier_ptx(ptx, world)


def _check_barrier_ptx(ptx: str, world: int) -> None:
    ops = []
    for line in ptx.splitlines():
        for word in line.split():
            if word.startswith("atom.") and ".cas" in word:
                ops.append(set(word.split(".")))
    def count(sem):
        scoped = [q for q in ops if {"global", "sys", "cas"} <= q]
        if sem == "relaxed":  # spelled out, or the default when no order is named
            return sum(1 for q in scoped if not q & {"release", "acquire", "acq_rel"})
        return sum(1 for q in scoped if sem in q)
    assert (count("release"), count("acquire"), count("relaxed")) == (1, 1, 2), (world, ops)
    assert len(ops) == 4, (world, ops)
    assert "bar.sync" in ptx, world
    assert "ld.global.cg" in ptx, world
    assert "fence.acq_rel.sys" in ptx, world  # every thread's copy-in, before its flag


# ============================================================================ GPUs (NCCL)


def _nccl_ranks(body, world, *args, timeout_s=600.0):
    """``body(rank, world, group, *args)`` on ``world`` spawned NCCL ranks (one GPU each)."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, {torch.cuda.device_count()} visible")
    return run_ranks(body, world, *args, timeout_s=timeout_s, backend="nccl")


_GPU_LATENT, _GPU_HIDDEN = 3584, 7168


def _gpu_rank(rank, world, group, tokens_list):
    """Every check that needs this rank's GPU; returns CPU tensors and facts."""
    import torch.distributed as dist

    dev = torch.device("cuda", rank)
    dt = torch.bfloat16
    moe_tail_symm.enable_symm_mem_tail()
    gw = torch.Generator(device=dev).manual_seed(5)  # replicated weights: one seed
    norm_w = (1 + 0.1 * torch.randn(_GPU_LATENT, device=dev, generator=gw)).to(dt)
    up_w = (torch.randn(_GPU_HIDDEN, _GPU_LATENT, device=dev, generator=gw)
            / _GPU_LATENT**0.5).to(dt)
    out = {"norm_w": norm_w.cpu(), "up_w": up_w.cpu()}
    for tokens in tokens_list:
        g = torch.Generator(device=dev).manual_seed(1000 * tokens + rank)
        x = torch.randn(tokens, _GPU_LATENT, device=dev, generator=g).to(dt)
        s = torch.randn(tokens, _GPU_HIDDEN, device=dev, generator=g).to(dt)
        xr, sr = moe_tail_symm.one_shot_all_reduce(x, s, group)
        y = moe_tail_symm.symm_mem_latent_moe_tail(x, s, norm_w, EPS, up_w, group)
        ref = reference.latent_moe_tail(x, s, norm_w, EPS, up_w, group)
        y_tier, tier = moe_tail.run_latent_moe_tail(x, s, norm_w, EPS, up_w, group)
        # The same call captured in a CUDA graph and replayed (twice: the pads reset).
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            moe_tail_symm.symm_mem_latent_moe_tail(x, s, norm_w, EPS, up_w, group)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            y_graph = moe_tail_symm.symm_mem_latent_moe_tail(x, s, norm_w, EPS, up_w, group)
        graph.replay()
        graph.replay()
        torch.cuda.synchronize()
        out[tokens] = dict(x=x.cpu(), s=s.cpu(), xr=xr.cpu(), sr=sr.cpu(), y=y.cpu(),
                           ref=ref.cpu(), y_tier=y_tier.cpu(), tier=tier.value,
                           y_graph=y_graph.cpu())
    # A group whose first call comes inside a capture: a clear error, not a hang.
    fresh = dist.new_group(list(range(world)))
    x = torch.zeros(1, _GPU_LATENT, device=dev, dtype=dt)
    s = torch.zeros(1, _GPU_HIDDEN, device=dev, dtype=dt)
    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            moe_tail_symm.symm_mem_latent_moe_tail(x, s, norm_w, EPS, up_w, fresh)
        out["capture_error"] = None
    except RuntimeError as e:
        out["capture_error"] = str(e)
    return out


def _check_gpu(world, ranks, tokens_list):
    for tokens in tokens_list:
        parts = [r[tokens] for r in ranks]
        what = f"world {world} T={tokens}"
        want_xr = reduce_in_rank_order([p["x"] for p in parts])
        want_sr = reduce_in_rank_order([p["s"] for p in parts])
        for r, p in enumerate(parts):
            # GPU fp32 adds and round-to-nearest: bit for bit the plain-torch rank-order sum.
            assert torch.equal(p["xr"], want_xr), f"{what}: rank {r} routed sum"
            assert torch.equal(p["sr"], want_sr), f"{what}: rank {r} shared sum"
            assert torch.equal(p["y"], parts[0]["y"]), f"{what}: rank {r} differs from rank 0"
            assert torch.equal(p["y_graph"], p["y"]), f"{what}: rank {r} graph replay differs"
        # Against the exact tail (fp64 from every partial): no worse than the NCCL reference.
        x64 = torch.stack([p["x"].double() for p in parts]).sum(0)
        s64 = torch.stack([p["s"].double() for p in parts]).sum(0)
        w, up = ranks[0]["norm_w"].double(), ranks[0]["up_w"].double()
        exact = s64 + (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS) * w) @ up.T
        scale = exact.abs().max().item()
        err = (parts[0]["y"].double() - exact).abs().max().item() / scale
        ref_err = (parts[0]["ref"].double() - exact).abs().max().item() / scale
        assert err <= 2 * ref_err + 2.0**-9, f"{what}: error {err:.3g} vs reference {ref_err:.3g}"
        if world > 1:
            expect = "tail_fusion" if tokens <= min(get_config().fused_tail_max_tokens,
                                                    moe_tail_symm.SELECT_MAX_TOKENS) else \
                "column_parallel"
            assert parts[0]["tier"] == expect, f"{what}: tier {parts[0]['tier']}"
            if expect == "tail_fusion":
                assert torch.equal(parts[0]["y_tier"], parts[0]["y"]), what
    for r, got in enumerate(ranks):
        msg = got["capture_error"]
        assert msg and "CUDA-graph capture" in msg and "prepare_symm_mem_tail" in msg, \
            f"rank {r}: {msg!r}"


@pytest.mark.cuda
def test_world_size_1_smoke():
    """One GPU, one NCCL rank. torch's CUDA symmetric-memory allocator has no world-size
    floor (its rendezvous exchange and its alloc-id check both handle a single rank), so
    the whole path runs: allocation, rendezvous, the kernel's barriers (a rank signals
    itself), the fused tail, CUDA-graph replay and the capture-time error."""
    tokens = [1, 4, 16, 64]
    _check_gpu(1, _nccl_ranks(_gpu_rank, 1, tokens), tokens)


@pytest.mark.cuda
@pytest.mark.parametrize("world", [2, 4, 8])
def test_multi_gpu(world):
    tokens = [1, 4, 16, 32]
    _check_gpu(world, _nccl_ranks(_gpu_rank, world, tokens), tokens)


# ============================================================================ the tp benchmark (CPU parts)


def _fake_tp_rows():
    def row(t, rep, ov, cp, symm=None):
        r = dict(T=t, tp=2, auto="column_parallel", same_auto_tier=True, floor_us=11.95,
                 replicated_us=rep, allreduce_overlap_us=ov, column_parallel_us=cp)
        for name in ("replicated", "allreduce_overlap", "column_parallel"):
            r[f"{name}_err"], r[f"{name}_ranks_identical"] = 4e-3, True
        if symm is not None:
            r.update(symm_mem_us=symm, symm_mem_err=3e-3, symm_mem_ranks_identical=True)
        return r
    return [row(1, 60.0, 50.0, 55.0, 30.0), row(16, 70.0, 60.0, 65.0, 66.0),
            row(64, 80.0, 80.0, 70.0, 75.0), row(256, 130.0, 120.0, 121.0)]


def test_tp_bench_crossovers():
    """The thresholds the timings imply: how far the symm-mem tail beats the fastest NCCL
    tier, and the overlap tier is no slower than column-parallel, at every T up to there
    (a win past a loss -- overlap at 256 after losing at 64 -- does not count)."""
    from k3fusion.bench.moe_tail_tp import crossovers

    rows = _fake_tp_rows()
    assert crossovers(rows) == dict(fused_tail_max_tokens=1, overlap_threshold=16)
    assert crossovers(rows[::-1]) == crossovers(rows)  # by T, not by row order
    # column-parallel faster everywhere, symm-mem everywhere it ran: overlap never, symm 64
    for r in rows:
        r["column_parallel_us"] = r["allreduce_overlap_us"] - 1
        if "symm_mem_us" in r:
            r["symm_mem_us"] = 1.0
    assert crossovers(rows) == dict(fused_tail_max_tokens=64, overlap_threshold=None)
    failed = [dict(r, symm_mem_us=None) for r in rows]  # a failed timing is no win
    assert crossovers(failed)["fused_tail_max_tokens"] is None


def test_tp_bench_table_and_guards(monkeypatch):
    from k3fusion.bench import moe_tail_tp as bench

    args = bench._parser().parse_args(["--tokens", "1", "16"])
    rows = _fake_tp_rows()
    rows[1]["symm_mem_us"], rows[1]["symm_mem_error"] = None, "rank 1: RuntimeError: boom"
    rows[2]["allreduce_overlap_ranks_identical"] = False
    md = bench._markdown(rows, args, 2, {"gpu": "GPU", "date": "d", "torch": "t", "triton": "x"})
    assert "| 1 | 60.00 | 50.00 | 55.00 | 30.00 | 11.95 | column_parallel (yes) | 4.00e-03 | yes |" in md
    assert "| 16 | 70.00 | 60.00 | 65.00 | - |" in md and "rank 1: RuntimeError: boom" in md
    assert "| 64 |" in md and md.split("| 64 |")[1].split("\n")[0].rstrip().endswith("| NO |")
    assert "| 256 | 130.00 | 120.00 | 121.00 | - |" in md
    assert "symm-mem fused tail fastest up to T = 1" in md
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(SystemExit, match="torchrun"):
        bench.main(["--tokens", "1"])
