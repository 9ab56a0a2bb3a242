"""The catalogue of public implementations (``public_catalogue.py``, issue 27): every entry
fuses exactly the sites a correct pass fuses -- the right pairs, the right tails, AttnRes
sites over the right number of blocks -- and nothing of a near relative; the compiled
output is no less accurate than eager against an fp64 copy; and no entry fails to compile
through Inductor's lowering and code generation at T = 0 and 1 (static) and at a dynamic T
(64)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import k3fusion

from graph_utils import (CaptureBackend, K3Calls, LoweringBackend, SideBySide,  # noqa: F401
                         fresh_state, gpu_gemm_forms, op_histogram)
from public_catalogue import _TORCH, ENTRIES, Entry

pytestmark = [pytest.mark.usefixtures("fresh_state"),
              pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")]


@contextlib.contextmanager
def spec_path():
    """The ops on their plain-torch CPU path (rounding to nearest as eager and the GPU
    kernels do) instead of the Triton interpreter, whose casts truncate."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET", raising=False)
        yield


def _flat(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in _flat(o)]


def _errors(out, ref) -> tuple[float, float]:
    e = torch.cat([(a.double() - b).abs().flatten() for a, b in zip(_flat(out), _flat(ref))])
    return (e.max().item(), e.mean().item()) if e.numel() else (0.0, 0.0)


def _size(ref) -> float:
    """The mean magnitude of the reference outputs."""
    t = torch.cat([r.abs().flatten() for r in _flat(ref)])
    return t.mean().item() if t.numel() else 0.0


def assert_as_accurate_as_eager(out, eager, ref, dtype: torch.dtype) -> None:
    """No less accurate than eager against the fp64 copy ``ref`` (the ops keep their sums in
    fp32), up to the noise of Inductor's own compile of the rest of the graph. The mean is
    the bound (issue 27): bf16 1.2x eager's; fp32, where eager's error is itself a rounding
    or two, 1.1x plus two fp32 roundings of the outputs' size (another summation order in
    a compiled matmul moves it that much). The max, one element of that summation-order
    noise, within 2x plus 8 such roundings (k3_flattened_projection, fp32 at T 33: 1.65x
    eager's on this CPU, where its mean is 0.67x)."""
    e_max, e_mean = _errors(eager, ref)
    c_max, c_mean = _errors(out, ref)
    ulp = torch.finfo(torch.float32).eps * _size(ref)
    slack = 1.2 if dtype == torch.bfloat16 else 1.1
    assert c_mean <= slack * e_mean + 2 * ulp and c_max <= 2 * e_max + 8 * ulp, (
        f"compiled max/mean error {c_max:.3g}/{c_mean:.3g}, eager {e_max:.3g}/{e_mean:.3g}")


def assert_counts(entry: Entry, counts: dict, want: dict, model, args, report=None) -> None:
    """``counts == want``, else a failure that says why each site was left alone
    (``k3fusion.explain``: one more compile of the call, only when the counts differ) --
    what a GPU run cut off by its time limit must still tell."""
    if counts != want:
        torch._dynamo.reset()
        with torch.no_grad():
            why = k3fusion.explain(model, *args, quiet=True)
        pytest.fail(f"{entry.name}: fused {counts}, expected {want}\n{why}"
                    + (f"\n{report}" if report else ""))


def _fused_counts(entry: Entry) -> dict[str, int]:
    counts = k3fusion.match_counts()
    counts.pop("attn_res_delta_handoff")
    return counts


def check_sites(entry: Entry, calls: K3Calls, dtype: torch.dtype) -> None:
    """The fused sites are the right ones: pairs and tails by parameter name, AttnRes by
    the number of completed blocks each reads."""
    pairs = sorted(sorted([calls.name(a["w1"]), calls.name(a["w2"])])
                   for a in calls.of("dual_rms_norm"))
    assert pairs == sorted(sorted(p) for p in entry.pairs), pairs
    tails = sorted((calls.name(a["norm_w"]), calls.name(a["up_w"]))
                   for a in calls.of("latent_moe_tail"))
    assert tails == sorted(entry.tails), tails
    blocks = sorted(int(a["num_blocks"]) for a in calls.of("attn_res"))
    assert blocks == entry.expected(dtype)[1], blocks


