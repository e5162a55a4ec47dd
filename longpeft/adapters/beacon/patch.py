"""Activation Beacon's weights and attention forward, and how they go on a built model and come off again.

Each projection named in ``params`` gets a float32 beacon twin ``beacon_{q,k,v,o}_proj`` (:class:`BeaconLinear` for
``full``, :class:`BeaconLoraDelta` for ``lora``) whose output replaces the stock projection's at the beacon rows.
``install_beacon`` also binds the beacon attention forward and the window scheduler, gives ``generate`` a beacon
cache and the scheduler the causal LM's ``logits_to_keep``, and records ``config.beacon``; ``remove_beacon`` undoes
all of it. Plain and peft-wrapped models, and bitsandbytes 4-bit bases (the ``full`` copies are dequantised).

This module imports only torch and transformers: it is part of the exported modeling file."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from types import MethodType

import torch
import torch.nn.functional as F
from torch import nn

# longpeft-inline-begin
from ...family import attention_kernel, attention_modules, backbone_of, causal_lm_of, pop_cache
from ...rope import apply_rotary
from .cache import BeaconStep
from .layout import BeaconSettings
from .scheduler import beacon_backbone_forward, beacon_prepare_cache_for_generation

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
    """The stock ``{name}_proj`` of ``x [batch, seq, in]``; on ``rows`` (into seq), the beacon twin's, in its dtype."""
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


def _base_layer(projection: nn.Module) -> nn.Module:
    """The innermost layer of a projection (a peft LoRA layer wraps its ``base_layer``)."""
    while hasattr(projection, "base_layer"):
        projection = projection.base_layer
    return projection


