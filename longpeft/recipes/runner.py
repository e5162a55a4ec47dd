"""Run a recipe: base model -> ContextSpec -> LoRA/QLoRA -> TRL SFTTrainer -> adapter + longpeft.json.

Output folder (``recipe.output_dir``)::

    base/                 only for ``tiny:<arch>`` models: the generated base model and tokenizer
    checkpoints/          Trainer checkpoints every ``train.save_steps`` (``--resume`` continues from the last)
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
import os
import sys
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    BitsAndBytesConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    TrainerCallback,
)

from ..adapters import (
    METHODS,
    ResolveContext,
    apply_spec,
    export_methods,
    save_method_weights,
    spec_methods,
)
from ..config import torch_dtype
from ..spec import ContextSpec, recipe_hash
from ..synth_data.utk import UtkAugmenter, UtkCollator, add_utk_tokens
from .checkpoints import changed_keys, checkpoint_step, is_finished, latest_checkpoint, save_training_recipe, trim_metrics
from .data import (filter_by_length, load_training_data, pack_for_utk, tokenize_dataset, utk_document_room,
                   utk_limit)
from .init_from import check_init_adapter, load_init_weights, report_differences
from .memory import TrainingMemory, check_memory_options, checkpoint_settings, shapes_memory
from .method_trainer import method_checkpoint_trainer
from .schema import Recipe

TINY_PREFIX = "tiny:"


@dataclass
class RunResult:
    """Where a run wrote its results; ``adapter_dir`` holds the full model with ``finetune: full``."""

    output_dir: Path
    adapter_dir: Path
    metrics: dict[str, Any]


# ---------------------------------------------------------------------------------------------
# Base model
# ---------------------------------------------------------------------------------------------


def materialize_tiny_base(name: str, folder: Path, seed: int) -> Path:
    """Write the tiny model ``tiny:<arch>`` and its in-memory-trained tokenizer to ``folder`` (once,
    atomically: written beside it and renamed, so a kill or a full disk never leaves a partial base). Processes
    of one run may all call it at once: each builds the same base (seeded), the first rename wins, and the others
    use its folder."""
    import shutil
    import tempfile

    from ..tiny import demo_tokenizer, tiny_model

    if (folder / "config.json").is_file():
        return folder
    if folder.exists():  # an earlier write was cut short (a kill, a full disk): never use it
        shutil.rmtree(folder)
    arch = name[len(TINY_PREFIX):]
    tokenizer = demo_tokenizer()
    model = tiny_model(arch, seed=seed, vocab_size=len(tokenizer))
    model.config.name_or_path = name
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".base-"))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(folder)  # atomic: the folder appears complete or not at all
        except OSError:
            if not (folder / "config.json").is_file():  # not another process's complete base: a real failure
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def builds_partitioned(recipe: Recipe) -> bool:
    """Whether loading the base builds it partitioned across processes (DeepSpeed ZeRO-3's ``zero.Init``, which
    transformers uses for unquantized models under a ZeRO-3 config with ``zero3_init_flag``): a collective step."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    return is_deepspeed_zero3_enabled() and not recipe.model.load_in_4bit


def base_location(recipe: Recipe, output_dir: Path) -> str:
    """Hub id or local folder of the base model (tiny models are written under ``output_dir/base``;
    built-in models such as ``longpeft:toy-base`` are packaged folders)."""
    from ..builtin_models import model_location

    name = recipe.model.name_or_path
    if name.startswith(TINY_PREFIX):
        return str(materialize_tiny_base(name, output_dir / "base", recipe.train.seed))
    return model_location(name)


def quantization_config(recipe: Recipe) -> BitsAndBytesConfig | None:
    """4-bit NF4 (QLoRA) settings; quant storage equals the compute dtype (needed by FSDP2)."""
    if not recipe.model.load_in_4bit:
        return None
    dtype = torch_dtype(recipe.model.dtype)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=recipe.model.bnb_4bit_quant_type,
        bnb_4bit_use_double_quant=recipe.model.bnb_4bit_use_double_quant,
        bnb_4bit_compute_dtype=dtype,
        bnb_4bit_quant_storage=dtype,
    )


