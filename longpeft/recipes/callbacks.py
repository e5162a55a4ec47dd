"""The callbacks a recipe's Trainer runs with: metrics to ``metrics.jsonl``, the rotary frequencies kept float32,
a stop on a non-finite loss, a changed recipe's optimizer settings taken up on resume, and a stop before the first
step (a finished checkpoint only loaded).
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from ..errors import LongpeftError
from ..rope import rotary_modules


class MetricsLogger(TrainerCallback):
    """Appends every Trainer log (loss, lr, grad norm, ...) to ``metrics.jsonl``, one line per step."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            with self.path.open("a") as f:
                f.write(json.dumps({"step": state.global_step, "epoch": state.epoch, **logs}) + "\n")


class KeepRotaryFrequencies(TrainerCallback):
    """Gives every rotary module its float32 frequencies back when training begins.

    DeepSpeed releases with DeepSpeed#5812 cast the whole module to bf16 when they wrap it, buffers included, which
    rounds ``inv_freq`` (and ``original_inv_freq``) to 8 bits of mantissa: at position 100K a frequency off by 0.2 %
    turns by hundreds of radians. (0.19.8, the one longpeft pins, casts parameters only: a bf16 ZeRO-3 run on CPU
    leaves the buffers float32.) The float32 values are kept from ``prepare`` and put back (with a warning) at
    ``on_train_begin``, after the Trainer has wrapped the model, whatever wrapper cast them.
    """

    NAMES = ("inv_freq", "original_inv_freq")

    def __init__(self, model: torch.nn.Module) -> None:
        self.saved = [
            (module, name, getattr(module, name).detach().clone())
            for _, _, module in rotary_modules(model)
            for name in self.NAMES
            if isinstance(getattr(module, name, None), torch.Tensor)
        ]

    def on_train_begin(self, args, state, control, **kwargs):
        cast = {}
        for module, name, value in self.saved:
            current = getattr(module, name)
            if current.dtype != value.dtype:
                cast[current.dtype] = cast.get(current.dtype, 0) + 1
                setattr(module, name, value.to(current.device))
        if cast:
            warnings.warn(
                f"the model's wrapper cast {sum(cast.values())} rotary frequency buffers to "
                f"{', '.join(map(str, cast))}; longpeft put their float32 values back",
                stacklevel=1,
            )


class TrainingDiverged(LongpeftError, ValueError):
    """The loss or the gradient norm became NaN or infinite; the run stopped (the message says what to change)."""


class StopOnNonFinite(TrainerCallback):
    """Stops a run whose logged loss or gradient norm is not finite (a NaN adapter is never saved)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        for key in ("loss", "grad_norm"):
            value = (logs or {}).get(key)
            if isinstance(value, (int, float)) and not math.isfinite(value):
                raise TrainingDiverged(
                    f"training diverged at step {state.global_step}: {key} = {value}; lower train.learning_rate "
                    "(or check the data), then start again (the last checkpoint before it is kept)"
                )


class ApplyOptimizerSettings(TrainerCallback):
    """A resumed run with a changed recipe (--allow-recipe-change) takes up its learning rate and Adam betas: the
    checkpoint's optimizer and scheduler state, loaded before training begins, restore the ones the run started
    with. The schedule's shape (warmup, decay, steps) follows the new recipe already; its base rate is set here, and
    the first resumed step runs at the new schedule's rate for its step (with more ``train.max_steps``, the old
    schedule's last rate, often 0, would otherwise be used once). ``train``: the recipe's train section."""

    def __init__(self, train: Any):
        self.train = train

    def on_train_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
        scheduler = getattr(lr_scheduler, "scheduler", lr_scheduler)  # accelerate wraps it
        groups = optimizer.param_groups
        for index, group in enumerate(groups):
            group["initial_lr"] = self.train.learning_rate
            if "betas" in group:
                group["betas"] = (self.train.adam_beta1, self.train.adam_beta2)
            if scheduler is not None:
                scheduler.base_lrs[index] = self.train.learning_rate
                group["lr"] = self.train.learning_rate * scheduler.lr_lambdas[index](scheduler.last_epoch)
        if scheduler is not None:  # what the Trainer logs as this step's learning rate
            scheduler._last_lr = [group["lr"] for group in groups]


class CheckpointLoaded(Exception):
    """Raised by :class:`StopBeforeTraining` once the Trainer has loaded the checkpoint it resumes from."""


class StopBeforeTraining(TrainerCallback):
    """Ends ``trainer.train(resume_from_checkpoint=...)`` when training begins: by then the Trainer has wrapped the
    model (DeepSpeed's engine, FSDP) and loaded the checkpoint's weights and state into it, and no step has run.
    The runner uses it to save a finished run whose adapter a kill lost."""

    def on_train_begin(self, args, state, control, **kwargs):
        raise CheckpointLoaded
