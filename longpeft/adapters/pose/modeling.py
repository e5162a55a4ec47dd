"""PoSE's training inputs: skip-wise position ids, the window a sample trains with, and the collator.

A window of ``L_c`` tokens is cut at random into ``N`` chunks, contiguous positions inside each; chunk ``i`` is
shifted by a skip ``u_i`` drawn uniformly from ``{u_(i-1), ..., L_t - L_c}`` (``u_0 = 0``): skips never decrease and
the largest position is at most ``L_t - 1`` (the authors' code caps the first chunk at half the window; here the cut
is uniform). Chunk ``i`` holds ``x[v_i + st_i : v_i + st_i + l_i]`` of a sample ``x`` of ``L_x`` tokens (``st_i``,
``l_i``: its start and length in the window; Eq. 5): ``v_i = 0`` (``content_skip`` ``none``), ``v_i`` drawn from
``{v_(i-1), ..., L_x - L_c}`` (``uniform``) or ``v_i = u_i`` (``aligned``, skips at most ``min(L_x, L_t) - L_c``).

:class:`PoseCollator` always returns an all-ones ``attention_mask`` (right padding): without one, transformers reads
a jump in ``position_ids`` as a new packed sequence. TRL's collator drops ``position_ids``, hence PoSE's own."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from ...family import IGNORE_INDEX


def _skips(n_chunks: int, max_skip: int, rng: np.random.Generator) -> np.ndarray:
    """``(n_chunks,)`` skips: ``s_0 = 0``, then each drawn uniformly from ``{s_(i-1), ..., max_skip}``."""
    skips = np.zeros(n_chunks, dtype=np.int64)
    for i in range(1, n_chunks):
        skips[i] = rng.integers(skips[i - 1], max_skip + 1)
    return skips


def pose_position_ids(
    length: int, target_length: int, n_chunks: int = 2, rng: np.random.Generator | int | None = None
) -> np.ndarray:
    """PoSE position ids, int64 ``(length,)`` with max ``<= target_length - 1``, of a sample of ``length`` tokens in
    ``n_chunks`` chunks (1: plain positions); ``rng``: a numpy Generator or a seed."""
    return pose_sample(length, length, target_length, n_chunks, "none", rng)[1]


def pose_sample(
    source_length: int,
    window: int,
    target_length: int,
    n_chunks: int = 2,
    content_skip: str = "none",
    rng: np.random.Generator | int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Which tokens of a sample of ``source_length`` (``L_x``) tokens train, and at which positions: ``(token_index,
    position_ids)``, int64 ``(L_c,)`` with ``L_c = min(window, L_x)``, both increasing, by 1 inside a chunk.

    ``target_length``: ``L_t``, at least ``L_c``; ``n_chunks``: at most ``L_c``; ``content_skip``: ``none``,
    ``uniform`` or ``aligned`` (the module docstring); ``rng``: a numpy Generator or a seed.
    """
    length = min(window, source_length)
    if target_length < length:
        raise ValueError(f"target_length ({target_length}) must be >= the trained length ({length})")
    if length < 1:
        raise ValueError("length must be at least 1")
    if not 1 <= n_chunks <= length:
        raise ValueError(f"n_chunks must be in 1..{length}, got {n_chunks}")
    if content_skip not in ("none", "uniform", "aligned"):
        raise ValueError(f"content_skip must be none, uniform or aligned, got {content_skip!r}")
    rng = np.random.default_rng(rng)  # a Generator is returned as it is
    # each token's chunk: n_chunks non-empty chunks cut uniformly at random
    cuts = np.sort(rng.choice(np.arange(1, length), size=n_chunks - 1, replace=False))
    chunk = np.repeat(np.arange(n_chunks), np.diff(np.concatenate([[0], cuts, [length]])))
    steps = np.arange(length, dtype=np.int64)
    if content_skip == "aligned":  # the tokens at their position ids
        index = steps + _skips(n_chunks, min(source_length, target_length) - length, rng)[chunk]
        return index, index.copy()
    positions = steps + _skips(n_chunks, target_length - length, rng)[chunk]
    if content_skip == "uniform":
        steps = steps + _skips(n_chunks, source_length - length, rng)[chunk]
    return steps, positions


