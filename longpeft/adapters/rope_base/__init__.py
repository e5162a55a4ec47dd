"""RoPE-base expansion (and transformers' own RoPE scalings) through one entry point.

The "Llama-3 8K -> 80K overnight" recipe raises the RoPE base from 500K to 200M and fine-tunes with
QLoRA. transformers' own rope types (linear/PI, dynamic NTK, yarn, llama3) are selected the same way,
through a complete ``rope_parameters`` dict. The ``rope`` section of recipes and of
``longpeft.json`` is :class:`RopeConfig`; in ``longpeft.json`` it holds the complete resolved dict.
A merged or fully fine-tuned model's config.json also gets the keys transformers 4 reads
(:func:`write_legacy_rope_keys`).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field
from torch import nn

from ...config import StrictModel
from ...errors import ConfigError
from ...rope import rope_parameters_of, set_rope_parameters, unused_rope_keys
from ..registry import Method, ResolveContext

RopeType = Literal["default", "linear", "dynamic", "yarn", "llama3"]


class RopeConfig(StrictModel):
    """New RoPE parameters (merged onto the base's) and the new context length.

    The fields are transformers' ``rope_parameters`` keys of the supported rope types; omitted keys
    keep the base's values (a new ``rope_type`` replaces the whole dict). After resolution every key
    of the complete dict is set.
    """

    rope_type: RopeType | None = None
    rope_theta: float | None = Field(default=None, gt=1, lt=1e30)
    factor: float | None = Field(default=None, gt=0, lt=1e6)
    original_max_position_embeddings: int | None = Field(default=None, gt=0)
    low_freq_factor: float | None = Field(default=None, gt=0)
    high_freq_factor: float | None = Field(default=None, gt=0)
    attention_factor: float | None = Field(default=None, gt=0)
    beta_fast: float | None = Field(default=None, gt=0)
    beta_slow: float | None = Field(default=None, gt=0)
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool | None = None
    partial_rotary_factor: float | None = Field(default=None, gt=0, le=1)
    max_position_embeddings: int | None = Field(default=None, gt=0)

    def rope_parameters(self) -> dict[str, Any]:
        """The requested rope_parameters keys (without max_position_embeddings), Nones dropped."""
        return {k: v for k, v in self.model_dump().items() if v is not None and k != "max_position_embeddings"}


def resolve_rope_parameters(config: Any, rope: dict[str, Any]) -> dict[str, Any]:
    """Complete rope_parameters from a partial request on top of a base config.

    ``{"rope_theta": 2e8}`` keeps the base's rope_type; giving ``rope_type`` replaces the whole dict
    (keys of the old type do not leak into the new one), keeping rope_theta unless given.
    For yarn/llama3 ``original_max_position_embeddings`` defaults to the base's max length.
    """
    base = rope_parameters_of(config)
    if "rope_type" in rope and rope["rope_type"] != base.get("rope_type", "default"):
        params = {"rope_type": rope["rope_type"], "rope_theta": base["rope_theta"]}
    else:
        params = dict(base)
    params.update({k: v for k, v in rope.items() if v is not None})
    if params["rope_type"] in ("yarn", "llama3") and "original_max_position_embeddings" not in params:
        params["original_max_position_embeddings"] = config.max_position_embeddings
    params["rope_theta"] = float(params["rope_theta"])
    return params


def expand_rope_base(
    model: nn.Module, rope_parameters: dict[str, Any], max_position_embeddings: int | None = None
) -> torch.Tensor:
    """Set new RoPE parameters on a built model and verify the rotary frequencies changed.

    Args:
        model: transformers causal LM (PEFT-wrapped works too).
        rope_parameters: complete or partial rope_parameters (see :func:`resolve_rope_parameters`).
        max_position_embeddings: the new context length recorded in the config.

    Returns:
        The rotary module's new ``inv_freq`` (``[head_dim // 2]``).
    """
    params = resolve_rope_parameters(model.config, rope_parameters)
    original = getattr(model, "_longpeft_original_rope", None)
    if original is None:
        # Remembered once, so that remove() restores the model as it was before the first change.
        original = (rope_parameters_of(model.config), model.config.max_position_embeddings)
    new = set_rope_parameters(model, params, max_position_embeddings)
    model._longpeft_original_rope = original
    return new


# ---- the method shape ---------------------------------------------------------------------------


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
        raise ConfigError(f"rope.{unused[0]} is not read by rope_type {params['rope_type']} (transformers would ignore "
                          "it); remove it, or choose a rope_type that reads it")
    if params["rope_type"] == "dynamic" and context.trained_length:
        raise ConfigError("rope_type dynamic rescales only beyond max_position_embeddings, which is at least the "
                          "training length, so training would see plain RoPE; use linear, yarn, llama3 or a larger "
                          "rope_theta (dynamic stays available without training: expand_rope_base)")
    unknown = sorted(set(params) - set(RopeConfig.model_fields))
    if unknown:
        raise ConfigError(f"the base model's rope_parameters have keys longpeft does not know: {unknown}")
    max_positions = config.max_position_embeddings or context.base_config.max_position_embeddings
    return RopeConfig(**params, max_position_embeddings=max_positions)


def apply(model: nn.Module, config: RopeConfig) -> None:
    expand_rope_base(model, config.rope_parameters(), config.max_position_embeddings)


def remove(model: nn.Module) -> None:
    """Restore the RoPE parameters the model had before :func:`expand_rope_base` first changed them."""
    original = getattr(model, "_longpeft_original_rope", None)
    if original is None:
        raise ValueError(f"{type(model).__name__} has no RoPE change made by longpeft to remove")
    params, max_positions = original
    set_rope_parameters(model, copy.deepcopy(params), max_positions)
    del model._longpeft_original_rope


def write_legacy_rope_keys(folder: Path, config: RopeConfig) -> None:
    """Also write a saved model's RoPE parameters as transformers 4 reads them: top-level ``rope_theta``, and
    ``rope_scaling`` for a scaled rope type (null for the default one).

    transformers 5 saves only ``rope_parameters``; a reader of the old keys (transformers < 5, serving stacks
    pinned to it) then builds the model with the architecture's default base (10,000 for Llama), silently.
    transformers 5 reads the file as before: ``rope_scaling`` holds the same parameters, ``rope_theta`` fills it.
    """
    path = folder / "config.json"
    data = json.loads(path.read_text())
    params = config.rope_parameters()
    scaling = {key: value for key, value in params.items() if key != "rope_theta"}
    data["rope_theta"] = params["rope_theta"]
    data["rope_scaling"] = scaling if scaling.get("rope_type", "default") != "default" else None
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def describe(config: RopeConfig) -> list[str]:
    return [f"RoPE parameters {config.rope_parameters()}, {config.max_position_embeddings} positions."]


METHOD = Method(
    name="rope",
    config=RopeConfig,
    apply=apply,
    remove=remove,
    is_applied=lambda model: getattr(model, "_longpeft_original_rope", None) is not None,
    resolve=resolve,
    export=lambda model, folder, config: write_legacy_rope_keys(folder, config),
    describe=describe,
)

__all__ = ["METHOD", "RopeConfig", "expand_rope_base", "resolve_rope_parameters", "write_legacy_rope_keys"]
