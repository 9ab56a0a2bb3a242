"""Block / Full AttnRes written as public code writes it (issue 15), for the spelling tests.

The layer loop follows MoonshotAI's Attention-Residuals README: a ``blocks`` list appended
at block boundaries, a ``partial_block`` that restarts as ``None`` there, ``partial_block +
attn_out`` / ``+ mlp_out``, the sublayers behind their pre-norms. Only the AttnRes step
(``res``) changes between spellings; the sublayers are small stand-ins (a Linear + tanh for
attention, a SiLU MLP), since only the residual stream matters to the pass.

Spellings of the step (``SPELLINGS``):

* ``official``: ``V = torch.stack(blocks + [partial_block])`` (sources first, [N+1, B, T, D]),
  ``K = norm(V)`` (an RMSNorm module), logits ``einsum('d, n b t d -> n b t',
  proj.weight.squeeze(), K)``, ``einsum('n b t, n b t d -> b t d', logits.softmax(0), V)``;
* ``linear``: logits ``proj(K).squeeze(-1)``, ``F.softmax(logits, dim=0)``;
* ``query``: a pseudo-query row ``q[site]`` of a ``[sites, D]`` parameter, ``nn.RMSNorm``,
  logits minus their max, ``torch.softmax(..., 0)``;
* ``functional``: ``F.rms_norm(V, (D,))`` without weight, the mix in fp32 cast back;
* ``sources_last``: ``torch.stack(..., dim=-2)``, ``Linear`` squeezed, ``.float().softmax(-1)``,
  ``(w.unsqueeze(-1) * V).sum(-2)`` (this repo's own form);
* ``bank``: a preallocated sources-first bank ``[max_blocks + 1, B, T, D]``, written
  ``bank[n] = partial_block`` and read ``bank[:n + 1]``;
* ``full``: Full AttnRes: every sublayer output is a source (up to 2 x layers + 1);
* ``movedim``: the official stack moved to sources-last, ``torch.stack(blocks +
  [partial_block]).movedim(0, -2)``, then the sources-last step;
* ``matvec``: logits ``K @ proj.weight.squeeze()`` (matmul with a vector: torch lowers it
  to the keys flattened to rows, ``(rows * q).sum(1)`` in fp32, viewed back), the mix
  ``(w.unsqueeze(-1) * V).sum(0)``;
* ``scratch``: the official step with the parameter-free key norm community ports write
  from scratch, ``x / torch.sqrt(torch.mean(x ** 2, dim=-1, keepdim=True) + eps)`` (here
  on the fp32 upcast, cast back).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SPELLINGS = ("official", "linear", "query", "functional", "sources_last", "bank", "full",
             "matvec", "movedim", "scratch")


class RMSNorm(nn.Module):
    """The common module form (upcast, normalize, cast back, weight)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Layer(nn.Module):
    def __init__(self, dim: int, spelling: str) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(dim), RMSNorm(dim)
        self.attn = nn.Linear(dim, dim, bias=False)
        self.up, self.down = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(2 * dim, dim, bias=False)
        norm = nn.RMSNorm if spelling == "query" else RMSNorm
        self.attn_res_norm, self.mlp_res_norm = norm(dim, eps=1e-6), norm(dim, eps=1e-6)
        self.attn_res_proj = nn.Linear(dim, 1, bias=False)
        self.mlp_res_proj = nn.Linear(dim, 1, bias=False)

    def attention(self, x):
        return torch.tanh(self.attn(self.attn_norm(x)))

    def mlp(self, x):
        return self.down(F.silu(self.up(self.mlp_norm(x))))


