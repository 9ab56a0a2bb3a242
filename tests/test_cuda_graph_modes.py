"""Decode as servers run it (issue 29): ``mode="reduce-overhead"`` (Inductor's CUDA-graph
trees) and ``mode="max-autotune"`` with ``backend="k3fusion"`` and with ``install()``, on
the tiny K3 model and a K3-width stack; decode steps at each token count, every output
within the bound of eager's (:func:`_decode`). CUDA only.

Before issue 29 the first reduce-overhead call failed at K3 width ("Detected 1 tensor(s)
in the cudagraph pool not tracked as outputs": a cached scratch buffer allocated in the
tree's warm-up, in its private pool).
"""

from __future__ import annotations

import copy

import pytest
import torch

import k3fusion
from k3fusion.bench.decoder import ERROR_RATIO, _errors, _ulp, build_model, stack_config

pytestmark = [pytest.mark.cuda,
              pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")]

def _logits(out):
    return out.logits if hasattr(out, "logits") else out


#: A step's own max error at most this many times eager's (+ 1 ulp): a stale or wrong
#: output is off by the logits' own size, far beyond; a rounding reaches 2.2x (below).
STEP_GUARD = 4.0


def _decode(model, compiled, tokens_list, steps, vocab) -> float:
    """``steps`` decode calls per token count, held to the suite's model-level bf16 rule
    (the decoder benchmark's, :data:`ERROR_RATIO`) over the steps of each token count:
    against an fp64 copy of the model, the compiled output's largest max error within
    ``ERROR_RATIO x`` eager's largest (+ 1 ulp of the output's size) and its mean error,
    averaged over the steps, within ``ERROR_RATIO x`` eager's; each step's max error
    within :data:`STEP_GUARD` x eager's. Returns the worst ratio of error to bound (<= 1
    passes).

    Why over the steps: an 8-layer K3-width stack of random weights amplifies each
    rounding (eager's bf16 logits are off the fp64 ones by up to 2.3), so the ratio of two
    such errors at one step is heavy-tailed. Measured on the H200 (2026-12-03, 40 steps):
    default Inductor's per-step ratio averages 0.38 of the bound and peaks at 0.63,
    k3fusion's 0.43 and 0.70, k3fusion without its q/kv fusion 0.44 and 1.05; no one
    fusion carries the tail (docs/testing.md, "Model-level rule over decode steps")."""
    g = torch.Generator(device="cuda").manual_seed(0)
    oracle = copy.deepcopy(model).double()
    worst = 0.0
    for tokens in tokens_list:
        totals = dict(c_max=0.0, e_max=0.0, c_mean=0.0, e_mean=0.0, step=0.0)
        for _ in range(steps):
            ids = torch.randint(0, vocab, (1, tokens), device="cuda", generator=g)
            with torch.no_grad():
                got = _logits(compiled(ids)).double()  # a copy (a tree reuses its outputs)
                want = _logits(model(ids)).double()
                exact = _logits(oracle(ids))
            e_max, e_mean = _errors(want, exact)
            c_max, c_mean = _errors(got, exact)
            ulp = _ulp(float(exact.abs().max()), torch.bfloat16)
            totals["step"] = max(totals["step"], c_max / (STEP_GUARD * e_max + ulp))
            totals["c_max"], totals["e_max"] = max(totals["c_max"], c_max), max(totals["e_max"],
                                                                                e_max)
            totals["c_mean"] += c_mean / steps
            totals["e_mean"] += e_mean / steps
        ratio = max(totals["step"], totals["c_max"] / (ERROR_RATIO * totals["e_max"] + ulp),
                    totals["c_mean"] / (ERROR_RATIO * totals["e_mean"]))
        print(f"T={tokens}: {totals}: {ratio:.3g} of the bound")
        worst = max(worst, ratio)
    del oracle
    return worst


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    k3fusion.reset_match_counts()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("mode", ["reduce-overhead", "default"])
@pytest.mark.parametrize("width", ["tiny", "k3"])
def test_decode_steps_in_a_cuda_graph_mode(width, mode):
    layers = 8 if width == "k3" else 2  # K3 width: up to 8 completed blocks
    config = stack_config(layers, width=width, attn_res_block_size=1) if width == "k3" else \
        stack_config(layers, width="tiny")
    model = build_model(config, seed=0, device="cuda")
    compiled = torch.compile(model, backend="k3fusion",
                             mode=None if mode == "default" else mode)
    worst = _decode(model, compiled, (1, 4, 8, 64), 200,
                    config.vocab_size)
    counts = k3fusion.match_counts()
    assert counts["qkv_rmsnorm"] and counts["attn_res"] and counts["moe_tail"], counts
    assert worst <= 1, worst


def test_install_with_reduce_overhead_and_max_autotune():
    config = stack_config(2, width="tiny")
    model = build_model(config, seed=0, device="cuda")
    k3fusion.install()
    try:
        for mode in ("reduce-overhead", "max-autotune"):
            torch._dynamo.reset()
            k3fusion.reset_match_counts()
            compiled = torch.compile(model, mode=mode)
            worst = _decode(model, compiled, (1, 8), 20, config.vocab_size)
            assert k3fusion.match_counts()["attn_res"], mode
            assert worst <= 1, (mode, worst)
    finally:
        k3fusion.uninstall()


def test_backend_with_max_autotune():
    config = stack_config(2, width="tiny")
    model = build_model(config, seed=0, device="cuda")
    compiled = torch.compile(model, backend="k3fusion", mode="max-autotune")
    worst = _decode(model, compiled, (1, 8), 20, config.vocab_size)
    assert k3fusion.match_counts()["attn_res"]
    assert worst <= 1, worst
