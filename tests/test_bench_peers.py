"""The peer harness (``--peers DIR``, ``k3fusion.bench.peers``, issue 30) on the CPU: adapters
written to a temporary directory run through the op benchmarks' loops with a stand-in timer
and pass-through compilers. A peer's column and source reach the JSON and the markdown; a
declined point says n/a with the reason; a wrong peer is reported as failing the check and
is never timed; a bad directory or adapter is one clear error before anything runs."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from k3fusion.bench import attn_res, moe_tail, peers, qkv_rmsnorm
from k3fusion.bench.common import write_results
from k3fusion.kernels._launch import kernels_are_interpreted

ROOT = Path(__file__).resolve().parents[1]


def _adapter(directory: Path, stem: str, body: str, op: str = "qkv_rmsnorm",
             name: str | None = None, commit: str = "abc1234") -> Path:
    head = (f"NAME = {name or stem!r}\nOP = {op!r}\n"
            f"SOURCE = {{'repo': 'example/{stem}', 'path': 'ops/{stem}.py', 'commit': {commit!r}}}\n")
    path = directory / f"{stem}.py"
    path.write_text("import torch\n" + head + textwrap.dedent(body))
    return path


_RMS = """
def _rms(x, w, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)
"""

GOOD_QKV = _RMS + """
def make(inputs, point):
    q, kv = inputs["q"], inputs["kv"]
    return lambda: (_rms(q, inputs["q_weight"], point["eps"]),
                    _rms(kv, inputs["kv_weight"], point["eps"]))
"""
# Forgets the kv norm's weight: off by ~10% -- a real kernel's kind of bug.
WRONG_QKV = _RMS + """
def make(inputs, point):
    q, kv = inputs["q"], inputs["kv"]
    return lambda: (_rms(q, inputs["q_weight"], point["eps"]),
                    _rms(kv, torch.ones_like(inputs["kv_weight"]), point["eps"]))
"""
DECLINING = GOOD_QKV + """
def declines(point):
    return "no kernel for T < 4" if point["T"] < 4 else None
"""


class _Timer:
    """Runs the callable once per set, as the real timer does before its capture; a peer's
    callable (``fn(i)`` on ``(i,)``) takes 1 us, everything else 2 us."""

    def __init__(self):
        self.peer_calls = 0

    def __call__(self, fn, arg_sets, *_):
        for args in arg_sets:
            fn(*args)
        is_peer = isinstance(arg_sets[0][0], int)
        self.peer_calls += is_peer
        return 1.0 if is_peer else 2.0


def _passthrough(gm, example_inputs):
    return gm.forward


def _peer_dir(tmp_path: Path) -> Path:
    d = tmp_path / "peers"
    d.mkdir()
    _adapter(d, "good", GOOD_QKV)
    _adapter(d, "wrong", WRONG_QKV)
    _adapter(d, "picky", DECLINING)
    return d


@pytest.mark.usefixtures("ops_by_reference")
def test_qkv_peers_reach_json_and_markdown(tmp_path):
    loaded = peers.load_peers(_peer_dir(tmp_path), "qkv_rmsnorm")
    timer = _Timer()
    result = qkv_rmsnorm.run([2, 4], peers=loaded, device="cpu", timer=timer,
                             backends={"inductor": _passthrough, "k3fusion": _passthrough})
    write_results(tmp_path, "qkv_rmsnorm", result, qkv_rmsnorm.markdown(result), lambda r, p: None)
    saved = json.loads((tmp_path / "qkv_rmsnorm.json").read_text())
    assert {p["name"]: p["commit"] for p in saved["peers"]} == {
        "good": "abc1234", "picky": "abc1234", "wrong": "abc1234"}
    t2, t4 = saved["rows"]
    assert t2["peers"]["good"] == {"us": 1.0} and t4["peers"]["picky"] == {"us": 1.0}
    assert t2["peers"]["picky"] == {"declined": "no kernel for T < 4"}
    assert "us" not in t2["peers"]["wrong"] and "mismatched" in t2["peers"]["wrong"][
        "failed_check"].lower()
    # timed: good at both points, picky at T = 4 only, wrong never
    assert timer.peer_calls == 3
    assert t2["best_peer"] == "good" and t2["peer_speedup"] == 2.0  # fused op 2 us / 1 us
    md = (tmp_path / "qkv_rmsnorm.md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| T |"))
    assert header.endswith("| good | picky | wrong | best peer vs k3fusion |")
    row2 = next(line for line in md.splitlines() if line.startswith("| 2 |"))
    assert "| 1.00 | n/a (no kernel for T < 4) | **failed check** (" in row2
    assert row2.endswith("| **good 2.00x, peer faster** |")
    assert "- good: example/good `ops/good.py` @ abc1234 (adapter `good.py`)" in md


# Writes the new prefix but not the block slot: the bank check catches it.
NO_BLOCK_WRITE = """
def make(inputs, point):
    prefix, delta = inputs["prefix"], inputs["delta"]
    def step():
        prefix.copy_((prefix.float() + delta.float()).to(prefix.dtype))
        return torch.zeros_like(prefix)
    return step