#: Input draws whose errors are pooled for the accuracy check: at 10 token rows one draw's
#: mean error swings by 0.6-1.4x between draws through a bf16 model of several layers (the
#: fused sites and default Inductor alike), three keep the check off a lucky seed.
ACCURACY_SEEDS = (1, 2, 3)
#: The GPU test's draws: at T 1 a draw is 2 token rows, and three of them still swing
#: (k3_flattened_projection, bf16: k3fusion's mean error 1.51x eager's over draws 1-3,
#: 1.005x over 1-10, default Inductor's 0.82x; H200, 2026-12-06).
CUDA_ACCURACY_SEEDS = tuple(range(1, 11))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("entry", ENTRIES, ids=[e.name for e in ENTRIES])
def test_entry_fuses_its_sites_and_is_as_accurate_as_eager(entry, dtype):
    model = entry.build().eval()
    ref_model = copy.deepcopy(model).double()
    model = model.to(dtype)
    be = CaptureBackend()
    compiled = torch.compile(model, backend=be, fullgraph=True)
    ref, eager, out = [], [], []
    with torch.no_grad():
        for seed in ACCURACY_SEEDS:  # one compile, the errors pooled over the draws
            args = entry.inputs(5, dtype, seed=seed)
            ref.append(ref_model(*(a.double() for a in args)))
            eager.append(model(*args))
            with spec_path():
                out.append(compiled(*args))
    assert be.compiles == 1
    calls = K3Calls(be, model)
    assert _fused_counts(entry) == entry.expected(dtype)[0]
    check_sites(entry, calls, dtype)
    if not any(entry.expected(dtype)[0].values()):  # left as it was: default Inductor's graph
        assert op_histogram(be.graph_after) == op_histogram(be.graph_before)
    assert_as_accurate_as_eager(out, eager, ref, dtype)


#: Each entry under the first fusion it has (an entry fusing two kinds compiles once; its
#: other counts are test_entry_fuses_its_sites_and_is_as_accurate_as_eager's: side by
#: side, norms of different entries' inputs may pair).
KINDS = {"attn_res": [e for e in ENTRIES if e.fused.get("attn_res")],
         "qkv_rmsnorm": [e for e in ENTRIES if e.fused.get("qkv_rmsnorm")
                         and not e.fused.get("attn_res")],
         "moe_tail": [e for e in ENTRIES if e.fused.get("moe_tail")
                      and not e.fused.get("attn_res") and not e.fused.get("qkv_rmsnorm")]}
#: Entries whose ``dynamic=True`` compile restarts Dynamo's analysis (torch 2.13): a Python
#: float in a size or scalar expression that AOT autograd cannot keep as a graph input is
#: specialized, and the whole frame is traced again -- the whole side-by-side graph, when
#: such an entry shares it. They get graphs of their own, so that the others' graph is
#: traced once (2026-12-05, this 2-core machine: the AttnRes and MLA dynamic compiles took
#: 102 s of CPU grouped by kind alone, 75 s grouped so; the static ones the same either
#: way). A stale entry here costs time only: the checks are the same in any group.
RESTARTS_DYNAMIC = {"vllm_test_reference", "fla_naive", "catswe_paper_form",
                    "megatron_loop_read", "deepseek_v32_indexer", "deepseek_v3_cache_write",
                    "megatron_core_mla", "torchtitan_deepseek_v3", "rocm_megatron_k3_gated_mla",
                    "torchtitan_k3_latent_moe"}
#: Entries per side-by-side graph: a dynamic compile's time grows faster than its graph
#: (one graph of 20 AttnRes entries took 56 s, alone at the end of a CI run); groups of
#: this many compile in parallel workers instead (6 per group cost 30 s more in all).
GROUP = 12
GROUPS = {f"{kind}{'-restarts' if restarts else ''}{i // GROUP}": (kind, part[i:i + GROUP])
          for kind, entries in KINDS.items() for restarts in (False, True)
          for part in [[e for e in entries if (e.name in RESTARTS_DYNAMIC) == restarts]]
          for i in range(0, len(part), GROUP)}


