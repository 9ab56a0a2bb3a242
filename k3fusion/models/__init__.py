"""Reference models the k3fusion passes are tested against."""

from .kimi_k3 import KimiK3Attention, KimiK3Config, KimiK3ForCausalLM, KimiK3RMSNorm

__all__ = ["KimiK3Config", "KimiK3ForCausalLM", "KimiK3RMSNorm", "KimiK3Attention"]
