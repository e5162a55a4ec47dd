"""The order training draws its samples in, when the recipe groups them by length (``train.group_by_length``).

The Trainer's own grouping (``train_sampling_strategy="group_by_length"``) draws its order from the global torch
generator, groups one process's batches only, and without a length column reads every row whole to count it. Here
the order is :func:`longpeft.scale.lengths.length_grouped_order` (the one the planner times): blocks of whole
optimizer steps (every process's samples of a step together) sorted by length, drawn from ``train.seed`` and the
epoch alone, so that every process draws the same order, a resumed run continues the one it was interrupted in, and
the planner's hours are for the order training uses.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ..errors import DataError
from ..launch.topology import data_parallel_size
from ..scale.lengths import length_grouped_order


class LengthGroupedSampler(torch.utils.data.Sampler[int]):
    """Row indices of one epoch in :func:`length_grouped_order`'s order. ``lengths``: tokens of each row;
    ``step_samples``: samples per optimizer step over all processes (per-device batch x data-parallel processes x
    gradient accumulation); ``seed``: the run's seed. The Trainer (through accelerate's data loader) calls
    :meth:`set_epoch` before each epoch, a resumed epoch included."""

    def __init__(self, lengths: list[int], step_samples: int, seed: int) -> None:
        self.lengths, self.step_samples, self.seed, self.epoch = lengths, step_samples, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self) -> Iterator[int]:
        return iter(length_grouped_order(self.lengths, self.step_samples, self.seed, self.epoch).tolist())


def row_lengths(dataset: Any) -> list[int]:
    """Tokens of each row of a tokenized Hugging Face ``dataset`` (its ``input_ids`` column), counted by Arrow
    without reading the tokens into Python."""
    import pyarrow.compute as pc

    if "input_ids" not in getattr(dataset, "column_names", ()):
        raise DataError(
            "train.group_by_length needs the tokenized training rows (an input_ids column); this "
            f"dataset has {getattr(dataset, 'column_names', None)}: set train.group_by_length: false"
        )
    return pc.list_value_length(dataset.with_format("arrow")["input_ids"]).to_pylist()


def length_grouped_trainer(trainer_class: type) -> type:
    """A subclass of ``trainer_class`` (TRL's SFTTrainer or a subclass) that trains in :class:`LengthGroupedSampler`'s
    order."""

    class LengthGroupedTrainer(trainer_class):
        def _get_train_sampler(self, train_dataset: Any = None) -> torch.utils.data.Sampler:
            dataset = train_dataset if train_dataset is not None else self.train_dataset
            args = self.args
            step_samples = args.per_device_train_batch_size * data_parallel_size() * args.gradient_accumulation_steps
            return LengthGroupedSampler(row_lengths(dataset), step_samples, args.seed)

    LengthGroupedTrainer.__name__ = LengthGroupedTrainer.__qualname__ = f"LengthGrouped{trainer_class.__name__}"
    return LengthGroupedTrainer