@pytest.mark.parametrize("tokens,dynamic", [(1, False), (0, False), (64, True)],
                         ids=["T1", "T0", "T64-dynamic"])
@pytest.mark.parametrize("group", sorted(GROUPS))
def test_entries_compile_at_any_token_count(group, tokens, dynamic):
    """Lowering and codegen for real (``LoweringBackend``) in bf16, the entries with a
    fusion of one kind side by side in one graph per group (one compile per token count;
    the near relatives fuse nothing, so the graph Inductor compiles for them is its own);
    the output equals eager's within bf16 rounding of the fused sums.

    Token counts: decode (1: size-1 dims, its own views and layouts; in the GEMM forms of
    a GPU build under ``mode="max-autotune"``), none (0: zero-size buffers) and any (a
    dynamic T, hinted at 64: lowering on symbolic sizes; in the GEMM forms of a GPU build,
    ``gpu_gemm_forms``). A static
    compile at a general T (it was T = 64 too, until 2026-12-05) is the fused graph of
    ``test_entry_fuses_its_sites_and_is_as_accurate_as_eager`` (T = 5, fp32 and bf16,
    Inductor's passes for real: the same sites by name, no less accurate than eager),
    lowered here at T = 1 and at the dynamic T."""
    kind, entries = GROUPS[group]
    models = [e.build().eval().to(torch.bfloat16) for e in entries]
    args = [e.inputs(tokens, torch.bfloat16) for e in entries]
    module = SideBySide([(m, len(a)) for m, a in zip(models, args)])
    flat = [t for a in args for t in a]
    be = LoweringBackend()
    # The GEMMs a GPU build makes (gpu_gemm_forms). At a dynamic T: pad_mm leaves the
    # symbolic rows alone but pads the static dims, e.g. the einsum mix's 3-9 sources. At
    # T 1: mode="max-autotune"'s, one-row / one-column GEMMs decomposed (the mix's one row
    # of weights, the logits' one column, a decode token's projections), the rest padded.
    # (Torch 2.11 also drops the cast pairs between two such GEMMs, so a rounding the
    # sites' op keeps is gone from its graph and those sites stay unfused: not checked.)
    forms = gpu_gemm_forms(max_autotune=True) if tokens == 1 else gpu_gemm_forms()
    with forms if (tokens == 1 and _TORCH >= (2, 13)) or dynamic else contextlib.nullcontext():
        compiled = torch.compile(module, backend=be, dynamic=dynamic, fullgraph=True)
        with torch.no_grad(), spec_path():
            want, got = module(*flat), compiled(*flat)
    assert be.lowered == be.compiles == 1
    if tokens:  # (at T = 0 Inductor may fold a zero-size chain away before the pass)
        assert k3fusion.match_counts()[kind] == sum(
            e.expected(torch.bfloat16, dynamic)[0][kind] for e in entries)
    for a, b in zip(_flat(got), _flat(want)):
        assert a.shape == b.shape and a.dtype == b.dtype
        scale = b.float().abs().max().item() if b.numel() else 0.0
        torch.testing.assert_close(a.float(), b.float(), rtol=0.05, atol=0.05 * max(scale, 1.0))


#: The groups with projections (the AttnRes groups' padded mixes are the dynamic case of
#: test_entries_compile_at_any_token_count).
GPU_GEMM_GROUPS = sorted(g for g in GROUPS if GROUPS[g][0] != "attn_res")