@dataclass
class PoseCollator:
    """Pads a batch (right) and attaches PoSE ``position_ids`` and an explicit all-ones ``attention_mask``.

    Each feature needs ``input_ids``; labels come from ``labels``, else TRL's ``assistant_masks`` /
    ``completion_mask`` (1 = trained), else ``input_ids``. A feature with ``position_ids`` keeps them (truncated to
    the window). Label -100 for padding (which repeats the last position) and a token after skipped text.

    ``seed`` seeds each sample's draw together with its tokens (as UtK's collator does): a resumed run, or another
    process, draws what an uninterrupted one would, and a sample seen again gets the same positions."""

    target_length: int  # the simulated context length L_t
    pad_token_id: int
    n_chunks: int = 2  # PoSE chunks per sample
    # the training window L_c: longer samples are cut to it, or give L_c tokens by content_skip (None: neither)
    max_length: int | None = None
    seed: int = 0
    # which of a longer sample's tokens fill the window (:func:`pose_sample`)
    content_skip: Literal["none", "uniform", "aligned"] = "none"

    def __post_init__(self) -> None:
        if self.max_length is not None and self.max_length > self.target_length:
            raise ValueError(f"max_length ({self.max_length}) must not exceed target_length ({self.target_length})")
        if self.content_skip not in ("none", "uniform", "aligned"):
            raise ValueError(f"content_skip must be none, uniform or aligned, got {self.content_skip!r}")
        if self.content_skip != "none" and self.max_length is None:
            raise ValueError(f"content_skip={self.content_skip!r} draws a window from each sample: set max_length")

    def _draw(self, input_ids: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The window's ``(input_ids, labels, position_ids)`` drawn from one sample, each ``(L_c,)``."""
        if self.content_skip == "none" and self.max_length is not None:
            input_ids, labels = input_ids[: self.max_length], labels[: self.max_length]
        rng = np.random.default_rng(zlib.crc32(input_ids.tobytes(), self.seed))
        window = self.max_length or len(input_ids)
        n_chunks = min(self.n_chunks, window, len(input_ids))
        index, positions = pose_sample(len(input_ids), window, self.target_length, n_chunks, self.content_skip, rng)
        labels = labels[index]
        labels[1:][np.diff(index) > 1] = IGNORE_INDEX  # its predecessor in the window did not precede it
        return input_ids[index], labels, positions

    def _labels(self, feature: dict[str, Any], input_ids: np.ndarray) -> np.ndarray:
        if feature.get("labels") is not None:
            return np.asarray(feature["labels"], dtype=np.int64)
        for key in ("assistant_masks", "completion_mask"):
            if feature.get(key) is not None:
                return np.where(np.asarray(feature[key], dtype=bool), input_ids, IGNORE_INDEX)
        return input_ids.copy()

    def __call__(self, features: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        rows = []
        for feature in features:
            input_ids = np.asarray(feature["input_ids"], dtype=np.int64)
            labels = self._labels(feature, input_ids)
            if feature.get("position_ids") is None:
                rows.append(self._draw(input_ids, labels))
                continue
            keep = slice(self.max_length)
            rows.append((input_ids[keep], labels[keep], np.asarray(feature["position_ids"], dtype=np.int64)[keep]))
        width = max(len(ids) for ids, _, _ in rows)

        def padded(column: int, **fill: Any) -> torch.Tensor:  # each row right-padded to the batch's width
            return torch.from_numpy(
                np.stack([np.pad(row[column], (0, width - len(row[column])), **fill) for row in rows])
            )

        # Padding repeats the last position: positions past target_length - 1 would change what a rope type that
        # reads the batch's largest position (dynamic) computes for the real tokens.
        return {
            "input_ids": padded(0, constant_values=self.pad_token_id),
            "labels": padded(1, constant_values=IGNORE_INDEX),
            "position_ids": padded(2, mode="edge"),
            "attention_mask": torch.ones((len(rows), width), dtype=torch.long),
        }
