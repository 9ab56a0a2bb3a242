"""Benchmark the MLA q/kv RMSNorm pair (needs CUDA).

``python -m k3fusion.bench.qkv_rmsnorm [--out DIR] [--sweep] [--peers DIR]``

Kimi-K3's shapes, bf16, under CUDA-graph replay against the HBM floor: eager, default
``torch.compile``, the same with ``backend="k3fusion"``, the fused op, and each peer
kernel of ``--peers`` (:mod:`k3fusion.bench.peers`). Writes
``qkv_rmsnorm.json``, ``qkv_rmsnorm.md`` and ``qkv_rmsnorm.png`` to ``--out``. ``--sweep``
also times every rows-per-program choice of the kernel (for its heuristic).

How it measures (the shapes, the floor):
docs/bench-methods.md, section "``python -m k3fusion.bench.qkv_rmsnorm``".
"""

from __future__ import annotations

from pathlib import Path

import torch

import k3fusion
from k3fusion.kernels.qkv_rmsnorm import dual_rms_norm as launch

from . import peers as peer_kernels
from .common import (base_parser, compile_uncached, environment, hf_rms_norm, plot_series,
                     write_results)
from .timing import cuda_graph_us, hbm_floor_us, sets_to_outgrow_l2

TOKENS = (1, 8, 32, 128, 512, 4096, 16384)
#: The column peers are compared with: the fused op called directly as a peer's kernel is,
#: in the form a model's compiled graph launches (weights read before the PDL wait; the
#: bench's launches never write them).
PEER_BASELINE = "fused_op_early_us"
Q_LORA, KV_LORA, ROPE = 1536, 512, 64
EPS = 1e-6


def qkv_norms(q_c, q_w, kv, kv_w):
    kv_c, _ = kv.split([KV_LORA, ROPE], dim=-1)
    return hf_rms_norm(q_c, q_w, EPS), hf_rms_norm(kv_c, kv_w, EPS)


def _inputs(t: int, device: str = "cuda"):
    dt = torch.bfloat16
    q_c = torch.randn(t, Q_LORA, device=device, dtype=dt)
    kv = torch.randn(t, KV_LORA + ROPE, device=device, dtype=dt)
    q_w = (1 + 0.1 * torch.randn(Q_LORA, device=device)).to(dt)
    kv_w = (1 + 0.1 * torch.randn(KV_LORA, device=device)).to(dt)
    return q_c, q_w, kv, kv_w


def _bytes(t: int) -> int:
    return 2 * (2 * t * (Q_LORA + KV_LORA) + Q_LORA + KV_LORA)


def peer_inputs(q_c, q_w, kv, kv_w) -> dict:
    """One input set as a peer's ``make`` gets it (``peers.CONTRACTS["qkv_rmsnorm"]``)."""
    return {"q": q_c, "q_weight": q_w, "kv": kv[:, :KV_LORA], "kv_weight": kv_w}


def peer_point(t: int) -> dict:
    return {"op": "qkv_rmsnorm", "T": t, "q_size": Q_LORA, "kv_size": KV_LORA,
            "kv_stride": KV_LORA + ROPE, "eps": EPS}


def check_outputs(out, ref) -> None:
    """The bound every variant and peer is held to against the eager pair."""
    for o, r in zip(out, ref, strict=True):
        torch.testing.assert_close(o, r, rtol=2 ** -7, atol=1e-2)


def _peer_check(args, ref):
    def check(make):
        try:
            check_outputs(make(peer_inputs(*[a.clone() for a in args]))(), ref)
        except (AssertionError, TypeError, ValueError) as e:  # wrong values, count or shape
            return peer_kernels.failure(e)
        return None
    return check


