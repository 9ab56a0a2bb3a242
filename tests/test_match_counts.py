"""``k3fusion.match_counts()``: one key rule, and counts that survive Inductor's caches.

A compile served from the FX graph cache runs no custom pass; the counts come back through
the counter deltas Inductor stores with each cached graph. Checked within one process
(after ``torch._dynamo.reset()``, backend and ``install()``) and across two processes
sharing one fresh cache directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
from torch import nn

import k3fusion
from k3fusion.counters import FUSIONS, record_matches
from k3fusion.models.kimi_k3 import KimiK3RMSNorm

ROOT = Path(__file__).resolve().parents[1]


class _MLAPair(nn.Module):
    """The q/kv norm pair of MLA: two projections of one hidden state, each RMS-normalized."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q_a_proj = nn.Linear(64, 48, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(64, 40, bias=False)
        self.q_a_layernorm = KimiK3RMSNorm(48)
        self.kv_a_layernorm = KimiK3RMSNorm(32)

    def forward(self, h):
        kv_c, rope = self.kv_a_proj_with_mqa(h).split([32, 8], dim=-1)
        return self.q_a_layernorm(self.q_a_proj(h)), self.kv_a_layernorm(kv_c), rope


def test_every_fusion_is_a_key_and_the_names_are_the_patterns():
    from k3fusion.patterns import attn_res, moe_tail, qkv_rmsnorm

    assert set(FUSIONS) == {qkv_rmsnorm.FUSION_NAME, attn_res.FUSION_NAME,
                            attn_res.HANDOFF_NAME, moe_tail.FUSION_NAME}
    k3fusion.reset_match_counts()
    assert k3fusion.match_counts() == dict.fromkeys(FUSIONS, 0)


def test_reset_and_a_cleared_torch_counter_start_from_zero():
    from torch._dynamo.utils import counters

    k3fusion.reset_match_counts()
    record_matches("attn_res", 3)
    record_matches("moe_tail", 0)
    assert k3fusion.match_counts() == {**dict.fromkeys(FUSIONS, 0), "attn_res": 3}
    k3fusion.reset_match_counts()
    record_matches("attn_res", 2)
    assert k3fusion.match_counts()["attn_res"] == 2
    counters.clear()  # what torch's own TestCase does between tests
    assert k3fusion.match_counts() == dict.fromkeys(FUSIONS, 0)
    record_matches("qkv_rmsnorm", 1)
    assert k3fusion.match_counts()["qkv_rmsnorm"] == 1
    k3fusion.reset_match_counts()


@pytest.mark.parametrize("fusion, n", [("nope", 1), ("attn_res", -1), ("attn_res", True),
                                       ("attn_res", 1.0)])
def test_record_matches_rejects_bad_arguments(fusion, n):
    with pytest.raises(ValueError, match="fusion" if fusion == "nope" else "n must"):
        record_matches(fusion, n)


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """FX graph + AOTAutograd caches on, in a directory no other test has written."""
    from k3fusion import backend as k3backend

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    saved_pass = inductor_config.post_grad_custom_post_pass
    saved_installed = list(k3backend._previous)
    torch._dynamo.reset()
    try:
        with inductor_config.patch(fx_graph_cache=True, fx_graph_remote_cache=False), \
                functorch_config.patch(enable_autograd_cache=True,
                                       enable_remote_autograd_cache=False):
            yield
    finally:
        torch._dynamo.reset()
        k3fusion.reset_match_counts()
        inductor_config.post_grad_custom_post_pass = saved_pass
        k3backend._previous[:] = saved_installed


@pytest.mark.parametrize("way", ["backend", "install"])
def test_counts_survive_a_cache_hit_in_one_process(way, fresh_cache):
    from torch._dynamo.utils import counters

    model, h = _MLAPair().eval(), torch.randn(2, 5, 64)
    if way == "install":
        k3fusion.install()
    seen = []
    for _ in range(2):  # cold compile, then the same graph from the cache
        torch._dynamo.reset()
        k3fusion.reset_match_counts()
        hits = counters["inductor"]["fxgraph_cache_hit"]
        with torch.no_grad():
            compiled = torch.compile(model, backend="k3fusion" if way == "backend" else "inductor")
            compiled(h)
        seen.append((k3fusion.match_counts(), counters["inductor"]["fxgraph_cache_hit"] - hits))
    if way == "install":
        k3fusion.uninstall()
    (cold, cold_hits), (warm, warm_hits) = seen
    assert (cold_hits, warm_hits) == (0, 1)  # the second compile really was a cache hit
    assert cold == warm == {**dict.fromkeys(FUSIONS, 0), "qkv_rmsnorm": 1}


def test_training_counts_survive_an_aot_autograd_cache_hit(fresh_cache):
    """A training compile (forward and backward) served from the AOTAutograd cache counts
    what the joint-graph pass fused when it compiled: the counts ride into the forward
    graph's compile, whose counter changes the cache replays. Before, a warm training
    compile counted 0 while it ran the fused ops."""
    from torch._dynamo.utils import counters

    model, h = _MLAPair().train(), torch.randn(2, 5, 64)
    seen = []
    for _ in range(2):  # cold, then from the AOTAutograd cache
        torch._dynamo.reset()
        k3fusion.reset_match_counts()
        hits = counters["aot_autograd"]["autograd_cache_hit"]
        compiled = torch.compile(model, backend="k3fusion")
        out = compiled(h)
        sum(o.float().sum() for o in out).backward()
        seen.append((k3fusion.match_counts(), counters["aot_autograd"]["autograd_cache_hit"] - hits))
    (cold, cold_hits), (warm, warm_hits) = seen
    assert (cold_hits, warm_hits) == (0, 1)  # the second compile really was a cache hit
    assert cold == warm == {**dict.fromkeys(FUSIONS, 0), "qkv_rmsnorm": 1}


_CHILD = textwrap.dedent("""
    import json, sys
    import torch
    from torch._dynamo.utils import counters
    import k3fusion
    sys.path.insert(0, {tests!r})
    from test_match_counts import _MLAPair

    way = sys.argv[1]
    if way == "install":
        k3fusion.install()
    k3fusion.reset_match_counts()
    with torch.no_grad():
        torch.compile(_MLAPair().eval(),
                      backend="k3fusion" if way == "backend" else "inductor")(torch.randn(2, 5, 64))
    print(json.dumps({{"counts": k3fusion.match_counts(),
                       "hits": counters["inductor"]["fxgraph_cache_hit"]}}))
""")


@pytest.mark.slow  # two fresh interpreters
@pytest.mark.parametrize("way", ["backend", "install"])
def test_counts_survive_a_cache_hit_in_another_process(way, tmp_path):
    env = {**os.environ, "TORCHINDUCTOR_FX_GRAPH_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    script = tmp_path / "child.py"
    script.write_text(_CHILD.format(tests=str(ROOT / "tests")))
    runs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, str(script), way], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert [r["hits"] for r in runs] == [0, 1]  # cold, then served from the shared cache
    assert runs[0]["counts"] == runs[1]["counts"] == {**dict.fromkeys(FUSIONS, 0),
                                                      "qkv_rmsnorm": 1}
