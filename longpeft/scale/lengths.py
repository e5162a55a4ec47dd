"""The training samples' own token counts (counted by :mod:`longpeft.recipes.plan_data`), which the planner's time
estimate sums over, and the order the Trainer takes them in."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

HISTOGRAM_BUCKETS = 5  # (max/2, max], (max/4, max/2], ..., and everything up to max/16


@dataclass(frozen=True)
class SampleLengths:
    """Tokens of every training sample as training sees them, after the recipe's length filters, truncation and
    packing (one per trained row, in no particular order); or, with no ``lengths``, why they are ``unknown``."""

    lengths: tuple[int, ...] = ()
    source: str = ""  # the data they were counted from (a file, ``demo``, ...)
    counted_with: str = ""  # ``"the tokenizer of <model>"``, or the characters-per-token estimate and why
    # what the recipe's filters did (longpeft.recipes.data.select_by_length): dropped, truncated, packed_sequences...
    filtered: dict[str, int] = field(default_factory=dict)
    unknown: str = ""

    @classmethod
    def not_known(cls, why: str) -> SampleLengths:
        return cls(unknown=why)

    def describe(self) -> str:
        """Where the lengths come from, for the planner's time line."""
        cuts = [
            f"{self.filtered[key]:,} {what}"
            for key, what in (
                ("dropped", "dropped as too long"),
                ("dropped_short", "dropped as too short"),
                ("truncated", "cut to the length limit"),
                ("dropped_without_scored_tokens", "dropped with no scored token left after the cut"),
            )
            if self.filtered.get(key)
        ]
        packed = self.filtered.get("packed_sequences")
        if packed is not None:
            cuts.append(f"documents packed into {packed:,} UtK sequences, UtK's own insertions not counted")
        return f"counted in {self.source} with {self.counted_with}; " + (
            ", ".join(cuts) if cuts else "the recipe's length filters dropped none"
        )


