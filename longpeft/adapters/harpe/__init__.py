"""HARPE: one RoPE base per attention head ("Breaking the Stage Barrier", Lian et al.).

Each key/value head rotates with its own RoPE base; with grouped-query attention the query heads
of a group use their KV head's base. Used as the initialisation of a LoRA (or full) run: the bases
are chosen when the adapter is created (:class:`HarpeConfig` resolved by ``select_bases``), applied
to the model (``apply_head_bases``), recorded in the adapter's ``longpeft.json``, and the model
trains at the target length in one stage. A merged model is exported for plain transformers with
``write_remote_code``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ...config import StrictModel
from ...family import num_kv_heads
from ...rope import head_dim_of
from ..registry import Method, ResolveContext
from .export import write_remote_code
from .patch import apply_head_bases, check_head_bases, has_head_bases, remove_head_bases
from .selection import peak_valley_bases, select_bases, uniform_bases


class HarpeConfig(StrictModel):
    """The ``harpe`` section: how the per-KV-head bases are chosen, and (once chosen) the bases.

    ``selection``: ``peak_valley`` (the paper's greedy search on a ``stride`` grid) or ``uniform``
    (evenly spaced in [b_min, b_max], ascending or ``descending`` over the heads). ``bases`` is
    filled when the adapter is created; giving it in a recipe skips the selection.
    """

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


def resolve(config: HarpeConfig, context: ResolveContext) -> HarpeConfig:
    """Choose one base per KV head of the base model (kept when the config already has them)."""
    base = context.base_config
    if config.bases is not None:
        return config.model_copy(update={"bases": check_head_bases(base, config.bases)})
    bases = select_bases(
        config.selection,
        config.b_min,
        config.b_max,
        n=num_kv_heads(base),
        stride=config.stride,
        head_dim=head_dim_of(base),
        target_length=context.target_length,
        descending=config.descending,
    )
    return config.model_copy(update={"bases": bases})


def _require_bases(config: HarpeConfig) -> list[float]:
    if config.bases is None:
        raise ValueError("the harpe section has no bases yet; resolve it against the base model first")
    return config.bases


def describe(config: HarpeConfig) -> list[str]:
    return [f"Per-KV-head RoPE bases (HARPE, {config.selection}): {config.bases}."]


METHOD = Method(
    name="harpe",
    config=HarpeConfig,
    apply=lambda model, config: apply_head_bases(model, _require_bases(config)),
    remove=remove_head_bases,
    is_applied=has_head_bases,
    resolve=resolve,
    export=lambda model, folder, config: write_remote_code(folder, _require_bases(config)),
    describe=describe,
    remote_code=True,
    kernel_conflict=(
        "its attention forward rotates queries and keys itself (one RoPE base per head), "
        "where Liger's RoPE kernel does not reach, and the pair is not checked"
    ),
)

__all__ = [
    "METHOD",
    "HarpeConfig",
    "apply_head_bases",
    "check_head_bases",
    "has_head_bases",
    "peak_valley_bases",
    "remove_head_bases",
    "select_bases",
    "uniform_bases",
    "write_remote_code",
]
