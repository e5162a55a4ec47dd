"""Multi-GPU launches (accelerate config files shipped beside this module), on one node or several (:mod:`.nodes`):
the ``accelerate launch`` command of a recipe, and the refusals of combinations known not to work."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..adapters import METHODS, check_conflicts
from ..errors import ConfigError
from .kinds import DEEPSPEED_LAUNCHES, LAUNCHES, SHARDED_LAUNCHES
from .nodes import Nodes


def config_file(launch: str) -> Path:
    """The accelerate config file of a launch kind."""
    if launch not in LAUNCHES:
        raise ConfigError(f"--launch {launch!r}: choose one of {', '.join(LAUNCHES)}")
    return Path(__file__).parent / f"{launch}.yaml"


def mixed_precision(recipe: Any, on_gpu: bool) -> str:
    """``bf16``, ``fp16`` (CUDA only) or ``no``: the autocast of a recipe's run, for SFTConfig and for ``accelerate
    launch`` (whose ``--mixed_precision`` the Trainer would otherwise take over the recipe's). Trained weights stay
    float32 under it, so that AdamW updates are not rounded away."""
    return {"bfloat16": "bf16", "float16": "fp16" if on_gpu else "no"}.get(recipe.model.dtype, "no")


def check_launch(recipe: Any, launch: str) -> None:
    """Refuse launch/recipe combinations known not to work, with a ConfigError naming the combination, why it
    fails and what to use instead (docs/scale.md, "One node")."""
    config_file(launch)
    if launch == "ulysses":
        check_sequence_parallel(recipe)
    if launch in SHARDED_LAUNCHES:
        check_sharded(recipe, f"--launch {launch}")
    if launch in DEEPSPEED_LAUNCHES and recipe.finetune == "lora":
        if weighted := [name for name in recipe.method_configs() if METHODS[name].keeps_weights]:
            raise ConfigError(
                f"--launch {launch} with finetune: lora and {', '.join(weighted)}: for a LoRA model's checkpoints "
                "DeepSpeed ZeRO-3 gathers only the trainable weights, and some of the method's own weights are "
                "frozen (they would be lost); use --launch fsdp2 or ddp, or finetune: method"
            )
    if launch in DEEPSPEED_LAUNCHES and recipe.train.backend == "unsloth":
        raise ConfigError(
            f"--launch {launch} with train.backend: unsloth: unsloth runs its own attention and "
            "checkpointing kernels, which DeepSpeed does not shard; use --launch ddp"
        )


def check_sharded(recipe: Any, how: str) -> None:
    """Refuse what cannot train with the weights sharded (``how``: ``--launch fsdp2``, ...): the methods whose
    registry ``conflicts`` name ``sharded_weights``, and the tiled MLP."""
    check_conflicts(recipe.method_configs(), {"sharded_weights": how})
    if recipe.train.mlp_tile_tokens:
        raise ConfigError(
            f"train.mlp_tile_tokens with {how}: the tiled MLP reads its layer's weights outside the sharded "
            "module's gather; use --launch ddp or remove train.mlp_tile_tokens"
        )


def check_sequence_parallel(recipe: Any) -> None:
    """Refuse what cannot run with each sequence split across GPUs (``--launch ulysses``), methods whose registry
    ``conflicts`` name ``split_sequences`` included."""
    if recipe.model.load_in_4bit:
        raise ConfigError(
            "--launch ulysses with model.load_in_4bit: sequence parallelism over a 4-bit base is unproven "
            "(trl#4314, accelerate#3874); use --launch ddp with train.activation_offloading, or a bf16 base"
        )
    if recipe.model.attn_implementation == "eager":
        raise ConfigError(
            "--launch ulysses needs flash_attention_2 or sdpa attention (eager materialises the full score matrix)"
        )
    check_conflicts(recipe.method_configs(), {"split_sequences": "--launch ulysses"})
    if recipe.data.utk is not None:
        raise ConfigError(
            "--launch ulysses with data.utk: UtK's collator gives no position_ids, so each sequence shard would "
            "restart its positions at 0; use --launch ddp or fsdp2 with train.activation_offloading"
        )
    if recipe.train.backend == "unsloth":
        raise ConfigError(
            "--launch ulysses with train.backend: unsloth: unsloth's attention kernels are not the ones "
            "Ulysses shards; use --launch ddp"
        )


def check_context_parallel(recipe: Any, packing: bool = False) -> None:
    """Refuse torch context parallelism (``cp_size`` in a user's own accelerate config) where it is known to fail,
    and with the methods whose ``conflicts`` name ``split_sequences``; ``packing``: documents are packed (UtK)."""
    if recipe.model.attn_implementation == "flash_attention_2":
        raise ConfigError(
            "context parallelism (accelerate cp_size > 1) needs sdpa attention (it does not work with "
            "flash-attn); use --launch ulysses"
        )
    if packing:
        raise ConfigError(
            "context parallelism (accelerate cp_size > 1) does not support packed sequences (data.utk "
            "packs documents); drop data.utk or use --launch ddp"
        )
    if recipe.model.load_in_4bit:
        raise ConfigError(
            "context parallelism (accelerate cp_size > 1) with a 4-bit base (QLoRA) is unproven; use "
            "--launch ddp or a bf16 base"
        )
    check_conflicts(recipe.method_configs(), {"split_sequences": "context parallelism (accelerate cp_size > 1)"})


def sequence_parallel_size() -> int:
    """GPUs that share one sequence under ``accelerate launch`` with sequence parallelism (1 without)."""
    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG") != "true":
        return 1
    return int(os.environ.get("PARALLELISM_CONFIG_SP_SIZE", "1"))


def check_sequence_parallel_group(processes: int, heads: int, kv_heads: int) -> None:
    """Refuse a Ulysses group (every process of every node) that does not divide the query heads, or neither
    divides nor is a multiple of the KV heads: DeepSpeed would refuse it when the model is built."""
    if heads % processes:
        raise ConfigError(
            f"--launch ulysses over {processes} processes: each process takes heads / processes of the "
            f"model's {heads} attention heads, and {processes} does not divide {heads}; use a number of "
            "GPUs in all (nodes x --gpus) that divides it, or --launch fsdp2 or zero3"
        )
    if kv_heads % processes and processes % kv_heads:
        raise ConfigError(
            f"--launch ulysses over {processes} processes: the model's {kv_heads} KV heads must be a "
            "multiple or a divisor of the processes (DeepSpeed splits or replicates them); use a "
            "number of GPUs in all (nodes x --gpus) that is, or --launch fsdp2 or zero3"
        )


def launch_command(
    recipe: Any,
    recipe_name: str,
    launch: str,
    gpus: int,
    overrides: list[str] | None = None,
    nodes: Nodes | None = None,
) -> list[str]:
    """``accelerate launch --config_file <launch>.yaml --num_processes P --mixed_precision M [this node's place]
    [Ulysses' sizes] -m longpeft.cli train RECIPE [--set ...]``, P = ``gpus`` per node x ``nodes.count`` (default:
    one node). With ``ulysses`` all P processes share each sequence, with the recipe's attention kernel."""
    if gpus < 1:
        raise ConfigError(f"--gpus must be >= 1, got {gpus}")
    nodes = nodes or Nodes()
    processes = str(gpus * nodes.count)
    command = ["accelerate", "launch", "--config_file", str(config_file(launch)), "--num_processes", processes]
    command += ["--mixed_precision", mixed_precision(recipe, on_gpu=True), *nodes.accelerate_arguments(launch)]
    if launch == "ulysses":
        command += ["--parallelism_config_sp_size", processes]
        command += ["--parallelism_config_sp_attn_implementation", recipe.model.attn_implementation]
    command += ["-m", "longpeft.cli", "train", recipe_name]
    return command + [word for override in overrides or [] for word in ("--set", override)]
