"""The Trainer every run trains with: checkpoints that appear complete or not at all, a tied embedding written once.

- **Atomic checkpoints.** The Trainer's whole save (peft's adapter or the model, accelerate's FSDP shards, DeepSpeed's
  partitions, optimizer, scheduler, RNG states of every process, ``trainer_state.json``) goes into
  ``checkpoints/.saving/checkpoint-<step>``; once every process has written its part (a barrier), the main process
  renames it to ``checkpoints/checkpoint-<step>`` and only then rotates older ones away (``train.save_total_limit``).
  A kill at any moment of a save leaves nothing under a checkpoint's name, and the run keeps its last complete
  checkpoint through a rotation. A rename rather than a completion marker: it needs no knowledge of which files each
  save path writes (sharded saves write theirs from every process), and checkpoint folders stay what transformers
  and earlier runs know. The checkpoints folder must be one filesystem that every process writes to (as a resume
  of a sharded run already needs).
- **A tied embedding once.** peft writes a trained embedding tied to the output head twice; each checkpoint's
  adapter file keeps it once (:func:`~longpeft.adapter_weights.leave_out_tied_copies`) and a resume ties it again
  (:func:`~longpeft.adapter_weights.load_weights_into`). Sharded checkpoints (FSDP, DeepSpeed) keep their own
  formats.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..adapter_weights import leave_out_tied_copies, load_weights_into, missing_adapter_weights, tied_names
from ..errors import DataError
from .checkpoints import clear_staging, publish_checkpoint, staging_folder


def checkpoint_trainer(trainer_class: type) -> type:
    """A subclass of ``trainer_class`` (TRL's SFTTrainer, or unsloth's patch of it) with the checkpoints of the
    module docstring."""

    class CheckpointTrainer(trainer_class):
        _writing_to: Path | None = None  # while a checkpoint is saved: the folder it is written in

        def _get_output_dir(self, trial: Any) -> str:
            return str(self._writing_to) if self._writing_to is not None else super()._get_output_dir(trial)

        def _save_checkpoint(self, model: Any, trial: Any) -> None:
            from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

            checkpoints = Path(super()._get_output_dir(trial))
            name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            if self.args.should_save:
                clear_staging(checkpoints)
            self.accelerator.wait_for_everyone()  # nobody writes into it before it is cleared
            self._writing_to = staging_folder(checkpoints)
            try:
                super()._save_checkpoint(model, trial)
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

        def _save(self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None) -> None:
            super()._save(output_dir, state_dict)
            if self.args.should_save:
                leave_out_tied_copies(self.model, output_dir if output_dir is not None else self.args.output_dir)

        def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
            folder = Path(resume_from_checkpoint)
            sharded = self.is_fsdp_enabled or self.is_deepspeed_enabled
            if sharded or not tied_names(folder):
                super()._load_from_checkpoint(resume_from_checkpoint, model)
                return
            target = model if model is not None else self.model
            missing = missing_adapter_weights(target, load_weights_into(target, folder))
            if missing:
                raise DataError(
                    f"{folder}: its adapter lacks {len(missing)} weights of this run's (e.g. "
                    f"{missing[0]}); delete that checkpoint folder to resume from the one before, or "
                    "start again into a new output_dir"
                )

    CheckpointTrainer.__name__ = CheckpointTrainer.__qualname__ = f"Checkpoint{trainer_class.__name__}"
    return CheckpointTrainer
