"""Test setup: Triton interpreter on CPU-only machines, hypothesis profiles, ``cuda`` marker.

Tests import their helpers (``graph_utils``, ``_tolerances``, ...) as top-level modules:
``tests/`` is on ``sys.path`` (pytest's default import mode puts it there; this file keeps
it there under any mode, and spawned ranks inherit it).
"""

import os
import sys
import zlib
from pathlib import Path

# Under pytest-xdist (one worker per core): one thread per worker for torch's CPU ops and
# Inductor's compiles -- workers that each start a thread per core oversubscribe the CPU
# (the 2-core suite ran 1.3x slower than with one thread each). Before torch is imported.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

# Triton reads TRITON_INTERPRET when a kernel is *decorated*, i.e. when k3fusion's kernel
# modules are imported, so this must run before anything imports k3fusion.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

import k3fusion.pass_manager  # noqa: E402

# A fusion's own error fails the test instead of leaving the graph unfused with a warning
# (what users get); tests of that fallback switch it back per test.
k3fusion.pass_manager.RAISE_INTERNAL_ERRORS = True

settings.register_profile(
    "ci", deadline=None, max_examples=25, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "dev", deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


#: ``-n auto`` workers when a GPU is visible: every worker holds its own CUDA context and
#: caches, and K3-width tests take up to 30 GB each (16 workers ran an H200 out of memory).
GPU_WORKERS = 4


def pytest_xdist_auto_num_workers(config):
    if torch.cuda.is_available():
        return min(GPU_WORKERS, os.cpu_count() or 1)
    return None  # xdist's own choice: one per core


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)


@pytest.fixture(autouse=True)
def _seeded_global_rng(request):
    """Every test starts from its own fixed global RNG state (a hash of its id), whatever
    ran before it in its worker: a module built with torch's default init gets the same
    weights in any test order, so a CI failure reproduces alone."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


#: ``PYTEST_FAIL_LOG=path``: each failure's test id and the end of its report appended to
#: ``path`` as it happens -- a run cut off by a time limit (a device call) still names them.
FAIL_LOG = os.environ.get("PYTEST_FAIL_LOG")


def pytest_runtest_logreport(report):
    if FAIL_LOG and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:
        lines = str(report.longrepr).strip().splitlines()[-8:]
        with open(FAIL_LOG, "a") as f:
            f.write(f"{report.nodeid} [{report.when}]\n" + "".join(f"    {x}\n" for x in lines))


@pytest.fixture
def pass_runs(monkeypatch):
    """(graph before, graph after) for every K3FusionPass call, however it was installed."""
    import copy

    from k3fusion.pass_manager import K3FusionPass

    runs = []
    original = K3FusionPass.__call__

    def recording(self, graph):
        before = copy.deepcopy(graph)
        original(self, graph)
        runs.append((before, copy.deepcopy(graph)))

    monkeypatch.setattr(K3FusionPass, "__call__", recording)
    return runs
