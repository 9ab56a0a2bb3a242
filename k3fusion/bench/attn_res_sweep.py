"""Sweep the AttnRes step's launch shapes over widths, block counts and token counts (issue 20).

``python -m k3fusion.bench.attn_res_sweep --out DIR [--quick] [--skip-inductor] [--dry-run]
[--peers DIR]``

At every ``(H, nb, T)`` point, under CUDA-graph replay: every candidate launch shape
(:func:`candidates`), default Inductor, and at ``T = 1`` a bytes-only latency floor, each
candidate checked against ``k3fusion.reference.attn_res`` first (:func:`check`), and each
peer kernel of ``--peers`` (:mod:`k3fusion.bench.peers`, :func:`check_peer`). Compiles
run first in a pool of workers that fill the on-disk caches. Writes
``DIR/attn_res_sweep.json`` after every ``(H, nb)`` and prints the selection table the data
implies; ``--tables-from JSON`` prints it again. ``--dry-run``: everything at tiny sizes in
Triton's CPU interpreter, not timed (the CPU test of this script's logic).

How it measures (the grid, the candidates, the checks, the tables):
docs/bench-methods.md, section "``python -m k3fusion.bench.attn_res_sweep``".
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, wait
from dataclasses import replace
from pathlib import Path

import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F
import triton
import triton.language as tl

from k3fusion import reference
from k3fusion.kernels import attn_res as attn_res_kernels
from k3fusion.kernels.attn_res import attn_res as launch
from k3fusion.kernels.attn_res import TRIGGERS, pick_launch_shape, tile_rows

from . import peers as peer_kernels
from .common import add_peers_argument, add_scratch_argument, environment, hf_rms_norm
from .timing import cuda_graph_us, hbm_floor_us, sets_to_outgrow_l2

HIDDENS = (2048, 4096, 7168)
NUM_BLOCKS = tuple(range(9))
TOKENS = (1, 8, 32, 128, 512, 4096)
QUICK = dict(hiddens=(2048, 7168), num_blocks=(1, 4, 8), tokens=(1, 32, 512))
#: ``--chosen-only``'s sizes: every width and block count at the issue's token counts.
CHOSEN = dict(hiddens=HIDDENS, num_blocks=NUM_BLOCKS, tokens=(1, 128, 4096))
#: ... with default Inductor at the issue table's block counts only (its compiles dominate).
CHOSEN_INDUCTOR_BLOCKS = (1, 4, 8)
#: Tiny sizes for ``--dry-run`` (CPU interpreter): a width below a power of two, both sides
#: of the T thresholds in :func:`candidates`.
DRY = dict(hiddens=(48,), num_blocks=(0, 5), tokens=(1, 3))
BANK_SLOTS = 9
EPS = 1e-6
#: Output bound of the check, in bf16 ulps of rms_norm of the kernel's own mix (:func:`check`).
OUT_ULPS = 3.0
#: Candidates of the row kernel: sources per tile, warps.
ROW_TILES = (1, 2, 4, 8, 16)
ROW_WARPS = (4, 8, 16)
#: The row kernel's pipelined (prefill) shapes: (sources per tile, warps, stages).
ROW_PIPELINED = ((1, 2, 3), (1, 4, 2), (1, 4, 3), (1, 8, 3), (2, 8, 3))
#: ... and its unpipelined ones past 128 tokens (``(1, 4)``: vLLM's NVIDIA kernel's
#: prefill form): (sources per tile, warps).
ROW_PREFILL = ((4, 16), (2, 8), (1, 4), (1, 8))
#: Most tokens at which the split kernel's multi-program shapes, and the row kernel's early
#: first tile, are candidates (the forms for grids of fewer programs than SMs;
#: ``--small-grid-tokens``).
SMALL_GRID_MAX_TOKENS = 32
#: The split kernel's (columns per program, warps).
SPLIT_SHAPES = ((512, 4), (1024, 4), (2048, 8), (4096, 16))
SOLO_WARPS = (4, 8, 16)
#: Most live source-tile elements per thread a candidate (but the defaults) may hold: past
#: it the tile spills (and ptxas takes long to say so). 192 since the block count is
#: compiled in (six live rows of 7168 over 8 warps ran fine; docs/experiments.md,
#: "2026-12-03: the block count as a constexpr"). The launch table's bound too
#: (``kernels.attn_res.TILE_MAX_PER_THREAD``, equal: a test checks).
MAX_PER_THREAD = 192
#: Bytes-only kernel shapes: (columns per program, 0 = the whole row; warps).
BYTES_ONLY_SHAPES = ((0, 4), (0, 8), (0, 16), (1024, 4), (512, 4))
#: ``--focus``: time only these shapes (and the default and previous default) at each
#: point; ``S`` in a label stands for the widest source tile there (every block at once).
#: None: every candidate.
FOCUS: tuple[str, ...] | None = None
#: ``--triggers``: time every candidate with each of these PDL triggers too (the values
#: of ``kernels.attn_res.TRIGGERS``); None: each with its own.
TRIGGER_VARIANTS: tuple[str, ...] | None = None
#: The GPU the sweep runs on, as the launch table knows it (``kernels.attn_res.
#: device_table_name``): its rows decide the chosen shape's label. None off CUDA.
GPU: str | None = None
#: ``--no-pdl``: k3fusion's launches not as programmatic dependents (None: wherever the GPU
#: can, the default).
PDL: bool | None = None
#: ``--rotated-outputs``: k3fusion's timed launches write one preallocated output per input
#: set (cold lines) instead of one allocated in each call -- as the peers' wrappers and
#: compiled graphs allocate theirs, so the graph's pool hands the same block back each call.
ROTATED_OUTPUTS = False


def timed_out(rotated):
    """The output a timed k3fusion launch writes (``ROTATED_OUTPUTS``)."""
    return rotated if ROTATED_OUTPUTS else torch.empty_like(rotated)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# ---------------------------------------------------------------------- candidates


def label(shape) -> str:
    """Short name of a launch shape: ``r4x16e`` (row: sources per tile x warps, ``e`` early
    first tile, ``p3`` pipelined three deep), ``s1024x4`` (split: columns x warps),
    ``solo8`` (one program per token, 8 warps)."""
    suffix = {v: k for k, v in TRIGGERS.items()}[shape.trigger]
    if shape.kind == "row":
        return (f"r{shape.sources_per_tile}x{shape.num_warps}" + ("e" if shape.early_tile else "")
                + (f"p{shape.loop_stages}" if shape.loop_stages > 1 else "") + suffix)
    if shape.chunk >= shape.block_h:
        return f"solo{shape.num_warps}{suffix}"
    return f"s{shape.chunk}x{shape.num_warps}{suffix}"


def previous_default(T: int, H: int, nb: int) -> str:
    """Label of the shape the rule before the launch table picks (``use_table=False``)."""
    return label(pick_launch_shape(T, H, nb, use_table=False))


def is_public_form(kw: dict) -> bool:
    """The public kernel's form (one program per token, a few sources per tile, online
    softmax, 4-8 warps): the issue's reference point, in this repo's row kernel."""
    return (kw.get("kind") == "row" and kw.get("sources_per_tile", 0) <= 4
            and kw.get("num_warps") in (4, 8) and kw.get("loop_stages") == 1)


def candidates(T: int, H: int, nb: int, chosen_only: bool = False) -> dict[str, dict]:
    """``{label: launcher keyword arguments}`` timed at one point; the first is the default
    (``pick_launch_shape``: the launch table), the second the previous default (its rule,
    ``use_table=False``) where it differs. ``chosen_only``: those two and the public
    kernel's form (:func:`is_public_form`) only."""
    out: dict[str, dict] = {}

    block_h, sources = _pow2(H), _pow2(nb + 1)

    def add(kw: dict, bounded: bool = True) -> None:
        shape = pick_launch_shape(T, H, nb, gpu=GPU, **kw)
        width = shape.chunk or shape.block_h
        if bounded and tile_rows(shape, nb) * width > MAX_PER_THREAD * 32 * shape.num_warps:
            return
        if chosen_only and bounded and not is_public_form(kw):
            return
        out.setdefault(label(shape), kw)

    add({}, bounded=False)
    add({"use_table": False}, bounded=False)
    if T <= SMALL_GRID_MAX_TOKENS:
        for chunk, w in SPLIT_SHAPES:
            if chunk < block_h:
                add({"kind": "split", "chunk": chunk, "num_warps": w})
    for w in SOLO_WARPS if T <= 512 else SOLO_WARPS[-1:]:
        add({"kind": "split", "chunk": block_h, "num_warps": w})
    tiles = [s for s in ROW_TILES if s <= sources]
    if T <= 128:
        for spt in tiles:
            for w in ROW_WARPS:
                for early in ((True, False) if T <= SMALL_GRID_MAX_TOKENS else (False,)):
                    add({"kind": "row", "sources_per_tile": spt, "num_warps": w,
                         "loop_stages": 1, "early_tile": early})
    else:
        for spt, w in ROW_PREFILL:
            if spt in tiles:
                add({"kind": "row", "sources_per_tile": spt, "num_warps": w, "loop_stages": 1,
                     "early_tile": False})
    if T >= 128:
        for spt, w, st in ROW_PIPELINED:
            if spt in tiles:
                add({"kind": "row", "sources_per_tile": spt, "num_warps": w, "loop_stages": st,
                     "early_tile": False})
    if FOCUS is not None:
        widest = f"r{tiles[-1]}" if tiles else None
        want = {f.replace("rS", widest) if widest else f for f in FOCUS}
        out = {name: kw for i, (name, kw) in enumerate(out.items()) if i < 2 or name in want}
    for name, kw in list(out.items()) if TRIGGER_VARIANTS else ():
        for trigger in TRIGGER_VARIANTS:
            out.setdefault(label(pick_launch_shape(T, H, nb, **kw, trigger=trigger, gpu=GPU)),
                           {**kw, "trigger": trigger})
    return out


