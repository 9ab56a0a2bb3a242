"""``patch_model`` never serves a result for another tensor or another value.

A patched module must equal the original for every call sequence a forward can make:
in-place writes to ``h``, ``q_c`` or ``kv_c`` between the calls, frees and new tensors at
a freed address, unrelated inputs, AttnRes list banks edited or re-allocated between
steps. Everything here runs the ops' CPU reference path, so "equal" means bit for bit.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from _kernel_paths import cpu_path
from k3fusion.eager import patch_model
from k3fusion.models import KimiK3RMSNorm
from k3fusion.models.kimi_k3 import AttnResStep

H, Q, KV, KV_LORA = 32, 24, 20, 16


class ExactAttnRes(nn.Module):
    """An AttnRes mix written as the paper states it (fp32 keys and mix), in the same op
    order as ``k3fusion.reference.attn_res``: the fused step equals it bit for bit."""

    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.norm = KimiK3RMSNorm(hidden, eps)
        self.proj = nn.Linear(hidden, 1, bias=False)

    def forward(self, sources: torch.Tensor) -> torch.Tensor:
        s = sources.float()
        inv_rms = torch.rsqrt(s.pow(2).mean(-1) + self.norm.variance_epsilon)
        logits = inv_rms * (s * self.norm.weight.float() * self.proj.weight.view(-1).float()).sum(-1)
        weights = torch.softmax(logits, dim=-1)
        return (weights.unsqueeze(-1) * s).sum(-2).to(sources.dtype)


class ToyMLA(AttnResStep, nn.Module):
    """The four MLA children patch_model fuses, plus an AttnRes site (``apply_attn_res``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q_a_proj = nn.Linear(H, Q, bias=False)
        self.q_a_layernorm = KimiK3RMSNorm(Q)
        self.kv_a_proj_with_mqa = nn.Linear(H, KV, bias=False)
        self.kv_a_layernorm = KimiK3RMSNorm(KV_LORA)
        self.res = ExactAttnRes(H)
        with torch.no_grad():
            for norm in (self.q_a_layernorm, self.kv_a_layernorm, self.res.norm):
                norm.weight.uniform_(0.5, 1.5)

    def forward(self, h, edit=None):
        """DeepSeek-style MLA prologue; ``edit(name, tensor)`` may write in place."""
        q_c = self.q_a_proj(h)
        edit and edit("q_c", q_c)
        q = self.q_a_layernorm(q_c)
        edit and edit("h", h)
        kv_c, k_pe = self.kv_a_proj_with_mqa(h).split([KV_LORA, KV - KV_LORA], dim=-1)
        edit and edit("kv_c", kv_c)
        return q, self.kv_a_layernorm(kv_c), k_pe


def _pair():
    ref = ToyMLA()
    pat = copy.deepcopy(ref)
    report = patch_model(pat)
    assert report.patched == ["apply_attn_res", ""], report
    return ref, pat


def _assert_equal(got, want):
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g, w), f"max diff {(g.float() - w.float()).abs().max()}"


# ------------------------------------------------------------------ the issue repros


@pytest.mark.parametrize("target", ["h", "q_c", "kv_c"])
def test_in_place_edit_between_the_calls_is_seen(target):
    """Issue 16 item 1 (``h``), issue 21 item 1 (``kv_c``), and ``q_c``: a write between the
    prefetch and the call that would take its result makes that call run the module."""

    def edit(name, t):
        if name == target:
            t.add_(1.0)

    ref, pat = _pair()
    h = torch.randn(5, H)
    with torch.no_grad(), cpu_path("reference"):
        want = ref(h.clone(), edit)
        got = pat(h.clone(), edit)
        plain = pat(h.clone())  # the next, unedited call fuses again
    _assert_equal(got, want)
    _assert_equal(plain, ref(h.clone()))


def test_a_new_tensor_at_a_freed_address_is_not_served():
    """Issue 16 item 2: ``q_c`` freed, a new tensor at its address (version 0, other
    values) goes to the q norm: the module's result, not the stashed one. The new tensor
    is made at the same address deterministically, through numpy."""
    ref, pat = _pair()
    h = torch.randn(4, H)
    with torch.no_grad(), cpu_path("reference"):
        q_c = pat.q_a_proj(h)
        arr = q_c.numpy()
        ptr = q_c.data_ptr()
        del q_c
        x = torch.from_numpy(arr)  # another tensor, same address, version 0
        arr[:] = np.random.default_rng(0).standard_normal(arr.shape, dtype=np.float32)
        assert x.data_ptr() == ptr and x._version == 0
        _assert_equal([pat.q_a_layernorm(x)], [ref.q_a_layernorm(x)])


