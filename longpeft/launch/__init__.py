"""Launch configurations for one multi-GPU node (accelerate config files shipped with longpeft).

``launch_command(recipe, launch, gpus)`` builds the ``accelerate launch`` command of a recipe;
``check_launch`` refuses combinations known not to work, saying why and what to use instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

LAUNCHES = ("ddp", "fsdp2", "zero3", "ulysses")


def config_file(launch: str) -> Path:
    """The accelerate config file of a launch kind."""
    if launch not in LAUNCHES:
        raise ValueError(f"--launch {launch!r}: choose one of {', '.join(LAUNCHES)}")
    return Path(__file__).parent / f"{launch}.yaml"


def check_launch(recipe: Any, launch: str) -> None:
    """Refuse launch/recipe combinations that are known not to work (see DESIGN.md, Scale).

    Raises:
        ValueError: naming the combination, why it fails, and what to use instead.
    """
    config_file(launch)
    attention = recipe.model.attn_implementation
    if launch == "ulysses" and recipe.model.load_in_4bit:
        raise ValueError(
            "--launch ulysses with model.load_in_4bit: sequence parallelism over a 4-bit base is unproven "
            "(trl#4314, accelerate#3874); use --launch ddp with train.activation_offloading, or a bf16 base"
        )
    if launch == "ulysses" and attention == "eager":
        raise ValueError("--launch ulysses needs flash_attention_2 or sdpa attention (eager materialises the full score matrix)")
    if launch == "zero3" and recipe.finetune == "lora":
        from ..adapters import METHODS

        weighted = [name for name in recipe.method_configs() if METHODS[name].save is not None]
        if weighted:
            raise ValueError(
                f"--launch zero3 with finetune: lora and {', '.join(weighted)}: for a LoRA model's checkpoints "
                "DeepSpeed ZeRO-3 gathers only the trainable weights, and some of the method's own weights are "
                "frozen (they would be lost); use --launch fsdp2 or ddp, or finetune: method"
            )
    if launch == "zero3" and recipe.model.load_in_4bit:
        raise ValueError(
            "--launch zero3 with model.load_in_4bit: DeepSpeed ZeRO-3 cannot partition bitsandbytes 4-bit weights; "
            "use --launch fsdp2 (longpeft sets bnb_4bit_quant_storage to the compute dtype for it) or ddp"
        )


def check_context_parallel(recipe: Any, packing: bool = False) -> None:
    """torch context parallelism (accelerate ``cp_size``) is refused where it is known to fail."""
    if recipe.model.attn_implementation == "flash_attention_2":
        raise ValueError("context parallelism needs sdpa attention (it does not work with flash-attn); use --launch ulysses")
    if packing:
        raise ValueError("context parallelism does not support packed sequences; turn packing off")
    if recipe.model.load_in_4bit:
        raise ValueError("context parallelism with a 4-bit base (QLoRA) is unproven; use --launch ddp or a bf16 base")


def launch_command(recipe_name: str, launch: str, gpus: int, overrides: list[str] | None = None) -> list[str]:
    """``accelerate launch --config_file <launch>.yaml --num_processes N -m longpeft.cli train RECIPE [--set ...]``."""
    if gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {gpus}")
    command = ["accelerate", "launch", "--config_file", str(config_file(launch)), "--num_processes", str(gpus),
               "-m", "longpeft.cli", "train", recipe_name]
    for override in overrides or []:
        command += ["--set", override]
    return command
