"""Export a merged HARPE model so plain transformers loads it (trust_remote_code), without longpeft.

``write_remote_code`` writes :mod:`.modeling` (with longpeft's RoPE helpers inlined, so it imports only torch
and transformers) into the saved folder as ``modeling_harpe.py`` and points config.json's ``auto_map`` at the HARPE
config and model classes of the model's architecture. The exported config gets its own model_type
(``harpe_llama``, ...): transformers would otherwise load the folder without trust_remote_code as
the stock architecture, silently ignoring the per-head bases; with its own model_type that fails with an error.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ...errors import DataError
from ..remote_code import point_config_at_remote_code, saved_config, standalone_source
from . import modeling
from .modeling import EXPORT_CLASSES_BY_MODEL_TYPE

MODELING_FILENAME = "modeling_harpe.py"


def standalone_modeling_source() -> str:
    """modeling_harpe.py: :mod:`.modeling` with its longpeft imports replaced by the source of what they import."""
    return standalone_source(
        "Per-head RoPE (HARPE), written by longpeft for an exported model.", [modeling], modeling.INLINED_ON_EXPORT
    )


def write_remote_code(save_dir: str | Path, bases: Sequence[float]) -> None:
    """Make a ``save_pretrained`` folder of a merged HARPE model loadable with plain transformers.

    Writes ``modeling_harpe.py`` beside the weights and sets, in config.json, ``head_rope_bases``,
    ``model_type = "harpe_<type>"``, ``architectures`` and ``auto_map`` (``AutoConfig`` and
    ``AutoModelForCausalLM`` -> the HARPE classes of ``modeling_harpe.py``). Then
    ``AutoModelForCausalLM.from_pretrained(save_dir, trust_remote_code=True)`` builds the model
    with the same per-head RoPE, in a process where longpeft is not installed; without
    ``trust_remote_code`` loading fails instead of giving a model with one base.

    Args:
        save_dir: folder written by ``model.save_pretrained`` (must hold config.json).
        bases: the model's per-KV-head bases (checked against config.json's head count).
    """
    config_path, config, model_type = saved_config(save_dir, EXPORT_CLASSES_BY_MODEL_TYPE, "HARPE")
    kv_heads = config.get("num_key_value_heads") or config.get("num_attention_heads")
    bases = [float(b) for b in bases]
    if len(bases) != kv_heads:
        raise DataError(f"{config_path}: the model has {kv_heads} key/value heads but {len(bases)} bases were given")
    stored = config.get("head_rope_bases")
    if stored is not None and [float(b) for b in stored] != bases:
        raise DataError(f"{config_path} already records different head_rope_bases {stored}; export the matching bases")
    point_config_at_remote_code(
        config_path,
        config,
        model_type,
        EXPORT_CLASSES_BY_MODEL_TYPE,
        MODELING_FILENAME,
        standalone_modeling_source(),
        {"head_rope_bases": bases},
    )