def build_spec(recipe: Recipe, base_config: Any, base_id: str) -> ContextSpec:
    """The ContextSpec this recipe gives the base model: every method section resolved against the
    base (complete RoPE parameters, HARPE bases, STRING's default shift, ...), and the lengths."""
    trained_length = recipe.data.max_length
    target_length = recipe.target_length or trained_length
    resolved: dict[str, Any] = {}
    for name, config in recipe.method_configs().items():
        context = ResolveContext(base_config, trained_length, target_length, dict(resolved))
        resolved[name] = METHODS[name].resolve(config, context)
    return ContextSpec.from_base(
        base_config,
        recipe.method,
        base_model=spec_base_reference(recipe, base_id),
        methods={name: config.model_dump() for name, config in resolved.items()},
        trained_length=trained_length,
        target_length=target_length,
        recipe_hash=recipe_hash(recipe.model_dump()),
    )


def check_against_base(recipe: Recipe, spec: ContextSpec) -> None:
    """Settings that only make sense for this base model, checked before anything is loaded or trained."""
    vocab = spec.base_shape["vocab_size"]
    problems = []
    # A tiny: model stands in for the recipe's real one (plan --stand-in): its token ids are the real model's.
    stand_in = recipe.model.name_or_path.startswith(TINY_PREFIX)
    bad_eos = [i for i in recipe.model.eos_token_ids or [] if not 0 <= i < vocab and not stand_in]
    if bad_eos:
        problems.append(f"model.eos_token_ids {bad_eos} are outside the vocabulary (0..{vocab - 1})")
    bad_rows = [i for i in recipe.lora.trainable_token_indices or [] if not 0 <= i < vocab]
    if bad_rows:
        problems.append(f"lora.trainable_token_indices {bad_rows} are outside the vocabulary (0..{vocab - 1})")
    span = positions_spanned(spec, recipe.data.max_length)
    if span > spec.max_position_embeddings:
        bounded = span < recipe.data.max_length  # a method (Activation Beacon) keeps fewer positions than tokens
        spanning = " and ".join(method.name for method, _ in spec_methods(spec) if method.span is not None)
        how = "" if span == recipe.data.max_length else f" {'even ' if bounded else ''}with {spanning}"
        problems.append(
            f"data.max_length={recipe.data.max_length} spans {span} positions{how}, beyond the adapted model's "
            f"{spec.max_position_embeddings}; "
            + (f"lower data.max_length, or change the {recipe.method} section so it keeps fewer positions" if bounded
               else "raise rope.max_position_embeddings")
        )
    if problems:
        raise ValueError(f"recipe {recipe.name}: " + "; ".join(problems))


def check_against_local_base(recipe: Recipe) -> str | None:
    """:func:`check_against_base` without loading or downloading anything (``longpeft plan``): against a ``tiny:``
    model's config or the base's config.json on this machine (a local folder, or a Hub model in the cache).
    Returns where the config came from, or None when there is none here (nothing checked)."""
    from ..scale.plan import local_config_file

    name = recipe.model.name_or_path
    if name.startswith(TINY_PREFIX):
        from ..tiny import tiny_config

        config, source = tiny_config(name[len(TINY_PREFIX):]), name
    else:
        config_file = local_config_file(name)
        if config_file is None:
            return None
        config, source = AutoConfig.from_pretrained(config_file.parent), str(config_file)
    check_against_base(recipe, build_spec(recipe, config, name))
    return source


def positions_spanned(spec: ContextSpec, length: int) -> int:
    """Positions an input of ``length`` tokens occupies once the spec's methods apply (``length``,
    unless a method keeps positions bounded, as Activation Beacon does)."""
    spans = [method.span(config, length, spec.max_position_embeddings)
             for method, config in spec_methods(spec) if method.span is not None]
    return min(spans, default=length)


def method_parameters(recipe: Recipe, model: Any) -> dict[str, Any]:
    """The own weights (Activation Beacon's) of every method the recipe applies, or none."""
    parameters: dict[str, Any] = {}
    for name in recipe.method_configs():
        if METHODS[name].parameters is not None:
            parameters.update(METHODS[name].parameters(model))
    return parameters


def spec_base_reference(recipe: Recipe, base_id: str) -> str:
    """How the spec names its base: a base generated inside the run folder (``tiny:``) is named
    relative to the adapter folder, so the run folder can be moved; a built-in model by its name
    (``longpeft:toy-base``, wherever longpeft is installed); anything else as given."""
    from ..builtin_models import BUILTIN_MODELS

    if recipe.model.name_or_path in BUILTIN_MODELS:
        return recipe.model.name_or_path
    output_dir = recipe.resolved_output_dir().resolve()
    base_path = Path(base_id).resolve()
    if base_path.is_relative_to(output_dir):
        return os.path.relpath(base_path, output_dir / "adapter")
    return base_id


