"""Export a merged Activation Beacon model so plain transformers loads it (trust_remote_code), without longpeft: the
saved folder's config.json gets the ``beacon`` settings and an ``auto_map`` at ``modeling_beacon.py``, the beacon
runtime and the causal LM classes of :mod:`.remote_classes` with the few longpeft helpers they use inlined.
"""

from __future__ import annotations

from pathlib import Path

from ...family import (
    attention_kernel,
    attention_modules,
    backbone_of,
    cache_keyword,
    causal_lm_of,
    define_export_classes,
    is_attention_module,
    kernel_interface,
    pop_cache,
)
from ...rope import apply_rotary, rotate_half
from ..remote_code import point_config_at_remote_code, saved_config, standalone_source
from . import cache, layout, modules, parallel, patch, remote_classes, scheduler
from .layout import BeaconSettings
from .remote_classes import EXPORT_CLASSES_BY_MODEL_TYPE

MODELING_FILENAME = "modeling_beacon.py"
RUNTIME_MODULES = (layout, cache, parallel, modules, scheduler, patch, remote_classes)
INLINED_HELPERS = (
    rotate_half,
    apply_rotary,
    is_attention_module,
    attention_modules,
    causal_lm_of,
    backbone_of,
    cache_keyword,
    pop_cache,
    kernel_interface,
    attention_kernel,
    define_export_classes,
)


def standalone_modeling_source() -> str:
    """The text of ``modeling_beacon.py``: the beacon runtime and model classes, no longpeft import."""
    return standalone_source(
        "Activation Beacon, written by longpeft for an exported model (needs only torch and transformers).",
        RUNTIME_MODULES,
        INLINED_HELPERS,
    )


def write_remote_code(save_dir: str | Path, settings: BeaconSettings) -> None:
    """Make ``save_dir``, written by ``save_pretrained`` of a model with beacons (their tensors included), load with
    ``AutoModelForCausalLM.from_pretrained(save_dir, trust_remote_code=True)``: writes ``modeling_beacon.py`` and sets,
    in config.json, ``beacon`` (the ``settings``), ``model_type = "beacon_<type>"``, ``architectures`` and
    ``auto_map``. Without ``trust_remote_code`` loading fails instead of giving a model without beacons."""
    config_path, config, model_type = saved_config(save_dir, EXPORT_CLASSES_BY_MODEL_TYPE, "Activation Beacon")
    point_config_at_remote_code(
        config_path,
        config,
        model_type,
        EXPORT_CLASSES_BY_MODEL_TYPE,
        MODELING_FILENAME,
        standalone_modeling_source(),
        {"beacon": settings.as_dict()},
    )
