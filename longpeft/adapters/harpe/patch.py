"""Switch HARPE's per-head RoPE on and off on a built transformers model (plain or PEFT-wrapped); the rotation is
:mod:`.modeling`'s, which exported models ship too."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

from torch import nn

from ...base_config import rope_parameters_of
from ...family import attention_modules
from ...rope import rotary_modules
from ..registry import check_applicable
from .config import check_head_bases
from .modeling import HeadRotaryEmbedding, patch_head_rope


def _config_of(model: nn.Module):
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no .config; pass a transformers causal LM (or its PEFT wrapper)")
    return config


def apply_head_bases(model: nn.Module, bases: Sequence[float]) -> None:
    """Give every KV head of ``model`` (a Llama, Mistral, Qwen2 or Qwen3 causal LM or its inner model, plain or
    PEFT-wrapped) one of the ``num_key_value_heads`` ``bases``, in place, replacing earlier ones; they are stored as
    ``config.head_rope_bases`` (``save_pretrained`` keeps them) and give plain RoPE frequencies (another rope_type's
    scaling is lost, with a warning)."""
    config = _config_of(model)
    bases = check_head_bases(config, bases)
    check_applicable(model, "harpe")
    rope_type = rope_parameters_of(config).get("rope_type", "default")
    if rope_type != "default":
        warnings.warn(
            f"the model's rope_type is {rope_type!r}; HARPE replaces it with plain RoPE at one base per head",
            stacklevel=2,
        )
    if not attention_modules(model):
        raise ValueError(f"found no attention module with q/k/v/o projections in {type(model).__name__}")
    if not has_head_bases(model) and not rotary_modules(model):
        raise ValueError(f"found no rotary embedding module in {type(model).__name__}; is it a RoPE model?")
    patch_head_rope(model, bases)


def has_head_bases(model: nn.Module) -> bool:
    """Whether HARPE's per-head RoPE is active on ``model``."""
    return any(isinstance(m, HeadRotaryEmbedding) for m in model.modules())


def is_harpe_on(model: nn.Module) -> bool:
    """Whether ``model`` rotates with one base per head (:func:`apply_head_bases`, or an exported HARPE model)."""
    return has_head_bases(model) or bool(getattr(_config_of(model), "head_rope_bases", None))


def remove_head_bases(model: nn.Module) -> None:
    """Undo :func:`apply_head_bases` exactly; ValueError when the model has no per-head RoPE."""
    if not has_head_bases(model):
        raise ValueError(f"{type(model).__name__} has no HARPE per-head RoPE to remove")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, HeadRotaryEmbedding):
                if child.replaced is None:
                    raise ValueError("this per-head rotary module was built without the original one; cannot restore")
                setattr(parent, name, child.replaced)
    attentions = attention_modules(model)
    for module in attentions:
        module.__dict__.pop("forward", None)  # the class's forward again
    for config in (_config_of(model), *(module.config for module in attentions)):
        if hasattr(config, "head_rope_bases"):  # (a config shared by several modules: once)
            del config.head_rope_bases
