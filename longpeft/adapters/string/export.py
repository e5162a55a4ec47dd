"""Export a merged model that uses STRING so plain transformers loads it with STRING on (``trust_remote_code``):
``modeling_string.py`` beside the weights, the settings as config.json's ``string``."""

from __future__ import annotations

from pathlib import Path

from ... import family, rope
from ..remote_code import point_config_at_remote_code, saved_config, standalone_source
from . import attention
from .attention import EXPORT_CLASSES_BY_MODEL_TYPE, StringSettings

MODELING_FILENAME = "modeling_string.py"
# What the modeling file inlines (the marked imports of attention.py, and what they call).
INLINED_HELPERS = (rope.rotate_half, rope.apply_rotary, rope.rotary_modules, family.is_attention_module)
INLINED_HELPERS += (family.attention_modules, family.causal_lm_of, family.pop_cache, family.kernel_interface)
INLINED_HELPERS += (family.define_export_classes,)


def write_remote_code(save_dir: str | Path, settings: StringSettings) -> None:
    """Make the ``save_pretrained`` folder ``save_dir`` of a merged model load with STRING on (``settings``) through
    ``AutoModelForCausalLM.from_pretrained(save_dir, trust_remote_code=True)``; config.json gets ``string``,
    ``model_type = "string_<type>"``, ``architectures`` and ``auto_map``. The file's ``disable_string(model)`` switches
    STRING off."""
    config_path, config, model_type = saved_config(save_dir, EXPORT_CLASSES_BY_MODEL_TYPE, "STRING")
    docstring = "STRING for an exported model, written by longpeft (needs only torch and transformers)."
    source = standalone_source(docstring, [attention], INLINED_HELPERS)
    entries = {"string": settings.as_dict()}
    point_config_at_remote_code(
        config_path, config, model_type, EXPORT_CLASSES_BY_MODEL_TYPE, MODELING_FILENAME, source, entries
    )
