"""Block AttnRes: the fused step, compiled in both bank forms and called eagerly.

    python examples/attn_res.py

K3 replaces the residual stream with a softmax mix over completed blocks (the "bank") and
the running block sum (the prefix). ``KimiK3Config`` options:

* ``attn_res=True`` turns it on; ``attn_res_block_size`` layers make a block (K3: 12);
* ``attn_res_bank="list"`` keeps completed blocks in a Python list (``torch.stack``ed per
  step), ``"tensor"`` in a preallocated ``[B, S, max_blocks, H]`` tensor written in place;
* ``attn_res_precision="model"`` mixes in the model dtype (softmax in fp32), ``"fp32"``
  runs key norm, logits, softmax and mix in fp32.

Each step (two per layer, plus the final one) becomes one ``k3fusion::attn_res`` kernel;
each layer's closing ``prefix + mlp_out`` folds into the next step
(``attn_res_delta_handoff``).
"""

import torch

import k3fusion
from k3fusion import reference
from k3fusion.eager import attn_res
from k3fusion.models import KimiK3Config, KimiK3ForCausalLM

device = "cuda" if torch.cuda.is_available() else "cpu"
gen = torch.Generator(device=device).manual_seed(0)

# 1. Compiled: both bank forms.
for bank in ("list", "tensor"):
    config = KimiK3Config.tiny(attn_res=True, attn_res_bank=bank, attn_res_block_size=1,
                               attn_res_precision="model", dtype=torch.float32)
    model = KimiK3ForCausalLM(config, seed=0).to(device).eval()
    ids = torch.randint(0, config.vocab_size, (1, 8), device=device, generator=gen)
    k3fusion.reset_match_counts()
    with torch.no_grad():
        err = (torch.compile(model, backend="k3fusion")(ids) - model(ids)).abs().max().item()
    counts = k3fusion.match_counts()
    print(f"{bank} bank: matches:", {k: counts[k] for k in ("attn_res", "attn_res_delta_handoff")},
          f"of {model.attn_res_sites} steps and {config.num_layers} hand-offs; "
          f"max |compiled - eager| {err:.1e}")

# 2. Eager: one step on a preallocated bank, in place as the spec says -- the prefix
#    gets the delta, the prefix is written to bank slot 2, and the mix over the
#    3 completed blocks plus the prefix comes back normalized.
T, max_blocks, H = 5, 4, 64
bank = torch.randn(T, max_blocks, H, device=device, generator=gen)
prefix, delta = (torch.randn(T, H, device=device, generator=gen) for _ in range(2))
norm_w, proj_w, out_w = (torch.rand(H, device=device, generator=gen) + 0.5 for _ in range(3))
args = dict(num_blocks=2, norm_w=norm_w, proj_w=proj_w, eps=1e-6, delta=delta,
            block_write_idx=2, out_norm_w=out_w, out_eps=1e-6)
want_prefix, want_bank = prefix.clone(), bank.clone()
want = reference.attn_res(want_prefix, want_bank, **args)
got = attn_res(prefix, bank, **args)
print("eager step on a tensor bank: max |fused - reference|:",
      f"out {(got - want).abs().max().item():.1e},",
      f"prefix {(prefix - want_prefix).abs().max().item():.1e},",
      f"bank {(bank - want_bank).abs().max().item():.1e}")
