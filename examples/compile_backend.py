"""Compile a Kimi-K3 model with the k3fusion backend and see what was fused.

    python examples/compile_backend.py

The tiny model has Block AttnRes on, as K3 has, so all three of its chains fuse: the MLA
q/kv norm pair, each AttnRes step, and each layer's closing add (folded into the next
step). Run it twice: the second run is served from Inductor's cache and reports the same
counts. ``K3FUSION_DEBUG=1`` logs why anything was not fused.
"""

import torch

import k3fusion
from k3fusion.models import KimiK3Config, KimiK3ForCausalLM

device = "cuda" if torch.cuda.is_available() else "cpu"
config = KimiK3Config.tiny(attn_res=True, attn_res_block_size=1, dtype=torch.float32)
model = KimiK3ForCausalLM(config, seed=0).to(device).eval()
ids = torch.randint(0, config.vocab_size, (1, 8), device=device,
                    generator=torch.Generator(device=device).manual_seed(0))

k3fusion.reset_match_counts()
with torch.no_grad():
    compiled = torch.compile(model, backend="k3fusion")  # no import needed; dynamic=True works too
    err = (compiled(ids) - model(ids)).abs().max().item()
print("matches:", k3fusion.match_counts())
print("sites:", {"qkv_rmsnorm": model.mla_layers, "attn_res": model.attn_res_sites,
                 "attn_res_delta_handoff": config.num_layers})
print(f"max |compiled - eager|: {err:.2e}")
