"""The Trainer every recipe trains with: the backend's trainer class (TRL's SFTTrainer, or unsloth's patch of it)
with :class:`RecipeTrainer`'s hooks; each private Trainer method it overrides calls one of them:

- atomic checkpoints (``_save_checkpoint``, ``_get_output_dir``): written under ``checkpoints/.saving``, renamed once
  every process wrote its part (one filesystem for all), then older ones rotated away;
- a tied embedding kept once per checkpoint and tied again on resume (``_save``, ``_load_from_checkpoint``);
- the methods' own weights (``_save``, ``_load_from_checkpoint``); with ``finetune: method`` a checkpoint holds only
  them, the tokenizer and the training arguments (the base is frozen);
- length grouping (``_get_train_sampler``): :func:`longpeft.scale.lengths.length_grouped_order`, drawn from
  ``train.seed`` and the epoch alone (every process draws it, a resume continues it).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from ..adapter_weights import leave_out_tied_copies, load_weights_into, missing_adapter_weights, tied_names
from ..adapters import load_method_weights, save_method_weights
from ..errors import DataError
from ..launch.topology import data_parallel_size
from ..scale.lengths import length_grouped_order
from ..spec import ContextSpec
from .checkpoints import clear_staging, publish_checkpoint, staging_folder

TRAINING_ARGS_NAME = "training_args.bin"  # as transformers names it


def recipe_trainer_class() -> type:
    """:class:`RecipeTrainer` over TRL's SFTTrainer as exported now (unsloth's patch once unsloth is imported)."""
    from trl import SFTTrainer  # here, not at import: unsloth must patch TRL first

    return type(f"Recipe{SFTTrainer.__name__}", (RecipeTrainer, SFTTrainer), {})


class RecipeTrainer:
    """The hooks of the module docstring, before the backend's trainer class in the MRO (:func:`recipe_trainer_class`).

    Args (besides the trainer class's own):
        method_spec: the ContextSpec whose methods' own weights checkpoints keep (None: none, or a full fine-tune).
        finetune: the recipe's ``finetune`` (``lora``, ``method`` or ``full``).
        group_by_length: train in :class:`LengthGroupedSampler`'s order.
    """

    def __init__(
        self,
        *args: Any,
        method_spec: ContextSpec | None = None,
        finetune: str = "lora",
        group_by_length: bool = False,
        **kwargs: Any,
    ) -> None:
        self.method_spec, self.finetune, self.group_by_length = method_spec, finetune, group_by_length
        self._writing_to: Path | None = None  # while a checkpoint is saved: the folder it is written in
        super().__init__(*args, **kwargs)

    # ---- the Trainer's private methods, each calling its hook ----

    def _get_output_dir(self, trial: Any) -> str:
        return str(self._writing_to) if self._writing_to is not None else super()._get_output_dir(trial)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        with self.checkpoint_written_atomically(Path(super()._get_output_dir(trial))):
            super()._save_checkpoint(model, trial)

    def _save(self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None) -> None:
        folder = Path(output_dir if output_dir is not None else self.args.output_dir)
        if self.method_spec is not None:
            self.save_method_weights(folder, state_dict)
        if self.method_spec is not None and self.finetune == "method":
            self.save_beside_frozen_base(folder)
            return
        super()._save(str(folder), state_dict)
        if self.args.should_save:
            leave_out_tied_copies(self.model, folder)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        folder = Path(resume_from_checkpoint)
        sharded = self.is_fsdp_enabled or self.is_deepspeed_enabled  # their checkpoints hold the whole model
        if sharded or not (self.method_spec is not None and self.finetune == "method"):
            self.load_checkpoint_weights(folder, model, sharded)
        if self.method_spec is not None and not sharded:
            self.restore_method_weights(folder)

    def _get_train_sampler(self, train_dataset: Any = None) -> torch.utils.data.Sampler | None:
        if not self.group_by_length:
            return super()._get_train_sampler(train_dataset)
        return self.length_grouped_sampler(train_dataset if train_dataset is not None else self.train_dataset)

    # ---- the hooks ----

    @contextmanager
    def checkpoint_written_atomically(self, checkpoints: Path) -> Iterator[None]:
        """The checkpoint saved in the block goes into ``checkpoints``' staging folder, then takes its name and older
        ones are rotated away."""
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        if self.args.should_save:
            clear_staging(checkpoints)
        self.accelerator.wait_for_everyone()  # nobody writes into it before it is cleared
        self._writing_to = staging_folder(checkpoints)
        try:
            yield
        finally:
            self._writing_to = None
        self.accelerator.wait_for_everyone()  # every process has written its part
        if self.args.should_save:
            publish_checkpoint(checkpoints, name)
            rotate_checkpoints(
                str(checkpoints),
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=False,
            )

    def save_method_weights(self, folder: Path, state_dict: dict[str, Any] | None) -> None:
        """The methods' own weights into ``folder`` (main process), from ``state_dict`` when the Trainer gathered one
        (DeepSpeed passes {} when it could not)."""
        if self.args.should_save:
            folder.mkdir(parents=True, exist_ok=True)
            save_method_weights(self.model, self.method_spec, folder, state_dict or None)

    def save_beside_frozen_base(self, folder: Path) -> None:
        """A ``finetune: method`` checkpoint's tokenizer and training arguments (the frozen base is not saved)."""
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(folder)
            torch.save(self.args, os.path.join(folder, TRAINING_ARGS_NAME))

    def load_checkpoint_weights(self, folder: Path, model: Any, sharded: bool) -> None:
        """The checkpoint's weights into ``model`` (default the trainer's): the Trainer's own loading, or for an
        adapter that keeps a tied embedding once, tied again (refused when some are missing)."""
        if sharded or not tied_names(folder):
            super()._load_from_checkpoint(str(folder), model)
            return
        target = model if model is not None else self.model
        missing = missing_adapter_weights(target, load_weights_into(target, folder))
        if missing:
            raise DataError(
                f"{folder}: its adapter lacks {len(missing)} weights of this run's (e.g. {missing[0]}); delete that "
                "checkpoint folder to resume from the one before, or start again into a new output_dir"
            )

    def restore_method_weights(self, folder: Path) -> None:
        """The methods' own weights of the checkpoint ``folder`` into the model, with an error that says what to do."""
        try:
            load_method_weights(self.model, self.method_spec, folder)
        except FileNotFoundError as exc:
            raise DataError(
                f"{folder} lacks the method weights of this run (written by another longpeft version, "
                f"or the recipe's methods changed): delete that folder to resume from the checkpoint "
                f"before it, or start again ({exc})"
            ) from exc

    def length_grouped_sampler(self, dataset: Any) -> LengthGroupedSampler:
        """:class:`LengthGroupedSampler` over ``dataset``'s rows, in blocks of one optimizer step's samples."""
        args = self.args
        step_samples = args.per_device_train_batch_size * data_parallel_size() * args.gradient_accumulation_steps
        return LengthGroupedSampler(row_lengths(dataset), step_samples, args.seed)


class LengthGroupedSampler(torch.utils.data.Sampler[int]):
    """Row indices of one epoch in :func:`length_grouped_order`'s order. ``lengths``: tokens of each row;
    ``step_samples``: samples per optimizer step over all processes; ``seed``: the run's seed. accelerate's data
    loader calls :meth:`set_epoch` before each epoch, a resumed one included."""

    def __init__(self, lengths: list[int], step_samples: int, seed: int) -> None:
        self.lengths, self.step_samples, self.seed, self.epoch = lengths, step_samples, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self) -> Iterator[int]:
        return iter(length_grouped_order(self.lengths, self.step_samples, self.seed, self.epoch).tolist())


def row_lengths(dataset: Any) -> list[int]:
    """Tokens of each row of a tokenized Hugging Face ``dataset`` (its ``input_ids`` column), counted by Arrow
    without reading the tokens into Python."""
    if "input_ids" not in getattr(dataset, "column_names", ()):
        raise DataError(
            "train.group_by_length needs the tokenized training rows (an input_ids column); this "
            f"dataset has {getattr(dataset, 'column_names', None)}: set train.group_by_length: false"
        )
    return pc.list_value_length(dataset.with_format("arrow")["input_ids"]).to_pylist()
