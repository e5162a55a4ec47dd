"""RoPE-base expansion (and transformers' own RoPE scalings) through one entry point.

The "Llama-3 8K -> 80K overnight" recipe raises the RoPE base from 500K to 200M and fine-tunes with
QLoRA. transformers' own rope types (linear/PI, dynamic NTK, yarn, llama3) are selected the same way,
through a complete ``rope_parameters`` dict. The ``rope`` section of recipes and of
``longpeft.json`` is :class:`RopeConfig`; in ``longpeft.json`` it holds the complete resolved dict.
A merged or fully fine-tuned model's config.json also gets the keys transformers 4 reads
(:func:`write_legacy_rope_keys`).

- :mod:`.config`: :class:`RopeConfig`;
- :mod:`.modeling`: :func:`expand_rope_base` and its undo;
- :mod:`.export`: the legacy config.json keys of an exported model.
"""

from __future__ import annotations

from ...errors import ConfigError
from ...rope import unused_rope_keys
from ..registry import Method, ResolveContext
from .config import RopeConfig, RopeType
from .export import export_rope, write_legacy_rope_keys
from .modeling import apply_rope_config, expand_rope_base, has_rope_change, resolve_rope_parameters, restore_rope


def resolve(config: RopeConfig, context: ResolveContext) -> RopeConfig:
    """The complete rope_parameters and max length this section gives the base model.

    Refuses keys the resulting rope type does not read (transformers would ignore them), and ``dynamic`` for a
    training run: dynamic NTK rescales only beyond ``max_position_embeddings``, which a recipe sets to at least its
    training length, so the run would train plain RoPE.
    """
    requested = config.rope_parameters()
    params = resolve_rope_parameters(context.base_config, requested)
    unused = unused_rope_keys(params["rope_type"], requested)
    if unused:
        raise ConfigError(f"rope.{unused[0]} is not read by rope_type {params['rope_type']} (transformers would "
                          "ignore it); remove it, or choose a rope_type that reads it")
    if params["rope_type"] == "dynamic" and context.trained_length:
        raise ConfigError("rope_type dynamic rescales only beyond max_position_embeddings, which is at least the "
                          "training length, so training would see plain RoPE; use linear, yarn, llama3 or a larger "
                          "rope_theta (dynamic stays available without training: expand_rope_base)")
    unknown = sorted(set(params) - set(RopeConfig.model_fields))
    if unknown:
        raise ConfigError(f"the base model's rope_parameters have keys longpeft does not know: {unknown}")
    max_positions = config.max_position_embeddings or context.base_config.max_position_embeddings
    return RopeConfig(**params, max_position_embeddings=max_positions)


METHOD = Method(
    name="rope",
    config=RopeConfig,
    resolve=resolve,
    apply=apply_rope_config,
    remove=restore_rope,
    is_applied=has_rope_change,
    export=export_rope,
    implied=True,  # the card writes the RoPE change itself (hub.model_card_text)
)

__all__ = [
    "METHOD",
    "RopeConfig",
    "RopeType",
    "expand_rope_base",
    "has_rope_change",
    "resolve_rope_parameters",
    "restore_rope",
    "write_legacy_rope_keys",
]
