"""The ``string`` section of recipes and of ``longpeft.json``: STRING's shift and local window (no torch)."""

from __future__ import annotations

from pydantic import Field, model_validator

from ...config import MAX_POSITIONS, StrictModel
from ..registry import ResolveContext

DEFAULT_LOCAL_WINDOW = 128  # W: far keys score as at distance d - shift + W


class StringConfig(StrictModel):
    """STRING settings: keys ``d >= shift`` away score as at ``d - shift + local_window`` (:func:`string_defaults`)."""

    shift: int | None = Field(default=None, ge=1, le=MAX_POSITIONS)
    local_window: int = Field(default=DEFAULT_LOCAL_WINDOW, ge=0, le=MAX_POSITIONS)
    trained_length: int | None = Field(default=None, ge=2, le=MAX_POSITIONS)
    cos_sin_scale: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _window_inside_shift(self) -> StringConfig:
        if self.shift is not None and self.local_window > self.shift:
            raise ValueError(f"local_window ({self.local_window}) must be <= shift ({self.shift})")
        return self


def string_defaults(
    shift: int | None, trained_length: int | None, recorded_length: int | None, max_position_embeddings: int
) -> tuple[int, int]:
    """``(shift, trained_length)`` with STRING's defaults: L is ``trained_length``, else ``recorded_length`` (the
    model's longpeft.json's), else ``max_position_embeddings``; S is ``shift``, else L // 3."""
    trained = trained_length if trained_length is not None else recorded_length or max_position_embeddings
    return (shift if shift is not None else trained // 3), trained


def resolve(config: StringConfig, context: ResolveContext) -> StringConfig:
    """Fill the trained length (the recipe's training length) and the default shift L // 3."""
    shift, trained = string_defaults(
        config.shift, config.trained_length, context.trained_length, context.base_config.max_position_embeddings
    )
    return config.model_copy(update={"trained_length": trained, "shift": shift})


def describe(config: StringConfig) -> list[str]:
    """Model-card sentence: the shifted distances and the trained length."""
    return [
        f"STRING at inference: keys at distance >= {config.shift} are scored as if at distance "
        f"d - {config.shift} + {config.local_window} (trained length {config.trained_length})."
    ]
