"""Mutation test of the q/kv RMSNorm pair fusion (issue 15, item 3): an MLA front written
with public norm spellings (``_norm_spellings``), one random structural mutation applied,
compiled through Inductor's real passes with the k3fusion pass. For every draw: the compile
does not raise, the outputs equal eager within the dtype's rounding bound, and the pair is
fused exactly when both norms are still the op's RMSNorm and the site is still a pair the
op can take; an unfused one must leave the graph exactly as it was, so what Inductor
lowers is default Inductor's graph. Lowering and codegen of every site form a rewrite may
touch: ``test_mutation_sites_compile.py`` (``graph_utils.LoweringBackend``).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch import nn

from _norm_spellings import NORM_MUTATIONS, WRITTEN, Norm, applicable

from graph_utils import (check_mutated_site, expected_from,  # noqa: F401
                         fresh_state)

pytestmark = [
    pytest.mark.usefixtures("fresh_state"),
    pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight"),
]

HIDDEN, Q_RANK, KV_RANK, ROPE = 64, 48, 24, 8

#: site mutation -> (the pair is still one the op fuses?, what it is)
SITE_MUTATIONS: dict[str, tuple[bool | None, str]] = {
    "none": (True, "the MLA front as written"),
    "bias_after": (True, "a bias added to the q norm's output (outside the norm)"),
    "fp32_weight": (True, "an fp32 weight on a 16-bit member (cast-then-weight: fp32 out)"),
    "leak": (False, "the fp32 normalized row also returned"),
    "chained": (False, "the kv latent projected from the normed q latent"),
    # Same function, but the op takes rows with a contiguous last dim only: a miss.
    "slice_step": (False, "kv_c sliced with step 2 from a wider projection"),
    "other_hidden": (False, "kv projected from another tensor computed in the graph"),
}


class MLAFront(nn.Module):
    def __init__(self, spellings, norm_mutation, member, site, dtype, tokens, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        kv_out = 2 * KV_RANK + ROPE if site == "slice_step" else KV_RANK + ROPE
        self.q_a_proj = nn.Linear(HIDDEN, Q_RANK, bias=False)
        kv_in = Q_RANK if site == "chained" else HIDDEN
        self.kv_a_proj_with_mqa = nn.Linear(kv_in, kv_out, bias=False)
        for lin in (self.q_a_proj, self.kv_a_proj_with_mqa):
            with torch.no_grad():
                lin.weight.copy_(0.2 * torch.randn(lin.weight.shape, generator=g))
        muts = {"q": "none", "kv": "none"}
        muts[member] = norm_mutation
        wdt = {m: (torch.float32 if site == "fp32_weight" and m == member else dtype)
               for m in ("q", "kv")}
        self.q_a_layernorm = Norm(Q_RANK, spellings[0], muts["q"], dtype=dtype,
                                  weight_dtype=wdt["q"], tokens=tokens, seed=seed + 1)
        self.kv_a_layernorm = Norm(KV_RANK, spellings[1], muts["kv"], dtype=dtype,
                                   weight_dtype=wdt["kv"], tokens=tokens, seed=seed + 2)
        self.to(dtype)
        if site == "fp32_weight":  # .to(dtype) cast the fp32 weight back
            norm = self.q_a_layernorm if member == "q" else self.kv_a_layernorm
            for p in norm.parameters():
                p.data = p.data.float()
        self.site, self.member = site, member
        if site == "bias_after":
            self.q_bias = nn.Parameter((0.1 * torch.randn(Q_RANK, generator=g)).to(dtype))
        if site == "leak":
            (self.q_a_layernorm if member == "q" else self.kv_a_layernorm).leak = True

    def forward(self, h):
        q_c = self.q_a_layernorm(self.q_a_proj(h))
        if self.site == "bias_after":
            q_c = q_c + self.q_bias
        if self.site == "chained":
            kv = self.kv_a_proj_with_mqa(q_c.to(h.dtype))
        elif self.site == "other_hidden":
            kv = self.kv_a_proj_with_mqa(h * 2)
        else:
            kv = self.kv_a_proj_with_mqa(h)
        if self.site == "slice_step":
            kv_c, k_pe = kv[..., 0:2 * KV_RANK:2], kv[..., 2 * KV_RANK:]
        else:
            kv_c, k_pe = kv.split([KV_RANK, ROPE], dim=-1)
        out = (q_c, self.kv_a_layernorm(kv_c), k_pe)
        if self.site == "leak":
            norm = self.q_a_layernorm if self.member == "q" else self.kv_a_layernorm
            out = out + (norm.leaked,)
        return out


def expected_fused(norm_mutation: str, site: str, dtype: torch.dtype) -> bool | None:
    """True: must fuse; False: must not; None: either (same function, not read)."""
    norm_ok = NORM_MUTATIONS[norm_mutation][0]
    if norm_mutation == "cast_other_dtype":
        # 16-bit: cast to the other 16-bit dtype, another function; fp32 cast to 16 bits:
        # the norm_dtype form, which the pair kernel does not take.
        norm_ok = False
    return expected_from(norm_ok, SITE_MUTATIONS[site][0])


@st.composite
def draws(draw):
    site = draw(st.sampled_from(sorted(SITE_MUTATIONS)))
    # a leak reads the written-out norm's fp32 row: a written spelling, an RMSNorm
    mutations = sorted(m for m in NORM_MUTATIONS if site != "leak" or m != "layernorm")
    norm_mutation = draw(st.sampled_from(mutations))
    member = draw(st.sampled_from(["q", "kv"]))
    spelling = draw(st.sampled_from([s for s in applicable(norm_mutation)
                                     if site != "leak" or s in WRITTEN]))
    other = draw(st.sampled_from(["hf", "vllm", "f_rms_norm", "nn_rmsnorm"]))
    spellings = (spelling, other) if member == "q" else (other, spelling)
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    lead = draw(st.sampled_from([(1,), (3,), (2, 3)]))
    # dynamic: symbolic T, and a module's float eps becomes a 0-dim graph input
    dynamic = draw(st.booleans())
    grad = draw(st.booleans())  # autograd recording: the forward of a training pair
    return norm_mutation, member, site, spellings, dtype, lead, dynamic, grad


# CI: 20 draws; HYPOTHESIS_PROFILE=dev: 300.
_EXAMPLES = 20 if settings.default.max_examples <= 25 else 300
_SETTINGS = dict(max_examples=_EXAMPLES, deadline=None, phases=[Phase.explicit, Phase.reuse,
                                                         Phase.generate],
                 suppress_health_check=[HealthCheck.too_slow,
                                        HealthCheck.function_scoped_fixture])


def check_draw(norm_mutation, member, site, spellings, dtype, lead, dynamic=False, grad=False,
               seed=0):
    tokens = lead[-1]
    module = MLAFront(spellings, norm_mutation, member, site, dtype, tokens, seed).eval()
    g = torch.Generator().manual_seed(seed + 7)
    h = torch.randn(*lead, HIDDEN, generator=g).to(dtype)
    what = (f"{norm_mutation} on {member} ({spellings}), site {site}, {dtype}, {lead}, "
            f"dynamic={dynamic}, grad={grad}")
    return check_mutated_site(module, (h,), "qkv_rmsnorm",
                              expected_fused(norm_mutation, site, dtype), dynamic=dynamic,
                              what=what, rounded=rounding_dtype(norm_mutation, dtype), grad=grad)


def rounding_dtype(norm_mutation: str, dtype: torch.dtype) -> torch.dtype:
    """The narrowest dtype an output went through (an fp32 output of a row rounded to 16
    bits on the way differs from eager by that rounding, not by fp32 noise)."""
    if norm_mutation == "cast_other_dtype":
        return torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
    return dtype


@settings(**_SETTINGS)
@given(d=draws())
def test_mutated_mla_front_fuses_exactly_when_it_is_still_the_pair(d):
    check_draw(*d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mutation,fused", [("div_by_sqrt", 1), ("div_by_sqrt_eps_outside", 0)])
def test_norms_written_as_a_division_by_sqrt(mutation, fused, dtype):
    """``x / torch.sqrt(torch.mean(x ** 2, -1, keepdim=True) + eps)``, the RMSNorm class
    written from scratch, is the op's norm (the pair fuses); with eps outside the sqrt it
    is not (the graph stays as it was). Both members so written, in every dtype."""
    module_draw = (mutation, "q", "none", ("hf", "vllm"), dtype, (2, 3))
    assert check_draw(*module_draw) == fused
    assert check_draw(mutation, "kv", "none", ("vllm", "hf"), dtype, (1,), dynamic=True) == fused


@pytest.mark.parametrize("spellings", [("hf", "hf"), ("vllm", "f_rms_norm"),
                                       ("nn_rmsnorm", "hf")])
def test_public_spellings_fuse(spellings):
    """Every public spelling fuses unmutated (the random draws may not hit each)."""
    assert check_draw("none", "q", "none", spellings, torch.bfloat16, (2, 3)) == 1