def dense_weight(projection: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight [out, in], bias [out] or None)`` of a projection: the base weight of a peft LoRA layer; of a
    bitsandbytes 4-bit layer, the weight it computes with, read off its output on the identity (bitsandbytes may
    repack a CPU weight after its first forward)."""
    projection = _base_layer(projection)
    bias = None if projection.bias is None else projection.bias.detach()
    if not hasattr(projection.weight, "quant_state"):
        return projection.weight.detach(), bias
    dtype = getattr(projection, "compute_dtype", None) or torch.float32
    with torch.no_grad():
        outputs = projection(torch.eye(projection.in_features, device=projection.weight.device, dtype=dtype))
    return (outputs - (0 if bias is None else bias.to(outputs.dtype))).T.contiguous(), bias


def _twin(projection: nn.Module, settings: BeaconSettings, initialise: bool) -> nn.Module:
    """The beacon twin of a projection: a float32 copy (``full``) or a zero delta (``lora``)."""
    base = _base_layer(projection)
    in_features, out_features, has_bias = base.in_features, base.out_features, base.bias is not None
    if settings.projection == "lora":
        twin = BeaconLoraDelta(in_features, out_features, settings.lora_rank, settings.lora_alpha)
    else:
        twin = BeaconLinear(in_features, out_features, has_bias)
        if initialise:
            weight, bias = dense_weight(base)
            with torch.no_grad():
                twin.weight.copy_(weight.reshape(out_features, in_features).float())
                if bias is not None:
                    twin.bias.copy_(bias.float())
    return twin.to(base.weight.device)


def _special_token_id(config, name: str) -> int:
    value = getattr(config, f"{name}_token_id", None)
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    if value is None:
        raise ValueError(
            f"beacon embed_init: {name} needs config.{name}_token_id, which this model does not set; "
            f"use the other embed_init or set config.{name}_token_id"
        )
    return int(value)


def _keep_last_forward(causal_lm: nn.Module) -> MethodType:
    """The causal LM's stock forward, bound to ``causal_lm``, passing an int ``logits_to_keep = k > 0`` to the decoder
    stack as ``beacon_keep_last`` (it then returns only the last ``k`` hidden states); it keeps the stock signature,
    which ``generate`` reads."""
    stock = type(causal_lm).forward

    @functools.wraps(stock)
    def forward(self, *args, logits_to_keep: int | torch.Tensor = 0, **kwargs):
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            kwargs["beacon_keep_last"] = logits_to_keep
        return stock(self, *args, logits_to_keep=logits_to_keep, **kwargs)

    return MethodType(forward, causal_lm)


def install_beacon(model: nn.Module, settings: BeaconSettings | dict, initialise: bool = True) -> None:
    """Give a causal LM Activation Beacon, in place: ``apply_beacon`` without its check of the methods beacon cannot
    run with (an exported model's classes call this). ``settings``: :class:`BeaconSettings` or its dict
    (``config.beacon``); the other arguments are ``apply_beacon``'s."""
    settings = settings if isinstance(settings, BeaconSettings) else BeaconSettings.from_dict(dict(settings))
    causal_lm, backbone = causal_lm_of(model), backbone_of(model)
    attentions = attention_modules(backbone)
    implementation = causal_lm.config._attn_implementation or "eager"
    if "flash" in implementation and settings.attn != "full-coverage":
        raise ValueError(
            f"beacon attn {settings.attn} needs an explicit mask, which {implementation} cannot take; "
            "load the model with attn_implementation='sdpa' (or use attn full-coverage)"
        )
    if not attentions:
        raise ValueError(f"found no attention module with q/k/v/o projections in {type(causal_lm).__name__}")
    init_token = _special_token_id(causal_lm.config, settings.embed_init) if initialise else None
    if is_beacon_applied(model):  # only once the new settings are known to apply: a refusal keeps the old beacons
        remove_beacon(model)
    embed = backbone.embed_tokens.weight
    row = nn.Embedding(1, embed.shape[1], dtype=torch.float32, device=embed.device)
    if init_token is not None:
        with torch.no_grad():
            row.weight[0] = embed[init_token].float()
    backbone.beacon_embed_tokens = row
    for attention in attentions:
        for name in settings.params:
            setattr(attention, f"beacon_{name}_proj", _twin(getattr(attention, f"{name}_proj"), settings, initialise))
        attention.forward = MethodType(beacon_attention_forward, attention)
    for layer in backbone.layers:
        layer._can_checkpoint_with_cache = True  # the recompute replays writes the beacon cache makes idempotent
    backbone.forward = MethodType(beacon_backbone_forward, backbone)
    backbone.beacon_settings = settings
    backbone.beacons_enabled = True
    causal_lm._prepare_cache_for_generation = MethodType(beacon_prepare_cache_for_generation, causal_lm)
    causal_lm.forward = _keep_last_forward(causal_lm)
    causal_lm.config.beacon = settings.as_dict()


def is_beacon_applied(model: nn.Module) -> bool:
    """Whether Activation Beacon is on ``model``."""
    try:
        return hasattr(backbone_of(model), "beacon_embed_tokens")
    except ValueError:
        return False


def remove_beacon(model: nn.Module) -> None:
    """Undo :func:`install_beacon`: the stock model again, parameter for parameter (ValueError: it has no beacons)."""
    if not is_beacon_applied(model):
        raise ValueError(f"{type(model).__name__} has no Activation Beacon to remove")
    causal_lm, backbone = causal_lm_of(model), backbone_of(model)
    del backbone.beacon_embed_tokens
    for name in ("forward", "beacon_settings", "beacons_enabled"):
        backbone.__dict__.pop(name, None)
    for attention in attention_modules(backbone):
        for name in [name for name, _ in attention.named_children() if name.startswith("beacon_")]:
            delattr(attention, name)
        attention.__dict__.pop("forward", None)
    for layer in backbone.layers:
        layer.__dict__.pop("_can_checkpoint_with_cache", None)
    causal_lm.__dict__.pop("_prepare_cache_for_generation", None)
    causal_lm.__dict__.pop("forward", None)
    causal_lm.config.__dict__.pop("beacon", None)


def beacon_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The beacon parameters by their name in the decoder stack (``layers.0.self_attn.beacon_q_proj.weight``, ...)."""
    return {name: p for name, p in backbone_of(model).named_parameters() if ".beacon_" in f".{name}"}


def trainable_beacon_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The beacon parameters that can learn: all but the last layer's beacon q and o projections, whose outputs
    nothing reads."""
    last = len(backbone_of(model).layers) - 1
    unread = (f"layers.{last}.self_attn.beacon_q_proj.", f"layers.{last}.self_attn.beacon_o_proj.")
    return {name: p for name, p in beacon_parameters(model).items() if not name.startswith(unread)}


@contextlib.contextmanager
def beacons_disabled(model: nn.Module) -> Iterator[None]:
    """Run a block with beacons off: the model computes what the stock model computes."""
    backbone = backbone_of(model)
    before = backbone.beacons_enabled
    backbone.beacons_enabled = False
    try:
        yield
    finally:
        backbone.beacons_enabled = before
