"""Probe tasks on a model + tokenizer: build the probe grid, generate greedily, score, plot.

``evaluate(task, model, tokenizer, **options)`` is the entry point; :func:`passkey_accuracy` and
:func:`niah_grid` are shortcuts for the two most used grids.
"""

from __future__ import annotations

import contextlib
import json
import statistics
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ..synth_data.probes import TASKS as PROBE_TASKS, make_probes
from .generation import greedy_generate
from .names import TASKS
from .memory import check_memory
from .perplexity import perplexity_of_file
from .plots import depth_length_heatmap, score_by_length
from .scoring import score

RULER_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "variable_tracking", "common_words")
# Continuation budget per task (tokens): enough for the answer(s) with some slack.
MAX_NEW_TOKENS = {
    "passkey": 12,
    "niah_single": 16,
    "niah_multikey": 16,
    "niah_multivalue": 64,
    "niah_multiquery": 48,
    "variable_tracking": 40,
    "common_words": 96,
    "topic_retrieval": 16,
}


@contextlib.contextmanager
def string_enabled(model: Any, string: bool | dict[str, Any] | None) -> Iterator[dict[str, Any] | None]:
    """Run a block with STRING on (``True``: defaults; a dict: ``enable_string`` settings), then
    restore whatever STRING state the model had. ``None``/``False`` leaves the model as it is."""
    if not string:
        yield None
        return
    from ..adapters.string import disable_string, enable_string, string_settings

    before = string_settings(model)
    settings = enable_string(model, **({} if string is True else dict(string)))
    try:
        yield settings
    finally:
        disable_string(model)
        if before is not None:
            enable_string(model, **before)


def run_probe_task(
    task: str,
    model: Any,
    tokenizer: Any,
    lengths: Sequence[int],
    depths: Sequence[float] | None = None,
    n_samples: int = 10,
    seed: int = 0,
    batch_size: int = 4,
    max_new_tokens: int | None = None,
    chat: bool = False,
    **probe_options: Any,
) -> dict[str, Any]:
    """Build the probe grid of ``task``, generate, and score every sample.

    Returns:
        ``{"task", "metric", "score", "by_length", "cells", "samples", "lengths", "depths"}`` where
        ``cells`` holds the mean score of each (length, depth) cell.
    """
    if task not in PROBE_TASKS:
        raise ValueError(f"unknown probe task {task!r}; choose one of {PROBE_TASKS}")
    lengths = sorted({int(length) for length in lengths})
    if not lengths or lengths[0] < 1:
        raise ValueError(f"lengths must be positive token counts, got {lengths}")
    new_tokens = max_new_tokens or MAX_NEW_TOKENS[task]
    check_memory(model, batch_size, lengths[-1] + new_tokens)  # before building anything long
    probes = make_probes(task, tokenizer, lengths, depths, n_samples=n_samples, seed=seed, chat=chat, **probe_options)
    # Longest first: a memory problem shows up at once, not after the short lengths ran.
    order = sorted(range(len(probes)), key=lambda k: -probes[k].length)
    predictions: list[str] = [""] * len(probes)
    texts = greedy_generate(model, tokenizer, [probes[k].input_ids for k in order], new_tokens, batch_size, desc=task)
    for k, text in zip(order, texts):
        predictions[k] = text
    samples = []
    for probe, prediction in zip(probes, predictions):
        samples.append(
            {
                "length": probe.length,
                "depth": probe.depth,
                "answers": probe.answers,
                "prediction": prediction,
                "score": score(prediction, probe.answers, probe.metric),
            }
        )
    cell_keys = sorted({(s["length"], s["depth"]) for s in samples}, key=lambda c: (c[0], -1 if c[1] is None else c[1]))
    cells = [
        {
            "length": length,
            "depth": depth,
            "score": statistics.fmean(s["score"] for s in samples if (s["length"], s["depth"]) == (length, depth)),
            "n": sum(1 for s in samples if (s["length"], s["depth"]) == (length, depth)),
        }
        for length, depth in cell_keys
    ]
    by_length = {
        str(length): statistics.fmean(s["score"] for s in samples if s["length"] == length) for length in lengths
    }
    used_depths = sorted({s["depth"] for s in samples if s["depth"] is not None})
    return {
        "task": task,
        "metric": probes[0].metric,
        "score": statistics.fmean(s["score"] for s in samples),
        "by_length": by_length,
        "cells": cells,
        "lengths": lengths,
        "depths": used_depths or None,
        "n_samples": n_samples,
        "seed": seed,
        "chat": chat,
        "samples": samples,
    }


