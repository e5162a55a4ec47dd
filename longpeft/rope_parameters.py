"""RoPE parameter dicts, torch-free (recipes are validated without torch): the keys each rope type reads, a config's
complete ``rope_parameters``, and the same dict read off a ``config.json`` as transformers v5 reads it.
"""

from __future__ import annotations

import copy
from typing import Any

from .errors import ConfigError

# rope_type -> keys that transformers requires besides "rope_type" and "rope_theta".
ROPE_TYPE_REQUIRED_KEYS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
# Keys a rope type reads besides its required ones (transformers ignores, with a log line, any other key).
ROPE_TYPE_OPTIONAL_KEYS: dict[str, tuple[str, ...]] = {
    "yarn": (
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    )
}
# transformers' RoPE base of the Llama family (LlamaConfig.default_theta) when a config.json names none.
DEFAULT_ROPE_THETA = 10_000.0
# rope types whose scaling reads the pretraining length, which transformers fills from max_position_embeddings.
READS_ORIGINAL_LENGTH = ("llama3", "yarn", "longrope")


def unused_rope_keys(rope_type: str, keys: Any) -> list[str]:
    """The ``keys`` a ``rope_type`` does not read (transformers would ignore them)."""
    used = {
        "rope_type",
        "rope_theta",
        "partial_rotary_factor",
        *ROPE_TYPE_REQUIRED_KEYS.get(rope_type, ()),
        *ROPE_TYPE_OPTIONAL_KEYS.get(rope_type, ()),
    }
    return sorted(set(keys) - used)


def rope_parameters_of(config: Any) -> dict[str, Any]:
    """A copy of the config's complete ``rope_parameters`` dict (``rope_type`` and ``rope_theta`` at least)."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or "rope_theta" not in params:
        raise ConfigError(
            f"{type(config).__name__} has no usable rope_parameters ({params!r}); longpeft supports "
            "RoPE models whose transformers v5 config carries rope_parameters with a rope_theta"
        )
    if "rope_type" not in params:
        params = {**params, "rope_type": "default"}
    return copy.deepcopy(dict(params))


def validate_rope_parameters(params: dict[str, Any]) -> dict[str, Any]:
    """Check a rope_parameters dict for the rope types longpeft supports; returns it unchanged."""
    rope_type = params.get("rope_type", "default")
    if rope_type not in ROPE_TYPE_REQUIRED_KEYS:
        raise ConfigError(
            f"rope_parameters.rope_type={rope_type!r} is not supported; choose one of "
            f"{sorted(ROPE_TYPE_REQUIRED_KEYS)}"
        )
    if "rope_theta" not in params:
        raise ConfigError("rope_parameters needs rope_theta (the RoPE base)")
    if float(params["rope_theta"]) <= 1:
        raise ConfigError(f"rope_parameters.rope_theta must be > 1, got {params['rope_theta']}")
    missing = [k for k in ROPE_TYPE_REQUIRED_KEYS[rope_type] if k not in params]
    if missing:
        raise ConfigError(f"rope_parameters with rope_type={rope_type!r} needs {missing}")
    return params


def rope_parameters_from_json(config: dict[str, Any]) -> dict[str, Any]:
    """The ``rope_parameters`` transformers v5 gives a Llama-family ``config.json`` dict: its ``rope_scaling`` (v4) or
    ``rope_parameters``, completed from the top level (``rope_type`` from v4's ``type`` or ``default``, ``rope_theta``
    or :data:`DEFAULT_ROPE_THETA`, ``partial_rotary_factor``, a scaling type's original length)."""
    params = copy.deepcopy(config.get("rope_scaling") or config.get("rope_parameters") or {})
    if not isinstance(params, dict):
        raise ConfigError(f"rope_parameters {params!r} is not a mapping of RoPE settings")
    theta = config.get("rope_theta")
    params.setdefault("rope_theta", theta if theta is not None else DEFAULT_ROPE_THETA)
    if config.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    params.setdefault("rope_type", params.get("type", "default"))
    if params["rope_type"] in READS_ORIGINAL_LENGTH:
        original = config.get("original_max_position_embeddings")
        if original is not None:
            params["original_max_position_embeddings"] = original
        elif config.get("max_position_embeddings") is not None:
            params.setdefault("original_max_position_embeddings", config["max_position_embeddings"])
    return params
