"""The AttnRes launch selection (``kernels/attn_res.py``: ``LAUNCH_TABLE`` read by
``pick_launch_shape``): its buckets at every edge, its fallbacks to the rule, every shape it
selects against the spec in Triton's interpreter, its agreement with the committed sweep it
came from, and the compiled and eager paths choosing the same launch for the same shape."""

from __future__ import annotations

import importlib
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import triton

import k3fusion
import k3fusion.eager
from k3fusion.bench import attn_res_sweep as sweep
from k3fusion.kernels.attn_res import (
    EARLY_TILE_MAX_TOKENS, LAUNCH_TABLE, LAUNCH_TABLE_BY_GPU, PREFILL_TOKENS, SPLIT_MAX_GRID_Y,
    SPLIT_MAX_TOKENS, TILE_MAX_PER_THREAD, LaunchShape, launch_table, parse_shape,
    pick_launch_shape, table_shape, tile_rows,
)

from graph_utils import fresh_state  # noqa: F401
from test_attn_res_kernel import _K3, run_and_check

MOD = importlib.import_module("k3fusion.kernels.attn_res")  # the module, not the launcher
DOCS = Path(__file__).resolve().parents[1] / "docs"
#: The runs the table came from: up to 255 tokens the 2026-12-03 one (the block count
#: compiled in, every candidate form around the table's, T 1/8/32/128), the prefill rows
#: the 2026-12-02 one (every candidate, T 512/4096).
#: Up to 255 tokens, oldest first: a later run's points replace an earlier run's (2026-12-04:
#: H 7168 to 32 tokens again, captured launches keeping their scratch words).
SWEEP_JSONS = [DOCS / "attn_res_decode_sweep_2026-12-03.json",
               DOCS / "attn_res_decode_sweep_2026-12-04.json"]
#: From 256 tokens, oldest first: a later run's points replace an earlier run's.
PREFILL_SWEEP_JSONS = [DOCS / "attn_res_decode_sweep.json",
                       DOCS / "attn_res_prefill_rows_2026-12-03.json"]
H100 = "NVIDIA H100 80GB HBM3"
#: The H100 runs its rows came from (2026-12-06): every candidate around the points where
#: a public kernel was ahead, with each PDL trigger (entry, mix; exit at T 1/128/512), and
#: the small grids' forms (split shapes, early tile) to 255 tokens.
H100_PROBE_JSONS = [DOCS / "attn_res_h100_probe_h2048_2026-12-06.json",
                    DOCS / "attn_res_h100_probe_h4096_2026-12-06.json",
                    DOCS / "attn_res_h100_probe_small_grid_2026-12-06.json"]
#: Every table: the H200's, and each GPU's with its own rows.
TABLES = [None, *LAUNCH_TABLE_BY_GPU]


def rule(T, H, nb, **kw) -> LaunchShape:
    return pick_launch_shape(T, H, nb, use_table=False, **kw)


def name(T, H, nb, **kw) -> str:
    return sweep.label(pick_launch_shape(T, H, nb, **kw))


# ------------------------------------------------------------------------- the table


def test_table_entries_parse_fit_and_name_themselves() -> None:
    """Every entry is a shape the sweep names the same way, one per block count 0..8, within
    the per-thread tile bound the sweep used at the widest row of its bucket (bf16), and
    launchable there; the rows of a bucket end with one for any T."""
    assert sweep.MAX_PER_THREAD == TILE_MAX_PER_THREAD
    for gpu, key, rows in [(g, k, r) for g in TABLES for k, r in launch_table(g).items()]:
        mosts = [most for most, _ in rows]
        assert mosts[-1] is None and mosts[:-1] == sorted(mosts[:-1])
        H = key // 2
        for most, names in rows:
            names = names.split()
            assert len(names) == 9, (key, most)
            T = 4096 if most is None else most
            for nb, n in enumerate(names):
                shape = parse_shape(n, H)
                assert sweep.label(shape) == n
                width = shape.chunk or shape.block_h
                assert tile_rows(shape, nb) * width <= TILE_MAX_PER_THREAD * 32 * shape.num_warps
                assert table_shape(T, H, nb, gpu=gpu) == shape, (gpu, key, most, nb)
                if shape.kind == "row":
                    assert shape.sources_per_tile <= triton.next_power_of_2(nb + 1)
    with pytest.raises(ValueError, match="launch shape name"):
        parse_shape("r3x", 64)


