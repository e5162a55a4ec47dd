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
- :mod:`.patch`: ``install_beacon`` / ``remove_beacon`` (in the exported modeling file too);
- :mod:`.apply`: :func:`apply_beacon` (checks, then installs), the settings only inference reads;
- :mod:`.remote_classes`: the causal LM classes of an exported model (the end of ``modeling_beacon.py``);
- :mod:`.weights`: ``beacon_adapter.safetensors`` and the converter from the authors' checkpoints;
- :mod:`.export`: the modeling file and ``auto_map`` of a merged export.
"""

from __future__ import annotations

from ..registry import Method, MethodTraining, MethodWeights, imported_on_call, torch_names
from .config import BeaconConfig, describe, planned_parameters, resolve, training_labels

INFERENCE_SETTINGS = ("inference_ratios", "inference_ratio_mix", "parallel_windows", "keep_start", "keep_end")

__getattr__ = torch_names(
    __name__,
    {
        **dict.fromkeys(("BeaconCache", "BeaconStep"), "cache"),
        **dict.fromkeys(("BeaconSettings", "WindowLayout", "window_layout"), "layout"),
        **dict.fromkeys(
            (
                "backbone_of",
                "beacon_parameters",
                "beacons_disabled",
                "install_beacon",
                "is_beacon_applied",
                "remove_beacon",
                "trainable_beacon_parameters",
            ),
            "patch",
        ),
        **dict.fromkeys(("apply_beacon", "set_inference_settings"), "apply"),
        **dict.fromkeys(("WEIGHTS_FILENAME", "load_beacon_weights", "save_beacon_weights"), "weights"),
        "write_remote_code": "export",
    },
)


def training_span(config: BeaconConfig, length: int, max_positions: int) -> int:
    """Positions a training input of ``length`` tokens occupies: the memory plus one window at the training ratios
    (the recipe's check that they fit the base)."""
    from .layout import window_span  # the window layout module builds its masks in torch

    return window_span(config.settings(), length, max_positions, training=True)


ROTATES_ITSELF = "its attention forward rotates queries and keys itself (beacon keys re-rotated into memory)"

METHOD = Method(
    name="beacon",
    config=BeaconConfig,
    resolve=resolve,
    apply=imported_on_call(f"{__name__}.apply", "apply_beacon_config"),
    remove=imported_on_call(f"{__name__}.patch", "remove_beacon"),
    is_applied=imported_on_call(f"{__name__}.patch", "is_beacon_applied"),
    describe=describe,
    export=imported_on_call(f"{__name__}.export", "export_beacon"),
    remote_code=True,
    weights=MethodWeights(
        parameters=imported_on_call(f"{__name__}.patch", "trainable_beacon_parameters"),
        save=imported_on_call(f"{__name__}.weights", "save_weights"),
        load=imported_on_call(f"{__name__}.weights", "load_weights"),
        planned=planned_parameters,
        plan_lever="beacon.projection: lora (a low-rank delta instead of a full copy of each projection)",
    ),
    training=MethodTraining(span=training_span, labels=training_labels),
    model_span=imported_on_call(f"{__name__}.apply", "model_span"),
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
