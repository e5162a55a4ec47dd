"""Per-head RoPE (HARPE) for the Llama, Mistral, Qwen2 and Qwen3 models of transformers; longpeft patches models
with this file and ships it beside an exported HARPE model.

KV head ``g`` rotates its keys, and the queries of its group, with RoPE of base ``config.head_rope_bases[g]``
(frequency ``j``: ``b_g ** (-2j / head_dim)``). The model's rotary module becomes a :class:`HeadRotaryEmbedding`
(cos/sin with a KV-head axis) and every attention forward :func:`head_rope_attention_forward`; projections, Qwen3's
q/k norms, the KV cache and the attention kernel are the model's own."""

from __future__ import annotations

from collections.abc import Sequence
from types import MethodType

import torch
from torch import nn

# longpeft-inline-begin
from ...family import attention_kernel, define_export_classes, is_attention_module, pop_cache
from ...rope import cos_sin, per_head_inv_freq, rotate_per_head

# longpeft-inline-end


class HeadRotaryEmbedding(nn.Module):
    """Rotary embedding with one RoPE base per KV head, keeping the module it ``replaced`` (unregistered). No buffer:
    frequencies computed on the CPU and cached per device are right on a model built on the meta device too."""

    def __init__(self, bases: Sequence[float], head_dim: int, replaced: nn.Module | None = None) -> None:
        super().__init__()
        self.bases = [float(b) for b in bases]
        self.head_dim = int(head_dim)
        self.__dict__["replaced"] = replaced  # not a submodule: no parameters, not in state_dict
        self._inv_freq_by_device: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """``[kv_heads, head_dim // 2]`` float32 frequencies on ``device``."""
        if device not in self._inv_freq_by_device:
            self._inv_freq_by_device[device] = per_head_inv_freq(self.bases, self.head_dim).to(device)
        return self._inv_freq_by_device[device]

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` of ``position_ids`` ``[batch, seq]``, each ``[batch, kv_heads, seq, head_dim]`` in the dtype
        and on the device of ``x`` (the hidden states); the angles in float32, as transformers computes them."""
        return cos_sin(position_ids, self.inv_freq(x.device), x.dtype)

    def extra_repr(self) -> str:
        return f"bases={self.bases}, head_dim={self.head_dim}"


def head_rope_attention_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Llama/Mistral/Qwen2/Qwen3's attention forward with the per-head cos/sin of :class:`HeadRotaryEmbedding`:
    ``hidden_states [batch, seq, hidden]`` -> ``(output [batch, seq, hidden], attention weights or None)``."""
    cos, sin = position_embeddings
    if cos.dim() != 4:
        raise RuntimeError(
            f"{type(self).__name__} is patched for per-head RoPE but received cos of shape {tuple(cos.shape)}; "
            "the model's rotary module must be a HeadRotaryEmbedding (apply the head bases to the whole model)"
        )
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query_states = self.q_proj(hidden_states).view(hidden_shape)
    key_states = self.k_proj(hidden_states).view(hidden_shape)
    if hasattr(self, "q_norm"):  # Qwen3 normalises each head before the rotation
        query_states, key_states = self.q_norm(query_states), self.k_norm(key_states)
    query_states, key_states = (rotate_per_head(x.transpose(1, 2), cos, sin) for x in (query_states, key_states))
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    cache = pop_cache(kwargs)
    if cache is not None:
        key_states, value_states = cache.update(key_states, value_states, self.layer_idx)
    output, weights = attention_kernel(self, query_states, key_states, value_states, attention_mask, **kwargs)
    return self.o_proj(output.reshape(*input_shape, -1).contiguous()), weights


def patch_head_rope(model: nn.Module, bases: Sequence[float]) -> None:
    """Give a built model one RoPE base per KV head, in place, unchecked (``apply_head_bases`` checks); the bases are
    recorded as ``config.head_rope_bases``."""
    bases = [float(b) for b in bases]
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, HeadRotaryEmbedding):
                setattr(parent, name, HeadRotaryEmbedding(bases, child.head_dim, child.replaced))
            elif hasattr(child, "inv_freq") and hasattr(child, "rope_type"):
                setattr(parent, name, HeadRotaryEmbedding(bases, child.inv_freq.numel() * 2, replaced=child))
    for module in model.modules():
        if is_attention_module(module):
            module.forward = MethodType(head_rope_attention_forward, module)
            module.config.head_rope_bases = bases
    model.config.head_rope_bases = bases


class _HeadRopeCausalLM:
    """one RoPE base per KV head (``config.head_rope_bases``)."""

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        bases = getattr(config, "head_rope_bases", None)
        if not bases:
            raise ValueError("config.json has no head_rope_bases: this is not a HARPE model")
        patch_head_rope(self, bases)


# Base model_type -> (exported model_type, config class name, causal-LM class name) for auto_map.
EXPORT_CLASSES_BY_MODEL_TYPE = define_export_classes(globals(), "harpe", _HeadRopeCausalLM)
