"""Activation Beacon (Zhang et al., "Soaring from 4K to 400K"), as an adapter on a stock base model.

Long inputs run in windows of ``W`` raw tokens; each window's beacons condense it, and when it is
full only their K/V stay in memory, so memory and cost grow with ``length / ratio`` instead of
``length``. Per layer the beacons have their own q/k/v(/o) projections (a trainable copy, or the
stock projection plus a low-rank delta) and one embedding row; the base model stays frozen and
unedited: no resized vocabulary, no modeling file (except in an exported merged model).

- :mod:`.config`: :class:`BeaconConfig`, the section, and its pure settings logic;
- :mod:`.layout`: runtime settings, window layout, masks, positions, ratio choice (the A.2 table);
- :mod:`.cache`: :class:`BeaconCache`, the memory the caller owns;
- :mod:`.modules`: beacon projections and the attention forward that uses them;
- :mod:`.scheduler`: the window loop (training, prefill, decoding through ``generate``);
- :mod:`.patch`: ``install_beacon`` / ``remove_beacon`` (:func:`apply_beacon` checks, then installs);
- :mod:`.remote_classes`: the causal LM classes of an exported model (the end of ``modeling_beacon.py``);
- :mod:`.weights`: ``beacon_adapter.safetensors`` and the converter from the authors' checkpoints;
- :mod:`.export`: the modeling file and ``auto_map`` of a merged export.
"""

from __future__ import annotations

from pathlib import Path

import pydantic
from torch import nn

from ...errors import ConfigError
from ...family import causal_lm_of
from ..registry import Method, MethodTraining, MethodWeights, check_applicable
from .cache import BeaconCache, BeaconStep
from .config import BeaconConfig, describe, planned_parameters, resolve, training_labels
from .export import write_remote_code
from .layout import BeaconSettings, WindowLayout, window_layout, window_span
from .patch import (
    backbone_of,
    beacon_parameters,
    beacons_disabled,
    install_beacon,
    is_beacon_applied,
    remove_beacon,
    trainable_beacon_parameters,
)
from .weights import WEIGHTS_FILENAME, load_beacon_weights, save_beacon_weights


def apply_beacon(model: nn.Module, settings: BeaconSettings | dict, initialise: bool = True) -> None:
    """Give a built Llama/Mistral/Qwen2/Qwen3 causal LM (plain or peft-wrapped) Activation Beacon, in place.

    Args:
        model: the model; applying again replaces the settings and the beacon weights.
        settings: :class:`BeaconSettings` or its dict (``config.beacon``).
        initialise: copy the stock weights into the beacon weights (``full``), the eos/bos row into
            the beacon embedding. Off when the weights are loaded right after (an exported model).

    Raises:
        MethodConflict: a method beacon cannot run with is on (its registry ``conflicts``).
    """
    check_applicable(model, "beacon")
    install_beacon(model, settings, initialise)


INFERENCE_SETTINGS = ("inference_ratios", "inference_ratio_mix", "parallel_windows", "keep_start", "keep_end")


def set_inference_settings(model: nn.Module, **changes) -> BeaconSettings:
    """Change the settings of a model with beacons that only inference reads (:data:`INFERENCE_SETTINGS`: the
    inference ratios and mix, ``parallel_windows``, ``keep_start``, ``keep_end``), keeping its beacon weights;
    returns the new settings. A request already under way keeps its cache, which the new settings may not fit:
    start new requests after the change.

    Raises:
        ConfigError: a setting that is not an inference setting, or a value :class:`BeaconConfig` refuses.
        ValueError: the model has no beacons.
    """
    other = sorted(set(changes) - set(INFERENCE_SETTINGS))
    if other:
        raise ConfigError(
            f"{other} are not inference settings ({', '.join(INFERENCE_SETTINGS)}); apply the beacons "
            "again (apply_beacon) to change the others"
        )
    if not is_beacon_applied(model):
        raise ValueError(f"{type(model).__name__} has no Activation Beacon")
    backbone = backbone_of(model)
    current = backbone.beacon_settings.as_dict()
    if current["projection"] == "full":  # BeaconSettings fills in a rank that projection: full does not take
        current["lora_rank"] = current["lora_alpha"] = None
    try:
        settings = BeaconConfig(**{**current, **changes}).settings()
    except pydantic.ValidationError as error:
        reasons = "; ".join(str(problem["msg"]).removeprefix("Value error, ") for problem in error.errors())
        raise ConfigError(f"beacon inference settings {changes}: {reasons}") from error
    backbone.beacon_settings = settings
    causal_lm_of(model).config.beacon = settings.as_dict()
    return settings


