"""What a synth task asks about and what it gets back: passages of documents, QA jobs and QA pairs, and the layouts
of passages as text that the tasks share.

A :class:`QAJob` of a registered task (:mod:`.registry`) says what to ask about (a <= 4K-token chunk, a whole long
context, the texts of one cluster, a book) and how many items to write; a :class:`QAGenerator` (:mod:`.qa`) turns
jobs into lists of :class:`QAPair`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from .answer_schema import QA_PAIRS
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
    """One generation job.

    Attributes:
        task: the name of a registered synth task (:mod:`.registry`).
        passages: what to ask about: one chunk (single_detail), one whole context (multi_detail,
            biography) or the documents of one context (heterogeneous, numbered from 1 in order).
        n: questions to write (biographies for ``biography``).
        seed: seeds the procedural answerer's choices.
    """

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
    text = passage.text.strip()
    title = passage.doc.title.strip()
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
