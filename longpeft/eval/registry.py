"""The eval-task registry: the one table that ``longpeft eval``, :func:`longpeft.eval.evaluate` and the task contract
test read.

A task is one record: its name, its help line and the flags it takes (:mod:`.flags`, each with its default). A
:class:`ProbeTask` adds its probe builder, decode budget and scorer, and runs on the probe loop of :mod:`.tasks`
(build the grid, decode greedily, score each continuation); any other task brings its own ``run`` (perplexity, the
RULER-lite suite) or its own ``command`` (lm-evaluation-harness). Adding a task is one :func:`register` line
(the built-in ones: :mod:`.builtin`); nothing else names it.

Torch-free: the CLI builds its parser from this table.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ..synth_data.probes import Probe
from .flags import DEPTHS, Flag
from .scoring import score


@dataclass(frozen=True)
class EvalTask:
    """One ``longpeft eval`` task.

    Attributes:
        name: ``longpeft eval NAME``, the ``"task"`` of its results and the name of its files.
        help: one line for ``longpeft eval --help``.
        flags: the flags it takes besides ``--model``, ``--adapter``, ``--out`` and the loading ones; a flag of
            another task given to it is refused by name.
        aliases: other names it answers to.
    """

    name: str
    help: str
    flags: tuple[Flag, ...]
    aliases: tuple[str, ...] = field(default=(), kw_only=True)

    def run(
        self, model: Any, tokenizer: Any, save: Callable[[dict[str, Any]], None], **options: Any
    ) -> dict[str, Any]:
        """Its result on ``model`` (:func:`~longpeft.eval.evaluate` adds the STRING settings and writes it).

        ``options`` are keyed by its flags' keywords; ``save(part)`` writes a finished part's result at once (a
        suite's tasks) when there is an output folder.
        """
        raise ConfigError(f"eval {self.name} runs from the command line only: longpeft eval {self.name} ...")

    def command(self, args: argparse.Namespace) -> int | None:
        """Its own command (load, run, write; the exit status), or None for ``longpeft eval``'s: load the model,
        :func:`~longpeft.eval.evaluate`, write ``<name>.json`` and its plot, print the summary."""
        return None


def score_probe(prediction: str, probe: Probe) -> float:
    """The probe's own metric (exact, contains or recall: :func:`longpeft.eval.scoring.score`)."""
    return score(prediction, probe.answers, probe.metric)


@dataclass(frozen=True)
class ProbeTask(EvalTask):
    """A task scored on a grid of probes: prompts of exact token lengths with known answers, decoded greedily, each
    continuation scored in [0, 1]. The probe loop (:func:`longpeft.eval.tasks.run_probe_task`) runs it.

    Attributes:
        build: ``build(builder, length, depth, **options) -> Probe`` (no ``depth`` for a task without
            ``--depths``): one prompt of exactly ``length`` tokens from ``builder``, a
            :class:`longpeft.synth_data.probes.ProbeBuilder` (seeded, chat or plain); ``options`` are the task's
            own (its flags beyond the grid's, or ``evaluate``'s extra keywords).
        max_new_tokens: the decode budget per prompt: enough for the answer(s) with some slack.
        score: ``score(prediction, probe) -> float`` in [0, 1].
    """

    build: Callable[..., Probe]
    max_new_tokens: int
    score: Callable[[str, Probe], float] = score_probe

    @property
    def depths(self) -> bool:
        """Its needles sit at a depth: the grid spans ``--depths`` (0, .25, .5, .75 and 1 by default)."""
        return DEPTHS in self.flags


TASKS: dict[str, EvalTask] = {}
ALIASES: dict[str, str] = {}


def register(task: EvalTask) -> EvalTask:
    """Add ``task`` to the registry (``longpeft eval`` lists tasks in registration order); returns it.

    Raises:
        ValueError: its name or an alias is taken, it declares a flag another task declares differently (reuse
            the declaration of :mod:`.flags`), or a probe task has no decode budget.
    """
    for name in (task.name, *task.aliases):
        if name in ALIASES or (name in TASKS and TASKS[name] is not task):
            raise ValueError(f"an eval task named {name!r} is already registered")
    declared: dict[str, tuple[str, Flag]] = {}
    for other in TASKS.values():
        for flag in other.flags:
            declared.setdefault(flag.flag, (other.name, flag))
    for flag in task.flags:
        other, known = declared.get(flag.flag, (None, flag))
        if dataclasses.replace(known, default=None) != dataclasses.replace(flag, default=None):
            raise ValueError(
                f"eval task {task.name}: {flag.flag} is declared differently by eval task {other}; reuse its "
                "declaration (longpeft.eval.flags), with another default if needed"
            )
    if isinstance(task, ProbeTask) and task.max_new_tokens < 1:
        raise ValueError(f"eval task {task.name}: max_new_tokens must be >= 1, got {task.max_new_tokens}")
    TASKS[task.name] = task
    ALIASES.update(dict.fromkeys(task.aliases, task.name))
    return task


def unregister(name: str) -> None:
    """Remove a task and its aliases from the registry (tests, plug-ins)."""
    task = TASKS.pop(name, None)
    for alias in task.aliases if task else ():
        ALIASES.pop(alias, None)


@contextmanager
def registered(task: EvalTask) -> Iterator[EvalTask]:
    """Register ``task`` for the ``with`` block, and unregister it afterwards (tests, experiments)."""
    register(task)
    try:
        yield task
    finally:
        unregister(task.name)


def get_task(name: str) -> EvalTask:
    """The registered task called ``name`` (or one of its aliases), with an error listing the known ones."""
    task = TASKS.get(ALIASES.get(name, name))
    if task is None:
        raise ConfigError(f"unknown eval task {name!r}; choose one of {EVAL_TASKS}")
    return task


def probe_task(name: str) -> ProbeTask:
    """The registered probe task called ``name``, with an error listing the known ones."""
    task = TASKS.get(ALIASES.get(name, name))
    if not isinstance(task, ProbeTask):
        raise ConfigError(f"unknown probe task {name!r}; choose one of {PROBE_TASKS}")
    return task


class TaskNames(Sequence[str]):
    """The names of the registered tasks that ``keep`` selects, read at each use (a task registered later is in)."""

    def __init__(self, keep: Callable[[EvalTask], bool]) -> None:
        self.keep = keep

    def names(self) -> tuple[str, ...]:
        return tuple(name for name, task in TASKS.items() if self.keep(task))

    def __getitem__(self, index: Any) -> Any:
        return self.names()[index]

    def __len__(self) -> int:
        return len(self.names())

    def __repr__(self) -> str:
        return repr(self.names())


EVAL_TASKS = TaskNames(lambda task: True)
PROBE_TASKS = TaskNames(lambda task: isinstance(task, ProbeTask))
DEPTH_TASKS = TaskNames(lambda task: isinstance(task, ProbeTask) and task.depths)
