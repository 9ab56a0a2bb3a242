"""k3fusion: torch.compile fusion passes and Triton kernels for Kimi-K3-style decoders.

Three ways in:

* ``torch.compile(model, backend="k3fusion")`` (an entry point; no import needed);
* ``k3fusion.install()`` adds the passes to plain ``backend="inductor"`` compiles;
* ``k3fusion.eager`` wrappers / ``patch_model`` run the same kernels without compiling.
"""

from __future__ import annotations

from . import ops  # noqa: F401  registers the norm and AttnRes ops (torch.ops.k3fusion.*)
from . import moe_tail  # noqa: F401  registers k3fusion::latent_moe_tail and its fused kernel
from .backend import install, uninstall
from .config import FusionConfig, get_config, set_config
from .counters import match_counts, reset_match_counts
from .explain import explain

__version__ = "0.1.0"

__all__ = [
    "FusionConfig", "get_config", "set_config", "install", "uninstall",
    "match_counts", "reset_match_counts", "explain", "__version__",
]