def length_histogram(
    lengths: Sequence[int], max_length: int, sample_flops: Callable[[int], float], buckets: int = HISTOGRAM_BUCKETS
) -> list[dict[str, Any]]:
    """Samples, tokens and FLOPs (``sample_flops(n)`` per sample of ``n`` tokens) per length bucket, longest first:
    ``(max_length / 2, max_length]`` (and longer), the half below it, ..., ``[1, max_length / 2**(buckets - 1)]``.
    Rows ``{"low", "high", "samples", "tokens", "flops"}``; empty buckets are kept so the shape shows."""
    edges = [max_length // 2**k for k in range(buckets)] + [0]
    rows = [
        {"low": edges[k + 1] + 1, "high": edges[k], "samples": 0, "tokens": 0, "flops": 0.0} for k in range(buckets)
    ]
    for n in lengths:
        k = next((k for k in range(buckets - 1, -1, -1) if n <= edges[k]), 0)
        rows[k]["samples"] += 1
        rows[k]["tokens"] += n
        rows[k]["flops"] += sample_flops(n)
    rows[0]["high"] = max(max_length, max(lengths, default=0))
    return rows


def format_histogram(rows: list[dict[str, Any]]) -> list[str]:
    """The histogram as text lines: each bucket's samples and its shares of the tokens and of the FLOPs."""
    tokens = sum(row["tokens"] for row in rows) or 1
    flops = sum(row["flops"] for row in rows) or 1.0
    return [f"{'sample length (tokens)':<24} {'samples':>9} {'tokens':>8} {'FLOPs':>8}"] + [
        f"{row['low']:>10,} - {row['high']:>10,} {row['samples']:>10,} {row['tokens'] / tokens:>8.1%} "
        f"{row['flops'] / flops:>8.1%}"
        for row in rows
    ]


GROUPED_STEPS = 50  # optimizer steps per length-sorted block of :func:`length_grouped_order` (the Trainer's 50)


def length_grouped_order(lengths: Sequence[int], step_samples: int, seed: int, epoch: int) -> Any:
    """The order of one epoch's rows (a numpy array of indices into ``lengths``, each once) when batches are
    grouped by length (``train.group_by_length``): a permutation drawn from ``(seed, epoch)`` alone, so the same in
    every process and after a resume, grouped by :func:`group_by_length`. The longest sample comes first, so that a
    run that cannot fit it fails at its first step."""
    import numpy as np

    rng = np.random.default_rng([seed, epoch])
    return group_by_length(rng.permutation(len(lengths)), lengths, step_samples)


def group_by_length(permutation: Any, lengths: Sequence[int], step_samples: int) -> Any:
    """``permutation`` (numpy array of row indices) cut into blocks of ``min(rows // (4 * step_samples),
    GROUPED_STEPS)`` optimizer steps (at least one; the Trainer's rule), each sorted longest first (ties keep their
    order), then the longest block head swapped with the first block's."""
    import numpy as np

    if step_samples < 1:
        raise ValueError(f"step_samples must be >= 1, not {step_samples}")
    sizes = np.asarray(lengths, dtype=np.int64)
    block = max(1, min(len(permutation) // (4 * step_samples), GROUPED_STEPS)) * step_samples
    blocks = [permutation[i : i + block] for i in range(0, len(permutation), block)]
    blocks = [rows[np.argsort(-sizes[rows], kind="stable")] for rows in blocks]
    if blocks:
        longest = int(np.argmax([sizes[rows[0]] for rows in blocks]))
        blocks[0][0], blocks[longest][0] = blocks[longest][0], blocks[0][0]
    return np.concatenate(blocks) if blocks else np.zeros(0, dtype=np.int64)


def epoch_steps(rows: int, per_device_batch: int, data_parallel: int, accumulation: int) -> int:
    """Optimizer steps in one epoch of ``rows`` samples, as the Trainer counts them: micro-batches of
    ``per_device_batch`` dealt round-robin to ``data_parallel`` GPUs (the last round completed), each GPU's in steps
    of ``accumulation``, the last step taking the rest."""
    return max(1, _ceil(_rounds(rows, per_device_batch, data_parallel), accumulation))


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _rounds(rows: int, per_device_batch: int, data_parallel: int) -> int:
    """Micro-batches each GPU trains in an epoch of ``rows`` samples."""
    return _ceil(_ceil(rows, per_device_batch), data_parallel)


def ordered_seconds(
    lengths: Sequence[int],
    sample_seconds: Callable[[Any], Any],
    steps: int,
    per_device_batch: int,
    data_parallel: int,
    accumulation: int,
    seed: int = 0,
    grouped: bool = False,
) -> float:
    """Seconds of ``steps`` optimizer steps of data-parallel training over the samples of ``lengths``, taken as the
    Trainer and accelerate take them: each epoch in a fresh seeded random order (``grouped``: in
    :func:`length_grouped_order`'s), micro-batch ``j`` of ``per_device_batch`` samples on GPU ``j % data_parallel``;
    with several GPUs the last round is completed with the epoch's first samples (accelerate's ``even_batches``). A
    step is ``accumulation`` micro-batches per GPU (:func:`epoch_steps` per epoch), each padded to its longest sample,
    and lasts as long as its slowest GPU. ``sample_seconds(n)``: one GPU's seconds for one sample of ``n`` tokens
    (an array of lengths in, an array out)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    pool = np.asarray(lengths, dtype=np.int64)
    rows, step_samples = len(pool), per_device_batch * data_parallel * accumulation
    filled = rows  # samples drawn per epoch: with several GPUs the last round is completed
    if data_parallel > 1:
        filled = _rounds(rows, per_device_batch, data_parallel) * data_parallel * per_device_batch
    batch = np.arange(filled) // per_device_batch  # each drawn sample's micro-batch
    micro = np.arange(_ceil(filled, per_device_batch))
    per_epoch = epoch_steps(rows, per_device_batch, data_parallel, accumulation)
    # micro-batch j runs on GPU j % data_parallel, in step (j // data_parallel) // accumulation of the epoch
    cell = micro // data_parallel // accumulation * data_parallel + micro % data_parallel
    seconds = []
    for epoch in range(_ceil(steps, per_epoch)):
        order = length_grouped_order(pool, step_samples, seed, epoch) if grouped else rng.permutation(rows)
        drawn = pool[np.resize(order, filled)]  # the last round completed with the epoch's first samples
        longest = np.zeros(len(micro), dtype=np.int64)
        np.maximum.at(longest, batch, drawn)
        micro_seconds = np.bincount(batch) * sample_seconds(longest.astype(np.float64))
        gpu_seconds = np.bincount(cell, weights=micro_seconds, minlength=per_epoch * data_parallel)
        seconds.append(gpu_seconds.reshape(per_epoch, data_parallel).max(axis=1))
    return float(np.concatenate(seconds)[:steps].sum()) if seconds else 0.0
