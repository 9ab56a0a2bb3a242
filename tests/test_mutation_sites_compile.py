"""Every site of the three mutation catalogues (``test_attn_res_mutations``,
``test_qkv_mutations``, ``test_moe_tail_mutations``) compiles through Inductor's lowering
and code generation (``graph_utils.LoweringBackend``) at T = 0 and 1 (static) and at a
dynamic T (64), and equals eager (issue 27: a compile never fails because of k3fusion).
A static compile at a general T (T = 64 until 2026-12-05) is what the mutation tests
compile, draw by draw (Inductor's passes for real), lowered here at T = 1 and the dynamic T.

Only the sites a rewrite may touch are compiled here (those the catalogue says fuse, or
may): a site left unfused must leave the graph as it was (the mutation tests check that),
so Inductor compiles default Inductor's graph there. The sites sit side by side in one
module (each with its own parameters and inputs): one compile per catalogue and token
count covers them all. Fusion counts are the mutation tests' business: side by side, two
region-input norms of different sites may pair, which is fine here -- whatever is
rewritten must compile and compute eager's values. The mutation tests compile their draws
through ``CaptureBackend`` only (no lowering): this file lowers their sites.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import test_attn_res_mutations as attn_muts
import test_moe_tail_mutations as tail_muts
import test_qkv_mutations as qkv_muts
from _norm_spellings import NORM_MUTATIONS, applicable

from graph_utils import LoweringBackend, SideBySide, fresh_state  # noqa: F401

pytestmark = [pytest.mark.usefixtures("fresh_state"),
              pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")]

DTYPE = torch.bfloat16


def _rand(g, *shape):
    return torch.randn(*shape, generator=g).to(DTYPE)


def attn_res_sites(tokens: int) -> tuple[list, list]:
    g = torch.Generator().manual_seed(tokens)
    sites, args = [], []
    for spelling in ("sources_last", "sources_first", "matvec", "moved"):
        for mutation in sorted(attn_muts.MUTATIONS):
            if not (attn_muts.MUTATIONS[mutation] or mutation == "mix_fp32" or (
                    spelling == "moved" and mutation in attn_muts.STACK_KEEPS)):
                continue  # never fused: the graph stays default Inductor's
            if mutation in attn_muts.MATVEC_ONLY and spelling != "matvec":
                continue
            if mutation in attn_muts.MOVED_ONLY and spelling != "moved":
                continue
            n = 2
            sites.append((attn_muts.Site(spelling, mutation, n).to(DTYPE), 2))
            slots = 2 * n + 1
            shape = (2, tokens, slots, attn_muts.H) if spelling == "sources_last" else \
                (slots, 2, tokens, attn_muts.H)
            args += [_rand(g, *shape), _rand(g, 2, tokens, attn_muts.H)]
    return sites, args


def _norm_cases(site_mutations):
    """Each site mutation once with plain norms, and each norm mutation once in each
    spelling it can be written in -- those a rewrite may touch (fused, or either)."""
    for site in sorted(site_mutations):
        if site_mutations[site][0] is not False:
            yield site, "none", "hf"
    for mutation in sorted(NORM_MUTATIONS):
        if NORM_MUTATIONS[mutation][0] is not False:
            for spelling in applicable(mutation):
                yield "none", mutation, spelling


def qkv_sites(tokens: int) -> tuple[list, list]:
    g = torch.Generator().manual_seed(tokens)
    sites, args = [], []
    for k, (site, mutation, spelling) in enumerate(_norm_cases(qkv_muts.SITE_MUTATIONS)):
        member = "q" if k % 2 else "kv"
        spellings = (spelling, "vllm") if member == "q" else ("vllm", spelling)
        sites.append((qkv_muts.MLAFront(spellings, mutation, member, site, DTYPE,
                                        max(tokens, 1), seed=k).eval(), 1))
        args.append(_rand(g, 2, tokens, qkv_muts.HIDDEN))
    return sites, args


def tail_sites(tokens: int) -> tuple[list, list]:
    g = torch.Generator().manual_seed(tokens)
    sites, args = [], []
    cases = [c for c in _norm_cases(tail_muts.SITE_MUTATIONS) if c[1] != "cast_other_dtype"]
    for k, (site, mutation, spelling) in enumerate(cases):
        sites.append((tail_muts.LatentTail(spelling, mutation, site, DTYPE, max(tokens, 1),
                                           seed=k).eval(), 3))
        args += [_rand(g, tokens, n) for n in (tail_muts.ACT, tail_muts.LATENT, tail_muts.HIDDEN)]
    return sites, args


CATALOGUES = {"attn_res": attn_res_sites, "qkv_rmsnorm": qkv_sites, "moe_tail": tail_sites}


@contextlib.contextmanager
def spec_path():
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET", raising=False)
        yield


@pytest.mark.parametrize("tokens,dynamic", [(1, False), (0, False), (64, True)],
                         ids=["T1", "T0", "T64-dynamic"])
@pytest.mark.parametrize("catalogue", sorted(CATALOGUES))
def test_every_mutation_site_compiles(catalogue, tokens, dynamic):
    sites, args = CATALOGUES[catalogue](tokens)
    module = SideBySide(sites)
    be = LoweringBackend()
    compiled = torch.compile(module, backend=be, dynamic=dynamic, fullgraph=True)
    with torch.no_grad(), spec_path():
        want = module(*args)
        got = compiled(*args)
    assert be.lowered == be.compiles == 1
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        scale = b.float().abs().max().item() if b.numel() else 0.0
        torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=3e-2 * max(scale, 1.0))
