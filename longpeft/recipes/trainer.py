"""The trainer of a recipe: TRL's SFTConfig from the recipe, the data collator (UtK's, a method's, or TRL's), each
method's training-label rule, the callbacks every run has, and :mod:`.recipe_trainer`'s class over the model."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase, TrainerCallback

from ..adapters import CollatorContext, spec_methods
from ..compat import ensure_trl_loss_kernel, plain_cpu_device
from ..errors import ConfigError, DataError, LongpeftError
from ..family import IGNORE_INDEX
from ..launch import mixed_precision, sequence_parallel_size
from ..launch.topology import check_distributed_type, check_parallelism, data_parallel_size, gradient_accumulation
from ..rope import rotary_modules
from ..spec import ContextSpec
from ..synth_data.utk import UtkAugmenter, UtkCollator, add_utk_tokens
from .data import longest_sample
from .peft_setup import lora_config, set_trained_weights
from .recipe_trainer import recipe_trainer_class
from .schema import TRAIN_KEYS_AS_IS, Recipe


def sft_config(recipe: Recipe, output_dir: Path):
    """TRL SFTConfig from :func:`sft_arguments` and the recipe's ``trl:`` section. Creating it sets up the processes
    (and DeepSpeed's config, which the base loads under)."""
    from trl import SFTConfig  # here, not at import: unsloth must patch TRL first (train.backend: unsloth)

    ensure_trl_loss_kernel()  # trl < 1.16 without Triton (CPU) has no loss kernel
    arguments = sft_arguments(recipe, output_dir)
    try:
        args = SFTConfig(**{**recipe.trl, **arguments})  # only pad_to_multiple_of is in both
    except (ValueError, TypeError) as error:  # a trl: value SFTConfig refuses (its own keys pass on this machine)
        if not recipe.trl:
            raise
        keys = ", ".join(f"trl.{key}" for key in recipe.trl)
        reason = " ".join(str(error).split())[:300]
        raise ConfigError(
            f"{keys}: trl.SFTConfig refuses the recipe's trl section ({reason}); fix or remove it"
        ) from error
    plain_cpu_device(args)  # transformers < 5.23 cannot resume a multi-process CPU run on "cpu:N"
    return args


def sft_arguments(recipe: Recipe, output_dir: Path) -> dict[str, Any]:
    """The SFTConfig arguments longpeft sets from the recipe (each one a key of ``TRL_KEYS_OWNED_BY_RECIPE``)."""
    from trl import SFTConfig

    t, use_cuda, sp = recipe.train, torch.cuda.is_available(), sequence_parallel_size()
    precision = mixed_precision(recipe, use_cuda)
    fields = {f.name for f in dataclasses.fields(SFTConfig)}  # transformers >= 5.23 warns on gradient_checkpointing
    checkpointing = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    arguments = dict(
        **{key: getattr(t, key) for key in TRAIN_KEYS_AS_IS},
        output_dir=str(output_dir / "checkpoints"),
        per_device_train_batch_size=t.per_device_batch_size,
        gradient_accumulation_steps=gradient_accumulation(recipe, data_parallel_size()),
        # unsloth checkpoints (and offloads) through its own get_peft_model(use_gradient_checkpointing="unsloth").
        **{checkpointing: t.gradient_checkpointing and t.backend == "transformers"},
        save_strategy="steps",
        data_seed=t.seed,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        use_cpu=not use_cuda,
        max_length=longest_sample(recipe)[0],  # TRL cuts samples to it
        # The assistant masks are computed by longpeft when the data is tokenized (any chat template).
        assistant_only_loss=False,
        packing=False,
        report_to=list(t.report_to) or "none",
        dataloader_num_workers=0,
        disable_tqdm=False,
    )
    if t.use_liger_kernel:  # Liger's layer kernels only: the loss stays TRL's fused LM head
        arguments.update(
            use_liger_kernel=True, liger_kernel_config={"fused_linear_cross_entropy": False, "cross_entropy": False}
        )
    if recipe.data.utk:  # UtK sequences are packed and augmented by longpeft's collator, which reads doc_lengths
        arguments.update(dataset_kwargs={"skip_prepare_dataset": True}, remove_unused_columns=False)
    if sp > 1:  # Ulysses shards every batch into sp equal slices of the sequence
        arguments["pad_to_multiple_of"] = math.lcm(sp, recipe.trl.get("pad_to_multiple_of") or 1)
    return arguments


def data_collator(recipe: Recipe, spec: ContextSpec, tokenizer: PreTrainedTokenizerBase):
    """UtK's collator with ``data.utk``; else the collator of the method that brings one (PoSE's); else None (TRL's).
    The recipe's validation refuses two of them."""
    utk, pad, max_length, seed = recipe.data.utk, tokenizer.pad_token_id, recipe.data.max_length, recipe.train.seed
    if utk is not None:
        augmenter = UtkAugmenter(add_utk_tokens(tokenizer, max(utk.chunk_counts)), **utk.model_dump())
        return UtkCollator(augmenter, pad, max_length, seed=seed)
    context = CollatorContext(pad_token_id=pad, max_length=max_length, seed=seed)
    collators = (method.collator(config, context) for method, config in spec_methods(spec))
    return next((collator for collator in collators if collator is not None), None)


class MethodTrainingLabels:
    """A data collator's batches with each method's ``training_labels`` rule applied to their labels (Activation
    Beacon leaves the first window out of the training loss with some layouts, as its authors do)."""

    def __init__(self, collator: Any, rules: list[tuple[Any, Any]]) -> None:
        self.collator, self.rules = collator, rules  # rules: [(Method, config)]

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        batch = self.collator(features)
        batch["labels"] = self.apply(batch["labels"])
        return batch

    def apply(self, labels: torch.Tensor) -> torch.Tensor:
        """``labels [batch, seq]`` after every rule."""
        for method, config in self.rules:
            labels = method.training_labels(config, labels)
        return labels

    def changes_labels(self, length: int) -> bool:
        """Whether the rules leave out any target of a fully scored ``[1, length]`` batch."""
        scored = torch.zeros(1, length, dtype=torch.long)
        return not torch.equal(self.apply(scored), scored)


def check_samples_left(trainer: Any, data_stats: dict[str, int], recipe: Recipe) -> None:
    """Drop the samples a method's ``training_labels`` rule leaves without a scored target, count them and those
    TRL's preparation dropped into ``data_stats``, and fail with what to do when none is left to train on."""
    collator, dataset = trainer.data_collator, trainer.train_dataset
    if isinstance(collator, MethodTrainingLabels) and collator.changes_labels(recipe.data.max_length):
        rows = tqdm(range(len(dataset)), desc="samples with scored targets", leave=False)
        scored = [i for i in rows if (collator([dataset[i]])["labels"][:, 1:] != IGNORE_INDEX).any()]
        if len(scored) < len(dataset):
            trainer.train_dataset = dataset = dataset.select(scored)
    left = len(dataset)
    rows = "packed_sequences" if "packed_sequences" in data_stats else "kept"  # what the trainer's rows are
    data_stats["dropped_without_scored_tokens"] = data_stats[rows] - left
    data_stats[rows] = left
    if left == 0:
        raise DataError(
            f"recipe {recipe.name}: no training sample has a scored token within data.max_length="
            f"{recipe.data.max_length} (the assistant turns were cut off, every label is masked, or a method leaves "
            "them out: Activation Beacon does not score the first window unless attn: full-coverage with pos: "
            "interleave); raise data.max_length, use longer samples or a smaller beacon.window, or set "
            "train.assistant_only_loss: false"
        )


class MetricsLogger(TrainerCallback):
    """Appends every Trainer log (loss, lr, grad norm, ...) to ``metrics.jsonl``, one line per step."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            with self.path.open("a") as f:
                f.write(json.dumps({"step": state.global_step, "epoch": state.epoch, **logs}) + "\n")


class KeepRotaryFrequencies(TrainerCallback):
    """Gives every rotary module its float32 frequencies back (with a warning) when training begins, after the
    Trainer wrapped the model: DeepSpeed releases with DeepSpeed#5812 cast buffers to bf16 too, and a frequency off
    by 0.2 % turns by hundreds of radians at position 100K."""

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


def build_trainer(
    recipe: Recipe,
    model: Any,
    tokenizer: PreTrainedTokenizerBase,
    spec: ContextSpec,
    dataset: Any,
    args: Any,
    output_dir: Path,
    callbacks: list[TrainerCallback],
) -> Any:
    """The recipe's trainer (:func:`~.recipe_trainer.recipe_trainer_class`) over the model with its trained weights
    set up (:mod:`.peft_setup`), the dataset, the collator and each method's label rule; metrics go to
    ``output_dir/metrics.jsonl``, then come ``callbacks``. Refuses a distributed setup the recipe cannot run under."""
    own_weights = any(method.keeps_weights for method, _ in spec_methods(spec))  # kept by its checkpoints
    if recipe.finetune == "method":
        model.requires_grad_(False)  # only the methods' own weights train (set_trained_weights)
    trainer = recipe_trainer_class()(
        model=model,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora_config(recipe, model),
        data_collator=data_collator(recipe, spec, tokenizer),
        callbacks=[MetricsLogger(output_dir / "metrics.jsonl"), KeepRotaryFrequencies(model), *callbacks],
        method_spec=spec if own_weights and recipe.finetune != "full" else None,  # a full model's hold them
        finetune=recipe.finetune,
        group_by_length=recipe.train.group_by_length,
    )
    set_trained_weights(recipe, trainer.model)
    rules = [(method, config) for method, config in spec_methods(spec) if method.overrides("training_labels")]
    if rules:  # around the recipe's collator, or the one TRL built
        trainer.data_collator = MethodTrainingLabels(trainer.data_collator, rules)
    check_distributed_type(trainer.accelerator.distributed_type)
    check_parallelism(recipe, trainer.accelerator)
    return trainer
