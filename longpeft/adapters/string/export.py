"""Export a merged model that uses STRING so plain transformers loads it with STRING on (``trust_remote_code``):
``modeling_string.py`` (:mod:`.attention` and :mod:`.remote_classes`, the longpeft helpers they use inlined) beside
the weights, and the settings as config.json's ``string``.
"""

from __future__ import annotations

from pathlib import Path

from ...family import (
    attention_modules,
    causal_lm_of,
    define_export_classes,
    is_attention_module,
    kernel_interface,
    pop_cache,
)
from ...rope import apply_rotary, rotary_modules, rotate_half
from ..remote_code import point_config_at_remote_code, saved_config, standalone_source
from . import attention, remote_classes
from .attention import StringSettings
from .remote_classes import EXPORT_CLASSES_BY_MODEL_TYPE

MODELING_FILENAME = "modeling_string.py"
INLINED_HELPERS = (
    rotate_half,
    apply_rotary,
    rotary_modules,
    is_attention_module,
    attention_modules,
    causal_lm_of,
    pop_cache,
    kernel_interface,
    define_export_classes,
)


def standalone_modeling_source() -> str:
    """The text of ``modeling_string.py``: STRING attention and the model classes, no longpeft import."""
    return standalone_source(
        "STRING (shifted positions at inference), written by longpeft for an exported model "
        "(needs only torch and transformers).",
        (attention, remote_classes),
        INLINED_HELPERS,
    )


def write_remote_code(save_dir: str | Path, settings: StringSettings) -> None:
    """Make the ``save_pretrained`` folder ``save_dir`` of a merged model load with STRING on (``settings``) through
    ``AutoModelForCausalLM.from_pretrained(save_dir, trust_remote_code=True)``; config.json gets ``string``,
    ``model_type = "string_<type>"``, ``architectures`` and ``auto_map``. The file's ``disable_string(model)`` switches
    STRING off."""
    config_path, config, model_type = saved_config(save_dir, EXPORT_CLASSES_BY_MODEL_TYPE, "STRING")
    point_config_at_remote_code(
        config_path,
        config,
        model_type,
        EXPORT_CLASSES_BY_MODEL_TYPE,
        MODELING_FILENAME,
        standalone_modeling_source(),
        {"string": settings.as_dict()},
    )
