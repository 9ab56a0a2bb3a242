"""Add the k3fusion passes to plain ``backend="inductor"`` compiles (e.g. mode="max-autotune").

    python examples/install_into_inductor.py
"""

import torch

import k3fusion
from k3fusion.models import KimiK3Config, KimiK3ForCausalLM

config = KimiK3Config.tiny(dtype=torch.float32)
model = KimiK3ForCausalLM(config, seed=0).eval()
ids = torch.randint(0, config.vocab_size, (2, 8))

k3fusion.install()  # composes with a post_grad_custom_post_pass you already set
try:
    with torch.no_grad():
        out = torch.compile(model)(ids)
finally:
    k3fusion.uninstall()
print("matches:", k3fusion.match_counts())
