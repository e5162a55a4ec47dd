"""The demo's before/after table: passkey and single-needle NIAH at W, 2W and 4W (W = the base's trained window)
for the base model and base + adapter, each with and without STRING, built from the eval results' JSON files only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..adapters.string import DEFAULT_LOCAL_WINDOW, string_defaults
from ..errors import DataNotFoundError
from .tasks import evaluate

DEMO_TASKS = ("passkey", "niah_single")
SETTINGS = ("base", "base + STRING", "adapter", "adapter + STRING")
WINDOW_MULTIPLES = (1, 2, 4)
DEPTHS = (0.0, 0.5, 1.0)


def setting_folder(setting: str) -> str:
    """``"adapter + STRING"`` -> ``"adapter_STRING"``."""
    return setting.replace(" + ", "_")


def demo_string_settings(trained_length: int) -> dict[str, int]:
    """STRING for a small model: the default S (L / 3) and W = min(128, S / 4) (the paper's W = 128 needs L >= 2K)."""
    shift, trained_length = string_defaults(None, trained_length, None, trained_length)
    return {"shift": shift, "local_window": min(DEFAULT_LOCAL_WINDOW, shift // 4), "trained_length": trained_length}


def run_demo_evals(
    out: str | Path, adapter_dir: str | Path, n_samples: int = 8, seed: int = 0, lengths: tuple[int, ...] | None = None
) -> int:
    """Evaluate the adapter's base and base + adapter, each with and without STRING (L: the base's window, the
    adapter's trained length), into ``out/eval/<setting>/``, with ``n_samples`` prompts per (length, depth) cell at
    ``lengths`` (default W, 2W and 4W) and depths 0, 0.5 and 1; returns the base's trained window W."""
    from transformers import AutoModelForCausalLM

    from ..loading import load, load_tokenizer, resolve_base
    from ..spec import ContextSpec

    spec = ContextSpec.load(adapter_dir)
    base_location = resolve_base(spec, adapter_dir, None)
    base = AutoModelForCausalLM.from_pretrained(base_location).eval()
    window = base.config.max_position_embeddings
    tokenizer = load_tokenizer(adapter_dir, base_location)
    adapter = load(base_location, adapter_dir).eval()
    models = {"base": (base, window), "adapter": (adapter, spec.trained_length or window)}
    lengths = lengths or tuple(m * window for m in WINDOW_MULTIPLES)
    grid = dict(lengths=lengths, depths=DEPTHS, n_samples=n_samples, seed=seed, chat=False, batch_size=12)
    for setting in SETTINGS:
        model, trained_length = models[setting.split(" + ")[0]]
        string = demo_string_settings(trained_length) if "STRING" in setting else None
        out_dir = Path(out) / "eval" / setting_folder(setting)
        for task in DEMO_TASKS:
            evaluate(task, model, tokenizer, string=string, out_dir=out_dir, **grid)
    return window


def collect_rows(eval_dir: str | Path) -> list[dict[str, Any]]:
    """Rows ``{"task", "setting", "length", "score"}`` read from ``eval_dir/<setting>/<task>.json``; raises
    DataNotFoundError when a setting's result is missing (the evaluation did not finish)."""
    rows = []
    for setting in SETTINGS:
        for task in DEMO_TASKS:
            path = Path(eval_dir) / setting_folder(setting) / f"{task}.json"
            if not path.is_file():
                raise DataNotFoundError(
                    f"{path}: no eval result for {setting} / {task}; run the demo's evaluation first"
                )
            result = json.loads(path.read_text())
            for length, score in result["by_length"].items():
                rows.append({"task": task, "setting": setting, "length": int(length), "score": float(score)})
    return rows


def before_after_table(rows: list[dict[str, Any]], window: int) -> str:
    """A markdown table: one row per setting, one column per (task, length), lengths as multiples of W."""
    lengths = sorted({r["length"] for r in rows})
    score = {(r["setting"], r["task"], r["length"]): r["score"] for r in rows}
    label = {"passkey": "passkey", "niah_single": "NIAH"}
    columns = [(task, n) for task in DEMO_TASKS for n in lengths]
    names = [f"{label[t]} {n // window}W" if n % window == 0 else f"{label[t]} {n}" for t, n in columns]
    lines = [f"| setting (W = {window}) | " + " | ".join(names) + " |", "|---|" + "---:|" * len(columns)]
    for setting in SETTINGS:
        cells = [f"{score[(setting, t, n)]:.2f}" if (setting, t, n) in score else "-" for t, n in columns]
        lines.append(f"| {setting} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
