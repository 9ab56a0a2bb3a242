"""The AttnRes sweep benchmark's logic (``k3fusion.bench.attn_res_sweep``) on the CPU: its
``--dry-run`` builds and checks every candidate launch shape at tiny sizes in Triton's
interpreter, runs the bytes-only kernel, writes the JSON and prints the tables -- so the one
GPU run does not crash on a typo. Timing itself needs CUDA."""

from __future__ import annotations

import json

import pytest

from k3fusion.bench import attn_res_sweep as sweep
from k3fusion.kernels._launch import kernels_are_interpreted


def test_candidates_cover_the_kernels_forms() -> None:
    """At decode sizes the split kernel, its one-program form and the row kernel with and
    without the early tile are all candidates; the default first; the solo form only where
    its tile fits the register bound; the pipelined shapes only from T = 128."""
    c = sweep.candidates(1, 2048, 8)
    names = list(c)
    # the launch table's choice first, then the previous rule's (the split kernel at T = 1)
    assert names[:2] == ["solo4", "s1024x4"] and c["s1024x4"] == {"use_table": False}
    assert {"s512x4", "solo8", "r4x16e", "r4x16", "r16x8e"} <= set(names)
    assert not any("p3" in n for n in names)
    # nine live rows of 8192 hold 144 per thread at 16 warps, 288 at 8 (past the bound)
    at_8 = sweep.candidates(1, 7168, 8)
    assert "solo16" in at_8 and "solo8" not in at_8
    assert "solo8" in sweep.candidates(1, 7168, 5)
    big = sweep.candidates(4096, 7168, 8)
    # no multi-program split at prefill sizes (its grid grows with T): only the solo form
    assert list(big)[0] == "r1x8p3" and not any(n[0] == "s" and n[1].isdigit() for n in big)
    # never more sources per tile than there are sources
    assert not any(n.startswith(("r2", "r4", "r8", "r16")) for n in sweep.candidates(8, 4096, 0))


def test_triggers_and_small_grids_widen_the_candidates(monkeypatch) -> None:
    """``--triggers``: every candidate also with each PDL trigger (labels with the table's
    suffix, the kernels' ``trigger`` argument); ``--small-grid-tokens``: the split kernel's
    multi-program shapes and the early tile as candidates to that many tokens."""
    plain = sweep.candidates(128, 2048, 3)
    assert not any(n.endswith(("M", "L")) for n in plain)
    assert not any(n.startswith("s") and n[1].isdigit() or "e" in n for n in plain)
    monkeypatch.setattr(sweep, "TRIGGER_VARIANTS", ("entry", "mix"))
    both = sweep.candidates(128, 2048, 3)
    assert set(both) == set(plain) | {n + "M" for n in plain}
    assert all(both[n + "M"] == {**plain[n], "trigger": "mix"} for n in plain)
    monkeypatch.setattr(sweep, "TRIGGER_VARIANTS", None)
    monkeypatch.setattr(sweep, "SMALL_GRID_MAX_TOKENS", 128)
    small = sweep.candidates(128, 2048, 3)
    assert {"s512x4", "s1024x4", "r4x8e", "r2x4e"} <= set(small) and set(plain) <= set(small)


@pytest.mark.skipif(not kernels_are_interpreted(), reason="the dry run is the CPU form")
def test_dry_run_with_triggers(tmp_path, monkeypatch) -> None:
    """A run with ``--triggers`` checks each trigger's launches against the reference (the
    trigger moves no store); ``--no-pdl`` with it is refused."""
    for name in ("TRIGGER_VARIANTS", "SMALL_GRID_MAX_TOKENS"):
        monkeypatch.setattr(sweep, name, getattr(sweep, name))  # main sets them: restored
    argv = ["--dry-run", "--chosen-only", "--num-blocks", "3", "--tokens", "1",
            "--skip-inductor", "--jobs", "0", "--triggers", "entry", "mix", "exit"]
    assert sweep.main(argv + ["--out", str(tmp_path / "a")]) == 0
    (p,) = json.loads((tmp_path / "a" / "attn_res_sweep.json").read_text())["points"]
    names = set(p["variants"])
    assert {p["default"], p["default"] + "M", p["default"] + "L"} <= names
    assert all(v["ok"] for v in p["variants"].values())
    with pytest.raises(SystemExit):
        sweep.main(argv + ["--no-pdl", "--out", str(tmp_path / "b")])


def test_estimate_fits_one_device_call() -> None:
    plan = sweep.estimate(sweep.HIDDENS, sweep.NUM_BLOCKS, sweep.TOKENS, True)
    assert plan["estimated_timing_s"] < 300, plan


