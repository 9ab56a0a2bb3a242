"""``k3fusion::attn_res_`` with arguments that share memory, and with autograd.

The in-place op's spec (``k3fusion.reference.attn_res``) is a sequence of steps, each
reading before it writes: with ``prefix`` a view of a bank slot, ``delta`` overlapping
``prefix``, or ``prefix`` the slot the block is written to, the op's result (and what
it leaves in memory) must be the spec's on both CPU paths -- never a kernel pass that
reads what it already overwrote. A tensor the op writes that requires grad is refused,
as torch refuses in-place ops on leaves that require grad.
"""

from __future__ import annotations

import pytest
import torch

from _kernel_paths import cpu_path
from k3fusion import eager, reference

H = 16
# The CPU kernel path is Triton's interpreter, which must be on before k3fusion is
# imported: on a CUDA machine the kernel runs on the GPU instead (the test below).
PATHS = ("reference",) if torch.cuda.is_available() else ("kernel", "reference")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _weights(H=H):
    g = torch.Generator().manual_seed(7)
    return torch.rand(H, generator=g) + 0.5, torch.randn(H, generator=g)


# Each layout builds (prefix, blocks, num_blocks, delta, block_write_idx) out of one
# memory buffer, so the reference can be run on a clone with the same aliasing.
def _prefix_is_a_live_source(buf, T, idx, H=H):  # issue 16 item 3
    b = buf[: T * 4 * H].view(T, 4, H)
    return b[:, 1], b, 2, buf[T * 4 * H: T * 5 * H].view(T, H), idx


def _delta_overlaps_prefix(buf, T, idx, H=H):  # issue 16 item 4
    rows = buf[: (T + 1) * H].view(T + 1, H)
    b = buf[(T + 1) * H: (T + 1) * H + T * 4 * H].view(T, 4, H)
    return rows[1:], b, 1, rows[:-1], idx


def _prefix_is_the_written_slot(buf, T, idx, H=H):
    b = buf[: T * 4 * H].view(T, 4, H)
    return b[:, 2], b, 2, buf[T * 4 * H: T * 5 * H].view(T, H), 2 if idx >= 0 else -1


def _prefix_is_a_live_source_no_delta(buf, T, idx, H=H):
    b = buf[: T * 4 * H].view(T, 4, H)
    return b[:, 0], b, 2, None, 2 if idx >= 0 else -1


def _delta_is_a_source(buf, T, idx, H=H):
    b = buf[: T * 4 * H].view(T, 4, H)
    return buf[T * 4 * H: T * 5 * H].view(T, H), b, 2, b[:, 0], idx


def _prefix_interleaved_with_the_bank(buf, T, idx, H=H):
    """Shares no element with the bank, though its address range meets the bank's:
    the conservative check takes the sequential path, the result is the same."""
    b = buf[: T * 5 * H].view(T, 5, H)
    return b[:, 4], b[:, :4], 2, buf[T * 5 * H: T * 6 * H].view(T, H), idx


LAYOUTS = [_prefix_is_a_live_source, _delta_overlaps_prefix, _prefix_is_the_written_slot,
           _prefix_is_a_live_source_no_delta, _delta_is_a_source,
           _prefix_interleaved_with_the_bank]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("T", [3, 13, 33, 64])
@pytest.mark.parametrize("write", [False, True], ids=["no-write", "write"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda f: f.__name__.strip("_"))
def test_aliased_arguments_give_the_spec_result(layout, write, T, path):
    norm_w, proj_w = _weights()
    buf = torch.randn(T * 7 * H, generator=torch.Generator().manual_seed(T))
    ref_buf = buf.clone()
    idx = 2 if write else -1
    prefix, blocks, nb, delta, idx = layout(buf, T, idx)
    want_args = layout(ref_buf, T, idx)
    want = reference.attn_res(want_args[0], want_args[1], want_args[2], norm_w, proj_w, 1e-6,
                              want_args[3], want_args[4])
    with cpu_path(path):
        got = eager.attn_res(prefix, blocks, nb, norm_w, proj_w, 1e-6, delta=delta,
                             block_write_idx=idx)
    assert torch.equal(buf, ref_buf), "the in-place writes differ from the spec's"
    if path == "reference":
        assert torch.equal(got, want)
    else:  # the fused mix: fp32 summation order only
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("T", [1, 13, 64, 512])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda f: f.__name__.strip("_"))
def test_aliased_arguments_give_the_spec_result_on_the_gpu(layout, T):
    """The same at K3's width on the GPU kernel (block write on)."""
    width = 7168
    norm_w, proj_w = (w.cuda() for w in _weights(width))
    buf = torch.randn(T * 7 * width, generator=torch.Generator().manual_seed(T)).cuda()
    ref_buf = buf.clone()
    prefix, blocks, nb, delta, idx = layout(buf, T, 2, width)
    w = layout(ref_buf, T, 2, width)
    want = reference.attn_res(w[0], w[1], w[2], norm_w, proj_w, 1e-6, w[3], w[4])
    got = eager.attn_res(prefix, blocks, nb, norm_w, proj_w, 1e-6, delta=delta,
                         block_write_idx=idx)
    assert torch.equal(buf, ref_buf), "the in-place writes differ from the spec's"
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_unaliased_arguments_keep_one_launch(monkeypatch):
    """The common case (separate prefix, delta and bank) still writes inside the kernel."""
    import k3fusion.kernels

    launches = []
    real = k3fusion.kernels.attn_res.attn_res
    monkeypatch.setattr(k3fusion.kernels.attn_res, "attn_res",
                        lambda *a, **k: launches.append(k) or real(*a, **k))
    norm_w, proj_w = (w.to(DEVICE) for w in _weights())
    prefix, blocks, delta = (torch.randn(*shape, device=DEVICE)
                             for shape in ((5, H), (5, 4, H), (5, H)))
    with cpu_path("kernel"):
        eager.attn_res(prefix, blocks, 2, norm_w, proj_w, 1e-6, delta=delta, block_write_idx=2)
    assert len(launches) == 1
    assert launches[0]["delta"] is not None and launches[0]["block_write_idx"] == 2


# ------------------------------------------------------------------ autograd


@pytest.mark.parametrize("written", ["prefix", "blocks"])
def test_written_tensor_that_requires_grad_is_refused(written):
    """Issue 16 item 5: like torch's in-place ops on leaves that require grad."""
    norm_w, proj_w = _weights()
    prefix, blocks, delta = torch.randn(3, H), torch.randn(3, 4, H), torch.randn(3, H)
    args = {"prefix": prefix, "blocks": blocks}
    args[written].requires_grad_(True)
    before = {k: v.detach().clone() for k, v in args.items()}
    kw = {"delta": delta} if written == "prefix" else {"block_write_idx": 2}
    with pytest.raises(RuntimeError, match=rf"{written} .*requires grad"):
        eager.attn_res(prefix, blocks, 2, norm_w, proj_w, 1e-6, **kw)
    for k, v in args.items():
        assert torch.equal(v.detach(), before[k]), f"{k} was modified"
    with torch.no_grad():  # as torch allows there
        eager.attn_res(prefix, blocks, 2, norm_w, proj_w, 1e-6, **kw)
    # Read only: allowed (the op returns a new tensor autograd cannot differentiate).
    eager.attn_res(prefix, blocks, 2, norm_w, proj_w, 1e-6)
