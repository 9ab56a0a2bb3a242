"""``python -m k3fusion`` (or ``k3fusion``): compile the built-in tiny Kimi-K3 three ways and
report the fusions; ``explain`` and ``bench`` are its subcommands.

Runs the model eagerly, with default ``torch.compile`` and with ``backend="k3fusion"``,
and prints per fusion the sites the model has and the matches the pass made, then the
max error of each compiled run against eager (one per compile path). On CUDA it also
times one forward of each under CUDA-graph replay. Exit status: 0 when every site was
fused and both errors are within the rounding bound, 1 otherwise, 2 for a usage error.
Progress goes to stderr, one line per stage (``--quiet`` turns it off).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import textwrap
import traceback
from typing import Any

import torch

import k3fusion
from k3fusion.bench.timing import cuda_graph_us
from k3fusion.explain import StageProgress, explain
from k3fusion.models import KimiK3Config, KimiK3ForCausalLM
from k3fusion.models.kimi_k3 import ATTN_RES_BANKS, NORM_STYLES, count_latent_moe_layers
from k3fusion.patterns.attn_res import FUSION as ATTN_RES, HANDOFF_NAME
from k3fusion.patterns.moe_tail import FUSION as MOE_TAIL
from k3fusion.patterns.qkv_rmsnorm import FUSION as QKV_RMSNORM
from k3fusion.patterns.registry import COUNT_NAMES, FUSIONS

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Max |compiled - eager| / max|eager| a correct compile stays under: a few roundings
# of the model dtype through a handful of layers (fp32: reassociation only).
_REL_TOL = {torch.bfloat16: 3e-2, torch.float16: 4e-3, torch.float32: 1e-4}

_DESCRIPTION = ("Compile the built-in tiny Kimi-K3 model eagerly, with default torch.compile and "
                "with backend='k3fusion', and report per fusion the sites and the matches, and "
                "each compiled run's max error against eager. Exit status: 0 when every site "
                "was fused and the errors are within bounds, 1 otherwise, 2 for a usage error.")


def _prog() -> str:
    """``k3fusion`` when run as the console script, else ``python -m k3fusion``."""
    return "k3fusion" if os.path.basename(sys.argv[0] or "") == "k3fusion" else "python -m k3fusion"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _device(text: str) -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N``, and only a CUDA device this build and machine have."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"not a device: {text!r} (cpu, cuda or cuda:N)") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r}: the main job runs on cpu or cuda")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build of torch" if torch.version.cuda is None else "no visible GPU"
            raise argparse.ArgumentTypeError(f"{text!r}: CUDA is not available ({build}, "
                                             f"torch {torch.__version__}); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(
                f"{text!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return device


class _Parser(argparse.ArgumentParser):
    """A usage error is one line on stderr (and exit status 2), not the whole usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help for usage)\n")


#: subcommand -> what it does, for the main job's ``--help``.
SUBCOMMANDS = {
    "explain": "compile the tiny model once and say, per candidate site, what was fused and "
               "why each other one was not, with its source line",
    "bench": "run the per-op and decoder-stack benchmarks (CUDA)",
}


def _subcommand_list(prog: str) -> str:
    lines = [f"subcommands ({prog} SUBCOMMAND --help for its flags):"]
    for name, what in SUBCOMMANDS.items():
        lines += textwrap.wrap(what, 78, initial_indent=f"  {name:<10}", subsequent_indent=" " * 12)
    return "\n".join(lines)


