"""Fusion switches and thresholds, with validated ``K3FUSION_*`` environment overrides.

One frozen :class:`FusionConfig` describes what the passes may do. It is part of the
pass ``uuid()``, so changing a switch invalidates compiled-graph caches instead of
silently reusing a graph built under other settings.

Environment variables are read by :func:`load_config` (and so by :func:`get_config`
the first time). A bad value is an error that names the variable; it is never
replaced by a default.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, fields

__all__ = ["FusionConfig", "get_config", "set_config", "load_config", "ENV_PREFIX"]

ENV_PREFIX = "K3FUSION_"

#: Values of ``FusionConfig.moe_tail_tier`` (``k3fusion.moe_tail.Tier`` values, or "auto").
MOE_TAIL_TIERS = ("auto", "tail_fusion", "allreduce_overlap", "column_parallel", "replicated")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class FusionConfig:
    """What the k3fusion passes and eager wrappers are allowed to do.

    Each field can be overridden by the environment variable ``K3FUSION_<FIELD>``
    (upper case), e.g. ``K3FUSION_QKV_RMSNORM=0``.
    """

    #: Pair the MLA ``q_a_layernorm`` / ``kv_a_layernorm`` into one fused kernel.
    qkv_rmsnorm: bool = True
    #: Fuse each Block AttnRes chain (delta add, mix, output norm) into one kernel.
    attn_res: bool = True
    #: Log, for every recognized RMSNorm left unfused, why (logger ``k3fusion``).
    debug: bool = False
    #: Rows handled by one program of the dual RMSNorm kernel; 0 picks by size.
    dual_norm_rows_per_program: int = 0
    #: Latent-MoE tail: run the tiered tail (eager runner, and the graph pass when it
    #: lands); False runs the plain replicated tail everywhere.
    moe_tail: bool = True
    #: TAIL_FUSION tier for 0 < tokens <= this, where a fused-tail implementation supports
    #: the platform and its own measured limit admits T (``TailFusionImpl.select_max_tokens``
    #: in ``k3fusion.moe_tail``); 0 never selects it.
    fused_tail_max_tokens: int = 64
    #: ALLREDUCE_OVERLAP tier (shared-expert all-reduce on a side stream, replicated
    #: up-projection) for 0 < tokens <= this (0 never selects it); above it COLUMN_PARALLEL (tp > 1) or the
    #: replicated form (tp = 1). As vLLM's ``VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD``.
    #: 0 by default: column-parallel was faster at every T at tp = 2
    #: (docs/benchmarks.md, "Latent-MoE tail tiers across GPUs (`torchrun -m k3fusion.bench.moe_tail_tp`)").
    shared_experts_stream_token_threshold: int = 0
    #: Never select ALLREDUCE_OVERLAP (as vLLM's ``VLLM_DISABLE_SHARED_EXPERTS_STREAM``).
    disable_shared_experts_stream: bool = False
    #: Force one latent-MoE tail tier ("auto" selects by token count): "tail_fusion",
    #: "allreduce_overlap", "column_parallel" or "replicated". Forcing a tier that is
    #: unavailable for a call is an error, never a silent fallback.
    moe_tail_tier: str = "auto"

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("bool", bool) and not isinstance(value, bool):
                raise TypeError(f"FusionConfig.{f.name} must be a bool, got {value!r}")
            if f.type in ("int", int):
                if isinstance(value, bool) or not isinstance(value, int):
                    raise TypeError(f"FusionConfig.{f.name} must be an int, got {value!r}")
                if value < 0:
                    raise ValueError(f"FusionConfig.{f.name} must be >= 0, got {value}")
            if f.type in ("str", str) and not isinstance(value, str):
                raise TypeError(f"FusionConfig.{f.name} must be a str, got {value!r}")
        if self.moe_tail_tier not in MOE_TAIL_TIERS:
            raise ValueError(f"FusionConfig.moe_tail_tier must be one of {MOE_TAIL_TIERS}, "
                             f"got {self.moe_tail_tier!r}")
        if self.moe_tail_tier != "auto" and not self.moe_tail:
            raise ValueError(f"FusionConfig.moe_tail_tier={self.moe_tail_tier!r} forces a tier "
                             "but moe_tail=False turns the tiered tail off")
        rows = self.dual_norm_rows_per_program
        if rows and rows & (rows - 1):
            raise ValueError(
                f"FusionConfig.dual_norm_rows_per_program must be 0 or a power of two, got {rows}"
            )

    def replace(self, **changes) -> "FusionConfig":
        return dataclasses.replace(self, **changes)

    def cache_key(self) -> str:
        """A stable string of every setting (goes into the pass uuid)."""
        return ";".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))


def _parse(name: str, raw: str, kind: str):
    text = raw.strip().lower()
    if kind in ("bool", bool):
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise ValueError(f"{name}={raw!r}: expected one of 1/0/true/false/yes/no/on/off")
    if kind in ("int", int):
        try:
            return int(text, 10)
        except ValueError:
            raise ValueError(f"{name}={raw!r}: expected an integer") from None
    if kind in ("str", str):
        return text
    raise AssertionError(f"no parser for {kind}")  # a new field type needs one


def load_config(environ: "os._Environ[str] | dict[str, str] | None" = None) -> FusionConfig:
    """Build the config from defaults plus ``K3FUSION_*`` overrides in ``environ``."""
    environ = os.environ if environ is None else environ
    known = {ENV_PREFIX + f.name.upper(): f for f in fields(FusionConfig)}
    overrides = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        f = known.get(name)
        if f is None:
            raise ValueError(
                f"unknown k3fusion setting {name}; known: {', '.join(sorted(known))}"
            )
        overrides[f.name] = _parse(name, raw, f.type)
    try:
        return FusionConfig(**overrides)
    except (TypeError, ValueError) as e:
        raise ValueError(f"invalid k3fusion environment setting: {e}") from None


_current: FusionConfig | None = None


def get_config() -> FusionConfig:
    """The config in force: the last :func:`set_config`, else the environment's."""
    global _current
    if _current is None:
        _current = load_config()
    return _current


def set_config(config: FusionConfig | None = None, **changes) -> FusionConfig:
    """Replace the config in force (``None`` re-reads the environment); returns it."""
    global _current
    if config is not None and not isinstance(config, FusionConfig):
        raise TypeError(f"config must be a FusionConfig, got {type(config).__name__}")
    base = config if config is not None else load_config()
    _current = base.replace(**changes) if changes else base
    return _current
