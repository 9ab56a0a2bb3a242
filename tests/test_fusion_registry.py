"""The fusion registry (issue 32): one ordered tuple every layer reads, and the claim order
between fusions stated once, in the code, and in docs/architecture.md as the code has it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import k3fusion
from k3fusion.config import FusionConfig
from k3fusion.counters import FUSIONS as COUNTED
from k3fusion.eager.patch import PATCHERS
from k3fusion.pass_manager import _claim_steps
from k3fusion.patterns import attn_res, moe_tail, qkv_rmsnorm
from k3fusion.patterns.registry import COUNT_NAMES, FUSIONS, by_name, claim_order

ROOT = Path(__file__).resolve().parents[1]


def test_registry_order_is_the_order_users_see():
    assert [f.name for f in FUSIONS] == ["qkv_rmsnorm", "attn_res", "moe_tail"]
    assert COUNT_NAMES == COUNTED == ("qkv_rmsnorm", "attn_res", "attn_res_delta_handoff",
                                      "moe_tail")
    k3fusion.reset_match_counts()
    assert list(k3fusion.match_counts()) == list(COUNT_NAMES)


def test_each_fusion_is_its_patterns_module_object():
    for module in (qkv_rmsnorm, attn_res, moe_tail):
        assert module.FUSION.name == module.FUSION_NAME == module.__name__.rpartition(".")[2]
        assert module.FUSION in FUSIONS and by_name(module.FUSION_NAME) is module.FUSION
        assert module.FUSION.count_names[0] == module.FUSION.name
        assert hasattr(FusionConfig(), module.FUSION.switch)
    with pytest.raises(KeyError, match="known: qkv_rmsnorm, attn_res, moe_tail"):
        by_name("nope")


def test_eager_patchers_attach_to_the_fusions_names_in_their_old_order():
    assert [p.fusion for p in PATCHERS] == ["moe_tail", "attn_res", "qkv_rmsnorm"]
    assert {p.fusion for p in PATCHERS} <= {f.name for f in FUSIONS}


def _steps(**switches):
    return [(f.name, reserves) for f, reserves in _claim_steps(FusionConfig(**switches))]


def test_claim_steps():
    # AttnRes; the strong q/kv pairs reserved; the tail; the q/kv pass on what is left
    assert _steps() == [("attn_res", False), ("qkv_rmsnorm", True), ("moe_tail", False),
                        ("qkv_rmsnorm", False)]
    assert [f.name for f in claim_order()] == ["attn_res", "moe_tail", "qkv_rmsnorm"]
    # a reservation only where a fusion claims between it and its owner
    assert ("qkv_rmsnorm", True) not in _steps(moe_tail=False)
    assert ("qkv_rmsnorm", True) not in _steps(qkv_rmsnorm=False)
    # a fusion switched off keeps its step: it may explain the norms that reach it
    assert ("qkv_rmsnorm", False) in _steps(qkv_rmsnorm=False)


def test_architecture_states_the_claim_order_of_the_code():
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("## Claims between fusions"):]
    section = section[:section.index("\n## ", 1)]
    # "1. **AttnRes** (10, ...": each numbered claim with its priority, in the doc's order
    item = re.compile(r"^\d+\. \*\*[^*]+\*\*[^(\n]*\((\d+)", flags=re.M)
    stated = [int(p) for p in item.findall(section)]
    priorities = sorted([f.claim_priority for f in FUSIONS]
                        + [f.reservation.priority for f in FUSIONS if f.reservation])
    assert stated == priorities
