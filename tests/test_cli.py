"""The main job: ``python -m k3fusion`` (and its ``bench`` entry)."""

from __future__ import annotations

import json

import pytest
import torch

from k3fusion.cli import main


def test_main_job_reports_every_fusion_as_json(capsys):
    # One small run of the real job: eager, default torch.compile and backend="k3fusion".
    assert main(["--json", "--dtype", "fp32", "--tokens", "5", "--batch", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    fusions = {f["fusion"]: f for f in report["fusions"]}
    assert set(fusions) == {"qkv_rmsnorm", "attn_res", "attn_res_delta_handoff"}
    assert all(f["matches"] == f["sites"] > 0 for f in fusions.values())
    assert fusions["attn_res_delta_handoff"]["sites"] == 2  # the tiny model's two layers
    assert report["ok"] and report["max_rel_err_vs_eager"]["k3fusion"] <= report["tolerance"]


@pytest.mark.parametrize("bad", [["--tokens", "0"], ["--batch", "0"], ["--dtype", "fp64"]])
def test_main_job_rejects_bad_arguments(bad):
    with pytest.raises(SystemExit) as e:
        main(bad)
    assert e.value.code == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_bench_without_cuda_says_so(capsys):
    assert main(["bench"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert main(["bench", "--only", "decoder", "--out", "x"]) == 2  # parsed, then refused
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_bench_only_parses_a_comma_separated_subset():
    from k3fusion.cli import BENCHES, _parse_bench

    assert _parse_bench([]).only == list(BENCHES)
    args = _parse_bench(["--only", "decoder, qkv_rmsnorm,decoder", "--out", "d"])
    assert args.only == ["decoder", "qkv_rmsnorm"] and args.out == "d"


@pytest.mark.parametrize("only", ["decoder,nope", "", ","])
def test_bench_only_rejects_unknown_names(only, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--only", only])
    assert e.value.code == 2
    assert "choose from qkv_rmsnorm,attn_res,moe_tail,decoder" in capsys.readouterr().err


def test_bench_runs_each_selected_benchmark_and_reports_failures(monkeypatch, capsys):
    # The loop itself, with stand-in benchmark modules (the real ones need a GPU).
    import sys
    import types

    calls = []

    def fake(name, outcome):
        def main(argv):
            calls.append((name, argv))
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome
        return types.SimpleNamespace(main=main)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "k3fusion.bench.qkv_rmsnorm", fake("qkv_rmsnorm", 0))
    monkeypatch.setitem(sys.modules, "k3fusion.bench.attn_res",
                        fake("attn_res", SystemExit("attn_res broke")))
    monkeypatch.setitem(sys.modules, "k3fusion.bench.moe_tail", None)  # not there
    monkeypatch.setitem(sys.modules, "k3fusion.bench.decoder", fake("decoder", None))
    assert main(["bench", "--out", "o"]) == 1
    assert calls == [(n, ["--out", "o"]) for n in ("qkv_rmsnorm", "attn_res", "decoder")]
    captured = capsys.readouterr()
    assert "attn_res broke" in captured.err and "moe_tail: skipped" in captured.err
    assert ("bench summary: qkv_rmsnorm ok, attn_res FAILED (exit 1), moe_tail skipped "
            "(k3fusion.bench.moe_tail is not there), decoder ok") in captured.out
    calls.clear()
    assert main(["bench", "--only", "decoder,qkv_rmsnorm"]) == 0
    assert [n for n, _ in calls] == ["decoder", "qkv_rmsnorm"]
