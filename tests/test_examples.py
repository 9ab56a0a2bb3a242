"""Every example runs, as a user runs it: ``python examples/<name>.py`` in a fresh process.

Inductor's caches are on (one fresh cache directory for the module). The main example
runs twice in a row: the second run is served from the cache and must print the same,
non-empty match counts as the first. The other compiling examples run once (their
counts on a cache hit: ``test_match_counts.py`` checks both entry points, the backend
and ``install()``, in another process; a warm rerun of each here cost the suite about
30 s of a 2-core CI machine).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
COMPILING = ["compile_backend", "install_into_inductor", "attn_res", "moe_tail"]
#: Run twice (cold, then from the cache).
RERUN = ["compile_backend"]
EAGER = ["eager_patch", "explain"]

pytestmark = pytest.mark.slow  # each run is a fresh interpreter and a compile


def test_every_example_is_tested():
    assert sorted(p.stem for p in EXAMPLES.glob("*.py")) == sorted(COMPILING + EAGER)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("inductor-cache")


def _run(name: str, cache_dir: Path) -> subprocess.CompletedProcess:
    """One run of example ``name``. The rerun one starts from the empty ``cache_dir`` (its
    second run must be a cache hit); the others use the machine's Inductor cache, as a
    user's second script does (C++ kernels the suite compiled are not compiled again)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as a user has it
    env.update(TORCHINDUCTOR_FX_GRAPH_CACHE="1", TORCHINDUCTOR_AUTOGRAD_CACHE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    if name in RERUN:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
    return subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=400)


@pytest.fixture(scope="module")
def runs(cache_dir) -> dict[str, list[subprocess.CompletedProcess]]:
    """Every example's runs, in order per example (the main one twice: cold, then from
    the cache), the examples side by side: each run is a fresh interpreter that mostly
    keeps one core busy, so a 2-core machine takes about half the time."""
    def runs_of(name):
        return [_run(name, cache_dir) for _ in range(2 if name in RERUN else 1)]

    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {name: pool.submit(runs_of, name) for name in COMPILING + EAGER}
        return {name: f.result() for name, f in futures.items()}


def _stdout(proc: subprocess.CompletedProcess, name: str) -> str:
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc.stdout


def _match_counts(out: str) -> list[dict[str, int]]:
    return [ast.literal_eval(m) for m in re.findall(r"matches: (\{[^}]*\})", out)]


@pytest.mark.parametrize("name", COMPILING)
def test_compiling_example_fuses_and_a_cache_hit_prints_the_same_counts(name, runs):
    outs = [_stdout(proc, name) for proc in runs[name]]
    cold = outs[0]
    counts = _match_counts(cold)
    assert counts and all(any(c.values()) for c in counts), cold
    assert len(outs) == (2 if name in RERUN else 1)
    for warm in outs[1:]:
        assert _match_counts(warm) == counts, (cold, warm)
    if name == "compile_backend":  # every site of the model fused
        sites = ast.literal_eval(re.search(r"sites: (\{[^}]*\})", cold).group(1))
        assert {k: counts[0][k] for k in sites} == sites


def test_eager_patch_example(runs):
    out = _stdout(runs["eager_patch"][0], "eager_patch")
    assert "skipped: {}" in out and "self_attn" in out and "apply_attn_res" in out, out
    rel = float(re.search(r"max \|patched - original\| / max\|original\|: (\S+)", out).group(1))
    assert rel < 3e-2  # bf16 roundings through two layers (the main job's bound)


def test_explain_example(runs):
    out = _stdout(runs["explain"][0], "explain")
    if importlib.util.find_spec("k3fusion.explain") is None:
        assert "k3fusion.explain is not in this version" in out
    else:  # the report once: every fusion of the tiny model, counted
        assert "not in this version" not in out, out
        for line in ("attn_res: 5 fused", "qkv_rmsnorm: 2 fused", "moe_tail: 2 fused"):
            assert out.count(line) == 1, out