@pytest.mark.skipif(not kernels_are_interpreted(), reason="the dry run is the CPU form")
def test_dry_run(tmp_path, capsys) -> None:
    assert sweep.main(["--dry-run", "--out", str(tmp_path), "--num-blocks", "0", "5"]) == 0
    result = json.loads((tmp_path / "attn_res_sweep.json").read_text())
    points = result["points"]
    assert len(points) == 4 and result["precompile_errors"] == {}
    for p in points:
        assert p["best"] is not None and not p["wrong"], p
        assert p["default"] in p["variants"] and "inductor_us" in p
        for name, v in p["variants"].items():
            assert v["ok"] and "us" in v, (name, v)
        if p["T"] == 1:
            assert len(p["bytes_only"]) == len(sweep.BYTES_ONLY_SHAPES)
    out = capsys.readouterr().out
    assert "selection" in out and out.rstrip().splitlines()[-1].startswith("   48")
    assert all(p["public_form_us"] is not None for p in points)
    assert sweep.main(["--tables-from", str(tmp_path / "attn_res_sweep.json")]) == 0
    assert capsys.readouterr().out.rstrip().splitlines()[-1] == out.rstrip().splitlines()[-1]


def test_check_flags_a_wrong_variant(monkeypatch) -> None:
    """A candidate that reads one source too few fails the check (so it is never selected)."""
    import torch

    args = sweep.make_inputs(2, 40, "cpu", seed=3)
    ref = sweep.reference_step(args, 4)
    interpreted = kernels_are_interpreted()
    good = sweep.check(args, 4, {"kind": "row", "sources_per_tile": 2}, ref,
                       interpreted=interpreted)
    assert good["ok"], good
    real = sweep.launch_step
    monkeypatch.setattr(sweep, "launch_step",
                        lambda a, nb, out, kw: real(a, nb - 1, out, kw) if nb else None)
    bad = sweep.check(args, 4, {"kind": "row", "sources_per_tile": 2}, ref,
                      interpreted=interpreted)
    assert not bad["ok"], bad
    assert torch.isfinite(torch.tensor(bad["out_ulps"]))


@pytest.mark.skipif(not kernels_are_interpreted(), reason="the CPU form of the pool")
def test_precompile_pool_runs_its_tasks_in_workers() -> None:
    """The worker pool (spawned processes; what fills the caches before the GPU sweep)
    runs a task and reports no error; a task past the timeout is reported, not waited on."""
    errors = sweep.precompile((16,), (1,), (1,), False, 1, device="cpu")
    assert errors == {}, errors


def test_chosen_only_times_the_choice_the_previous_default_and_the_public_form() -> None:
    """``--chosen-only``: the table's shape, the rule's (previous default), and the public
    kernel's form -- nothing else; its default sizes cover the issue's table and T = 1 at
    every block count, in well under the full sweep's time."""
    for T, H, nb in ((1, 7168, 8), (128, 2048, 1), (4096, 7168, 8), (1, 4096, 5)):
        full, chosen = sweep.candidates(T, H, nb), sweep.candidates(T, H, nb, chosen_only=True)
        names = list(chosen)
        assert names[0] == list(full)[0] and sweep.previous_default(T, H, nb) in chosen
        assert all(sweep.is_public_form(kw) for kw in list(chosen.values())[2:])
        assert {n for n, kw in full.items() if sweep.is_public_form(kw)} <= set(chosen)
    issue = {(2048, 1, 1), (2048, 4, 1), (2048, 8, 1), (2048, 1, 128), (4096, 1, 1),
             (4096, 4, 1), (4096, 8, 1), (7168, 1, 1), (7168, 4, 1), (7168, 8, 1),
             (7168, 8, 128), (7168, 8, 4096)}
    c = sweep.CHOSEN
    assert issue <= {(H, nb, T) for H in c["hiddens"] for nb in c["num_blocks"]
                     for T in c["tokens"]}
    assert {nb for _, nb, _ in issue} <= set(sweep.CHOSEN_INDUCTOR_BLOCKS)
    plan = sweep.estimate(*c.values(), True, True, sweep.CHOSEN_INDUCTOR_BLOCKS)
    assert plan["estimated_timing_s"] < 60, plan


@pytest.mark.skipif(not kernels_are_interpreted(), reason="the dry run is the CPU form")
def test_dry_run_chosen_only(tmp_path, capsys) -> None:
    assert sweep.main(["--dry-run", "--chosen-only", "--out", str(tmp_path), "--num-blocks",
                       "4", "--tokens", "1", "--inductor-blocks", "5"]) == 0
    result = json.loads((tmp_path / "attn_res_sweep.json").read_text())
    (p,) = result["points"]
    assert result["chosen_only"] and "inductor_us" not in p  # Inductor at 5 blocks only
    assert p["previous"] == "solo4" and p["previous_us"] is not None
    assert p["default"] == "r4x4e" and p["public_form_us"] is not None
    assert all(sweep.is_public_form(v["kw"]) for v in list(p["variants"].values())[2:])


