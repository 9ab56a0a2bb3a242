"""The decoder-stack benchmark (``k3fusion.bench.decoder``): its model, its equivalence check
and its sweep.

On CPU the stack is built at tiny width (same switches: AttnRes with a boundary inside the
stack, latent MoE); the sweep runs with pass-through dynamo backends and a wall-clock timer
standing in for Inductor and CUDA-graph replay, so its bookkeeping is tested without a GPU.
The ``cuda`` test checks model-level equivalence at real K3 widths.
"""

from __future__ import annotations

import json

import pytest
import torch

import k3fusion
from k3fusion.bench import decoder

from graph_utils import fresh_state

_FIXTURES = (fresh_state,)  # used by name (usefixtures)

pytestmark = pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")


def _tiny(layers: int = 2):
    return decoder.stack_config(layers, width="tiny")


def test_k3_stack_has_k3_widths_a_boundary_inside_and_fits_one_gpu():
    cfg = decoder.stack_config()
    assert (cfg.hidden_size, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim,
            cfg.latent_size) == (7168, 1536, 512, 64, 3584)
    assert cfg.attn_res and cfg.latent_moe and cfg.dtype == torch.bfloat16
    assert cfg.num_layers == decoder.LAYERS
    writes = [i for i in range(cfg.num_layers) if i % cfg.attn_res_block_size == 0]
    assert writes[0] == 0 and any(0 < i < cfg.num_layers for i in writes)
    # every expert runs densely anyway; top_k == num_experts keeps routing continuous
    assert cfg.top_k == cfg.num_experts
    assert 1e9 < decoder.weight_bytes(cfg) < 10e9
    assert decoder.block_size_for(1) == decoder.block_size_for(2) == 1


def test_stack_config_rejects_an_unknown_width():
    with pytest.raises(ValueError, match="width"):
        decoder.stack_config(2, width="huge")


@pytest.mark.parametrize(("step", "t", "shape"), [("decode", 3, (3, 1)), ("prefill", 5, (1, 5))])
def test_tiny_stack_runs_on_cpu(step, t, shape):
    cfg = _tiny()
    model = decoder.build_model(cfg, 0, "cpu")
    ids = decoder.stack_inputs(step, t, cfg.vocab_size, 0, "cpu")
    assert tuple(ids.shape) == shape
    with torch.no_grad():
        out = model.model(ids)
    assert out.shape == (*shape, cfg.hidden_size) and out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    assert decoder.expected_sites(model) == {"qkv_rmsnorm": 2, "attn_res": 5, "moe_tail": 2}


def test_build_model_is_seeded_and_leaves_the_global_rng_alone():
    cfg = _tiny(1)
    state = torch.get_rng_state()
    a, b = (decoder.build_model(cfg, 3, "cpu").state_dict() for _ in range(2))
    c = decoder.build_model(cfg, 4, "cpu").state_dict()
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.self_attn.q_a_proj.weight"],
                           c["model.layers.0.self_attn.q_a_proj.weight"])


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_state")
def test_equivalence_passes_for_the_k3fusion_compile_on_cpu():
    cfg = _tiny(1)
    model = decoder.build_model(cfg, 0, "cpu")
    compiled = torch.compile(model.model, backend="k3fusion", dynamic=False)
    records = decoder.check_equivalence(model, {"k3fusion": compiled}, "decode", 4, [0, 1])
    assert decoder.equivalence_failures(records) == []
    assert [r["seed"] for r in records] == [0, 1] and all(r["ok"] for r in records)
    # the check compared a fused model, not an unfused one
    counts = k3fusion.match_counts()
    assert all(counts.get(name, 0) > 0 for name in decoder.expected_sites(model)), counts


def test_equivalence_catches_a_dropped_norm_weight():
    # The final RMSNorm's weight (1 +- 0.1) left out: a 10% error, far beyond rounding.
    cfg = _tiny()
    model = decoder.build_model(cfg, 0, "cpu")

    def wrong(ids):
        return model.model(ids) / model.model.norm.weight

    records = decoder.check_equivalence(model, {"k3fusion": wrong}, "prefill", 6, [0, 1])
    failures = decoder.equivalence_failures(records)
    assert len(failures) == 2 and all("k3fusion error vs fp64" in f for f in failures)
    assert not any(r["ok"] for r in records)


