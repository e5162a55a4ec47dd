"""STRING (An et al., 2024): training-free shifted query positions for far keys at inference.

``enable_string(model)`` / ``disable_string(model)`` switch it on a built model; the active settings
show in ``print(model)`` on every attention module. The ``string`` section of a recipe or of
``longpeft.json`` (:class:`StringConfig`) switches it on when an adapter is loaded. The attention
math and its exactness argument are in :mod:`.attention`; a merged model keeps STRING through the
modeling file :mod:`.export` writes beside it (``trust_remote_code=True``).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator
from torch import nn

from ...config import StrictModel
from ...errors import ConfigError
from ...family import causal_lm_of, check_supported
from ..registry import Method, ResolveContext
from .attention import (
    DEFAULT_LOCAL_WINDOW,
    STRING_ATTENTION,
    StringSettings,
    disable_string,
    install_string,
    rotate_keys_forward,
    string_attention_eager,
    string_attention_flash,
    string_attention_forward,
    string_attention_sdpa,
    string_settings,
)
from .export import write_remote_code

# Methods STRING cannot run with, and why (recipes naming both are refused; so is enabling it on such a model).
EXCLUDES = {
    "harpe": "STRING needs one RoPE base for all heads, and HARPE gives each head its own",
    "beacon": "Activation Beacon keeps positions inside the base's window already, and its cache holds beacon keys "
              "whose positions are not their cache indices (STRING reads distances off those)",
}


def enable_string(
    model: nn.Module,
    shift: int | None = None,
    local_window: int = DEFAULT_LOCAL_WINDOW,
    trained_length: int | None = None,
    cos_sin_scale: float | None = None,
) -> dict[str, Any]:
    """Switch STRING on, in place (calling it again replaces the settings).

    Args:
        model: a transformers Llama/Mistral/Qwen2/Qwen3 causal LM, plain or PEFT-wrapped, with
            eager, SDPA or flash-attention attention.
        shift: S; keys at distance ``>= S`` are scored as at ``d - S + local_window``.
            Default ``trained_length // 3``.
        local_window: W (default 128); must be ``<= shift``.
        trained_length: L, the length the model was trained at; default
            ``config.max_position_embeddings``.
        cos_sin_scale: optional factor on the cos/sin of queries and keys (the authors' ~1.07);
            multiplies every attention logit by its square. Off (None) by default.

    Returns:
        The active settings as a dict (also given by :func:`string_settings`).
    """
    config = causal_lm_of(model).config
    if not isinstance(getattr(config, "string", None), dict):  # an exported STRING model is a supported architecture
        check_supported(config, "STRING")
    for name, attribute in (("harpe", "head_rope_bases"), ("beacon", "beacon")):
        if getattr(config, attribute, None):
            raise ConfigError(f"this model has {name} on (config.{attribute}): {EXCLUDES[name]}; STRING cannot be "
                              f"combined with {name}")
    trained_length = int(trained_length if trained_length is not None else config.max_position_embeddings)
    shift = int(shift if shift is not None else trained_length // 3)
    scale = None if cos_sin_scale is None else float(cos_sin_scale)
    settings = StringSettings(shift, int(local_window), trained_length, scale)
    install_string(model, settings)
    return settings.as_dict()


class StringConfig(StrictModel):
    """STRING settings: keys at distance ``d >= shift`` score as at ``d - shift + local_window``.

    ``shift`` defaults to ``trained_length // 3``; ``trained_length`` defaults to the adapter's
    training length (when resolved by a recipe) or the model's ``max_position_embeddings``.
    """

    shift: int | None = Field(default=None, ge=1)
    local_window: int = Field(default=DEFAULT_LOCAL_WINDOW, ge=0)
    trained_length: int | None = Field(default=None, ge=2)
    cos_sin_scale: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _window_inside_shift(self) -> StringConfig:
        if self.shift is not None and self.local_window > self.shift:
            raise ValueError(f"local_window ({self.local_window}) must be <= shift ({self.shift})")
        return self


def resolve(config: StringConfig, context: ResolveContext) -> StringConfig:
    """Fill the trained length (the recipe's training length) and the default shift L // 3."""
    trained = config.trained_length or context.trained_length or context.base_config.max_position_embeddings
    return config.model_copy(update={"trained_length": trained, "shift": config.shift or trained // 3})


def apply(model, config: StringConfig) -> None:
    enable_string(model, **config.model_dump())


def describe(config: StringConfig) -> list[str]:
    return [
        f"STRING at inference: keys at distance >= {config.shift} are scored as if at distance "
        f"d - {config.shift} + {config.local_window} (trained length {config.trained_length})."
    ]


def model_span(model, length: int) -> tuple[int, int]:
    """(positions, keys) of an input of ``length`` tokens with STRING on: the largest scored distance + 1
    (far keys score as at ``d - shift + local_window``); every key is still read."""
    settings = string_settings(model)
    return max(min(length, settings["shift"]), length - settings["shift"] + settings["local_window"]), length


METHOD = Method(
    name="string",
    config=StringConfig,
    apply=apply,
    remove=disable_string,
    is_applied=lambda model: string_settings(model) is not None,
    resolve=resolve,
    describe=describe,
    model_span=model_span,
    export=lambda model, folder, config: write_remote_code(folder, StringSettings(**config.model_dump())),
    remote_code=True,
    inference_only=True,
    excludes=EXCLUDES,
    kernel_conflict=(
        "its attention forward rotates queries and keys itself (shifted positions for far keys), "
        "where Liger's RoPE kernel does not reach, and the pair is not checked"
    ),
)

__all__ = [
    "METHOD",
    "STRING_ATTENTION",
    "StringConfig",
    "StringSettings",
    "disable_string",
    "enable_string",
    "install_string",
    "rotate_keys_forward",
    "string_attention_eager",
    "string_attention_flash",
    "string_attention_forward",
    "string_attention_sdpa",
    "string_settings",
    "write_remote_code",
]
