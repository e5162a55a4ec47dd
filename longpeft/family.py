"""Model-family facts in one place: which architectures longpeft supports, how to find their
attention modules, how many key/value heads they have.

Imports nothing heavy, so that modeling files exported beside merged models can inline it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

# transformers model types whose attention longpeft's per-module patches (HARPE, STRING, beacon) know.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def num_kv_heads(config: Any) -> int:
    """Number of key/value heads (``num_key_value_heads``, or the query heads for plain multi-head attention)."""
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def is_attention_module(module: nn.Module) -> bool:
    """Whether ``module`` is a Llama-family self-attention (q/k/v/o projections, a layer index)."""
    return all(hasattr(module, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj", "layer_idx", "head_dim"))


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """Every self-attention module of a model (plain or PEFT-wrapped), in layer order."""
    return [m for m in model.modules() if is_attention_module(m)]


def check_supported(config: Any, what: str) -> None:
    """Raise ValueError naming ``what`` when the config's model type is not one longpeft patches."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{what} supports model types {', '.join(SUPPORTED_MODEL_TYPES)}; this model is {model_type!r}")
