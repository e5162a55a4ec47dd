"""Causal LM classes of an exported Activation Beacon model (the end of ``modeling_beacon.py``): each builds its
stock architecture (``BeaconLlamaForCausalLM``, ... with model_type ``beacon_llama``, ...), then applies the beacons
of ``config.beacon`` (their weights are loaded afterwards)."""

from __future__ import annotations

# longpeft-inline-begin
from ...family import define_export_classes
from .patch import install_beacon

# longpeft-inline-end


class _BeaconCausalLM:
    """Activation Beacon (``config.beacon``)."""

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        settings = getattr(config, "beacon", None)
        if not settings:
            raise ValueError("config.json has no beacon settings: this is not an Activation Beacon model")
        install_beacon(self, settings, initialise=False)


# Base model_type -> (exported model_type, config class name, causal-LM class name) for auto_map.
EXPORT_CLASSES_BY_MODEL_TYPE = define_export_classes(globals(), "beacon", _BeaconCausalLM)