@pytest.mark.parametrize("group", GPU_GEMM_GROUPS)
def test_entries_fuse_in_a_gpu_builds_gemm_forms(group):
    """The GEMMs a CUDA compile may build (``gpu_gemm_forms``: ``pad_mm``'s zero-padded,
    sliced-back GEMMs; an fp32 ``addmm`` split into ``mm`` + bias add) change nothing the
    passes fuse: each group side by side at T 5 (10 rows, padded to 12), fp32 (the split
    is fp32's; here pad_mm pads fp32 as a GPU does 16-bit GEMMs, and as it does fp32 under
    TF32), compiled through lowering; the counts of the group's fusion, and eager's output
    within bf16 rounding of the fused sums. (On the GPU, before the split add was seen
    through, DeepSeek-V2's biased q/kv pair went unpaired.)"""
    dtype = torch.float32
    kind, entries = GROUPS[group]
    models = [e.build().eval().to(dtype) for e in entries]
    args = [e.inputs(5, dtype) for e in entries]
    module = SideBySide([(m, len(a)) for m, a in zip(models, args)])
    flat = [t for a in args for t in a]
    be = LoweringBackend()
    with gpu_gemm_forms():
        compiled = torch.compile(module, backend=be, fullgraph=True)
        with torch.no_grad(), spec_path():
            want, got = module(*flat), compiled(*flat)
    assert be.lowered == be.compiles == 1
    assert k3fusion.match_counts()[kind] == sum(e.expected(dtype)[0][kind] for e in entries)
    for a, b in zip(_flat(got), _flat(want)):
        assert a.shape == b.shape and a.dtype == b.dtype
        scale = b.float().abs().max().item() if b.numel() else 0.0
        torch.testing.assert_close(a.float(), b.float(), rtol=0.05, atol=0.05 * max(scale, 1.0))


# --------------------------------------------------------------------------- at K3's sizes

#: entry -> (class attributes at K3 size, AttnRes num_blocks fused): K3's block-AttnRes
#: runs up to 8 completed blocks + the prefix (9 sources); a block closes every layer here.
K3_SHAPED = {
    "k3_folded_query": ({"layers": 8, "block": 1}, [k for k in range(1, 9) for _ in (0, 1)]),
    "k3_sequence_first": ({"layers": 8, "block": 1}, [k for k in range(1, 9) for _ in (0, 1)]),
    "k3_flattened_projection": ({"layers": 8, "block": 1},
                                [k for k in range(1, 9) for _ in (0, 1)]),
    "moonshot_readme": ({}, None),
    "vllm_test_reference": ({}, None),
    "hf_deepseek_v3": ({}, None),
    "vllm_fused_projection": ({}, None),
    "sglang_absorb_contiguous": ({}, None),
    "vllm_latent_tail": ({}, None),
    "megatron_bridge_k3_mla": ({}, None),
    "megatron_bridge_k3_tail": ({}, None),
    "torchtitan_k3_latent_moe": ({}, None),
    "automodel_k3_moe": ({}, None),
    "hf_kimi_k3_gated_mla": ({}, None),
    "hf_kimi_k3_moe": ({}, None),
    "hf_kimi_k3_decoder": ({}, None),
}


@pytest.mark.cuda
@pytest.mark.parametrize("name", sorted(K3_SHAPED))
def test_k3_shaped_entry_compiled_for_real_on_cuda(name, monkeypatch):
    """The K3-shaped entries at K3's widths (H 7168, q 1536, kv 512 of 576, latent 3584,
    up to 9 sources), bf16 on the GPU, compiled with ``backend="k3fusion"`` (Inductor for
    real, the Triton kernels): the exact sites, and no less accurate than eager against an
    fp64 copy. ``CATALOGUE_REPORT=path`` appends one JSON line per entry."""
    import json
    import os

    import public_catalogue as cat

    for attr, value in dict(H=7168, Q_LORA=1536, KV_LORA=512, ROPE=64, LATENT=3584).items():
        monkeypatch.setattr(cat, attr, value)
    entry = cat.BY_NAME[name]
    sizes, blocks = K3_SHAPED[name]
    for attr, value in sizes.items():
        monkeypatch.setattr(entry.build, attr, value)
    with torch.device("cuda"):
        model = entry.build().eval()
    ref_model = copy.deepcopy(model).double()
    model = model.to(torch.bfloat16)
    args = entry.inputs(64, torch.bfloat16, device="cuda")
    with torch.no_grad():
        ref = ref_model(*(a.double() for a in args))
        del ref_model
        eager = model(*args)
        out = torch.compile(model, backend="k3fusion", fullgraph=True)(*args)
    counts = _fused_counts(entry)
    want = dict(entry.expected(torch.bfloat16)[0])
    if blocks is not None:
        want["attn_res"] = len(blocks)
    e_max, e_mean = _errors(eager, ref)
    c_max, c_mean = _errors(out, ref)
    report = dict(entry=name, counts=counts, eager_max=e_max, eager_mean=e_mean,
                  k3fusion_max=c_max, k3fusion_mean=c_mean,
                  torch=torch.__version__, gpu=torch.cuda.get_device_name())
    if os.environ.get("CATALOGUE_REPORT"):
        with open(os.environ["CATALOGUE_REPORT"], "a") as f:
            f.write(json.dumps(report) + "\n")
    assert_counts(entry, counts, want, model, args, report)
    assert_as_accurate_as_eager(out, eager, ref, torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype,tokens", [(torch.bfloat16, 1), (torch.bfloat16, 33),
                                          (torch.float32, 33)], ids=["bf16-T1", "bf16-T33", "fp32-T33"])