def all_candidates(hiddens, num_blocks, tokens, chosen_only: bool = False
                   ) -> dict[tuple[int, int], dict[str, dict]]:
    """Per ``(H, nb)``: the union over T of :func:`candidates` (what the workers compile)."""
    union = {}
    for H in hiddens:
        for nb in num_blocks:
            merged: dict[str, dict] = {}
            for T in tokens:
                for name, kw in candidates(T, H, nb, chosen_only).items():
                    merged.setdefault(name, kw)
            union[(H, nb)] = merged
    return union


# ---------------------------------------------------------------------- the step


def make_inputs(T: int, H: int, device, seed: int = 0):
    """``(prefix, delta, bank, norm_w, proj_w [1, H], out_w)``, bf16, random (never zeros)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dt = torch.bfloat16

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    return (randn(T, H).to(dt), randn(T, H).to(dt), randn(T, BANK_SLOTS, H).to(dt),
            (1 + 0.1 * randn(H)).to(dt), (randn(1, H) / H**0.5).to(dt),
            (1 + 0.1 * randn(H)).to(dt))


def step_bytes(T: int, H: int, nb: int) -> int:
    """Bytes the step must move: read nb blocks, prefix, delta; write prefix, block, out."""
    return 2 * ((nb + 5) * T * H + 3 * H)


def launch_step(args, nb: int, out, kw: dict) -> None:
    prefix, delta, bank, norm_w, proj_w, out_w = args
    launch(prefix, bank, nb, norm_w, proj_w[0], EPS, out, delta=delta, prefix_out=prefix,
           block_write_idx=nb, out_norm_w=out_w, out_eps=EPS, shape=kw, pdl=PDL)


def launch_mix(args, nb: int, mix, kw: dict) -> None:
    """The candidate without delta, block write and norm: its rounded mix (the check's
    second launch; another compiled variant)."""
    prefix, _, bank, norm_w, proj_w, _ = args
    launch(prefix, bank, nb, norm_w, proj_w[0], EPS, mix, shape=kw, pdl=PDL)


def chain(prefix, delta, bank, norm_w, proj_w, out_w, nb: int):
    """The step as a model writes it (``bench.attn_res.attn_res_chain`` at ``nb`` blocks)."""
    prefix = prefix + delta
    bank[:, nb] = prefix
    sources = torch.cat([bank[:, :nb], prefix.unsqueeze(1)], 1)
    logits = F.linear(hf_rms_norm(sources, norm_w, EPS), proj_w).squeeze(-1)
    weights = logits.float().softmax(-1)
    mixed = (weights.to(sources.dtype).unsqueeze(-1) * sources).sum(1)
    return prefix, hf_rms_norm(mixed, out_w, EPS)


def compiled_chain(nb: int):
    """Default Inductor of :func:`chain` at ``nb`` blocks (fresh Dynamo state)."""
    torch._dynamo.reset()
    return torch.compile(lambda *a: chain(*a, nb=nb))


def mark_tokens_dynamic(args) -> None:
    if args[0].shape[0] >= 2:  # a size-1 dim cannot be dynamic (0/1 specialization)
        for t in args[:3]:
            torch._dynamo.mark_dynamic(t, 0)


# ---------------------------------------------------------------------- checks


def reference_step(args, nb: int):
    """``(new prefix, bank, out)`` of ``k3fusion.reference.attn_res`` on clones of ``args``."""
    prefix, delta, bank, norm_w, proj_w, out_w = [a.clone() for a in args]
    out = reference.attn_res(prefix, bank, nb, norm_w, proj_w[0], EPS, delta, nb, out_w, EPS)
    return prefix, bank, out


def check(args, nb: int, kw: dict, ref, *, interpreted: bool) -> dict:
    """Run one candidate on clones of ``args`` (outputs poisoned with NaN) and check it
    stage by stage with the kernel tests' bounds (tests/test_attn_res_kernel.py):

    1. the new prefix and the bank (written slot included) bit for bit against ``ref``;
    2. the mix -- the same candidate launched again without delta, write and norm on its
       own updated prefix and bank -- within 1 ulp (1.5 where the interpreter truncates)
       + :func:`mix_atol` of the spec's;
    3. the output within :data:`OUT_ULPS` ulps of ``rms_norm`` of that mix: the tests'
       cast-then-weight bound (2; 3 truncating) + 1 for the second launch being another
       compiled variant (as the tests allow the split kernel).
    """
    a = [x.clone() for x in args]
    prefix, _, bank, norm_w, proj_w, out_w = a
    out = torch.full_like(prefix, float("nan"))
    launch_step(a, nb, out, kw)
    ref_prefix, ref_bank, _ = ref
    if interpreted:
        # The interpreter rounds bf16 toward zero (the tests' round_to): 1 ulp there; the
        # later stages use the kernel's own prefix, as in the tests.
        prefix_ok = _max_ulps(prefix, ref_prefix) <= 1.0
        bank_ok = _max_ulps(bank, ref_bank) <= 1.0
    else:
        prefix_ok, bank_ok = torch.equal(prefix, ref_prefix), torch.equal(bank, ref_bank)
    written = not out.isnan().any().item()
    mix = torch.full_like(prefix, float("nan"))
    launch_mix(a, nb, mix, kw)
    expected_mix = reference.attn_res(prefix.clone(), bank.clone(), nb, norm_w, proj_w[0], EPS)
    mix_err = _max_ulps(mix, expected_mix, atol=mix_atol(prefix, bank, nb, norm_w, proj_w[0]))
    out_err = _max_ulps(out, reference.rms_norm(mix, out_w, EPS))
    truncating = 1.0 if interpreted else 0.0
    ok = (prefix_ok and bank_ok and written and mix_err <= 1.0 + 0.5 * truncating
          and out_err <= OUT_ULPS + truncating)
    return {"ok": bool(ok), "prefix_ok": bool(prefix_ok), "bank_ok": bool(bank_ok),
            "written": bool(written), "mix_ulps": mix_err, "out_ulps": out_err}


def mix_atol(prefix, blocks, nb: int, norm_w, proj_w):
    """The kernel tests' ``mix_atol``: how far two fp32 evaluations of the unrounded mix
    may drift apart, per element (``u * M * (6 max_s A_s + 2 S + 4)``; the derivation is
    in tests/test_attn_res_kernel.py)."""
    src = torch.cat([blocks[:, :nb], prefix.unsqueeze(1)], dim=1).double()
    g = norm_w.double() * proj_w.double()
    inv_rms = torch.rsqrt(src.pow(2).mean(-1) + EPS)
    weights = torch.softmax(inv_rms * (src * g).sum(-1), dim=-1)
    a_max = (inv_rms * (src * g).abs().sum(-1)).amax(-1, keepdim=True)
    m = (weights.unsqueeze(-1) * src.abs()).sum(1)
    return 2.0**-24 * m * (6 * a_max + 2 * (nb + 1) + 4)


def _max_ulps(actual, expected, atol=0.0) -> float:
    """max over elements of ``max(0, |a - e| - atol) / ulp_bf16(e)`` (inf on NaN; ``atol``
    a number or a tensor of ``expected``'s shape)."""
    a, e = actual.double(), expected.double()
    if a.isnan().any() or e.isnan().any():
        return float("inf")
    atol = atol.double() if hasattr(atol, "double") else atol
    _, exp = torch.frexp(e.abs())
    ulp = torch.pow(2.0, (exp - 1).clamp_min(-126).double() - 7)
    return ((a - e).abs() - atol).clamp_min(0).div(ulp).max().item() if a.numel() else 0.0


def peer_point(T: int, H: int, nb: int) -> dict:
    """A point as a peer's ``declines`` and ``make`` get it (``peers.CONTRACTS["attn_res"]``)."""
    return {"op": "attn_res", "T": T, "hidden": H, "num_blocks": nb, "block_write_idx": nb,
            "eps": EPS, "out_eps": EPS, "layout": "sources-last"}


def peer_inputs(args) -> dict:
    prefix, delta, bank, norm_w, proj_w, out_w = args
    return {"prefix": prefix, "delta": delta, "bank": bank, "norm_weight": norm_w,
            "proj_weight": proj_w[0], "out_norm_weight": out_w}


def check_peer(make, args, nb: int, *, interpreted: bool) -> str | None:
    """What is wrong with a peer's step on clones of ``args`` (None: nothing): the new
    prefix and the bank as :func:`check` holds a candidate to (bit for bit; 1 ulp where the
    interpreter truncates), the output within ``bench.attn_res``'s bound of the spec's (a
    peer has no mix-only launch for :func:`check`'s staged bound)."""
    ref_prefix, ref_bank, ref_out = reference_step(args, nb)
    a = [x.clone() for x in args]
    out = make(peer_inputs(a))()
    prefix, bank = a[0], a[2]
    same = ((lambda x, y: _max_ulps(x, y) <= 1.0) if interpreted else torch.equal)
    if not same(prefix, ref_prefix):
        return "the new prefix is not prefix + delta"
    if not same(bank, ref_bank):
        return f"the bank differs from the reference's (block write to slot {nb})"
    try:
        torch.testing.assert_close(out, ref_out, rtol=2**-6, atol=2**-6)
    except (AssertionError, TypeError, ValueError) as e:
        return peer_kernels.failure(e)
    return None


# ---------------------------------------------------------------------- bytes-only floor


def _bytes_only_kernel():
    @triton.jit(do_not_specialize=["num_blocks", "write_idx"])
    def bytes_only(prefix_ptr, delta_ptr, blocks_ptr, tok_stride, blk_stride, out_ptr,
                   num_blocks, write_idx, H, CHUNK: tl.constexpr, S_PAD: tl.constexpr):
        """The step's loads and stores in one launch, every load issued at once, no
        row-wide reduction (the sources are summed column by column, so no load is dead)."""
        chunk = tl.program_id(0)
        tok = tl.program_id(1).to(tl.int64)
        cols = chunk * CHUNK + tl.arange(0, CHUNK)
        cmask = cols < H
        s = tl.arange(0, S_PAD)
        row = blocks_ptr + tok * tok_stride
        x = tl.load(row + s.to(tl.int64)[:, None] * blk_stride + cols[None, :],
                    mask=(s < num_blocks)[:, None] & cmask[None, :], other=0.0)
        p = tl.load(prefix_ptr + tok * H + cols, mask=cmask, other=0.0)
        d = tl.load(delta_ptr + tok * H + cols, mask=cmask, other=0.0)
        q = (p.to(tl.float32) + d.to(tl.float32)).to(p.dtype)
        tl.store(prefix_ptr + tok * H + cols, q, mask=cmask)
        tl.store(row + write_idx.to(tl.int64) * blk_stride + cols, q, mask=cmask)
        y = q.to(tl.float32) + tl.sum(x.to(tl.float32), axis=0)
        tl.store(out_ptr + tok * H + cols, y.to(p.dtype), mask=cmask)

    return bytes_only


_BYTES_ONLY = []


def bytes_only(args, nb: int, out, chunk: int, num_warps: int) -> None:
    if not _BYTES_ONLY:
        _BYTES_ONLY.append(_bytes_only_kernel())
    prefix, delta, bank = args[:3]
    T, H = prefix.shape
    chunk = chunk or _pow2(H)
    _BYTES_ONLY[0][((H + chunk - 1) // chunk, T)](
        prefix, delta, bank, bank.stride(0), bank.stride(1), out, nb, nb, H, CHUNK=chunk,
        S_PAD=max(2, _pow2(nb)), num_warps=num_warps)


# ---------------------------------------------------------------------- precompile pool


def _pdl_label() -> str:
    if PDL is False:
        return "off"
    return "auto, late trigger" if attn_res_kernels.LATE_TRIGGER else "auto"


def _worker_init(pdl: bool | None = None, late_trigger: bool = False) -> None:
    global PDL
    inductor_config.compile_threads = 1  # the pool is the parallelism
    # the launches the main process will time (a spawned worker starts afresh)
    PDL = pdl
    attn_res_kernels.LATE_TRIGGER = late_trigger


def _precompile(task):
    """Fill the on-disk caches for one ``(what, H, nb)``; returns (task, seconds, errors)."""
    what, H, nb, payload, device = task
    start, errors = time.perf_counter(), {}
    if what == "kernels":
        args = make_inputs(1, H, device)
        for name, kw in payload.items():
            try:
                launch_step(args, nb, torch.empty_like(args[0]), kw)
                launch_mix(args, nb, torch.empty_like(args[0]), kw)  # the check's variant
            except Exception as e:  # recorded; the main process skips it too
                errors[name] = f"{type(e).__name__}: {e}"[:300]
        for chunk, w in BYTES_ONLY_SHAPES:
            try:
                bytes_only(args, nb, torch.empty_like(args[0]), chunk, w)
            except Exception as e:
                errors[f"bytes {chunk}x{w}"] = f"{type(e).__name__}: {e}"[:300]
    else:
        try:
            fn = compiled_chain(nb)
            for T in payload:  # the same order as the timed process (same cache keys)
                args = make_inputs(T, H, device)
                mark_tokens_dynamic(args)
                fn(*args)
        except Exception as e:
            errors["inductor"] = f"{type(e).__name__}: {e}"[:300]
    if device == "cuda":
        torch.cuda.synchronize()
    return (what, H, nb), time.perf_counter() - start, errors


def precompile(hiddens, num_blocks, tokens, inductor: bool, jobs: int,
               device: str = "cuda", timeout_s: float = 240.0, chosen_only: bool = False,
               inductor_blocks=None) -> dict:
    """Compile every candidate (and Inductor's graphs) once, in ``jobs`` spawned worker
    processes (0: in this process), so that the timed loop only loads cached binaries."""
    union = all_candidates(hiddens, num_blocks, tokens, chosen_only)
    # Inductor first: its compiles are the long ones.
    tasks = [("inductor", H, nb, inductor_order(tokens), device) for H in hiddens
             for nb in num_blocks if inductor_blocks is None or nb in inductor_blocks
             ] if inductor else []
    tasks += [("kernels", H, nb, union[(H, nb)], device) for H in hiddens for nb in num_blocks]
    start, errors = time.perf_counter(), {}
    if jobs == 0:
        for key, secs, errs in map(_precompile, tasks):
            if errs:
                errors[str(key)] = errs
    else:
        # A pool that reports a dead worker (BrokenProcessPool) instead of hanging; past
        # the timeout its workers are stopped (they must not share the GPU with timing):
        # whatever is left compiles in this process, inside the sweep.

        pool = ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn"),
                                   initializer=_worker_init,
                                   initargs=(PDL, attn_res_kernels.LATE_TRIGGER))
        futures = {pool.submit(_precompile, t): t[:3] for t in tasks}
        done, pending = wait(futures, timeout=timeout_s)
        for f in done:
            try:
                key, secs, errs = f.result()
                if errs:
                    errors[str(key)] = errs
            except Exception as e:
                errors[str(futures[f])] = f"{type(e).__name__}: {e}"[:300]
        if pending:
            errors["timeout"] = f"{len(pending)} tasks unfinished after {timeout_s:.0f} s"
            for proc in list((getattr(pool, "_processes", None) or {}).values()):
                proc.terminate()
        pool.shutdown(wait=not pending, cancel_futures=True)
    print(f"precompile: {len(tasks)} tasks on {jobs} workers in "
          f"{time.perf_counter() - start:.0f} s; errors: {errors or 'none'}", flush=True)
    return errors


def inductor_order(tokens) -> list[int]:
    """Dynamic compile at the first T >= 2, then the rest (T = 1 compiles its own)."""
    big = [t for t in tokens if t >= 2]
    return big + [t for t in tokens if t < 2]


# ---------------------------------------------------------------------- the sweep


def run(hiddens, num_blocks, tokens, *, inductor: bool, dry_run: bool, out_dir: Path,
        budget_s: float, jobs: int, chosen_only: bool = False, inductor_blocks=None,
        peers=(), timer=None) -> dict:
    """``peers``: :class:`peers.Peer` of attn_res, checked and timed at every point;
    ``timer``: ``(fn, arg_sets, T) -> us`` in place of CUDA-graph replay (the dry run's
    default runs each once and says 1.0)."""
    t0 = time.perf_counter()
    device = "cpu" if dry_run else "cuda"
    result = {"bench": "attn_res_sweep", "hiddens": list(hiddens),
              "num_blocks": list(num_blocks), "tokens": list(tokens), "dry_run": dry_run,
              "inductor": inductor, "chosen_only": chosen_only, "out_ulps_bound": OUT_ULPS,
              "pdl": _pdl_label(),
              "outputs": "rotated" if ROTATED_OUTPUTS else "per call", "points": [],
              "precompile_errors": {}, "peers": peer_kernels.sources(peers)}
    if dry_run:
        result.update(date=time.strftime("%Y-%m-%d"), gpu="cpu (interpreter)",
                      torch=torch.__version__, triton=triton.__version__)
    else:
        result.update(environment())
    plan = estimate(hiddens, num_blocks, tokens, inductor, chosen_only, inductor_blocks)
    result["plan"] = plan
    print(f"plan: {plan}", flush=True)
    if not dry_run:
        result["precompile_errors"] = precompile(hiddens, num_blocks, tokens, inductor, jobs,
                                                 chosen_only=chosen_only,
                                                 inductor_blocks=inductor_blocks)
    else:  # the worker's code, in this process, on the kernels only (no C++ compiler needed)
        result["precompile_errors"] = precompile(hiddens, num_blocks[:1], tokens[:1], False, 0,
                                                 device, chosen_only=chosen_only)

    def default_timer(fn, sets, T):
        if dry_run:
            fn(*sets[0])
            return 1.0
        return cuda_graph_us(fn, sets, reps=10 if T >= 512 else 30)

    timer = timer or default_timer

    for H in hiddens:
        # One bank of 9 slots per (H, T), shared by every nb; enough sets that even the
        # nb = 0 step's bytes outgrow L2 (at most 20, the timer's calls per graph).
        sets = {T: [make_inputs(T, H, device, seed=i)
                    for i in range(1 if dry_run else sets_to_outgrow_l2(step_bytes(T, H, 0)))]
                for T in tokens}
        outs = {T: [torch.empty_like(s[0]) for s in sets[T]] for T in tokens}
        for nb in num_blocks:
            for T in tokens:
                for s in sets[T]:
                    s[0].normal_()  # the in-place prefix update drifts; start fresh
            fn_ind = None
            timed_inductor = inductor and (inductor_blocks is None or nb in inductor_blocks)
            if timed_inductor and time.perf_counter() - t0 < budget_s:
                # The dry run exercises the same path with the chain run eagerly.
                fn_ind = (lambda *a, nb=nb: chain(*a, nb=nb)) if dry_run else compiled_chain(nb)
            elif timed_inductor:
                result.setdefault("inductor_skipped", []).append([H, nb])
            for T in inductor_order(tokens):
                point = {"H": H, "nb": nb, "T": T, "floor_us": hbm_floor_us(step_bytes(T, H, nb)),
                         "input_sets": len(sets[T]), "variants": {}}
                cands = candidates(T, H, nb, chosen_only)
                point["default"] = next(iter(cands))
                point["previous"] = previous_default(T, H, nb)
                ref = reference_step(sets[T][0], nb)
                for name, kw in cands.items():
                    v = {"kw": kw}
                    try:
                        v.update(check(sets[T][0], nb, kw, ref, interpreted=dry_run))
                    except Exception as e:
                        v.update(ok=False, error=f"{type(e).__name__}: {e}"[:300])
                    point["variants"][name] = v
                for name, kw in cands.items():
                    v = point["variants"][name]
                    if "error" in v:
                        continue
                    try:
                        v["us"] = timer(lambda *a, kw=kw: launch_step(a[:6], nb,
                                                                      timed_out(a[6]), kw),
                                        [s + (o,) for s, o in zip(sets[T], outs[T])], T)
                    except Exception as e:
                        v["error"] = f"{type(e).__name__}: {e}"[:300]
                if fn_ind is not None:
                    try:
                        for s in sets[T]:
                            mark_tokens_dynamic(s)
                        first = [a.clone() for a in sets[T][0]]
                        mark_tokens_dynamic(first)  # as the workers' compile saw them
                        diff = (fn_ind(*first)[1].float() - ref[2].float()).abs()
                        # The chain rounds keys and logits to bf16 (the spec keeps fp32):
                        # bench.attn_res.assert_near_chain's bounds, recorded, not asserted.
                        point["inductor_err"] = [diff.mean().item(), diff.max().item()]
                        point["inductor_ok"] = bool(point["inductor_err"][0] < 1.6e-2
                                                    and point["inductor_err"][1] < 0.125)
                        point["inductor_us"] = timer(fn_ind, sets[T], T)
                    except Exception as e:
                        point["inductor_error"] = f"{type(e).__name__}: {e}"[:300]
                if T == 1:
                    for chunk, w in BYTES_ONLY_SHAPES:
                        name = f"bytes-only {chunk or 'row'}x{w}"
                        try:
                            point.setdefault("bytes_only", {})[name] = timer(
                                lambda *a, c=chunk, w=w: bytes_only(a[:6], nb,
                                                                    timed_out(a[6]), c, w),
                                [s + (o,) for s, o in zip(sets[T], outs[T])], T)
                        except Exception as e:
                            point.setdefault("bytes_only_errors", {})[name] = str(e)[:300]
                if peers:
                    point["peers"] = peer_kernels.time_peers(
                        peers, peer_point(T, H, nb), [peer_inputs(s) for s in sets[T]],
                        lambda make: check_peer(make, sets[T][0], nb, interpreted=dry_run),
                        lambda fn, arg_sets, T=T: timer(fn, arg_sets, T))
                summarize(point)
                if peers:  # against the chosen shape: what k3fusion runs at this point
                    peer_kernels.summarize(point, "default_us")
                result["points"].append(point)
            print(f"H {H} nb {nb}: {len(result['points'])} points, "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
            write_json(result, out_dir)
        del sets, outs
        if not dry_run:
            torch.cuda.empty_cache()
    result["seconds"] = time.perf_counter() - t0
    write_json(result, out_dir)
    return result


def summarize(point: dict) -> None:
    """Best correct candidate, and the default's and Inductor's ratios to it."""
    ok = {n: v["us"] for n, v in point["variants"].items() if v.get("ok") and "us" in v}
    point["wrong"] = sorted(n for n, v in point["variants"].items() if not v.get("ok"))
    if not ok:
        point["best"] = None
        return
    best = min(ok, key=ok.get)
    point["best"], point["best_us"] = best, ok[best]
    point["default_us"] = point["variants"][point["default"]].get("us")
    if point.get("previous") in point["variants"]:
        point["previous_us"] = point["variants"][point["previous"]].get("us")
    public = [ok[n] for n, v in point["variants"].items() if n in ok and is_public_form(v["kw"])]
    point["public_form_us"] = min(public) if public else None
    if point.get("bytes_only"):
        point["bytes_only_best_us"] = min(point["bytes_only"].values())


def write_json(result: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "attn_res_sweep.json").write_text(json.dumps(result, indent=1))


# ---------------------------------------------------------------------- estimate, tables


#: Rough seconds per timed graph (capture + replays + host work) and per Inductor (H, nb) in
#: the timed process (cache hits), for :func:`estimate`.
SECONDS_PER_GRAPH = 0.02
SECONDS_PER_INDUCTOR_LOAD = 3.0


def estimate(hiddens, num_blocks, tokens, inductor: bool, chosen_only: bool = False,
             inductor_blocks=None) -> dict:
    inductor_at = [nb for nb in num_blocks if inductor and (inductor_blocks is None
                                                            or nb in inductor_blocks)]
    graphs = replays = 0
    device_us = 0.0
    for H in hiddens:
        for nb in num_blocks:
            for T in tokens:
                n = (len(candidates(T, H, nb, chosen_only))
                     + (len(BYTES_ONLY_SHAPES) if T == 1 else 0))
                n_ind = 1 if nb in inductor_at else 0
                reps = 10 if T >= 512 else 30
                graphs += n + n_ind
                replays += (n + n_ind) * (reps + 1)
                # ~1.3x the HBM floor + 5 us per kernel call; Inductor ~6x the floor + 10.
                floor = step_bytes(T, H, nb) / 4.3e12 * 1e6
                device_us += 20 * (reps + 4) * (n * (1.3 * floor + 5) + n_ind * (6 * floor + 10))
    seconds = graphs * SECONDS_PER_GRAPH + device_us / 1e6
    seconds += len(hiddens) * len(inductor_at) * SECONDS_PER_INDUCTOR_LOAD
    return {"graphs": graphs, "replays": replays, "calls": replays * 20,
            "estimated_timing_s": round(seconds)}


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def selection_table(result: dict) -> str:
    """Best shape per (H, nb, T): rows nb, columns T, one block per H."""
    tokens = result["tokens"]
    by = {(p["H"], p["nb"], p["T"]): p for p in result["points"]}
    lines = ["selection (best correct shape per point; row: r<sources/tile>x<warps>[e: early "
             "tile][pN: pipelined], s<chunk>x<warps>: split, soloW: one program per token)"]
    for H in result["hiddens"]:
        lines.append(f"H {H:5d} | " + " ".join(f"T={t:<7d}" for t in tokens))
        for nb in result["num_blocks"]:
            cells = [(by.get((H, nb, t)) or {}).get("best") or "-" for t in tokens]
            lines.append(f"  nb {nb}  | " + " ".join(f"{c:<9s}" for c in cells))
    return "\n".join(lines)


def selection_check(result: dict, keep_trigger: bool = False) -> list[dict]:
    """Per point of a saved sweep: what ``pick_launch_shape`` chooses now on the sweep's GPU,
    its measured us (None where the sweep did not time that shape), the best's and the
    previous default's. ``keep_trigger``: the chosen shape with its own PDL trigger (a
    sweep with ``--triggers``), else at entry."""
    rows = []
    for p in result["points"]:
        # the sweeps before --triggers chose the shape; PDL's trigger came from its own
        # probe (every shape they timed triggered at entry)
        shape = pick_launch_shape(p["T"], p["H"], p["nb"], gpu=result.get("gpu"))
        chosen = label(shape if keep_trigger else replace(shape, trigger="entry"))
        v = p["variants"].get(chosen, {})
        prev = p["variants"].get(previous_default(p["T"], p["H"], p["nb"]), {})
        rows.append({"H": p["H"], "nb": p["nb"], "T": p["T"], "chosen": chosen,
                     "chosen_us": v.get("us") if v.get("ok") else None,
                     "best": p.get("best"), "best_us": p.get("best_us"),
                     "previous_us": prev.get("us"), "inductor_us": p.get("inductor_us")})
    return rows


def _heat_panels(result: dict, path: Path, value_of, *, text, outlined, cmap: str,
                 vmin: float, vmax: float, colorbar: str, title: str) -> None:
    """One panel per width, block counts down, token counts across: ``value_of(H, nb, T)``
    (None: no cell), written in the cell as ``text(v)`` -> (string, color), outlined red
    where ``outlined(v)``."""
    import matplotlib  # optional (the bench extra): only a heat map needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    hiddens, blocks, tokens = result["hiddens"], result["num_blocks"], result["tokens"]
    fig, axes = plt.subplots(1, len(hiddens), figsize=(4.2 * len(hiddens), 4.6), squeeze=False)
    for ax, H in zip(axes[0], hiddens):
        grid = np.full((len(blocks), len(tokens)), np.nan)
        for i, nb in enumerate(blocks):
            for j, T in enumerate(tokens):
                v = value_of(H, nb, T)
                if v:
                    grid[i, j] = v
                    label, color = text(v)
                    ax.text(j, i, label, ha="center", va="center", fontsize=8, color=color)
                    if outlined(v):
                        ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False,
                                                   edgecolor="red", linewidth=2))
        im = ax.imshow(grid, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto")
        ax.set_xticks(range(len(tokens)), [str(t) for t in tokens])
        ax.set_yticks(range(len(blocks)), [str(nb) for nb in blocks])
        ax.set(xlabel="tokens T", ylabel="completed blocks", title=f"H {H}")
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label=colorbar)
    fig.suptitle(f"{title} ({result.get('gpu')}, {result.get('date')}, bf16)")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def heatmap(result: dict, path: Path) -> None:
    """PNG of default Inductor's time over the chosen shape's (:func:`selection_check`) per
    (H, nb, T): one panel per width, block counts down, token counts across."""
    rows = {(r["H"], r["nb"], r["T"]): r for r in selection_check(result)}

    def ratio(H, nb, T):
        r = rows.get((H, nb, T))
        return r and _ratio(r["inductor_us"], r["chosen_us"])

    _heat_panels(result, path, ratio,
                 text=lambda v: (f"{v:.1f}", "black" if v > 2.5 else "white"),
                 outlined=lambda v: v < 2,  # below the 2x
                 cmap="viridis", vmin=1, vmax=8,
                 colorbar="default Inductor us / k3fusion us (red: below 2x)",
                 title="AttnRes step, k3fusion's chosen launch vs default Inductor")


