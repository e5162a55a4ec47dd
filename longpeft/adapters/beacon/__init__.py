"""Activation Beacon (Zhang et al., "Soaring from 4K to 400K"), as an adapter on a stock base model.

Long inputs run in windows of ``W`` raw tokens; each window's beacons condense it, and when it is
full only their K/V stay in memory, so memory and cost grow with ``length / ratio`` instead of
``length``. Per layer the beacons have their own q/k/v(/o) projections (a trainable copy, or the
stock projection plus a low-rank delta) and one embedding row; the base model stays frozen and
unedited: no resized vocabulary, no modeling file (except in an exported merged model).

- :mod:`.layout`: settings, window layout, masks, positions, ratio choice (the A.2 table);
- :mod:`.cache`: :class:`BeaconCache`, the memory the caller owns;
- :mod:`.modules`: beacon projections and the attention forward that uses them;
- :mod:`.scheduler`: the window loop (training, prefill, decoding through ``generate``);
- :mod:`.patch`: ``apply_beacon`` / ``remove_beacon``;
- :mod:`.weights`: ``beacon_adapter.safetensors`` and the converter from the authors' checkpoints;
- :mod:`.export`: the modeling file and ``auto_map`` of a merged export.
"""

from __future__ import annotations

from pathlib import Path

from ..registry import Method, ResolveContext
from .cache import BeaconCache, BeaconStep
from .config import BeaconConfig
from .export import write_remote_code
from .layout import BeaconSettings, WindowLayout, window_layout, window_span
from .patch import (
    apply_beacon,
    backbone_of,
    beacon_parameters,
    beacons_disabled,
    is_beacon_applied,
    remove_beacon,
    trainable_beacon_parameters,
)
from .weights import WEIGHTS_FILENAME, load_beacon_weights, save_beacon_weights


def model_span(model, length: int) -> tuple[int, int]:
    """(positions, keys) of an input of ``length`` tokens on a model with beacons: both are the memory plus one
    window at the ratio it adapts to (a query reads the memory and its window, nothing older)."""
    backbone = backbone_of(model)
    span = window_span(backbone.beacon_settings, length, backbone.config.max_position_embeddings)
    return span, span


def resolve(config: BeaconConfig, context: ResolveContext) -> BeaconConfig:
    """Write out the implied settings (inference ratios, attend_prev, LoRA rank and alpha)."""
    return config.resolved()


def describe(config: BeaconConfig) -> list[str]:
    ratios = ", ".join(map(str, config.ratios))
    return [
        f"Activation Beacon: windows of {config.window} tokens condensed at ratios {ratios} ({config.attn}, "
        f"{config.pos}, beacon projections {'/'.join(config.params)} as {config.projection}, sink {config.sink}); "
        f"at inference the ratio adapts to the input ({config.inference_ratio_mix}).",
    ]


def _load(model, folder: Path, config: BeaconConfig) -> None:
    load_beacon_weights(model, folder)


def _save(model, folder: Path, config: BeaconConfig, state_dict=None) -> None:
    save_beacon_weights(model, folder, state_dict)


def planned_parameters(config: BeaconConfig, shape) -> tuple[int, int]:
    """(trainable, frozen) beacon parameters on a base of ``shape`` (a ``ModelShape``): per layer a copy or a
    low-rank delta of each projection in ``params``, and one embedding row; the last layer's q and o twins stay
    frozen (see :func:`trainable_beacon_parameters`). Biases are not counted."""
    config = config.resolved()
    full = config.projection == "full"
    per_projection = {}
    for name in config.params:
        in_features, out_features = shape.projection_shape(f"{name}_proj")
        per_projection[name] = in_features * out_features if full else config.lora_rank * (in_features + out_features)
    frozen = sum(per_projection.get(name, 0) for name in ("q", "o"))
    return shape.layers * sum(per_projection.values()) - frozen + shape.hidden, frozen


def training_labels(config: BeaconConfig, labels):
    """``labels [batch, seq]`` without the first window's targets (tokens 1..window), as the authors train every
    layout but full-coverage + interleave: there the first window's tokens read no beacon, so they teach the beacons
    nothing (``modeling_beacon.py``: "skip computing loss in the very first window")."""
    if (config.attn, config.pos) == ("full-coverage", "interleave"):
        return labels
    labels = labels.clone()
    labels[:, : config.window + 1] = -100
    return labels


def _span(config: BeaconConfig, length: int, max_positions: int) -> int:
    return window_span(config.settings(), length, max_positions, training=True)  # the recipe's training check


METHOD = Method(
    name="beacon",
    config=BeaconConfig,
    apply=lambda model, config: apply_beacon(model, config.settings()),
    remove=remove_beacon,
    is_applied=is_beacon_applied,
    resolve=resolve,
    save=_save,
    load=_load,
    export=lambda model, folder, config: write_remote_code(folder, config.settings()),
    describe=describe,
    remote_code=True,
    parameters=trainable_beacon_parameters,
    span=_span,
    model_span=model_span,
    planned_parameters=planned_parameters,
    plan_lever="beacon.projection: lora (a low-rank delta instead of a full copy of each projection)",
    training_labels=training_labels,
    sharding_conflict=(
        "Activation Beacon runs the decoder once per window, and samples of different lengths give the processes "
        "different numbers of windows, while FSDP2 and ZeRO-3 gather every layer's weights collectively on each run: "
        "the processes' collectives stop matching (2 CPU processes under FSDP2 fail with gloo's size mismatch; NCCL "
        "would hang). Use --launch ddp (each GPU holds the frozen base; only the beacon weights train)"
    ),
    kernel_conflict=(
        "its attention forward rotates queries and keys itself (beacon keys re-rotated into memory), "
        "where Liger's RoPE kernel does not reach, and the pair is not checked"
    ),
)

__all__ = [
    "METHOD",
    "WEIGHTS_FILENAME",
    "BeaconCache",
    "BeaconConfig",
    "BeaconSettings",
    "BeaconStep",
    "WindowLayout",
    "apply_beacon",
    "beacon_parameters",
    "beacons_disabled",
    "is_beacon_applied",
    "load_beacon_weights",
    "remove_beacon",
    "save_beacon_weights",
    "trainable_beacon_parameters",
    "window_layout",
    "write_remote_code",
]
