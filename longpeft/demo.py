"""`make demo`: the whole longpeft path on CPU, no download, on the packaged toy base (``longpeft:toy-base``, window
W = 256, ``longpeft/toy_base/README.md``): train ``toy-extend-cpu`` at 4W, score passkey and NIAH at W, 2W and 4W
before and after (each with and without STRING), print the table, merge, write model cards.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .errors import OutputFolderError
from .hub import merge, write_model_card
from .recipes.checkpoints import latest_checkpoint
from .recipes.runner import run
from .recipes.schema import load_recipe
from .spec import ContextSpec

DEMO_RECIPE = "toy-extend-cpu"


def run_demo(out: str | Path = "runs/demo", max_steps: int | None = None) -> dict:
    """Run the demo into ``out`` (an interrupted demo resumes); returns the summary printed at the end."""
    from .eval.demo_report import before_after_table, collect_rows, run_demo_evals

    out = Path(out)
    prepare_demo_folder(out)
    overrides = [f"output_dir={out}"] + ([f"train.max_steps={max_steps}"] if max_steps else [])
    recipe = load_recipe(DEMO_RECIPE, overrides)
    result = run(recipe, resume=latest_checkpoint(out) is not None)

    window = run_demo_evals(out, result.adapter_dir)
    eval_rows = collect_rows(out / "eval")
    table = before_after_table(eval_rows, window)
    (out / "before_after.md").write_text(table + "\n")
    (out / "eval_results.json").write_text(json.dumps({"rows": eval_rows}, indent=2) + "\n")
    shutil.copy(out / "eval_results.json", result.adapter_dir / "eval_results.json")

    merged = merge(result.adapter_dir, out / "merged")
    for folder in (result.adapter_dir, out / "merged"):  # now with the eval table
        write_model_card(folder, ContextSpec.load(folder))

    metrics = {key: result.metrics[key] for key in ("steps", "first_loss", "final_loss")}
    summary = {"output_dir": str(out), **metrics, "merged_max_abs_logit_diff": merged["max_abs_logit_diff"]}
    summary |= {"window": window, "eval": eval_rows, "table": table}
    print(f"\nlongpeft demo -> {summary['output_dir']}")
    print(f"  training: {summary['steps']} steps, loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f}")
    print(f"  merged model vs base + adapter: max |logit diff| = {summary['merged_max_abs_logit_diff']:.2e}")
    print("  retrieval accuracy (greedy, exact match) at W, 2W and 4W tokens; W = the toy base's window:\n")
    print(summary["table"])
    return summary


DEMO_MARKER = ".longpeft-demo"
# What a demo run writes into its folder (and so may delete to start a new one).
DEMO_OUTPUTS = tuple(
    "adapter merged eval checkpoints base metrics.jsonl metrics.json loss.png eval_results.json before_after.md "
    "recipe.resolved.json recipe.training.json".split()
)


def prepare_demo_folder(out: Path) -> None:
    """Make ``out`` ready for a demo run, deleting a finished demo's outputs only; an OutputFolderError when ``out``
    is a file or a non-empty folder without the demo's marker file."""
    if out.exists() and not out.is_dir():
        raise OutputFolderError(f"--out {out} is a file; choose a folder for the demo")
    if out.is_dir() and any(out.iterdir()) and not (out / DEMO_MARKER).is_file():
        raise OutputFolderError(
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
