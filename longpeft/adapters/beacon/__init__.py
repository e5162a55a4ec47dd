"""Activation Beacon (Zhang et al., "Soaring from 4K to 400K"), as an adapter on a stock base model (docs/beacon.md).

Long inputs run in windows of ``W`` raw tokens; beacons condense each window, and once it is full only their K/V stay
in memory. Per layer the beacons have their own q/k/v(/o) projections and one embedding row; the base stays frozen
and unedited. Modules: :mod:`.config` (the section, no torch), :mod:`.layout` (window layout, masks, ratio choice),
:mod:`.cache`, :mod:`.scheduler` (the window loop, parallel windows), :mod:`.patch` (beacon projections, attention
forward, install/remove), :mod:`.apply`, :mod:`.remote_classes`, :mod:`.export`, :mod:`.weights` and
:mod:`.authors_config` (the authors' checkpoints, ``longpeft convert-beacon``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..registry import Method, imported_on_call, torch_names
from .config import INFERENCE_SETTINGS, BeaconConfig, describe, planned_parameters, resolve, training_labels

if TYPE_CHECKING:  # registering the method imports no torch
    from torch import nn

TORCH_NAMES = {
    **dict.fromkeys(("BeaconCache", "BeaconStep"), "cache"),
    **dict.fromkeys(("BeaconSettings", "WindowLayout", "window_layout"), "layout"),
    **dict.fromkeys(("backbone_of", "beacon_parameters", "beacons_disabled", "install_beacon"), "patch"),
    **dict.fromkeys(("is_beacon_applied", "remove_beacon", "trainable_beacon_parameters"), "patch"),
    **dict.fromkeys(("apply_beacon", "set_inference_settings"), "apply"),
    **dict.fromkeys(("WEIGHTS_FILENAME", "load_beacon_weights", "save_beacon_weights"), "weights"),
    "write_remote_code": "export",
}
__getattr__ = torch_names(__name__, TORCH_NAMES)

ROTATES_ITSELF = "its attention forward rotates queries and keys itself (beacon keys re-rotated into memory)"


class Beacon(Method):
    """Activation Beacon in the registry: its layout on a built model, its own weights (``beacon_adapter.safetensors``
    beside the adapter), its modeling file on export, and its training window and labels. Each hook imports its
    torch module when it runs."""

    name = "beacon"
    config = BeaconConfig
    remote_code = True
    plan_lever = "beacon.projection: lora (a low-rank delta instead of a full copy of each projection)"
    # lm-eval pads a batch's generation requests on the left, which beacon refuses, and its scored ones on the right,
    # where beacon would choose its ratio for the padded length.
    padded_batches = (
        "an Activation Beacon model reads a padded request differently from the request alone (its windows start at "
        "the same index in every row)"
    )
    conflicts = {
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
    }

    resolve = staticmethod(resolve)
    describe = staticmethod(describe)
    planned_weights = staticmethod(planned_parameters)
    training_labels = staticmethod(training_labels)
    remove = imported_on_call(f"{__name__}.patch", "remove_beacon")
    is_applied = imported_on_call(f"{__name__}.patch", "is_beacon_applied")
    model_span = imported_on_call(f"{__name__}.apply", "model_span")
    weight_parameters = imported_on_call(f"{__name__}.patch", "trainable_beacon_parameters")

    def apply(self, model: nn.Module, config: BeaconConfig) -> None:
        from .apply import apply_beacon

        apply_beacon(model, config.settings())

    def export(self, model: nn.Module, folder: Path, config: BeaconConfig) -> None:
        from .export import write_remote_code

        write_remote_code(folder, config.settings())

    def save_weights(self, model: nn.Module, folder: Path, config: BeaconConfig, state_dict: dict | None) -> None:
        from .weights import save_beacon_weights

        save_beacon_weights(model, folder, state_dict)

    def load_weights(self, model: nn.Module, folder: Path, config: BeaconConfig) -> None:
        from .weights import load_beacon_weights

        load_beacon_weights(model, folder)

    def training_span(self, config: BeaconConfig, length: int, max_positions: int) -> int:
        """The memory plus one window at the training ratios (the recipe's check that they fit the base)."""
        from .layout import window_span

        return window_span(config.settings(), length, max_positions, training=True)


METHOD = Beacon()

__all__ = ["INFERENCE_SETTINGS", "METHOD", "BeaconConfig", *TORCH_NAMES]
