"""STRING on a built model: switched on with a section's settings, whether it is on, and what an input costs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from ...family import causal_lm_of, check_supported
from ...spec import SPEC_FILENAME, ContextSpec
from ..registry import check_applicable
from .attention import StringSettings, install_string, string_settings
from .config import DEFAULT_LOCAL_WINDOW, string_defaults


def enable_string(
    model: nn.Module,
    shift: int | None = None,
    local_window: int = DEFAULT_LOCAL_WINDOW,
    trained_length: int | None = None,
    cos_sin_scale: float | None = None,
) -> dict[str, Any]:
    """Switch STRING on ``model`` (a Llama/Mistral/Qwen2/Qwen3 causal LM, plain or PEFT-wrapped, with eager, SDPA or
    flash-attention attention), in place, replacing earlier settings; returns them as :func:`string_settings` does.

    Keys at distance ``d >= shift`` (default ``trained_length // 3``) score as at ``d - shift + local_window``
    (``local_window <= shift``). ``trained_length`` (L) defaults to :func:`recorded_trained_length`, else
    ``max_position_embeddings``. ``cos_sin_scale`` (the authors' ~1.07; None: off) multiplies the cos/sin of queries
    and keys, so every attention logit by its square. MethodConflict when a method STRING cannot run with is on.
    """
    config = causal_lm_of(model).config
    if not isinstance(getattr(config, "string", None), dict):  # an exported STRING model is a supported architecture
        check_supported(config, "STRING")
    check_applicable(model, "string")
    recorded = recorded_trained_length(model) if trained_length is None else None
    shift, trained_length = string_defaults(shift, trained_length, recorded, config.max_position_embeddings)
    scale = None if cos_sin_scale is None else float(cos_sin_scale)
    settings = StringSettings(int(shift), int(local_window), int(trained_length), scale)
    install_string(model, settings)
    return settings.as_dict()


def recorded_trained_length(model: nn.Module) -> int | None:
    """The ``trained_length`` of the longpeft.json ``longpeft.load`` applied (``model.longpeft_spec``), else of the
    one in the folder the model was loaded from (a merged model's); None without one, or when it records none."""
    spec = getattr(model, "longpeft_spec", None)
    if spec is None:
        source = getattr(causal_lm_of(model).config, "name_or_path", None)
        if source and (Path(source) / SPEC_FILENAME).is_file():
            spec = ContextSpec.load(Path(source))
    return spec.trained_length if spec is not None else None


def is_string_on(model: nn.Module) -> bool:
    """Whether STRING is on ``model``."""
    return string_settings(model) is not None


def model_span(model: nn.Module, length: int) -> tuple[int, int]:
    """(positions, keys) of an input of ``length`` tokens with STRING on: the largest scored distance + 1
    (far keys score as at ``d - shift + local_window``); every key is still read."""
    settings = string_settings(model)
    return max(min(length, settings["shift"]), length - settings["shift"] + settings["local_window"]), length
