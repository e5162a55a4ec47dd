"""The processes of a run as ``accelerate launch`` (or torchrun) set them up, and the refusals of a distributed
setup a recipe cannot run under."""

from __future__ import annotations

import os
from typing import Any

from ..errors import ConfigError
from . import check_context_parallel, check_sequence_parallel, check_sharded, sequence_parallel_size


def world_size() -> int:
    """Number of training processes (set by accelerate launch / torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def data_parallel_size() -> int:
    """Processes that each train on their own samples: all of them, except that sequence parallelism
    (``--launch ulysses``) gives one sample to every group of ``sp_size`` processes."""
    sp = sequence_parallel_size()
    if world_size() % sp:
        raise ConfigError(f"sequence parallel size {sp} does not divide the {world_size()} processes")
    return world_size() // sp


def gradient_accumulation(recipe: Any, data_parallel: int) -> int:
    """Accumulation steps so that ``train.per_device_batch_size`` x ``data_parallel`` (processes that train samples
    of their own) x steps = ``train.global_batch_size``; a ConfigError naming the fix when they do not divide it.
    ``train`` (every launch) and ``plan`` (every ``--gpus``) refuse the same recipes through it."""
    per_step = recipe.train.per_device_batch_size * data_parallel
    if recipe.train.global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size={recipe.train.global_batch_size} is not a multiple of "
            f"train.per_device_batch_size={recipe.train.per_device_batch_size} x {data_parallel} data-parallel "
            f"processes: --set train.global_batch_size to a multiple of {per_step}, or train on fewer GPUs"
        )
    return recipe.train.global_batch_size // per_step


def is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def check_distributed_type(distributed_type: Any) -> None:
    """Refuse a run whose launch config asked for FSDP or DeepSpeed but that accelerate set up otherwise (accelerate
    1.15 makes every multi-process CPU run plain DDP, ``MULTI_CPU``, whatever the config says)."""
    variables = {"FSDP": "ACCELERATE_USE_FSDP", "DEEPSPEED": "ACCELERATE_USE_DEEPSPEED"}
    asked = [name for name, variable in variables.items() if os.environ.get(variable, "false").lower() == "true"]
    got = str(distributed_type).rsplit(".", 1)[-1]
    if asked and got != asked[0]:
        raise ConfigError(
            f"the launch config asks for {asked[0]}, but accelerate set up {got}: accelerate runs FSDP and DeepSpeed "
            "only on GPUs (every multi-process CPU run is DDP); on CPU use --launch ddp (or accelerate launch "
            "--multi_gpu)"
        )


def check_parallelism(recipe: Any, accelerator: Any) -> None:
    """Refuse weight sharding (FSDP, DeepSpeed ZeRO-3), sequence or context parallelism that the recipe cannot run
    under (however it was configured: ``--launch`` or a user's own accelerate config)."""
    distributed_type = str(accelerator.distributed_type).rsplit(".", 1)[-1]
    deepspeed = getattr(accelerator.state, "deepspeed_plugin", None)
    if distributed_type == "FSDP":
        check_sharded(recipe, "FSDP")
    elif distributed_type == "DEEPSPEED" and deepspeed is not None and deepspeed.zero_stage == 3:
        check_sharded(recipe, "DeepSpeed ZeRO-3")
    if (parallelism := getattr(accelerator, "parallelism_config", None)) is None:
        return
    if parallelism.cp_enabled:
        check_context_parallel(recipe, packing=recipe.data.utk is not None)
    if parallelism.sp_enabled:
        check_sequence_parallel(recipe)