def test_kv_norm_on_an_unrelated_tensor_runs_the_module():
    """Issue 21 item 1: after ``q_a_proj``, ``kv_a_layernorm`` of another tensor (even one
    of kv_c's shape and layout) is that tensor's norm; the step's own kv_c still fuses."""
    ref, pat = _pair()
    h = torch.randn(3, H)
    other = torch.randn(3, KV)[:, :KV_LORA]
    with torch.no_grad(), cpu_path("reference"):
        pat.q_a_proj(h)
        _assert_equal([pat.kv_a_layernorm(other)], [ref.kv_a_layernorm(other)])
        q_c = pat.q_a_proj(h)
        q = pat.q_a_layernorm(q_c)
        kv_c = pat.kv_a_proj_with_mqa(h)[:, :KV_LORA]
        _assert_equal([q, pat.kv_a_layernorm(kv_c)],
                      [ref.q_a_layernorm(q_c), ref.kv_a_layernorm(kv_c)])


def test_each_result_is_handed_out_once():
    """Two calls the module would answer with two new tensors never get one shared one."""
    _, pat = _pair()
    h = torch.randn(2, H)
    with torch.no_grad(), cpu_path("reference"):
        q_c = pat.q_a_proj(h)
        a, b = pat.q_a_layernorm(q_c), pat.q_a_layernorm(q_c)
        kv1, kv2 = pat.kv_a_proj_with_mqa(h), pat.kv_a_proj_with_mqa(h)
    assert a.data_ptr() != b.data_ptr() and kv1.data_ptr() != kv2.data_ptr()
    assert torch.equal(a, b) and torch.equal(kv1, kv2)


def test_changed_weights_are_seen():
    """A weight written in place, or swapped, between the prefetch and the call."""
    ref, pat = _pair()
    h = torch.randn(3, H)
    with torch.no_grad(), cpu_path("reference"):
        for m in (ref, pat):
            q_c = m.q_a_proj(h)
            m.kv_a_proj_with_mqa.weight.mul_(2)
            m.q_a_layernorm.weight = nn.Parameter(m.q_a_layernorm.weight * 3)
            kv = m.kv_a_proj_with_mqa(h)
            m.results = (m.q_a_layernorm(q_c), kv, m.kv_a_layernorm(kv[:, :KV_LORA]))
    _assert_equal(pat.results, ref.results)


def test_inference_mode_runs_the_modules():
    """Inference tensors keep no version counter: nothing is prefetched (and nothing
    raises, as it did when the stash read ``_version``)."""
    ref, pat = _pair()

    def edit(name, t):
        if name == "h":
            t.add_(1.0)

    with torch.inference_mode(), cpu_path("reference"):
        h = torch.randn(3, H)
        _assert_equal(pat(h.clone(), edit), ref(h.clone(), edit))
        _assert_equal(pat(h), ref(h))


def _bank(n):
    return [torch.randn(4, H) for _ in range(n)]


def test_list_bank_edited_in_place_between_steps():
    """Issue 21 item 3: call, edit a block in place, call: the stack is rebuilt."""
    ref, pat = _pair()
    bank0, prefix = _bank(2), torch.randn(4, H)
    with torch.no_grad(), cpu_path("reference"):
        for m in (pat, ref):
            bank = [b.clone() for b in bank0]
            first = m.apply_attn_res(prefix, bank, m.res, 2)[0]
            bank[1].mul_(-3)
            m.results = first, m.apply_attn_res(prefix, bank, m.res, 2)[0]
    _assert_equal(pat.results, ref.results)


def test_list_bank_block_freed_and_reallocated_between_steps():
    """Issue 21 item 3: call, free a block, a new block at its address (same version),
    call: not the cached stack of the old blocks."""
    ref, pat = _pair()
    bank, prefix = _bank(2), torch.randn(4, H)
    with torch.no_grad(), cpu_path("reference"):
        pat.apply_attn_res(prefix, bank, pat.res, 2)
        arr = bank[1].numpy()
        ptr, version = bank[1].data_ptr(), bank[1]._version
        bank[1] = torch.from_numpy(arr)
        arr[:] = np.random.default_rng(1).standard_normal(arr.shape, dtype=np.float32)
        assert bank[1].data_ptr() == ptr and bank[1]._version == version
        got = pat.apply_attn_res(prefix, bank, pat.res, 2)[0]
        want = ref.apply_attn_res(prefix, bank, ref.res, 2)[0]
    _assert_equal([got], [want])


