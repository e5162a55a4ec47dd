"""What a recipe trains: peft's LoRA config (:func:`lora_config`, which TRL's SFTTrainer wraps the model in), then,
on the wrapped model, the methods' own weights and every trained weight's dtype (:func:`set_trained_weights`)."""

from __future__ import annotations

from typing import Any

import torch
from peft import LoraConfig
from peft.utils.other import TrainableTokensWrapper
from transformers import PreTrainedModel

from ..adapters import METHODS
from ..config import torch_dtype
from ..errors import ConfigError
from .schema import Recipe


def set_trained_weights(recipe: Recipe, model: Any) -> None:
    """On the model the trainer wrapped: every trained weight kept in ``lora.trainable_dtype`` (float32 for a full
    fine-tune; transformers backend only), the methods' own weights trainable (peft froze everything but LoRA), and
    ``bias = None`` on a head peft wrapped for ``lora.embeddings: token_indices``: TRL's fused loss reads it beside the
    head's effective ``[vocab, hidden]`` weight, and its forward adds none (:func:`lora_config` refuses a bias)."""
    if isinstance(model.get_output_embeddings(), TrainableTokensWrapper):
        model.get_output_embeddings().bias = None
    if recipe.train.backend == "transformers" and recipe.finetune in ("lora", "full"):
        trained_dtype = recipe.lora.trainable_dtype if recipe.finetune == "lora" else None
        keep_trained_weights_in(model, torch_dtype(trained_dtype or "float32"), torch_dtype(recipe.model.dtype))
    for name in recipe.method_configs():
        for parameter in METHODS[name].weight_parameters(model).values():
            parameter.requires_grad_(True)


def lora_config(recipe: Recipe, model: PreTrainedModel) -> LoraConfig | None:
    """The peft LoraConfig TRL's trainer wraps ``model`` in; None without LoRA (``finetune: full`` or ``method``) and
    with the unsloth backend (which added LoRA when it loaded the base).

    On a model with tied input/output embeddings a trained embedding stays tied to the output head (one trained
    matrix; peft ties ``token_indices`` rows by itself). ``lora.embeddings: token_indices`` is refused on a tied head
    with a bias: peft's trainable tokens drop it.
    """
    if recipe.finetune != "lora" or recipe.train.backend != "transformers":
        return None
    lora, head = recipe.lora, model.get_output_embeddings()
    tied = head is not None and head.weight is model.get_input_embeddings().weight
    if tied and lora.embeddings == "token_indices" and head.bias is not None:
        raise ConfigError(
            f"recipe {recipe.name}: lora.embeddings: token_indices on a base whose tied output head has a bias: "
            "peft's trainable tokens leave the bias out of the head's forward; use lora.embeddings: full"
        )
    embedding = input_embedding_path(model)
    token_indices = {embedding: list(lora.trainable_token_indices)} if lora.embeddings == "token_indices" else None
    return LoraConfig(
        ensure_weight_tying=tied and lora.embeddings == "full",
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        modules_to_save=[embedding] if lora.embeddings == "full" else None,
        trainable_token_indices=token_indices,
        task_type="CAUSAL_LM",
    )


def input_embedding_path(model: PreTrainedModel) -> str:
    """The input embedding's module path (e.g. ``model.embed_tokens``; peft matches by suffix, and a bare
    ``embed_tokens`` would match Activation Beacon's ``beacon_embed_tokens`` too)."""
    embedding = model.get_input_embeddings()
    return next(name for name, module in model.named_modules() if module is embedding)


def keep_trained_weights_in(model: Any, dtype: torch.dtype, compute_dtype: torch.dtype) -> None:
    """Keep every trained weight of ``model`` in ``dtype`` (``lora.trainable_dtype``: docs/recipes.md) while the
    forward computes in ``compute_dtype`` (autocast); the input embedding's output is cast to ``compute_dtype``, so
    that a float32 embedding does not turn the residual stream and checkpointed layer inputs into float32."""
    for parameter in model.parameters():
        if parameter.requires_grad and parameter.is_floating_point() and parameter.dtype != dtype:
            parameter.data = parameter.data.to(dtype)
    embeddings = model.get_input_embeddings()
    if dtype != compute_dtype and any(p.requires_grad for p in embeddings.parameters()):
        embeddings.register_forward_hook(lambda module, args, output: output.to(compute_dtype))


def adapter_settings(model: Any) -> dict[str, Any] | None:
    """The LoRA config of the trained adapter (whichever backend added it); None for full fine-tuning."""
    configs = getattr(model, "peft_config", None) or {}
    return configs["default"].to_dict() if "default" in configs else None
