"""One-run probe of the latent-MoE tail's candidate forms (issue 17), on one GPU.

``python -m k3fusion.bench.moe_tail_probe --out DIR [--tokens T ...] [--skip-autotune]
[--autotune-tokens T ...] [--budget-s S] [--skip-triton] [--skip-inductor] [--quick]
[--dry-run]``

For each T at Kimi-K3's widths, bf16, CUDA-graph replay medians of: the HBM floor, cuBLAS's
GEMM alone, the unfused tiers' launch sequences, the op, the fused kernel's default launch
and its candidate forms (:func:`candidates`), default and max-autotune Inductor. Every
variant is checked against the reference once per T (a wrong one is flagged and never
"best"). Writes ``DIR/moe_tail_probe.json`` and prints a compact table. ``--dry-run``:
every variant at a tiny size in Triton's CPU interpreter, checked, not timed.

How it measures (each variant, the checks' bounds, ``--quick``):
docs/bench-methods.md, section "``python -m k3fusion.bench.moe_tail_probe``".
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

import k3fusion  # noqa: F401  (registers the ops)
from k3fusion.kernels import moe_tail as fused_tail
from k3fusion.kernels.moe_tail import MAX_TOKENS

from .common import hf_rms_norm
from .timing import cuda_graph_us, hbm_floor_us, sets_to_outgrow_l2

TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 512, 4096)
AUTOTUNE_TOKENS = (1, 16, 64, 512, 4096)
#: ``--quick``'s T: 32 / 48 / 64 bracket the fused kernel's selection limit; 8 / 16 the
#: switch of cuBLAS's GEMM kernel between 8 and 16 rows (18.5 -> 15.9 us).
QUICK_TOKENS = (1, 4, 8, 16, 32, 48, 64, 512, 4096)
#: ``--quick``'s fused-kernel forms: the norm-launch default (2-32 token rows), the PDL
#: 1/rms prologue form it replaced, and the one-launch sum of squares in the main loop.
QUICK_CANDIDATES = ("normed_pdl_n64", "pdl_n64_s1", "loop_n64", "loop_n64_k128_st6")
LATENT, HIDDEN = 3584, 7168
EPS = 1e-6
#: Rows checked per T (spread over all row tiles).
CHECK_ROWS = 48
#: The dry run's widths: not multiples of the tiles (masks), L over two 256-wide K blocks
#: (the candidates' split-K runs), H over one 128-column tile.
DRY_LATENT, DRY_HIDDEN, DRY_TOKENS = 520, 136, (1, 3, 33, 70)


def candidates(t: int) -> dict[str, dict]:
    """``{label: launch options}`` of the fused kernel's candidate forms at T = ``t``."""
    c: dict[str, dict] = {}
    if t <= 64:
        # The norm prologue as its own launch, then split-K to fill all SMs: 112 column
        # tiles of 64 x (1, 2, 4, 7) splits of L (block_k 256: 14 K blocks); 128-column
        # tiles (block_k 128, so 4 stages fit) x (2, 4); 32-column tiles x 2. "pdl": the
        # tail kernel launched as the prologue's programmatic dependent (no launch gap).
        for bn, sk in ((64, 1), (64, 2), (64, 4), (64, 7), (128, 2), (128, 4), (32, 2)):
            bk = {"block_k": 128} if bn == 128 else {}
            c[f"pre_n{bn}_s{sk}"] = dict(prenorm=True, block_n=bn, split_k=sk, **bk)
            if bn == 64 or sk == 4:
                c[f"pdl_n{bn}_s{sk}"] = dict(prenorm=True, pdl=True, block_n=bn, split_k=sk,
                                             **bk)
        # The rows normalized by a norm launch, the kernel a GEMM + add on them (the default
        # at 2-32 rows), at 64 rows too.
        c["normed_pdl_n64"] = dict(normed_rows=True, pdl=True, block_n=64)
        # One launch, no prologue: the rows' sums of squares ride along with the weight
        # stream, 1/rms scales the dot's output (its GEMM input is rnd(x * w), not the
        # reference's rounded normalized row).
        c["loop_n64"] = dict(rms_in_loop=True, block_n=64, split_k=1)
        c["loop_n64_k128_st6"] = dict(rms_in_loop=True, block_n=64, split_k=1, block_k=128,
                                      num_stages=6)
        # Split-K without the prologue launch (each program its own prologue), for contrast.
        c["own_n64_s4"] = dict(prenorm=False, block_n=64, split_k=4)
        if t == 1:
            for sk in (2, 4):
                c[f"gemv_pdl_n32_s{sk}"] = dict(gemv=True, prenorm=True, pdl=True, block_n=32,
                                                split_k=sk)
        if t >= 32:  # the weight tile as the dot's M side at 32 / 64 token rows
            c["swap_n64"] = dict(swap_ab=True, block_n=64, num_stages=3)
            for sk in (2, 4):
                c[f"pdl_swap_n64_s{sk}"] = dict(prenorm=True, pdl=True, swap_ab=True, block_n=64,
                                                split_k=sk, num_stages=3)
    if t >= 64:
        # Row-tiled GEMM: norm prologue launch, normalized tile formed on the fly, add in
        # the epilogue.
        for bm, bn, bk, nw, ns in ((64, 128, 64, 4, 4), (128, 128, 64, 8, 3),
                                   (128, 128, 64, 8, 4), (128, 256, 64, 8, 3),
                                   (64, 64, 128, 4, 4)):
            if bm > max(64, t):
                continue  # more padding rows than tokens
            c[f"rt_m{bm}_n{bn}_k{bk}_w{nw}_st{ns}"] = dict(
                prenorm=True, pdl=True, block_m=bm, block_n=bn, block_k=bk, num_warps=nw,
                num_stages=ns, swap_ab=False)
        if t >= 512:
            c["rt_m128_n128_k64_w8_st4_mfirst"] = dict(
                prenorm=True, pdl=True, block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4,
                swap_ab=False, m_first=True)
        if t <= 128:
            c["rt_m64_n64_k128_w4_st4_s2"] = dict(
                prenorm=True, pdl=True, block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=4,
                swap_ab=False, split_k=2)
    return c