def peer_table(result: dict) -> str:
    """Markdown: per point k3fusion's chosen shape and each peer (us, or why not timed), and
    the best peer against k3fusion; then the peers' sources. Empty without peers."""
    if not result.get("peers"):
        return ""
    head = ["H", "blocks", "T", "k3fusion (chosen)", *peer_kernels.table_columns(result)]
    lines = [f"AttnRes step against peer kernels, bf16, {result.get('gpu')}, "
             f"{result.get('date')}, torch {result.get('torch')}, triton {result.get('triton')}; "
             "us per call, CUDA-graph replay, the same rotated inputs.", "",
             "| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for p in result["points"]:
        lines.append(f"| {p['H']} | {p['nb']} | {p['T']} | {_fmt(p.get('default_us'))} | "
                     + " | ".join(peer_kernels.table_cells(result, p)) + " |")
    lines += peer_kernels.sources_lines(result, "k3fusion's chosen shape")
    return "\n".join(lines) + "\n"


def peer_heatmap(result: dict, path: Path) -> None:
    """PNG of the fastest peer's time over k3fusion's per (H, nb, T) (below 1/1.02, a
    public kernel more than 2% faster: outlined red), one panel per width."""
    by = {(p["H"], p["nb"], p["T"]): p for p in result["points"]}

    def over_k3fusion(H, nb, T):
        speedup = (by.get((H, nb, T)) or {}).get("peer_speedup")
        return 1 / speedup if speedup else None

    _heat_panels(result, path, over_k3fusion,
                 text=lambda v: (f"{v:.2f}", "black"),
                 outlined=lambda v: 1 / v > peer_kernels.NOISE,
                 cmap="RdYlGn", vmin=0.8, vmax=1.5,
                 colorbar="fastest peer us / k3fusion us (red: a peer over 2% faster)",
                 title="AttnRes step, k3fusion's chosen launch vs the fastest peer")


def _ratio(a, b):
    return a / b if a and b else None


def point_table(result: dict) -> str:
    """One line per point: best shape and us, the default (chosen) shape and us, the
    previous default's, the public form's and Inductor's us; Inductor / chosen, previous /
    chosen, chosen / best; at T = 1 the bytes-only floor."""
    lines = [f"{result.get('gpu')}, {result.get('date')}, torch {result.get('torch')}, triton "
             f"{result.get('triton')}; us per call (CUDA-graph median)",
             "    H nb    T best       us chosen       us    prev  public inductor ind/c "
             "prv/c c/bst floor" + ("  best peer / k3fusion's time over it"
                                    if result.get("peers") else "")]
    for p in result["points"]:
        best, chosen = p.get("best_us"), p.get("default_us")
        lines.append(f"{p['H']:5d} {p['nb']:2d} {p['T']:4d} {p.get('best') or '-':8s}"
                     f"{_fmt(best):>7s} {p.get('default') or '-':8s}{_fmt(chosen):>7s} "
                     f"{_fmt(p.get('previous_us')):>7s} "
                     f"{_fmt(p.get('public_form_us')):>7s} {_fmt(p.get('inductor_us')):>8s} "
                     f"{_fmt(_ratio(p.get('inductor_us'), chosen)):>5s} "
                     f"{_fmt(_ratio(p.get('previous_us'), chosen)):>5s} "
                     f"{_fmt(_ratio(chosen, best)):>5s}"
                     + (f" {p['bytes_only_best_us']:.2f}" if p.get("bytes_only_best_us") else "")
                     + (f" WRONG: {','.join(p['wrong'])}" if p.get("wrong") else "")
                     + (f"  peer {p['best_peer']} {p['best_peer_us']:.2f} "
                        f"{_fmt(p.get('peer_speedup'))}"
                        + (" PEER FASTER" if (p.get("peer_speedup") or 0) > peer_kernels.NOISE
                           else "") if p.get("best_peer") else "")
                     + _peer_problems(p))
    return "\n".join(lines)


def _peer_problems(point: dict) -> str:
    """Peers that declined, failed the check or crashed at a point, for its line."""
    bad = [f"{n}: {next(iter(c))}" for n, c in (point.get("peers") or {}).items()
           if "us" not in c]
    return f"  [{'; '.join(bad)}]" if bad else ""


def main(argv=None) -> int:
    global FOCUS, GPU, PDL, ROTATED_OUTPUTS, SMALL_GRID_MAX_TOKENS, TRIGGER_VARIANTS
    p = argparse.ArgumentParser(prog="python -m k3fusion.bench.attn_res_sweep")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-out")))
    p.add_argument("--quick", action="store_true", help=f"a subset: {QUICK}")
    p.add_argument("--chosen-only", action="store_true",
                   help="time only the chosen shape, the previous default and the public "
                        f"kernel's form (with Inductor); sizes {CHOSEN} unless given")
    p.add_argument("--skip-inductor", action="store_true")
    p.add_argument("--inductor-blocks", type=int, nargs="+",
                   help="Inductor only at these block counts (default: every one; "
                        f"--chosen-only: {CHOSEN_INDUCTOR_BLOCKS})")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny sizes in Triton's CPU interpreter, no timing (tests the logic)")
    p.add_argument("--jobs", type=int, default=None,
                   help="precompile worker processes (default: CPUs - 2, at most 14; 0: none)")
    p.add_argument("--hiddens", type=int, nargs="+", help="override the widths")
    p.add_argument("--num-blocks", type=int, nargs="+", help="override the block counts")
    p.add_argument("--tokens", type=int, nargs="+", help="override the token counts")
    p.add_argument("--focus", nargs="+", metavar="SHAPE",
                   help="time only these shapes besides the default and previous default "
                        "(labels as in the launch table; rSxW: the widest source tile)")
    p.add_argument("--tables-from", type=Path, metavar="JSON",
                   help="only print the tables of an earlier run's attn_res_sweep.json")
    p.add_argument("--heatmap", type=Path, metavar="PNG",
                   help="with --tables-from: also draw the k3fusion-vs-Inductor heat map")
    p.add_argument("--no-pdl", action="store_true",
                   help="launch k3fusion's kernels without PDL (not as programmatic dependents "
                        "of the launch before): a probe of what PDL costs or gives")
    p.add_argument("--late-trigger", action="store_true",
                   help="k3fusion's PDL launches let the next launch start after their last "
                        "store, not at their start: a probe of where the trigger belongs")
    p.add_argument("--triggers", nargs="+", choices=sorted(set(TRIGGERS.values()) - {"off"}),
                   help="also time every candidate with each of these PDL triggers (entry: "
                        "at its start, mix: once the mix is computed, exit: after its last "
                        "store)")
    p.add_argument("--small-grid-tokens", type=int, metavar="T",
                   help="the split kernel's multi-program shapes and the row kernel's early "
                        f"tile as candidates up to T tokens (default "
                        f"{SMALL_GRID_MAX_TOKENS})")
    p.add_argument("--rotated-outputs", action="store_true",
                   help="k3fusion's timed launches write one preallocated output per input "
                        "set (the method before 2026-12-04's evening) instead of allocating "
                        "it in each call as the peers and compiled graphs do: an A/B")
    p.add_argument("--budget-s", type=float, default=330.0,
                   help="no new Inductor compiles after this many seconds of the sweep")
    add_peers_argument(p)
    add_scratch_argument(p)
    args = p.parse_args(argv)
    peers = peer_kernels.from_args(p, args, "attn_res")
    ROTATED_OUTPUTS = args.rotated_outputs
    if args.no_pdl and args.late_trigger:
        p.error("--late-trigger moves PDL's trigger: it needs PDL (drop --no-pdl)")
    if args.no_pdl and args.triggers:
        p.error("--triggers places PDL's trigger: it needs PDL (drop --no-pdl)")
    PDL = False if args.no_pdl else None
    attn_res_kernels.LATE_TRIGGER = args.late_trigger
    FOCUS = tuple(args.focus) if args.focus else None
    TRIGGER_VARIANTS = tuple(args.triggers) if args.triggers else None
    if args.small_grid_tokens is not None:
        SMALL_GRID_MAX_TOKENS = args.small_grid_tokens
    if args.tables_from:
        result = json.loads(args.tables_from.read_text())
        print(selection_table(result) + "\n\n" + point_table(result))
        if result.get("peers"):
            print("\n" + peer_table(result))
        if args.heatmap:
            heatmap(result, args.heatmap)
            if result.get("peers"):
                peer_heatmap(result, args.heatmap.with_name(args.heatmap.stem + "_peers.png"))
        return 0
    if args.dry_run:
        # Triton reads this when k3fusion's kernels are decorated, i.e. before this module
        # runs: it must come from the environment.
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--dry-run runs in Triton's CPU interpreter: set TRITON_INTERPRET=1 "
                             "(TRITON_INTERPRET=1 python -m k3fusion.bench.attn_res_sweep "
                             "--dry-run)")
        sizes = DRY
    else:
        if not torch.cuda.is_available():
            raise SystemExit("this benchmark needs a CUDA GPU (or --dry-run)")
        GPU = attn_res_kernels.device_table_name(torch.device("cuda"))
        sizes = (QUICK if args.quick else CHOSEN if args.chosen_only
                 else dict(hiddens=HIDDENS, num_blocks=NUM_BLOCKS, tokens=TOKENS))
    sizes = {k: tuple(getattr(args, k) or v) for k, v in sizes.items()}
    jobs = args.jobs if args.jobs is not None else max(1, min(14, (os.cpu_count() or 4) - 2))
    result = run(sizes["hiddens"], sizes["num_blocks"], sizes["tokens"],
                 inductor=not args.skip_inductor, dry_run=args.dry_run,
                 out_dir=args.out, budget_s=args.budget_s, jobs=0 if args.dry_run else jobs,
                 chosen_only=args.chosen_only, peers=peers,
                 inductor_blocks=(args.inductor_blocks if args.inductor_blocks
                                  else CHOSEN_INDUCTOR_BLOCKS if args.chosen_only else None))
    tables = selection_table(result) + "\n\n" + point_table(result) + "\n"
    if peers:
        tables += "\n" + peer_table(result)
    (args.out / "attn_res_sweep.md").write_text(tables)
    try:
        heatmap(result, args.out / "attn_res_sweep_heatmap.png")
        if peers:
            peer_heatmap(result, args.out / "attn_res_sweep_heatmap_peers.png")
    except ImportError as e:  # matplotlib: the bench extra
        print(f"no heat map ({e})")
    print(f"\nsweep took {result['seconds']:.0f} s; raw: {args.out / 'attn_res_sweep.json'}")
    print(tables)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
