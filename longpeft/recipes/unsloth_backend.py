"""``train.backend: unsloth``: load the base and add LoRA through unsloth's FastLanguageModel (CUDA only; its own
environment, ``requirements-gpu-unsloth.txt``, so it is imported lazily).

unsloth has no ``rope_theta`` argument and stacks its own linear scaling when ``max_seq_length`` exceeds the
config's ``max_position_embeddings``: it gets the config that already carries the recipe's ``rope_parameters`` and
positions, and every rotary module's frequencies are checked after loading (a changed RoPE is refused). It patches
TRL's trainers when imported, so :func:`fast_language_model` runs before TRL is imported.
"""

from __future__ import annotations

import copy
import importlib.util
from typing import Any

import torch

from ..config import torch_dtype
from ..errors import ConfigError
from ..rope import RotaryMismatch, check_rotary_frequencies
from ..spec import ContextSpec
from .base import configure_base, finish_base, quantization_config
from .peft_setup import input_embedding_path
from .schema import Recipe

INSTALL = "pip install -r requirements-gpu-unsloth.txt"


def fast_language_model() -> Any:
    """``unsloth.FastLanguageModel``, imported on first use. Raises ImportError: unsloth is not installed;
    ConfigError: there is no CUDA GPU."""
    if importlib.util.find_spec("unsloth") is None:
        raise ImportError(
            f"train.backend: unsloth needs the unsloth package, which is not installed; on a CUDA machine run "
            f"`{INSTALL}` in its own environment, or set train.backend: transformers"
        )
    if not torch.cuda.is_available():
        raise ConfigError(
            "train.backend: unsloth needs a CUDA GPU and this machine has none; set train.backend: transformers"
        )
    from unsloth import FastLanguageModel

    return FastLanguageModel


def load_model(recipe: Recipe, base_id: str, fast: Any) -> tuple[Any, Any, ContextSpec]:
    """Base model through ``fast.from_pretrained`` (``fast``: :func:`fast_language_model`) with the recipe's RoPE,
    then LoRA through ``fast.get_peft_model``; the rotary frequencies are checked after each. Returns ``(peft model,
    tokenizer, spec)``, the tokenizer the default backend's. Raises RotaryMismatch: unsloth changed the RoPE the
    recipe asked for."""
    m, lora, train = recipe.model, recipe.lora, recipe.train
    tokenizer, config, spec = configure_base(recipe, base_id)
    reference = copy.deepcopy(config)  # what the rotary must give, whatever unsloth does to the config it gets
    quantization = quantization_config(recipe)
    common = dict(
        use_gradient_checkpointing="unsloth" if train.gradient_checkpointing else False, random_state=train.seed
    )
    model, _ = fast.from_pretrained(
        model_name=base_id,
        config=config,
        max_seq_length=recipe.data.max_length,
        dtype=torch_dtype(m.dtype),
        load_in_4bit=m.load_in_4bit,
        **({"quantization_config": quantization} if quantization is not None else {}),
        revision=m.revision,
        trust_remote_code=m.trust_remote_code,
        # the recipe's base as it is: with load_in_4bit unsloth would otherwise swap in its own pre-quantized mirror
        # (another repository, without the revision and with that checkpoint's baked-in quantization settings)
        use_exact_model_name=True,
        **common,
    )
    check_rope(model, reference, "after FastLanguageModel.from_pretrained")
    finish_base(recipe, model)
    model = fast.get_peft_model(
        model,
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        modules_to_save=[input_embedding_path(model)] if lora.embeddings == "full" else None,
        **common,
    )
    check_rope(model, reference, "after FastLanguageModel.get_peft_model")
    return model, tokenizer, spec


def check_rope(model: Any, config: Any, when: str) -> None:
    """Refuse a model whose rotary frequencies are not the recipe's (one line, naming the backend)."""
    try:
        check_rotary_frequencies(model, config)
    except RotaryMismatch as exc:
        raise RotaryMismatch(
            f"train.backend: unsloth changed the RoPE {when} ({exc}); unsloth stacks its own scaling when "
            "max_seq_length exceeds the config's max_position_embeddings. Refusing to train: set "
            "rope.max_position_embeddings >= data.max_length, or use train.backend: transformers"
        ) from None