def _main_parser() -> _Parser:
    prog = _prog()
    p = _Parser(prog=prog, description=textwrap.fill(_DESCRIPTION, 78),
                epilog=_subcommand_list(prog), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--quiet", "-q", action="store_true",
                   help="no progress lines on stderr")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16",
                   help="dtype of the model and its activations (default: bf16)")
    p.add_argument("--device", type=_device, default=None,
                   help="cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument("--tokens", type=_positive_int, default=16, help="sequence length of the input")
    p.add_argument("--batch", type=_positive_int, default=2, help="batch size of the input")
    p.add_argument("--norm-style", choices=NORM_STYLES, default="hf",
                   help="RMSNorm formulation of the model (default: hf)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the model's weights and the input ids (default: 0)")
    p.add_argument("--no-attn-res", dest="attn_res", action="store_false",
                   help="build the model with plain residuals instead of Block AttnRes")
    p.add_argument("--latent-moe", action="store_true",
                   help="use the normalized latent MoE instead of the dense MLP "
                        "(reports the moe_tail fusion)")
    p.add_argument("--bank", choices=ATTN_RES_BANKS, default=None,
                   help="how the AttnRes model keeps its completed blocks (default: list)")
    p.add_argument("--block-size", type=_positive_int, default=None,
                   help="AttnRes block size in layers (default 1: a block at every layer)")
    return p


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = _main_parser()
    args = p.parse_args(argv)
    if not args.attn_res:
        given = [flag for flag, v in (("--bank", args.bank), ("--block-size", args.block_size))
                 if v is not None]
        if given:
            p.error(f"{' and '.join(given)} {'configure' if len(given) > 1 else 'configures'} "
                    "Block AttnRes, which --no-attn-res turns off")
    args.bank = args.bank or "list"
    args.block_size = args.block_size or 1
    return args


def _max_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    scale = ref.float().abs().max().item() or 1.0
    return (out.float() - ref.float()).abs().max().item() / scale


def run(args: argparse.Namespace) -> dict[str, Any]:
    progress = StageProgress(getattr(args, "quiet", False), "k3fusion")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = _DTYPES[args.dtype]
    config = KimiK3Config.tiny(dtype=dtype, norm_style=args.norm_style, attn_res=args.attn_res,
                               attn_res_bank=args.bank, attn_res_block_size=args.block_size,
                               latent_moe=args.latent_moe)
    model = KimiK3ForCausalLM(config, seed=args.seed).to(device).eval()
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.tokens), generator=gen).to(device)

    # Inductor's caches stay on: a warm run is served from them and its match counts
    # come back with the cached graph (k3fusion.counters).
    with torch.no_grad():
        progress(f"eager forward of the tiny model on {device}, input {list(ids.shape)}")
        eager_out = model(ids)
        progress("default torch.compile: compiling and running (a CPU compiles for a while "
                 "the first time; later runs are served from Inductor's cache)")
        torch._dynamo.reset()
        default = torch.compile(model)
        default_out = default(ids)
        progress("torch.compile(backend='k3fusion'): compiling and running")
        k3fusion.reset_match_counts()
        torch._dynamo.reset()
        fused = torch.compile(model, backend="k3fusion")
        fused_out = fused(ids)
        counts = k3fusion.match_counts()

        timings = None
        if device.type == "cuda":
            progress("timing eager, inductor and k3fusion under CUDA-graph replay")
            timings = {name: cuda_graph_us(fn, [(ids,)], calls_per_graph=1) / 1e3
                       for name, fn in (("eager", model), ("inductor", default), ("k3fusion", fused))}
    progress("done")

    tol = _REL_TOL[dtype]
    # The model's sites per match_counts() key; a row for each key it has sites for (a
    # model without AttnRes has no attn_res row, a dense one no moe_tail row).
    sites = {QKV_RMSNORM.name: model.mla_layers, ATTN_RES.name: model.attn_res_sites,
             # each layer's closing prefix + mlp_out, folded into the next site
             HANDOFF_NAME: config.num_layers if config.attn_res else 0,
             MOE_TAIL.name: count_latent_moe_layers(model)}  # one tail per latent-MoE layer
    fusions = [{"fusion": name, "sites": sites[name], "matches": counts[name]}
               for name in COUNT_NAMES if sites.get(name)]
    errors = {"inductor": _max_rel_err(default_out, eager_out),
              "k3fusion": _max_rel_err(fused_out, eager_out)}
    ok = all(f["matches"] == f["sites"] for f in fusions) and all(e <= tol for e in errors.values())
    features = [f"attn_res {args.bank} bank" if args.attn_res else "plain residuals"]
    if args.attn_res and args.block_size != 1:
        features.append(f"block size {args.block_size}")
    if args.latent_moe:
        features.append("latent MoE")
    return {
        "model": f"KimiK3ForCausalLM(tiny, {', '.join(features)})",
        "device": str(device), "dtype": args.dtype,
        "norm_style": args.norm_style, "input_shape": list(ids.shape),
        "torch": torch.__version__, "k3fusion": k3fusion.__version__,
        "fusions": fusions, "max_rel_err_vs_eager": errors, "tolerance": tol,
        "cuda_graph_ms": timings, "ok": ok,
    }


