"""``tests/mutation/run_mutations.py``: the mutants it generates, and that it restores the file."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "run_mutations", Path(__file__).parent / "mutation" / "run_mutations.py")
runner = importlib.util.module_from_spec(_spec)
sys.modules["run_mutations"] = runner  # dataclasses look their module up there
_spec.loader.exec_module(runner)

SOURCE = '''"""Docstring: if a == b: not mutated."""


def f(a, b):
    # a comment: if x == y
    if a == b and b is not None:
        raise ValueError("a == b is not allowed")
    return a < 3
'''


def test_candidates_touch_code_only():
    muts = runner.candidates(SOURCE)
    got = {(m.kind, m.after.strip()) for m in muts}
    assert ("guard", "if False and (a == b and b is not None):") in got
    assert ("negate", "if a != b and b is not None:") in got
    assert ("negate", "if a == b and b is None:") in got
    assert ("bool", "if a == b or b is not None:") in got
    assert ("boundary", "return a <= 3") in got
    assert ("constant", "return a < 4") in got
    # nothing inside the docstring, the comment or the string literal
    assert all(m.line in (6, 8) for m in muts), [str(m) for m in muts]


def test_run_restores_the_module(tmp_path, monkeypatch):
    module = tmp_path / "mod.py"
    module.write_text(SOURCE)
    test = tmp_path / "test_mod.py"
    test.write_text("import mod\n\ndef test_f():\n    assert mod.f(1, 2) is True\n")
    monkeypatch.chdir(tmp_path)
    muts = [m for m in runner.candidates(SOURCE) if m.kind == "boundary"]
    results = runner.run(module, [str(test)], muts, timeout=120)
    assert module.read_text() == SOURCE
    # a < 3 -> a <= 3: f(1, 2) still True (survives)
    assert [k for _, k, _ in results] == [False]