# (H, element size) at and past every row-bytes edge -> the bucket (bytes), None: the rule
ROW_EDGES = [((2048, 2), 4096), ((2049, 2), 8192), ((4096, 2), 8192), ((4097, 2), 16384),
             ((7168, 2), 16384), ((8192, 2), 16384), ((8193, 2), None),
             ((1024, 4), 4096), ((1025, 4), 8192), ((2048, 4), 8192), ((4096, 4), 16384),
             ((4097, 4), None), ((1, 2), 4096), ((96, 2), 4096)]


@pytest.mark.parametrize("hw,key", ROW_EDGES, ids=[f"H{h}x{e}" for (h, e), _ in ROW_EDGES])
def test_row_bytes_buckets(hw, key) -> None:
    """fp32 at H takes bf16's bucket at 2H; rows wider than the widest key take the rule."""
    H, size = hw
    for T in (1, 13, 65, 256):
        for nb in (0, 3, 8):
            got = pick_launch_shape(T, H, nb, element_size=size)
            if key is None:
                assert table_shape(T, H, nb, size) is None
                assert got == rule(T, H, nb, element_size=size)
                continue
            most, names = next(r for r in LAUNCH_TABLE[key] if r[0] is None or T <= r[0])
            assert got == parse_shape(names.split()[nb], H), (H, size, T, nb)


def test_token_buckets_at_their_edges() -> None:
    """The token edges are the rule's measured thresholds: the split kernel up to
    SPLIT_MAX_TOKENS (at 16 KiB rows and 5-8 blocks), the early tile up to
    EARLY_TILE_MAX_TOKENS, the prefill shapes from PREFILL_TOKENS."""
    assert (SPLIT_MAX_TOKENS, EARLY_TILE_MAX_TOKENS, PREFILL_TOKENS) == (12, 64, 256)
    H = 7168
    assert [name(T, H, 8) for T in (1, 12, 13, 16, 17, 32, 33, 64, 65, 255, 256, 724, 725,
                                    4096)] == \
        ["s1024x4"] * 4 + ["s2048x8"] * 2 + ["r4x8e", "r4x8e", "r2x8p3", "r2x8p3",
                                             "r1x8p3L", "r1x8p3L", "r1x8p3", "r1x8p3"]
    assert [name(T, H, 6) for T in (12, 16, 17, 64)] == ["s1024x4"] * 2 + ["r8x8e"] * 2
    assert [name(T, H, 0) for T in (1, 12, 13, 32, 33, 64, 65, 255, 256, 724, 725)] == \
        ["r1x16e", "r1x16e", "r1x16", "r1x16"] + ["solo16"] * 4 + ["solo8L", "solo8L", "solo16"]
    assert [name(T, H, 4) for T in (1, 2, 12, 13, 64, 65, 255, 256)] == \
        ["s1024x4", "solo8", "solo8", "solo16", "solo16", "solo16", "solo16", "r1x8p3L"]
    H = 2048
    assert [name(T, H, 8) for T in (1, 64, 65, 255, 256, 362, 363, 575, 576, 4096)] == \
        ["solo4", "solo4", "solo8", "solo8", "r1x4p3", "r1x4p3", "r1x2p3", "r1x2p3",
         "r1x2p3L", "r1x2p3L"]
    assert [name(T, H, 6) for T in (1, 64, 65, 255, 256)] == \
        ["solo4", "solo4", "solo4", "solo4", "r1x4p3"]
    assert [name(T, H, 1) for T in (256, 575, 576, 4096)] == ["r1x8p3", "r1x8p3", "r1x8p3L",
                                                              "r1x8p3L"]
    H = 4096
    assert [name(T, H, 1) for T in (1, 64, 65, 255, 256, 4096)] == ["solo16"] * 4 + ["solo16L"] * 2
    assert [name(T, H, 8) for T in (1, 64, 65, 255, 256)] == \
        ["solo8", "solo8", "solo8", "solo8", "r1x4p3L"]