def _bound_module():
    """``tests/_tolerances.py`` (the tier tests' bound), loaded by path: the probe runs from
    the repository root, where ``tests/`` is not a package."""
    path = Path(__file__).resolve().parents[2] / "tests" / "_tolerances.py"
    spec = importlib.util.spec_from_file_location("_k3_tolerances", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m k3fusion.bench.moe_tail_probe")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench-out")))
    p.add_argument("--tokens", type=int, nargs="*", default=None)
    p.add_argument("--autotune-tokens", type=int, nargs="*", default=list(AUTOTUNE_TOKENS))
    p.add_argument("--skip-autotune", action="store_true")
    p.add_argument("--skip-inductor", action="store_true", help="no compiles at all")
    p.add_argument("--skip-triton", action="store_true",
                   help="no fused-kernel variants (kernel, tri:*): baselines and compiles only")
    p.add_argument("--budget-s", type=float, default=300.0,
                   help="after this many seconds, skip the remaining max-autotune compiles")
    p.add_argument("--quick", action="store_true",
                   help=f"T {' '.join(map(str, QUICK_TOKENS))}, no Inductor compiles, of "
                        "the kernel's forms only QUICK_CANDIDATES")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny sizes on the CPU in Triton's interpreter; checks, no timing")
    args = p.parse_args(argv)
    if args.dry_run and os.environ.get("TRITON_INTERPRET") != "1":
        # The interpreter must be on before k3fusion (imported to reach this module) first
        # decorates its kernels: run again in a fresh interpreter with it set.
        import subprocess

        argv = sys.argv[1:] if argv is None else list(argv)
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        return subprocess.run([sys.executable, "-m", "k3fusion.bench.moe_tail_probe", *argv],
                              env=env).returncode
    return _run(args)


