"""Add the k3fusion passes to plain ``backend="inductor"`` compiles (e.g. mode="max-autotune").

    python examples/install_into_inductor.py
"""

import torch

import k3fusion
from k3fusion.models import KimiK3Config, KimiK3ForCausalLM

config = KimiK3Config.tiny(attn_res=True, attn_res_block_size=1, dtype=torch.float32)
model = KimiK3ForCausalLM(config, seed=0).eval()
ids = torch.randint(0, config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))

k3fusion.reset_match_counts()
k3fusion.install()  # composes with a post_grad_custom_post_pass you already set
try:
    with torch.no_grad():
        out = torch.compile(model)(ids)
finally:
    k3fusion.uninstall()  # restores what was there before install()
print("matches:", k3fusion.match_counts())
