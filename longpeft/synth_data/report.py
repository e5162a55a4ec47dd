"""Writing a synthetic dataset: JSONL, a saved ``datasets.Dataset``, stats JSON and a length histogram PNG."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from datasets import Dataset

from ..files import write_text_atomically, writing_to
from .builders import task_counts

TRAIN_FILE = "train.jsonl"
DATASET_DIR = "dataset"
STATS_FILE = "stats.json"
HISTOGRAM_FILE = "length_hist.png"


def length_summary(lengths: Sequence[int]) -> dict[str, float]:
    """min / median / mean / p90 / max of token lengths (empty dict for no rows)."""
    if not lengths:
        return {}
    values = np.asarray(lengths)
    return {
        "min": int(values.min()),
        "median": float(np.median(values)),
        "mean": round(float(values.mean()), 1),
        "p90": float(np.percentile(values, 90)),
        "max": int(values.max()),
    }


def _by_task(rows: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    by_task: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_task.setdefault(row["task"], []).append(row)
    return by_task


def dataset_stats(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Counts per task, token-length summaries overall and per task, QA turns per task."""
    by_task = _by_task(rows)
    return {
        "conversations": len(rows),
        "counts": task_counts(rows),
        "tokens": length_summary([row["num_tokens"] for row in rows]),
        "tokens_per_task": {task: length_summary([r["num_tokens"] for r in group]) for task, group in by_task.items()},
        "qa_turns_per_task": {
            task: sum(sum(m["role"] == "assistant" for m in r["messages"]) for r in group)
            for task, group in by_task.items()
        },
    }


REASON_NOTES = {  # what the summary adds when requests were rejected for these reasons
    "http_refused": "HTTP 4xx reasons: the first are above",
    "prompt_too_long": "prompt_too_long: not sent, longer than the endpoint's context",
    "truncated": "truncated: cut off at llm.max_tokens",
}


def rejection_summary(stats: dict[str, Any]) -> list[str]:
    """Console lines on what an LLM run rejected: what ``rejects.jsonl`` lists (``stats["rejects"]``:
    :meth:`.llm_rejects.RejectsLog.counts`), then the quality gates' judgements of this run per reason and task.
    Empty for a run without the LLM answerer."""
    lines = []
    usage = stats.get("llm_usage", {})
    if usage.get("foreign_cache_files"):
        lines.append(
            f"llm_cache: {usage['foreign_cache_files']} file(s) were not cache entries longpeft writes (not JSON, cut "
            "short, or another shape): read as absent, their requests asked again and the files replaced"
        )
    if usage.get("foreign_rejects_lines"):
        lines.append(
            f"rejects.jsonl: {usage['foreign_rejects_lines']} line(s) were not records longpeft writes (cut short, "
            "edited, or another program's): left out of it"
        )
    rejects = stats.get("rejects", {})
    if by_reason := rejects.get("requests", {}):
        causes = usage.get("total", {}).get("gave_up_causes") or {}  # gave_up is never carried: this run's
        why = {"gave_up": " (" + ", ".join(f"{cause}: {n}" for cause, n in causes.items()) + ")"} if causes else {}
        notes = [note for reason, note in REASON_NOTES.items() if by_reason.get(reason)]
        lines.append(
            f"rejects.jsonl: {sum(by_reason.values())} request(s) rejected: "
            + ", ".join(f"{reason} {n}{why.get(reason, '')}" for reason, n in by_reason.items())
            + (f" ({'; '.join(notes)})" if notes else "")
        )
        lines.append(f"  their attempts: {_counts(rejects.get('attempts', {}))}")
        if rejects.get("earlier"):
            lines.append(
                f"  {rejects['earlier']} of them rejected in an earlier run and not asked again; "
                "--retry-rejected asks them again"
            )
    if items := rejects.get("items"):
        lines.append(f"rejects.jsonl: {sum(items.values())} item(s) dropped by the quality gates: {_counts(items)}")
    quality = stats.get("quality")
    if quality and quality.get("checked"):
        unused = f" ({quality['unused']} unused: beyond the number asked)" if quality.get("unused") else ""
        lines.append(
            f"quality gates: {quality['kept']} of {quality['checked']} items judged in this run kept{unused}; "
            f"rejected: {_counts(quality['rejected']) or 'none'}"
        )
        lines += [f"  {task:<14} {_counts(counts)}" for task, counts in quality["rejected_per_task"].items()]
    elif quality and not quality.get("enabled", True):
        lines.append("quality gates: off (quality.enabled: false)")
    return lines


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{reason} {count}" for reason, count in counts.items())


def plot_length_histogram(rows: Sequence[dict[str, Any]], path: str | Path, bins: int = 30) -> None:
    """Stacked histogram of conversation token lengths, one colour per task (matplotlib's Figure API: no pyplot
    state, no backend or display needed)."""
    from matplotlib.figure import Figure  # here: the report's other readers draw nothing (0.7 s of import)

    groups = {task: [row["num_tokens"] for row in group] for task, group in _by_task(rows).items()}
    figure = Figure(figsize=(8, 4.5))
    axis = figure.subplots()
    if groups:
        axis.hist(list(groups.values()), bins=bins, stacked=True, label=[f"{t} ({len(v)})" for t, v in groups.items()])
        axis.legend(fontsize=8)
    axis.set_xlabel("tokens per conversation (chat template included)")
    axis.set_ylabel("conversations")
    axis.set_title(f"Token lengths of {len(rows)} conversations")
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def write_dataset(
    rows: Sequence[dict[str, Any]], out_dir: str | Path, extra_stats: dict[str, Any] | None = None
) -> Dataset:
    """Write ``train.jsonl``, ``dataset/`` (``Dataset.save_to_disk``), ``stats.json`` and ``length_hist.png``;
    returns the Dataset (columns ``id``, ``task``, ``messages``, ``num_tokens``, ``sources``, ``meta``). The JSON files
    are written atomically; a full disk or a refused write is an ``OutputWriteError`` naming ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    columns = ("id", "task", "messages", "num_tokens", "sources", "meta")
    rows = [{key: row[key] for key in columns} for row in rows]
    write_text_atomically(out / TRAIN_FILE, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    dataset = Dataset.from_list(rows) if rows else Dataset.from_dict({key: [] for key in columns})
    with writing_to(out):
        dataset.save_to_disk(str(out / DATASET_DIR))
        stats = {**dataset_stats(rows), **(extra_stats or {})}
        write_text_atomically(out / STATS_FILE, json.dumps(stats, indent=2) + "\n")
        plot_length_histogram(rows, out / HISTOGRAM_FILE)
    return dataset
