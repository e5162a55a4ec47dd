"""Set RoPE parameters on a built model, and restore them: the torch side of the ``rope`` method."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ...base_config import rope_parameters_of
from ...rope import set_rope_parameters
from .config import resolve_rope_parameters


def expand_rope_base(
    model: nn.Module, rope_parameters: dict[str, Any], max_position_embeddings: int | None = None
) -> torch.Tensor:
    """Set ``rope_parameters`` (complete or partial: :func:`resolve_rope_parameters`) and the new context length
    ``max_position_embeddings`` on a built causal LM (plain or PEFT-wrapped), checking that the rotary frequencies
    changed; returns the rotary module's new ``inv_freq`` ``[head_dim // 2]``."""
    params = resolve_rope_parameters(model.config, rope_parameters)
    original = getattr(model, "_longpeft_original_rope", None)
    if original is None:  # remembered once: remove() restores the model as it was before the first change
        original = (rope_parameters_of(model.config), model.config.max_position_embeddings)
    new = set_rope_parameters(model, params, max_position_embeddings)
    model._longpeft_original_rope = original
    return new


def restore_rope(model: nn.Module) -> None:
    """Restore the RoPE parameters the model had before :func:`expand_rope_base` first changed them."""
    original = getattr(model, "_longpeft_original_rope", None)
    if original is None:
        raise ValueError(f"{type(model).__name__} has no RoPE change made by longpeft to remove")
    params, max_positions = original
    set_rope_parameters(model, copy.deepcopy(params), max_positions)
    del model._longpeft_original_rope


def has_rope_change(model: nn.Module) -> bool:
    """Whether :func:`expand_rope_base` changed ``model``'s RoPE parameters, not undone by :func:`restore_rope`."""
    return getattr(model, "_longpeft_original_rope", None) is not None