class AttnResModel(nn.Module):
    """``layers`` layers, a block boundary every ``block_size // 2`` layers (block_size
    counts sublayers, as in the README), a final AttnRes step and norm."""

    def __init__(self, spelling: str, dim: int = 32, layers: int = 5, block_size: int = 2,
                 seed: int = 0) -> None:
        super().__init__()
        assert spelling in SPELLINGS, spelling
        torch.manual_seed(seed)
        self.spelling, self.block_size = spelling, block_size
        self.layers = nn.ModuleList(Layer(dim, spelling) for _ in range(layers))
        self.final_res_norm = RMSNorm(dim)
        self.final_res_proj = nn.Linear(dim, 1, bias=False)
        self.final_norm = RMSNorm(dim)
        self.query = nn.Parameter(torch.randn(2 * layers + 1, dim) / dim ** 0.5)
        with torch.no_grad():  # logits of std ~1 across sources; weights off 1
            for p in self.parameters():
                if p.dim() == 1:
                    p.add_(0.1 * torch.randn_like(p))
                elif p.shape[0] == 1:
                    p.mul_(3.0)

    # ------------------------------------------------------------------ the AttnRes step

    def res(self, blocks, partial_block, proj, norm, site: int):
        s = self.spelling
        if s in ("sources_last", "movedim"):
            if s == "movedim":
                V = torch.stack(blocks + [partial_block]).movedim(0, -2)     # [B, T, N+1, D]
            else:
                V = torch.stack(blocks + [partial_block], dim=-2)            # [B, T, N+1, D]
            logits = proj(norm(V)).squeeze(-1).float()
            w = logits.softmax(-1)
            return (w.to(V.dtype).unsqueeze(-1) * V).sum(-2)
        V = blocks if s == "bank" else torch.stack(blocks + [partial_block])  # [N+1, B, T, D]
        if s == "functional":
            K = F.rms_norm(V, (V.shape[-1],))
        elif s == "scratch":
            x = V.float()
            K = (x / torch.sqrt(torch.mean(x ** 2, dim=-1, keepdim=True) + 1e-6)).to(V.dtype)
        else:
            K = norm(V)
        if s == "linear":
            logits = proj(K).squeeze(-1)
            w = F.softmax(logits, dim=0)
        elif s == "matvec":
            logits = K @ proj.weight.squeeze()
            return (logits.softmax(0).unsqueeze(-1) * V).sum(0)
        elif s == "query":
            logits = torch.einsum("d, n b t d -> n b t", self.query[site], K)
            logits = logits - logits.max(dim=0, keepdim=True).values
            w = torch.softmax(logits, 0)
        else:
            logits = torch.einsum("d, n b t d -> n b t", proj.weight.squeeze(), K)
            w = logits.softmax(0)
        if s == "functional":
            return torch.einsum("n b t, n b t d -> b t d", w.float(), V.float()).to(V.dtype)
        return torch.einsum("n b t, n b t d -> b t d", w, V)

    # ------------------------------------------------------------------ the layer loop

    def forward(self, x):
        if self.spelling == "full":
            return self._full(x)
        if self.spelling == "bank":
            return self._bank(x)
        blocks, partial_block = [], x
        for i, layer in enumerate(self.layers):
            h = self.res(blocks, partial_block, layer.attn_res_proj, layer.attn_res_norm, 2 * i)
            if i % (self.block_size // 2) == 0:  # block boundary: start a new block
                blocks.append(partial_block)
                partial_block = None
            attn_out = layer.attention(h)
            partial_block = partial_block + attn_out if partial_block is not None else attn_out
            h = self.res(blocks, partial_block, layer.mlp_res_proj, layer.mlp_res_norm, 2 * i + 1)
            partial_block = partial_block + layer.mlp(h)
        h = self.res(blocks, partial_block, self.final_res_proj, self.final_res_norm,
                     2 * len(self.layers))
        return self.final_norm(h)

    def _bank(self, x):
        max_blocks = len(self.layers) // (self.block_size // 2) + 1
        bank = x.new_empty(max_blocks + 1, *x.shape)
        n, partial_block = 0, x
        for i, layer in enumerate(self.layers):
            bank[n] = partial_block
            h = self.res(bank[:n + 1], None, layer.attn_res_proj, layer.attn_res_norm, 2 * i)
            if i % (self.block_size // 2) == 0:
                n += 1  # the partial block's slot becomes a completed block
                partial_block = None
            attn_out = layer.attention(h)
            partial_block = partial_block + attn_out if partial_block is not None else attn_out
            bank[n] = partial_block
            h = self.res(bank[:n + 1], None, layer.mlp_res_proj, layer.mlp_res_norm, 2 * i + 1)
            partial_block = partial_block + layer.mlp(h)
        bank[n] = partial_block
        h = self.res(bank[:n + 1], None, self.final_res_proj, self.final_res_norm,
                     2 * len(self.layers))
        return self.final_norm(h)

    def _full(self, x):
        outputs = [x]  # every sublayer output is a source
        for layer in self.layers:
            h = self._full_res(outputs, layer.attn_res_proj, layer.attn_res_norm)
            outputs.append(layer.attention(h))
            h = self._full_res(outputs, layer.mlp_res_proj, layer.mlp_res_norm)
            outputs.append(layer.mlp(h))
        return self.final_norm(self._full_res(outputs, self.final_res_proj, self.final_res_norm))

    @staticmethod
    def _full_res(outputs, proj, norm):
        V = torch.stack(outputs)
        logits = torch.einsum("d, n b t d -> n b t", proj.weight.squeeze(), norm(V))
        return torch.einsum("n b t, n b t d -> b t d", logits.softmax(0), V)

    def multi_source_sites(self) -> int:
        """AttnRes steps over more than one source (what must fuse): all 2L + 1 but the
        first, which reads the embedding alone."""
        return 2 * len(self.layers)

    def fused_sites(self) -> int:
        """What fuses: the multi-source steps, and in the spellings whose mix is a weighted
        sum the first too (``sum`` over one source stays a site; a sources-first einsum over
        one source lowers to a plain multiply, no longer a contraction)."""
        return self.multi_source_sites() + (self.spelling in ("sources_last", "matvec",
                                                               "movedim"))
