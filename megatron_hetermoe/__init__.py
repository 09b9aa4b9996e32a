"""megatron-hetermoe: HeterMoE (arXiv 2504.03871) as a Megatron-Core plugin."""
from __future__ import annotations

import importlib

__version__ = "0.1.0"


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message names the extra that brings it."""


def import_extra(module: str, extra: str, purpose: str):
    """Import an optional dependency, or say which `pip install 'megatron-hetermoe[EXTRA]'` adds it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        dist = module.split(".")[0]
        raise MissingExtraError(
            f"{purpose} needs {dist}, which is not installed ({e}); install the [{extra}] extra: "
            f"pip install 'megatron-hetermoe[{extra}]' (or pip install {dist})"
        ) from None
