"""The trainer of a recipe, wired from what the steps before built: TRL's SFTConfig from the recipe's settings, the
data collator (UtK's, a method's, or TRL's), each method's training-label rule, the callbacks every run has
(metrics, rotary frequencies, stopping), and the trainer class with longpeft's checkpoints (:mod:`.recipe_trainer`)
over the model whose trained weights :mod:`.peft_setup` sets up.
"""

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
from .init_from import InitAdapter, load_init_weights, report_differences
from .peft_setup import peft_config, set_trained_weights
from .recipe_trainer import recipe_trainer_class
from .schema import Recipe


def checkpointing_argument(config_class: type, enabled: bool) -> dict[str, bool]:
    """Activation checkpointing under its current name (transformers >= 5.23: ``activation_checkpointing``,
    earlier: ``gradient_checkpointing``), so no deprecation warning is printed on either."""
    fields = {f.name for f in dataclasses.fields(config_class)}
    return {"activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing": enabled}


def sft_config(recipe: Recipe, output_dir: Path):
    """TRL SFTConfig with every optimisation setting of the recipe, plus its ``trl:`` section (whose keys the
    recipe's validation keeps apart from :func:`sft_arguments`'s: ``schema.check_trl_keys``). Creating it sets up
    the processes (and DeepSpeed's config, which the base loads under). On the older stack, TRL gets its loss
    kernel and a multi-process CPU run the plain ``cpu`` device (:mod:`longpeft.compat`)."""
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

    t = recipe.train
    use_cuda = torch.cuda.is_available()
    precision = mixed_precision(recipe, use_cuda)
    sp = sequence_parallel_size()
    return dict(
        output_dir=str(output_dir / "checkpoints"),
        learning_rate=t.learning_rate,
        lr_scheduler_type=t.lr_scheduler_type,
        warmup_steps=t.warmup_steps,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        optim=t.optim,
        per_device_train_batch_size=t.per_device_batch_size,
        gradient_accumulation_steps=gradient_accumulation(recipe, data_parallel_size()),
        num_train_epochs=t.num_train_epochs,
        max_steps=t.max_steps,
        # unsloth checkpoints (and offloads) through its own get_peft_model(use_gradient_checkpointing="unsloth").
        **checkpointing_argument(SFTConfig, t.gradient_checkpointing and t.backend == "transformers"),
        activation_offloading=t.activation_offloading,
        # Liger's layer kernels only: the loss stays TRL's fused LM head (Liger's fused loss would replace it)
        **(
            {
                "use_liger_kernel": True,
                "liger_kernel_config": {"fused_linear_cross_entropy": False, "cross_entropy": False},
            }
            if t.use_liger_kernel
            else {}
        ),
        save_strategy="steps",
        save_steps=t.save_steps,
        save_total_limit=t.save_total_limit,
        logging_steps=t.logging_steps,
        max_grad_norm=t.max_grad_norm,
        seed=t.seed,
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
        # UtK sequences are packed and augmented by longpeft's collator, which reads doc_lengths.
        **(
            {"dataset_kwargs": {"skip_prepare_dataset": True}, "remove_unused_columns": False}
            if recipe.data.utk
            else {}
        ),
        # Ulysses shards every batch into sp equal slices of the sequence
        **({"pad_to_multiple_of": math.lcm(sp, recipe.trl.get("pad_to_multiple_of") or 1)} if sp > 1 else {}),
    )


def data_collator(recipe: Recipe, spec: ContextSpec, tokenizer: PreTrainedTokenizerBase):
    """UtK's collator (on-the-fly augmentation of packed documents) with ``data.utk``; else the collator of the
    method that brings one (its ``collator``: PoSE's skip-wise position ids); else None (TRL's). The
    recipe's validation refuses two of them (``registry.find_conflicts``)."""
    utk = recipe.data.utk
    if utk is not None:
        augmenter = UtkAugmenter(
            add_utk_tokens(tokenizer, max(utk.chunk_counts)),
            probability=utk.probability,
            chunk_counts=utk.chunk_counts,
            min_split_tokens=utk.min_split_tokens,
            preserve_order=utk.preserve_order,
            label_length=utk.label_length,
        )
        return UtkCollator(augmenter, tokenizer.pad_token_id, recipe.data.max_length, seed=recipe.train.seed)
    context = CollatorContext(
        pad_token_id=tokenizer.pad_token_id, max_length=recipe.data.max_length, seed=recipe.train.seed
    )
    collators = (method.collator(config, context) for method, config in spec_methods(spec))
    return next((collator for collator in collators if collator is not None), None)