def test_fallbacks_to_the_rule() -> None:
    """More blocks than the table's columns, too many tokens for the split kernel's grid,
    the split kernel's PTX exchange off NVIDIA (the one-program form has none), and every
    override: the rule, exactly as before the table."""
    for nb in (9, 12, 31):
        for T in (1, 100, 4096):
            assert pick_launch_shape(T, 7168, nb) == rule(T, 7168, nb)
    # the one-program form at prefill sizes: its grid's token dim is capped
    assert name(SPLIT_MAX_GRID_Y, 7168, 0) == "solo16"
    assert pick_launch_shape(SPLIT_MAX_GRID_Y + 1, 7168, 0) == rule(SPLIT_MAX_GRID_Y + 1, 7168, 0)
    for kw in ({"split_max_tokens": 0}, {"split_max_tokens": 12}, {"prefill_tokens": 10**9},
               {"sources_per_tile": 2}, {"num_warps": 8}, {"kind": "row"}, {"kind": "split"},
               {"chunk": 512}, {"loop_stages": 1}, {"early_tile": False}):
        for T, H, nb in ((1, 7168, 8), (1, 2048, 3), (100, 4096, 5), (4096, 2048, 1)):
            assert pick_launch_shape(T, H, nb, **kw) == rule(T, H, nb, **kw), (kw, T, H, nb)
    # the rule's own answers where the table differs (what the overrides keep reaching)
    assert sweep.label(rule(1, 2048, 8)) == "s1024x4" and name(1, 2048, 8) == "solo4"
    assert sweep.label(rule(1, 7168, 8, split_max_tokens=0)) == "r4x16e"


def test_split_entries_fall_back_off_nvidia(monkeypatch) -> None:
    monkeypatch.setattr(torch.version, "hip", "6.0", raising=False)
    assert table_shape(1, 7168, 8) is None and rule(1, 7168, 8).kind == "row"
    assert name(1, 7168, 1) == "solo8"  # one program per token: no exchange, no PTX


def test_the_table_matches_the_sweeps_it_came_from() -> None:
    """Against the committed H200 sweeps (``SWEEP_JSONS`` up to 255 tokens,
    ``PREFILL_SWEEP_JSONS`` from 256, the newest run of a point): at every point the
    chosen shape was timed and checked, is within 5% of the best and no more than 3%
    slower than the previous default -- a table edit that contradicts the data fails here."""
    def newest(paths, keep):
        points = {}
        for path in paths:
            for r in sweep.selection_check(json.loads(path.read_text())):
                if keep(r["T"]):
                    points[r["H"], r["nb"], r["T"]] = r
        return list(points.values())
    decode = newest(SWEEP_JSONS, lambda T: T <= 255)
    prefill = newest(PREFILL_SWEEP_JSONS, lambda T: T > 255)
    assert (len(decode), len(prefill)) == (135, 76)
    for r in decode + prefill:
        assert r["chosen_us"] is not None, r
        assert r["chosen_us"] <= 1.05 * r["best_us"], r
        assert r["chosen_us"] <= 1.03 * r["previous_us"], r


#: The H200 probe PDL's trigger per row came from (docs/experiments.md, "2026-12-05: PDL's
#: trigger per row"): the table's shape timed with the trigger at entry, after the last
#: store and without PDL, at H 2048 / 4096 / 7168, 0-8 blocks, T 1 to 4096.
TRIGGER_PROBE = Path(__file__).parent.parent / "docs" / "attn_res_pdl_trigger_probe_2026-12-05.json"


