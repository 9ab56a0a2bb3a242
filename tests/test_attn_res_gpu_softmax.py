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
from graph_utils import (CaptureBackend, K3Calls,  # noqa: F401
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


#: One entry per way a catalogue site reaches its softmax (the online branch is one piece
#: of code: the spellings above draw its near misses): stacked sources first (einsum),
#: a [T, N, H] bank, sequence-first, flattened rows, logits minus their max, an output
#: norm with a delta, per-source logits (two forms), a unit scale.
ATTN_RES_ENTRIES = [e for e in ENTRIES if e.name in (
    "moonshot_readme", "k3_folded_query", "k3_sequence_first", "k3_flattened_projection",
    "catswe_paper_form", "vllm_test_reference", "highbuyer_two_pass", "megatron_loop_read",
    "fast_attnres_reference")]
#: entries whose softmax is ``softmax(l * 1.0)`` (Inductor's where-form on torch 2.13: no
#: online rewrite)
WHERE_FORM_ENTRIES = {"fast_attnres_reference"}


@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=["bf16"])
@pytest.mark.parametrize("entry", ATTN_RES_ENTRIES, ids=[e.name for e in ATTN_RES_ENTRIES])
def test_catalogue_entry_with_online_softmax(entry, dtype):
    """The public AttnRes implementations above fuse the same sites (by block count) in
    the GPU's softmax form, in the dtype a GPU serves, and are no less accurate than eager
    against fp64. (Lowering and codegen of the fused op do not depend on the softmax's
    form: test_public_catalogue compiles every entry through them.)"""
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
