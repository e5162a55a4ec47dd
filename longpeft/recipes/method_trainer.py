"""Trainer checkpoints that keep the methods' own weights (Activation Beacon's) and nothing they need not.

A Trainer checkpoint holds what ``Trainer._save`` writes: peft's adapter for a LoRA run, the whole model
otherwise. A method with weights of its own (a registry ``save``/``load`` hook) needs them in every
checkpoint, so the runner trains with :func:`method_checkpoint_trainer`'s subclass of the Trainer:

- ``finetune: lora``: the method weights are written beside peft's adapter;
- ``finetune: method``: the base is frozen, so a checkpoint holds the method weights, the tokenizer and
  the training arguments only (beacon q/k/v on Llama-3-8B: 805M float32 weights, 3.2 GB, where the
  Trainer would write the whole model, 19 GB).

The method weights are written first, inside the Trainer's save of the model, before the optimizer state
and ``trainer_state.json``: a kill while a checkpoint is written leaves one that ``latest_checkpoint``
skips, never a complete-looking one without them. Sharded runs (FSDP, DeepSpeed) keep saving and restoring
the whole model in their own formats; the method files come from the state dict the Trainer gathered.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ..adapters import load_method_weights, save_method_weights
from ..errors import DataError
from ..spec import ContextSpec

TRAINING_ARGS_NAME = "training_args.bin"  # as transformers names it


def restore_method_weights(model: Any, spec: ContextSpec, checkpoint: Path) -> None:
    """Load the method weights of ``checkpoint`` into ``model``, with an error that says what to do."""
    try:
        load_method_weights(model, spec, checkpoint)
    except FileNotFoundError as exc:
        raise DataError(
            f"{checkpoint} lacks the method weights of this run (written by another longpeft version, "
            f"or the recipe's methods changed): delete that folder to resume from the checkpoint "
            f"before it, or start again ({exc})"
        ) from exc


def method_checkpoint_trainer(trainer_class: type, spec: ContextSpec, finetune: str) -> type:
    """A subclass of ``trainer_class`` (TRL's SFTTrainer, or unsloth's patch of it) whose checkpoints keep the
    weights of ``spec``'s methods; ``finetune``: ``lora`` or ``method`` (see the module docstring)."""
    if finetune not in ("lora", "method"):
        raise ValueError(f"method checkpoints are for finetune lora or method, not {finetune!r}")

    class MethodCheckpointTrainer(trainer_class):
        def _save(self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None) -> None:
            folder = Path(output_dir if output_dir is not None else self.args.output_dir)
            if self.args.should_save:
                folder.mkdir(parents=True, exist_ok=True)
                # DeepSpeed passes {} when it could not gather (the model is then saved in its own format).
                save_method_weights(self.model, spec, folder, state_dict or None)
            if finetune == "lora":
                super()._save(str(folder), state_dict)
            elif self.args.should_save:  # the frozen base is not saved again
                if self.processing_class is not None:
                    self.processing_class.save_pretrained(folder)
                torch.save(self.args, os.path.join(folder, TRAINING_ARGS_NAME))

        def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
            sharded = self.is_fsdp_enabled or self.is_deepspeed_enabled  # their checkpoints hold the whole model
            if finetune == "lora" or sharded:
                super()._load_from_checkpoint(resume_from_checkpoint, model)
            if not sharded:
                restore_method_weights(self.model, spec, Path(resume_from_checkpoint))

    MethodCheckpointTrainer.__name__ = MethodCheckpointTrainer.__qualname__ = (
        f"MethodCheckpoint{trainer_class.__name__}"
    )
    return MethodCheckpointTrainer
