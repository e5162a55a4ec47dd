"""Probe sets of the registered probe tasks: one probe by task name, and the (length, depth) grid of a task."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from ..synth_data import probes
from ..synth_data.probes import Probe
from .registry import probe_task

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


class ProbeBuilder(probes.ProbeBuilder):
    """:class:`longpeft.synth_data.probes.ProbeBuilder` that also makes the probes of the registered probe tasks."""

    def make(self, task: str, length: int, depth: float | None = None, **options: Any) -> Probe:
        """One probe of the probe task ``task``; ``depth`` in [0, 1] (default 0.5) places the needles of a task
        with ``--depths`` and is not used by the others."""
        record = probe_task(task)
        if record.depths:
            depth = 0.5 if depth is None else float(depth)
            if not 0.0 <= depth <= 1.0:
                raise ConfigError(f"depth must be in [0, 1], got {depth}")
            probe = record.build(self, length, depth, **options)
        else:
            probe = record.build(self, length, **options)
        probe.task = record.name
        return probe


def make_probes(
    task: str,
    tokenizer: PreTrainedTokenizerBase,
    lengths: Sequence[int],
    depths: Sequence[float] | None = None,
    n_samples: int = 10,
    seed: int = 0,
    chat: bool = False,
    **options: Any,
) -> list[Probe]:
    """A grid of probes: ``n_samples`` per (length, depth) cell (depths only for tasks with ``--depths``).

    Args:
        task: a registered probe task.
        lengths: prompt lengths in tokens.
        depths: needle depths in [0, 1] (default :data:`DEFAULT_DEPTHS`; repeats count once, as repeated lengths
            do).
        n_samples: probes per cell.
        seed: everything is deterministic given it.
        chat: wrap prompts in the tokenizer's chat template.
        options: task options (e.g. ``digits=5`` for passkey, ``n_keys`` for NIAH).
    """
    if n_samples < 1:
        raise ConfigError(f"n_samples must be >= 1, got {n_samples}")
    grid_depths: Sequence[float | None] = [None]
    if probe_task(task).depths:
        grid_depths = sorted({float(d) for d in depths}) if depths is not None else DEFAULT_DEPTHS
    builder = ProbeBuilder(tokenizer, chat=chat, seed=seed)
    return [
        builder.make(task, int(length), depth, **options)
        for length in lengths
        for depth in grid_depths
        for _ in range(n_samples)
    ]