# ------------------------------------------------------------------ call sequences

_OPS = ("edit", "realloc", "reuse", "free", "h", "q_proj", "kv_proj", "q_norm", "kv_norm",
        "attn_res", "attn_res_tensor_bank")
_WIDTH = {"q": Q, "h0": H, "kv": KV, "out": H, "h1": H, "qn": Q, "kvn": KV_LORA}
_NAMES = tuple(_WIDTH)


class _Run:
    """Runs one drawn call sequence on a model; every op's result is recorded (cloned).

    The pool holds what a forward holds: two hidden states, the projections and norms
    (the latest of each), an AttnRes output; ops act on pool entries by name."""

    def __init__(self, model, T):
        self.m, self.T, self.pool, self.seen = model, T, {}, []
        self.bank = torch.zeros(T, 3, H)

    def _rand(self, width, seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(self.T, width, generator=g)

    def _hidden(self):
        return [self.pool[n] for n in ("h0", "h1", "out") if n in self.pool]

    def step(self, op, i, name, c, seed):
        m, pool = self.m, self.pool
        h = pool.get(("h0", "h1")[i])
        out = None
        if op == "h":
            out = pool[("h0", "h1")[i]] = self._rand(H, seed)
        elif op == "q_proj" and h is not None:
            out = pool["q"] = m.q_a_proj(h)
        elif op == "kv_proj" and h is not None:
            out = pool["kv"] = m.kv_a_proj_with_mqa(h)
        elif op == "q_norm" and "q" in pool:
            out = pool["qn"] = m.q_a_layernorm(pool["q"])
        elif op == "kv_norm" and "kv" in pool:
            kv_c, _ = pool["kv"].split([KV_LORA, KV - KV_LORA], dim=-1)
            out = pool["kvn"] = m.kv_a_layernorm(kv_c)
        elif op == "edit" and name in pool:
            x = pool[name]
            [lambda: x.add_(0.5), lambda: x[..., : 1 + c % x.shape[-1]].mul_(-2.0),
             lambda: x[: 1 + c % self.T].sub_(1.0)][c % 3]()
            out = x
        elif op == "free":
            pool.pop(name, None)  # freed now (reference counting), unless the model holds it
        elif op == "realloc":
            # Free the entry, then a new tensor (version 0) of its size: the allocator
            # often puts it at the freed address.
            pool.pop(name, None)
            src = pool.get(("h0", "h1")[i]) if _WIDTH[name] == H else None
            out = pool[name] = src * 2.0 if src is not None and c % 2 else self._rand(_WIDTH[name], seed)
        elif op == "reuse" and name in pool:
            # The same, at the freed address for sure: a new tensor over the old memory.
            arr = pool.pop(name).contiguous().numpy()
            arr[...] = self._rand(arr.shape[-1], seed).numpy()
            out = pool[name] = torch.from_numpy(arr)
        elif op == "attn_res" and self._hidden():
            hs = self._hidden()
            prefix, blocks = hs[i % len(hs)], hs[: c % min(3, len(hs) + 1)]
            delta = hs[(i + 1) % len(hs)] if c % 2 else None
            idx = len(blocks) if c % 4 >= 2 else -1
            res, new_prefix, new_bank = m.apply_attn_res(
                prefix, blocks, m.res, len(blocks), delta=delta, block_write_idx=idx)
            out = pool["out"] = res
            self.seen += [new_prefix.clone(), torch.stack(new_bank or [res])]
        elif op == "attn_res_tensor_bank" and self._hidden():
            x = self._hidden()[i % len(self._hidden())]
            nb = c % 3
            self.bank[:, nb].copy_(x)
            prefix = self.bank[:, seed % 3] if c % 5 == 0 else x
            idx = -1 if nb == 2 or c % 3 == 0 else nb + 1
            out = pool["out"] = m.apply_attn_res(prefix, self.bank, m.res, nb, block_write_idx=idx)[0]
            self.seen.append(self.bank.clone())
        self.seen.append(None if out is None else out.clone())


_SKELETON = ("q_proj", "q_norm", "kv_proj", "kv_norm")  # a forward's order
_READS = {"q_proj": "h", "kv_proj": "h", "q_norm": "q", "kv_norm": "kv"}
# Weighted towards what breaks a cache: writes, frees and new tensors, often of the very
# tensor the next call reads ("next").
_op = st.tuples(st.sampled_from(_OPS + ("edit", "realloc", "reuse")), st.integers(0, 1),
                st.sampled_from(("next",) * 3 + _NAMES), st.integers(0, 59),
                st.integers(0, 2**16))


@st.composite
def _forward(draw):
    """A forward's four calls (usually in a forward's order) with random calls, in-place
    edits, frees and new tensors before each of them and after the last."""
    order = draw(st.one_of(st.just(_SKELETON), st.permutations(_SKELETON)))
    i = draw(st.integers(0, 1))
    extras = draw(st.lists(st.lists(_op, max_size=2), min_size=5, max_size=5))
    ops = []
    for step, before in zip(order, extras):
        reads = _READS[step] if _READS[step] != "h" else ("h0", "h1")[i]
        ops += [(op, j, reads if name == "next" else name, c, seed)
                for op, j, name, c, seed in before] + [(step, i, reads, 0, 0)]
    return ops + [(op, j, "q" if name == "next" else name, c, seed)
                  for op, j, name, c, seed in extras[-1]]


@settings(max_examples=60, derandomize=True, deadline=None)
@given(T=st.sampled_from([1, 3, 16]), forwards=st.lists(_forward(), min_size=1, max_size=2))
def test_patched_module_equals_the_original_for_any_call_sequence(T, forwards):
    ops = [op for fwd in forwards for op in [("h", 0, "h0", 0, 1), ("h", 1, "h1", 0, 2)] + fwd]
    ref, pat = _pair()
    runs = []
    with torch.no_grad(), cpu_path("reference"):
        for model in (ref, pat):
            run = _Run(model, T)
            for op in ops:
                run.step(*op)
            runs.append(run)
    want, got = runs[0].seen, runs[1].seen
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert (g is None) == (w is None), f"result {i}"
        if g is not None:
            assert torch.equal(g, w), f"result {i}: max diff {(g - w).abs().max()}"


# ------------------------------------------------------------------ training


class _CountCalls(TorchDispatchMode):
    """Dispatcher calls of each of ``ops``."""

    def __init__(self, *ops) -> None:
        super().__init__()
        self.calls = dict.fromkeys(ops, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.calls:
            self.calls[func] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("path", ["reference", "kernel"])
@pytest.mark.parametrize("bank, dtype", [("list", torch.float32), ("tensor", torch.float32),
                                         ("tensor", torch.bfloat16), ("list", torch.bfloat16)])
def test_patched_model_trains_like_the_original(bank, dtype, path):
    """Issue 16 item 5, issue 28: with grad on and parameters that require grad, the q/kv
    pair and every AttnRes step run their fused ops (the functional AttnRes op, whose
    backward is the fused kernel where the kernels run: ``kernel``, the interpreter) and
    the tail the original modules. Every parameter's gradient within the model-level
    bound against an fp64 copy (at most 2x the original's max error + 2 ulps of the
    gradient's size), the loss within 2 ulps of the original's. Under no_grad it fuses
    too."""
    from k3fusion.models import KimiK3Config, KimiK3ForCausalLM
    from k3fusion.models.kimi_k3 import count_attn_res_sites
    from test_eager import DUAL
    from _tolerances import ulp

    ops = torch.ops.k3fusion
    cfg = KimiK3Config.tiny(dtype=dtype, attn_res=True, attn_res_bank=bank,
                            attn_res_block_size=1, latent_moe=True, num_layers=2)
    ref = KimiK3ForCausalLM(cfg, seed=5).train()
    exact = copy.deepcopy(ref).double()
    pat = copy.deepcopy(ref)
    patch_model(pat)
    ids = torch.randint(0, cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(4))
    exact(ids).double().square().mean().backward()
    losses = []
    with cpu_path(path):
        for m in (ref, pat):
            with _CountCalls(DUAL, ops.attn_res.default, ops.attn_res_backward.default) as seen:
                loss = m(ids).float().square().mean()
                loss.backward()
            losses.append(loss.detach())
        with torch.no_grad(), _CountCalls(DUAL, ops.attn_res_.default,
                                          ops.attn_res.default) as fused:
            pat(ids)
    sites = count_attn_res_sites(pat)
    assert seen.calls[DUAL] == cfg.num_layers  # the patched model's call
    assert seen.calls[ops.attn_res.default] == sites
    assert seen.calls[ops.attn_res_backward.default] == (sites if path == "kernel" else 0)
    assert abs(float(losses[1] - losses[0])) <= 2 * float(ulp(losses[0].abs(), dtype))
    for (name, p), q, e in zip(ref.named_parameters(), pat.parameters(), exact.parameters(),
                               strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is None:
            continue
        bound = (2 * float((p.grad.double() - e.grad).abs().max())
                 + 2 * float(ulp(e.grad.abs().max(), dtype)))
        assert float((q.grad.double() - e.grad).abs().max()) <= bound, name
    assert fused.calls[DUAL] == cfg.num_layers
    assert fused.calls[ops.attn_res_.default] + fused.calls[ops.attn_res.default] == sites


class _CastThenWeight(nn.Module):
    """HF's spelling: normalize in fp32, cast, then weight (``weight_in_fp32``: weight in
    fp32, then cast)."""

    def __init__(self, n: int, weight_in_fp32: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.variance_epsilon, self.weight_in_fp32 = 1e-6, weight_in_fp32

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight.float() * x).to(dtype) if self.weight_in_fp32 else \
            self.weight * x.to(dtype)


class _MlaPair(nn.Module):
    def __init__(self, norm) -> None:
        super().__init__()
        self.q_a_proj = nn.Linear(32, 24, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(32, 20, bias=False)  # kv 16 of 20
        self.q_a_layernorm, self.kv_a_layernorm = norm(24), norm(16)
        with torch.no_grad():
            for m in (self.q_a_layernorm, self.kv_a_layernorm):
                m.weight.add_(0.1 * torch.randn_like(m.weight))

    def forward(self, h):
        kv = self.kv_a_proj_with_mqa(h)
        return (self.q_a_layernorm(self.q_a_proj(h)).sum(-1)
                + 1.5 * self.kv_a_layernorm(kv[..., :16]).sum(-1) + kv[..., 16:].sum(-1))


_NORMS = {"torch_rmsnorm": lambda n: nn.RMSNorm(n, eps=1e-6),
          "cast_then_weight": lambda n: _CastThenWeight(n, False),
          "weight_in_fp32": lambda n: _CastThenWeight(n, True)}


@pytest.mark.parametrize("path", ["reference", "kernel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm", list(_NORMS))
def test_qkv_pair_fused_under_grad_gives_the_original_gradients(norm, dtype, path):
    """Issue 28: the patched q/kv pair runs fused while autograd records; its backward (the
    reference formula's, recomputed from the saved inputs) gives every parameter the
    original modules' gradient bit for bit, for each norm formulation the probe accepts.
    The loss is linear in the output, so the forward's kernel rounding (``kernel``: the
    Triton kernel in the interpreter) does not reach the gradients; on the reference path
    the output is bit for bit too."""
    from test_eager import DUAL, CountOps

    torch.manual_seed(0)
    ref = _MlaPair(_NORMS[norm]).to(dtype)
    pat = copy.deepcopy(ref)
    assert patch_model(pat).patched
    h = torch.randn(3, 5, 32, dtype=dtype)
    outs = []
    with cpu_path(path):
        for m in (ref, pat):
            with CountOps(DUAL) as fused:
                out = m(h)
            (out.float() * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
            outs.append(out.detach())
    assert fused.calls == 1  # the patched model's call
    if path == "reference":
        assert torch.equal(outs[0], outs[1])
    for (name, p), q in zip(ref.named_parameters(), pat.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def test_torch_func_transforms_run_the_original_modules():
    """Under ``torch.func.grad`` and ``torch.vmap`` the patched modules run the original
    ones (the fused path's norm probe and ops do not work on the transforms' wrapped
    tensors): results and gradients bit for bit the unpatched model's. Before, a patched
    model raised under both."""
    from k3fusion.models import KimiK3Config, KimiK3ForCausalLM

    cfg = KimiK3Config.tiny(dtype=torch.float32, attn_res=True, attn_res_bank="list",
                            attn_res_block_size=1, latent_moe=True, num_layers=2)
    ref = KimiK3ForCausalLM(cfg, seed=5)
    pat = copy.deepcopy(ref)
    patch_model(pat)
    ids = torch.randint(0, cfg.vocab_size, (3, 2, 5), generator=torch.Generator().manual_seed(4))
    params = {k: v.detach() for k, v in ref.named_parameters()}
    results = []
    for m in (ref, pat):
        grads = torch.func.grad(
            lambda p, m=m: torch.func.functional_call(m, p, (ids[0],)).square().mean())(params)
        with torch.no_grad():
            batched = torch.vmap(m)(ids)
        results.append((grads, batched))
    (g_ref, b_ref), (g_pat, b_pat) = results
    assert torch.equal(b_ref, b_pat)
    assert g_ref.keys() == g_pat.keys()
    for name in g_ref:
        assert torch.equal(g_ref[name], g_pat[name]), name
