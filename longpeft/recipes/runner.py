"""Run a recipe: base model -> ContextSpec -> LoRA/QLoRA -> TRL SFTTrainer -> adapter + longpeft.json.

Output folder (``recipe.output_dir``)::

    base/                 only for ``tiny:<arch>`` models: the generated base model and tokenizer
    checkpoints/          Trainer checkpoints every ``train.save_steps`` (``--resume`` continues from the last);
                          each is written under ``checkpoints/.saving`` and renamed once complete
    adapter/              LoRA adapter (and the method's own weights, e.g. beacon_adapter.safetensors) +
                          longpeft.json + tokenizer; only the method's weights with ``finetune: method``
    model/                instead of adapter/ with ``finetune: full``: the whole model + longpeft.json
    metrics.jsonl         one JSON object per logging step
    metrics.json          summary: final loss, steps, runtime, data counts, resolved settings
    loss.png              the loss curve
    recipe.resolved.json  the validated recipe and every derived setting
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase, TrainerCallback

from ..compat import ensure_trl_loss_kernel, plain_cpu_device, without_checkpointing_notice
from ..config import torch_dtype
from ..errors import ModelSourceError, OutputFolderError
from ..files import write_text_atomically, writing_to
from ..launch import check_sharded
from ..launch.topology import (
    check_distributed_type,
    check_parallelism,
    data_parallel_size,
    is_main_process,
    world_size,
)
from ..spec import ContextSpec
from ..synth_data.utk import add_utk_tokens
from . import unsloth_backend
from .checkpoint_trainer import checkpoint_trainer
from .checkpoints import check_recipe_change, checkpoint_step, latest_checkpoint, save_training_recipe, trim_metrics
from .data import (
    check_content_to_skip,
    check_data_source,
    filter_by_length,
    load_training_data,
    longest_sample,
    pack_for_utk,
    tokenize_dataset,
    utk_document_room,
    utk_limit,
)
from .init_from import adapter_folder, check_init_adapter, load_init_weights, report_differences
from .memory import TrainingMemory, checkpoint_settings, shapes_memory
from .method_trainer import method_checkpoint_trainer
from .model import (
    adapter_settings,
    base_location,
    builds_partitioned,
    check_base_source,
    expose_token_indices_head_bias,
    gathered_state_dict,
    keep_trained_weights_in,
    load_base,
    lora_config,
    method_parameters,
    quantization_config,
    save_adapter,
)
from .sampling import length_grouped_trainer
from .schema import Recipe
from .trainer import (
    ApplyOptimizerSettings,
    KeepRotaryFrequencies,
    MetricsLogger,
    StopOnNonFinite,
    assistant_only_loss,
    check_samples_left,
    data_collator,
    keeps_weights_outside_checkpoints,
    sft_config,
    train_or_take_last,
    with_method_labels,
)
from .validate import Validation, check_here, validate_recipe


@dataclass
class RunResult:
    """Where a run wrote its results; ``adapter_dir`` holds the full model with ``finetune: full``."""

    output_dir: Path
    adapter_dir: Path
    metrics: dict[str, Any]


@dataclass
class Prepared:
    """Everything the runner builds before training."""

    recipe: Recipe
    output_dir: Path
    trainer: Any
    tokenizer: PreTrainedTokenizerBase
    spec: ContextSpec
    data_stats: dict[str, int]
    resolved: dict[str, Any]


@without_checkpointing_notice()  # peft and TRL read a property transformers deprecates
def prepare(
    recipe: Recipe, callbacks: list[TrainerCallback] | None = None, validation: Validation | None = None
) -> Prepared:
    """Build the model, the data and the trainer of a recipe, in that order, without training (``longpeft plan
    --build`` prints the result's ``resolved`` settings). The recipe is validated first (``validation``, the
    result of :func:`~.validate.validate_recipe` when the caller ran it), then this machine (:func:`check_here`),
    every source the recipe names (:func:`check_sources`) and the stage it starts from (``model.init_from``)."""
    validation = validation or validate_recipe(recipe)
    check_here(validation)
    check_sources(recipe)
    # the stage it starts from, checked against the recipe and its base's config before any weight loads
    start = check_init_adapter(recipe, validation.spec, validation.base.config) if recipe.model.init_from else None
    fast = None
    if recipe.train.backend == "unsloth":
        fast = unsloth_backend.fast_language_model()  # before TRL is imported: unsloth patches its trainers
    ensure_trl_loss_kernel()  # trl < 1.16 without Triton (CPU) has no loss kernel
    output_dir = recipe.resolved_output_dir()
    output_dir.mkdir(parents=True, exist_ok=True)
    # a tiny: base is built before DeepSpeed's config exists (no zero.Init)
    base_id = base_location(recipe, output_dir)
    args = sft_config(recipe, output_dir)
    plain_cpu_device(args)  # transformers < 5.23 cannot resume a multi-process CPU run on "cpu:N"
    model, tokenizer, spec = build_model(recipe, base_id, args, fast)
    with args.main_process_first(local=True, desc="data"):
        dataset, data_stats = build_dataset(recipe, tokenizer)
    trainer = build_trainer(
        recipe,
        model,
        tokenizer,
        spec,
        dataset,
        args,
        [MetricsLogger(output_dir / "metrics.jsonl"), KeepRotaryFrequencies(model), *(callbacks or [])],
    )
    if start is not None:
        load_init_weights(trainer.model, start.folder, start.kind, spec)
        report_differences(start.folder, start.differences)
    check_samples_left(trainer, data_stats, recipe)
    checkpointing = build_memory(recipe, trainer, model.config)
    resolved = {
        "recipe": recipe.model_dump(),
        "base_model": base_id,
        "context_spec": spec.to_dict(),
        "world_size": world_size(),
        "distributed_type": str(trainer.accelerator.distributed_type),
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "effective_global_batch_size": args.per_device_train_batch_size
        * args.gradient_accumulation_steps
        * data_parallel_size(),
        "backend": recipe.train.backend,
        "lora": adapter_settings(trainer.model),
        "trainable_parameters": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "quantization": quantization_config(recipe).to_dict() if recipe.model.load_in_4bit else None,
        "data": data_stats,
        "init_from": start.to_dict() if start is not None else None,
        "checkpointing": dataclasses.asdict(checkpointing) if checkpointing is not None else None,
    }
    return Prepared(recipe, output_dir, trainer, tokenizer, spec, data_stats, resolved)


def check_sources(recipe: Recipe) -> None:
    """Every model, adapter and data set the recipe names (``model.name_or_path``, ``model.init_from``,
    ``data.source``), before anything is built: a local path must exist and is named as missing otherwise (never
    tried as a Hub id), a Hub id must answer within ``LONGPEFT_HUB_TIMEOUT``, and the downloads that follow are
    bounded by it too (:func:`longpeft.files.check_model_source`)."""
    check_base_source(recipe)
    if recipe.model.init_from:
        adapter_folder(recipe.model.init_from)  # a Hub adapter is downloaded now, before the base loads
    check_data_source(recipe.data)


def build_model(
    recipe: Recipe, base_id: str, args: Any, fast: Any
) -> tuple[Any, PreTrainedTokenizerBase, ContextSpec]:
    """The base with the recipe's methods applied (and LoRA, with unsloth's ``fast`` loader).

    Each process loads the base after the local main one (which downloads it once), except under DeepSpeed ZeRO-3,
    whose zero.Init partitions every weight while the model is built, with all processes taking part; a method that
    cannot train sharded is refused before then (it would read partitioned, empty weights).
    """
    partitioned = builds_partitioned(recipe)
    if partitioned:
        check_sharded(recipe, "DeepSpeed ZeRO-3")
    with nullcontext() if partitioned else args.main_process_first(local=True, desc="base model"):
        if fast is not None:
            return unsloth_backend.load_model(recipe, base_id, fast)  # LoRA added by unsloth
        return load_base(recipe, base_id)


def build_dataset(recipe: Recipe, tokenizer: PreTrainedTokenizerBase) -> tuple[Any, dict[str, int]]:
    """The tokenized training rows after the recipe's length rules, and their counts (``data_stats``): each sample
    kept, cut or dropped against ``data.max_length`` (PoSE's content skip: its simulated length); with UtK, the
    documents packed into sequences of ``data.max_length``."""
    dataset = tokenize_dataset(load_training_data(recipe.data, tokenizer), tokenizer, assistant_only_loss(recipe))
    utk, max_length = recipe.data.utk, recipe.data.max_length
    if utk is None:
        longest, limit = longest_sample(recipe)
        skips_content = longest > max_length
        dataset, data_stats = filter_by_length(
            dataset,
            longest,
            recipe.data.truncate,
            limit,
            min_length=recipe.data.min_length,
            window=max_length if skips_content else None,
        )
        if skips_content:
            check_content_to_skip(recipe, data_stats)
        return dataset, data_stats
    # documents are counted, kept or dropped (data.truncate) as they are, before packing
    room = utk_document_room(max_length, utk)
    dataset, data_stats = filter_by_length(
        dataset, room, recipe.data.truncate, utk_limit(max_length, room), min_length=recipe.data.min_length
    )
    letters = add_utk_tokens(tokenizer, max(utk.chunk_counts)).letters  # the tokens are in already
    dataset = pack_for_utk(dataset, max_length, utk, len(letters))
    data_stats["packed_sequences"] = len(dataset)
    return dataset, data_stats


def build_trainer(
    recipe: Recipe,
    model: Any,
    tokenizer: PreTrainedTokenizerBase,
    spec: ContextSpec,
    dataset: Any,
    args: Any,
    callbacks: list[TrainerCallback],
) -> Any:
    """TRL's SFTTrainer over the model (LoRA added by peft from the recipe's config), the dataset and the
    recipe's collator, with the trained weights' dtype, the method weights trainable and each method's label rule;
    refuses a distributed setup the recipe cannot run under."""
    from trl import SFTTrainer

    peft_config = lora_config(recipe, model) if recipe.train.backend == "transformers" else None
    if recipe.finetune == "method":  # the base stays frozen; only the method's weights train
        model.requires_grad_(False)
    trainer_class = checkpoint_trainer(SFTTrainer)
    if keeps_weights_outside_checkpoints(recipe, spec):
        trainer_class = method_checkpoint_trainer(trainer_class, spec, recipe.finetune)
    if recipe.train.group_by_length:
        trainer_class = length_grouped_trainer(trainer_class)
    trainer = trainer_class(
        model=model,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        data_collator=data_collator(recipe, spec, tokenizer),
        callbacks=callbacks,
    )
    expose_token_indices_head_bias(trainer.model)
    if recipe.train.backend == "transformers" and recipe.finetune in ("lora", "full"):
        trained_dtype = recipe.lora.trainable_dtype if recipe.finetune == "lora" else None
        keep_trained_weights_in(
            trainer.model, torch_dtype(trained_dtype or "float32"), torch_dtype(recipe.model.dtype)
        )
    for parameter in method_parameters(recipe, trainer.model).values():
        parameter.requires_grad_(True)  # peft froze everything but LoRA; the method's weights train too
    with_method_labels(trainer, spec)
    check_distributed_type(trainer.accelerator.distributed_type)
    check_parallelism(recipe, trainer.accelerator)
    return trainer


def build_memory(recipe: Recipe, trainer: Any, model_config: Any) -> Any:
    """What each layer keeps (:mod:`.memory`), installed when training begins; returns the checkpointing settings
    (None when transformers' own checkpointing runs as is)."""
    distributed_type = str(trainer.accelerator.distributed_type)
    checkpointing = None
    if recipe.train.backend == "transformers" and shapes_memory(recipe):
        checkpointing = checkpoint_settings(recipe, model_config, world_size(), distributed_type)
    trainer.add_callback(TrainingMemory(checkpointing, recipe.train.mlp_tile_tokens))
    return checkpointing


@without_checkpointing_notice()
def run(
    recipe: Recipe,
    resume: bool = False,
    callbacks: list[TrainerCallback] | None = None,
    allow_recipe_change: bool = False,
) -> RunResult:
    """Train a recipe end to end and write the output folder described in the module docstring.

    Args:
        resume: continue from the latest complete checkpoint in ``output_dir/checkpoints`` (after a
            kill). A run that had already finished is not trained again.
        allow_recipe_change: resume even though training keys of the recipe changed since the run
            started (otherwise refused, naming the keys); the run then goes on with, and records, this recipe.
    """
    validation = validate_recipe(recipe)  # before anything is written or loaded: what plan checks
    check_here(validation)
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
            if changed:  # allowed: the run goes on with this recipe, which later resumes compare with
                save_training_recipe(output_dir, recipe.model_dump())
        else:
            (output_dir / "metrics.jsonl").unlink(missing_ok=True)
            save_training_recipe(output_dir, recipe.model_dump())
    taken_up = [ApplyOptimizerSettings(recipe.train)] if changed else []  # the checkpoint restores the old ones
    prepared = prepare(recipe, [StopOnNonFinite(), *taken_up, *(callbacks or [])], validation)
    trainer = prepared.trainer
    if trainer.is_world_process_zero():
        write_text_atomically(
            output_dir / "recipe.resolved.json", json.dumps(prepared.resolved, indent=2, default=str) + "\n"
        )
    with writing_to(output_dir / "checkpoints"):
        train_metrics = train_or_take_last(trainer, checkpoint if resume else None)

    adapter_dir = output_dir / ("model" if recipe.finetune == "full" else "adapter")
    state_dict = gathered_state_dict(trainer)  # every process takes part when the model is sharded
    if trainer.is_world_process_zero():
        save_adapter(
            trainer.model,
            prepared.tokenizer,
            prepared.spec,
            adapter_dir,
            state_dict,
            recipe.finetune,
            torch_dtype(recipe.model.dtype),
        )
        metrics = summarize(output_dir, train_metrics, prepared)
    else:
        metrics = dict(train_metrics)
    trainer.accelerator.wait_for_everyone()
    return RunResult(output_dir, adapter_dir, metrics)


def summarize(output_dir: Path, train_metrics: dict[str, Any], prepared: Prepared) -> dict[str, Any]:
    """Write metrics.json and loss.png from metrics.jsonl; returns the summary."""
    from .plots import plot_loss

    trim_metrics(output_dir / "metrics.jsonl", prepared.trainer.state.global_step)
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [(r["step"], r["loss"]) for r in records if "loss" in r]
    summary = {
        "recipe": prepared.recipe.name,
        "steps": prepared.trainer.state.global_step,
        "first_loss": losses[0][1] if losses else None,
        "final_loss": losses[-1][1] if losses else None,
        "train": {k: v for k, v in train_metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)},
        "data": prepared.data_stats,
        "rope_parameters": prepared.spec.rope_parameters,
        "max_position_embeddings": prepared.spec.max_position_embeddings,
        "trainable_parameters": prepared.resolved["trainable_parameters"],
    }
    write_text_atomically(output_dir / "metrics.json", json.dumps(summary, indent=2) + "\n")
    with writing_to(output_dir):
        plot_loss(losses, output_dir / "loss.png", title=f"{prepared.recipe.name}: training loss")
    return summary
