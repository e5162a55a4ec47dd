"""STRING (An et al., 2024): training-free shifted query positions for far keys at inference.

``enable_string(model)`` / ``disable_string(model)`` switch it on a built model; the active settings
show in ``print(model)`` on every attention module. The ``string`` section of a recipe or of
``longpeft.json`` (:class:`StringConfig`) switches it on when an adapter is loaded. The attention
math and its exactness argument are in :mod:`.attention`.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from ...config import StrictModel
from ..registry import Method, ResolveContext
from .attention import (
    DEFAULT_LOCAL_WINDOW,
    STRING_ATTENTION,
    StringSettings,
    disable_string,
    enable_string,
    rotate_keys_forward,
    string_attention_eager,
    string_attention_flash,
    string_attention_forward,
    string_attention_sdpa,
    string_settings,
)


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
    merge_loses="STRING lives in longpeft's attention patch, not in the weights or config.json",
)

__all__ = [
    "METHOD",
    "STRING_ATTENTION",
    "StringConfig",
    "StringSettings",
    "disable_string",
    "enable_string",
    "rotate_keys_forward",
    "string_attention_eager",
    "string_attention_flash",
    "string_attention_forward",
    "string_attention_sdpa",
    "string_settings",
]
