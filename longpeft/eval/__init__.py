"""Long-context evaluation: passkey, needle-in-a-haystack grids with heatmaps, RULER-lite tasks, topic retrieval
and sliding-window perplexity, on any causal LM + tokenizer, with or without STRING; and any lm-evaluation-harness
task through :mod:`.harness`. Every task is a record of the registry (:mod:`.registry`; built-in: :mod:`.builtin`)."""

from __future__ import annotations

from ..adapters.registry import torch_names
from . import builtin  # noqa: F401  (registers the built-in tasks)
from .registry import TASKS, EvalTask, ProbeTask, get_task, register, registered, unregister

# Public name -> submodule, imported on first use (the CLI imports this package without torch).
_EXPORTS = {
    name: module
    for module, names in {
        "registry": "EVAL_TASKS",  # the task names, read at each access
        "generation": "InsufficientMemoryError check_memory estimate_forward_bytes",
        "perplexity": "perplexity_of_file sliding_window_perplexity",
        "scoring": "exact_match recall score",
        "tasks": "evaluate niah_grid passkey_accuracy run_probe_task write_outputs",
        "harness": "extended_length harness_lm run_harness",
    }.items()
    for name in names.split()
}
__getattr__ = torch_names(__name__, _EXPORTS)


__all__ = ["TASKS", "EvalTask", "ProbeTask", "get_task", "register", "registered", "unregister"]
__all__ += list(_EXPORTS)
