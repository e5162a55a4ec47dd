"""Where a run starts and how it trains: a new run, one resumed from its latest complete checkpoint (a changed
recipe's optimizer settings taken up), or a finished one whose last checkpoint is only loaded."""

from __future__ import annotations

import contextlib
import pickle
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from ..errors import DataError, ModelSourceError, OutputFolderError
from ..files import writing_to
from ..launch.topology import is_main_process
from ..reading import REFUSED_FOR_SAFETY
from .checkpoints import (
    check_recipe_change,
    checkpoint_step,
    is_finished,
    latest_checkpoint,
    save_training_recipe,
    trim_metrics,
)
from .schema import Recipe


@dataclass
class RunStart:
    """Where a run starts: its ``output_dir``, the ``checkpoint`` it resumes from (None: a new run) and the training
    keys its recipe ``changed`` since the run started (resumed with ``--allow-recipe-change``)."""

    output_dir: Path
    checkpoint: Path | None
    changed: list[str]


def start_run(recipe: Recipe, resume: bool, allow_recipe_change: bool) -> RunStart:
    """Check the run folder against ``resume`` and the recipe against the one the run started with, then ready the
    folder (main process): a resumed run's later metrics dropped, a new or changed recipe recorded.
    Raises ModelSourceError: ``resume`` without a complete checkpoint; OutputFolderError: a new run into a folder
    with checkpoints; ConfigError: a recipe change not allowed."""
    output_dir = recipe.resolved_output_dir()
    skipped: list[str] = []
    checkpoint = latest_checkpoint(output_dir, skipped)
    for message in skipped:
        print(f"longpeft: {message}", file=sys.stderr)
    if resume and checkpoint is None:
        raise ModelSourceError(
            f"--resume: no complete checkpoint in {output_dir / 'checkpoints'}; start without --resume"
        )
    if not resume and checkpoint is not None:
        raise OutputFolderError(
            f"{output_dir} already has checkpoints ({checkpoint.name}); pass --resume to continue that run, "
            "or choose another output_dir"
        )
    changed = check_recipe_change(output_dir, recipe, allow_recipe_change) if resume else []
    if resume:
        print(f"longpeft: resuming from {checkpoint}", file=sys.stderr)
    if is_main_process():
        output_dir.mkdir(parents=True, exist_ok=True)
        if resume:
            trim_metrics(output_dir / "metrics.jsonl", checkpoint_step(checkpoint))
        else:
            (output_dir / "metrics.jsonl").unlink(missing_ok=True)
        if changed or not resume:
            save_training_recipe(output_dir, recipe.model_dump())
    return RunStart(output_dir, checkpoint, changed)


class ApplyOptimizerSettings(TrainerCallback):
    """A resumed run with a changed recipe (--allow-recipe-change) takes up its learning rate and Adam betas, which
    the checkpoint's optimizer and scheduler state restored to the old ones; the first resumed step runs at the new
    schedule's rate for its step. ``train``: the recipe's train section."""

    def __init__(self, train: Any):
        self.train = train

    def on_train_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
        scheduler = getattr(lr_scheduler, "scheduler", lr_scheduler)  # accelerate wraps it
        groups, rate = optimizer.param_groups, self.train.learning_rate
        for index, group in enumerate(groups):
            group["initial_lr"] = rate
            if "betas" in group:
                group["betas"] = (self.train.adam_beta1, self.train.adam_beta2)
            if scheduler is not None:
                scheduler.base_lrs[index] = rate
                group["lr"] = rate * scheduler.lr_lambdas[index](scheduler.last_epoch)
        if scheduler is not None:  # what the Trainer logs as this step's learning rate
            scheduler._last_lr = [group["lr"] for group in groups]


class CheckpointLoaded(Exception):
    """Raised by :class:`StopBeforeTraining` once the Trainer has loaded the checkpoint it resumes from."""


class StopBeforeTraining(TrainerCallback):
    """Ends ``trainer.train(resume_from_checkpoint=...)`` when training begins: the Trainer has wrapped the model
    and loaded the checkpoint into it, and no step has run (to save a finished run whose adapter a kill lost)."""

    def on_train_begin(self, args, state, control, **kwargs):
        raise CheckpointLoaded


def planned_steps(trainer: Any) -> int:
    """The optimizer steps the run trains in all, as transformers computes them (``train.max_steps``, or epochs)."""
    return trainer.set_initial_training_values(trainer.args, trainer.get_train_dataloader())[-1]


def train_or_take_last(trainer: Any, checkpoint: Path | None) -> dict[str, Any]:
    """Train (from ``checkpoint`` when resuming) and return the Trainer's metrics; a checkpoint of the run's last
    step is only loaded (:class:`StopBeforeTraining`) and ``{}`` returned.
    Raises DataError: a checkpoint file weights-only loading refuses, or weights of other shapes than the recipe's;
    OutputWriteError: a checkpoint that cannot be written (a full disk), naming the checkpoints folder."""
    with writing_to(Path(trainer.args.output_dir)):  # the checkpoints folder: a full disk names it
        try:
            if checkpoint is not None and is_finished(checkpoint, planned_steps(trainer)):
                print(
                    f"longpeft: {checkpoint.name} is the run's last step; saving it without training", file=sys.stderr
                )
                trainer.add_callback(StopBeforeTraining())
                with contextlib.suppress(CheckpointLoaded):
                    trainer.train(resume_from_checkpoint=str(checkpoint))
                return {}
            return trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint is not None else None).metrics
        except pickle.UnpicklingError:
            if checkpoint is None:
                raise
            raise DataError(
                f"{checkpoint}: a file there is {REFUSED_FOR_SAFETY} (Python objects that weights-only "
                "loading does not run); delete that checkpoint folder to resume from the one before, or "
                "start again into a new output_dir"
            ) from None
        except RuntimeError as error:  # torch's load_state_dict: the recipe builds other shapes than the run's
            if checkpoint is None or "size mismatch" not in str(error):
                raise
            first = next(line.strip() for line in str(error).splitlines() if "size mismatch" in line)
            raise DataError(
                f"{checkpoint}: its weights have other shapes than this recipe's model ({first}); resume "
                "with the recipe the run started with, or train into a new output_dir"
            ) from None
