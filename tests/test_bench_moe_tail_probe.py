"""The issue-17 probe (``k3fusion.bench.moe_tail_probe``): its ``--dry-run`` runs every
variant at a tiny size on the CPU in Triton's interpreter and checks it against the tier
tests' bound, so the one GPU run does not crash on a code path first reached there."""

from __future__ import annotations

import json
import os

import pytest
import torch

from k3fusion.bench import moe_tail_probe as probe

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="the dry run is the CPU interpreter's")


def test_dry_run_checks_every_variant(tmp_path, capsys):
    # 1: the GEMV candidates; 33: the swapped dot at 64 rows; 70: the row-tiled forms.
    assert probe.main(["--dry-run", "--tokens", "1", "33", "70", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "moe_tail_probe.json").read_text())
    assert result["dry_run"] and [r["T"] for r in result["rows"]] == [1, 33, 70]
    for r in result["rows"]:
        assert not r["errors"], r["errors"]
        expected = {f"tri:{k}" for k in probe.candidates(r["T"])} | {"norm_addmm", "op",
                                                                       "inductor"}
        assert expected <= set(r["check"])
        assert all(v["ok"] and v["worst_of_bound"] > 0 for v in r["check"].values())
    assert "best/gemm" in capsys.readouterr().out.splitlines()[-4]


def test_dry_run_flags_a_wrong_variant(tmp_path, monkeypatch, capsys):
    from k3fusion.kernels import moe_tail as kernel_mod

    real = kernel_mod.latent_moe_tail_fused
    monkeypatch.setattr(kernel_mod, "latent_moe_tail_fused",
                        lambda *a, **k: real(*a, **k) + 1)  # a misplaced add of 1
    assert probe.main(["--dry-run", "--tokens", "3", "--skip-inductor",
                       "--out", str(tmp_path)]) == 1
    row = json.loads((tmp_path / "moe_tail_probe.json").read_text())["rows"][0]
    assert not row["check"]["kernel"]["ok"] and row["check"]["op"]["ok"]
    assert "tri:pdl_n64_s4" in capsys.readouterr().out.splitlines()[-1]


def test_candidates_cover_the_issue_ranges():
    small, large = probe.candidates(16), probe.candidates(4096)
    assert any(o.get("prenorm") and o.get("split_k", 1) > 1 for o in small.values())
    assert large and all(o["block_m"] and o["prenorm"] for o in large.values())
    assert probe.TOKENS == (1, 2, 4, 8, 16, 32, 64, 128, 512, 4096)


def test_skip_triton_runs_baselines_only(tmp_path):
    assert probe.main(["--dry-run", "--tokens", "2", "--skip-triton", "--skip-autotune",
                       "--out", str(tmp_path)]) == 0
    row = json.loads((tmp_path / "moe_tail_probe.json").read_text())["rows"][0]
    assert set(row["check"]) == {"norm_addmm", "norm_mm_add", "norm_copy_addmm", "donated_addmm",
                                 "op", "inductor"}


def test_quick_mode_times_the_phase2_forms_only(tmp_path):
    """``--quick`` (the one short confirmation run): the baselines, the two-launch forms and
    only QUICK_CANDIDATES of the kernel's forms, at 2 <= T <= 64; no compiles; all correct."""
    assert probe.main(["--dry-run", "--quick", "--tokens", "1", "3", "70",
                       "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "moe_tail_probe.json").read_text())["rows"]
    base = {"norm_mm_add", "norm_copy_addmm", "donated_addmm", "op"}
    assert [set(r["check"]) for r in rows] == [
        base, base | {f"tri:{k}" for k in probe.QUICK_CANDIDATES}, base]
    assert all(v["ok"] for r in rows for v in r["check"].values())
    assert probe.QUICK_TOKENS == (1, 4, 8, 16, 32, 48, 64, 512, 4096)
