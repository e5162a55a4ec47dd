"""The ``rope`` section of recipes and of ``longpeft.json``: new RoPE parameters and context length (no torch)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from ...base_config import rope_parameters_of
from ...config import MAX_POSITIONS, Positions, StrictModel

RopeType = Literal["default", "linear", "dynamic", "yarn", "llama3"]


class RopeConfig(StrictModel):
    """New RoPE parameters (transformers' ``rope_parameters`` keys, merged onto the base's: omitted keys keep its
    values, a new ``rope_type`` replaces the whole dict) and the new context length; resolved, every key is set."""

    rope_type: RopeType | None = None
    rope_theta: float | None = Field(default=None, gt=1, lt=1e30)
    factor: float | None = Field(default=None, gt=0, lt=1e6)
    original_max_position_embeddings: int | None = Field(default=None, gt=0, le=MAX_POSITIONS)
    low_freq_factor: float | None = Field(default=None, gt=0)
    high_freq_factor: float | None = Field(default=None, gt=0)
    attention_factor: float | None = Field(default=None, gt=0)
    beta_fast: float | None = Field(default=None, gt=0)
    beta_slow: float | None = Field(default=None, gt=0)
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool | None = None
    partial_rotary_factor: float | None = Field(default=None, gt=0, le=1)
    max_position_embeddings: Positions | None = None

    def rope_parameters(self) -> dict[str, Any]:
        """The requested rope_parameters keys (without max_position_embeddings), Nones dropped."""
        return {k: v for k, v in self.model_dump().items() if v is not None and k != "max_position_embeddings"}


def resolve_rope_parameters(config: Any, rope: dict[str, Any]) -> dict[str, Any]:
    """Complete rope_parameters from a partial request ``rope`` on top of a base ``config``: ``{"rope_theta": 2e8}``
    keeps the base's rope_type; a new ``rope_type`` replaces the whole dict (keeping rope_theta unless given); for
    yarn/llama3 ``original_max_position_embeddings`` defaults to the base's max length."""
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
