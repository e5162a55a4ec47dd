"""One validation of a recipe before any weight loads, the same for ``longpeft plan`` and ``longpeft train``.

:func:`validate_recipe` checks a recipe the schema accepted against itself and its base model's config (read without
weights or torch: :mod:`longpeft.base_config`). :func:`check_here` checks what only this machine can tell (the base's
config read here, CUDA, the packages a setting needs): ``train`` runs it after the validation.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from typing import Any

from ..adapters import METHODS, ResolveContext, check_conflicts, spec_methods
from ..base_config import BUILTIN_MODELS, TINY_PREFIX, BaseFacts, BaseNotHere, read_base
from ..errors import ConfigError
from ..spec import ContextSpec, base_reference, recipe_hash
from .schema import Recipe


@dataclass(frozen=True)
class Validation:
    """A recipe that passed :func:`validate_recipe`: its ``base`` facts and the ContextSpec ``spec`` it gives the
    base, or both None and ``base_missing`` saying why the base could not be read here (the recipe checked alone)."""

    recipe: Recipe
    base: BaseFacts | None
    base_missing: str | None
    spec: ContextSpec | None

    def summary(self) -> str:
        """One line: what the recipe was checked against (``plan`` prints it)."""
        if self.base is not None:
            return f"recipe checked against the base's config ({self.base.source})"
        return (
            f"the recipe was checked without its base's config, which train needs here: {self.base_missing} "
            "(plan --build loads the base and checks)"
        )


def validate_recipe(recipe: Recipe, stand_in: bool = False) -> Validation:
    """Every check of ``recipe`` that needs no weights, against its base's config when that can be read here
    (bounded on the Hub). ``stand_in``: the base stands in for the real one, whose eos ids the recipe keeps. Raises
    ConfigError (or another LongpeftError): the first problem; ModelSourceError: a base that does not exist."""
    if recipe.trl:  # SFTConfig's arguments are known only from the class (a recipe without trl: skips it)
        from trl import SFTConfig

        fields = {f.name for f in dataclasses.fields(SFTConfig)}
        unknown = [key for key in recipe.trl if key not in fields]
        if unknown:
            raise ConfigError(f"trl.{unknown[0]}: not an argument of trl.SFTConfig")
    check_memory_settings(recipe)
    try:
        base = read_base(recipe.model.name_or_path, recipe.model.revision)
    except BaseNotHere as missing:
        return Validation(recipe, None, str(missing), None)
    base.check_remote_code(recipe.model.trust_remote_code, "model.trust_remote_code: true")
    if recipe.data.format == "messages" and base.tokenizer_found and not base.chat_template:
        raise ConfigError(
            f"data.format: messages renders conversations with the tokenizer's chat template, and "
            f"{recipe.model.name_or_path}'s tokenizer has none; use a chat (instruct) base, give its tokenizer a "
            "chat_template, or train on plain text (data.format: text)"
        )
    spec = build_spec(recipe, base.config, recipe.model.name_or_path)
    check_against_base(recipe, spec, stand_in)
    check_layer_counts(recipe, base.config.num_hidden_layers)
    check_target_modules(recipe, base)
    return Validation(recipe, base, None, spec)


def check_here(validation: Validation) -> None:
    """What a run needs of this machine: the base's config read (``validation``), CUDA and packages its settings need.
    Raises BaseNotHere: the base's config was not readable here; ConfigError: a setting this machine cannot run."""
    if validation.base_missing is not None:
        raise BaseNotHere(validation.base_missing)
    import torch  # only a run asks what this machine has (plan checks the recipe for any machine)

    train, cuda = validation.recipe.train, torch.cuda.is_available()
    if train.activation_offloading and not cuda:  # TRL's offloader asks for an accelerator, obscurely
        raise ConfigError(
            "train.activation_offloading moves checkpointed activations from a CUDA GPU to CPU memory, and this "
            "machine has no CUDA GPU; set train.activation_offloading: false here"
        )
    if train.use_liger_kernel and not cuda:
        raise ConfigError(
            "train.use_liger_kernel: Liger's kernels are Triton kernels for CUDA GPUs and this machine has none; "
            "set train.use_liger_kernel: false here"
        )
    if train.use_liger_kernel and importlib.util.find_spec("liger_kernel") is None:
        raise ConfigError(
            "train.use_liger_kernel: the liger-kernel package is not installed (pip install liger-kernel)"
        )


def check_memory_settings(recipe: Recipe) -> None:
    """``train.keep_attention`` and Liger's kernels need an attention and methods that carry them out."""
    if recipe.train.keep_attention != "none" and recipe.model.attn_implementation == "eager":
        raise ConfigError(
            "train.keep_attention keeps the output of an attention kernel, and eager attention is no single "
            "kernel; use model.attn_implementation: sdpa (or flash_attention_2)"
        )
    if recipe.train.use_liger_kernel:  # Liger's RoPE kernel would not reach a method that rotates its own queries
        check_conflicts(recipe.method_configs(), {"liger_kernels": "train.use_liger_kernel"})


def build_spec(recipe: Recipe, base_config: Any, base_id: str) -> ContextSpec:
    """The ContextSpec this recipe gives the base: every method section resolved against ``base_config``
    (transformers' config or a :class:`~longpeft.base_config.BaseConfig`), and the lengths. It names a built-in
    base by its name, a local one relative to the adapter folder (so that the two can move together)."""
    trained_length = recipe.data.max_length
    target_length = recipe.target_length or trained_length
    resolved: dict[str, Any] = {}
    for name, config in recipe.method_configs().items():
        context = ResolveContext(base_config, trained_length, target_length, dict(resolved))
        resolved[name] = METHODS[name].resolve(config, context)
    base_model = recipe.model.name_or_path
    if base_model not in BUILTIN_MODELS:
        base_model = base_reference(base_id, recipe.resolved_output_dir() / "adapter")
    return ContextSpec.from_base(
        base_config,
        recipe.method,
        base_model=base_model,
        methods={name: config.model_dump() for name, config in resolved.items()},
        trained_length=trained_length,
        target_length=target_length,
        recipe_hash=recipe_hash(recipe.model_dump()),
    )