def _wall_timer(fn, arg_sets, calls_per_graph):
    import time

    start = time.perf_counter()
    for args in arg_sets:
        fn(*args)
    return (time.perf_counter() - start) / len(arg_sets) * 1e6


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_state")
def test_sweep_on_cpu_writes_table_json_and_plot(tmp_path):
    from k3fusion.bench.common import write_results

    # two distinct "compilers" (dynamo keeps a cache entry per backend)
    backends = {"inductor": lambda gm, example_inputs: gm.forward,
                "k3fusion": lambda gm, example_inputs: gm.forward}
    config = decoder.stack_config(1, width="tiny", num_experts=1, top_k=1)  # quick to trace
    result = decoder.run(tokens=[2, 3, 5], prefill=[4], seeds=1, config=config, device="cpu",
                         backends=backends, timer=_wall_timer, progress=False)
    assert result["ok"] and [(r["step"], r["T"]) for r in result["rows"]] == [
        ("decode", 2), ("decode", 3), ("decode", 5), ("prefill", 4)]
    # dynamic=None: decode T=2 specialized, T=3 recompiles with a dynamic token dim, T=5
    # reuses that graph, [1, 4] (another dim changed) recompiles
    for name in ("inductor", "k3fusion"):
        assert [r[f"{name}_compiled"] for r in result["rows"]] == [True, True, False, True]
        assert [r[f"{name}_compile_s"] is None for r in result["rows"]] == [
            False, False, True, False]
    for r in result["rows"]:
        assert all(r[f"{n}_us"] > 0 for n in ("eager", "inductor", "k3fusion"))
        assert r["speedup_vs_inductor"] > 0
    assert len(result["equivalence"]) == 4 and result["compile_shapes"] == "auto"
    write_results(tmp_path, "decoder", result, decoder.markdown(result), decoder.plot)
    md = (tmp_path / "decoder.md").read_text()
    assert "| decode | 3 |" in md and "| prefill | 4 |" in md and "**NO**" not in md
    assert "| decode | 5 |" in md and "| reused | reused | reused |" in md
    assert json.loads((tmp_path / "decoder.json").read_text())["rows"][3]["T"] == 4
    try:  # the plot needs the `bench` extra; the test extra alone (CI) writes none
        import matplotlib  # noqa: F401
    except ImportError:
        assert not (tmp_path / "decoder.png").exists()
    else:
        assert (tmp_path / "decoder.png").stat().st_size > 0


@pytest.mark.usefixtures("fresh_state")
def test_sweep_with_reduce_overhead_compiles_times_and_checks_each_mode():
    modes_seen, timed = [], []

    def make_backend():  # one per name (dynamo keeps a cache entry per backend)
        def backend(gm, example_inputs, mode=None, **_):
            modes_seen.append(mode)
            return gm.forward
        return backend

    def loop_timer(fn, arg_sets, calls_per_graph):
        timed.append(fn)
        return 100.0

    config = decoder.stack_config(1, width="tiny", num_experts=1, top_k=1)
    result = decoder.run(tokens=[2], prefill=[], seeds=1, config=config, device="cpu",
                         backends={"inductor": make_backend(), "k3fusion": make_backend()},
                         timer=_wall_timer, loop_timer=loop_timer, progress=False,
                         reduce_overhead=True)
    assert result["ok"] and sorted(modes_seen, key=str) == [None, None, "reduce-overhead",
                                                            "reduce-overhead"]
    assert result["variants"] == {"inductor": "default", "k3fusion": "default",
                                  "inductor_ro": "reduce-overhead",
                                  "k3fusion_ro": "reduce-overhead"}
    row, = result["rows"]
    assert len(timed) == 2 and row["inductor_ro_us"] == row["k3fusion_ro_us"] == 100.0
    assert row["ro_speedup_vs_inductor"] == 1.0 and row["k3fusion_ro_compiled"]
    # the reduce-overhead k3fusion variant is checked against the bound like the default one
    assert "k3fusion_ro_within" in result["equivalence"][0]
    md = decoder.markdown(result)
    assert "| decode | 2 | 100.0 | 100.0 | 1.000x |" in md, md
    assert decoder._parse([]).reduce_overhead and \
        not decoder._parse(["--no-reduce-overhead"]).reduce_overhead


