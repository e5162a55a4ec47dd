"""Causal LM classes of an exported Activation Beacon model (the end of ``modeling_beacon.py``).

An exported (merged) beacon model is the stock model plus the beacon weights in one safetensors
folder; its config.json carries the settings as ``beacon`` and points ``auto_map`` at these classes.
Each builds its stock architecture, then applies the beacons (their weights are loaded afterwards).
The exported config gets its own model_type (``beacon_llama``, ...), so loading without
``trust_remote_code`` fails loudly instead of silently building a model without beacons.
"""

from __future__ import annotations

from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

# longpeft-inline-begin
from .patch import apply_beacon

# longpeft-inline-end


class _BeaconCausalLM:
    """Mixin: build the base architecture, then give it the beacons of ``config.beacon``."""

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        settings = getattr(config, "beacon", None)
        if not settings:
            raise ValueError("config.json has no beacon settings: this is not an Activation Beacon model")
        apply_beacon(self, settings, initialise=False)


class BeaconLlamaConfig(LlamaConfig):
    model_type = "beacon_llama"


class BeaconMistralConfig(MistralConfig):
    model_type = "beacon_mistral"


class BeaconQwen2Config(Qwen2Config):
    model_type = "beacon_qwen2"


class BeaconQwen3Config(Qwen3Config):
    model_type = "beacon_qwen3"


class BeaconLlamaForCausalLM(_BeaconCausalLM, LlamaForCausalLM):
    """Llama with Activation Beacon (``config.beacon``)."""

    config_class = BeaconLlamaConfig


class BeaconMistralForCausalLM(_BeaconCausalLM, MistralForCausalLM):
    """Mistral with Activation Beacon (``config.beacon``)."""

    config_class = BeaconMistralConfig


class BeaconQwen2ForCausalLM(_BeaconCausalLM, Qwen2ForCausalLM):
    """Qwen2 with Activation Beacon (``config.beacon``)."""

    config_class = BeaconQwen2Config


class BeaconQwen3ForCausalLM(_BeaconCausalLM, Qwen3ForCausalLM):
    """Qwen3 with Activation Beacon (``config.beacon``)."""

    config_class = BeaconQwen3Config


# Base model_type -> (exported model_type, config class name, causal-LM class name) for auto_map.
EXPORT_CLASSES_BY_MODEL_TYPE = {
    base: (cls.config_class.model_type, cls.config_class.__name__, cls.__name__)
    for base, cls in (
        ("llama", BeaconLlamaForCausalLM),
        ("mistral", BeaconMistralForCausalLM),
        ("qwen2", BeaconQwen2ForCausalLM),
        ("qwen3", BeaconQwen3ForCausalLM),
    )
}
