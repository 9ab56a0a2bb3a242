"""Example peer adapter: the latent-MoE tail in plain torch (eager, no compile).

    python -m k3fusion.bench.moe_tail --peers examples/peers

Declares NAME, OP, SOURCE and make (docs/bench-methods.md, "Peer kernels").
"""

import torch

NAME = "torch eager (example)"
OP = "moe_tail"
SOURCE = {"repo": "k3fusion", "path": "examples/peers/torch_moe_tail.py",
          "commit": "this checkout"}


def make(inputs, point):
    """shared + rms_norm(routed) @ up_weight.T."""
    routed, shared = inputs["routed"], inputs["shared"]
    norm_w, up_w, eps = inputs["norm_weight"], inputs["up_weight"], point["eps"]

    def tail():
        r = routed.float()
        normed = (r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps)).to(routed.dtype)
        return shared + (norm_w * normed) @ up_w.T

    return tail
