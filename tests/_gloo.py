"""Real multi-process torch.distributed for the tests: spawn the ranks (gloo on CPU, or
NCCL with one GPU each), run one function on each, and return what each rank returned."""

from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Callable

import torch

__all__ = ["run_ranks"]


def _entry(rank: int, world: int, port: int, out_path: str, body: Callable, args: tuple,
           backend: str) -> None:
    import torch.distributed as dist

    init = dict(init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    if backend == "nccl":
        # NVLink multicast off (what the device machines need).
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", rank), **init)
    else:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=timedelta(seconds=60), **init)
    ok = True
    try:
        result = body(rank, world, dist.group.WORLD, *args)
        with open(f"{out_path}.{rank}", "wb") as f:
            pickle.dump(result, f)
    except BaseException:
        traceback.print_exc()
        ok = False
    finally:
        dist.destroy_process_group()
    # Skip interpreter teardown: a gloo/inductor background thread torn down late can
    # abort the process ("terminate called without an active exception") after the
    # work is done and reported, which would turn a pass into a spurious failure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if ok else 1)


def run_ranks(body: Callable, world: int, *args, timeout_s: float = 150.0,
              backend: str = "gloo") -> list:
    """``body(rank, world, group, *args)`` on ``world`` spawned ranks of ``backend`` ("gloo",
    or "nccl": rank r on GPU r); their return values in rank order. ``body`` must be a
    module-level function (it is pickled)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "rank")
        procs = [ctx.Process(target=_entry, args=(r, world, port, out_path, body, args,
                                                  backend))
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [i for i, p in enumerate(procs) if p.is_alive()]
        for i in hung:
            procs[i].terminate()
            procs[i].join(5)
        if hung:
            raise RuntimeError(f"world {world}: ranks {hung} did not finish in {timeout_s}s")
        codes = [p.exitcode for p in procs]
        missing = [r for r in range(world) if not os.path.exists(f"{out_path}.{r}")]
        if any(codes) or missing:
            raise RuntimeError(f"world {world}: rank exit codes {codes}, no result from ranks "
                               f"{missing} (see captured stderr)")
        results = []
        for r in range(world):
            with open(f"{out_path}.{r}", "rb") as f:
                results.append(pickle.load(f))
        return results