def test_no_pdl_reaches_every_timed_launch(tmp_path, monkeypatch) -> None:
    """``--no-pdl`` (a probe of what PDL costs): every k3fusion launch of the run, checked
    or timed, gets ``pdl=False``; the run says so. Without it: ``pdl=None`` (the default)."""
    seen = []
    real = sweep.launch

    def spy(*args, **kwargs):
        seen.append(kwargs.get("pdl", "missing"))
        return real(*args, **kwargs)

    monkeypatch.setattr(sweep, "launch", spy)
    monkeypatch.setattr(sweep, "PDL", None)  # main sets it: restored after the test
    argv = ["--dry-run", "--chosen-only", "--num-blocks", "4", "--tokens", "1",
            "--skip-inductor", "--jobs", "0"]
    assert sweep.main(argv + ["--out", str(tmp_path / "a")]) == 0
    assert seen and set(seen) == {None}
    seen.clear()
    assert sweep.main(argv + ["--no-pdl", "--out", str(tmp_path / "b")]) == 0
    assert seen and set(seen) == {False}
    assert json.loads((tmp_path / "b" / "attn_res_sweep.json").read_text())["pdl"] == "off"


def test_late_trigger_reaches_every_timed_launch(tmp_path, monkeypatch) -> None:
    """``--late-trigger`` (a probe of where PDL's trigger belongs): every k3fusion launch of
    the run sees the kernels' switch on, the run says so; with ``--no-pdl`` it is refused."""
    import k3fusion.kernels.attn_res as kernels

    seen = []
    real = sweep.launch

    def spy(*args, **kwargs):
        seen.append((kwargs.get("pdl", "missing"), kernels.LATE_TRIGGER))
        return real(*args, **kwargs)

    monkeypatch.setattr(sweep, "launch", spy)
    monkeypatch.setattr(sweep, "PDL", None)
    monkeypatch.setattr(kernels, "LATE_TRIGGER", False)  # main sets it: restored after
    argv = ["--dry-run", "--chosen-only", "--num-blocks", "4", "--tokens", "1",
            "--skip-inductor", "--jobs", "0"]
    assert sweep.main(argv + ["--late-trigger", "--out", str(tmp_path / "a")]) == 0
    assert seen and set(seen) == {(None, True)}
    result = json.loads((tmp_path / "a" / "attn_res_sweep.json").read_text())
    assert result["pdl"] == "auto, late trigger"
    with pytest.raises(SystemExit):
        sweep.main(argv + ["--late-trigger", "--no-pdl", "--out", str(tmp_path / "b")])


@pytest.mark.skipif(not kernels_are_interpreted(), reason="the dry run is the CPU form")
@pytest.mark.parametrize("rotated", [False, True])
def test_timed_launches_allocate_their_output_per_call_as_the_peers(tmp_path, monkeypatch,
                                                                    rotated: bool) -> None:
    """k3fusion's timed launches write an output allocated in the call, as a peer's wrapper
    and a compiled graph allocate theirs (inside a capture the pool hands the same block
    back each call); ``--rotated-outputs``: the input set's own preallocated output."""
    timing, outs_given, outs_written = [False], [], []
    real = sweep.launch

    def spy(*args, **kwargs):
        if timing[0]:
            outs_written.append(args[6])
        return real(*args, **kwargs)

    def timer(fn, sets, T):
        timing[0] = True
        try:
            outs_given.extend(s[6] for s in sets if len(s) == 7)
            fn(*sets[0])
        finally:
            timing[0] = False
        return 1.0

    monkeypatch.setattr(sweep, "launch", spy)
    monkeypatch.setattr(sweep, "ROTATED_OUTPUTS", rotated)
    result = sweep.run([64], [2], [3], inductor=False, dry_run=True, out_dir=tmp_path,
                       budget_s=60, jobs=0, chosen_only=True, timer=timer)
    assert result["outputs"] == ("rotated" if rotated else "per call")
    assert outs_written and outs_given
    given = {id(o) for o in outs_given}
    assert all((id(o) in given) == rotated for o in outs_written)


def test_heatmap_from_the_committed_sweep(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "docs" / "attn_res_decode_sweep.json"
    out = tmp_path / "h.png"
    assert sweep.main(["--tables-from", str(src), "--heatmap", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
