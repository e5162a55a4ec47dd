"""The longest sample a recipe can train (``longpeft plan --longest``): the shorter of the memory bound (the
planner's peak per GPU) and the positions bound (the adapted model's, :func:`.validate.check_against_base`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..base_config import BaseNotHere, read_base
from ..scale.plan import Plan, longest_fitting, plan_at_length, shape_of
from .schema import Recipe
from .validate import build_spec, positions_spanned

LIMIT = 1 << 24  # tokens: the longest sample searched


@dataclass
class LongestSample:
    """The longest sample and its bounds, in tokens: ``tokens`` the smaller bound (0: not even ``step``), ``memory``
    (a multiple of ``step``), ``positions`` (None: not known here, with ``positions_source`` saying why; ``LIMIT``:
    none below it) under the adapted model's ``max_positions``; the recipe's ``max_length`` and ``target_length``;
    the memory search's ``gpu_memory_gib`` and ``step``; the ``plan`` at ``tokens`` (at ``step`` when nothing fits).
    """

    tokens: int
    memory: int
    positions: int | None
    max_positions: int | None
    positions_source: str
    max_length: int
    target_length: int | None
    gpu_memory_gib: float
    step: int
    plan: Plan

    @property
    def bound(self) -> str:
        """What bounds :attr:`tokens`: ``memory``, ``positions`` or both."""
        if self.positions is None or self.memory < self.positions:
            return "memory"
        return "positions" if self.positions < self.memory else "memory and positions"

    def lines(self) -> list[str]:
        """What ``plan --longest`` prints before the plan's table."""
        memory = (
            f"memory: up to {self.memory:,} tokens fit in {self.gpu_memory_gib:g} GiB per GPU (multiples of "
            f"{self.step:,})"
            if self.memory
            else f"memory: not even {self.step:,} tokens fit in {self.gpu_memory_gib:g} GiB per GPU"
        )
        if self.positions is None:
            positions = f"positions: not checked ({self.positions_source})"
        elif self.positions >= LIMIT:
            positions = (
                f"positions: no bound below {LIMIT:,} tokens (the method keeps an input inside the adapted model's "
                f"{self.max_positions:,} positions at any length)"
            )
        else:
            positions = (
                f"positions: up to {self.positions:,} tokens stay inside the adapted model's {self.max_positions:,} "
                "positions (train refuses a longer data.max_length)"
            )
        target = f", for target_length {self.target_length:,}" if self.target_length else ""
        fits = "fits" if self.max_length <= self.tokens else "does not fit"
        bound = self.bound + (" (positions not checked)" if self.positions is None else "")
        return [
            f"longest sample: {self.tokens:,} tokens per GPU sample, bounded by {bound}",
            f"  {memory}",
            f"  {positions}",
            f"  recipe: data.max_length={self.max_length:,}{target}; it {fits}",
        ]


def positions_bound(recipe: Recipe) -> tuple[int | None, int | None, str]:
    """``(longest, max_positions, source)``: the longest ``data.max_length`` (up to ``LIMIT``) whose input stays
    inside the adapted model's positions (:func:`.validate.positions_spanned`), those positions, and where the base's
    config came from; ``(None, None, why)`` without the base's config on this machine."""
    try:
        base = read_base(recipe.model.name_or_path, recipe.model.revision)
    except BaseNotHere as missing:
        return None, None, str(missing)
    spec, source = build_spec(recipe, base.config, recipe.model.name_or_path), base.source
    max_positions = spec.max_position_embeddings
    low, high = 0, LIMIT  # low fits (or is 0), high + 1 does not
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if positions_spanned(spec, middle) <= max_positions else (low, middle - 1)
    return low, max_positions, source


def longest_trainable_sample(
    recipe: Recipe,
    gpus: int = 1,
    gpu_memory_gib: float = 80.0,
    gpu: str = "h100",
    launch: str | None = None,
    step: int = 1024,
) -> LongestSample:
    """The longest sample ``recipe`` trains within ``gpu_memory_gib`` per GPU and the adapted model's positions."""
    shape = shape_of(recipe.model.name_or_path)
    memory, plan = longest_fitting(recipe, gpus, gpu_memory_gib, gpu, shape, launch, step, LIMIT)
    positions, max_positions, source = positions_bound(recipe)
    tokens = memory if positions is None else min(memory, positions)
    if tokens not in (memory, 0):
        plan = plan_at_length(recipe, tokens, gpus, gpu_memory_gib, gpu, shape, launch)
    recipe_lengths = recipe.data.max_length, recipe.target_length
    return LongestSample(tokens, memory, positions, max_positions, source, *recipe_lengths, gpu_memory_gib, step, plan)
