"""Export a merged model that uses STRING so plain transformers loads it with STRING on (trust_remote_code).

STRING changes no weight: it lives in the attention function. ``write_remote_code`` writes
``modeling_string.py`` beside the weights (the attention of :mod:`.attention` and the classes of
:mod:`.remote_classes`, with the few longpeft helpers they use inlined, so it imports only torch and
transformers), the settings as ``string`` in config.json, and points ``auto_map`` at those classes.
The config gets its own model_type (``string_llama``, ...), so loading without ``trust_remote_code``
fails instead of building the model without STRING.
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
    """Make a ``save_pretrained`` folder of a merged model load with STRING on in plain transformers.

    Writes ``modeling_string.py`` and sets, in config.json, ``string`` (the settings),
    ``model_type = "string_<type>"``, ``architectures`` and ``auto_map``. Then
    ``AutoModelForCausalLM.from_pretrained(save_dir, trust_remote_code=True)`` builds the model with STRING
    on (the file's ``disable_string(model)`` switches it off).

    Args:
        save_dir: folder written by ``model.save_pretrained`` (must hold config.json).
        settings: the STRING settings to switch on at load.
    """
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
