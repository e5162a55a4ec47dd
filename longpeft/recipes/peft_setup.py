"""What a recipe trains, set up on the loaded base: peft's LoRA config (trained embeddings, tied heads), the base
frozen for ``finetune: method``, the methods' own weights trainable, and every trained weight's dtype.

TRL's SFTTrainer wraps the model in peft from :func:`peft_config` (unsloth's backend adds LoRA itself);
:func:`set_trained_weights` then runs on the model it wrapped.
"""

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


def peft_config(recipe: Recipe, model: PreTrainedModel) -> LoraConfig | None:
    """The LoRA config TRL's trainer wraps ``model`` in: :func:`lora_config` with the transformers backend, None
    with unsloth's (which added LoRA when it loaded the base). With ``finetune: method`` the base is frozen here:
    only the method's weights train (:func:`set_trained_weights`)."""
    if recipe.finetune == "method":
        model.requires_grad_(False)
    return lora_config(recipe, model) if recipe.train.backend == "transformers" else None


def set_trained_weights(recipe: Recipe, model: Any) -> None:
    """On the model the trainer wrapped (peft's, with LoRA): the head bias TRL's fused loss reads
    (:func:`expose_token_indices_head_bias`), every trained weight kept in ``lora.trainable_dtype`` (float32 for a
    full fine-tune; :func:`keep_trained_weights_in`, with the transformers backend), and the methods' own weights
    trainable (peft froze everything but LoRA)."""
    expose_token_indices_head_bias(model)
    if recipe.train.backend == "transformers" and recipe.finetune in ("lora", "full"):
        trained_dtype = recipe.lora.trainable_dtype if recipe.finetune == "lora" else None
        keep_trained_weights_in(model, torch_dtype(trained_dtype or "float32"), torch_dtype(recipe.model.dtype))
    for parameter in method_parameters(recipe, model).values():
        parameter.requires_grad_(True)


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
    if recipe.finetune != "lora":
        return None
    lora = recipe.lora
    tied = model is not None and has_tied_embeddings(model)
    if tied and lora.embeddings == "token_indices" and model.get_output_embeddings().bias is not None:
        raise ConfigError(
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


def method_parameters(recipe: Recipe, model: Any) -> dict[str, Any]:
    """The own weights (Activation Beacon's) of every method the recipe applies, or none."""
    parameters: dict[str, Any] = {}
    for name in recipe.method_configs():
        parameters.update(METHODS[name].weight_parameters(model))
    return parameters


def adapter_settings(model: Any) -> dict[str, Any] | None:
    """The LoRA config of the trained adapter (whichever backend added it); None for full fine-tuning."""
    configs = getattr(model, "peft_config", None) or {}
    return configs["default"].to_dict() if "default" in configs else None
