"""Run the fused q/kv RMSNorm kernel in an uncompiled model.

    python examples/eager_patch.py
"""

import torch

from k3fusion.eager import patch_model
from k3fusion.models import KimiK3Config, KimiK3ForCausalLM

device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU runs the plain-torch kernel
config = KimiK3Config.tiny()
model = KimiK3ForCausalLM(config, seed=0).to(device).eval()
ids = torch.randint(0, config.vocab_size, (1, 16), device=device)

with torch.no_grad():
    before = model(ids)
    report = patch_model(model)  # works on any module with the standard MLA children
    after = model(ids)
print("patched:", report.patched)
print("skipped:", report.skipped)
print("max |diff|:", (after.float() - before.float()).abs().max().item())
