"""Long-context evaluation: passkey, needle-in-a-haystack grids with heatmaps, RULER-lite
(multi-key/value/query NIAH, variable tracking, common-word extraction), topic retrieval and
sliding-window perplexity, on any causal LM + tokenizer (base, base + adapter, merged), with or
without STRING; and any lm-evaluation-harness task through :mod:`.harness` (the ``eval`` extra).
Every task is a record of the registry (:mod:`.registry`); the built-in ones are registered by :mod:`.builtin`.
"""

from __future__ import annotations

import importlib
from typing import Any

from . import builtin  # noqa: F401  (registers the built-in tasks)
from .registry import TASKS, EvalTask, ProbeTask, get_task, register, registered, unregister

# Public name -> submodule, imported on first use (the CLI imports this package without torch).
_EXPORTS = {
    "EVAL_TASKS": "registry",  # the task names, read at each access
    "InsufficientMemoryError": "memory",
    "check_memory": "memory",
    "estimate_forward_bytes": "memory",
    "perplexity_of_file": "perplexity",
    "sliding_window_perplexity": "perplexity",
    "exact_match": "scoring",
    "recall": "scoring",
    "score": "scoring",
    "evaluate": "tasks",
    "niah_grid": "tasks",
    "passkey_accuracy": "tasks",
    "run_probe_task": "tasks",
    "write_outputs": "tasks",
    "extended_length": "harness",
    "harness_lm": "harness",
    "run_harness": "harness",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)


__all__ = ["TASKS", "EvalTask", "ProbeTask", "get_task", "register", "registered", "unregister"]
__all__ += list(_EXPORTS)
