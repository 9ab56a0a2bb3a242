"""Example peer adapter: the MLA q/kv RMSNorm pair in plain torch (eager, no compile).

    python -m k3fusion bench --only qkv_rmsnorm --peers examples/peers

A peer adapter declares NAME, OP, SOURCE and make (and may add declines); the bench imports
it from the --peers directory, checks its output against the reference k3fusion is checked
against, then times it beside k3fusion. docs/bench-methods.md, "Peer kernels", describes
the format and how the vLLM kernels are wrapped.
"""

import torch

NAME = "torch eager (example)"
OP = "qkv_rmsnorm"
# Where the timed code comes from: printed under the tables. A real peer names the public
# repository, the file and the commit it was fetched at.
SOURCE = {"repo": "k3fusion", "path": "examples/peers/torch_qkv_rmsnorm.py",
          "commit": "this checkout"}


def _rms_norm(x, w, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def make(inputs, point):
    """A zero-argument callable for one input set (called once per rotated set, outside
    the timed region): returns (q normed, kv normed)."""
    q, q_w, kv, kv_w, eps = (inputs["q"], inputs["q_weight"], inputs["kv"],
                             inputs["kv_weight"], point["eps"])
    return lambda: (_rms_norm(q, q_w, eps), _rms_norm(kv, kv_w, eps))
