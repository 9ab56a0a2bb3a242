"""Why was (or wasn't) each site fused: ``k3fusion.explain(model, *example_inputs)``.

    python examples/explain.py

Needs a k3fusion with ``k3fusion.explain`` (says so and exits 0 otherwise).
"""

import sys

import torch

import k3fusion
from k3fusion.models import KimiK3Config, KimiK3ForCausalLM

try:
    from k3fusion.explain import explain
except ImportError:
    print("k3fusion.explain is not in this version of k3fusion; "
          "set K3FUSION_DEBUG=1 to log why each norm or site was not fused")
    sys.exit(0)

config = KimiK3Config.tiny(attn_res=True, attn_res_block_size=1, latent_moe=True,
                           dtype=torch.float32)
model = KimiK3ForCausalLM(config, seed=0).eval()
ids = torch.randint(0, config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))

with torch.no_grad():
    explain(model, ids)  # prints the report (and returns it)
