"""The scratch words the synchronizing kernels exchange data through, on the GPU.

An eager launch zeroes words of its own; a captured launch keeps an arena slice of its own
for good (``kernels/_scratch.py``; its rules are tested on CPU in ``test_scratch.py``).
Before issue 29 launches took words from a cache per (kernel, device, stream): two graphs
captured on one stream shared them, and replayed at once on two streams the AttnRes split
kernel waited forever for an epoch that never came; a CUDA-graph tree's warm-up left the
cached buffer alive in its private pool. Between issue 29 and issue 30 every captured
launch zeroed its words in the graph (a memset node, about 1.1 us a replay).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from k3fusion.kernels import _scratch


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
                 out, out_norm_w=args["out_norm_w"], shape=dict(kind="split", chunk=256))
        return out
    return step


def _split_k_tail_step(tokens: int, seed: int):
    """Inputs and a launch of the split-K fused tail (the last program per tile finishes
    the tile: arrival counters)."""
    from k3fusion.kernels.moe_tail import latent_moe_tail_fused

    g = torch.Generator(device="cuda").manual_seed(seed)
    latent, hidden, dt = 1024, 512, torch.bfloat16
    x = torch.randn(tokens, latent, device="cuda", generator=g).to(dt)
    s = torch.randn(tokens, hidden, device="cuda", generator=g).to(dt)
    w = (1 + 0.1 * torch.randn(latent, device="cuda", generator=g)).to(dt)
    up = (torch.randn(hidden, latent, device="cuda", generator=g) / latent**0.5).to(dt)
    return lambda: latent_moe_tail_fused(x, s, w, 1e-6, up, split_k=4)


@pytest.mark.cuda
def test_captured_split_k_tail_keeps_its_counters_and_resets_them():
    """A captured split-K tail takes arena words (no memset node); after every replay its
    last arrivals have reset each counter to 0, and the result equals eager's."""
    from k3fusion.kernels import moe_tail as kernel_mod

    step = _split_k_tail_step(4, 3)
    stream = torch.cuda.Stream()
    made, real = [], kernel_mod.launch_scratch
    with torch.cuda.stream(stream):
        want = step().clone()  # the warm-up makes the arena
        torch.cuda.synchronize()
        handed = _scratch.arena_stats()["bytes_handed_out"]
        kernel_mod.launch_scratch = lambda *a, **k: made.append(real(*a, **k)) or made[-1]
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                out = step()
        finally:
            kernel_mod.launch_scratch = real
    assert len(made) == 1 and made[0].dtype == torch.int32
    assert _scratch.arena_stats()["bytes_handed_out"] >= handed + made[0].numel() * 4
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want) and not made[0].any()


@pytest.mark.cuda
def test_the_arena_escapes_a_pool_that_routes_this_threads_allocations(monkeypatch):
    """A CUDA-graph tree's warm-up routes its thread's allocations to the tree's pool,
    which must hold nothing but its outputs afterwards: the arena, made in such a
    warm-up, comes from the default pool."""
    monkeypatch.setattr(_scratch, "_arenas", {})
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        inside = torch.empty(1024, device="cuda")  # routed (the check can see a routing)
        _scratch.launch_scratch(torch.device("cuda"), 8, torch.int64, reusable=True)
    arena = _scratch._arenas[torch.cuda.current_device()][-1].words
    segments = [(seg["address"], seg["address"] + seg["total_size"]) for seg in pool.snapshot()]

    def in_pool(ptr):
        return any(lo <= ptr < hi for lo, hi in segments)
    assert in_pool(inside.data_ptr()) and not in_pool(arena.data_ptr())
    del inside


@pytest.mark.cuda
@pytest.mark.parametrize("make_step", [_split_attn_res_step, _split_k_tail_step],
                         ids=["attn_res_split", "moe_tail_split_k"])
def test_two_graphs_on_one_stream_replay_in_any_order(make_step):
    """Two graphs captured on one stream, replayed in any order: each gives its eager
    result exactly (each owns the words of its launch)."""
    steps = [make_step(4, seed) for seed in (1, 2)]
    stream = torch.cuda.Stream()
    graphs, outs = [], []
    with torch.cuda.stream(stream):
        want = [step().clone() for step in steps]
        torch.cuda.synchronize()
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


_CONCURRENT = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, "tests")
    from test_launch import _split_attn_res_step, _split_k_tail_step
    make = {"attn_res": _split_attn_res_step, "moe_tail": _split_k_tail_step}[sys.argv[1]]
    steps = [make(4, 1), make(2, 2)]          # two graphs of different T
    capture = torch.cuda.Stream()
    graphs, outs, want = [], [], []
    with torch.cuda.stream(capture):
        want = [s().clone() for s in steps]
        torch.cuda.synchronize()
        for s in steps:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=capture):
                outs.append(s())
            graphs.append(g)
    if sys.argv[2] == "same":                  # one graph, replayed on both streams
        graphs, outs, want = graphs[:1] * 2, outs[:1] * 2, want[:1] * 2
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for i in range(1000):                      # both graphs in flight at once
        for g, st in zip(graphs, streams):
            with torch.cuda.stream(st):
                g.replay()
        if i % 100 == 99:
            torch.cuda.synchronize()
            assert all(torch.equal(o, w) for o, w in zip(outs, want)), i
    torch.cuda.synchronize()
    assert all(torch.equal(o, w) for o, w in zip(outs, want))
    print("ok")
""")


@pytest.mark.cuda
@pytest.mark.parametrize("graphs", ["two", "same"])
@pytest.mark.parametrize("kernel", ["attn_res", "moe_tail"])
def test_graphs_replayed_concurrently_on_two_streams_never_hang(kernel, graphs):
    """Two graphs of different T -- or one graph twice (CUDA runs one executable graph's
    replays one after another, which its words rely on) -- replayed on two streams at
    once, 1000 times, in a child process under a timeout (a spin-wait that never ends
    cannot be interrupted in-process): no hang, every result right."""
    try:
        proc = subprocess.run([sys.executable, "-c", _CONCURRENT, kernel, graphs],
                              capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{kernel}: graphs replayed on two streams did not finish in 180 s (a hang)")
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]
