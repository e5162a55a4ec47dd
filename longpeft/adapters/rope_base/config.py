"""The ``rope`` section of recipes and of ``longpeft.json``: new RoPE parameters and context length (no torch)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from ...config import StrictModel

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
