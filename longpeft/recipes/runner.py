"""Run a recipe: base model -> ContextSpec -> LoRA/QLoRA -> TRL SFTTrainer -> adapter + longpeft.json, written
into the output folder that docs/recipes.md ("A run's output folder") describes."""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from ..compat import without_checkpointing_notice
from ..files import write_text_atomically
from ..launch.topology import data_parallel_size, world_size
from . import unsloth_backend
from .base import base_location, check_base_source, load_base, load_model, quantization_config
from .data import build_dataset, check_data_source
from .init_from import check_init_adapter
from .memory import install_memory
from .peft_setup import adapter_settings
from .resume import ApplyOptimizerSettings, start_run, train_or_take_last
from .saving import Prepared, save_run
from .schema import Recipe
from .trainer import StopOnNonFinite, build_trainer, check_samples_left, sft_config
from .validate import Validation, check_here, validate_recipe


@dataclass
class RunResult:
    """Where a run wrote its results; ``adapter_dir`` holds the full model with ``finetune: full``."""

    output_dir: Path
    adapter_dir: Path
    metrics: dict[str, Any]


@without_checkpointing_notice()  # peft and TRL read a property transformers deprecates
def prepare(
    recipe: Recipe, callbacks: list[TrainerCallback] | None = None, validation: Validation | None = None
) -> Prepared:
    """Build the model, the data and the trainer of a recipe without training (``longpeft plan --build``), after
    :func:`~.validate.validate_recipe` (``validation``, when the caller ran it) and :func:`check_here`."""
    validation = validation or validate_recipe(recipe)
    check_here(validation)
    return build(recipe, validation, recipe.resolved_output_dir(), callbacks or [])


def build(recipe: Recipe, validation: Validation, output_dir: Path, callbacks: list[TrainerCallback]) -> Prepared:
    """:func:`prepare`'s steps after the checks of the recipe and this machine: the sources the recipe names (bounded
    Hub checks) and ``model.init_from`` checked, then the base, the data, the trainer and the run's memory built."""
    check_base_source(recipe)
    start = check_init_adapter(recipe, validation.spec, validation.base.config) if recipe.model.init_from else None
    check_data_source(recipe.data)
    loader = load_base
    if recipe.train.backend == "unsloth":  # FastLanguageModel imported now, before TRL: unsloth patches its trainers
        loader = functools.partial(unsloth_backend.load_model, fast=unsloth_backend.fast_language_model())
    output_dir.mkdir(parents=True, exist_ok=True)
    base_id = base_location(recipe, output_dir)  # a tiny: base is built before DeepSpeed's config exists
    args = sft_config(recipe, output_dir)
    model, tokenizer, spec = load_model(recipe, base_id, args, loader)
    with args.main_process_first(local=True, desc="data"):
        dataset, data_stats = build_dataset(recipe, tokenizer)
    trainer = build_trainer(recipe, model, tokenizer, spec, dataset, args, output_dir, callbacks)
    if start is not None:  # the weights of the stage the run starts from (model.init_from)
        start.load_into(trainer.model, spec)
    check_samples_left(trainer, data_stats, recipe)
    checkpointing = install_memory(recipe, trainer, model.config)
    per_step_samples = args.per_device_train_batch_size * args.gradient_accumulation_steps  # on each process
    resolved = {
        "recipe": {**recipe.model_dump(), "output_dir": str(output_dir.resolve())},  # {name} filled in, absolute
        "base_model": base_id,
        "context_spec": spec.to_dict(),
        "world_size": world_size(),
        "distributed_type": str(trainer.accelerator.distributed_type),
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "effective_global_batch_size": per_step_samples * data_parallel_size(),
        "backend": recipe.train.backend,
        "lora": adapter_settings(trainer.model),
        "trainable_parameters": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "quantization": quantization_config(recipe).to_dict() if recipe.model.load_in_4bit else None,
        "data": data_stats,
        "init_from": start.to_dict() if start is not None else None,
        "checkpointing": dataclasses.asdict(checkpointing) if checkpointing is not None else None,
    }
    return Prepared(recipe, output_dir, trainer, tokenizer, spec, data_stats, resolved)


@without_checkpointing_notice()
def run(
    recipe: Recipe,
    resume: bool = False,
    callbacks: list[TrainerCallback] | None = None,
    allow_recipe_change: bool = False,
) -> RunResult:
    """Train a recipe end to end and write its output folder (docs/recipes.md).

    Args:
        resume: continue from the latest complete checkpoint in ``output_dir/checkpoints`` (a finished run is not
            trained again).
        allow_recipe_change: resume even though training keys of the recipe changed since the run started
            (otherwise refused, naming the keys); the run then goes on with, and records, this recipe.
    """
    validation = validate_recipe(recipe)  # before anything is written or loaded: what plan checks
    check_here(validation)
    start = start_run(recipe, resume, allow_recipe_change)
    taken_up = [ApplyOptimizerSettings(recipe.train)] if start.changed else []  # the checkpoint restores the old ones
    prepared = build(recipe, validation, start.output_dir, [StopOnNonFinite(), *taken_up, *(callbacks or [])])
    trainer, output_dir = prepared.trainer, prepared.output_dir
    if trainer.is_world_process_zero():
        resolved = json.dumps(prepared.resolved, indent=2, default=str) + "\n"
        write_text_atomically(output_dir / "recipe.resolved.json", resolved)
    train_metrics = train_or_take_last(trainer, start.checkpoint)
    adapter_dir, metrics = save_run(prepared, train_metrics)
    trainer.accelerator.wait_for_everyone()
    return RunResult(output_dir, adapter_dir, metrics)
