"""``k3fusion.moe_tail_symm``: the documented path of the symmetric-memory tail (README's
``enable_symm_mem_tail()``), kept for compatibility; it re-exports the public names of
``k3fusion.moe_tail.symm_mem``, where the implementation lives."""

from .moe_tail.symm_mem import *  # noqa: F401,F403  (its __all__: this module's public API)
from .moe_tail.symm_mem import IMPL_NAME, MAX_TOKENS, SELECT_MAX_TOKENS  # noqa: F401  (read too)
from .moe_tail.symm_mem import __all__  # noqa: F401
