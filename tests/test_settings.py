"""``K3FUSION_*`` settings: every variable checked when k3fusion is imported, against what
its field allows and the kernels' limits; an error is one line naming the variable, the
value and what is allowed (issue 31)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from k3fusion.config import (ENV_PREFIX, TRITON_MAX_TENSOR_NUMEL, FusionConfig, SettingsError,
                             dual_norm_rows_for_widths, env_name, load_config)

ROOT = Path(__file__).resolve().parents[1]

#: field -> bad values: a wrong word, a negative number, over a kernel limit (where the field
#: has one), a value no rule allows.
BAD = {
    "qkv_rmsnorm": ["maybe", "2"], "attn_res": ["maybe"], "debug": ["maybe", ""],
    "fused_backward": ["sometimes"],
    "moe_tail": ["maybe"], "disable_shared_experts_stream": ["maybe"],
    "dual_norm_rows_per_program": ["lots", "-4", "3", str(2 * TRITON_MAX_TENSOR_NUMEL)],
    "fused_tail_max_tokens": ["-5", "1e3", "many"],
    "shared_experts_stream_token_threshold": ["-1", "lots"],
    "moe_tail_tier": ["fast", "-1"],
}


def test_every_field_has_bad_values_here():
    assert set(BAD) == {f.name for f in fields(FusionConfig)}


@pytest.mark.parametrize("var, raw", [(env_name(name), raw) for name, values in BAD.items()
                                      for raw in values])
def test_a_bad_value_is_one_line_naming_the_variable_value_and_what_is_allowed(var, raw):
    with pytest.raises(SettingsError) as e:
        load_config({var: raw})
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"{var}={raw!r}: expected "), message
    assert isinstance(e.value, ValueError)


def test_the_limit_says_what_is_allowed():
    with pytest.raises(SettingsError, match=r"a power of two up to 1048576 \(Triton's largest"):
        load_config({"K3FUSION_DUAL_NORM_ROWS_PER_PROGRAM": str(2 * TRITON_MAX_TENSOR_NUMEL)})
    rows = load_config({"K3FUSION_DUAL_NORM_ROWS_PER_PROGRAM": "64"}).dual_norm_rows_per_program
    assert rows == 64
    with pytest.raises(ValueError, match=r"dual_norm_rows_per_program must be 0 \(pick by size\) "
                                         r"or a power of two up to"):
        FusionConfig(dual_norm_rows_per_program=2 * TRITON_MAX_TENSOR_NUMEL)


def test_the_limit_is_tritons():
    triton_language = pytest.importorskip("triton.language")
    assert TRITON_MAX_TENSOR_NUMEL == triton_language.TRITON_MAX_TENSOR_NUMEL


def test_rows_per_program_checked_against_the_widths_at_launch():
    config = FusionConfig(dual_norm_rows_per_program=TRITON_MAX_TENSOR_NUMEL)
    with pytest.raises(ValueError) as e:
        dual_norm_rows_for_widths(config, 64, 32)
    message = str(e.value)
    assert "\n" not in message and "K3FUSION_DUAL_NORM_ROWS_PER_PROGRAM" in message
    assert "expected at most 16384 for norms 64 and 32 wide" in message
    assert dual_norm_rows_for_widths(config.replace(dual_norm_rows_per_program=16384), 64, 33) \
        == 16384
    assert dual_norm_rows_for_widths(FusionConfig(), 4096, 1) == 0  # 0: picked by size


def test_two_settings_that_contradict_name_both_variables():
    with pytest.raises(SettingsError, match="K3FUSION_MOE_TAIL_TIER='replicated' forces a tier "
                                            "but K3FUSION_MOE_TAIL='off'"):
        load_config({"K3FUSION_MOE_TAIL": "off", "K3FUSION_MOE_TAIL_TIER": "replicated"})


def test_an_unknown_variable_lists_the_known_ones():
    with pytest.raises(SettingsError) as e:
        load_config({"K3FUSION_QKV_RMS_NORM": "0"})
    assert str(e.value).startswith("K3FUSION_QKV_RMS_NORM='0': not a k3fusion setting; known: ")
    assert all(env_name(f.name) in str(e.value) for f in fields(FusionConfig))


def test_the_readme_lists_every_variable():
    readme = (ROOT / "README.md").read_text()
    listed = set(re.findall(r"^\| `(K3FUSION_\w+)` \|", readme, flags=re.M))
    assert listed == {env_name(f.name) for f in fields(FusionConfig)}
    code = "\n".join(p.read_text() for package in ("k3fusion", "patterns", "kernels", "examples")
                     for p in (ROOT / package).rglob("*.py"))
    named = set(re.findall(r"\b" + ENV_PREFIX + r"[A-Z_]*[A-Z]", code)) - {ENV_PREFIX.rstrip("_")}
    assert named <= listed, "the code names a variable the config does not have"


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    clean["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), clean.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env={**clean, **env},
                          capture_output=True, text=True, timeout=300)


def test_import_checks_the_environment_before_anything_runs():
    proc = _run(["-c", "import k3fusion; print('imported')"],
                {"K3FUSION_FUSED_TAIL_MAX_TOKENS": "-5"})
    assert proc.returncode == 1 and "imported" not in proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert last == ("k3fusion.config.SettingsError: K3FUSION_FUSED_TAIL_MAX_TOKENS='-5': "
                    "expected an integer >= 0"), proc.stderr
    assert "torch" not in proc.stderr  # failed before torch or a kernel was imported


@pytest.mark.parametrize("args", [["-m", "k3fusion"], ["-m", "k3fusion", "explain"]])
def test_the_command_line_says_it_in_one_line_with_exit_status_2(args):
    proc = _run(args, {"K3FUSION_QKV_RMSNORM": "maybe"})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == ("python -m k3fusion: error: K3FUSION_QKV_RMSNORM='maybe': expected "
                           "one of 1/0/true/false/yes/no/on/off\n")


def test_the_console_script_names_itself():
    script = ("import sys; sys.argv[0] = '/usr/bin/k3fusion'; "
              "from k3fusion.cli import main; sys.exit(main())")
    proc = _run(["-c", script], {"K3FUSION_DUAL_NORM_ROWS_PER_PROGRAM": "3"})
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("k3fusion: error: K3FUSION_DUAL_NORM_ROWS_PER_PROGRAM='3': ")

