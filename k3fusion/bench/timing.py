"""Timing under CUDA-graph replay, and the HBM floor every table is read against."""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from k3fusion.kernels._scratch import graphs_die_within

__all__ = ["HBM_BYTES_PER_S", "hbm_floor_us", "cuda_graph_us", "call_loop_us",
           "sets_to_outgrow_l2"]

#: Device-to-device copy bandwidth measured on the H200 (bytes read + written per s).
HBM_BYTES_PER_S = 4.3e12


def hbm_floor_us(bytes_moved: float) -> float:
    """The time just moving ``bytes_moved`` through HBM once takes, in microseconds."""
    return bytes_moved / HBM_BYTES_PER_S * 1e6


def cuda_graph_us(fn: Callable[..., object], arg_sets: Sequence[tuple] = ((),), *,
                  calls_per_graph: int = 20, reps: int = 30) -> float:
    """Median microseconds of one ``fn(*args)`` inside a CUDA graph.

    ``calls_per_graph`` back-to-back calls are captured into one graph, so the graph's
    own launch cost is spread out, as in a model step captured whole. Call ``i`` reads
    ``arg_sets[i % len(arg_sets)]``: give enough sets that together they outgrow the L2
    cache (:func:`sets_to_outgrow_l2`), or the numbers measure the cache, not HBM.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for args in arg_sets[:3]:  # compile/autotune outside the capture
            fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    # The graph dies here: its launches' scratch words serve the next timing's capture.
    with graphs_die_within():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls_per_graph):
                fn(*arg_sets[i % len(arg_sets)])
        graph.replay()
        torch.cuda.synchronize()
        us = _median_us(graph.replay, reps, calls_per_graph)
        del graph
    return us


def call_loop_us(fn: Callable[..., object], arg_sets: Sequence[tuple] = ((),), *,
                 calls: int = 20, reps: int = 30) -> float:
    """Median microseconds of one ``fn(*args)`` called from Python, ``calls`` back to back
    per timed run: for a function that captures and replays its own CUDA graphs
    (``mode="reduce-overhead"``), which cannot run inside :func:`cuda_graph_us`'s capture.
    Guards, input copies and launch overhead are included, as a server calling it sees them.
    """
    for args in arg_sets[:3]:  # compile, record the trees' graphs
        fn(*args)
    torch.cuda.synchronize()

    def run():
        for i in range(calls):
            fn(*arg_sets[i % len(arg_sets)])

    return _median_us(run, reps, calls)


def _median_us(run: Callable[[], object], reps: int, calls: int) -> float:
    """Median over ``reps`` timed ``run()``s (CUDA events) of the microseconds per call,
    ``run`` making ``calls`` calls."""
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    times.sort()
    return times[len(times) // 2]


#: Bytes the rotated inputs of one timing must exceed: twice the H200's 60 MB L2.
L2_FLUSH_BYTES = 120e6


def sets_to_outgrow_l2(bytes_per_set: float, most: int = 20) -> int:
    """How many distinct input sets to rotate through (at most ``most``)."""
    return max(1, min(most, math.ceil(L2_FLUSH_BYTES / max(bytes_per_set, 1))))