"""
NO_OUTPUT_NORM = """
def declines(point):
    return "no output norm"

def make(inputs, point):
    raise AssertionError("a declined point is never made")
"""


@pytest.fixture
def ops_by_reference(monkeypatch):
    """The ops' CPU path without Triton's interpreter (read per call): k3fusion.reference,
    which the benches' bit-exact and bf16 checks hold, as the compiled kernels do (the
    interpreter rounds toward zero; the kernel tests cover it)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.mark.usefixtures("ops_by_reference")
def test_attn_res_peers_checked_against_the_reference(tmp_path):
    d = tmp_path / "peers"
    d.mkdir()
    (d / "torch_attn_res.py").write_text((ROOT / "examples/peers/torch_attn_res.py").read_text())
    _adapter(d, "no_write", NO_BLOCK_WRITE, op="attn_res")
    _adapter(d, "vllm_like", NO_OUTPUT_NORM, op="attn_res")
    _adapter(d, "other_op", GOOD_QKV)  # another op's adapter: not a column here
    loaded = peers.load_peers(d, "attn_res")
    timer = _Timer()
    result = attn_res.run([3], compiled={"inductor": _passthrough}, peers=loaded,
                          device="cpu", hidden=64, timer=timer)
    (row,) = result["rows"]
    cells = row["peers"]
    assert cells["torch eager (example)"] == {"us": 1.0}  # the committed example passes
    assert cells["no_write"]["failed_check"].startswith("the bank differs")
    assert cells["vllm_like"] == {"declined": "no output norm"}
    assert timer.peer_calls == 1
    md = attn_res.markdown(result)
    assert "n/a (no output norm)" in md and "other_op" not in md
    assert "examples/peers/torch_attn_res.py" in md


def test_moe_tail_peers(tmp_path):
    d = tmp_path / "peers"
    d.mkdir()
    (d / "torch_moe_tail.py").write_text((ROOT / "examples/peers/torch_moe_tail.py").read_text())
    _adapter(d, "no_shared", """
def make(inputs, point):
    return lambda: inputs["shared"] * 0 + 1
""", op="moe_tail")
    gen = torch.Generator().manual_seed(0)
    sets = [(torch.randn(2, 32, generator=gen).bfloat16(), torch.randn(2, 16, generator=gen).bfloat16(),
             (1 + 0.1 * torch.randn(32, generator=gen)).bfloat16(),
             (torch.randn(16, 32, generator=gen) / 32**0.5).bfloat16()) for _ in range(2)]
    ref = moe_tail.tail(*sets[0])
    cells = moe_tail.time_peers(peers.load_peers(d, "moe_tail"), 2, sets, ref, timer=_Timer())
    assert cells["torch eager (example)"] == {"us": 1.0}
    assert "does not match the reference" in cells["no_shared"]["failed_check"]


@pytest.mark.skipif(not kernels_are_interpreted(), reason="the sweep's dry run is the CPU form")
def test_attn_res_sweep_dry_run_with_peers(tmp_path, capsys):
    from k3fusion.bench import attn_res_sweep as sweep

    d = tmp_path / "peers"
    d.mkdir()
    (d / "torch_attn_res.py").write_text((ROOT / "examples/peers/torch_attn_res.py").read_text())
    _adapter(d, "no_write", NO_BLOCK_WRITE, op="attn_res")
    out = tmp_path / "out"
    assert sweep.main(["--dry-run", "--chosen-only", "--skip-inductor", "--num-blocks", "5",
                       "--tokens", "1", "--out", str(out), "--peers", str(d)]) == 0
    (point,) = json.loads((out / "attn_res_sweep.json").read_text())["points"]
    assert point["peers"]["torch eager (example)"] == {"us": 1.0}
    assert "bank differs" in point["peers"]["no_write"]["failed_check"]
    assert point["best_peer"] == "torch eager (example)" and point["peer_speedup"] == 1.0
    md = (out / "attn_res_sweep.md").read_text()
    assert "| H | blocks | T | k3fusion (chosen) | no_write | torch eager (example) |" in md
    assert "| 48 | 5 | 1 | 1.00 | **failed check** (the bank differs" in md