class MethodTrainingLabels:
    """A data collator's batches with each method's ``training_labels`` rule applied to their labels (Activation
    Beacon leaves the first window out of the training loss with some layouts, as its authors do)."""

    def __init__(self, collator: Any, rules: list[tuple[Any, Any]]) -> None:
        self.collator = collator
        self.rules = rules  # [(Method, config)]

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
        """Whether the rules leave out any target of a fully scored ``[1, length]`` batch (beacon's released
        layout leaves none: then no sample needs checking)."""
        scored = torch.zeros(1, length, dtype=torch.long)
        return not torch.equal(self.apply(scored), scored)


def with_method_labels(trainer: Any, spec: ContextSpec) -> None:
    """Wrap ``trainer.data_collator`` (the recipe's, or the one TRL built) in :class:`MethodTrainingLabels` when a
    method of ``spec`` has a ``training_labels`` rule."""
    rules = [(method, config) for method, config in spec_methods(spec) if method.overrides("training_labels")]
    if rules:
        trainer.data_collator = MethodTrainingLabels(trainer.data_collator, rules)


def check_samples_left(trainer: Any, data_stats: dict[str, int], recipe: Recipe) -> None:
    """Drop the samples a method's ``training_labels`` rule leaves without a scored target (Activation Beacon's
    first window can hold a short sample's every answer), count them and those TRL's own preparation dropped (with
    ``data.truncate``, samples whose every scored token was cut off) into ``data_stats``, and fail with what to do
    when none is left to train on."""
    collator, dataset = trainer.data_collator, trainer.train_dataset
    if isinstance(collator, MethodTrainingLabels) and collator.changes_labels(recipe.data.max_length):
        scored = [
            i
            for i in tqdm(range(len(dataset)), desc="samples with scored targets", leave=False)
            if (collator([dataset[i]])["labels"][:, 1:] != IGNORE_INDEX).any()
        ]
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
    """Gives every rotary module its float32 frequencies back when training begins.

    DeepSpeed releases with DeepSpeed#5812 cast the whole module to bf16 when they wrap it, buffers included, which
    rounds ``inv_freq`` (and ``original_inv_freq``) to 8 bits of mantissa: at position 100K a frequency off by 0.2 %
    turns by hundreds of radians. (0.19.8, the one longpeft pins, casts parameters only: a bf16 ZeRO-3 run on CPU
    leaves the buffers float32.) The float32 values are kept from ``prepare`` and put back (with a warning) at
    ``on_train_begin``, after the Trainer has wrapped the model, whatever wrapper cast them.
    """

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
    start: InitAdapter | None = None,
) -> Any:
    """TRL's SFTTrainer with :mod:`.recipe_trainer`'s hooks over the model (LoRA added by peft from
    :func:`~.peft_setup.peft_config`), the dataset and the recipe's collator, with the trained weights set up
    (:func:`~.peft_setup.set_trained_weights`) and each method's label rule; the steps' metrics go to
    ``output_dir/metrics.jsonl``, the rotary frequencies stay float32, then come ``callbacks``. Refuses a
    distributed setup the recipe cannot run under, then copies in the weights of the stage the run starts from
    (``start``: ``model.init_from``)."""
    own_weights = any(method.keeps_weights for method, _ in spec_methods(spec))  # kept by its checkpoints
    trainer = recipe_trainer_class()(
        model=model,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config(recipe, model),
        data_collator=data_collator(recipe, spec, tokenizer),
        callbacks=[MetricsLogger(output_dir / "metrics.jsonl"), KeepRotaryFrequencies(model), *callbacks],
        method_spec=spec if own_weights and recipe.finetune != "full" else None,  # a full model's hold them
        finetune=recipe.finetune,
        group_by_length=recipe.train.group_by_length,
    )
    set_trained_weights(recipe, trainer.model)
    with_method_labels(trainer, spec)
    check_distributed_type(trainer.accelerator.distributed_type)
    check_parallelism(recipe, trainer.accelerator)
    if start is not None:
        load_init_weights(trainer.model, start.folder, start.kind, spec)
        report_differences(start.folder, start.differences)
    return trainer