@pytest.mark.parametrize("entry", ENTRIES, ids=[e.name for e in ENTRIES])
def test_every_entry_compiled_for_real_on_cuda(entry, dtype, tokens):
    """Every entry at test sizes on the GPU through ``backend="k3fusion"``: Inductor's CUDA
    graph (its online softmax, its own decompositions), the Triton kernels for real. The
    counts of the CPU test, and no less accurate than eager against an fp64 copy (the CPU
    test's bounds)."""
    _check_compiled_on_cuda(entry, dtype, tokens, entry.expected(dtype)[0])


def _check_compiled_on_cuda(entry: Entry, dtype: torch.dtype, tokens: int, want: dict,
                            **compile_kw) -> None:
    """``entry`` compiled with ``backend="k3fusion"`` (and ``compile_kw``) on the GPU:
    fused ``want``, no less accurate than eager over ``CUDA_ACCURACY_SEEDS``."""
    with torch.device("cuda"):
        model = entry.build().eval()
    ref_model = copy.deepcopy(model).double()
    model = model.to(dtype)
    compiled = torch.compile(model, backend="k3fusion", fullgraph=True, **compile_kw)
    ref, eager, out = [], [], []
    with torch.no_grad():
        for seed in CUDA_ACCURACY_SEEDS:  # one compile, the errors pooled (as on the CPU)
            args = entry.inputs(tokens, dtype, device="cuda", seed=seed)
            ref.append(ref_model(*(a.double() for a in args)))
            eager.append(model(*args))
            out.append(compiled(*args))
    del ref_model
    assert_counts(entry, _fused_counts(entry), want, model, args)
    assert_as_accurate_as_eager(out, eager, ref, dtype)


#: Torch before 2.13 drops a cast pair (``pointless_convert``) between two of the GEMMs
#: that ``mode="max-autotune"`` decomposes, and with it a rounding the sites' op keeps:
#: these sites stay unfused there (counts of ``tests/fake_cuda_graphs.py all bfloat16 1
#: --max-autotune --no-fold`` on torch 2.11; docs/testing.md).
MAX_AUTOTUNE_TORCH_2_11 = {
    "k3_folded_query": {"attn_res": 1},
    "sglang_absorb_contiguous": {"qkv_rmsnorm": 0},
    "vllm_minicpm3": {"qkv_rmsnorm": 0},
    "torchtitan_deepseek_v3": {"qkv_rmsnorm": 0},
    "sglang_latent_add3": {"moe_tail": 0},
    "torchtitan_k3_latent_moe": {"moe_tail": 0},
}


@pytest.mark.cuda
@pytest.mark.parametrize("entry", ENTRIES, ids=[e.name for e in ENTRIES])
def test_every_entry_compiled_for_real_on_cuda_in_max_autotune(entry):
    """A decode token (T 1, bf16) through ``mode="max-autotune-no-cudagraphs"`` on the GPU:
    coordinate-descent tuning's decomposed one-row / one-column GEMMs, the GEMM templates
    and ``pad_mm`` as its benchmark decides; what ``gpu_gemm_forms(max_autotune=True)``
    emulates on the CPU. Every site fuses (on older torch, as ``MAX_AUTOTUNE_TORCH_2_11``),
    no less accurate than eager."""
    want = dict(entry.expected(torch.bfloat16)[0])
    if _TORCH < (2, 13):
        want.update(MAX_AUTOTUNE_TORCH_2_11.get(entry.name, {}))
    _check_compiled_on_cuda(entry, torch.bfloat16, 1, want, mode="max-autotune-no-cudagraphs")