@pytest.mark.parametrize("body, expected", [
    ("NAME = 'x'\nOP = 'attn_res'\n", "missing SOURCE, make"),
    ("NAME = 'x'\nOP = 'rope'\nSOURCE = {'repo': 'r', 'path': 'p', 'commit': 'c'}\n"
     "def make(i, p): pass\n", "OP 'rope' is not a benchmarked op (attn_res, qkv_rmsnorm, moe_tail)"),
    ("NAME = 'x'\nOP = 'attn_res'\nSOURCE = {'repo': 'r', 'path': 'p'}\ndef make(i, p): pass\n",
     "SOURCE lacks commit"),
    ("NAME = 'x'\nOP = 'attn_res'\nSOURCE = {'repo': 'r', 'path': 'p', 'commit': 'c'}\n"
     "make = 3\n", "make must be a function"),
    ("import not_a_module_anywhere\n", "importing it failed: ModuleNotFoundError"),
])
def test_bad_adapter_is_one_clear_error_naming_the_file(tmp_path, body, expected, capsys):
    from k3fusion.cli import main

    (tmp_path / "bad_peer.py").write_text(body)
    with pytest.raises(peers.AdapterError) as e:
        peers.load_peers(tmp_path)
    assert "bad_peer.py" in str(e.value) and expected in str(e.value)
    # The CLI and each benchmark: a usage error (exit 2) before anything is timed.
    with pytest.raises(SystemExit) as stop:
        main(["bench", "qkv_rmsnorm", "--peers", str(tmp_path)])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "bad_peer.py" in err and expected in err
    with pytest.raises(SystemExit) as stop:
        qkv_rmsnorm.main(["--peers", str(tmp_path), "--out", str(tmp_path / "o")])
    assert stop.value.code == 2 and expected in capsys.readouterr().err


def test_bad_peer_directories(tmp_path, capsys):
    from k3fusion.cli import main

    with pytest.raises(peers.AdapterError, match="no such directory"):
        peers.load_peers(tmp_path / "missing")
    (tmp_path / "_helper.py").write_text("")
    with pytest.raises(peers.AdapterError, match="no adapter in it"):
        peers.load_peers(tmp_path)
    _adapter(tmp_path, "one", GOOD_QKV, name="same")
    _adapter(tmp_path, "two", GOOD_QKV, name="same")
    with pytest.raises(peers.AdapterError, match="one.py and .*two.py both have NAME 'same'"):
        peers.load_peers(tmp_path)
    for argv, expected in ((["--peers", str(tmp_path / "missing")], "no such directory"),
                           (["decoder", "--peers", str(tmp_path)], "none of decoder times peers"),
                           (["attn_res", "--only", "decoder"], "either as names or with --only"),
                           (["attn_rez"], "unknown benchmark attn_rez")):
        with pytest.raises(SystemExit) as stop:
            main(["bench", *argv])
        assert stop.value.code == 2 and expected in capsys.readouterr().err


def test_cli_passes_peers_to_the_benchmarks_that_time_them(monkeypatch, tmp_path):
    import sys
    import types

    from k3fusion.cli import main

    calls = {}
    for name in ("attn_res", "decoder"):
        module = types.ModuleType(f"k3fusion.bench.{name}")
        module.main = lambda argv, name=name: calls.setdefault(name, argv) and 0
        monkeypatch.setitem(sys.modules, f"k3fusion.bench.{name}", module)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert main(["bench", "attn_res", "decoder", "--out", "o", "--peers", str(ROOT / "examples/peers")]) == 0
    assert calls == {"attn_res": ["--out", "o", "--peers", str(ROOT / "examples/peers")],
                     "decoder": ["--out", "o"]}
