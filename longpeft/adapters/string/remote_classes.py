"""Causal LM classes of an exported STRING model (the end of ``modeling_string.py``): the stock architecture
(``StringLlamaForCausalLM``, ..., model_type ``string_llama``, ...) with STRING switched on from ``config.string``."""

from __future__ import annotations

# longpeft-inline-begin
from ...family import define_export_classes
from .attention import StringSettings, install_string

# longpeft-inline-end


class _StringCausalLM:
    """STRING at inference (``config.string``)."""

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        settings = getattr(config, "string", None)
        if not settings:
            raise ValueError("config.json has no string settings: this is not a STRING model")
        install_string(self, StringSettings(**settings))


# Base model_type -> (exported model_type, config class name, causal-LM class name) for auto_map.
EXPORT_CLASSES_BY_MODEL_TYPE = define_export_classes(globals(), "string", _StringCausalLM)
