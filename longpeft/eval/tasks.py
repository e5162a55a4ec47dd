"""Evaluation on a model + tokenizer: :func:`evaluate` runs a registered task; probe tasks build their grid,
generate greedily, score and plot here (:func:`passkey_accuracy` and :func:`niah_grid`: the two most used grids)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from torch import nn
from tqdm.auto import tqdm

from ..adapters.string import disable_string, enable_string, string_settings
from ..errors import ConfigError
from ..files import write_text_atomically, writing_to
from ..synth_data.probes import Probe
from ..units import format_duration
from .flags import BATCH_SIZE, DEPTHS, LENGTHS, SAMPLES, SEED
from .generation import check_memory, eos_token_ids, generate_batch, pad_token_id, warn_beyond_positions
from .registry import ProbeTask, get_task, make_probes

# Extra budget for chat replies, which often restate the question before the answer.
CHAT_EXTRA_NEW_TOKENS = 32


@contextlib.contextmanager
def string_enabled(model: Any, string: bool | dict[str, Any] | None) -> Iterator[dict[str, Any] | None]:
    """Run a block with STRING on (``True``: ``enable_string``'s defaults; a dict: its settings), then restore the
    model's STRING state; yields the settings. ``None``/``False`` leaves the model as it is."""
    if not string:
        yield None
        return
    before = string_settings(model)
    settings = enable_string(model, **({} if string is True else dict(string)))
    try:
        yield settings
    finally:
        disable_string(model)
        if before is not None:
            enable_string(model, **before)


@dataclasses.dataclass
class ProbeGrid:
    """A probe task's grid (``n_samples`` probes per (length, depth) cell; ``lengths`` distinct, ascending), its
    decode budget per prompt and how its probes were made, built before anything generates (cheap: token ids only)."""

    task: ProbeTask
    probes: list[Probe]
    lengths: list[int]
    new_tokens: int
    n_samples: int
    seed: int
    chat: bool

    def batches(self, batch_size: int) -> list[list[int]]:
        """Indices of the probes in batches of at most ``batch_size`` that never mix prompt lengths (no prompt pays
        for a longer one's padding), longest first (a memory problem shows up at once)."""
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        batches = []
        for length in sorted({p.length for p in self.probes}, reverse=True):
            same = [k for k, p in enumerate(self.probes) if p.length == length]
            batches += [same[i : i + batch_size] for i in range(0, len(same), batch_size)]
        return batches

    def largest_batch(self, batch_size: int) -> int:
        """Prompts in the longest of :meth:`batches`."""
        return min(batch_size, sum(1 for p in self.probes if p.length == self.lengths[-1]))

    def generate(self, model: Any, tokenizer: Any, batch_size: int) -> list[str]:
        """Greedy continuations of the probes (in their order), in :meth:`batches`. A grid of several batches
        announces its cost on stderr, then, after the first (longest) batch, a rough total time scaled by tokens."""
        probes, new_tokens, task = self.probes, self.new_tokens, self.task.name
        batches = self.batches(batch_size)
        tokens = [sum(probes[k].length + new_tokens for k in batch) for batch in batches]
        lengths = sorted({p.length for p in probes})
        if len(batches) > 1:
            span = f"{lengths[0]}-{lengths[-1]}" if len(lengths) > 1 else str(lengths[0])
            tqdm.write(
                f"{task}: {len(probes)} prompts of {span} tokens in {len(batches)} batches (one length each): at most "
                f"{len(batches) * new_tokens} forward passes (a prefill and up to {new_tokens - 1} decode steps per "
                f"batch), {sum(p.length for p in probes):,} prompt tokens + up to {len(probes) * new_tokens:,} "
                "generated",
                file=sys.stderr,
            )
        eos_ids = eos_token_ids(model, tokenizer)
        pad_id = pad_token_id(tokenizer, eos_ids)
        predictions = [""] * len(probes)
        for i, batch in enumerate(tqdm(batches, desc=task, unit="batch", leave=False)):
            start = time.perf_counter()
            prompts = [probes[k].input_ids for k in batch]
            for k, text in zip(batch, generate_batch(model, tokenizer, prompts, new_tokens, eos_ids, pad_id)):
                predictions[k] = text
            if i == 0 and len(batches) > 1:
                seconds = time.perf_counter() - start
                tqdm.write(
                    f"{task}: the first batch ({len(batch)} x {probes[batch[0]].length} tokens) took "
                    f"{format_duration(seconds)}; the whole grid should take about "
                    f"{format_duration(seconds * sum(tokens) / tokens[0])} (rough: scaled by tokens)",
                    file=sys.stderr,
                )
        return predictions


def build_probe_grid(
    task: str, tokenizer: Any, lengths: Sequence[int], *, max_new_tokens: int | None = None, **options: Any
) -> ProbeGrid:
    """The :class:`ProbeGrid` of the probe task ``task`` (:func:`~longpeft.eval.registry.make_probes` with
    ``options``: depths, n_samples, seed, chat and the task's own); fails before any generation. ``max_new_tokens``:
    the continuation budget (default per task, plus ``CHAT_EXTRA_NEW_TOKENS`` with ``chat``); ``chat`` wraps prompts
    in the tokenizer's chat template (replies scored with "contains")."""
    record = get_task(task, ProbeTask)
    lengths = sorted({int(length) for length in lengths})
    if not lengths or lengths[0] < 1:
        raise ConfigError(f"lengths must be positive token counts, got {lengths}")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be >= 1 (or None for the task's default), got {max_new_tokens}")
    options = {"n_samples": SAMPLES.default, "seed": SEED.default, "chat": False} | options
    new_tokens = max_new_tokens or record.max_new_tokens + (CHAT_EXTRA_NEW_TOKENS if options["chat"] else 0)
    probes = make_probes(record, tokenizer, lengths, **options)
    return ProbeGrid(record, probes, lengths, new_tokens, options["n_samples"], options["seed"], options["chat"])


def run_probe_task(
    task: str,
    model: Any,
    tokenizer: Any,
    lengths: Sequence[int] = LENGTHS.default,
    *,
    batch_size: int = BATCH_SIZE.default,
    save_prompts: bool = False,
    grid: ProbeGrid | None = None,
    **grid_options: Any,
) -> dict[str, Any]:
    """Build the probe grid of the probe task ``task`` (:func:`build_probe_grid` with ``grid_options``: depths,
    n_samples, seed, max_new_tokens, chat and the task's own), generate, and score every sample with the task's
    scorer. ``save_prompts`` keeps each prompt's text in its sample (large: about 4 characters per token); ``grid``
    is the grid when already built, its lengths checked against the model's positions. Returns ``{"task", "metric",
    "score", "by_length", "cells", "samples", "lengths", "depths", ...}``: ``cells`` as :func:`score_cells`, each
    sample ``{"length", "depth", "needle_positions", "metadata", "answers", "prediction", "score"}`` (+ ``"prompt"``);
    ``needle_positions`` are token offsets in the prompt."""
    if grid is None:
        warn_beyond_positions(model, lengths)
        grid = build_probe_grid(task, tokenizer, lengths, **grid_options)
    record, probes, lengths, new_tokens = grid.task, grid.probes, grid.lengths, grid.new_tokens
    check_memory(model, grid.largest_batch(batch_size), lengths[-1] + new_tokens)  # before the longest batch runs
    predictions = grid.generate(model, tokenizer, batch_size)
    samples = [
        {
            "length": probe.length,
            "depth": probe.depth,
            "needle_positions": probe.needle_positions,
            "metadata": probe.metadata,
            "answers": probe.answers,
            "prediction": prediction,
            "score": record.score(prediction, probe),
            **({"prompt": tokenizer.decode(probe.input_ids)} if save_prompts else {}),
        }
        for probe, prediction in zip(probes, predictions)
    ]
    return {
        "task": record.name,
        "metric": probes[0].metric,
        "score": statistics.fmean(s["score"] for s in samples),
        "by_length": {str(n): statistics.fmean(s["score"] for s in samples if s["length"] == n) for n in lengths},
        "cells": score_cells(samples),
        "lengths": lengths,
        "depths": sorted({s["depth"] for s in samples if s["depth"] is not None}) or None,
        "n_samples": grid.n_samples,
        "seed": grid.seed,
        "chat": grid.chat,
        "samples": samples,
    }


def score_cells(samples: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``{"length", "depth", "score", "n"}`` (mean score, count) per (length, depth) cell, by length, depth."""
    cells: dict[tuple[int, float | None], list[float]] = {}
    for s in samples:
        cells.setdefault((s["length"], s["depth"]), []).append(s["score"])
    order = sorted(cells, key=lambda c: (c[0], -1 if c[1] is None else c[1]))
    return [{"length": n, "depth": d, "score": statistics.fmean(cells[n, d]), "n": len(cells[n, d])} for n, d in order]


def run_suite(
    name: str, parts: Sequence[str], model: Any, tokenizer: Any, save: Callable[[dict[str, Any]], None], **options: Any
) -> dict[str, Any]:
    """The probe tasks ``parts`` on one grid (``options`` as :func:`run_probe_task`), all built before any generates,
    each saved as it finishes; the mean of their scores, overall and by length."""
    lengths, batch_size, save_prompts = (options.pop(key) for key in ("lengths", "batch_size", "save_prompts"))
    warn_beyond_positions(model, lengths)
    grids = {part: build_probe_grid(part, tokenizer, lengths, **options) for part in parts}
    results = {}
    for part in parts:
        results[part] = run_probe_task(
            part, model, tokenizer, lengths, batch_size=batch_size, save_prompts=save_prompts, grid=grids[part]
        )
        save(results[part])
    lengths_done = results[parts[0]]["lengths"]
    return {
        "task": name,
        "score": statistics.fmean(p["score"] for p in results.values()),
        "by_length": {
            str(n): statistics.fmean(p["by_length"][str(n)] for p in results.values()) for n in lengths_done
        },
        "lengths": lengths_done,
        "tasks": {t: {k: v for k, v in p.items() if k != "samples"} for t, p in results.items()},
    }


def plot_result(result: dict[str, Any], path: Path, title: str) -> Path:
    """Write a PNG of a task's ``result`` to ``path`` (matplotlib's Figure API: no pyplot state, no backend or display
    needed): with depths, the papers' needle-in-a-haystack picture, depth (rows, 0% at the top) x length (columns);
    else its score against context length (``result["by_length"]``)."""
    depths = result.get("depths")
    fig = Figure(figsize=(1.2 + 0.9 * len(result["lengths"]), 1.0 + 0.5 * len(depths)) if depths else (5, 3))
    ax = fig.subplots()
    if depths:
        lengths = result["lengths"]
        scores = {(c["length"], c["depth"]): c["score"] for c in result["cells"]}
        grid = [[scores[(length, depth)] for length in lengths] for depth in depths]
        image = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
        ax.set_xticks(range(len(lengths)), [str(length) for length in lengths])
        ax.set_yticks(range(len(depths)), [f"{100 * d:.0f}%" for d in depths])
        for row, depth_scores in enumerate(grid):
            for col, value in enumerate(depth_scores):
                ax.text(col, row, f"{value:.2f}", ha="center", va="center", fontsize=8)
        fig.colorbar(image, ax=ax, label="score")
    else:
        by_length = {int(n): score for n, score in result["by_length"].items()}
        ax.plot(sorted(by_length), [by_length[n] for n in sorted(by_length)], marker="o")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth" if depths else "score")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def write_outputs(result: dict[str, Any], out_dir: str | Path, name: str | None = None) -> dict[str, str]:
    """Write ``<name>.json`` and its PNG (depth x length heatmap, or score by length) into ``out_dir``; a full disk
    or a refused write is an ``OutputWriteError`` naming ``out_dir``."""
    out, name = Path(out_dir), name or result["task"]
    title = result["task"] + (" + STRING" if result.get("string") else "")
    with writing_to(out_dir):
        out.mkdir(parents=True, exist_ok=True)
        files = {"json": str(out / f"{name}.json")}
        if result.get("depths") or "by_length" in result:  # a heatmap with depths, else score by length
            kind, suffix = ("heatmap", "heatmap") if result.get("depths") else ("plot", "by_length")
            files[kind] = str(plot_result(result, out / f"{name}_{suffix}.png", title))
        result["files"] = files
        write_text_atomically(files["json"], json.dumps(result, indent=2) + "\n")
    return files


def evaluate(
    task: str,
    model: Any,
    tokenizer: Any,
    string: bool | dict[str, Any] | None = None,
    out_dir: str | Path | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Evaluate a transformers causal LM (PEFT-wrapped or merged) on one registered task or alias, with STRING on
    (:func:`string_enabled`) or not, writing ``<task>.json`` and PNGs to ``out_dir`` when given. ``options`` are the
    task's flags' keywords, each defaulting as its flag does (a probe task also takes its builder's own). Warns once
    when the prompts (or perplexity windows) are longer than the model's positions."""
    record = get_task(task)
    options = {flag.option: flag.default for flag in record.flags if flag.option} | options
    with string_enabled(model, string) as requested:
        # what runs: also the STRING an adapter's longpeft.json or a merged model switched on
        string_used = string_settings(model) if isinstance(model, nn.Module) else requested

        def save(part: dict[str, Any]) -> None:
            if out_dir is not None:
                write_outputs({**part, "string": string_used}, out_dir)

        if isinstance(record, ProbeTask):  # the probe loop, here (the registry imports no torch)
            result = run_probe_task(record.name, model, tokenizer, **options)
        else:
            result = record.run(model, tokenizer, save, **options)
    result["string"] = string_used
    if out_dir is not None:
        write_outputs(result, out_dir)
    return result


def passkey_accuracy(model: Any, tokenizer: Any, context_lengths: Sequence[int], **options: Any) -> dict[str, Any]:
    """Passkey retrieval accuracy per context length (``result["by_length"]``) and overall (``["score"]``);
    ``options`` as :func:`evaluate`'s, with ``n_samples=10``, ``seed=0`` and ``depths=(0.0, 0.5, 1.0)`` by default."""
    options = {"n_samples": 10, "seed": 0, "depths": (0.0, 0.5, 1.0)} | options
    return evaluate("passkey", model, tokenizer, lengths=context_lengths, **options)


def niah_grid(model: Any, tokenizer: Any, lengths: Sequence[int], **options: Any) -> dict[str, Any]:
    """Single-needle NIAH over a depth x length grid (``result["cells"]``; heatmap PNG in ``options["out_dir"]``);
    ``options`` as :func:`evaluate`'s, with ``depths`` 0 .25 .5 .75 1, ``n_samples=4`` and ``seed=0`` by default."""
    options = {"depths": DEPTHS.default, "n_samples": 4, "seed": 0} | options
    return evaluate("niah_single", model, tokenizer, lengths=lengths, **options)