def write_outputs(result: dict[str, Any], out_dir: str | Path, name: str | None = None) -> dict[str, str]:
    """Write ``<name>.json`` and its PNG (depth x length heatmap, or score by length) into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = name or result["task"]
    files = {"json": str(out_dir / f"{name}.json")}
    suffix = " + STRING" if result.get("string") else ""
    if result.get("depths"):
        scores = {(c["length"], c["depth"]): c["score"] for c in result["cells"]}
        png = depth_length_heatmap(scores, out_dir / f"{name}_heatmap.png", f"{result['task']}{suffix}", result["lengths"], result["depths"])
        files["heatmap"] = str(png)
    elif "by_length" in result:
        scores = {int(k): v for k, v in result["by_length"].items()}
        files["plot"] = str(score_by_length(scores, out_dir / f"{name}_by_length.png", f"{result['task']}{suffix}"))
    result["files"] = files
    Path(files["json"]).write_text(json.dumps(result, indent=2) + "\n")
    return files


def evaluate(
    task: str,
    model: Any,
    tokenizer: Any,
    lengths: Sequence[int] = (1024, 2048, 4096),
    string: bool | dict[str, Any] | None = None,
    out_dir: str | Path | None = None,
    text: str | Path | None = None,
    window: int = 4096,
    stride: int | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Evaluate ``model`` on one task; optionally with STRING on, and writing JSON + PNG.

    Args:
        task: a probe task (``passkey``, ``niah_single`` (alias ``niah``), ``niah_multikey``,
            ``niah_multivalue``, ``niah_multiquery``, ``variable_tracking``, ``common_words``,
            ``topic_retrieval``), ``ruler`` (the six RULER-lite tasks and their mean) or
            ``perplexity`` (sliding window over the file ``text``).
        model, tokenizer: a transformers causal LM (PEFT-wrapped or merged) and its tokenizer.
        lengths: prompt lengths in tokens (probe tasks).
        string: ``True`` for STRING with its defaults, or a dict of ``enable_string`` settings.
        out_dir: where to write ``<task>.json`` and PNGs.
        text, window, stride: perplexity inputs.
        options: ``depths``, ``n_samples``, ``seed``, ``batch_size``, ``max_new_tokens``, ``chat``
            and task options (see :func:`run_probe_task`).
    """
    task = "niah_single" if task == "niah" else task
    if task not in TASKS:
        raise ValueError(f"unknown eval task {task!r}; choose one of {TASKS}")
    with string_enabled(model, string) as string_used:
        if task == "perplexity":
            if text is None:
                raise ValueError("the perplexity task needs a text file (text=... / --text FILE)")
            result = {"task": task, **perplexity_of_file(model, tokenizer, text, window=window, stride=stride)}
        elif task == "ruler":
            parts = {t: run_probe_task(t, model, tokenizer, lengths, **options) for t in RULER_TASKS}
            lengths_done = parts[RULER_TASKS[0]]["lengths"]
            result = {
                "task": "ruler",
                "score": statistics.fmean(p["score"] for p in parts.values()),
                "by_length": {
                    str(length): statistics.fmean(p["by_length"][str(length)] for p in parts.values())
                    for length in lengths_done
                },
                "lengths": lengths_done,
                "tasks": {t: {k: v for k, v in p.items() if k != "samples"} for t, p in parts.items()},
            }
            if out_dir is not None:
                for t, p in parts.items():
                    write_outputs({**p, "string": string_used}, out_dir)
        else:
            result = run_probe_task(task, model, tokenizer, lengths, **options)
    result["string"] = string_used
    if out_dir is not None:
        write_outputs(result, out_dir)
    return result


def passkey_accuracy(
    model: Any,
    tokenizer: Any,
    context_lengths: Sequence[int],
    n_samples: int = 10,
    seed: int = 0,
    depths: Sequence[float] = (0.0, 0.5, 1.0),
    **options: Any,
) -> dict[str, Any]:
    """Passkey retrieval accuracy per context length (``result["by_length"]``) and overall (``["score"]``)."""
    return evaluate("passkey", model, tokenizer, lengths=context_lengths, n_samples=n_samples, seed=seed, depths=depths, **options)


def niah_grid(
    model: Any,
    tokenizer: Any,
    lengths: Sequence[int],
    depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
    n_samples: int = 4,
    seed: int = 0,
    out_dir: str | Path | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Single-needle NIAH over a depth x length grid (``result["cells"]``; heatmap PNG in ``out_dir``)."""
    return evaluate("niah_single", model, tokenizer, lengths=lengths, depths=depths, n_samples=n_samples, seed=seed, out_dir=out_dir, **options)