def _run(args) -> int:
    launch = fused_tail.latent_moe_tail_fused  # read per run: a test swaps in a wrong one
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        raise SystemExit("the probe needs a CUDA GPU (or --dry-run)")
    device = "cpu" if dry else "cuda"
    latent, hidden = (DRY_LATENT, DRY_HIDDEN) if dry else (LATENT, HIDDEN)
    tokens = args.tokens or list(DRY_TOKENS if dry else QUICK_TOKENS if args.quick else TOKENS)
    if args.quick:
        args.skip_inductor = True
    if any(t < 1 for t in tokens):
        raise SystemExit("--tokens values must be >= 1")
    dtype = torch.bfloat16
    tol = _bound_module()
    t_start = time.monotonic()

    def inputs(t):
        routed = torch.randn(t, latent, device=device).to(dtype)
        shared = torch.randn(t, hidden, device=device).to(dtype)
        norm_w = (1 + 0.1 * torch.randn(latent, device=device)).to(dtype)
        up_w = (torch.randn(hidden, latent, device=device) / latent**0.5).to(dtype)
        h = hf_rms_norm(routed, norm_w, EPS)  # cuBLAS-alone's input (not timed)
        return routed, shared, norm_w, up_w, h

    def nbytes(t):
        return 2 * (hidden * latent + latent + t * latent + 2 * t * hidden)

    def tail(routed, shared, norm_w, up_w, h):
        return shared + hf_rms_norm(routed, norm_w, EPS) @ up_w.T

    norm_op = torch.ops.k3fusion.rms_norm
    norm_copy = torch.ops.k3fusion.rms_norm_and_copy

    def norm_copy_addmm(r, s, w, u, h):
        normed, out = norm_copy(r, w, EPS, s, False, None)
        return out.addmm_(normed, u.T)

    def compiled(mode):
        import torch._functorch.config as functorch_config
        import torch._inductor.config as inductor_config

        torch._dynamo.reset()
        if dry:  # exercise the wrapper, not Inductor (no C++ toolchain assumed on CPU)
            fn = torch.compile(tail, backend="eager", dynamic=False)
        else:
            fn = torch.compile(tail, mode=mode, dynamic=False)

        def call(*a):
            with inductor_config.patch(fx_graph_cache=False), \
                    functorch_config.patch(enable_autograd_cache=False):
                return fn(*a)
        return call

    base = {
        "gemm": lambda r, s, w, u, h: h @ u.T,
        "norm": lambda r, s, w, u, h: norm_op(r, w, EPS, False, None),
        "norm_addmm": lambda r, s, w, u, h: torch.addmm(s, norm_op(r, w, EPS, False, None), u.T),
        "norm_mm_add": lambda r, s, w, u, h: s + norm_op(r, w, EPS, False, None) @ u.T,
        "norm_copy_addmm": norm_copy_addmm,
        "op": lambda r, s, w, u, h: torch.ops.k3fusion.latent_moe_tail(r, s, w, EPS, u, None),
    }

    # PDL launches inside a CUDA-graph capture, tried once on their own first: a failed
    # capture inside the sweep could take later variants with it.
    pdl_error = None
    if not dry and not args.skip_triton:
        try:
            r, s, w, u, _ = inputs(4)
            for form in (dict(prenorm=True, pdl=True, split_k=2),
                         dict(normed_rows=True, pdl=True)):
                cuda_graph_us(lambda: launch(r, s, w, EPS, u, **form),
                              calls_per_graph=2, reps=3)
        except Exception as e:  # noqa: BLE001 - say why, skip the pdl variants
            pdl_error = f"{type(e).__name__}: {str(e)[:200]}"
            print(f"PDL under graph capture failed, pdl variants skipped: {pdl_error}",
                  flush=True)
            torch.cuda.synchronize()

    rows = []
    env = _environment(torch, dry)
    args.out.mkdir(parents=True, exist_ok=True)

    def write() -> dict:  # after every T: a run cut short still leaves its rows
        result = {"probe": "moe_tail_probe", "latent": latent, "hidden": hidden,
                  "dtype": "bfloat16", "eps": EPS, "dry_run": dry,
                  "pdl_preflight_error": pdl_error, "rows": rows, **env}
        (args.out / "moe_tail_probe.json").write_text(json.dumps(result, indent=2))
        return result

    for t in tokens:
        n_sets = 1 if dry else sets_to_outgrow_l2(nbytes(t))
        sets = [inputs(t) for _ in range(n_sets)]
        r0, s0, w0, u0, _ = sets[0]
        idx = torch.unique(torch.linspace(0, t - 1, min(t, CHECK_ROWS)).round().long())
        idx = idx.to(device)
        exact, tier_bound = tol.latent_tail_exact_and_bound(r0[idx][None], s0[idx][None], w0,
                                                            u0, EPS, 2.0**-8)
        kref, kbound = tol.tail_tolerance(r0[idx], s0[idx], w0, EPS, u0, False, truncating=dry)
        kref, kbound = kref.to(device).double(), kbound.to(device)
        row = {"T": t, "floor_us": hbm_floor_us(nbytes(t)), "input_sets": n_sets,
               "us": {}, "check": {}, "errors": {}}

        def measure(name, fn, check=True, arg_sets=None):
            arg_sets = sets if arg_sets is None else arg_sets
            try:
                out = fn(*arg_sets[0])
                if check:
                    o = out[idx].double()
                    tier = float(((o - exact).abs() / tier_bound).max())
                    kern = float(((o - kref).abs() / kbound).max())
                    fused = name == "kernel" or name.startswith("tri:")
                    ratio = kern if fused else tier
                    ok = bool(torch.isfinite(out).all()) and ratio <= 1.0
                    row["check"][name] = {"ok": ok, "worst_of_bound": ratio,
                                          "of_kernel_bound": kern, "of_tier_bound": tier}
                if not dry:
                    row["us"][name] = cuda_graph_us(fn, arg_sets)
            except Exception as e:  # noqa: BLE001 - record (e.g. out of shared memory), go on
                row["errors"][name] = f"{type(e).__name__}: {str(e)[:300]}"
                if dry:
                    traceback.print_exc()

        for name, fn in base.items():
            if args.quick and name == "norm_addmm":
                continue
            measure(name, fn, check=name not in ("gemm", "norm"))
        # In place into each set's own clone of shared (first call checked, before replays).
        measure("donated_addmm",
                lambda r, s, w, u, h: s.addmm_(norm_op(r, w, EPS, False, None), u.T),
                arg_sets=[(r, s.clone(), w, u, h) for r, s, w, u, h in sets])
        if t <= MAX_TOKENS and not args.skip_triton and not args.quick:
            measure("kernel", lambda r, s, w, u, h: launch(r, s, w, EPS, u))
        forms = {} if args.skip_triton else candidates(t)
        if args.quick:
            forms = {k: v for k, v in forms.items() if k in QUICK_CANDIDATES and 2 <= t <= 64}
        for label, opts in forms.items():
            if opts.get("pdl") and pdl_error:
                row["errors"][f"tri:{label}"] = f"skipped (PDL preflight: {pdl_error})"
                continue
            measure(f"tri:{label}",
                    lambda r, s, w, u, h, opts=opts: launch(r, s, w, EPS, u, **opts))
        if not args.skip_inductor:
            measure("inductor", compiled("default"))
            over = time.monotonic() - t_start > args.budget_s
            if not args.skip_autotune and t in args.autotune_tokens:
                if over:
                    row["errors"]["autotune"] = f"skipped: --budget-s {args.budget_s} spent"
                else:
                    measure("autotune", compiled("max-autotune-no-cudagraphs"))
        row["elapsed_s"] = time.monotonic() - t_start
        rows.append(row)
        wrong = [k for k, v in row["check"].items() if not v["ok"]]
        us = row["us"]
        tri = {k: v for k, v in us.items() if k.startswith("tri:") and k not in wrong}
        best = min(tri, key=tri.get) if tri else None
        print(f"T={t}: {len(us)} timed, {len(row['errors'])} errors, wrong: {wrong or 'none'}"
              + "".join(f", {k} {us[k]:.1f}" for k in ("gemm", "norm_addmm", "op", "kernel",
                                                       "inductor", "autotune",
                                                       "norm_copy_addmm", "donated_addmm")
                          if k in us)
              + (f", best {best} {tri[best]:.1f}" if best else "")
              + f" ({row['elapsed_s']:.0f} s)", flush=True)
        del sets
        if not dry:
            torch.cuda.empty_cache()
        write()

    result = write()
    print(table(result))
    bad = [(r["T"], k) for r in rows for k, v in r["check"].items() if not v["ok"]]
    return 1 if dry and (bad or any(r["errors"] for r in rows)) else 0


