"""RMSNorm as other people write it, with one structural mutation applied, for the fusion
mutation tests (``test_qkv_mutations.py``, ``test_moe_tail_mutations.py``).

Spellings (public code, not this repo's model):

* ``"hf"``: HF ``DeepseekV3RMSNorm`` / Kimi MLA: ``hidden_states.to(float32)``,
  ``variance = pow(2).mean(-1, keepdim=True)``, ``x * rsqrt(variance + eps)``,
  ``weight * x.to(input_dtype)``;
* ``"vllm"``: vLLM ``RMSNorm.forward_native``: the same, weight on the right;
* ``"f_rms_norm"``: ``F.rms_norm(x, (D,), weight, eps)``;
* ``"nn_rmsnorm"``: an ``nn.RMSNorm`` module.

Mutations inside the norm (only the written-out spellings can take them) each say whether
the result is still the RMSNorm the fused ops compute (``NORM_MUTATIONS``: True = same
function, a fusion must take it; False = another function, never fused; None = the same
function in a spelling the matcher does not read: a miss is allowed, a wrong result not).
``"cast_other_dtype"`` (the normalized row cast to another dtype than the input's) is
classified by each test: an fp32 input cast to 16 bits is the ops' ``norm_dtype`` form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SPELLINGS = ("hf", "vllm", "f_rms_norm", "nn_rmsnorm")
WRITTEN = ("hf", "vllm")

#: mutation -> (still the op's RMSNorm?, what it is)
NORM_MUTATIONS: dict[str, tuple[bool, str]] = {
    "none": (True, "the spelling as published"),
    "other_eps": (True, "another eps (per norm)"),
    "square_by_mul": (True, "x32 * x32 instead of pow(2)"),
    "gemma": (False, "Gemma's weight (1 + w)"),
    "mean_other_dim": (False, "the mean over dim -2"),
    "no_keepdim": (None, "the mean without keepdim, unsqueezed back (same function)"),
    "eps_outside_sqrt": (False, "rsqrt(variance) + eps"),
    # the RMSNorm classes written from scratch: x / torch.sqrt(torch.mean(x ** 2, ...) + eps)
    "div_by_sqrt": (True, "x / sqrt(variance + eps) instead of x * rsqrt(...)"),
    "div_by_sqrt_eps_outside": (False, "x / (sqrt(variance) + eps)"),
    "bias_inside": (False, "a bias added to the normalized row before the weight"),
    "temperature": (False, "the normalized row scaled by a constant"),
    "weight_other_dim": (False, "a weight broadcast over the token dim ([T, 1])"),
    "layernorm": (False, "LayerNorm (mean subtracted) instead of RMSNorm"),
    "square_of_other": (False, "the variance of another tensor (x + 1)"),
    "cast_other_dtype": (None, "the normalized row cast to another dtype (see above)"),
}


def applicable(mutation: str) -> tuple[str, ...]:
    """Spellings a norm mutation can be written into."""
    if mutation in ("none", "other_eps", "layernorm"):
        return SPELLINGS
    return WRITTEN


class Norm(nn.Module):
    """An RMSNorm over the last dim in ``spelling``, with ``mutation`` applied; ``leak``:
    keep the fp32 normalized row in ``self.leaked`` (an intermediate read elsewhere)."""

    def __init__(self, width: int, spelling: str, mutation: str = "none", *, eps=1e-6,
                 dtype=torch.float32, weight_dtype=None, tokens: int = 1, seed: int = 0):
        super().__init__()
        if spelling not in applicable(mutation):
            raise ValueError(f"{mutation} cannot be written in {spelling}")
        g = torch.Generator().manual_seed(seed)
        self.spelling, self.mutation = spelling, mutation
        self.eps = 1e-5 if mutation == "other_eps" else eps
        w = (1 + 0.2 * torch.randn(width, generator=g)).to(weight_dtype or dtype)
        if spelling == "nn_rmsnorm" and mutation != "layernorm":
            self.mod = nn.RMSNorm(width, eps=self.eps, dtype=w.dtype)
            with torch.no_grad():
                self.mod.weight.copy_(w)
        else:
            self.weight = nn.Parameter(w)
        if mutation == "bias_inside":
            self.bias = nn.Parameter(0.1 * torch.randn(width, generator=g))
        if mutation == "weight_other_dim":
            self.weight = nn.Parameter((1 + 0.2 * torch.randn(tokens, 1, generator=g)).to(w.dtype))
        self.leak = False
        self.leaked = None

    def forward(self, x):
        m = self.mutation
        if m == "layernorm":
            w = self.weight
            return F.layer_norm(x, (x.shape[-1],), w, None, self.eps)
        if self.spelling == "f_rms_norm":
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        if self.spelling == "nn_rmsnorm":
            return self.mod(x)
        input_dtype = x.dtype
        hidden_states = x.to(torch.float32)
        if m == "square_by_mul":
            variance = (hidden_states * hidden_states).mean(-1, keepdim=True)
        elif m == "mean_other_dim":
            variance = hidden_states.pow(2).mean(-2, keepdim=True)
        elif m == "no_keepdim":
            variance = hidden_states.pow(2).mean(-1)
        elif m == "square_of_other":
            variance = (hidden_states + 1).pow(2).mean(-1, keepdim=True)
        else:
            variance = hidden_states.pow(2).mean(-1, keepdim=True)
        if m == "eps_outside_sqrt":
            hidden_states = hidden_states * (torch.rsqrt(variance) + self.eps)
        elif m == "div_by_sqrt":
            hidden_states = hidden_states / torch.sqrt(variance + self.eps)
        elif m == "div_by_sqrt_eps_outside":
            hidden_states = hidden_states / (torch.sqrt(variance) + self.eps)
        elif m == "no_keepdim":
            hidden_states = hidden_states * torch.rsqrt(variance + self.eps).unsqueeze(-1)
        else:
            hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
        if m == "bias_inside":
            hidden_states = hidden_states + self.bias
        if m == "temperature":
            hidden_states = hidden_states * 0.5
        if self.leak:
            self.leaked = hidden_states
        weight = 1 + self.weight if m == "gemma" else self.weight
        if m == "cast_other_dtype":
            input_dtype = torch.float16 if input_dtype == torch.bfloat16 else torch.bfloat16
        if self.spelling == "hf":
            return weight * hidden_states.to(input_dtype)
        return hidden_states.to(input_dtype) * weight  # vllm forward_native
