"""Run-folder bookkeeping that makes a kill lose nothing: complete checkpoints, the recipe a run was
started with, and metrics lines that survive a torn write.

A checkpoint is written under ``checkpoints/.saving`` and renamed to ``checkpoints/checkpoint-<step>`` once every
process has written its part (:func:`publish_checkpoint`). A resume takes a checkpoint folder only when complete: its
``trainer_state.json`` parses and its weights and optimizer state are there (others are skipped, saying so).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..files import write_text_atomically

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
STAGING = ".saving"  # under checkpoints/: where a checkpoint is written before it takes its name
# Weights and optimizer state as the Trainer writes them: whole (one process, DDP: peft's adapter, the model, or
# for ``finetune: method`` the method's own file such as ``beacon_adapter.safetensors``) or sharded (accelerate's
# FSDP files and torch.distributed.checkpoint folders, ``pytorch_model_fsdp_0/`` and ``optimizer_0/``; DeepSpeed's
# ``global_step<N>/``). A sharded folder counts once it is complete (DCP writes its ``.metadata`` last).
_WEIGHT_PATTERNS = ("*.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model_fsdp*")
_OPTIMIZER_PATTERNS = ("optimizer.pt", "optimizer*.bin", "optimizer_*", "global_step*")
TRAINING_RECIPE_FILENAME = "recipe.training.json"
# Recipe keys that do not change what is trained (they may differ between a kill and --resume).
_NOT_TRAINING = set(
    "name description output_dir train.save_steps train.save_total_limit train.logging_steps train.report_to".split()
)
# Training keys a resumed run cannot take up (--allow-recipe-change refuses them), with the reason: the checkpoint's
# optimizer state is restored as it was, and its weights have the shapes these keys gave them.
FIXED_FOR_THE_RUN = {
    "train.optim": "the checkpoint holds the state of the optimizer the run started with",
    "train.weight_decay": "the checkpoint's optimizer state restores the weight decay the run started with",
    "finetune": "the checkpoint holds the weights this setting chose to train",
    "method": "the checkpoint holds the weights this setting chose to train",
    "model.name_or_path": "the checkpoint's weights belong to the base the run started with",
    "lora.r": "the checkpoint's LoRA weights have the rank the run started with",
    "lora.target_modules": "the checkpoint's LoRA weights are for the modules the run started with",
    "lora.embeddings": "the checkpoint's trained embedding rows are those the run started with",
}


def checkpoint_state(folder: Path) -> dict[str, Any] | None:
    """The checkpoint's ``trainer_state.json`` when the checkpoint is complete, else None."""
    try:
        state = json.loads((folder / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return None
    complete = isinstance(state, dict) and _written(folder, _WEIGHT_PATTERNS) and _written(folder, _OPTIMIZER_PATTERNS)
    return state if complete else None


def _written(folder: Path, patterns: tuple[str, ...]) -> bool:
    """Whether ``folder`` holds a file matching one of ``patterns``, or a complete sharded folder matching one."""
    for pattern in patterns:
        for path in folder.glob(pattern):
            if path.is_file():
                return True
            if path.is_dir() and (
                (path / ".metadata").is_file() or path.name.startswith("global_step") and any(path.iterdir())
            ):
                return True
    return False


def latest_checkpoint(output_dir: Path, report: list[str] | None = None) -> Path | None:
    """The newest complete checkpoint of a run; incomplete ones are passed over (and named in ``report``)."""
    folders = [p for p in (Path(output_dir) / "checkpoints").glob("checkpoint-*") if _CHECKPOINT.match(p.name)]
    for folder in sorted(folders, key=checkpoint_step, reverse=True):
        if checkpoint_state(folder) is not None:
            return folder
        if report is not None:
            report.append(f"{folder} is incomplete (a kill while it was written?); it is skipped")
    return None


def staging_folder(checkpoints: Path) -> Path:
    """Where the checkpoints of ``checkpoints`` (a run's ``checkpoints/``) are written before they take their names
    (the Trainer writes ``<it>/checkpoint-<step>``); never read by a resume."""
    return Path(checkpoints) / STAGING


def clear_staging(checkpoints: Path) -> None:
    """Remove what a save cut short left in :func:`staging_folder` (before the next save writes there)."""
    shutil.rmtree(staging_folder(checkpoints), ignore_errors=True)


def publish_checkpoint(checkpoints: Path, name: str) -> Path:
    """Give the checkpoint written in :func:`staging_folder` under ``name`` (``checkpoint-<step>``) that name in
    ``checkpoints``, in one rename. A folder already there by that name is an incomplete one (a resume would have
    continued from it, not from an earlier step, were it complete: a kill of an older longpeft's save, or of a
    rotation), and is removed first. Returns the checkpoint's folder."""
    final = Path(checkpoints) / name
    if final.exists():
        shutil.rmtree(final)
    (staging_folder(checkpoints) / name).rename(final)
    return final


def checkpoint_step(folder: Path) -> int:
    return int(_CHECKPOINT.match(folder.name).group(1))


def is_finished(folder: Path, total_steps: int) -> bool:
    """Whether the checkpoint was written at the last of the run's ``total_steps`` optimizer steps (what
    transformers derives from ``train.max_steps`` or the epochs: see ``trainer.planned_steps``); a resumed run
    given more steps or epochs is not finished."""
    state = checkpoint_state(folder) or {}
    return state.get("global_step", 0) >= total_steps


def trim_metrics(path: Path, last_step: int) -> None:
    """Keep the metric lines logged up to ``last_step``; drop later ones (a resumed run repeats them)
    and any blank or torn line a kill left behind."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= last_step:
            kept.append(line)
    write_text_atomically(path, "".join(line + "\n" for line in kept))  # a full disk keeps the old lines


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict):
        flat: dict[str, Any] = {}
        for key, value in data.items():
            flat.update(_flatten(value, f"{prefix}{key}."))
        return flat
    return {prefix[:-1]: data}


def training_recipe(recipe_dump: dict[str, Any]) -> dict[str, Any]:
    """The recipe's keys that decide what is trained, flattened to dotted names."""
    return {
        k: v for k, v in _flatten(json.loads(json.dumps(recipe_dump, default=str))).items() if k not in _NOT_TRAINING
    }


def save_training_recipe(output_dir: Path, recipe_dump: dict[str, Any]) -> None:
    write_text_atomically(
        Path(output_dir) / TRAINING_RECIPE_FILENAME, json.dumps(training_recipe(recipe_dump), indent=2) + "\n"
    )


def changed_keys(output_dir: Path, recipe: Any) -> list[str] | None:
    """Dotted keys of ``recipe`` (a :class:`~longpeft.recipes.schema.Recipe`) whose values differ from the recipe
    the run was started with; None when that record (``recipe.training.json``) is missing or unreadable, so nothing
    can be compared. A key the saved recipe lacks is a key a later longpeft added: it is a change only when set to
    something other than its default (defaults keep the earlier behaviour)."""
    path = Path(output_dir) / TRAINING_RECIPE_FILENAME
    try:
        before = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(before, dict):
        return None
    now = training_recipe(recipe.model_dump())
    not_default = set(training_recipe(recipe.model_dump(exclude_defaults=True)))
    return sorted(
        k for k in set(before) | set(now) if before.get(k) != now.get(k) and (k in before or k in not_default)
    )


def check_recipe_change(output_dir: Path, recipe: Any, allow: bool) -> list[str]:
    """The training keys changed since the run in ``output_dir`` started (a resume). Refused unless ``allow``
    (--allow-recipe-change); refused even then for the keys a resumed run cannot take up (FIXED_FOR_THE_RUN), and
    when the run's record of its recipe is missing or unreadable, unless ``allow`` (then every key counts as
    changed, and the record is written anew)."""
    changed = changed_keys(output_dir, recipe)
    record = output_dir / TRAINING_RECIPE_FILENAME
    if changed is None:
        if not allow:
            raise ConfigError(
                f"--resume: {record} is missing or unreadable, so a changed recipe cannot be detected; "
                "resume with --allow-recipe-change if this recipe is the one the run started with (the "
                "record is then written anew), or train into another output_dir"
            )
        return ["(all: no record)"]
    fixed = [f"{key} ({FIXED_FOR_THE_RUN[key]})" for key in changed if key in FIXED_FOR_THE_RUN]
    if fixed:
        raise ConfigError(
            f"--resume: {'; '.join(fixed)}: a resumed run cannot take this change up; restore it, or "
            "train into another output_dir"
        )
    if changed and not allow:
        raise ConfigError(
            f"--resume: the recipe changed since {output_dir} was started ({', '.join(changed)}); resuming "
            "would mix two trainings. Restore those keys, train into another output_dir, or pass "
            "--allow-recipe-change to resume anyway"
        )
    return changed