def _environment(torch, dry: bool) -> dict:
    import datetime

    import triton

    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": "cpu (interpreter)" if dry else torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda}


def table(result: dict) -> str:
    """Compact: per T the floor, the baselines, today's op, the best correct candidate."""
    head = (f"moe_tail_probe {result['gpu']} {result['date']} torch {result['torch']} "
            f"triton {result['triton']} L {result['latent']} -> H {result['hidden']} bf16, us")
    cols = ("floor", "gemm", "norm_addmm", "norm_mm_add", "norm_copy_addmm", "donated_addmm",
            "op", "kernel", "inductor", "autotune")
    lines = [head, "T | " + " | ".join(cols) + " | best tri (us) | best/gemm | wrong"]
    for r in result["rows"]:
        us, chk = r["us"], r["check"]

        def ok(k):
            return chk.get(k, {"ok": True})["ok"]

        cells = [f"{r['floor_us']:.1f}"]
        for k in cols[1:]:
            v = us.get(k)
            cells.append("-" if v is None else f"{v:.1f}" + ("" if ok(k) else "!"))
        tri = {k: v for k, v in us.items() if k.startswith("tri:") and ok(k)}
        best = min(tri, key=tri.get) if tri else None
        gemm = us.get("gemm")
        ratio = (f"{tri[best] / gemm:.2f}x" if best and gemm else "-")
        wrong = ",".join(k for k in chk if not ok(k)) or "-"
        cells += [f"{best[4:]} {tri[best]:.1f}" if best else "-", ratio, wrong]
        lines.append(f"{r['T']} | " + " | ".join(cells))
    errs = [(r["T"], k, v) for r in result["rows"] for k, v in r["errors"].items()]
    if errs:
        lines.append("errors: " + "; ".join(f"T={t} {k}: {v[:80]}" for t, k, v in errs[:12]))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
