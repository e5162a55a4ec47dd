"""`make demo`: the whole longpeft path on a tiny model on CPU, no download.

Generates offline procedural long-context QA, trains the ``tiny-cpu`` recipe (RoPE base 1e4 -> 1e6,
context 256 -> 1024, LoRA + trainable embedding), scores retrieval before and after the fine-tune
and with STRING, merges the adapter, and writes model cards. Output folder::

    adapter/ (+ longpeft.json, README.md)   merged/ (plain from_pretrained)   metrics.json   loss.png
    eval_results.json   eval/ (per-setting JSON and NIAH heatmaps)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .hub import merge, write_model_card
from .recipes.checkpoints import latest_checkpoint
from .recipes.runner import run
from .recipes.schema import load_recipe
from .spec import ContextSpec


def run_demo(out: str | Path = "runs/demo", max_steps: int | None = None) -> dict:
    """Run the demo into ``out``; returns the summary printed at the end.

    A finished demo folder is replaced (only what the demo wrote is deleted); an interrupted one
    (checkpoints, no adapter) is resumed. A non-empty folder the demo did not make is refused.
    """
    out = Path(out)
    prepare_demo_folder(out)
    overrides = [f"output_dir={out}"] + ([f"train.max_steps={max_steps}"] if max_steps else [])
    recipe = load_recipe("tiny-cpu", overrides)
    result = run(recipe, resume=latest_checkpoint(out) is not None)

    from .eval.demo_report import retrieval_report

    eval_rows = retrieval_report(out, result.adapter_dir)
    (out / "eval_results.json").write_text(json.dumps({"rows": eval_rows}, indent=2) + "\n")
    shutil.copy(out / "eval_results.json", result.adapter_dir / "eval_results.json")

    merged = merge(result.adapter_dir, out / "merged")
    spec = ContextSpec.load(result.adapter_dir)
    write_model_card(result.adapter_dir, spec, merged=False, repo_id=str(result.adapter_dir))
    write_model_card(out / "merged", spec, merged=True, repo_id=str(out / "merged"))

    summary = {
        "output_dir": str(out),
        "steps": result.metrics["steps"],
        "first_loss": result.metrics["first_loss"],
        "final_loss": result.metrics["final_loss"],
        "merged_max_abs_logit_diff": merged["max_abs_logit_diff"],
        "eval": eval_rows,
    }
    print_summary(summary)
    return summary


DEMO_MARKER = ".longpeft-demo"
# What a demo run writes into its folder (and so may delete to start a new one).
DEMO_OUTPUTS = ("adapter", "merged", "eval", "checkpoints", "base", "metrics.jsonl", "metrics.json", "loss.png",
                "eval_results.json", "recipe.resolved.json", "recipe.training.json")


def prepare_demo_folder(out: Path) -> None:
    """Make ``out`` ready for a demo run without deleting anything the demo did not write.

    Raises:
        FileExistsError: ``out`` is a non-empty folder without the demo's marker file.
        NotADirectoryError: ``out`` is a file.
    """
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"--out {out} is a file; choose a folder for the demo")
    if out.is_dir() and any(out.iterdir()) and not (out / DEMO_MARKER).is_file():
        raise FileExistsError(
            f"--out {out} is not empty and was not written by `longpeft demo`; choose an empty or new folder "
            "(nothing was deleted)"
        )
    if (out / "adapter").exists():  # a finished demo: start again, removing only the demo's own outputs
        for name in DEMO_OUTPUTS:
            path = out / name
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / DEMO_MARKER).write_text("written by `longpeft demo`: it may replace its own outputs here\n")


def print_summary(summary: dict) -> None:
    print(f"\nlongpeft demo -> {summary['output_dir']}")
    print(f"  training: {summary['steps']} steps, loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f}")
    print(f"  merged model vs base + adapter: max |logit diff| = {summary['merged_max_abs_logit_diff']:.2e}")
    print(f"  {'task':<10} {'setting':<22} {'length':>6} {'score':>6}")
    for row in summary["eval"]:
        print(f"  {row['task']:<10} {row.get('setting', ''):<22} {row.get('length', ''):>6} {row['score']:>6.3f}")
