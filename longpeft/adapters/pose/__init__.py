"""PoSE (positional skip-wise training): position ids that make a short window look like a long one.

The ``pose`` section of recipes and of ``longpeft.json`` is :class:`PoseConfig`. PoSE changes only
the position ids seen in training (through :class:`PoseCollator`); the trained model runs with
plain positions, so ``apply``/``remove`` change nothing on a model.

A sample of ``L_c`` tokens (the training window) is split at random into ``N`` chunks (default 2).
Position ids are contiguous inside each chunk; chunk ``i`` is shifted by a skip ``u_i``, drawn
uniformly from ``{u_(i-1), ..., L_t - L_c}`` with ``u_0 = 0``, so skips never decrease, chunks never
overlap, and the largest position is at most ``L_t - 1``. Over many samples the relative distances
cover ``1 .. L_t - 1``. The chunks' content is the sample's own contiguous tokens: the paper's
``v_i = 0`` variant (its default draws a content skip ``v_i`` from a longer text; its Table 4 finds
the variants within 0.08 perplexity of each other at 16K). The authors' code also caps the first
chunk at half the window; here the cut is uniform over the window.

Pitfalls this module handles (see DESIGN.md): transformers reads a jump in ``position_ids`` as the
start of a new packed sequence when no ``attention_mask`` is passed, which would cut attention
between chunks, so :class:`PoseCollator` always returns an explicit all-ones ``attention_mask``
(right padding: causal attention never lets real tokens see the padding); and TRL's collator drops
a ``position_ids`` column, so PoSE needs this collator of its own.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from pydantic import Field

from ...config import StrictModel
from ..registry import Method, ResolveContext

IGNORE_INDEX = -100


class PoseConfig(StrictModel):
    """PoSE settings: train in the recipe's window (``data.max_length``) to simulate ``target_length``.

    ``n_chunks``: chunks per sample (the paper's default 2); skips between chunks are drawn uniformly
    and never decrease (the paper's skip distribution).
    """

    n_chunks: int = Field(default=2, ge=1)
    target_length: int | None = Field(default=None, gt=0, description="default: the recipe's target_length")


def _resolve(config: PoseConfig, context: ResolveContext) -> PoseConfig:
    target = config.target_length or context.target_length
    if target is None or (context.trained_length and target <= context.trained_length):
        raise ValueError(
            f"pose.target_length ({target}) must be set and longer than the training length "
            f"({context.trained_length}, data.max_length): at equal lengths every skip is 0 and PoSE changes nothing"
        )
    return config.model_copy(update={"target_length": target})


def pose_position_ids(
    length: int, target_length: int, n_chunks: int = 2, rng: np.random.Generator | int | None = None
) -> np.ndarray:
    """PoSE position ids for one sample of ``length`` tokens simulating ``target_length``.

    Args:
        length: tokens in the sample (``L_c``, at most the training window).
        target_length: the context length to simulate (``L_t >= L_c``).
        n_chunks: chunks ``N`` (at most ``length``); 1 gives plain positions ``0 .. length - 1``.
        rng: a numpy Generator or a seed.

    Returns:
        int64 array of shape ``(length,)``, non-decreasing jumps between chunks, max ``<= L_t - 1``.
    """
    if length < 1:
        raise ValueError("length must be at least 1")
    if target_length < length:
        raise ValueError(f"target_length ({target_length}) must be >= the sample length ({length})")
    if not 1 <= n_chunks <= length:
        raise ValueError(f"n_chunks must be in 1..{length}, got {n_chunks}")
    rng = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    cuts = np.sort(rng.choice(np.arange(1, length), size=n_chunks - 1, replace=False)) if n_chunks > 1 else np.zeros(0, int)
    bounds = np.concatenate([[0], cuts, [length]])
    max_skip = target_length - length
    skips = np.zeros(n_chunks, dtype=np.int64)
    for i in range(1, n_chunks):
        skips[i] = rng.integers(skips[i - 1], max_skip + 1)
    chunk_of_token = np.repeat(np.arange(n_chunks), np.diff(bounds))
    return np.arange(length, dtype=np.int64) + skips[chunk_of_token]


class PoseCollator:
    """Pads a batch and attaches PoSE ``position_ids`` and an explicit all-ones ``attention_mask``.

    Each feature needs ``input_ids``; labels come from ``labels``, else from TRL's
    ``assistant_masks`` / ``completion_mask`` (1 = trained), else from ``input_ids``. A feature that
    already has ``position_ids`` keeps them. Batches are right-padded; padding gets label -100 and
    positions continuing after the sample's last one.

    Args:
        target_length: the simulated context length ``L_t``.
        pad_token_id: id used for padding.
        n_chunks: PoSE chunks per sample.
        max_length: training window ``L_c``: longer samples are truncated to it (None: no truncation).
        seed: with each sample's tokens, seeds that sample's draw (as UtK's collator does), so a resumed run, or
            another process, draws what an uninterrupted one would; a sample seen again in a later epoch gets the
            same positions.
    """

    def __init__(
        self,
        target_length: int,
        pad_token_id: int,
        n_chunks: int = 2,
        max_length: int | None = None,
        seed: int = 0,
    ):
        if max_length is not None and max_length > target_length:
            raise ValueError(f"max_length ({max_length}) must not exceed target_length ({target_length})")
        self.target_length = target_length
        self.pad_token_id = pad_token_id
        self.n_chunks = n_chunks
        self.max_length = max_length
        self.seed = seed

    def _labels(self, feature: dict[str, Any], input_ids: np.ndarray) -> np.ndarray:
        if feature.get("labels") is not None:
            return np.asarray(feature["labels"], dtype=np.int64)
        for key in ("assistant_masks", "completion_mask"):
            if feature.get(key) is not None:
                mask = np.asarray(feature[key], dtype=bool)
                return np.where(mask, input_ids, IGNORE_INDEX)
        return input_ids.copy()

    def __call__(self, features: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        rows = []
        for feature in features:
            input_ids = np.asarray(feature["input_ids"], dtype=np.int64)
            labels = self._labels(feature, input_ids)
            positions = feature.get("position_ids")
            if self.max_length is not None:
                input_ids, labels = input_ids[: self.max_length], labels[: self.max_length]
                positions = positions[: self.max_length] if positions is not None else None
            if positions is None:
                rng = np.random.default_rng(zlib.crc32(input_ids.tobytes(), self.seed))
                positions = pose_position_ids(len(input_ids), self.target_length, min(self.n_chunks, len(input_ids)), rng)
            rows.append((input_ids, labels, np.asarray(positions, dtype=np.int64)))
        width = max(len(r[0]) for r in rows)
        batch_ids = np.full((len(rows), width), self.pad_token_id, dtype=np.int64)
        batch_labels = np.full((len(rows), width), IGNORE_INDEX, dtype=np.int64)
        batch_positions = np.zeros((len(rows), width), dtype=np.int64)
        for b, (ids, labels, positions) in enumerate(rows):
            n = len(ids)
            batch_ids[b, :n], batch_labels[b, :n], batch_positions[b, :n] = ids, labels, positions
            # padding repeats the last position: positions past target_length - 1 would change what a rope type
            # that reads the batch's largest position (dynamic) computes for the real tokens
            batch_positions[b, n:] = positions[-1]
        return {
            "input_ids": torch.from_numpy(batch_ids),
            "labels": torch.from_numpy(batch_labels),
            "position_ids": torch.from_numpy(batch_positions),
            "attention_mask": torch.ones((len(rows), width), dtype=torch.long),
        }


METHOD = Method(
    name="pose",
    config=PoseConfig,
    apply=lambda model, config: None,  # training-time positions only (PoseCollator)
    remove=lambda model: None,
    is_applied=lambda model: False,
    resolve=_resolve,
    span=lambda config, length, max_positions: config.target_length,  # trained positions reach target_length - 1
    excludes={"beacon": "Activation Beacon sets the positions itself (memory first, then the window), so PoSE's "
                        "position ids would be ignored"},
    describe=lambda config: [
        f"Trained with PoSE: {config.n_chunks} chunks with skip-wise position ids simulating {config.target_length} tokens."
    ],
)
