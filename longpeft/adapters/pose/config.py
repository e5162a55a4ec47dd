"""The ``pose`` section of recipes and of ``longpeft.json``, and what it implies for a training run (no torch)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ...config import Positions, StrictModel
from ...errors import ConfigError
from ..registry import LongSamples, ResolveContext


class PoseConfig(StrictModel):
    """PoSE settings: train in the recipe's window (``data.max_length``) to simulate ``target_length``, in ``n_chunks``
    chunks per sample; ``content_skip`` other than ``none`` needs plain text (``data.format: text``)."""

    n_chunks: int = Field(default=2, ge=1)
    target_length: Positions | None = Field(default=None, description="default: the recipe's target_length")
    content_skip: Literal["none", "uniform", "aligned"] = Field(
        default="none",
        description="what the chunks hold: the sample's first tokens (none), spans drawn from a text up to "
        "target_length tokens long (uniform, the paper's), or the spans at the chunks' own positions (aligned)",
    )


def resolve(config: PoseConfig, context: ResolveContext) -> PoseConfig:
    """The simulated length: the section's, else the recipe's target length; it must exceed the training length."""
    target = config.target_length or context.target_length
    if target is None or (context.trained_length and target <= context.trained_length):
        raise ConfigError(
            f"pose.target_length ({target}) must be set and longer than the training length "
            f"({context.trained_length}, data.max_length): at equal lengths every skip is 0 and PoSE changes nothing"
        )
    return config.model_copy(update={"target_length": target})


def training_span(config: PoseConfig, length: int, max_positions: int) -> int:
    """Positions a training input occupies: PoSE's position ids reach ``target_length - 1``, whatever its length."""
    return config.target_length


def long_samples(config: PoseConfig, target_length: int | None) -> LongSamples | None:
    """With a content skip, samples up to the simulated length, from which the collator draws the window; else None."""
    target = config.target_length or target_length
    if config.content_skip == "none" or not target:
        return None
    return LongSamples(
        tokens=target,
        limit=f"pose.target_length={target} (PoSE's content skip)",
        setting=f"pose.content_skip: {config.content_skip}",
        off="pose.content_skip: none",
    )


CONTENT_SKIP_WORDS = {
    "none": "",
    "uniform": ", each chunk's text drawn from anywhere in documents up to that long",
    "aligned": ", each chunk's text taken at its position ids in documents up to that long",
}


def describe(config: PoseConfig) -> list[str]:
    """Model-card sentence: the chunks, the simulated length and what the chunks held."""
    return [
        f"Trained with PoSE: {config.n_chunks} chunks with skip-wise position ids simulating "
        f"{config.target_length} tokens" + CONTENT_SKIP_WORDS[config.content_skip] + "."
    ]
