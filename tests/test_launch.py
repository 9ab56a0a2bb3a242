"""``kernels/_launch.py``: the counter buffers the synchronizing kernels share."""

from __future__ import annotations

import pytest
import torch

from k3fusion.kernels import _launch


def test_counter_buffer_is_cached_zeroed_and_never_freed_when_grown():
    cpu = torch.device("cpu")
    a = _launch.counter_buffer("test", cpu, 10, torch.int64)
    assert a.dtype == torch.int64 and a.numel() >= 10 and not a.any()
    assert _launch.counter_buffer("test", cpu, a.numel(), torch.int64) is a  # cached
    assert _launch.counter_buffer("other", cpu, 10, torch.int64) is not a    # per name
    b = _launch.counter_buffer("test", cpu, a.numel() + 1, torch.int64)     # grown
    assert b is not a and b.numel() > a.numel() and not b.any()
    # A captured CUDA graph may still hold the old address: it stays alive.
    assert any(r is a for r in _launch._retired)
    assert _launch.counter_buffer("test", cpu, 5, torch.int64) is b


def _split_attn_res_step(tokens: int, seed: int):
    """Inputs and a launch of the split AttnRes kernel (its programs poll for each other's
    epoch-tagged partial sums)."""
    from k3fusion.kernels.attn_res import attn_res

    g = torch.Generator(device="cuda").manual_seed(seed)
    h, blocks = 1536, 4
    dt = torch.bfloat16
    args = dict(prefix=torch.randn(tokens, h, device="cuda", generator=g).to(dt),
                blocks=torch.randn(tokens, blocks + 1, h, device="cuda", generator=g).to(dt),
                norm_w=(1 + 0.1 * torch.randn(h, device="cuda", generator=g)).to(dt),
                proj_w=(torch.randn(h, device="cuda", generator=g) / h**0.5).to(dt),
                out_norm_w=(1 + 0.1 * torch.randn(h, device="cuda", generator=g)).to(dt))
    out = torch.empty(tokens, h, device="cuda", dtype=dt)

    def step():
        attn_res(args["prefix"], args["blocks"], blocks, args["norm_w"], args["proj_w"], 1e-6,
                 out, out_norm_w=args["out_norm_w"], kind="split", chunk=256)
        return out
    return step


def _split_k_tail_step(tokens: int, seed: int):
    """Inputs and a launch of the split-K fused tail (the last program per tile resets a
    counter)."""
    from k3fusion.kernels.moe_tail import latent_moe_tail_fused

    g = torch.Generator(device="cuda").manual_seed(seed)
    latent, hidden, dt = 1024, 512, torch.bfloat16
    x = torch.randn(tokens, latent, device="cuda", generator=g).to(dt)
    s = torch.randn(tokens, hidden, device="cuda", generator=g).to(dt)
    w = (1 + 0.1 * torch.randn(latent, device="cuda", generator=g)).to(dt)
    up = (torch.randn(hidden, latent, device="cuda", generator=g) / latent**0.5).to(dt)
    return lambda: latent_moe_tail_fused(x, s, w, 1e-6, up, split_k=4)


def _attn_res_counters_ok(buf: torch.Tensor) -> bool:
    from k3fusion.kernels.attn_res import SYNC_EPOCH

    # Each of the 4 tokens' words starts with its launch counter (1 + 8 chunk records of
    # 2 * 8 + 1 words per token): one epoch per launch -- 2 eager, 8 replays -- never reset.
    used = buf[:4 * 137:137]
    return used.tolist() == [10 * SYNC_EPOCH.value] * 4


@pytest.mark.cuda
@pytest.mark.parametrize("make_step,name,counters_ok", [
    # H 1536 in 256-column chunks (6 programs, 8 record slots), 5 sources (8 rows)
    (_split_attn_res_step, "attn_res/6x8", _attn_res_counters_ok),
    (_split_k_tail_step, "moe_tail", lambda buf: not bool(buf.any())),
], ids=["attn_res_split", "moe_tail_split_k"])
def test_two_graphs_on_one_stream_replay_in_any_order(make_step, name, counters_ok):
    """Two graphs captured on one stream share that stream's cached counter buffer; every
    launch leaves it in a valid start state (the tail's arrival counters at zero; the
    AttnRes split kernel's counters one epoch further, every word of its records
    rewritten), so replaying the second graph first (and then alternating) gives each
    graph's eager result exactly."""
    from k3fusion.kernels import _launch

    steps = [make_step(4, seed) for seed in (1, 2)]
    stream = torch.cuda.Stream()
    graphs, outs = [], []
    with torch.cuda.stream(stream):
        # Eager first, on the capture stream: the results to expect, and the stream's
        # counter buffer cached before any capture (so the graphs share it).
        want = [step().clone() for step in steps]
        torch.cuda.synchronize()
        key = (name, "cuda", torch.cuda.current_device(), stream.cuda_stream)
        counters = _launch._counter_buffers[key]
        for step in steps:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                outs.append(step())
            graphs.append(graph)
    for order in ((1, 0), (0, 1), (1, 1, 0, 0)):
        for i in order:
            graphs[i].replay()
            torch.cuda.synchronize()
            assert torch.equal(outs[i], want[i]), f"graph {i} in order {order}"
    assert _launch._counter_buffers[key] is counters and counters_ok(counters)