def test_the_table_triggers_match_the_probe_they_came_from() -> None:
    """At every point of the probe, the trigger the table picks (entry or after the last
    store) took at most 5% more than the better of the two (the sweeps' rule for shapes)
    -- and the probe timed the shape the table picks there."""
    points = json.loads(TRIGGER_PROBE.read_text())["points"]
    assert len(points) == 130
    for key, p in points.items():
        H, nb, T = map(int, key.split("/"))
        shape = pick_launch_shape(T, H, nb)
        assert p["shape"] == str(replace(shape, trigger="entry")), (key, p["shape"])
        mine = p["late" if shape.trigger == "exit" else "early"]
        assert shape.trigger in ("entry", "exit") and mine <= 1.05 * min(p["early"], p["late"]), (
            key, shape.trigger, p)


# ------------------------------------------------------------------- rows per GPU


def test_a_gpus_rows_replace_or_add_rows_of_the_table() -> None:
    """``launch_table(gpu)``: the table itself for None and for a GPU without rows of its
    own; for one with rows, each of them in place of the table's row with the same edge (or
    added at a new edge, in token order), every other row the table's, and no row of its
    own that says what the table says."""
    assert launch_table(None) is LAUNCH_TABLE
    assert launch_table("NVIDIA H200") is LAUNCH_TABLE
    for gpu, override in LAUNCH_TABLE_BY_GPU.items():
        table = launch_table(gpu)
        assert set(table) == set(LAUNCH_TABLE) >= set(override)
        for key, rows in table.items():
            own, base = override.get(key, {}), dict(LAUNCH_TABLE[key])
            assert dict(rows) == base | own
            assert [m for m, _ in rows] == sorted(base.keys() | own.keys(),
                                                  key=lambda m: float("inf") if m is None else m)
            assert all(base.get(m) != names for m, names in own.items()), (gpu, key)
    # the H100's: H 4096 prefill to 724 tokens in its own row, the rest as on the H200
    assert name(512, 4096, 5, gpu=H100) == "r1x4M" and name(512, 4096, 5) == "r1x4p3L"
    assert name(725, 4096, 5, gpu=H100) == name(725, 4096, 5) == "r1x4p3L"
    assert name(1, 7168, 8, gpu=H100) == name(1, 7168, 8) == "s1024x4"


def test_the_gpu_rows_match_the_probes_they_came_from() -> None:
    """At every point of the H100 probes its rows came from, the shape they pick there (with
    its PDL trigger) was timed and checked and is within 5% of the best."""
    points = 0
    for path in H100_PROBE_JSONS:
        result = json.loads(path.read_text())
        assert result["gpu"] == H100
        for r in sweep.selection_check(result, keep_trigger=True):
            points += 1
            assert r["chosen_us"] is not None and r["chosen_us"] <= 1.05 * r["best_us"], r
    assert points == 9 + 4 + 9


def test_the_launcher_reads_its_devices_rows(monkeypatch) -> None:
    """The launcher asks for its tensors' device's rows (``device_table_name``; None on the
    CPU) and launches what they say."""
    asked, launched = [], []
    monkeypatch.setattr(MOD, "device_table_name", lambda device: asked.append(device) or H100)
    real = MOD.pick_launch_shape

    def spy(*args, **kw):
        launched.append(real(*args, **kw))
        return launched[-1]

    monkeypatch.setattr(MOD, "pick_launch_shape", spy)
    T, H, nb = 3, 96, 2  # the 4 KiB rows: solo8 on the H200, solo8M on the H100
    args = sweep.make_inputs(T, H, "cuda" if torch.cuda.is_available() else "cpu", seed=0)
    prefix, delta, bank, norm_w, proj_w, out_w = args
    out = torch.empty_like(prefix)
    MOD.attn_res(prefix, bank, nb, norm_w, proj_w[0], sweep.EPS, out, delta=delta,
                 prefix_out=prefix, block_write_idx=nb, out_norm_w=out_w, out_eps=sweep.EPS)
    assert asked == [prefix.device]
    assert [sweep.label(s) for s in launched] == ["solo8M"] and name(T, H, nb) == "solo8"
    assert MOD.device_table_name(torch.device("cpu")) == H100  # (the patch)
    monkeypatch.undo()
    assert MOD.device_table_name(torch.device("cpu")) is None


