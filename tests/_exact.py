"""Exact functions for gradient oracles: a spec's math in fp64, without its roundings."""

from __future__ import annotations

import torch

__all__ = ["attn_res_fp64"]


def attn_res_fp64(prefix, blocks, num_blocks, norm_w, proj_w, delta, out_w, eps=1e-6,
                  out_eps=1e-5):
    """``k3fusion.reference.attn_res``'s math (functional: returns the mix, optionally
    output-normed, and the new prefix) on the inputs' dtype, rounding nothing: in fp64 the
    exact function the reference approximates."""
    p = prefix if delta is None else prefix + delta
    v = torch.cat([blocks[:, :num_blocks], p.unsqueeze(1)], 1)
    logits = torch.rsqrt(v.pow(2).mean(-1) + eps) * (v * norm_w * proj_w).sum(-1)
    mixed = (torch.softmax(logits, -1).unsqueeze(-1) * v).sum(1)
    if out_w is not None:
        mixed = mixed * torch.rsqrt(mixed.pow(2).mean(-1, keepdim=True) + out_eps) * out_w
    return mixed, p
