"""Activation Beacon on a built model through longpeft: :func:`apply_beacon` (the registry's conflicts checked, then
:func:`~.patch.install_beacon`), the settings only inference reads, and what an input costs a model with beacons."""

from __future__ import annotations

import pydantic
from torch import nn

from ...errors import ConfigError
from ...family import causal_lm_of
from ..registry import check_applicable
from .config import INFERENCE_SETTINGS, BeaconConfig
from .layout import BeaconSettings, window_span
from .patch import backbone_of, install_beacon, is_beacon_applied


def apply_beacon(model: nn.Module, settings: BeaconSettings | dict, initialise: bool = True) -> None:
    """Give a built Llama/Mistral/Qwen2/Qwen3 causal LM (plain or peft-wrapped) Activation Beacon, in place; applying
    again replaces the settings and the beacon weights. ``settings``: :class:`BeaconSettings`, or a dict of some or
    all of them (:func:`settings_from`). ``initialise``: copy the stock weights into the beacon weights (``full``) and
    the eos/bos row into the beacon embedding (off when the weights are loaded right after). Raises MethodConflict
    when a method beacon cannot run with is on (its registry ``conflicts``), ConfigError for a setting of the dict that
    :class:`BeaconConfig` refuses."""
    check_applicable(model, "beacon")
    install_beacon(model, settings if isinstance(settings, BeaconSettings) else settings_from(settings), initialise)


def settings_from(data: dict, what: str | None = None) -> BeaconSettings:
    """:class:`BeaconSettings` from a dict of every setting (``BeaconSettings.as_dict``) or of some of them, with
    :class:`BeaconConfig`'s defaults for the rest; a ConfigError names each key it does not have or value it refuses,
    after ``what`` (default: the dict). A whole dict under ``projection: full`` may record LoRA values (a
    ``config.beacon`` written so): they do not apply and are read as None."""
    if data.get("projection") == "full" and set(data) >= set(BeaconSettings.__dataclass_fields__):
        data = {**data, "lora_rank": None, "lora_alpha": None}
    try:
        return BeaconConfig(**data).settings()
    except pydantic.ValidationError as error:
        reasons = []
        for problem in error.errors():
            message = str(problem["msg"]).removeprefix("Value error, ")
            reasons.append(f"{'.'.join(map(str, problem['loc']))}: {message}" if problem["loc"] else message)
        raise ConfigError(f"{what or f'beacon settings {data}'}: {'; '.join(reasons)}") from error


def set_inference_settings(model: nn.Module, **changes) -> BeaconSettings:
    """Change the settings of a model with beacons that only inference reads (:data:`INFERENCE_SETTINGS`), keeping
    its beacon weights; returns the new settings. A request already under way keeps its cache, which the new settings
    may not fit: start new requests after the change. Raises ConfigError for a setting that is not an inference
    setting or a value :class:`BeaconConfig` refuses, ValueError when the model has no beacons."""
    other = sorted(set(changes) - set(INFERENCE_SETTINGS))
    if other:
        raise ConfigError(
            f"{other} are not inference settings ({', '.join(INFERENCE_SETTINGS)}); apply the beacons "
            "again (apply_beacon) to change the others"
        )
    if not is_beacon_applied(model):
        raise ValueError(f"{type(model).__name__} has no Activation Beacon")
    backbone = backbone_of(model)
    settings = settings_from({**backbone.beacon_settings.as_dict(), **changes}, f"beacon inference settings {changes}")
    backbone.beacon_settings = settings
    causal_lm_of(model).config.beacon = settings.as_dict()
    return settings


def model_span(model: nn.Module, length: int) -> tuple[int, int]:
    """(positions, keys) of an input of ``length`` tokens on a model with beacons: the memory plus one window at the
    ratio it adapts to; the keys outnumber the positions where beacons take the positions of raw tokens."""
    backbone = backbone_of(model)
    settings, max_positions = backbone.beacon_settings, backbone.config.max_position_embeddings
    return window_span(settings, length, max_positions), window_span(settings, length, max_positions, keys=True)
