"""RoPE-base expansion (the "Llama-3 8K -> 80K overnight" recipe: base 500K -> 200M, then QLoRA) and transformers'
own rope types (linear/PI, dynamic NTK, yarn, llama3), through one complete ``rope_parameters`` dict: the ``rope``
section (:class:`RopeConfig`), set on a model by :func:`expand_rope_base`, written into an exported config.json for
transformers 4 too (:func:`write_legacy_rope_keys`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ...base_config import ROPE_TYPE_REQUIRED_KEYS, rope_parameters_of, unused_rope_keys
from ...errors import ConfigError
from ..registry import Method, ResolveContext, imported_on_call, torch_names
from .config import RopeConfig, RopeType, resolve_rope_parameters
from .export import write_legacy_rope_keys

if TYPE_CHECKING:  # registering the method imports no torch
    from torch import nn

TORCH_NAMES = dict.fromkeys(("expand_rope_base", "has_rope_change", "restore_rope"), "modeling")
__getattr__ = torch_names(__name__, TORCH_NAMES)


def resolve(config: RopeConfig, context: ResolveContext) -> RopeConfig:
    """The complete rope_parameters and max length this section gives the base model; ConfigError for a rope type
    without the keys it reads, keys the rope type does not read, ``dynamic`` in a training run, a ``rope_theta`` below
    the base model's own, and base rope_parameters keys longpeft does not know (the messages say why)."""
    requested = config.rope_parameters()
    base_theta = float(rope_parameters_of(context.base_config)["rope_theta"])
    if requested.get("rope_theta", base_theta) < base_theta:
        raise ConfigError(
            f"rope.rope_theta={requested['rope_theta']:g} is below the base model's own RoPE base {base_theta:g}: a "
            "smaller base shortens every rotary wavelength, so the model tells fewer positions apart instead of more; "
            f"give a base above {base_theta:g} (the 80K recipe raises 500000 to 2e8), or leave rope.rope_theta out to "
            "keep the model's own"
        )
    params = resolve_rope_parameters(context.base_config, requested)
    missing = [key for key in ROPE_TYPE_REQUIRED_KEYS[params["rope_type"]] if key not in params]
    if missing:
        raise ConfigError(
            f"rope.rope_type {params['rope_type']} reads {', '.join(f'rope.{key}' for key in missing)}, which the "
            f"recipe and the base model leave unset; set {'them' if len(missing) > 1 else 'it'} (rope.factor: the "
            "length multiple, e.g. 4)"
        )
    unused = unused_rope_keys(params["rope_type"], requested)
    if unused:
        raise ConfigError(
            f"rope.{unused[0]} is not read by rope_type {params['rope_type']} (transformers would "
            "ignore it); remove it, or choose a rope_type that reads it"
        )
    if params["rope_type"] == "dynamic" and context.trained_length:
        raise ConfigError(
            "rope_type dynamic rescales only beyond max_position_embeddings, which is at least the "
            "training length, so training would see plain RoPE; use linear, yarn, llama3 or a larger "
            "rope_theta (dynamic stays available without training: expand_rope_base)"
        )
    unknown = sorted(set(params) - set(RopeConfig.model_fields))
    if unknown:
        raise ConfigError(f"the base model's rope_parameters have keys longpeft does not know: {unknown}")
    max_positions = config.max_position_embeddings or context.base_config.max_position_embeddings
    return RopeConfig(**params, max_position_embeddings=max_positions)


class Rope(Method):
    """RoPE parameters in the registry: every model has them (``implied``); the card writes their change itself."""

    name = "rope"
    config = RopeConfig
    implied = True

    resolve = staticmethod(resolve)
    remove = imported_on_call(f"{__name__}.modeling", "restore_rope")
    is_applied = imported_on_call(f"{__name__}.modeling", "has_rope_change")

    def apply(self, model: nn.Module, config: RopeConfig) -> None:
        from .modeling import expand_rope_base

        expand_rope_base(model, config.rope_parameters(), config.max_position_embeddings)

    def export(self, model: nn.Module, folder: Path, config: RopeConfig) -> None:
        write_legacy_rope_keys(folder, config)


METHOD = Rope()

__all__ = ["METHOD", "RopeConfig", "RopeType", "resolve_rope_parameters", "write_legacy_rope_keys", *TORCH_NAMES]
