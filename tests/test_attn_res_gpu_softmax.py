"""The AttnRes matcher on the softmax a GPU compile builds, checked on a CPU build.

On CUDA (and XPU) with Triton, Inductor's post-grad patterns rewrite every
``amax, sub, exp, sum`` softmax into ``prepare_softmax_online`` (one reduction for the
max and the sum of exps) before the fusion passes run; a CPU compile never does. Without
these tests the matcher's reading of that form ran only on the GPU machine.
:func:`graph_utils.gpu_softmax_form` runs Inductor's own rewrite here, so each site
below is checked in the form a GPU compile gives the pass: the same sites fuse, the near
misses stay unfused and equal to eager, the rewrite did happen where the softmax is
plain, and the whole pipeline (lowering and codegen) compiles.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._inductor import inductor_prims

import k3fusion

import test_attn_res_mutations as muts
from graph_utils import (CaptureBackend, K3Calls, LoweringBackend, SideBySide,  # noqa: F401
                         count_op, fresh_state, gpu_softmax_form, op_histogram)
from public_catalogue import ENTRIES
from test_public_catalogue import _errors, _flat, _fused_counts, check_sites, spec_path

pytestmark = [pytest.mark.usefixtures("fresh_state"),
              pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")]

ONLINE = getattr(inductor_prims, "prepare_softmax_online", None)
if ONLINE is None:  # (an older torch: no online softmax anywhere)
    pytest.skip("this torch has no prepare_softmax_online", allow_module_level=True)

#: softmax facts of a site (each must fuse exactly when test_attn_res_mutations says so);
#: "unit_scale" and "temperature" are Inductor's where-form of softmax(l * s), which its
#: online rewrite leaves alone (torch 2.13; 2.14 drops a scale of exactly 1 first, and
#: its softmax is then rewritten)
SOFTMAX_MUTATIONS = ["none", "minus_max", "softmax_other_dim", "sink", "mask", "leak_logits",
                     "unit_scale", "temperature"]
WHERE_FORM = {"unit_scale", "temperature"}


@pytest.mark.parametrize("spelling", ["sources_last", "sources_first", "matvec", "moved"])
@pytest.mark.parametrize("mutation", SOFTMAX_MUTATIONS)
def test_site_with_online_softmax(spelling, mutation):
    """Every spelling's site, and its softmax near misses, in the GPU's softmax form (fp32:
    the bf16 draws of the mutation test read the same graph up to casts)."""
    with gpu_softmax_form() as online:
        muts.check_site(spelling, mutation, 2, 3, torch.float32, seed=7, grad=False)
    if mutation not in WHERE_FORM:  # the pass saw the online form (else this cannot fail)
        assert online.rewrites >= 1


ATTN_RES_ENTRIES = [e for e in ENTRIES if e.fused.get("attn_res")]
#: entries whose softmax is ``softmax(l * 1.0)`` (Inductor's where-form on torch 2.13: no
#: online rewrite)
WHERE_FORM_ENTRIES = {"fast_attnres_reference"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("entry", ATTN_RES_ENTRIES, ids=[e.name for e in ATTN_RES_ENTRIES])
def test_catalogue_entry_with_online_softmax(entry, dtype):
    """Every public AttnRes implementation of the catalogue fuses the same sites (by block
    count) in the GPU's softmax form, and is no less accurate than eager against fp64."""
    model = entry.build().eval()
    ref_model = copy.deepcopy(model).double()
    model = model.to(dtype)
    args = entry.inputs(5, dtype)
    be = CaptureBackend()
    with gpu_softmax_form() as online, torch.no_grad(), spec_path():
        out = torch.compile(model, backend=be, fullgraph=True)(*args)
        ref = ref_model(*(a.double() for a in args))
        eager = model(*args)
    assert online.rewrites >= 1 or entry.name in WHERE_FORM_ENTRIES, (
        "no softmax was rewritten: the test did not see the GPU form")
    assert _fused_counts(entry) == entry.expected(dtype)[0]
    check_sites(entry, K3Calls(be, model), dtype)
    # each fused site took its (rewritten) softmax with it
    gone = count_op(be.graph_before, ONLINE) - count_op(be.graph_after, ONLINE)
    assert gone == (entry.expected(dtype)[0]["attn_res"] if online.rewrites else 0)
    e_max, e_mean = _errors(eager, ref)
    c_max, c_mean = _errors(out, ref)
    slack = 1.2 if dtype == torch.bfloat16 else 1.1
    ulp = torch.finfo(torch.float32).eps * max(t.abs().mean().item() for t in _flat(ref))
    assert c_mean <= slack * e_mean + 2 * ulp and c_max <= 1.5 * e_max + 8 * ulp, (
        f"compiled max/mean error {c_max:.3g}/{c_mean:.3g}, eager {e_max:.3g}/{e_mean:.3g}")


def test_catalogue_lowers_with_online_softmax():
    """Lowering and codegen for real, every AttnRes entry side by side in bf16, in the GPU's
    softmax form, T 64: the fused sites, and the online reductions Inductor lowers for what
    stays unfused, compile; the output equals eager's within bf16 rounding. (Other token
    counts and dynamic shapes: test_public_catalogue, in the CPU's form.)"""
    tokens, dynamic = 64, False
    models = [e.build().eval().to(torch.bfloat16) for e in ATTN_RES_ENTRIES]
    args = [e.inputs(tokens, torch.bfloat16) for e in ATTN_RES_ENTRIES]
    module = SideBySide([(m, len(a)) for m, a in zip(models, args)])
    flat = [t for a in args for t in a]
    be = LoweringBackend()
    with gpu_softmax_form() as online, torch.no_grad(), spec_path():
        got = torch.compile(module, backend=be, dynamic=dynamic, fullgraph=True)(*flat)
        want = module(*flat)
    assert be.lowered == be.compiles == 1 and online.rewrites >= 1
    assert k3fusion.match_counts()["attn_res"] == sum(
        e.expected(torch.bfloat16, dynamic)[0]["attn_res"] for e in ATTN_RES_ENTRIES)
    for a, b in zip(_flat(got), _flat(want)):
        assert a.shape == b.shape and a.dtype == b.dtype
        scale = b.float().abs().max().item() if b.numel() else 0.0
        torch.testing.assert_close(a.float(), b.float(), rtol=0.05, atol=0.05 * max(scale, 1.0))
