"""k3fusion: torch.compile fusion passes and Triton kernels for Kimi-K3-style decoders.

Three ways in:

* ``torch.compile(model, backend="k3fusion")`` (an entry point; no import needed);
* ``k3fusion.install()`` adds the passes to plain ``backend="inductor"`` compiles;
* ``k3fusion.eager`` wrappers / ``patch_model`` run the same kernels without compiling.

Importing k3fusion reads and checks every ``K3FUSION_*`` environment variable.
"""

from __future__ import annotations

import os as _os
import sys as _sys

from .config import SettingsError, get_config as _get_config


def _read_settings() -> None:
    """Read and check every ``K3FUSION_*`` variable now, before any model runs, not at the
    first compile. Run as the command line, a bad one is one line and exit status 2 (as a
    bad flag): the package is imported before ``k3fusion.cli`` runs, so only here can the
    error come without a traceback."""
    try:
        _get_config()
    except SettingsError as e:
        argv = getattr(_sys, "orig_argv", [])
        as_module = _sys.argv[:1] == ["-m"] and any(
            a == "-m" and b == "k3fusion" for a, b in zip(argv, argv[1:]))
        if _os.path.basename(_sys.argv[0] or "") == "k3fusion" or as_module:
            prog = "python -m k3fusion" if as_module else "k3fusion"
            print(f"{prog}: error: {e}", file=_sys.stderr)
            raise SystemExit(2) from None
        raise


# Before the ops and kernels are imported: a bad setting fails fast, in one line.
_read_settings()

from . import ops  # noqa: E402,F401  registers the norm and AttnRes ops (torch.ops.k3fusion.*)
from . import moe_tail  # noqa: E402,F401  registers k3fusion::latent_moe_tail and its fused kernel
from .backend import install, uninstall  # noqa: E402
from .config import FusionConfig, get_config, set_config  # noqa: E402
from .counters import match_counts, reset_match_counts  # noqa: E402
from .explain import explain  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "FusionConfig", "SettingsError", "get_config", "set_config", "install", "uninstall",
    "match_counts", "reset_match_counts", "explain", "__version__",
]
