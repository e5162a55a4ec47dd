"""Per-head RoPE (HARPE) for Llama, Mistral, Qwen2 and Qwen3 models of transformers.

longpeft patches models with this file, and writes it beside an exported HARPE model, where
``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` loads it through the
``auto_map`` of config.json without longpeft installed. Its only longpeft imports are the RoPE and
model-family helpers between the ``longpeft-inline`` markers, which the export replaces by their
source (see ``export.standalone_modeling_source``), so the exported file imports only torch and transformers.

Each key/value head ``g`` rotates its keys, and the queries of its group, with its own RoPE base
``config.head_rope_bases[g]``: frequency ``j`` of head ``g`` is ``b_g ** (-2j / head_dim)``, the
standard RoPE frequency of base ``b_g``. With grouped-query attention, the query heads that read
KV head ``g`` share its base (a query and the key it scores must rotate at the same speed for the
score to depend on the relative position only).

Two changes make a model per-head:

- the model's rotary module is replaced by :class:`HeadRotaryEmbedding`, which returns cos/sin with
  a KV-head axis, ``[batch, kv_heads, seq, head_dim]``;
- every attention module's forward is replaced by :func:`head_rope_attention_forward`, which
  rotates with those per-head cos/sin. Everything else (projections, Qwen3's q/k norms, the KV
  cache, the attention kernel: eager, SDPA or flash-attn) is the model's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import MethodType

import torch
from torch import nn

# longpeft-inline-begin
from ...family import attention_kernel, define_export_classes, is_attention_module, kernel_interface, pop_cache
from ...rope import apply_rotary, cos_sin, inv_freq, per_head_inv_freq, rotate_half, rotate_per_head

# longpeft-inline-end
INLINED_ON_EXPORT = (
    inv_freq,
    per_head_inv_freq,
    rotate_half,
    apply_rotary,
    rotate_per_head,
    cos_sin,
    is_attention_module,
    kernel_interface,
    attention_kernel,
    pop_cache,
    define_export_classes,
)


class HeadRotaryEmbedding(nn.Module):
    """Rotary embedding with one RoPE base per key/value head.

    Holds no buffer: the frequencies are computed on the CPU from ``bases`` and cached per device,
    so a model built on the meta device (as ``from_pretrained`` does) still gets correct values.

    Args:
        bases: one RoPE base per KV head.
        head_dim: size of one attention head (even).
        replaced: the rotary module this one replaces (kept, unregistered, so it can be restored).
    """

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
        """Per-head cos and sin.

        Args:
            x: any tensor of the model's compute dtype and device (the hidden states).
            position_ids: ``[batch, seq]`` integer positions.

        Returns:
            ``(cos, sin)``, each ``[batch, kv_heads, seq, head_dim]`` in ``x.dtype``; the angles are
            computed in float32 as transformers does.
        """
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
    """The attention forward of Llama/Mistral/Qwen2/Qwen3, rotating with per-head cos/sin.

    Bound to each attention module as its ``forward``. Identical to the models' own forward except
    for the rotation; Qwen3's per-head q/k RMSNorm (present as ``q_norm``/``k_norm``) runs before it,
    as in Qwen3.

    Args:
        hidden_states: ``[batch, seq, hidden]``.
        position_embeddings: ``(cos, sin)`` from :class:`HeadRotaryEmbedding`, ``[batch, kv_heads, seq, head_dim]``.
        attention_mask, kwargs: as the model's attention receives them (the KV cache as ``cache`` from
            transformers 5.24, ``past_key_values`` before).

    Returns:
        ``(output [batch, seq, hidden], attention weights or None)``.
    """
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
    query_states = rotate_per_head(query_states.transpose(1, 2), cos, sin)
    key_states = rotate_per_head(key_states.transpose(1, 2), cos, sin)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

    cache = pop_cache(kwargs)
    if cache is not None:
        key_states, value_states = cache.update(key_states, value_states, self.layer_idx)

    attn_output, attn_weights = attention_kernel(
        self, query_states, key_states, value_states, attention_mask, **kwargs
    )
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    return self.o_proj(attn_output), attn_weights


def patch_head_rope(model: nn.Module, bases: Sequence[float]) -> None:
    """Give a built model one RoPE base per KV head, in place (no validation; see longpeft for that).

    Replaces every rotary module (a child with ``inv_freq`` and ``rope_type``, or an earlier
    :class:`HeadRotaryEmbedding`) and binds :func:`head_rope_attention_forward` to every attention
    module. Also records the bases as ``config.head_rope_bases``.
    """
    bases = [float(b) for b in bases]
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, HeadRotaryEmbedding):
                setattr(parent, name, HeadRotaryEmbedding(bases, child.head_dim, child.replaced))
            elif hasattr(child, "inv_freq") and hasattr(child, "rope_type"):
                head_dim = child.inv_freq.numel() * 2
                setattr(parent, name, HeadRotaryEmbedding(bases, head_dim, replaced=child))
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


# Base model_type -> (exported model_type, config class name, causal-LM class name) for auto_map:
# HarpeLlamaConfig (model_type "harpe_llama") and HarpeLlamaForCausalLM, ...
EXPORT_CLASSES_BY_MODEL_TYPE = define_export_classes(globals(), "harpe", _HeadRopeCausalLM)
