"""Reference models the k3fusion passes are tested against."""

from .kimi_k3 import (
    KimiK3Attention,
    KimiK3AttnRes,
    KimiK3Config,
    KimiK3ForCausalLM,
    KimiK3RMSNorm,
    apply_attn_res,
    count_attn_res_sites,
)

__all__ = [
    "KimiK3Config",
    "KimiK3ForCausalLM",
    "KimiK3RMSNorm",
    "KimiK3Attention",
    "KimiK3AttnRes",
    "apply_attn_res",
    "count_attn_res_sites",
]
