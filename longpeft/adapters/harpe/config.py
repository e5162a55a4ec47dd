"""The ``harpe`` section of recipes and of ``longpeft.json``: how the per-KV-head bases are chosen (no torch)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import Field, model_validator

from ...config import StrictModel
from ...errors import ConfigError
from ...family import check_supported, head_dim_of, num_kv_heads


class HarpeConfig(StrictModel):
    """The ``harpe`` section: the ``selection`` of bases in [b_min, b_max] (``peak_valley`` on a ``stride`` grid, or
    ``uniform``), or the ``bases`` themselves (filled when the adapter is created)."""

    selection: Literal["peak_valley", "uniform"] = "peak_valley"
    b_min: float | None = Field(default=None, gt=1, lt=1e30)
    b_max: float | None = Field(default=None, gt=1, lt=1e30)
    stride: float | None = Field(default=None, gt=0)
    descending: bool = False
    bases: list[float] | None = None

    @model_validator(mode="after")
    def _check_range(self) -> HarpeConfig:
        if self.bases is not None:
            return self
        if self.b_min is None or self.b_max is None:
            raise ValueError("give b_min and b_max (the range the bases are chosen from), or the bases themselves")
        if self.b_max < self.b_min:
            raise ValueError("b_max must be >= b_min")
        if self.selection == "peak_valley" and self.stride is None:
            raise ValueError("selection: peak_valley needs a stride (the candidate grid step)")
        return self

    def chosen_bases(self) -> list[float]:
        """The bases, once chosen (:func:`longpeft.adapters.harpe.resolve`); ValueError before."""
        if self.bases is None:
            raise ValueError("the harpe section has no bases yet; resolve it against the base model first")
        return self.bases


def describe(config: HarpeConfig) -> list[str]:
    """Model-card sentence: the selection and the bases."""
    return [f"Per-KV-head RoPE bases (HARPE, {config.selection}): {config.bases}."]


def check_head_bases(config: Any, bases: Sequence[float]) -> list[float]:
    """One base per KV head of ``config``, as floats; ConfigError for a wrong count, non-finite or <= 1 bases, an odd
    head_dim or an unsupported architecture."""
    check_supported(config, "HARPE per-head RoPE")
    bases = [float(b) for b in bases]
    expected = num_kv_heads(config)
    if len(bases) != expected:
        raise ConfigError(
            f"harpe.bases: got {len(bases)} bases but the model has {expected} key/value heads "
            f"(num_key_value_heads); give one base per KV head, the query heads of a group share it"
        )
    bad = [b for b in bases if not math.isfinite(b) or b <= 1]
    if bad:
        raise ConfigError(f"harpe.bases must be finite and > 1, got {bad}")
    if head_dim_of(config) % 2:
        raise ConfigError(f"RoPE needs an even head_dim, the model has {head_dim_of(config)}")
    return bases
