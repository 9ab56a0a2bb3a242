"""Eager-mode wrappers: the same fused kernels for models that are not compiled."""

from .qkv_rmsnorm import *  # noqa: F401,F403  (split by fusion in the next commit)
from .qkv_rmsnorm import FUSED_WHEN, __all__  # noqa: F401
