"""Long-context evaluation: passkey, needle-in-a-haystack grids with heatmaps, RULER-lite
(multi-key/value/query NIAH, variable tracking, common-word extraction), topic retrieval and
sliding-window perplexity, on any causal LM + tokenizer (base, base + adapter, merged), with or
without STRING.
"""

from __future__ import annotations

from .memory import InsufficientMemoryError, check_memory, estimate_forward_bytes
from .perplexity import perplexity_of_file, sliding_window_perplexity
from .scoring import exact_match, recall, score
from .tasks import TASKS, evaluate, niah_grid, passkey_accuracy, run_probe_task, write_outputs

__all__ = [
    "TASKS",
    "InsufficientMemoryError",
    "check_memory",
    "estimate_forward_bytes",
    "evaluate",
    "exact_match",
    "niah_grid",
    "passkey_accuracy",
    "perplexity_of_file",
    "recall",
    "run_probe_task",
    "score",
    "sliding_window_perplexity",
    "write_outputs",
]