def apply_beacon_config(model: nn.Module, config: BeaconConfig) -> None:
    """The method's ``apply``: :func:`apply_beacon` with the section's settings."""
    apply_beacon(model, config.settings())


def export_beacon(model: nn.Module, folder: Path, config: BeaconConfig) -> None:
    """The method's ``export``: ``modeling_beacon.py`` and ``auto_map`` in the saved ``folder``."""
    write_remote_code(folder, config.settings())


def save_weights(model: nn.Module, folder: Path, config: BeaconConfig, state_dict=None) -> None:
    """The method's ``weights.save``: ``beacon_adapter.safetensors`` in ``folder``."""
    save_beacon_weights(model, folder, state_dict)


def load_weights(model: nn.Module, folder: Path, config: BeaconConfig) -> None:
    """The method's ``weights.load``: ``beacon_adapter.safetensors`` of ``folder`` onto ``model``."""
    load_beacon_weights(model, folder)


def training_span(config: BeaconConfig, length: int, max_positions: int) -> int:
    """Positions a training input of ``length`` tokens occupies: the memory plus one window at the training ratios
    (the recipe's check that they fit the base)."""
    return window_span(config.settings(), length, max_positions, training=True)


def model_span(model: nn.Module, length: int) -> tuple[int, int]:
    """(positions, keys) of an input of ``length`` tokens on a model with beacons: the memory plus one window at the
    ratio it adapts to (a query reads the memory and its window, nothing older); the keys outnumber the positions
    where beacons take the positions of raw tokens (step-expansion, segmentation: ``layout.span_at``)."""
    backbone = backbone_of(model)
    settings, max_positions = backbone.beacon_settings, backbone.config.max_position_embeddings
    return window_span(settings, length, max_positions), window_span(settings, length, max_positions, keys=True)


ROTATES_ITSELF = "its attention forward rotates queries and keys itself (beacon keys re-rotated into memory)"

METHOD = Method(
    name="beacon",
    config=BeaconConfig,
    resolve=resolve,
    apply=apply_beacon_config,
    remove=remove_beacon,
    is_applied=is_beacon_applied,
    describe=describe,
    export=export_beacon,
    remote_code=True,
    weights=MethodWeights(
        parameters=trainable_beacon_parameters,
        save=save_weights,
        load=load_weights,
        planned=planned_parameters,
        plan_lever="beacon.projection: lora (a low-rank delta instead of a full copy of each projection)",
    ),
    training=MethodTraining(span=training_span, labels=training_labels),
    model_span=model_span,
    conflicts={
        "harpe": "Activation Beacon re-rotates memory keys with the model's one rotary module, and HARPE gives each "
        "head its own RoPE base",
        "sharded_weights": (
            "Activation Beacon runs the decoder once per window, and samples of different lengths give the processes "
            "different numbers of windows, while FSDP2 and ZeRO-3 gather every layer's weights collectively on each "
            "run: the processes' collectives stop matching (2 CPU processes under FSDP2 fail with gloo's size "
            "mismatch; NCCL would hang); it needs no sharding either: each GPU holds the frozen base, and only the "
            "beacon weights train"
        ),
        "split_sequences": "Activation Beacon condenses each sequence window by window, which cannot run on sequence "
        "shards",
        "liger_kernels": f"{ROTATES_ITSELF}, where Liger's RoPE kernel does not reach, and the pair is not checked",
        "unsloth": "unsloth replaces the attention and decoder-layer forwards that Activation Beacon patches, which "
        "would silently not apply",
    },
)

__all__ = [
    "METHOD",
    "WEIGHTS_FILENAME",
    "BeaconCache",
    "BeaconConfig",
    "BeaconSettings",
    "BeaconStep",
    "INFERENCE_SETTINGS",
    "WindowLayout",
    "apply_beacon",
    "beacon_parameters",
    "beacons_disabled",
    "install_beacon",
    "is_beacon_applied",
    "load_beacon_weights",
    "remove_beacon",
    "save_beacon_weights",
    "set_inference_settings",
    "trainable_beacon_parameters",
    "window_layout",
    "write_remote_code",
]
