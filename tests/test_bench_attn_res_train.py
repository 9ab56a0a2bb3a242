"""The training benchmark's loop (``k3fusion.bench.attn_res_train``) on CPU, with a timer
that only calls each step: every compiled step fuses its one AttnRes site while autograd
records, and its output and gradients stay near eager's."""

from __future__ import annotations

import pytest

from k3fusion.bench import attn_res_train as bench

pytestmark = pytest.mark.usefixtures("fresh_state")
from graph_utils import fresh_state  # noqa: E402,F401


def test_training_bench_fuses_each_step_and_tabulates():
    calls = []

    def timer(fn, sets):
        calls.append(fn(*sets[0]))
        return 1.0

    result = bench.run((3,), (2,), device="cpu", hidden=64, timer=timer)
    assert [(r["blocks"], r["T"]) for r in result["rows"]] == [(2, 3)]
    for r in result["rows"]:
        assert r["k3fusion_matches"] == 1 and r["mix_k3fusion_matches"] == 1, r
        # bf16 gradients summed over T and H: a few ulps of the largest, as Inductor's.
        assert r["k3fusion_max_diff"] <= 2 * r["inductor_max_diff"] + 2**-5, r
        assert r["mix_k3fusion_max_diff"] <= 2 * r["mix_inductor_max_diff"] + 2**-5, r
    assert len(calls) == 5  # eager, Inductor, k3fusion; the mix's Inductor, k3fusion
    table = bench.markdown(result)
    assert table.count("\n| 2 | 3 |") == 1 and "mix: Liger" not in table


def test_training_bench_refuses_flags_it_does_not_use(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--sweep"])
    assert "do not apply" in capsys.readouterr().err