def check_against_base(recipe: Recipe, spec: ContextSpec, stand_in: bool = False) -> None:
    """Token ids inside the base's vocabulary (not the eos ids of a ``stand_in`` base), and the positions a sample
    spans inside the adapted model's."""
    vocab, problems = spec.base_shape.vocab_size, []
    eos_ids = [] if stand_in else recipe.model.eos_token_ids  # a stand-in base's vocabulary is not the real one's
    settings = {"model.eos_token_ids": eos_ids, "lora.trainable_token_indices": recipe.lora.trainable_token_indices}
    for key, values in settings.items():
        outside = [i for i in values or [] if not 0 <= i < vocab]
        if outside:
            problems.append(f"{key} {outside} are outside the vocabulary (0..{vocab - 1})")
    span = positions_spanned(spec, recipe.data.max_length)
    if span > spec.max_position_embeddings:
        problems.append(span_problem(spec, recipe.data.max_length, span))
    if problems:
        raise ConfigError(f"recipe {recipe.name}: " + "; ".join(problems))


def span_problem(spec: ContextSpec, length: int, span: int) -> str:
    """Why inputs of ``length`` tokens, spanning ``span`` positions, do not fit the adapted model's positions, naming
    the method that sets the span and the fix."""
    spanning = " and ".join(method.name for method, _ in spec_methods(spec) if method.overrides("training_span"))
    raise_positions = "raise rope.max_position_embeddings"
    keep_fewer = f"change the {spanning} section so it keeps fewer positions"
    if span < length:  # a method (Activation Beacon) keeps fewer positions than tokens, still too many
        how, fix = f" even with {spanning}", f"lower data.max_length, or {keep_fewer}"
    elif span > length:  # a method (PoSE) trains positions beyond the tokens
        how, fix = f" with {spanning}", raise_positions
    elif spanning:  # a method that may bound the positions keeps every one as set (beacon.ratios [0])
        how, fix = f" ({spanning} as set spans one position per token)", f"{raise_positions}, or {keep_fewer}"
    else:
        how, fix = "", raise_positions
    return (
        f"data.max_length={length} spans {span} positions{how}, beyond the adapted model's "
        f"{spec.max_position_embeddings}; {fix}"
    )


def positions_spanned(spec: ContextSpec, length: int) -> int:
    """Positions an input of ``length`` tokens spans once the spec's methods apply (fewer with Activation Beacon)."""
    spans = [
        method.training_span(config, length, spec.max_position_embeddings)
        for method, config in spec_methods(spec)
        if method.overrides("training_span")
    ]
    return min(spans, default=length)


def check_layer_counts(recipe: Recipe, layers: int) -> None:
    """``train.checkpoint_layers`` and ``train.keep_attention`` count decoder layers the base has."""
    for key in ("checkpoint_layers", "keep_attention"):
        value = getattr(recipe.train, key)
        if isinstance(value, int) and value > layers:
            raise ConfigError(
                f"train.{key}={value}: the model has {layers} decoder layers; give 0 to {layers}, all or auto"
            )


def check_target_modules(recipe: Recipe, base: BaseFacts) -> None:
    """Each of ``lora.target_modules`` names at least one layer LoRA can adapt (matched as peft does: the name, or
    its end after a dot), none the embedding ``lora.embeddings`` trains already. Not checked for a base that runs
    its own modeling code (building it would run that code)."""
    own_code = base.runs_own_code(recipe.model.trust_remote_code)
    if recipe.finetune != "lora" or recipe.train.backend != "transformers" or own_code:
        return
    kinds = base.module_kinds()
    saved = [name for name, kind in kinds.items() if kind == "Embedding"] if recipe.lora.embeddings == "full" else []
    layers = sorted({name.rpartition(".")[2] for name, kind in kinds.items() if kind != "other"})
    for target in recipe.lora.target_modules:
        matched = {name: kind for name, kind in kinds.items() if name == target or name.endswith(f".{target}")}
        where = f"lora.target_modules: {target!r}"
        if not matched:
            raise ConfigError(
                f"{where} names no module of {recipe.model.name_or_path}; its layers LoRA can adapt: "
                f"{', '.join(layers)}"
            )
        adaptable = [name for name, kind in matched.items() if kind != "other"]
        if not adaptable:
            raise ConfigError(
                f"{where} names modules LoRA cannot adapt ({next(iter(matched))}: not a linear or embedding layer); "
                f"name layers such as {', '.join(layers)}"
            )
        if all(name in saved for name in adaptable):
            raise ConfigError(
                f"{where} is the input embedding, which lora.embeddings: full trains whole already; remove it from "
                "lora.target_modules (or set lora.embeddings: none to train a LoRA on it)"
            )


def with_stand_in(overrides: list[str], arch: str) -> list[str]:
    """``overrides`` plus those that put a tiny random model of ``arch`` and the demo set in place of the recipe's
    base and data (``plan --stand-in``; validate with ``stand_in=True``), without ``model.init_from``."""
    return [*overrides, f"model.name_or_path={TINY_PREFIX}{arch}", "data.source=demo", "model.init_from=null"]


__all__ = ["Validation", "build_spec", "check_against_base", "check_here", "validate_recipe"]
