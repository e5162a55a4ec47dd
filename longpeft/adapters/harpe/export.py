"""Export a merged HARPE model so plain transformers loads it (``trust_remote_code``) without longpeft: its own
model_type (``harpe_llama``, ...), so loading it without ``trust_remote_code`` fails instead of ignoring the bases."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ... import family, rope
from ...errors import DataError
from ..remote_code import point_config_at_remote_code, saved_config, standalone_source
from . import modeling
from .modeling import EXPORT_CLASSES_BY_MODEL_TYPE

MODELING_FILENAME = "modeling_harpe.py"
# What the modeling file inlines (the marked imports of modeling.py, and what they call).
INLINED_HELPERS = (rope.inv_freq, rope.per_head_inv_freq, rope.rotate_half, rope.apply_rotary, rope.rotate_per_head)
INLINED_HELPERS += (rope.cos_sin, family.is_attention_module, family.kernel_interface, family.attention_kernel)
INLINED_HELPERS += (family.pop_cache, family.define_export_classes)


def write_remote_code(save_dir: str | Path, bases: Sequence[float]) -> None:
    """Make the ``save_pretrained`` folder ``save_dir`` of a merged HARPE model load with its per-KV-head ``bases`` in
    plain transformers; DataError when they do not match config.json's KV heads or the head_rope_bases it records."""
    config_path, config, model_type = saved_config(save_dir, EXPORT_CLASSES_BY_MODEL_TYPE, "HARPE")
    kv_heads = config.get("num_key_value_heads") or config.get("num_attention_heads")
    bases = [float(b) for b in bases]
    if len(bases) != kv_heads:
        raise DataError(f"{config_path}: the model has {kv_heads} key/value heads but {len(bases)} bases were given")
    stored = config.get("head_rope_bases")
    if stored is not None and [float(b) for b in stored] != bases:
        raise DataError(f"{config_path} already records different head_rope_bases {stored}; export the matching bases")
    docstring = "Per-head RoPE (HARPE), written by longpeft for an exported model."
    source = standalone_source(docstring, [modeling], INLINED_HELPERS)
    entries = {"head_rope_bases": bases}
    point_config_at_remote_code(
        config_path, config, model_type, EXPORT_CLASSES_BY_MODEL_TYPE, MODELING_FILENAME, source, entries
    )
