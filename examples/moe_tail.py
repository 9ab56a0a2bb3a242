"""The latent-MoE tail: ``all_reduce(shared) + up_proj(rms_norm(all_reduce(routed)))``.

    python examples/moe_tail.py

Compiled, the graph pass replaces the tail with ``k3fusion::latent_moe_tail``, which picks
a tier from the token count T at run time; eagerly, ``patch_model`` installs a runner that
does the same. The tiers (``k3fusion.moe_tail``): ``tail_fusion`` (one fused kernel:
CUDA, tp = 1, T <= 32; at tp > 1 a symmetric-memory one once enabled), ``allreduce_overlap``,
``column_parallel`` (tp > 1) and ``replicated`` (the plain form; tp = 1 otherwise).
"""

import torch

import k3fusion
from k3fusion.eager import moe_tail_runners, patch_model
from k3fusion.models import KimiK3Config, KimiK3ForCausalLM
from k3fusion.moe_tail import select_tier

device = "cuda" if torch.cuda.is_available() else "cpu"
config = KimiK3Config.tiny(latent_moe=True, dtype=torch.float32)  # dense residuals, MoE MLP
model = KimiK3ForCausalLM(config, seed=0).to(device).eval()
gen = torch.Generator(device=device).manual_seed(0)

# 1. Compiled: one tail per latent-MoE layer.
k3fusion.reset_match_counts()
ids = torch.randint(0, config.vocab_size, (1, 8), device=device, generator=gen)
with torch.no_grad():
    err = (torch.compile(model, backend="k3fusion")(ids) - model(ids)).abs().max().item()
print("matches:", {"moe_tail": k3fusion.match_counts()["moe_tail"]},
      f"of {config.num_layers} tails; max |compiled - eager| {err:.1e}")

# 2. Eager: the tier each call ran, by token count, on this device (tp = 1).
patch_model(model)
runner = next(iter(moe_tail_runners(model).values()))
tiers = {}
with torch.no_grad():
    for tokens in (1, 8, 16, 17, 64):
        model(torch.randint(0, config.vocab_size, (1, tokens), device=device, generator=gen))
        tiers[tokens] = runner.last_tier.value
print(f"eager tiers on {device}, tp=1:", tiers)

# 3. What selection picks elsewhere (it looks only at T, H, tp and the device type):
#    K3 widths (H = 7168) on CUDA, one and two tensor-parallel ranks.
for tp in (1, 2):
    for tokens in (1, 32, 33, 512):
        print(f"  cuda tp={tp} T={tokens:<4} -> {select_tier(tokens, 7168, tp, 'cuda').value}")