def run(tokens=TOKENS, sweep: bool = False, peers=(), *, device="cuda", timer=None,
        backends=None) -> dict:
    """``peers``: :class:`peers.Peer` of this op. ``device``, ``timer`` (``(fn, arg_sets)
    -> us``, default :func:`cuda_graph_us`) and ``backends`` (``{"inductor": ...,
    "k3fusion": ...}``, names or dynamo backends) let a CPU test run the loop."""
    timer = timer or cuda_graph_us
    backends = backends or {"inductor": "inductor", "k3fusion": "k3fusion"}

    def fused_op(q_c, q_w, kv, kv_w):
        return torch.ops.k3fusion.dual_rms_norm(q_c, q_w, EPS, kv[:, :KV_LORA], kv_w, EPS)

    def fused_op_early(q_c, q_w, kv, kv_w):  # as the pass calls it in a model's graph
        return torch.ops.k3fusion.dual_rms_norm(q_c, q_w, EPS, kv[:, :KV_LORA], kv_w, EPS,
                                                weights_early=True)

    rows = []
    for t in tokens:
        # Rotate input sets so that every variant reads from HBM, not from L2.
        sets = [_inputs(t, device) for _ in range(sets_to_outgrow_l2(_bytes(t)))]
        ref = qkv_norms(*sets[0])
        k3fusion.reset_match_counts()
        variants = {
            "eager": qkv_norms,
            "inductor": compile_uncached(qkv_norms, backends["inductor"]),
            "k3fusion": compile_uncached(qkv_norms, backends["k3fusion"]),
            "fused_op": fused_op,
            "fused_op_early": fused_op_early,
        }
        row = {"T": t, "floor_us": hbm_floor_us(_bytes(t)), "input_sets": len(sets)}
        for name, fn in variants.items():
            check_outputs(fn(*sets[0]), ref)  # compiles; then check the answer before timing
            row[f"{name}_us"] = timer(fn, sets)
        row["k3fusion_matches"] = k3fusion.match_counts().get("qkv_rmsnorm", 0)
        if peers:
            row["peers"] = peer_kernels.time_peers(
                peers, peer_point(t), [peer_inputs(*s) for s in sets], _peer_check(sets[0], ref),
                timer)
            peer_kernels.summarize(row, PEER_BASELINE)
        if sweep:
            outs = [(torch.empty_like(q), torch.empty(t, KV_LORA, device="cuda", dtype=q.dtype))
                    for q, *_ in sets]
            for r in (1, 2, 4):
                for w in (1, 2, 4, 8):
                    row[f"rows{r}_warps{w}_us"] = cuda_graph_us(
                        lambda q_c, q_w, kv, kv_w, y1, y2, r=r, w=w: launch(
                            q_c, q_w, EPS, kv[:, :KV_LORA], kv_w, EPS, y1, y2,
                            rows_per_program=r, num_warps=w),
                        [s + o for s, o in zip(sets, outs)])
        row["speedup_vs_inductor"] = row["inductor_us"] / row["k3fusion_us"]
        row["floor_fraction"] = row["floor_us"] / row["k3fusion_us"]
        rows.append(row)
        print(", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
              flush=True)
    return {"bench": "qkv_rmsnorm", "rows": rows, "peers": peer_kernels.sources(peers),
            **environment(device)}


def markdown(result: dict) -> str:
    lines = [
        f"q/kv RMSNorm pair, q 1536 + kv 512-of-576, bf16. {result['gpu']}, {result['date']}, "
        f"torch {result['torch']}, triton {result['triton']}. CUDA-graph replay (20 calls per "
        "graph, inputs rotated to outgrow L2), median us per call.",
        "",
        "| T | eager | default Inductor | k3fusion (compiled) | fused op | fused op, weights "
        "early | HBM floor | vs Inductor | of floor |"
        + "".join(f" {c} |" for c in peer_kernels.table_columns(result)),
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        + "---:|" * len(peer_kernels.table_columns(result)),
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['T']} | {r['eager_us']:.2f} | {r['inductor_us']:.2f} | {r['k3fusion_us']:.2f} "
            f"| {r['fused_op_us']:.2f} | {r['fused_op_early_us']:.2f} | {r['floor_us']:.2f} "
            f"| {r['speedup_vs_inductor']:.2f}x "
            f"| {100 * r['floor_fraction']:.0f}% |"
            + "".join(f" {c} |" for c in peer_kernels.table_cells(result, r)))
    lines += peer_kernels.sources_lines(result, "the fused op with its weights read early (the form "
                                        "a compiled model's graph launches)")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    plot_series(result, [("eager_us", "eager"), ("inductor_us", "default Inductor"),
                         ("k3fusion_us", "k3fusion"), ("floor_us", "HBM floor")]
                + peer_kernels.plot_series_of(result),
                f"MLA q/kv RMSNorm pair, bf16, {result['gpu']}", path)


def main(argv=None) -> int:
    parser = base_parser("python -m k3fusion.bench.qkv_rmsnorm", TOKENS)
    args = parser.parse_args(argv)
    peers = peer_kernels.from_args(parser, args, "qkv_rmsnorm")
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    result = run(args.tokens, args.sweep, peers)
    write_results(args.out, "qkv_rmsnorm", result, markdown(result), plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