def _print_table(report: dict[str, Any]) -> None:
    print(f"k3fusion {report['k3fusion']} on {report['model']}, {report['dtype']}, "
          f"{report['device']}, input {report['input_shape']}, torch {report['torch']}")
    print(f"{'fusion':<24}{'sites':>7}{'matches':>9}")
    for f in report["fusions"]:
        print(f"{f['fusion']:<24}{f['sites']:>7}{f['matches']:>9}")
    errs = report["max_rel_err_vs_eager"]
    print(f"max |out - eager| / max|eager|: inductor {errs['inductor']:.2e}, "
          f"k3fusion {errs['k3fusion']:.2e} (bound {report['tolerance']:.0e})")
    if report["cuda_graph_ms"]:
        t = report["cuda_graph_ms"]
        print("CUDA-graph replay, median ms: " + ", ".join(f"{k} {v:.4f}" for k, v in t.items()))
    if report["ok"]:
        print("OK")
    else:
        missed = [f["fusion"] for f in report["fusions"] if f["matches"] != f["sites"]]
        over = [k for k, e in errs.items() if e > report["tolerance"]]
        print("FAILED: " + "; ".join(
            ([f"not every site fused ({', '.join(missed)})"] if missed else [])
            + ([f"error above the bound ({', '.join(over)})"] if over else [])))


#: ``python -m k3fusion bench`` runs these, in this order: {name: module under k3fusion.bench}.
#: Each fusion's benchmark is named as the fusion; then AttnRes forward + backward (the
#: training mode) and the decoder step.
BENCHES = {**{f.name: f.name for f in FUSIONS}, "attn_res_train": "attn_res_train",
           "decoder": "decoder"}
#: The benchmarks that time peer kernels (``--peers DIR``): the fusions' own, one per op of
#: ``bench.peers.OPS``.
PEER_BENCHES = tuple(f.name for f in FUSIONS)