# ------------------------------------------------------------ every selected shape, run


def _launch_kw(shape: LaunchShape, H: int) -> dict:
    """Launcher arguments forcing ``shape``'s form at a small width ``H``: the one-program
    split form as wide as the row, the split kernel's chunks narrow enough for 3 programs."""
    if shape.kind == "row":
        return dict(kind="row", sources_per_tile=shape.sources_per_tile,
                    num_warps=shape.num_warps, loop_stages=shape.loop_stages,
                    early_tile=shape.early_tile)
    solo = shape.chunk >= shape.block_h
    return dict(kind="split", chunk=triton.next_power_of_2(H) if solo else 32,
                num_warps=shape.num_warps)


SELECTED = sorted({(n, nb) for gpu in TABLES for rows in launch_table(gpu).values()
                   for _, names in rows for nb, n in enumerate(names.split())})


@pytest.mark.parametrize("shape_name,nb", SELECTED, ids=[f"{n}-nb{nb}" for n, nb in SELECTED])
def test_every_selected_shape_matches_the_spec(shape_name: str, nb: int) -> None:
    """Each (shape, block count) the table selects, in its kernel form at H 96: delta,
    block write into the last slot, output norm, bf16, a stacked bank."""
    H = 96
    kw = _launch_kw(parse_shape(shape_name, H), H)
    c = replace(_K3, T=3, H=H, nb_max=9, num_blocks=nb, write_idx=8,
                launch=tuple(sorted(kw.items())))
    run_and_check(c, seed=nb)


@pytest.mark.parametrize("T", [1, 65])
def test_automatic_selection_matches_the_spec(T: int) -> None:
    """The launcher's own choice at a small width (the 4 KiB bucket) in the decode buckets
    (the prefill bucket's shapes run above at T = 3: 256 interpreted tokens take a minute)."""
    for nb in (0, 5, 8):
        c = replace(_K3, T=T, H=48, nb_max=9, num_blocks=nb, write_idx=8)
        assert pick_launch_shape(T, 48, nb) == table_shape(T, 48, nb)
        run_and_check(c, seed=T + nb)


# ------------------------------------------------------------- compiled and eager paths


@pytest.mark.usefixtures("fresh_state")
@pytest.mark.parametrize("H,nb", [(96, 3), (96, 6)])  # r4x4e, solo4
def test_compiled_and_eager_paths_pick_the_same_launch(monkeypatch, H: int, nb: int) -> None:
    """``torch.compile(backend="k3fusion")`` of an AttnRes site (the functional op) and
    ``k3fusion.eager.attn_res`` (the in-place op) ask ``pick_launch_shape`` the same question
    and get the table's answer."""
    calls = []
    real = MOD.pick_launch_shape

    def spy(T, H, num_blocks, **kw):
        shape = real(T, H, num_blocks, **kw)
        calls.append(((T, H, num_blocks, kw["element_size"], kw["gpu"]), shape))
        return shape

    monkeypatch.setattr(MOD, "pick_launch_shape", spy)
    T = 3
    # The interpreter on CPU, the GPU where there is one (its CPU tensors take no kernel).
    args = sweep.make_inputs(T, H, "cuda" if torch.cuda.is_available() else "cpu", seed=nb)

    compiled = torch.compile(lambda *a: sweep.chain(*a, nb=nb), backend="k3fusion",
                             fullgraph=True)
    with torch.no_grad():
        compiled(*[a.clone() for a in args])
    assert k3fusion.match_counts().get("attn_res", 0) == 1
    compiled_calls = list(calls)
    calls.clear()

    prefix, delta, bank, norm_w, proj_w, out_w = [a.clone() for a in args]
    k3fusion.eager.attn_res(prefix, bank, nb, norm_w, proj_w[0], sweep.EPS, delta, nb, out_w,
                            sweep.EPS)
    assert calls and calls == compiled_calls[-len(calls):]
    (question, shape), = calls
    gpu = MOD.device_table_name(args[0].device)
    assert question == (T, H, nb, 2, gpu) and shape == table_shape(T, H, nb, gpu=gpu)


