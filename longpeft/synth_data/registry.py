"""The synth-task registry (one :class:`SynthTask` per task; the built-in ones: :mod:`.builtin`), and the types of
what a task plans (:class:`QAJob`) and answers (:class:`QAPair`, from a :class:`QAGenerator`, :mod:`.qa`)."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import Field

from ..config import StrictModel, registration
from ..errors import ConfigError
from .answer_schema import QA_PAIRS, OutputSchema
from .corpus import Document, Fact


@dataclass(frozen=True)
class Passage:
    """The character span ``[start, end)`` of a document."""

    doc: Document
    start: int
    end: int

    @property
    def text(self) -> str:
        return self.doc.text[self.start : self.end]

    def facts(self) -> list[Fact]:
        """Facts of the document whose sentence lies entirely inside the passage."""
        return [f for f in self.doc.facts if f.start >= self.start and f.end <= self.end]


@dataclass
class QAJob:
    """One generation job of ``task`` (a registered synth task): ``n`` items (questions, or biographies) about its
    ``passages`` (a chunk, a whole context, or the documents of one context, numbered from 1 in order); ``seed``
    seeds the procedural answerer's choices."""

    task: str
    passages: list[Passage]
    n: int
    seed: int = 0


@dataclass
class QAPair:
    """A question and its answer; ``evidence`` lists the fact ids behind a procedural answer."""

    question: str
    answer: str
    evidence: list[str] = field(default_factory=list)


class QAGenerator(Protocol):
    """Answers a batch of jobs; ``None`` marks a job that produced nothing usable (recorded elsewhere)."""

    def generate(self, jobs: Sequence[QAJob]) -> list[list[QAPair] | None]: ...


def parse_qa_pairs(text: str) -> list[QAPair]:
    """``{"qa_pairs": [{"question", "answer"}]}`` (:data:`.answer_schema.QA_PAIRS`) -> QA pairs, stripped."""
    return [QAPair(item["question"].strip(), item["answer"].strip()) for item in QA_PAIRS.parse(text)]


def titled_text(passage: Passage) -> str:
    """The passage's text, headed by its document's title unless the text already starts with it."""
    text, title = passage.text.strip(), passage.doc.title.strip()
    return text if not title or text.startswith(title) else f"{title}\n{text}"


def titled_passages(passages: Sequence[Passage]) -> str:
    """The passages' titled texts (:func:`titled_text`), one after the other."""
    return "\n\n".join(titled_text(p) for p in passages)


def numbered_documents(passages: Sequence[Passage]) -> str:
    """The documents of a heterogeneous context, numbered from 1 (the layout of the training context)."""
    return "\n\n".join(f"Document {i + 1}:\n{titled_text(p)}" for i, p in enumerate(passages))


def first_passage(passages: Sequence[Passage]) -> str:
    """The text of the first passage, stripped: what the prompt of a one-passage job shows."""
    return passages[0].text.strip()


@dataclass(frozen=True)
class Flag:
    """One ``longpeft synth`` flag: ``flag`` as typed (its dest: without dashes, ``-`` read as ``_``), its ``help``
    line (None: none), the dotted config ``key`` it sets (a task's flag: a field of its section), or None for a flag
    the command reads itself, and more ``add_argument`` keywords (``options``: ``type``, ``choices``, ``action``)."""

    flag: str
    help: str | None
    key: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


class TaskConfig(StrictModel):
    """A task's section of the synth config (``single_detail:``, ...): ``contexts`` and the task's own settings."""

    contexts: int = Field(2, ge=0, description="conversations to build (0: the task is off)")


@dataclass(frozen=True)
class SynthTask:
    """One ``longpeft synth`` task (its fields: CONTRIBUTING.md, One record for every synth task). ``name``: the
    ``--tasks`` choice, config section and ``task`` of its rows; ``plan(builder, name, settings, documents) ->
    list[ContextPlan]`` (procedural documents made with ``builder`` when ``documents`` is None); ``prompt``: a
    ``str.format`` template of ``{text}`` (the passages laid out by ``layout``), ``{n}`` and ``{k}``; ``answer(job,
    rng)``: exact items from procedural facts; ``parse(text)`` raises :class:`.answer_schema.MalformedOutput` for an
    answer that breaks ``schema``; ``evidence``: the text the answers must be grounded in; ``subject(question) ->
    name`` for items about a named subject; ``computed_numbers``: answers hold numbers the ``ungrounded`` gate does
    not look for; ``documents``: options of :func:`.corpus.generate_document`."""

    name: str
    config: type[TaskConfig]
    plan: Callable[..., list[Any]]
    prompt: str
    answer: Callable[[QAJob, random.Random], list[QAPair]]
    schema: OutputSchema = field(default=QA_PAIRS, kw_only=True)
    parse: Callable[[str], list[QAPair]] = field(default=parse_qa_pairs, kw_only=True)
    layout: Callable[[Sequence[Passage]], str] = field(default=first_passage, kw_only=True)
    evidence: Callable[[Sequence[Passage]], str] = field(default=titled_passages, kw_only=True)
    subject: Callable[[str], str] | None = field(default=None, kw_only=True)
    computed_numbers: bool = field(default=False, kw_only=True)
    documents: Mapping[str, Any] = field(default_factory=dict, kw_only=True)
    flags: tuple[Flag, ...] = field(default=(), kw_only=True)


TASKS: dict[str, SynthTask] = {}


def register(task: SynthTask) -> SynthTask:
    """Add ``task`` to the registry (runs take tasks in registration order) and return it; ValueError when its name
    is taken or no identifier, its config is no :class:`TaskConfig`, or a flag is another task's or sets no field."""
    if task.name in TASKS and TASKS[task.name] is not task:
        raise ValueError(f"a synth task named {task.name!r} is already registered")
    if not task.name.isidentifier():
        raise ValueError(f"synth task {task.name!r}: the name must be an identifier (it names a config section)")
    if not (isinstance(task.config, type) and issubclass(task.config, TaskConfig)):
        raise ValueError(f"synth task {task.name}: config must be a subclass of TaskConfig, got {task.config!r}")
    taken = {flag.flag for other in TASKS.values() if other is not task for flag in other.flags}
    for flag in task.flags:
        if flag.flag in taken:
            raise ValueError(f"synth task {task.name}: {flag.flag} is another task's flag")
        if flag.key not in task.config.model_fields:
            raise ValueError(f"synth task {task.name}: {flag.flag} sets {flag.key!r}, not a field of its config")
    TASKS[task.name] = task
    return task


unregister, registered = registration(register, TASKS)  # tests, plug-ins


def get_task(name: str) -> SynthTask:
    """The registered task called ``name``, with an error listing the known ones."""
    if name not in TASKS:
        raise ConfigError(f"unknown synth task {name!r}; choose one of {', '.join(TASKS)}")
    return TASKS[name]


def task_flags() -> list[Flag]:
    """Every registered task's flags, keyed in the whole config (``single_detail.questions_per_chunk``)."""
    return [dataclasses.replace(flag, key=f"{task.name}.{flag.key}") for task in TASKS.values() for flag in task.flags]
