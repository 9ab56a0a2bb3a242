"""The main job: ``python -m k3fusion``, its ``explain`` and ``bench`` subcommands, and
their ``--help``."""

from __future__ import annotations

import argparse
import json
import re
import sys

import pytest
import torch

from k3fusion.cli import main


@pytest.mark.slow
def test_main_job_reports_every_fusion_as_json(capsys):
    # One small run of the real job: eager, default torch.compile and backend="k3fusion".
    assert main(["--json", "--dtype", "fp32", "--tokens", "5", "--batch", "1"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)  # stdout is the JSON alone; progress is on stderr
    stages = captured.err.splitlines()
    assert [line.split("] ")[1].split(":")[0] for line in stages] == [
        "eager forward of the tiny model on cpu, input [1, 5]", "default torch.compile",
        "torch.compile(backend='k3fusion')", "done"]
    fusions = {f["fusion"]: f for f in report["fusions"]}
    assert set(fusions) == {"qkv_rmsnorm", "attn_res", "attn_res_delta_handoff"}
    assert all(f["matches"] == f["sites"] > 0 for f in fusions.values())
    assert fusions["attn_res_delta_handoff"]["sites"] == 2  # the tiny model's two layers
    assert report["ok"] and report["max_rel_err_vs_eager"]["k3fusion"] <= report["tolerance"]


@pytest.mark.parametrize("bad, says", [
    (["--tokens", "0"], "--tokens: must be >= 1"), (["--batch", "0"], "--batch: must be >= 1"),
    (["--tokens", "x"], "--tokens: expected an integer"), (["--dtype", "fp64"], "invalid choice"),
    (["--norm-style", "bogus"], "--norm-style: invalid choice: 'bogus' (choose from 'hf'"),
    (["--bank", "dict"], "--bank: invalid choice"), (["--block-size", "0"], "must be >= 1, got 0"),
    (["--device", "tpu"], "not a device: 'tpu'"), (["--device", "mps"], "runs on cpu or cuda"),
    (["--no-attn-res", "--bank", "tensor"], "--bank configures Block AttnRes"),
    (["--no-attn-res", "--block-size", "2"], "--block-size configures Block AttnRes"),
])
def test_main_job_rejects_bad_arguments_in_one_line(bad, says, capsys):
    with pytest.raises(SystemExit) as e:
        main(bad)
    assert e.value.code == 2  # a usage error, not 1 (a missed fusion)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m k3fusion: error: "), err
    assert says in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_cuda_device_without_cuda_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--device", "cuda"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "CUDA is not available" in err and "--device cpu" in err


def test_help_is_plain_text(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "``" not in out and out.startswith("usage: python -m k3fusion ")
    assert "0 when every site was fused" in " ".join(out.split())  # exit statuses documented


@pytest.mark.slow
@pytest.mark.parametrize("flags, rows", [
    ([], ["qkv_rmsnorm", "attn_res", "attn_res_delta_handoff"]),
    (["--no-attn-res"], ["qkv_rmsnorm"]),
    (["--no-attn-res", "--latent-moe"], ["qkv_rmsnorm", "moe_tail"]),
    (["--latent-moe", "--bank", "tensor", "--block-size", "2"],
     ["qkv_rmsnorm", "attn_res", "attn_res_delta_handoff", "moe_tail"]),
])
def test_report_has_a_row_for_each_fusion_the_model_has(flags, rows, monkeypatch, capsys):
    # Which rows, not the compile: torch.compile is stubbed out (the model runs eagerly, so
    # nothing is fused and the run reports FAILED with exit status 1).
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: model)
    assert main(["--dtype", "fp32", "--tokens", "3", "--batch", "1", "-q", *flags]) == 1
    out, err = capsys.readouterr()
    assert err == ""  # --quiet
    table = out.splitlines()
    assert [line.split()[0] for line in table[2:-2]] == rows
    assert all(line.split()[2] == "0" for line in table[2:-2])
    assert table[-1].startswith("FAILED: not every site fused (" + ", ".join(rows))
    assert "attn_res tensor bank, block size 2" in table[0] or "--bank" not in flags


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
    err = capsys.readouterr().err
    assert "choose from qkv_rmsnorm,attn_res,moe_tail,attn_res_train,decoder" in err and err.count("\n") == 1


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
    monkeypatch.setitem(sys.modules, "k3fusion.bench.attn_res_train", fake("attn_res_train", 0))
    monkeypatch.setitem(sys.modules, "k3fusion.bench.decoder", fake("decoder", None))
    assert main(["bench", "--out", "o"]) == 1
    assert calls == [(n, ["--out", "o"])
                     for n in ("qkv_rmsnorm", "attn_res", "attn_res_train", "decoder")]
    captured = capsys.readouterr()
    assert "attn_res broke" in captured.err and "moe_tail: skipped" in captured.err
    assert ("bench summary: qkv_rmsnorm ok, attn_res FAILED (exit 1), moe_tail skipped "
            "(k3fusion.bench.moe_tail is not there), attn_res_train ok, decoder ok") in captured.out
    calls.clear()
    assert main(["bench", "--only", "decoder,qkv_rmsnorm"]) == 0
    assert [n for n, _ in calls] == ["decoder", "qkv_rmsnorm"]


# ------------------------------------------------------------- subcommands, --help (issue 31)


def _help(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def test_help_lists_every_subcommand(capsys):
    from k3fusion.cli import SUBCOMMAND_PARSERS, SUBCOMMANDS

    assert set(SUBCOMMANDS) == set(SUBCOMMAND_PARSERS) == {"explain", "bench"}
    listed = _help([], capsys).split("subcommands (", 1)[1].splitlines()[1:]
    assert [line.split()[0] for line in listed if not line.startswith("   ")] == list(SUBCOMMANDS)


@pytest.mark.parametrize("argv0, prog", [("/venv/bin/k3fusion", "k3fusion"),
                                         ("/src/k3fusion/__main__.py", "python -m k3fusion")])
@pytest.mark.parametrize("sub", ["explain", "bench"])
def test_subcommand_help_names_it_as_invoked(sub, argv0, prog, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [argv0])
    assert _help([sub], capsys).startswith(f"usage: {prog} {sub} ")


@pytest.mark.parametrize("sub", [None, "explain", "bench"])
def test_help_documents_every_flag(sub, capsys):
    from k3fusion.cli import SUBCOMMAND_PARSERS, _main_parser

    parser = _main_parser() if sub is None else SUBCOMMAND_PARSERS[sub]()
    flags = [a for a in parser._actions if a.option_strings]
    assert len(flags) > 1
    undocumented = [a.option_strings for a in flags if not a.help or a.help == argparse.SUPPRESS]
    assert undocumented == []
    shown = " ".join(_help([] if sub is None else [sub], capsys).split())
    for a in flags:
        assert " ".join(a.help.split()) in shown, a.option_strings


@pytest.mark.parametrize("bad, says", [
    (["--tokens=-3"], "argument --tokens: must be >= 1, got -3"),
    (["--tokens", "x"], "argument --tokens: expected an integer >= 1, got 'x'"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_explain_rejects_bad_arguments_in_one_line(bad, says, capsys):
    with pytest.raises(SystemExit) as e:
        main(["explain", *bad])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m k3fusion explain: error: "), err
    assert says in err


def test_stage_labels_promise_no_times(monkeypatch, capsys):
    # The stages, not the compile: torch.compile is stubbed out (nothing fuses: exit 1).
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: model)
    assert main(["--dtype", "fp32", "--tokens", "3", "--batch", "1"]) == 1
    labels = [line.split("] ", 1)[1] for line in capsys.readouterr().err.splitlines()]
    assert len(labels) == 4
    promise = re.compile(r"\b(second|minute|hour)s?\b|\b\d+(\.\d+)?\s*(s|min)\b", re.I)
    assert [label for label in labels if promise.search(label)] == []
