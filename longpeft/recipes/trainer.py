"""TRL's trainer for a recipe: the SFTConfig arguments longpeft sets, the data collators (UtK's, a method's, TRL's),
each method's training-label rule, and the callbacks a run needs (metrics, rotary frequencies, stopping).
"""

from __future__ import annotations

import json
import math
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase, TrainerCallback

from ..adapters import CollatorContext, spec_methods
from ..errors import ConfigError, DataError, LongpeftError
from ..family import IGNORE_INDEX
from ..launch.topology import data_parallel_size, gradient_accumulation
from ..reading import REFUSED_FOR_SAFETY
from ..spec import ContextSpec
from ..synth_data.utk import UtkAugmenter, UtkCollator, add_utk_tokens
from .checkpoints import is_finished
from .data import longest_sample
from .schema import Recipe


def checkpointing_argument(config_class: type, enabled: bool) -> dict[str, bool]:
    """Activation checkpointing under its current name (transformers >= 5.23: ``activation_checkpointing``,
    earlier: ``gradient_checkpointing``), so no deprecation warning is printed on either."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(config_class)}
    return {"activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing": enabled}


def sft_config(recipe: Recipe, output_dir: Path):
    """TRL SFTConfig with every optimisation setting of the recipe, plus its ``trl:`` section (whose keys the
    recipe's validation keeps apart from :func:`sft_arguments`'s: ``schema.check_trl_keys``)."""
    from trl import SFTConfig

    arguments = sft_arguments(recipe, output_dir)
    try:
        return SFTConfig(**{**recipe.trl, **arguments})  # only pad_to_multiple_of is in both
    except (ValueError, TypeError) as error:  # a trl: value SFTConfig refuses (its own keys pass on this machine)
        if not recipe.trl:
            raise
        keys = ", ".join(f"trl.{key}" for key in recipe.trl)
        reason = " ".join(str(error).split())[:300]
        raise ConfigError(
            f"{keys}: trl.SFTConfig refuses the recipe's trl section ({reason}); fix or remove it"
        ) from error


def sft_arguments(recipe: Recipe, output_dir: Path) -> dict[str, Any]:
    """The SFTConfig arguments longpeft sets from the recipe (each one a key of ``TRL_KEYS_OWNED_BY_RECIPE``)."""
    from trl import SFTConfig

    from ..launch import mixed_precision, sequence_parallel_size

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


def assistant_only_loss(recipe: Recipe) -> bool:
    """Loss on assistant turns only: the recipe's setting, on by default for conversations."""
    return recipe.data.format == "messages" and recipe.train.assistant_only_loss is not False


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


def keeps_weights_outside_checkpoints(recipe: Recipe, spec: ContextSpec) -> bool:
    """Whether Trainer checkpoints would miss (or needlessly hold) some weights: a LoRA or ``finetune: method``
    run with methods that have weights of their own (see :mod:`.method_trainer`)."""
    return recipe.finetune != "full" and any(method.keeps_weights for method, _ in spec_methods(spec))


class TrainingDiverged(LongpeftError, ValueError):
    """The loss or the gradient norm became NaN or infinite; the run stopped (the message says what to change)."""


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
        from ..rope import rotary_modules

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


class CheckpointLoaded(Exception):
    """Raised by :class:`StopBeforeTraining` once the Trainer has loaded the checkpoint it resumes from."""


class StopBeforeTraining(TrainerCallback):
    """Ends ``trainer.train(resume_from_checkpoint=...)`` when training begins: by then the Trainer has wrapped the
    model (DeepSpeed's engine, FSDP) and loaded the checkpoint's weights and state into it, and no step has run.
    The runner uses it to save a finished run whose adapter a kill lost."""

    def on_train_begin(self, args, state, control, **kwargs):
        raise CheckpointLoaded


class ApplyOptimizerSettings(TrainerCallback):
    """A resumed run with a changed recipe (--allow-recipe-change) takes up its learning rate and Adam betas: the
    checkpoint's optimizer and scheduler state, loaded before training begins, restore the ones the run started
    with. The schedule's shape (warmup, decay, steps) follows the new recipe already; its base rate is set here, and
    the first resumed step runs at the new schedule's rate for its step (with more ``train.max_steps``, the old
    schedule's last rate, often 0, would otherwise be used once). ``train``: the recipe's train section."""

    def __init__(self, train: Any):
        self.train = train

    def on_train_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
        scheduler = getattr(lr_scheduler, "scheduler", lr_scheduler)  # accelerate wraps it
        groups = optimizer.param_groups
        for index, group in enumerate(groups):
            group["initial_lr"] = self.train.learning_rate
            if "betas" in group:
                group["betas"] = (self.train.adam_beta1, self.train.adam_beta2)
            if scheduler is not None:
                scheduler.base_lrs[index] = self.train.learning_rate
                group["lr"] = self.train.learning_rate * scheduler.lr_lambdas[index](scheduler.last_epoch)
        if scheduler is not None:  # what the Trainer logs as this step's learning rate
            scheduler._last_lr = [group["lr"] for group in groups]


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


def planned_steps(trainer: Any) -> int:
    """The optimizer steps the run trains in all: ``train.max_steps``, else the epochs over the data loader
    (``ceil(num_train_epochs x updates per epoch)``, computed by transformers itself)."""
    return trainer.set_initial_training_values(trainer.args, trainer.get_train_dataloader())[-1]


def train_or_take_last(trainer: Any, checkpoint: Path | None) -> dict[str, Any]:
    """Train (from ``checkpoint`` when resuming) and return the Trainer's metrics; a checkpoint of the run's last
    step is only loaded (killed after it, or finished: its weights are taken, no step runs; the Trainer loads it
    itself, a sharded one into the wrapped model, and :class:`StopBeforeTraining` stops it before its first step).
    A checkpoint file that weights-only loading refuses (a pickle payload), or weights of other shapes than the
    recipe's model, end in a DataError naming the checkpoint.
    """
    import pickle

    try:
        if checkpoint is not None and is_finished(checkpoint, planned_steps(trainer)):
            print(f"longpeft: {checkpoint.name} is the run's last step; saving it without training", file=sys.stderr)
            trainer.add_callback(StopBeforeTraining())
            try:
                trainer.train(resume_from_checkpoint=str(checkpoint))
            except CheckpointLoaded:
                pass
            return {}
        return trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint is not None else None).metrics
    except pickle.UnpicklingError:
        if checkpoint is None:
            raise
        raise DataError(
            f"{checkpoint}: a file there is {REFUSED_FOR_SAFETY} (Python objects that weights-only "
            "loading does not run); delete that checkpoint folder to resume from the one before, or "
            "start again into a new output_dir"
        ) from None
    except RuntimeError as error:  # torch's load_state_dict: the recipe builds other shapes than the run's
        if checkpoint is None or "size mismatch" not in str(error):
            raise
        first = next(line.strip() for line in str(error).splitlines() if "size mismatch" in line)
        raise DataError(
            f"{checkpoint}: its weights have other shapes than this recipe's model ({first}); resume "
            "with the recipe the run started with, or train into a new output_dir"
        ) from None
