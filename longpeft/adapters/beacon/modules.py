"""Beacon weights and the attention forward that uses them on beacon rows only.

Each projection named in ``params`` gets a float32 beacon twin ``beacon_{q,k,v,o}_proj``: a :class:`BeaconLinear`
(``full``) or a :class:`BeaconLoraDelta` (``lora``). The stock projection computes every row; the twin, applied to
the beacon rows only, overwrites them (its output cast back to the model's dtype).

This module imports only torch and transformers: it is part of the exported modeling file.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# longpeft-inline-begin
from ...family import attention_kernel, pop_cache
from ...rope import apply_rotary
from .cache import BeaconStep

# longpeft-inline-end


class BeaconLinear(nn.Module):
    """``full`` beacon projection: ``y = W_b x + b_b`` with its own float32 weight ``[out, in]`` (and bias)."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=torch.float32))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=torch.float32)) if bias else None

    def forward(self, x: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """``x [..., in]`` beacon rows, ``base [..., out]`` the stock projection of them (unused)."""
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)


class BeaconLoraDelta(nn.Module):
    """``lora`` beacon projection: ``y = base(x) + (alpha / rank) B A x``, ``A [rank, in]``, ``B [out, rank] = 0``."""

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float) -> None:
        super().__init__()
        self.lora_A = nn.Linear(in_features, rank, bias=False, dtype=torch.float32)
        self.lora_B = nn.Linear(rank, out_features, bias=False, dtype=torch.float32)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=5**0.5)
        nn.init.zeros_(self.lora_B.weight)
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """``x [..., in]`` beacon rows, ``base [..., out]`` the stock projection of them."""
        return base + self.lora_B(self.lora_A(x.to(self.lora_A.weight.dtype))) * self.scaling


def project(attention: nn.Module, name: str, x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """The stock ``{name}_proj`` of ``x [batch, seq, in]``, with the beacon twin on ``rows`` (indices into seq)."""
    y = getattr(attention, f"{name}_proj")(x)
    twin = getattr(attention, f"beacon_{name}_proj", None)
    if twin is None or rows is None or rows.numel() == 0:
        return y
    beacon = twin(x.index_select(1, rows), y.index_select(1, rows))
    return y.index_copy(1, rows, beacon.to(y.dtype))


def beacon_attention_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None = None,
    beacon_step: BeaconStep | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Llama/Mistral/Qwen2/Qwen3 attention with beacon projections on the step's beacon rows; without a
    ``beacon_step`` (beacons switched off), the stock forward. The pre-RoPE keys go to the beacon cache too.

    ``hidden_states [batch, seq, hidden]``, ``position_embeddings`` ``(cos, sin)`` each ``[batch, seq, head_dim]``,
    ``attention_mask`` (what the kernel takes), and in ``kwargs`` the kernel's and the cache (``cache``, or
    ``past_key_values`` before transformers 5.24: a :class:`~.cache.BeaconCache` with a ``beacon_step``, else any);
    returns ``(output [batch, seq, hidden], attention weights or None)``.
    """
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    rows = beacon_step.beacon_rows if beacon_step is not None else None
    query_states = project(self, "q", hidden_states, rows).view(hidden_shape)
    key_states = project(self, "k", hidden_states, rows).view(hidden_shape)
    value_states = project(self, "v", hidden_states, rows).view(hidden_shape).transpose(1, 2)
    if hasattr(self, "q_norm"):  # Qwen3 normalises each head before the rotation
        query_states, key_states = self.q_norm(query_states), self.k_norm(key_states)
    query_states, pre_rope_keys = query_states.transpose(1, 2), key_states.transpose(1, 2)
    cos, sin = (half.unsqueeze(1) for half in position_embeddings)
    query_states, key_states = apply_rotary(query_states, cos, sin), apply_rotary(pre_rope_keys, cos, sin)
    cache = pop_cache(kwargs)
    if cache is not None:
        extra = {} if beacon_step is None else {"beacon_step": beacon_step, "pre_rope_keys": pre_rope_keys}
        key_states, value_states = cache.update(key_states, value_states, self.layer_idx, **extra)

    output, weights = attention_kernel(self, query_states, key_states, value_states, attention_mask, **kwargs)
    return project(self, "o", output.reshape(*input_shape, -1).contiguous(), rows), weights
