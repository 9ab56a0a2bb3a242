"""Run the fused kernels in an uncompiled model: ``patch_model``.

    python examples/eager_patch.py

``patch_model`` swaps in the fused q/kv norm pair, the fused AttnRes step (with the layer
hand-off) and the tiered latent-MoE tail, without changing the model's ``forward`` or its
state_dict keys. On CPU the fused ops run their plain-torch implementations (Triton's
interpreter with ``TRITON_INTERPRET=1`` set before the import); on a GPU, the kernels.
"""

import torch

from k3fusion.eager import patch_model
from k3fusion.models import KimiK3Config, KimiK3ForCausalLM

device = "cuda" if torch.cuda.is_available() else "cpu"
config = KimiK3Config.tiny(attn_res=True, attn_res_block_size=1, latent_moe=True)  # bf16
model = KimiK3ForCausalLM(config, seed=0).to(device).eval()
ids = torch.randint(0, config.vocab_size, (1, 16), device=device,
                    generator=torch.Generator(device=device).manual_seed(0))

with torch.no_grad():
    before = model(ids)
    report = patch_model(model)  # works on any module with the standard MLA children
    after = model(ids)
print("patched:", report.patched)
print("skipped:", report.skipped)
rel = (after.float() - before.float()).abs().max().item() / before.float().abs().max().item()
print(f"max |patched - original| / max|original|: {rel:.2e} (bf16 roundings)")
