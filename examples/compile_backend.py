"""Compile a Kimi-K3 model with the k3fusion backend and see what was fused.

    python examples/compile_backend.py
"""

import logging

import torch

import k3fusion
from k3fusion.models import KimiK3Config, KimiK3ForCausalLM

logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
logging.getLogger("torch").setLevel(logging.WARNING)

device = "cuda" if torch.cuda.is_available() else "cpu"
config = KimiK3Config.tiny()
model = KimiK3ForCausalLM(config, seed=0).to(device).eval()
ids = torch.randint(0, config.vocab_size, (1, 32), device=device)

k3fusion.reset_match_counts()
with torch.no_grad():
    compiled = torch.compile(model, backend="k3fusion", dynamic=True)  # no import needed
    logits = compiled(ids)
print("matches:", k3fusion.match_counts(), "expected q/kv pairs:", model.mla_layers)
