"""``k3fusion::attn_res`` reads a sources-first bank in place (issue 15, item 2): a bank
``[slots, B, T, H]`` (``torch.stack(blocks + [partial])`` order, or a preallocated bank)
is handed to the op as ``bank.movedim(0, -2)``, a ``[B, T, slots, H]`` view whose block
stride is ``B * T * H``. The kernel takes any token and block stride, so no copy is made;
these tests compare both layouts with the spec bit for bit where the kernel is the same."""

from __future__ import annotations

import pytest
import torch

from k3fusion import reference


def _case(layout: str, lead, slots: int, n: int, hidden: int, dtype, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    def r(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).to(dtype).to(device)
    prefix = r(*lead, hidden)
    if layout == "sources-first":
        bank = r(slots, *lead, hidden).movedim(0, -2)
    else:
        bank = r(*lead, slots, hidden)
    norm_w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(device)
    proj_w = (torch.randn(hidden, generator=g) / hidden ** 0.5).to(dtype).to(device)
    return prefix, bank, n, norm_w, proj_w


def _run(prefix, bank, n, norm_w, proj_w):
    (out,) = torch.ops.k3fusion.attn_res(prefix, bank, n, norm_w, proj_w, 1e-6)
    return out


@pytest.mark.parametrize("tokens", [1, 5, 13])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_sources_first_bank_equals_sources_last(tokens, dtype):
    """Same values in both layouts -> the same bits (the kernel reads by strides)."""
    first = _case("sources-first", (2, tokens), 5, 4, 48, dtype)
    last_bank = first[1].contiguous()
    assert first[1].stride(-2) == 2 * tokens * 48  # a view, never a copy
    out_first = _run(*first)
    out_last = _run(first[0], last_bank, *first[2:])
    assert torch.equal(out_first, out_last)
    spec = reference.attn_res(first[0].reshape(-1, 48).clone(), last_bank.reshape(-1, 5, 48),
                              4, first[3], first[4], 1e-6).reshape(out_first.shape)
    torch.testing.assert_close(out_first.float(), spec.float(),
                               **({} if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)))


def test_sources_first_view_is_not_copied(monkeypatch):
    """The launcher gets the caller's storage: the bank view's block stride reaches it."""
    from k3fusion.kernels import attn_res as kernel_module

    seen = {}
    real = kernel_module.attn_res

    def spy(prefix, blocks, *a, **k):
        seen["stride"] = blocks.stride()
        seen["ptr"] = blocks.data_ptr()
        return real(prefix, blocks, *a, **k)

    monkeypatch.setattr(kernel_module, "attn_res", spy)
    prefix, bank, n, nw, pw = _case("sources-first", (2, 3), 9, 8, 32, torch.float32)
    from k3fusion.kernels._launch import interpreter_enabled
    if not interpreter_enabled():
        pytest.skip("the CPU path without the interpreter is the spec, not the kernel")
    _run(prefix, bank, n, nw, pw)
    assert seen["ptr"] == bank.data_ptr() and seen["stride"] == (32, 2 * 3 * 32, 1)


@pytest.mark.cuda
@pytest.mark.parametrize("tokens", [1, 128, 4096])
@pytest.mark.parametrize("layout", ["sources-first", "sources-last"])
def test_real_size_on_gpu(layout, tokens):
    """H 7168, 9 sources (8 blocks + prefix), bf16, against the spec."""
    prefix, bank, n, nw, pw = _case(layout, (tokens,), 9, 8, 7168, torch.bfloat16, "cuda")
    out = _run(prefix, bank, n, nw, pw)
    spec = reference.attn_res(prefix.clone(), bank.contiguous(), n, nw, pw, 1e-6)
    torch.testing.assert_close(out, spec, atol=2 ** -6, rtol=2 ** -6)
