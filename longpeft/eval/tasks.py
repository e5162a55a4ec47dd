"""Probe tasks on a model + tokenizer: build the probe grid, generate greedily, score, plot.

``evaluate(task, model, tokenizer, **options)`` is the entry point; :func:`passkey_accuracy` and
:func:`niah_grid` are shortcuts for the two most used grids.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from torch import nn
from tqdm.auto import tqdm

from ..errors import ConfigError
from ..files import write_text_atomically, writing_to
from ..synth_data.probes import PROBE_TASKS, Probe, make_probes
from ..units import format_duration
from .generation import eos_token_ids, generate_batch, pad_token_id
from .memory import check_memory
from .names import EVAL_TASKS
from .perplexity import perplexity_of_file
from .plots import depth_length_heatmap, score_by_length
from .positions import warn_beyond_positions
from .scoring import score

RULER_TASKS = (
    "niah_single",
    "niah_multikey",
    "niah_multivalue",
    "niah_multiquery",
    "variable_tracking",
    "common_words",
)
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
# Extra budget for chat replies, which often restate the question before the answer.
CHAT_EXTRA_NEW_TOKENS = 32


@contextlib.contextmanager
def string_enabled(model: Any, string: bool | dict[str, Any] | None) -> Iterator[dict[str, Any] | None]:
    """Run a block with STRING on (``True``: defaults; a dict: ``enable_string`` settings), then
    restore whatever STRING state the model had. ``None``/``False`` leaves the model as it is.

    With ``True`` on a model loaded by ``longpeft.load``, L is the adapter's trained length (so S = L // 3).
    """
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


def length_batches(probes: Sequence[Probe], batch_size: int) -> list[list[int]]:
    """Indices of ``probes`` in batches of at most ``batch_size`` that never mix prompt lengths (no
    prompt pays for a longer one's padding), longest first (a memory problem shows up at once)."""
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    batches = []
    for length in sorted({p.length for p in probes}, reverse=True):
        same = [k for k, p in enumerate(probes) if p.length == length]
        batches += [same[i : i + batch_size] for i in range(0, len(same), batch_size)]
    return batches


def _say(message: str) -> None:
    """A status line on stderr (stdout is for results), printed without breaking progress bars."""
    tqdm.write(message, file=sys.stderr)


def generate_for_probes(
    model: Any, tokenizer: Any, probes: Sequence[Probe], max_new_tokens: int, batch_size: int, task: str
) -> list[str]:
    """Greedy continuations of ``probes`` (in their order), in :func:`length_batches`.

    A grid of more than one batch announces its cost on stderr first (batches, forward passes,
    tokens), then, after the first (longest) batch, a rough total time: that batch's time scaled by
    tokens (prompt + generated), an overestimate for the shorter batches' attention.
    """
    batches = length_batches(probes, batch_size)
    tokens = [sum(probes[k].length + max_new_tokens for k in batch) for batch in batches]
    lengths = sorted({p.length for p in probes})
    if len(batches) > 1:
        span = f"{lengths[0]}-{lengths[-1]}" if len(lengths) > 1 else str(lengths[0])
        _say(
            f"{task}: {len(probes)} prompts of {span} tokens in {len(batches)} batches (one length each): at most "
            f"{len(batches) * max_new_tokens} forward passes (a prefill and up to {max_new_tokens - 1} decode steps "
            f"per batch), {sum(p.length for p in probes):,} prompt tokens + up to {len(probes) * max_new_tokens:,} "
            "generated"
        )
    eos_ids = eos_token_ids(model, tokenizer)
    pad_id = pad_token_id(tokenizer, eos_ids)
    predictions = [""] * len(probes)
    for i, batch in enumerate(tqdm(batches, desc=task, unit="batch", leave=False)):
        start = time.perf_counter()
        texts = generate_batch(model, tokenizer, [probes[k].input_ids for k in batch], max_new_tokens, eos_ids, pad_id)
        for k, text in zip(batch, texts):
            predictions[k] = text
        if i == 0 and len(batches) > 1:
            seconds = time.perf_counter() - start
            _say(
                f"{task}: the first batch ({len(batch)} x {probes[batch[0]].length} tokens) took "
                f"{format_duration(seconds)}; the whole grid should take about "
                f"{format_duration(seconds * sum(tokens) / tokens[0])} (rough: scaled by tokens)"
            )
    return predictions


@dataclasses.dataclass
class ProbeGrid:
    """A task's probes, built before anything generates (cheap: token ids only).

    Attributes:
        task: the probe task.
        probes: the grid, ``n_samples`` per (length, depth) cell.
        lengths: the distinct prompt lengths, ascending.
        new_tokens: the continuation budget per prompt.
    """

    task: str
    probes: list[Probe]
    lengths: list[int]
    new_tokens: int

    def largest_batch(self, batch_size: int) -> int:
        """Prompts in the longest batch :func:`length_batches` makes (at most ``batch_size``, of the longest
        length)."""
        return min(batch_size, sum(1 for p in self.probes if p.length == self.lengths[-1]))


def build_probe_grid(
    task: str,
    tokenizer: Any,
    lengths: Sequence[int],
    depths: Sequence[float] | None = None,
    n_samples: int = 10,
    seed: int = 0,
    max_new_tokens: int | None = None,
    chat: bool = False,
    **probe_options: Any,
) -> ProbeGrid:
    """The :class:`ProbeGrid` of ``task`` (options as :func:`run_probe_task`); fails before any generation."""
    if task not in PROBE_TASKS:
        raise ConfigError(f"unknown probe task {task!r}; choose one of {PROBE_TASKS}")
    lengths = sorted({int(length) for length in lengths})
    if not lengths or lengths[0] < 1:
        raise ConfigError(f"lengths must be positive token counts, got {lengths}")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1 (or None for the task's default), got {max_new_tokens}")
    new_tokens = max_new_tokens or MAX_NEW_TOKENS[task] + (CHAT_EXTRA_NEW_TOKENS if chat else 0)
    probes = make_probes(task, tokenizer, lengths, depths, n_samples=n_samples, seed=seed, chat=chat, **probe_options)
    return ProbeGrid(task, probes, lengths, new_tokens)


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
    save_prompts: bool = False,
    grid: ProbeGrid | None = None,
    **probe_options: Any,
) -> dict[str, Any]:
    """Build the probe grid of ``task``, generate, and score every sample.

    Args:
        max_new_tokens: continuation budget (default per task, plus ``CHAT_EXTRA_NEW_TOKENS`` with ``chat``).
        chat: wrap prompts in the tokenizer's chat template (replies scored with "contains").
        save_prompts: keep each prompt's text (special tokens included) in its sample (large:
            about 4 characters per token).
        grid: the grid, when already built by :func:`build_probe_grid` with these options.

    Returns:
        ``{"task", "metric", "score", "by_length", "cells", "samples", "lengths", "depths"}`` where
        ``cells`` holds the mean score of each (length, depth) cell and each sample is
        ``{"length", "depth", "needle_positions", "metadata", "answers", "prediction", "score"}``
        (+ ``"prompt"``); ``needle_positions`` are token offsets in the prompt.
    """
    if grid is None:
        grid = build_probe_grid(
            task, tokenizer, lengths, depths, n_samples, seed, max_new_tokens, chat, **probe_options
        )
    probes, lengths, new_tokens = grid.probes, grid.lengths, grid.new_tokens
    check_memory(model, grid.largest_batch(batch_size), lengths[-1] + new_tokens)  # before the longest batch runs
    predictions = generate_for_probes(model, tokenizer, probes, new_tokens, batch_size, task)
    samples = []
    for probe, prediction in zip(probes, predictions):
        samples.append(
            {
                "length": probe.length,
                "depth": probe.depth,
                "needle_positions": probe.needle_positions,
                "metadata": probe.metadata,
                "answers": probe.answers,
                "prediction": prediction,
                "score": score(prediction, probe.answers, probe.metric),
            }
        )
        if save_prompts:
            samples[-1]["prompt"] = tokenizer.decode(probe.input_ids)
    cell_keys = sorted(
        {(s["length"], s["depth"]) for s in samples}, key=lambda c: (c[0], -1 if c[1] is None else c[1])
    )
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
    """Write ``<name>.json`` and its PNG (depth x length heatmap, or score by length) into ``out_dir``; a full disk
    or a refused write is an ``OutputWriteError`` naming ``out_dir``."""
    with writing_to(out_dir):
        return _write_outputs(result, Path(out_dir), name)


def _write_outputs(result: dict[str, Any], out_dir: Path, name: str | None) -> dict[str, str]:
    out_dir.mkdir(parents=True, exist_ok=True)
    name = name or result["task"]
    files = {"json": str(out_dir / f"{name}.json")}
    suffix = " + STRING" if result.get("string") else ""
    if result.get("depths"):
        scores = {(c["length"], c["depth"]): c["score"] for c in result["cells"]}
        png = depth_length_heatmap(
            scores, out_dir / f"{name}_heatmap.png", f"{result['task']}{suffix}", result["lengths"], result["depths"]
        )
        files["heatmap"] = str(png)
    elif "by_length" in result:
        scores = {int(k): v for k, v in result["by_length"].items()}
        files["plot"] = str(score_by_length(scores, out_dir / f"{name}_by_length.png", f"{result['task']}{suffix}"))
    result["files"] = files
    write_text_atomically(files["json"], json.dumps(result, indent=2) + "\n")
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
        options: ``depths``, ``n_samples``, ``seed``, ``batch_size``, ``max_new_tokens``, ``chat``,
            ``save_prompts`` and task options (see :func:`run_probe_task`).

    Warns once when the prompts (or perplexity windows) are longer than the model's positions.
    """
    task = "niah_single" if task == "niah" else task
    if task not in EVAL_TASKS:
        raise ConfigError(f"unknown eval task {task!r}; choose one of {EVAL_TASKS}")
    with string_enabled(model, string) as requested:
        from ..adapters.string import string_settings

        # what runs: also the STRING an adapter's longpeft.json or a merged model switched on
        string_used = string_settings(model) if isinstance(model, nn.Module) else requested
        if task == "perplexity":
            if text is None:
                raise ConfigError("the perplexity task needs a text file (text=... / --text FILE)")
            result = {"task": task, **perplexity_of_file(model, tokenizer, text, window=window, stride=stride)}
        elif task == "ruler":
            warn_beyond_positions(model, lengths)
            grid_options = {k: v for k, v in options.items() if k not in ("batch_size", "save_prompts")}
            grids = {t: build_probe_grid(t, tokenizer, lengths, **grid_options) for t in RULER_TASKS}  # all, first
            parts = {}
            for t in RULER_TASKS:
                parts[t] = run_probe_task(t, model, tokenizer, lengths, grid=grids[t], **options)
                if out_dir is not None:  # each task's results land as soon as it is done
                    write_outputs({**parts[t], "string": string_used}, out_dir)
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
        else:
            warn_beyond_positions(model, lengths)
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
    return evaluate(
        "passkey", model, tokenizer, lengths=context_lengths, n_samples=n_samples, seed=seed, depths=depths, **options
    )


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
    return evaluate(
        "niah_single",
        model,
        tokenizer,
        lengths=lengths,
        depths=depths,
        n_samples=n_samples,
        seed=seed,
        out_dir=out_dir,
        **options,
    )
