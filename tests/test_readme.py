"""The README's first screen says what the commands do: checked against the commands.

The set-up commands are the ones CI runs, the main job prints the table the README shows
(numbers aside), and each flag, marker, command and dependency it names exists.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from k3fusion.counters import FUSIONS

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
FIRST_SCREEN = README[:README.index("## What it is")]


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _blocks(text: str) -> list[str]:
    return re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)


def test_the_two_set_up_commands_are_what_ci_runs():
    install_and_run, install_and_test = _blocks(FIRST_SCREEN)[0].strip().splitlines()
    assert install_and_run.endswith(" -e . && python -m k3fusion")
    assert install_and_test.endswith(' -e ".[test]" && python -m pytest -q')
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if not line.lstrip().startswith("#")]
    assert install_and_test in [line.replace("python -m pip install", "pip install") for line in ci]


def test_every_flag_the_first_screen_names_exists(capsys):
    from k3fusion.cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    options = set(re.findall(r"--[a-z][a-z-]*", capsys.readouterr().out))
    named = set(re.findall(r"--[a-z][a-z-]*", FIRST_SCREEN))
    assert named - options == set(), "README names options the main job does not have"


def test_packaging_claims():
    project = _pyproject()["project"]
    assert "`k3fusion` command" in FIRST_SCREEN
    assert project["scripts"]["k3fusion"] == "k3fusion.cli:main"
    # numpy in the base install: torch warns without it, TRITON_INTERPRET=1 needs it
    assert "numpy" in [re.split(r"[<>=!~ ;\[]", d)[0] for d in project["dependencies"]]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License\n")


def test_suite_time_and_the_quick_subset_are_stated():
    # Both times for the machine they were measured on; the quick subset first (issue 31).
    text = " ".join(FIRST_SCREEN.split())
    suite = re.search(r"the suite: about \d+ minutes on an idle 2-core CPU", text)
    quick = re.search(r'`python -m pytest -q -m "not slow"` is the quick subset: about \d+ '
                      r"minutes on an idle 2-core CPU", text)
    assert suite and quick and quick.start() < suite.start()
    markers = _pyproject()["tool"]["pytest"]["ini_options"]["markers"]
    assert any(m.startswith("slow:") for m in markers)


def test_match_counts_key_rule_is_the_one_documented():
    import k3fusion

    rule = re.search(r"with every fusion as a key \(([^;]*);", README, flags=re.S).group(1)
    assert tuple(re.findall(r"`(\w+)`", rule)) == FUSIONS
    fusion_table = README[README.index("| fusion |"):].split("\n\n")[0]
    table = re.findall(r"^\| `(\w+)` \|", fusion_table, flags=re.M)
    assert tuple(table) == FUSIONS
    k3fusion.reset_match_counts()
    assert k3fusion.match_counts() == dict.fromkeys(FUSIONS, 0)


def _masked(text: str) -> str:
    """Numbers that vary by machine and build (errors, the torch version) masked."""
    text = re.sub(r"\d\.\d\de-\d\d", "<err>", text)
    return re.sub(r"torch \S+", "torch <version>", text)


@pytest.mark.slow
def test_main_job_prints_what_the_readme_shows():
    # As the first set-up command runs it: a fresh process, no arguments, no interpreter.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "k3fusion"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    shown = _blocks(FIRST_SCREEN)[1]
    if "cpu" in proc.stdout.splitlines()[0]:
        assert _masked(proc.stdout) == _masked(shown)
    else:  # a GPU machine adds the device name and a timing line
        assert _masked(proc.stdout).splitlines()[1:5] == _masked(shown).splitlines()[1:5]
    assert "Failed to initialize NumPy" not in proc.stderr
    stages = [line for line in proc.stderr.splitlines() if line.startswith("[k3fusion ")]
    assert len(stages) >= 4 and stages[-1].endswith("] done")  # one line per stage
