"""Export a merged Activation Beacon model so plain transformers loads it (trust_remote_code), without longpeft: the
saved folder's config.json gets the ``beacon`` settings and an ``auto_map`` at ``modeling_beacon.py``, the beacon
runtime and the causal LM classes of :mod:`.remote_classes` with the few longpeft helpers they use inlined."""

from __future__ import annotations

from pathlib import Path

from ... import family, rope
from ..remote_code import point_config_at_remote_code, saved_config, standalone_source
from . import cache, layout, patch, remote_classes, scheduler
from .layout import BeaconSettings
from .remote_classes import EXPORT_CLASSES_BY_MODEL_TYPE

MODELING_FILENAME = "modeling_beacon.py"
RUNTIME_MODULES = (layout, cache, scheduler, patch, remote_classes)
# What the modeling file inlines (the marked imports of the runtime modules, and what they call).
INLINED_HELPERS = (rope.rotate_half, rope.apply_rotary, family.is_attention_module, family.attention_modules)
INLINED_HELPERS += (family.causal_lm_of, family.backbone_of, family.cache_keyword, family.pop_cache)
INLINED_HELPERS += (family.kernel_interface, family.attention_kernel, family.define_export_classes)


def write_remote_code(save_dir: str | Path, settings: BeaconSettings) -> None:
    """Make ``save_dir``, written by ``save_pretrained`` of a model with beacons (their tensors included), load with
    ``AutoModelForCausalLM.from_pretrained(save_dir, trust_remote_code=True)``: writes ``modeling_beacon.py`` and sets,
    in config.json, ``beacon`` (the ``settings``), ``model_type = "beacon_<type>"``, ``architectures`` and
    ``auto_map``. Without ``trust_remote_code`` loading fails instead of giving a model without beacons."""
    config_path, config, model_type = saved_config(save_dir, EXPORT_CLASSES_BY_MODEL_TYPE, "Activation Beacon")
    docstring = "Activation Beacon, written by longpeft for an exported model (needs only torch and transformers)."
    source = standalone_source(docstring, RUNTIME_MODULES, INLINED_HELPERS)
    entries = {"beacon": settings.as_dict()}
    point_config_at_remote_code(
        config_path, config, model_type, EXPORT_CLASSES_BY_MODEL_TYPE, MODELING_FILENAME, source, entries
    )
