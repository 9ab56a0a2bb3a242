"""Example peer adapter: the AttnRes step in plain torch (eager, fp32 math, no compile).

    python -m k3fusion.bench.attn_res --peers examples/peers

Declares NAME, OP, SOURCE, make and declines (docs/bench-methods.md, "Peer kernels").
"""

import torch

NAME = "torch eager (example)"
OP = "attn_res"
SOURCE = {"repo": "k3fusion", "path": "examples/peers/torch_attn_res.py",
          "commit": "this checkout"}


def declines(point):
    """The reason this peer cannot run a point, or None. (This one runs them all; a kernel
    without an output norm would return "no output norm" for every point.)"""
    return None


def make(inputs, point):
    """prefix += delta in place, bank[:, write_idx] = prefix, returns the normed mix."""
    prefix, delta, bank = inputs["prefix"], inputs["delta"], inputs["bank"]
    norm_w, proj_w, out_w = inputs["norm_weight"], inputs["proj_weight"], inputs["out_norm_weight"]
    nb, write_idx = point["num_blocks"], point["block_write_idx"]
    eps, out_eps = point["eps"], point["out_eps"]

    def step():
        prefix.copy_((prefix.float() + delta.float()).to(prefix.dtype))
        bank[:, write_idx] = prefix
        sources = torch.cat([bank[:, :nb], prefix.unsqueeze(1)], 1).float()   # [T, nb+1, H]
        inv_rms = torch.rsqrt(sources.pow(2).mean(-1) + eps)                  # [T, nb+1]
        logits = (sources * (norm_w.float() * proj_w.float())).sum(-1) * inv_rms
        mixed = (logits.softmax(-1).unsqueeze(-1) * sources).sum(1)           # [T, H]
        out = mixed * torch.rsqrt(mixed.pow(2).mean(-1, keepdim=True) + out_eps)
        return (out * out_w.float()).to(prefix.dtype)

    return step
