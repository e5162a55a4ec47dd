"""The eval-task registry, read by ``longpeft eval``, :func:`longpeft.eval.evaluate` and tests/test_eval_tasks.py.
Torch-free: the CLI builds its parser from it. A task is one record and one :func:`register` line (the built-in
ones: :mod:`.builtin`); CONTRIBUTING.md ("One record for every eval task") describes the contract."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from ..config import registration
from ..errors import ConfigError
from ..synth_data import probes
from ..synth_data.probes import Probe
from .flags import DEPTHS, SAMPLES, SEED, Flag
from .scoring import score


@dataclass(frozen=True)
class EvalTask:
    """One ``longpeft eval`` task: its ``name`` (also the ``"task"`` of its results and the name of its files), its
    ``help`` line, the ``flags`` it takes besides the loading ones and ``--out`` (any other task's flag given to it
    is refused by name), and other names it answers to (``aliases``)."""

    name: str
    help: str
    flags: tuple[Flag, ...]
    aliases: tuple[str, ...] = field(default=(), kw_only=True)
    kind: ClassVar[str] = "eval task"  # what get_task calls it in its errors

    def run(self, model: Any, tokenizer: Any, save: Callable[[dict], None], **options: Any) -> dict[str, Any]:
        """Its result on ``model`` (a :class:`ProbeTask` runs on the probe loop instead), from ``options`` keyed by its
        flags' keywords; ``save(part)`` writes a finished part's result at once when there is an output folder."""
        raise ConfigError(f"eval {self.name} runs from the command line only: longpeft eval {self.name} ...")

    def command(self, args: argparse.Namespace) -> int | None:
        """Its own command's exit status (it loads, runs and writes), or None for ``longpeft eval``'s."""
        return None


def score_probe(prediction: str, probe: Probe) -> float:
    """The probe's own metric (exact, contains or recall: :func:`longpeft.eval.scoring.score`)."""
    return score(prediction, probe.answers, probe.metric)


@dataclass(frozen=True)
class ProbeTask(EvalTask):
    """A task scored on a grid of probes, each decoded greedily (:func:`longpeft.eval.tasks.run_probe_task`).
    ``build(builder, length, depth, **options) -> Probe`` (no ``depth`` without ``--depths``): one prompt of exactly
    ``length`` tokens from a :class:`longpeft.synth_data.probes.ProbeBuilder`, ``options`` the task's own;
    ``max_new_tokens``: the decode budget per prompt (answers + slack); ``score(prediction, probe)``: in [0, 1]."""

    build: Callable[..., Probe]
    max_new_tokens: int
    score: Callable[[str, Probe], float] = score_probe
    kind: ClassVar[str] = "probe task"

    @property
    def depths(self) -> bool:
        """Its needles sit at a depth: its grid spans ``--depths``."""
        return DEPTHS in self.flags

    def probe(self, builder: probes.ProbeBuilder, length: int, depth: float | None = None, **options: Any) -> Probe:
        """One probe; ``depth`` in [0, 1] (default 0.5) places a ``--depths`` task's needles, the others take none."""
        if not self.depths:
            return dataclasses.replace(self.build(builder, length, **options), task=self.name)
        depth = 0.5 if depth is None else float(depth)
        if not 0.0 <= depth <= 1.0:
            raise ConfigError(f"depth must be in [0, 1], got {depth}")
        return dataclasses.replace(self.build(builder, length, depth, **options), task=self.name)


TASKS: dict[str, EvalTask] = {}
ALIASES: dict[str, str] = {}
Task = TypeVar("Task", bound=EvalTask)


def task_flags() -> dict[str, Flag]:
    """Every registered task's flags by flag, in registration order (the first declaration of each)."""
    flags: dict[str, Flag] = {}
    for task in TASKS.values():
        for flag in task.flags:
            flags.setdefault(flag.flag, flag)
    return flags