def _bench_names(text: str) -> list[str]:
    """``--only`` value: comma-separated names of :data:`BENCHES` (order kept, no repeats)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in BENCHES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown benchmark {', '.join(unknown) or '(none given)'}; "
            f"choose from {','.join(BENCHES)}")
    return list(dict.fromkeys(names))


def _bench_parser() -> _Parser:
    p = _Parser(prog=f"{_prog()} bench",
                description="run the per-op benchmarks and the decoder-stack benchmark (CUDA)")
    p.add_argument("--out", default="bench-out", help="folder for JSON, markdown and plots")
    p.add_argument("names", nargs="*", metavar="NAME",
                   help=f"benchmarks to run, as --only takes them ({', '.join(BENCHES)})")
    p.add_argument("--only", type=_bench_names, default=None, metavar="NAMES",
                   help=f"comma-separated subset of {','.join(BENCHES)} (default: all)")
    p.add_argument("--peers", default=None, metavar="DIR",
                   help="also check and time the peer kernels whose adapters are in DIR, a "
                        f"directory outside the repo ({', '.join(PEER_BENCHES)}; "
                        "docs/bench-methods.md, 'Peer kernels')")
    return p


def _parse_bench(argv: list[str]) -> argparse.Namespace:
    """The bench flags; bad names and a bad --peers directory or adapter are usage errors,
    found before any benchmark runs."""
    p = _bench_parser()
    args = p.parse_args(argv)
    if args.names and args.only is not None:
        p.error("give the benchmarks either as names or with --only, not both")
    try:
        args.only = (_bench_names(",".join(args.names)) if args.names
                     else args.only or list(BENCHES))
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    if args.peers is not None:
        from k3fusion.bench import peers  # the bench package: only with --peers

        if not set(args.only) & set(PEER_BENCHES):
            p.error(f"--peers: none of {', '.join(args.only)} times peers (only "
                    f"{', '.join(PEER_BENCHES)} do)")
        try:
            peers.load_peers(args.peers)  # every adapter, so a typo fails now, not mid-run
        except peers.AdapterError as e:
            p.error(str(e))
    return args


def bench(argv: list[str]) -> int:
    """``python -m k3fusion bench [NAME ...] [--out DIR] [--only NAMES] [--peers DIR]``: the
    benchmarks (needs CUDA).

    Runs each selected benchmark's ``main(["--out", DIR])`` (``--peers DIR`` added for those
    that time peers); one that fails (non-zero or
    an exception) is reported and the rest still run; the exit status is non-zero if any
    failed. A benchmark module that is not there (yet) is skipped with a note.
    """
    args = _parse_bench(argv)
    if not torch.cuda.is_available():
        print(f"{_prog()} bench needs a CUDA GPU (none is visible here); "
              "see docs/benchmarks.md for results measured on an H200", file=sys.stderr)
        return 2
    outcome: dict[str, str] = {}
    for name in args.only:
        module_name = f"k3fusion.bench.{BENCHES[name]}"
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name:
                raise
            outcome[name] = f"skipped ({module_name} is not there)"
            print(f"bench {name}: skipped, {module_name} is not there", file=sys.stderr)
            continue
        print(f"== bench {name} ==", flush=True)
        try:
            peers = (["--peers", args.peers]
                     if args.peers is not None and name in PEER_BENCHES else [])
            status = module.main(["--out", args.out, *peers])
        except SystemExit as e:
            status = e.code if e.code is None or isinstance(e.code, int) else 1
            if status == 1 and not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
        except Exception:  # noqa: BLE001 - report, run the rest, fail at the end
            traceback.print_exc()
            status = 1
        outcome[name] = "ok" if not status else f"FAILED (exit {status})"
    print("bench summary: " + ", ".join(f"{k} {v}" for k, v in outcome.items()), flush=True)
    return 1 if any(v.startswith("FAILED") for v in outcome.values()) else 0


def _explain_parser() -> _Parser:
    p = _Parser(prog=f"{_prog()} explain",
                description="Compile the built-in tiny Kimi-K3 model with backend='k3fusion' "
                            "and run it once under torch.no_grad() (as the main job does), then "
                            "print per fusion the sites fused and, for each candidate left "
                            "alone, why, with its source line (k3fusion.explain). Progress "
                            "goes to stderr, a line per compiled graph.")
    p.add_argument("--tokens", type=_positive_int, default=8,
                   help="sequence length of the input (default: 8)")
    p.add_argument("--dynamic", action="store_true",
                   help="compile with dynamic shapes (torch.compile(dynamic=True))")
    p.add_argument("--verbose", action="store_true",
                   help="also list rsqrt ops that are no RMSNorm")
    p.add_argument("--no-attn-res", dest="attn_res", action="store_false",
                   help="build the model with plain residuals instead of Block AttnRes")
    p.add_argument("--latent-moe", action="store_true",
                   help="use the normalized latent MoE instead of the dense MLP")
    return p


#: subcommand -> its parser (the main job's is :func:`_main_parser`).
SUBCOMMAND_PARSERS = {"explain": _explain_parser, "bench": _bench_parser}


def _parse_explain(argv: list[str]) -> argparse.Namespace:
    return _explain_parser().parse_args(argv)


def explain_main(argv: list[str]) -> int:
    """``python -m k3fusion explain``: :func:`k3fusion.explain` on the built-in tiny model."""
    args = _parse_explain(argv)
    config = KimiK3Config.tiny(attn_res=args.attn_res, latent_moe=args.latent_moe)
    model = KimiK3ForCausalLM(config, seed=0).eval()
    ids = torch.randint(0, config.vocab_size, (2, args.tokens),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        explain(model, ids, dynamic=args.dynamic, verbose=args.verbose)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        return bench(argv[1:])
    if argv[:1] == ["explain"]:
        return explain_main(argv[1:])
    args = _parse(argv)
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_table(report)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