@pytest.mark.usefixtures("fresh_state")
def test_sweep_stops_at_a_failed_equivalence():
    def wrong_backend(gm, example_inputs):  # a "compiler" that breaks the output
        def run(*args):
            return [o * 1.25 if isinstance(o, torch.Tensor) and o.is_floating_point() else o
                    for o in gm(*args)]
        return run

    result = decoder.run(tokens=[2, 3], prefill=[], seeds=1, static=True, config=_tiny(1),
                         device="cpu", backends={"k3fusion": wrong_backend},
                         timer=_wall_timer, progress=False)
    assert not result["ok"] and result["rows"] == [] and len(result["equivalence"]) == 1
    assert result["compile_shapes"] == "static"
    assert "decode T=2 seed 0: k3fusion error" in result["failure"][0]
    assert "**FAILED" in decoder.markdown(result)


@pytest.mark.parametrize("argv", [["--layers", "0"], ["--seeds", "0"], ["--tokens", "0"],
                                  ["--tokens", "--prefill"], ["--fake-tp"],
                                  ["--fake-tp", "--rank-of", "1"]])
def test_cli_rejects_bad_arguments(argv):
    with pytest.raises(SystemExit) as e:
        decoder._parse(argv)
    assert e.value.code == 2


def test_cli_quick_and_defaults():
    d = decoder._parse([])
    assert (d.layers, d.tokens, d.prefill, d.seeds, d.static) == (4, [1, 8, 32, 64], [512, 4096],
                                                                  3, False)
    q = decoder._parse(["--quick", "--seeds", "3"])
    assert (q.layers, q.tokens, q.prefill, q.seeds) == (2, [1, 32], [512], 3)
    assert decoder._parse(["--prefill", "--static"]).prefill == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_main_without_cuda_says_so():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        decoder.main(["--quick"])


@pytest.mark.cuda
@pytest.mark.usefixtures("fresh_state")
@pytest.mark.parametrize(("step", "t"), [("decode", 8), ("prefill", 512)])
def test_k3_width_stack_matches_eager_within_bf16(step, t):
    """2 layers at K3 widths (one block boundary inside), compiled with k3fusion, against
    eager and fp64 over 3 seeds (weights and inputs redrawn in place: one compile)."""
    cfg = decoder.stack_config(2)
    model = decoder.build_model(cfg, 0, "cuda")
    compiled = torch.compile(model.model, backend="k3fusion")
    records = decoder.check_equivalence(model, {"k3fusion": compiled}, step, t, [0, 1, 2])
    assert decoder.equivalence_failures(records) == []
    counts = k3fusion.match_counts()
    assert all(counts.get(name, 0) > 0 for name in decoder.expected_sites(model)), counts


def test_rank_view_divides_heads_and_expert_widths_only():
    full, rank = decoder.stack_config(), decoder.stack_config(rank_of=8)
    assert (rank.num_heads, rank.moe_intermediate_size) == (8, 256)
    for name in ("hidden_size", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
                 "latent_size", "num_experts", "top_k", "num_layers"):
        assert getattr(rank, name) == getattr(full, name), name
    assert decoder.rank_view(full, 1) is full
    with pytest.raises(ValueError, match="does not divide num_heads"):
        decoder.rank_view(full, 3)
    with pytest.raises(ValueError, match="rank_of must be an int"):
        decoder.rank_view(full, 0)
    # the shards are the model's own TP shards: weights of a rank's stack have the shapes
    # tp_shard_state_dict cuts a tp=1 stack to (expert widths), heads / 8 in attention
    from k3fusion.models.kimi_k3 import tp_shard_state_dict

    tiny = decoder.stack_config(1, width="tiny")
    with torch.device("meta"):
        from k3fusion.models import KimiK3ForCausalLM

        whole = KimiK3ForCausalLM(tiny).state_dict()
        one = KimiK3ForCausalLM(decoder.rank_view(tiny, 2)).state_dict()
    cut = tp_shard_state_dict({k: v for k, v in whole.items()}, 0, 2)
    for key, value in one.items():
        if "experts" in key or "down_proj" in key or "up_proj" in key:
            assert value.shape == cut[key].shape, key
    assert one["model.layers.0.self_attn.o_proj.weight"].shape[1] * 2 == \
        whole["model.layers.0.self_attn.o_proj.weight"].shape[1]


@pytest.mark.usefixtures("fresh_state")
def test_rank_of_sweep_on_cpu_says_collectives_are_not_timed():
    backends = {"k3fusion": lambda gm, example_inputs: gm.forward}
    config = decoder.stack_config(1, width="tiny", num_experts=1, top_k=1)
    result = decoder.run(tokens=[2], prefill=[], seeds=1, config=config, rank_of=2,
                         device="cpu", backends=backends, timer=_wall_timer, progress=False)
    assert result["ok"] and result["config"]["rank_of"] == 2
    assert result["config"]["heads"] == config.num_heads // 2
    md = decoder.markdown(result)
    assert "Per-rank view (2-way TP)" in md and "not timed on one GPU" in md
    assert decoder._parse(["--rank-of", "8"]).rank_of == 8
    with pytest.raises(SystemExit):
        decoder._parse(["--rank-of", "3"])