def register(task: EvalTask) -> EvalTask:
    """Add ``task`` to the registry (``longpeft eval`` lists tasks in registration order); returns it. Raises
    ValueError when its name or an alias is taken, it declares a flag another task declares differently (but for
    its default), or a probe task has no decode budget."""
    for name in (task.name, *task.aliases):
        if name in ALIASES or (name in TASKS and TASKS[name] is not task):
            raise ValueError(f"an eval task named {name!r} is already registered")
    declared = task_flags()
    for flag in task.flags:
        if dataclasses.replace(declared.get(flag.flag, flag), default=None) != dataclasses.replace(flag, default=None):
            raise ValueError(
                f"eval task {task.name}: {flag.flag} is declared differently by another task; reuse its "
                "declaration (longpeft.eval.flags), with another default if needed"
            )
    if isinstance(task, ProbeTask) and task.max_new_tokens < 1:
        raise ValueError(f"eval task {task.name}: max_new_tokens must be >= 1, got {task.max_new_tokens}")
    TASKS[task.name] = task
    ALIASES.update(dict.fromkeys(task.aliases, task.name))
    return task


unregister, registered = registration(register, TASKS, ALIASES)  # tests, plug-ins


def task_names(kind: type[EvalTask] = EvalTask, depths: bool = False) -> tuple[str, ...]:
    """The names of the registered tasks of ``kind`` (with ``--depths`` only, when ``depths``)."""
    return tuple(n for n, t in TASKS.items() if isinstance(t, kind) and (not depths or t.depths))


def get_task(name: str, kind: type[Task] = EvalTask) -> Task:
    """The registered task of ``kind`` called ``name`` (or an alias), with an error listing the known ones."""
    task = TASKS.get(ALIASES.get(name, name))
    if not isinstance(task, kind):
        raise ConfigError(f"unknown {kind.kind} {name!r}; choose one of {task_names(kind)}")
    return task


# EVAL_TASKS, PROBE_TASKS, DEPTH_TASKS: the task names, read from the registry at each access.
_NAMES = {"EVAL_TASKS": (EvalTask, False), "PROBE_TASKS": (ProbeTask, False), "DEPTH_TASKS": (ProbeTask, True)}


def __getattr__(name: str) -> tuple[str, ...]:
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return task_names(*_NAMES[name])


class ProbeBuilder(probes.ProbeBuilder):
    """:class:`longpeft.synth_data.probes.ProbeBuilder` that also makes the probes of the registered probe tasks."""

    def make(self, task: str, length: int, depth: float | None = None, **options: Any) -> Probe:
        """One probe of the probe task ``task`` (:meth:`ProbeTask.probe`)."""
        return get_task(task, ProbeTask).probe(self, length, depth, **options)


def make_probes(
    task: str | ProbeTask,
    tokenizer: Any,
    lengths: Sequence[int],
    depths: Sequence[float] | None = None,
    n_samples: int = SAMPLES.default,
    seed: int = SEED.default,
    chat: bool = False,
    **options: Any,
) -> list[Probe]:
    """``n_samples`` probes of the probe task ``task`` (its name or record) per (length, depth) cell, deterministic
    given ``seed``. ``depths`` in [0, 1] (default ``--depths``'s; repeats count once) only for a task with
    ``--depths``; ``chat`` wraps prompts in the chat template; ``options`` are the task's own (``digits=5``)."""
    record = task if isinstance(task, ProbeTask) else get_task(task, ProbeTask)
    if n_samples < 1:
        raise ConfigError(f"n_samples must be >= 1, got {n_samples}")
    grid_depths: Sequence[float | None] = [None]
    if record.depths:
        grid_depths = sorted({float(d) for d in (DEPTHS.default if depths is None else depths)})
    builder = ProbeBuilder(tokenizer, chat=chat, seed=seed)
    return [
        record.probe(builder, int(n), d, **options) for n in lengths for d in grid_depths for _ in range(n_samples)
    ]
