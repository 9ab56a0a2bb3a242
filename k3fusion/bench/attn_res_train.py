"""Benchmark AttnRes forward + backward, as a training step runs it (needs CUDA).

``python -m k3fusion.bench.attn_res_train [--out DIR] [--tokens T ...] [--blocks N ...]
[--liger DIR]``

The step of a layer that closes a block, written as training code writes it (no in-place
bank write: the new prefix is a new tensor), bf16, ``H = 7168``: ``prefix + delta``, the
softmax mix over the completed blocks and the new prefix, the output norm; then the
gradient of every input and weight for a given output gradient. Timed under CUDA-graph
replay (forward and backward captured together) for eager, default Inductor and
``backend="k3fusion"``. ``--liger DIR`` (a directory holding the ``liger_kernel``
package, e.g. its unpacked wheel; never committed) adds Liger-Kernel's
``LigerAttnResFunction`` on the part it covers -- the mix alone, no prefix update and no
output norm -- beside default Inductor and k3fusion on that same part. Writes
``attn_res_train.json`` and ``.md`` to ``--out``. Method: docs/bench-methods.md,
"``attn_res_train``".
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import k3fusion

from .common import base_parser, compile_uncached, environment, hf_rms_norm, plot_series, \
    write_results
from .timing import cuda_graph_us, hbm_floor_us, sets_to_outgrow_l2

TOKENS = (512, 2048, 8192)
BLOCKS = (1, 4, 8)
HIDDEN = 7168
EPS = 1e-6


def full_step(prefix, delta, blocks, norm_w, proj_w, out_w):
    """``blocks [T, N, H]`` completed blocks; returns the normed mix of ``blocks`` and the
    new prefix ``prefix + delta``."""
    prefix = prefix + delta
    sources = torch.cat([blocks, prefix.unsqueeze(1)], 1)
    logits = F.linear(hf_rms_norm(sources, norm_w, EPS), proj_w).squeeze(-1)
    weights = logits.float().softmax(-1)
    mixed = (weights.to(sources.dtype).unsqueeze(-1) * sources).sum(1)
    return hf_rms_norm(mixed, out_w, EPS)


def mix_step(blocks, prefix, norm_w, proj_w):
    """The part Liger's ``attn_res`` covers: the softmax mix of ``blocks [T, N, H]`` and
    ``prefix [T, H]``."""
    sources = torch.cat([blocks, prefix.unsqueeze(1)], 1)
    logits = F.linear(hf_rms_norm(sources, norm_w, EPS), proj_w).squeeze(-1)
    weights = logits.float().softmax(-1)
    return (weights.to(sources.dtype).unsqueeze(-1) * sources).sum(1)


def _leaf(*shape, scale=1.0, offset=0.0, device="cuda", gen=None):
    t = offset + scale * torch.randn(*shape, device=device, generator=gen)
    return t.to(torch.bfloat16).requires_grad_()


def full_inputs(t: int, n: int, hidden: int = HIDDEN, device="cuda", gen=None) -> tuple:
    kw = dict(device=device, gen=gen)
    return (_leaf(t, hidden, **kw), _leaf(t, hidden, **kw), _leaf(t, n, hidden, **kw),
            _leaf(hidden, scale=0.1, offset=1, **kw), _leaf(1, hidden, scale=hidden**-0.5, **kw),
            _leaf(hidden, scale=0.1, offset=1, **kw),
            torch.randn(t, hidden, device=device, generator=gen).to(torch.bfloat16))  # d out


def mix_inputs(t: int, n: int, hidden: int = HIDDEN, device="cuda", gen=None) -> tuple:
    kw = dict(device=device, gen=gen)
    return (_leaf(t, n, hidden, **kw), _leaf(t, hidden, **kw),
            _leaf(hidden, scale=0.1, offset=1, **kw), _leaf(1, hidden, scale=hidden**-0.5, **kw),
            torch.randn(t, hidden, device=device, generator=gen).to(torch.bfloat16))


def full_bytes(t: int, n: int, hidden: int = HIDDEN) -> int:
    """Forward: read N blocks, prefix, delta; write out. Backward: read the output grad and
    the N + 1 sources, write N + 2 input grads (weights' grads are [H] rows)."""
    return 2 * t * hidden * ((n + 3) + (1 + n + 1 + n + 2))


def mix_bytes(t: int, n: int, hidden: int = HIDDEN) -> int:
    s = n + 1
    return 2 * t * hidden * ((s + 1) + (1 + s + s))


def with_grads(fn):
    """``fn(*leaves, dout)`` -> the forward's output and every leaf's gradient."""
    def step(*args):
        # Fresh leaves per call: a leaf made on the default stream would tie a CUDA-graph
        # capture to that (legacy) stream through its gradient node.
        *leaves, dout = args
        leaves = [a.detach().requires_grad_() for a in leaves]
        out = fn(*leaves)
        return out, torch.autograd.grad(out, leaves, dout)
    return step


def load_liger(directory: Path | None):
    """``LigerAttnResFunction`` from ``directory`` (None: not asked for)."""
    if directory is None:
        return None
    sys.path.insert(0, str(directory))
    try:
        return importlib.import_module("liger_kernel.ops.attn_res").LigerAttnResFunction
    finally:
        sys.path.remove(str(directory))


def liger_mix(liger):
    """Liger's op on the same sources, stacked ``[S, T, H]`` as it takes them: the timed
    step is given that stack already (its users build it with ``torch.stack``)."""
    def step(sources_first, norm_w, proj_w):
        return liger.apply(sources_first, proj_w[0], norm_w, EPS)
    return step


def _errors(got, want) -> float:
    return max(float((g.float() - w.float()).abs().max()) for g, w in zip(got, want))


def _largest(tensors) -> float:
    """The largest magnitude among the output and the gradients (their ulps scale errors)."""
    return max(float(t.float().abs().max()) for t in tensors)


def run(tokens=TOKENS, blocks=BLOCKS, liger=None, *, device="cuda", hidden=HIDDEN,
        timer=None, seed: int = 0) -> dict:
    """``seed``: the inputs' generator (the same inputs every run)."""
    timer = timer or cuda_graph_us
    gen = torch.Generator(device=device).manual_seed(seed)
    rows = []
    for n in blocks:
        for t in tokens:
            row = {"T": t, "blocks": n, "floor_us": hbm_floor_us(full_bytes(t, n, hidden)),
                   "mix_floor_us": hbm_floor_us(mix_bytes(t, n, hidden))}
            sets = [full_inputs(t, n, hidden, device, gen)
                    for _ in range(sets_to_outgrow_l2(full_bytes(t, n, hidden)))]
            variants = {"eager": with_grads(full_step)}
            k3fusion.reset_match_counts()
            for name in ("inductor", "k3fusion"):
                variants[name] = with_grads(compile_uncached(full_step, name))
            want = variants["eager"](*sets[0])
            row["largest"] = _largest([want[0], *want[1]])
            for name, fn in variants.items():
                got = fn(*sets[0])
                row[f"{name}_max_diff"] = _errors([got[0], *got[1]], [want[0], *want[1]])
                row[f"{name}_us"] = timer(fn, sets)
            row["k3fusion_matches"] = k3fusion.match_counts().get("attn_res", 0)
            msets = [mix_inputs(t, n, hidden, device, gen)
                     for _ in range(sets_to_outgrow_l2(mix_bytes(t, n, hidden)))]
            k3fusion.reset_match_counts()
            mix = {name: with_grads(compile_uncached(mix_step, name))
                   for name in ("inductor", "k3fusion")}
            mix_want = with_grads(mix_step)(*msets[0])
            row["mix_largest"] = _largest([mix_want[0], *mix_want[1]])
            for name, fn in mix.items():
                got = fn(*msets[0])
                row[f"mix_{name}_max_diff"] = _errors([got[0], *got[1]],
                                                      [mix_want[0], *mix_want[1]])
                row[f"mix_{name}_us"] = timer(fn, msets)
            row["mix_k3fusion_matches"] = k3fusion.match_counts().get("attn_res", 0)
            if liger is not None:
                lsets = [(torch.cat([bl, pr.unsqueeze(1)], 1).detach().transpose(0, 1)
                          .contiguous().requires_grad_(), *rest)
                         for bl, pr, *rest in msets]
                fn = with_grads(liger_mix(liger))
                got = fn(*lsets[0])
                d_sources = got[1][0].transpose(0, 1)
                row["mix_liger_max_diff"] = _errors(
                    [got[0], d_sources[:, :n], d_sources[:, n], *got[1][1:]],
                    [mix_want[0], *mix_want[1]])
                row["mix_liger_us"] = timer(fn, lsets)
            row["speedup_vs_inductor"] = row["inductor_us"] / row["k3fusion_us"]
            rows.append(row)
            print(", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                            for k, v in row.items()), flush=True)
    return {"bench": "attn_res_train", "hidden": hidden, "rows": rows,
            "liger": liger is not None, **environment(device)}


def markdown(result: dict) -> str:
    liger = result["liger"]
    head = ["blocks", "T", "eager", "default Inductor", "k3fusion", "vs Inductor", "HBM floor",
            "mix: Inductor", "mix: k3fusion", *(["mix: Liger"] if liger else []), "mix floor"]
    lines = [f"AttnRes forward + backward, bf16, H {result['hidden']}, {result['gpu']}, "
             f"{result['date']}, torch {result['torch']}, triton {result['triton']}. "
             "CUDA-graph replay, median us per step (forward and every input's gradient).", "",
             "| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in result["rows"]:
        cells = [str(r["blocks"]), str(r["T"])] + [f"{r[k]:.1f}" for k in (
            "eager_us", "inductor_us", "k3fusion_us")]
        cells += [f"{r['speedup_vs_inductor']:.2f}x", f"{r['floor_us']:.1f}",
                  f"{r['mix_inductor_us']:.1f}", f"{r['mix_k3fusion_us']:.1f}"]
        cells += [f"{r['mix_liger_us']:.1f}"] if liger else []
        cells += [f"{r['mix_floor_us']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    n = max(r["blocks"] for r in result["rows"])
    sub = {**result, "rows": [r for r in result["rows"] if r["blocks"] == n]}
    series = [("eager_us", "eager"), ("inductor_us", "default Inductor"),
              ("k3fusion_us", "k3fusion"), ("floor_us", "HBM floor")]
    plot_series(sub, series, f"AttnRes fwd+bwd ({n} blocks, H {result['hidden']}), bf16, "
                f"{result['gpu']}", path)


def main(argv=None) -> int:
    p = base_parser("python -m k3fusion.bench.attn_res_train", TOKENS)
    p.add_argument("--blocks", type=int, nargs="*", default=list(BLOCKS))
    p.add_argument("--liger", type=Path, default=None, metavar="DIR",
                   help="directory holding the liger_kernel package (its unpacked wheel)")
    args = p.parse_args(argv)
    if args.sweep or args.peers:
        p.error("--sweep and --peers do not apply to the training benchmark (see --liger)")
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    result = run(args.tokens, args.blocks, load_liger(args.liger))
    write_results(args.out, "attn_res_train", result, markdown(result), plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
