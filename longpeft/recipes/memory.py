"""A run's activation memory: the recipe's checkpointing settings (``auto`` chosen by the planner for this model,
launch and GPU) and tiled MLP, installed by :class:`TrainingMemory` when training begins (after the Trainer turned
checkpointing on and applied Liger's kernels, which they build on)."""

from __future__ import annotations

import sys
from typing import Any

import torch
from transformers import TrainerCallback

from ..launch import sequence_parallel_size
from ..launch.topology import world_size
from ..scale.checkpointing import CheckpointSettings, apply_checkpointing, decoder_layers
from ..scale.plan import GPU_PEAK_TFLOPS, GiB, resolve_checkpointing, shape_from_config
from ..scale.tiling import apply_tiled_mlp
from .schema import Recipe


def planned_launch(distributed_type: str, processes: int) -> str | None:
    """The ``longpeft plan --launch`` equivalent of the run's accelerate setup (``None`` for one process)."""
    if processes <= 1:
        return None
    if "DEEPSPEED" in distributed_type:
        return "ulysses" if sequence_parallel_size() > 1 else "zero3"
    return "fsdp2" if "FSDP" in distributed_type else "ddp"


def install_memory(recipe: Recipe, trainer: Any, model_config: Any) -> CheckpointSettings | None:
    """Add :class:`TrainingMemory` to ``trainer``; returns the checkpointing settings it installs when training
    begins, ``auto`` resolved by the planner on the model's real shape and this GPU's memory (None when
    transformers' own checkpointing runs as is: the recipe changes nothing the layers keep)."""
    checkpointing, train = None, recipe.train
    shapes_memory = train.checkpoint_layers != "all" or train.keep_attention != "none" or train.offload_checkpoints
    if train.backend == "transformers" and shapes_memory:
        if torch.cuda.is_available():  # this process's GPU: its kind and memory
            device = torch.cuda.get_device_properties(torch.cuda.current_device())
            name, memory_gib = device.name.lower(), device.total_memory / GiB
        else:  # the machine's RAM
            import psutil

            name, memory_gib = "", psutil.virtual_memory().total / GiB
        gpu = next((kind for kind in GPU_PEAK_TFLOPS if kind in name), "h100")
        processes, shape = world_size(), shape_from_config(model_config.to_dict())
        launch = planned_launch(str(trainer.accelerator.distributed_type), processes)
        checkpointing = resolve_checkpointing(recipe, shape, processes, memory_gib, gpu, launch)
    trainer.add_callback(TrainingMemory(checkpointing, train.mlp_tile_tokens))
    return checkpointing


class TrainingMemory(TrainerCallback):
    """Installs the run's checkpointing and tiled MLP when training begins, saying on stderr (main process) what each
    did. ``offloader`` then holds the counters of the offloaded layer inputs (None without offloading)."""

    def __init__(self, settings: CheckpointSettings | None, mlp_tile_tokens: int | None) -> None:
        self.settings, self.mlp_tile_tokens, self.offloader = settings, mlp_tile_tokens, None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        lines = []
        if self.settings is not None:
            self.offloader = apply_checkpointing(model, self.settings)
            layers = len(decoder_layers(model))
            lines.append(f"checkpointing: {self.settings.describe(layers, on_gpu=args.device.type == 'cuda')}")
        if self.mlp_tile_tokens:
            tiled = apply_tiled_mlp(model, self.mlp_tile_tokens)
            lines.append(
                f"MLP tiled: the MLP of {tiled} decoder layers runs {self.mlp_tile_tokens:,} tokens at a time in "
                "training (inputs longer than that), keeping one tile's intermediate activations"
            )
        if state.is_world_process_zero:
            for line in lines:
                print(f"longpeft: {line}", file=sys.stderr)