def attention_implementation(requested: str) -> str:
    """The requested attention kernel, or SDPA (with a warning) when flash-attn cannot run here."""
    if requested != "flash_attention_2":
        return requested
    import importlib.util

    if torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None:
        return requested
    warnings.warn(
        "model.attn_implementation=flash_attention_2 needs CUDA and the flash-attn package "
        "(pip install 'longpeft[flash-attn]'); using sdpa instead",
        stacklevel=2,
    )
    return "sdpa"


def configure_base(recipe: Recipe, base_id: str) -> tuple[PreTrainedTokenizerBase, Any, ContextSpec]:
    """Tokenizer, the base config carrying the recipe's new RoPE parameters and length, and the ContextSpec.

    transformers v5 reads ``rope_parameters`` when a model is built, so the config gets the complete dict
    (and ``max_position_embeddings`` >= the training length) before any model exists.
    """
    m = recipe.model
    common = dict(revision=m.revision, trust_remote_code=m.trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(base_id, **common)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    config = AutoConfig.from_pretrained(base_id, **common)
    spec = build_spec(recipe, config, base_id)
    check_against_base(recipe, spec)
    if recipe.data.utk is not None:  # UtK's knot, label and trace tokens join the vocabulary
        add_utk_tokens(tokenizer, max(recipe.data.utk.chunk_counts))
        spec.vocab_size = max(len(tokenizer), config.vocab_size)
    config.rope_parameters = dict(spec.rope_parameters)
    config.max_position_embeddings = spec.max_position_embeddings
    return tokenizer, config, spec


def finish_base(recipe: Recipe, model: PreTrainedModel) -> None:
    """Settings every backend gives the loaded model: the recipe's eos ids, no KV cache while training."""
    if recipe.model.eos_token_ids:
        model.generation_config.eos_token_id = list(recipe.model.eos_token_ids)
    model.config.use_cache = False


def load_base(recipe: Recipe, base_id: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, ContextSpec]:
    """Load tokenizer and model, give the model the recipe's ContextSpec, set its eos ids."""
    m = recipe.model
    tokenizer, config, spec = configure_base(recipe, base_id)
    model = AutoModelForCausalLM.from_pretrained(
        base_id,
        config=config,
        dtype=torch_dtype(m.dtype),
        attn_implementation=attention_implementation(m.attn_implementation),
        quantization_config=quantization_config(recipe),
        revision=m.revision,
        trust_remote_code=m.trust_remote_code,
    )
    # Then apply the spec (all but inference-time methods), which re-checks that the rotary frequencies changed.
    apply_spec(model, spec, training=True)
    if spec.vocab_size > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(spec.vocab_size)
    finish_base(recipe, model)
    return model, tokenizer, spec


# ---------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------


def has_tied_embeddings(model: PreTrainedModel) -> bool:
    """Whether the model's output head shares its weight with the input embedding."""
    head = model.get_output_embeddings()
    return head is not None and head.weight is model.get_input_embeddings().weight


def lora_config(recipe: Recipe, model: PreTrainedModel | None = None):
    """peft LoraConfig of the recipe (None for full fine-tuning).

    On a model with tied input/output embeddings a trained embedding stays tied to the output head: the adapter
    trains one matrix, and the merged model is tied as the base was. A fully trained one needs
    ``ensure_weight_tying``; peft ties trained rows (``token_indices``) by itself, and the flag there only warns.
    ``lora.embeddings: token_indices`` is refused on a tied head with a bias: peft's trainable tokens drop it.
    """
    from peft import LoraConfig

    if recipe.finetune != "lora":
        return None
    lora = recipe.lora
    tied = model is not None and has_tied_embeddings(model)
    if tied and lora.embeddings == "token_indices" and model.get_output_embeddings().bias is not None:
        raise ValueError(
            f"recipe {recipe.name}: lora.embeddings: token_indices on a base whose tied output head has a bias: "
            "peft's trainable tokens leave the bias out of the head's forward; use lora.embeddings: full"
        )
    embedding = input_embedding_path(model) if model is not None else "embed_tokens"
    return LoraConfig(
        ensure_weight_tying=tied and lora.embeddings == "full",
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        modules_to_save=[embedding] if lora.embeddings == "full" else None,
        trainable_token_indices={embedding: list(lora.trainable_token_indices)}
        if lora.embeddings == "token_indices"
        else None,
        task_type="CAUSAL_LM",
    )


def input_embedding_path(model: PreTrainedModel) -> str:
    """The input embedding's module path (e.g. ``model.embed_tokens``): peft matches module names by suffix, and a
    bare ``embed_tokens`` also matched Activation Beacon's one-row ``beacon_embed_tokens``."""
    embedding = model.get_input_embeddings()
    return next(name for name, module in model.named_modules() if module is embedding)


def expose_token_indices_head_bias(model: Any) -> None:
    """Give the output head that peft wraps for ``lora.embeddings: token_indices`` on a tied base the ``bias``
    TRL's fused LM head reads (no-op for any other head).

    peft wraps such a head in a ``TrainableTokensWrapper`` tied to the embedding's trained rows. Its ``weight`` is
    already the effective ``[vocab, hidden]`` matrix (the base's rows with the trained ``trainable_token_indices``
    rows copied in, differentiable in them) that its own forward multiplies by, but it has no ``bias``, which TRL's
    fused loss reads beside ``weight`` (``AttributeError`` on the first step). Its forward adds no bias
    (``F.linear(hidden, weight)``; :func:`lora_config` refuses heads that have one), so ``bias = None`` makes the
    fused loss the loss of the model's own forward.
    """
    from peft.utils.other import TrainableTokensWrapper

    head = model.get_output_embeddings()
    if isinstance(head, TrainableTokensWrapper):
        head.bias = None


def keep_trained_weights_in(model: Any, dtype: torch.dtype, compute_dtype: torch.dtype) -> None:
    """Keep every trained weight of ``model`` in ``dtype`` (``lora.trainable_dtype``) while the forward computes in
    ``compute_dtype``.

    TRL casts trained weights to bfloat16 over a 4-bit base, peft's trainable embedding copy starts in the
    base's dtype, and a full fine-tune of a bf16 model would train its bf16 weights themselves; either way AdamW
    would then drop updates smaller than bfloat16's precision (at lr 2e-5 on a tiny model, 74 % of the weights of a
    full fine-tune never moved in 3 steps). The forward runs under the compute dtype's autocast. The input
    embedding's output is cast to ``compute_dtype`` so that a float32 embedding copy does not turn the residual
    stream (and every checkpointed layer input, ``[batch, seq, hidden]``) into float32.
    """
    for parameter in model.parameters():
        if parameter.requires_grad and parameter.is_floating_point() and parameter.dtype != dtype:
            parameter.data = parameter.data.to(dtype)
    embeddings = model.get_input_embeddings()
    if dtype != compute_dtype and any(p.requires_grad for p in embeddings.parameters()):
        embeddings.register_forward_hook(lambda module, args, output: output.to(compute_dtype))


def world_size() -> int:
    """Number of training processes (set by accelerate launch / torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def data_parallel_size() -> int:
    """Processes that each train on their own samples: all of them, except that sequence parallelism
    (``--launch ulysses``) gives one sample to every group of ``sp_size`` processes."""
    from ..launch import sequence_parallel_size

    sp = sequence_parallel_size()
    if world_size() % sp:
        raise ValueError(f"sequence parallel size {sp} does not divide the {world_size()} processes")
    return world_size() // sp


def is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def gradient_accumulation(recipe: Recipe, processes: int) -> int:
    """Accumulation steps so that per-device batch x processes x accumulation = global batch."""
    per_step = recipe.train.per_device_batch_size * processes
    if recipe.train.global_batch_size % per_step:
        raise ValueError(
            f"train.global_batch_size={recipe.train.global_batch_size} is not a multiple of "
            f"train.per_device_batch_size={recipe.train.per_device_batch_size} x {processes} processes"
        )
    return recipe.train.global_batch_size // per_step


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

    return SFTConfig(**{**recipe.trl, **sft_arguments(recipe, output_dir)})  # only pad_to_multiple_of is in both


def sft_arguments(recipe: Recipe, output_dir: Path) -> dict[str, Any]:
    """The SFTConfig arguments longpeft sets from the recipe (each one a key of ``TRL_KEYS_OWNED_BY_RECIPE``)."""
    from trl import SFTConfig

    from ..launch import mixed_precision, sequence_parallel_size

    t = recipe.train
    use_cuda = torch.cuda.is_available()
    if t.activation_offloading and not use_cuda:  # TRL's offloader asks for an accelerator and fails obscurely
        raise ValueError("train.activation_offloading moves checkpointed activations from a CUDA GPU to CPU memory, and "
                         "this machine has no CUDA GPU; set train.activation_offloading: false here")
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
        **({"use_liger_kernel": True, "liger_kernel_config": {"fused_linear_cross_entropy": False,
                                                              "cross_entropy": False}} if t.use_liger_kernel else {}),
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
        **({"dataset_kwargs": {"skip_prepare_dataset": True}, "remove_unused_columns": False} if recipe.data.utk else {}),
        # Ulysses shards every batch into sp equal slices of the sequence
        **({"pad_to_multiple_of": math.lcm(sp, recipe.trl.get("pad_to_multiple_of") or 1)} if sp > 1 else {}),
    )


def assistant_only_loss(recipe: Recipe) -> bool:
    """Loss on assistant turns only: the recipe's setting, on by default for conversations."""
    return recipe.data.format == "messages" and recipe.train.assistant_only_loss is not False


def data_collator(recipe: Recipe, spec: ContextSpec, tokenizer: PreTrainedTokenizerBase):
    """UtK's collator (on-the-fly augmentation of packed documents) with ``data.utk``; PoSE's
    (skip-wise position ids, explicit all-ones mask) when the recipe uses PoSE; else TRL's."""
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
    pose = spec.methods.get("pose")
    if pose is None:
        return None
    from ..adapters.pose import PoseCollator

    return PoseCollator(
        target_length=pose["target_length"],
        pad_token_id=tokenizer.pad_token_id,
        n_chunks=pose["n_chunks"],
        max_length=recipe.data.max_length,
        seed=recipe.train.seed,
        content_skip=pose["content_skip"],
    )


def longest_sample(recipe: Recipe) -> tuple[int, str]:
    """The most tokens a training sample keeps on its way to the collator, and the setting that says so:
    ``data.max_length``, or with PoSE's content skip the simulated length (its collator draws the window from it)."""
    pose = recipe.method_configs().get("pose")
    target = (pose.target_length or recipe.target_length) if pose is not None and pose.content_skip != "none" else None
    if target:  # without one, PoSE's resolve refuses the recipe
        return target, f"pose.target_length={target} (PoSE's content skip)"
    return recipe.data.max_length, f"data.max_length={recipe.data.max_length}"


def check_content_to_skip(data_stats: dict[str, int], window: int) -> None:
    """Fail when no sample is longer than ``window`` tokens (``data_stats`` of :func:`filter_by_length`): PoSE's
    content skip draws from such samples, and would change nothing."""
    if not data_stats["longer_than_window"]:
        raise ValueError(f"pose.content_skip: no training sample is longer than data.max_length={window} tokens, so "
                         "no content would be skipped; use longer documents (up to pose.target_length) or "
                         "pose.content_skip: none")


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
    rules = [(method, config) for method, config in spec_methods(spec) if method.training_labels is not None]
    if rules:
        trainer.data_collator = MethodTrainingLabels(trainer.data_collator, rules)


def check_samples_left(trainer: Any, data_stats: dict[str, int], recipe: Recipe) -> None:
    """Drop the samples a method's ``training_labels`` rule leaves without a scored target (Activation Beacon's
    first window can hold a short sample's every answer), count them and those TRL's own preparation dropped (with
    ``data.truncate``, samples whose every scored token was cut off) into ``data_stats``, and fail with what to do
    when none is left to train on."""
    collator, dataset = trainer.data_collator, trainer.train_dataset
    if isinstance(collator, MethodTrainingLabels) and collator.changes_labels(recipe.data.max_length):
        scored = [i for i in tqdm(range(len(dataset)), desc="samples with scored targets", leave=False)
                  if (collator([dataset[i]])["labels"][:, 1:] != -100).any()]
        if len(scored) < len(dataset):
            trainer.train_dataset = dataset = dataset.select(scored)
    left = len(dataset)
    rows = "packed_sequences" if "packed_sequences" in data_stats else "kept"  # what the trainer's rows are
    data_stats["dropped_without_scored_tokens"] = data_stats[rows] - left
    data_stats[rows] = left
    if left == 0:
        raise ValueError(
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
    return recipe.finetune != "full" and any(method.save is not None for method, _ in spec_methods(spec))


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


def prepare(recipe: Recipe, callbacks: list[TrainerCallback] | None = None) -> Prepared:
    """Build model, data and trainer of a recipe without training (``longpeft plan`` prints this)."""
    fast = None
    if recipe.train.backend == "unsloth":
        from . import unsloth_backend

        fast = unsloth_backend.fast_language_model()  # before TRL is imported: unsloth patches its trainers
    from trl import SFTTrainer

    from ..compat import ensure_trl_loss_kernel, plain_cpu_device

    ensure_trl_loss_kernel()  # trl < 1.16 without Triton (CPU) has no loss kernel
    output_dir = recipe.resolved_output_dir()
    output_dir.mkdir(parents=True, exist_ok=True)
    base_id = base_location(recipe, output_dir)  # a tiny: base is built before DeepSpeed's config exists (no zero.Init)
    args = sft_config(recipe, output_dir)
    plain_cpu_device(args)  # transformers < 5.23 cannot resume a multi-process CPU run on "cpu:N"
    # Each process loads the base after the local main one (which downloads it once), except under DeepSpeed ZeRO-3,
    # whose zero.Init partitions every weight while the model is built, with all processes taking part; a method
    # that cannot train sharded is refused before then (it would read partitioned, empty weights).
    partitioned = builds_partitioned(recipe)
    if partitioned:
        from ..launch import check_sharded

        check_sharded(recipe, "DeepSpeed ZeRO-3")
    with nullcontext() if partitioned else args.main_process_first(local=True, desc="base model"):
        if fast is not None:
            model, tokenizer, spec = unsloth_backend.load_model(recipe, base_id, fast)  # LoRA added by unsloth
        else:
            model, tokenizer, spec = load_base(recipe, base_id)
    start = check_init_adapter(recipe, spec, model.config) if recipe.model.init_from else None
    with args.main_process_first(local=True, desc="data"):
        dataset = tokenize_dataset(load_training_data(recipe.data, tokenizer), tokenizer, assistant_only_loss(recipe))
        utk, max_length = recipe.data.utk, recipe.data.max_length
        if utk is None:
            longest, limit = longest_sample(recipe)
            skips_content = longest > max_length
            dataset, data_stats = filter_by_length(dataset, longest, recipe.data.truncate, limit,
                                                   min_length=recipe.data.min_length,
                                                   window=max_length if skips_content else None)
            if skips_content:
                check_content_to_skip(data_stats, max_length)
        else:  # documents are counted, kept or dropped (data.truncate) as they are, before packing
            room = utk_document_room(max_length, utk)
            dataset, data_stats = filter_by_length(dataset, room, recipe.data.truncate, utk_limit(max_length, room),
                                                   min_length=recipe.data.min_length)
            letters = add_utk_tokens(tokenizer, max(utk.chunk_counts)).letters  # the tokens are in already
            dataset = pack_for_utk(dataset, max_length, utk, len(letters))
            data_stats["packed_sequences"] = len(dataset)
    peft_config = lora_config(recipe, model) if recipe.train.backend == "transformers" else None
    if recipe.finetune == "method":  # the base stays frozen; only the method's weights train
        model.requires_grad_(False)
    trainer_class = SFTTrainer
    if keeps_weights_outside_checkpoints(recipe, spec):
        trainer_class = method_checkpoint_trainer(SFTTrainer, spec, recipe.finetune)
    trainer = trainer_class(
        model=model,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        data_collator=data_collator(recipe, spec, tokenizer),
        callbacks=[MetricsLogger(output_dir / "metrics.jsonl"), KeepRotaryFrequencies(model), *(callbacks or [])],
    )
    expose_token_indices_head_bias(trainer.model)
    if recipe.train.backend == "transformers" and recipe.finetune in ("lora", "full"):
        trained_dtype = recipe.lora.trainable_dtype if recipe.finetune == "lora" else None
        keep_trained_weights_in(trainer.model, torch_dtype(trained_dtype or "float32"), torch_dtype(recipe.model.dtype))
    if start is not None:
        load_init_weights(trainer.model, start.folder, start.kind, spec)
        report_differences(start.folder, start.differences)
    for parameter in method_parameters(recipe, trainer.model).values():
        parameter.requires_grad_(True)  # peft froze everything but LoRA; the method's weights train too
    with_method_labels(trainer, spec)
    check_samples_left(trainer, data_stats, recipe)
    check_distributed_type(trainer.accelerator.distributed_type)
    check_parallelism(recipe, trainer.accelerator)
    distributed_type = str(trainer.accelerator.distributed_type)
    check_memory_options(recipe, sharded="FSDP" in distributed_type or "DEEPSPEED" in distributed_type)
    checkpointing = None
    if recipe.train.backend == "transformers" and shapes_memory(recipe):
        checkpointing = checkpoint_settings(recipe, model.config, world_size(), distributed_type)
        if is_main_process():
            print(f"longpeft: checkpointing: {checkpointing.describe(model.config.num_hidden_layers)}", file=sys.stderr)
    trainer.add_callback(TrainingMemory(checkpointing, recipe.train.mlp_tile_tokens))
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


def check_distributed_type(distributed_type: Any) -> None:
    """Refuse a run whose launch config asked for FSDP or DeepSpeed but that accelerate set up otherwise.

    accelerate 1.15 turns FSDP on only for GPU-like process groups (``AcceleratorState``: the FSDP branch sits
    under ``distributed_type in [MULTI_GPU, MULTI_XPU, ...]``) and makes every multi-process CPU run
    ``MULTI_CPU``, i.e. plain DDP, whatever the config says; training would go on unsharded without a word.
    """
    asked = [name for name, variable in (("FSDP", "ACCELERATE_USE_FSDP"), ("DEEPSPEED", "ACCELERATE_USE_DEEPSPEED"))
             if os.environ.get(variable, "false").lower() == "true"]
    got = str(distributed_type).rsplit(".", 1)[-1]
    if asked and got != asked[0]:
        raise ValueError(
            f"the launch config asks for {asked[0]}, but accelerate set up {got}: accelerate runs FSDP and DeepSpeed "
            "only on GPUs (every multi-process CPU run is DDP); on CPU use --launch ddp (or accelerate launch --multi_gpu)"
        )


def check_parallelism(recipe: Recipe, accelerator: Any) -> None:
    """Refuse weight sharding (FSDP, DeepSpeed ZeRO-3), sequence or context parallelism that the recipe cannot run
    under (however it was configured: ``--launch`` or a user's own accelerate config)."""
    from ..launch import check_context_parallel, check_sequence_parallel, check_sharded

    distributed_type = str(accelerator.distributed_type).rsplit(".", 1)[-1]
    deepspeed = getattr(accelerator.state, "deepspeed_plugin", None)
    if distributed_type == "FSDP":
        check_sharded(recipe, "FSDP")
    elif distributed_type == "DEEPSPEED" and deepspeed is not None and deepspeed.zero_stage == 3:
        check_sharded(recipe, "DeepSpeed ZeRO-3")
    parallelism = getattr(accelerator, "parallelism_config", None)
    if parallelism is None:
        return
    if parallelism.cp_enabled:
        check_context_parallel(recipe, packing=recipe.data.utk is not None)
    if parallelism.sp_enabled:
        check_sequence_parallel(recipe)


def adapter_settings(model: Any) -> dict[str, Any] | None:
    """The LoRA config of the trained adapter (whichever backend added it); None for full fine-tuning."""
    configs = getattr(model, "peft_config", None) or {}
    return configs["default"].to_dict() if "default" in configs else None


class TrainingDiverged(ValueError):
    """The loss or the gradient norm became NaN or infinite; the run stopped."""


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

        self.saved = [(module, name, getattr(module, name).detach().clone()) for _, _, module in rotary_modules(model)
                      for name in self.NAMES if isinstance(getattr(module, name, None), torch.Tensor)]

    def on_train_begin(self, args, state, control, **kwargs):
        cast = {}
        for module, name, value in self.saved:
            current = getattr(module, name)
            if current.dtype != value.dtype:
                cast[current.dtype] = cast.get(current.dtype, 0) + 1
                setattr(module, name, value.to(current.device))
        if cast:
            warnings.warn(f"the model's wrapper cast {sum(cast.values())} rotary frequency buffers to "
                          f"{', '.join(map(str, cast))}; longpeft put their float32 values back", stacklevel=1)


class CheckpointLoaded(Exception):
    """Raised by :class:`StopBeforeTraining` once the Trainer has loaded the checkpoint it resumes from."""


class StopBeforeTraining(TrainerCallback):
    """Ends ``trainer.train(resume_from_checkpoint=...)`` when training begins: by then the Trainer has wrapped the
    model (DeepSpeed's engine, FSDP) and loaded the checkpoint's weights and state into it, and no step has run.
    The runner uses it to save a finished run whose adapter a kill lost."""

    def on_train_begin(self, args, state, control, **kwargs):
        raise CheckpointLoaded


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
    output_dir = recipe.resolved_output_dir()
    skipped: list[str] = []
    checkpoint = latest_checkpoint(output_dir, skipped)
    for message in skipped:
        print(f"longpeft: {message}", file=sys.stderr)
    if resume and checkpoint is None:
        raise FileNotFoundError(f"--resume: no complete checkpoint in {output_dir / 'checkpoints'}; start without --resume")
    if not resume and checkpoint is not None:
        raise FileExistsError(
            f"{output_dir} already has checkpoints ({checkpoint.name}); pass --resume to continue that run, "
            "or choose another output_dir"
        )
    changed = changed_keys(output_dir, recipe) if resume else []
    if resume:
        if changed and not allow_recipe_change:
            raise ValueError(
                f"--resume: the recipe changed since {output_dir} was started ({', '.join(changed)}); resuming "
                "would mix two trainings. Restore those keys, train into another output_dir, or pass "
                "--allow-recipe-change to resume anyway"
            )
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
    # TRL and peft (not longpeft) still read this deprecated transformers property on every run.
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    prepared = prepare(recipe, [StopOnNonFinite(), *(callbacks or [])])
    trainer = prepared.trainer
    if trainer.is_world_process_zero():
        (output_dir / "recipe.resolved.json").write_text(json.dumps(prepared.resolved, indent=2, default=str) + "\n")
    if resume and is_finished(checkpoint, planned_steps(trainer)):
        # Killed after the last checkpoint (or finished): take its weights, train no further step. The Trainer loads
        # the checkpoint itself (a sharded one into the wrapped model: DeepSpeed's engine, FSDP) and is stopped
        # before its first step.
        print(f"longpeft: {checkpoint.name} is the run's last step; saving it without training", file=sys.stderr)
        trainer.add_callback(StopBeforeTraining())
        try:
            trainer.train(resume_from_checkpoint=str(checkpoint))
        except CheckpointLoaded:
            pass
        train_metrics: dict[str, Any] = {}
    else:
        train_metrics = trainer.train(resume_from_checkpoint=str(checkpoint) if resume else None).metrics

    adapter_dir = output_dir / ("model" if recipe.finetune == "full" else "adapter")
    state_dict = gathered_state_dict(trainer)  # every process takes part when the model is sharded
    if trainer.is_world_process_zero():
        save_adapter(trainer.model, prepared.tokenizer, prepared.spec, adapter_dir, state_dict, recipe.finetune,
                     torch_dtype(recipe.model.dtype))
        metrics = summarize(output_dir, train_metrics, prepared)
    else:
        metrics = dict(train_metrics)
    trainer.accelerator.wait_for_everyone()
    return RunResult(output_dir, adapter_dir, metrics)


def planned_steps(trainer: Any) -> int:
    """The optimizer steps the run trains in all: ``train.max_steps``, else the epochs over the data loader
    (``ceil(num_train_epochs x updates per epoch)``, computed by transformers itself)."""
    return trainer.set_initial_training_values(trainer.args, trainer.get_train_dataloader())[-1]


def gathered_state_dict(trainer: Any) -> dict[str, Any] | None:
    """The whole state dict of a model sharded across processes (FSDP, DeepSpeed ZeRO-3), gathered by accelerate
    with every process taking part (call it on all of them); None when each process holds the whole model."""
    if trainer.is_fsdp_enabled:
        return trainer.accelerator.get_state_dict(trainer.model)
    if trainer.is_deepspeed_enabled:
        return trainer.accelerator.get_state_dict(trainer.deepspeed)
    return None


def save_adapter(
    model: Any, tokenizer: PreTrainedTokenizerBase, spec: ContextSpec, adapter_dir: Path,
    state_dict: dict[str, Any] | None = None, finetune: str = "lora", dtype: torch.dtype = torch.float32,
) -> None:
    """Adapter weights (or the full model), method weights, tokenizer, generation config and longpeft.json.

    ``state_dict``: the gathered weights of a sharded model (:func:`gathered_state_dict`); peft keeps the
    adapter's part of it. A fully fine-tuned model is saved in ``dtype`` (the recipe's ``model.dtype``; it trained
    float32 weights) and also gets what its methods export (e.g. HARPE's modeling
    file that plain transformers needs to keep its per-head bases, ``trust_remote_code=True``). With
    ``finetune: method`` only the method's own weights are written (the base did not change). longpeft.json
    records which (``weights``: the ``finetune`` setting).
    """
    if finetune == "full":
        model.config.use_cache = True  # training turned it off; the saved model is for generation
        # the float32 weights it trained are saved in the model's dtype (buffers such as inv_freq stay as they are)
        for parameter in model.parameters():
            if parameter.is_floating_point():
                parameter.data = parameter.data.to(dtype)
        if state_dict is not None:
            state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
    if finetune != "method":
        model.save_pretrained(adapter_dir, **({"state_dict": state_dict} if state_dict is not None else {}))
    save_method_weights(model, spec, adapter_dir, state_dict)
    if finetune == "full":
        export_methods(model, spec, adapter_dir)
    tokenizer.save_pretrained(adapter_dir)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(adapter_dir)
    spec = dataclasses.replace(spec, weights=finetune)
    spec.save(adapter_dir)
    from ..hub import write_model_card  # longpeft's card replaces peft's placeholder README.md

    write_model_card(adapter_dir, spec, repo_id=str(adapter_dir))


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
    (output_dir / "metrics.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_loss(losses, output_dir / "loss.png", title=f"{prepared.recipe.name}: training loss")
    return summary