@pytest.mark.usefixtures("fresh_state")
def test_profile_bookkeeping_and_amdahl_bound_on_cpu():
    backends = {"inductor": lambda gm, example_inputs: gm.forward,
                "k3fusion": lambda gm, example_inputs: gm.forward}
    profiles = iter([{"kernel_us": 100.0, "own_us": 0.0, "kernels": 30, "top": []},
                     {"kernel_us": 90.0, "own_us": 20.0, "kernels": 25, "top": []}])
    config = decoder.stack_config(1, width="tiny", num_experts=1, top_k=1)
    result = decoder.run(tokens=[2], prefill=[4], seeds=1, config=config, device="cpu",
                         backends=backends, timer=lambda fn, sets, n: 200.0,
                         profiler=lambda fn, ids: next(profiles), profile=True,
                         progress=False)
    decode, prefill = result["rows"]
    # chains under default = 100 - (90 - 20) = 30 us; bound = 200 / (200 - 30)
    assert decode["chains_default_us"] == pytest.approx(30.0)
    assert decode["amdahl_bound"] == pytest.approx(200 / 170)
    assert "amdahl_bound" not in prefill  # decode shapes only
    md = decoder.markdown(result)
    assert "| 2 | 200.0 | 100.0 | 30 | 90.0 | 20.0 | 30.0 | 1.176x | 1.000x |" in md
    assert decoder.OWN_KERNELS.match("_moe_tail_kernel") and \
        not decoder.OWN_KERNELS.match("triton_red_fused_mean_0")
    assert decoder._parse(["--profile"]).profile


_FAKE_TP_SCRIPT = """
import json, time, torch
from k3fusion.bench import decoder

def timer(fn, arg_sets, calls_per_graph):
    start = time.perf_counter()
    for args in arg_sets:
        fn(*args)
    return (time.perf_counter() - start) / len(arg_sets) * 1e6

try:
    decoder.run(tokens=[2], prefill=[], seeds=1, rank_of=1, fake_tp=True, device="cpu")
except ValueError as e:
    refused = str(e)
cfg = decoder.stack_config(1, width="tiny")
passthrough = {name: (lambda gm, ex: gm.forward) for name in ("inductor", "k3fusion")}
r = decoder.run(tokens=[2], prefill=[], seeds=1, config=cfg, device="cpu", rank_of=2,
                fake_tp=True, backends=passthrough, timer=timer, progress=False)
group = decoder.fake_tp_group(2)
model = decoder.build_model(decoder.rank_view(cfg, 2, experts=False), 0, "cpu", group)
mlp = model.model.layers[0].mlp
try:
    decoder.fake_tp_group(4)
except RuntimeError as e:
    other = str(e)
print(json.dumps(dict(ok=r["ok"], equivalence=r["equivalence"], fake_tp=r["fake_tp"],
                      md=decoder.markdown(r), refused=refused, heads=r["config"]["heads"],
                      note=r["rank_note"], tp=mlp.tp_size, other=other,
                      expert_rows=mlp.experts[0].gate_proj.weight.shape[0],
                      width=cfg.moe_intermediate_size)))
"""


@pytest.mark.slow
def test_fake_tp_builds_the_moe_with_a_group_of_that_many_ranks_and_skips_the_check():
    """``--fake-tp``: the latent MoE built with a fake group of ``rank_of`` ranks (in a
    process of its own: the group is process-wide), so the model shards its experts
    itself (and k3fusion's tail sees that tp: the tier tests cover what it runs); no
    equivalence check, and the output says so."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _FAKE_TP_SCRIPT], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert "fake_tp needs rank_of >= 2" in r["refused"]
    assert r["ok"] and r["fake_tp"] and r["equivalence"] == []
    assert r["tp"] == 2 and r["expert_rows"] == r["width"] // 2
    assert r["heads"] == decoder.stack_config(1, width="tiny").num_heads // 2
    assert "needs a fake process group of 4 ranks" in r["other"]
    assert "Equivalence: not checked" in r["md"] and "fake group of 2 ranks" in r["note"]
