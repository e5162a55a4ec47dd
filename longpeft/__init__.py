"""longpeft: parameter-efficient context extension for Hugging Face causal LMs.

``longpeft.load(base, adapter_dir)`` loads an adapter onto a base model (its ``longpeft.json``
first, then the weights; see :func:`longpeft.loading.load`). Importing the package is cheap: torch
and transformers load when ``load``, ``ContextSpec`` or ``SpecMismatchError`` is first used.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Public name -> the submodule that defines it (the object itself is returned: real signature and docs).
_EXPORTS = {"load": "loading", "ContextSpec": "spec", "SpecMismatchError": "spec"}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'longpeft' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = ["ContextSpec", "SpecMismatchError", "load", "__version__"]
