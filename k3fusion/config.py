"""Fusion switches and thresholds, with validated ``K3FUSION_*`` environment overrides.

One frozen :class:`FusionConfig` describes what the passes may do. It is part of the
pass ``uuid()``, so changing a switch invalidates compiled-graph caches instead of
silently reusing a graph built under other settings.

Environment variables are read and checked when ``k3fusion`` is imported (the first
:func:`get_config`); :func:`set_config` with no config reads them again. A bad value is a
:class:`SettingsError` of one line naming the variable, the value and what is allowed; it
is never replaced by a default.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass, fields
from typing import Callable, Iterator

__all__ = ["FusionConfig", "SettingsError", "get_config", "set_config", "load_config",
           "overridden", "dual_norm_rows_for_widths", "env_name", "ENV_PREFIX",
           "TRITON_MAX_TENSOR_NUMEL"]

ENV_PREFIX = "K3FUSION_"

#: Values of ``FusionConfig.moe_tail_tier`` (``k3fusion.moe_tail.Tier`` values, or "auto").
MOE_TAIL_TIERS = ("auto", "tail_fusion", "allreduce_overlap", "column_parallel", "replicated")

#: Triton's largest block (``triton.language.TRITON_MAX_TENSOR_NUMEL``; a test checks the
#: two agree). A dual-norm program's tile is its rows times the wider norm's width rounded
#: up to a power of two (``kernels.qkv_rmsnorm.pick_launch_shape``).
TRITON_MAX_TENSOR_NUMEL = 1 << 20

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_BOOL_WORDS = "one of 1/0/true/false/yes/no/on/off"


class SettingsError(ValueError):
    """A bad ``K3FUSION_*`` environment variable; the message is one line naming it, its
    value and what is allowed."""


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


#: field -> (test a value passes, what is allowed): for the fields with more than a type
#: rule; every other int field allows any value >= 0.
_VALUE_RULES: dict[str, tuple[Callable[[object], bool], str]] = {
    "dual_norm_rows_per_program": (
        lambda v: v == 0 or (_power_of_two(v) and v <= TRITON_MAX_TENSOR_NUMEL),
        f"0 (pick by size) or a power of two up to {TRITON_MAX_TENSOR_NUMEL} (Triton's largest "
        "block; a tile is this many rows times the norm width rounded up to a power of two)"),
    "moe_tail_tier": (lambda v: v in MOE_TAIL_TIERS, f"one of {', '.join(MOE_TAIL_TIERS)}"),
}
_AT_LEAST_0 = (lambda v: v >= 0, "an integer >= 0")


def _value_rule(name: str, kind) -> tuple[Callable[[object], bool], str] | None:
    if name in _VALUE_RULES:
        return _VALUE_RULES[name]
    return _AT_LEAST_0 if kind in ("int", int) else None


def env_name(field_name: str) -> str:
    """The environment variable that overrides ``FusionConfig.<field_name>``."""
    return ENV_PREFIX + field_name.upper()


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
    #: Training compiles: a fused AttnRes site's backward runs the fused backward kernel
    #: (the joint graph's backward is traced again from the fused forward); False keeps
    #: default Inductor's backward, which recomputes the chain.
    fused_backward: bool = True
    #: Log, for every recognized RMSNorm left unfused, why (logger ``k3fusion``).
    debug: bool = False
    #: Rows handled by one program of the dual RMSNorm kernel; 0 picks by size. A power of
    #: two whose tile (times the wider norm's width) fits in Triton's largest block.
    dual_norm_rows_per_program: int = 0
    #: Latent-MoE tail: the graph pass fuses it into ``latent_moe_tail``, and that op and
    #: the eager runner pick a tier per call; False leaves the tail unfused and runs the
    #: plain replicated tail everywhere.
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
            if f.type in ("int", int) and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"FusionConfig.{f.name} must be an int, got {value!r}")
            if f.type in ("str", str) and not isinstance(value, str):
                raise TypeError(f"FusionConfig.{f.name} must be a str, got {value!r}")
            rule = _value_rule(f.name, f.type)
            if rule is not None and not rule[0](value):
                raise ValueError(f"FusionConfig.{f.name} must be {rule[1]}, got {value!r}")
        if self.moe_tail_tier != "auto" and not self.moe_tail:
            raise ValueError(f"FusionConfig.moe_tail_tier={self.moe_tail_tier!r} forces a tier "
                             "but moe_tail=False turns the tiered tail off")

    def replace(self, **changes) -> "FusionConfig":
        return dataclasses.replace(self, **changes)

    def cache_key(self) -> str:
        """A stable string of every setting (goes into the pass uuid)."""
        return ";".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))


def _parse(name: str, raw: str, kind):
    """An environment variable's text as the field's type; a SettingsError if it is none."""
    text = raw.strip().lower()
    if kind in ("bool", bool):
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise SettingsError(f"{name}={raw!r}: expected {_BOOL_WORDS}")
    if kind in ("int", int):
        try:
            return int(text, 10)
        except ValueError:
            what = _value_rule(name[len(ENV_PREFIX):].lower(), kind)[1]
            raise SettingsError(f"{name}={raw!r}: expected {what}") from None
    if kind in ("str", str):
        return text
    raise AssertionError(f"no parser for {kind}")  # a new field type needs one


def load_config(environ: "os._Environ[str] | dict[str, str] | None" = None) -> FusionConfig:
    """Build the config from defaults plus ``K3FUSION_*`` overrides in ``environ``.

    Every variable is checked against what its field allows (and the kernels' limits);
    the first bad one is a :class:`SettingsError` of one line naming it.
    """
    environ = os.environ if environ is None else environ
    known = {env_name(f.name): f for f in fields(FusionConfig)}
    overrides, raw_of = {}, {}
    for name, raw in sorted(environ.items()):
        if not name.startswith(ENV_PREFIX):
            continue
        f = known.get(name)
        if f is None:
            raise SettingsError(f"{name}={raw!r}: not a k3fusion setting; known: "
                                f"{', '.join(sorted(known))}")
        value = _parse(name, raw, f.type)
        rule = _value_rule(f.name, f.type)
        if rule is not None and not rule[0](value):
            raise SettingsError(f"{name}={raw!r}: expected {rule[1]}")
        overrides[f.name], raw_of[f.name] = value, raw
    if overrides.get("moe_tail_tier", "auto") != "auto" and overrides.get("moe_tail") is False:
        raise SettingsError(
            f"K3FUSION_MOE_TAIL_TIER={raw_of['moe_tail_tier']!r} forces a tier but "
            f"K3FUSION_MOE_TAIL={raw_of['moe_tail']!r} turns the tiered tail off: unset one")
    return FusionConfig(**overrides)


def dual_norm_rows_for_widths(config: FusionConfig, width1: int, width2: int) -> int:
    """``config.dual_norm_rows_per_program``, checked against norms this wide: a program's
    tile (rows times the wider width rounded up to a power of two) must fit in Triton's
    largest block. Only the widths tell, so this runs at launch."""
    rows = config.dual_norm_rows_per_program
    block = 1 << max(width1 - 1, width2 - 1, 0).bit_length()
    if rows * block > TRITON_MAX_TENSOR_NUMEL:
        raise ValueError(
            f"dual_norm_rows_per_program ({env_name('dual_norm_rows_per_program')})={rows}: "
            f"expected at most {max(TRITON_MAX_TENSOR_NUMEL // block, 1)} for norms {width1} and "
            f"{width2} wide (a tile of {rows * block} elements is over Triton's largest block, "
            f"{TRITON_MAX_TENSOR_NUMEL})")
    return rows


_current: FusionConfig | None = None


def get_config() -> FusionConfig:
    """The config in force: the last :func:`set_config`, else the environment's (read when
    k3fusion is imported)."""
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


@contextlib.contextmanager
def overridden(**changes) -> Iterator[FusionConfig]:
    """The config in force with ``changes`` for the block, then exactly the config in force
    before it: every other field keeps what the caller set (``set_config(**changes)``
    would start again from the environment)."""
    global _current
    saved = get_config()
    _current = saved.replace(**changes)
    try:
        yield _current
    finally:
        _current = saved