@pytest.mark.cuda
@pytest.mark.parametrize("H", [2048, 4096, 7168])
def test_selected_launches_match_the_spec_at_the_sweeps_sizes(H: int) -> None:
    """On the GPU, the launcher's own choice at the sweep's widths, every block count, in
    every token bucket (both sides of each edge): delta, block write, output norm, bf16."""
    for T in (1, 12, 13, 64, 65, 255, 256):
        for nb in range(9):
            c = replace(_K3, T=T, H=H, nb_max=9, num_blocks=nb, write_idx=8)
            assert pick_launch_shape(T, H, nb) == table_shape(T, H, nb)
            run_and_check(c, seed=T * 16 + nb)


@pytest.mark.parametrize("suffix,trigger", [("", "entry"), ("M", "mix"), ("L", "exit"),
                                            ("N", "off")])
@pytest.mark.parametrize("name", ["r1x8p3", "r4x8e", "solo16", "s1024x4"])
def test_shape_names_carry_the_pdl_trigger(name, suffix, trigger):
    shape = parse_shape(name + suffix, 7168)
    assert shape.trigger == trigger
    assert sweep.label(shape) == name + suffix
    assert replace(shape, trigger="entry") == parse_shape(name, 7168)


def test_a_trigger_given_replaces_the_chosen_shapes():
    """``pick_launch_shape(trigger=...)`` (the sweep's ``--triggers``): the shape the table
    or the rule picks, with that trigger; anything else is refused by name."""
    for T, H, nb in ((1, 7168, 8), (512, 4096, 5), (300, 9000, 2)):
        for trigger in ("entry", "mix", "exit", "off"):
            assert pick_launch_shape(T, H, nb, trigger=trigger) == replace(
                pick_launch_shape(T, H, nb), trigger=trigger)
    assert pick_launch_shape(1, 96, 3, kind="row", trigger="mix") == replace(
        pick_launch_shape(1, 96, 3, kind="row"), trigger="mix")
    with pytest.raises(ValueError, match="trigger"):
        pick_launch_shape(1, 96, 3, trigger="late")


def test_the_shape_trigger_decides_pdl_unless_the_caller_does():
    from k3fusion.kernels.attn_res import pdl_flags

    shapes = {t: parse_shape("solo8" + s, 7168) for s, t in
              (("", "entry"), ("M", "mix"), ("L", "exit"), ("N", "off"))}
    # (can PDL, caller's pdl, trigger) -> (PDL, LATE_TRIGGER, MIX_TRIGGER)
    assert pdl_flags(True, None, shapes["entry"]) == (True, False, False)
    assert pdl_flags(True, None, shapes["mix"]) == (True, True, True)
    assert pdl_flags(True, None, shapes["exit"]) == (True, True, False)
    assert pdl_flags(True, None, shapes["off"]) == (False, False, False)
    assert pdl_flags(True, True, shapes["off"]) == (True, False, False)  # asked for: kept
    for t in shapes:
        assert pdl_flags(False, None, shapes[t]) == (False, False, False)
        assert pdl_flags(False, False, shapes[t]) == (False, False, False)
    with pytest.raises(ValueError, match="trigger"):
        pdl_flags(True, None, replace(shapes["entry"], trigger="late"))
