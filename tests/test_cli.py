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
    assert set(fusions) == {"qkv_rmsnorm", "attn_res"}
    assert all(f["matches"] == f["sites"] > 0 for f in fusions.values())
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
