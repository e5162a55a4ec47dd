"""Exact answers of the built-in synth tasks from the ground truth of procedural documents (see :mod:`.corpus`):
each function is a task's ``answer(job, rng)`` (:class:`.qa.ProceduralAnswerer` calls it, no LLM)."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

from .corpus import TOPIC_DESCRIPTIONS, Fact, article
from .registry import Passage, QAJob, QAPair

Source = TypeVar("Source")


def single_detail(job: QAJob, rng: random.Random) -> list[QAPair]:
    """Up to ``job.n`` facts of the chunk, asked back in order of appearance."""
    facts = job.passages[0].facts()
    chosen = rng.sample(facts, min(job.n, len(facts)))
    chosen.sort(key=lambda f: f.start)
    return [QAPair(f.question, f.value, [f.fact_id]) for f in chosen]


def multi_detail(job: QAJob, rng: random.Random) -> list[QAPair]:
    """Questions aggregating facts of several places: counts, comparisons, sums, orders."""
    by_kind = _grouped(job.passages[0].facts(), "kind")
    return _distinct(job.n, rng, [_count_profession, _earlier_birth, _code_sum, _event_order], by_kind)


def heterogeneous(job: QAJob, rng: random.Random) -> list[QAPair]:
    """Questions comparing the documents of one context (numbered from 1)."""
    docs = [_DocFacts(i + 1, p) for i, p in enumerate(job.passages)]
    makers = [_earliest_founded, _largest_population, _shared_professions, _same_kind, _population_gap]
    return _distinct(job.n, rng, makers, docs)


def biography(job: QAJob, rng: random.Random) -> list[QAPair]:
    """One "write a biography" turn per main character with three facts or more: the sentences of its facts."""
    passage = job.passages[0]
    facts = passage.facts()
    pairs = []
    for character in passage.doc.characters:
        own = [f for f in facts if f.subject == character.name]
        if len(own) < 3:
            continue
        text = " ".join(dict.fromkeys(f.sentence for f in own))  # its sentences in order of appearance
        pairs.append(QAPair(f"Write a short biography of {character.name}.", text, [f.fact_id for f in own]))
    rng.shuffle(pairs)
    return pairs[: job.n]


def _distinct(
    n: int, rng: random.Random, makers: Sequence[Callable[[Source, random.Random], QAPair | None]], source: Source
) -> list[QAPair]:
    """Up to ``n`` pairs of makers drawn at random (``n * 8`` draws at most), no question twice."""
    pairs: dict[str, QAPair] = {}  # by question
    for _ in range(n * 8):
        if len(pairs) == n:
            break
        if (pair := rng.choice(makers)(source, rng)) is not None:
            pairs.setdefault(pair.question, pair)
    return list(pairs.values())


def _grouped(facts: Iterable[Fact], field: str) -> dict[str, list[Fact]]:
    """``facts`` by their ``field`` (``kind``, ``value``), each group in order."""
    groups: dict[str, list[Fact]] = {}
    for fact in facts:
        groups.setdefault(getattr(fact, field), []).append(fact)
    return groups


def _count_profession(by_kind: dict[str, list[Fact]], rng: random.Random) -> QAPair | None:
    # Asks about people *named* in the text: filler prose also mentions unnamed workers ("spoke with a sailor").
    groups = _grouped(by_kind.get("profession", []), "value")
    if not (candidates := [p for p, fs in groups.items() if len(fs) >= 2]):
        return None
    profession = rng.choice(sorted(candidates))
    people = groups[profession]
    return QAPair(
        f"How many people named in the text worked as {article(profession)}? Name them in order of appearance.",
        f"{len(people)}: {', '.join(f.subject for f in people)}.",
        [f.fact_id for f in people],
    )


def _two_in_order(facts: list[Fact], rng: random.Random) -> tuple[Fact, Fact, Fact, Fact] | None:
    """Two facts of different (year) values drawn from ``facts``: as drawn, then in the order of their values."""
    if len(facts) < 2:
        return None
    a, b = rng.sample(facts, 2)
    if a.value == b.value:
        return None
    return (a, b, a, b) if int(a.value) < int(b.value) else (a, b, b, a)


def _earlier_birth(by_kind: dict[str, list[Fact]], rng: random.Random) -> QAPair | None:
    if (drawn := _two_in_order(by_kind.get("birth_year", []), rng)) is None:
        return None
    a, b, first, second = drawn
    return QAPair(
        f"Who was born earlier, {a.subject} or {b.subject}?",
        f"{first.subject}, born in {first.value}; {second.subject} was born in {second.value}.",
        [a.fact_id, b.fact_id],
    )


def _code_sum(by_kind: dict[str, list[Fact]], rng: random.Random) -> QAPair | None:
    codes = by_kind.get("code", [])
    if len(codes) < 2:
        return None
    a, b = sorted(rng.sample(codes, 2), key=lambda f: f.start)
    return QAPair(
        f"What is the sum of the numbers marked on the {a.subject} and on the {b.subject}?",
        str(int(a.value) + int(b.value)),
        [a.fact_id, b.fact_id],
    )


def _event_order(by_kind: dict[str, list[Fact]], rng: random.Random) -> QAPair | None:
    if (drawn := _two_in_order(by_kind.get("event", []), rng)) is None:
        return None
    a, b, first, second = drawn
    return QAPair(
        f"Which came first: the council {a.get('verb')} the {a.subject}, or it {b.get('verb')} the {b.subject}?",
        f"The council {first.get('verb')} the {first.subject} first, in {first.value}; "
        f"it {second.get('verb')} the {second.subject} in {second.value}.",
        [a.fact_id, b.fact_id],
    )


@dataclass
class _DocFacts:
    """What the heterogeneous questions need from one document of a context."""

    number: int
    passage: Passage

    def fact(self, kind: str) -> Fact | None:
        return next((f for f in self.passage.facts() if f.kind == kind), None)

    def professions(self) -> dict[str, list[Fact]]:
        return _grouped((f for f in self.passage.facts() if f.kind == "profession"), "value")


def _extreme_town(
    docs: list[_DocFacts], rng: random.Random, kind: str, largest: bool, question: str, answer: str
) -> QAPair | None:
    """The town whose ``kind`` fact is the one largest (smallest) of the context: ``question``, and ``answer``
    formatted with its ``town``, document ``number`` and ``value``; None when a document lacks the fact or two tie."""
    rows = [(d, d.fact(kind)) for d in docs]
    if any(f is None for _, f in rows):
        return None
    values = [int(f.value) for _, f in rows]
    best = max(values) if largest else min(values)
    if values.count(best) != 1:
        return None
    d, f = rows[values.index(best)]
    return QAPair(
        question, answer.format(town=f.subject, number=d.number, value=f.value), [x.fact_id for _, x in rows]
    )


_earliest_founded = partial(
    _extreme_town,
    kind="founded",
    largest=False,
    question="Which of the towns described in these documents was founded earliest?",
    answer="{town}, described in Document {number}, founded in {value}.",
)
_largest_population = partial(
    _extreme_town,
    kind="population",
    largest=True,
    question="Which of the towns described in these documents has the most inhabitants?",
    answer="{town}, described in Document {number}, with {value} inhabitants.",
)


def _shared_professions(docs: list[_DocFacts], rng: random.Random) -> QAPair | None:
    if len(docs) < 2:
        return None
    a, b = sorted(rng.sample(docs, 2), key=lambda d: d.number)
    pa, pb = a.professions(), b.professions()
    shared = sorted(set(pa) & set(pb))
    evidence = [f.fact_id for p in shared for f in pa[p] + pb[p]]
    answer = ", ".join(shared) + "." if shared else "None: no profession is held by people named in both."
    # "named": filler prose mentions unnamed workers too ("spoke with a sailor"), which the facts do not record
    question = (
        f"Which professions are held both by someone named in Document {a.number} "
        f"and by someone named in Document {b.number}?"
    )
    return QAPair(question, answer, evidence)


def _same_kind(docs: list[_DocFacts], rng: random.Random) -> QAPair | None:
    if not (topics := sorted({d.passage.doc.topic for d in docs if d.passage.doc.topic})):
        return None
    topic = rng.choice(topics)
    numbers = [d.number for d in docs if d.passage.doc.topic == topic]
    listed = ", ".join(str(n) for n in numbers[:-1]) + (" and " if len(numbers) > 1 else "") + str(numbers[-1])
    noun = "Documents" if len(numbers) > 1 else "Only Document"
    return QAPair(f"Which of the documents describe {TOPIC_DESCRIPTIONS[topic]}?", f"{noun} {listed}.")


def _population_gap(docs: list[_DocFacts], rng: random.Random) -> QAPair | None:
    if len(docs) < 2:
        return None
    a, b = sorted(rng.sample(docs, 2), key=lambda d: d.number)
    fa, fb = a.fact("population"), b.fact("population")
    if fa is None or fb is None or fa.value == fb.value:
        return None
    big, gap = a if int(fa.value) > int(fb.value) else b, abs(int(fa.value) - int(fb.value))
    return QAPair(
        f"Which has more inhabitants, the town of Document {a.number} or the town of Document {b.number}, and by "
        "how many?",
        f"The town of Document {big.number}, by {gap} inhabitants.",
        [fa.fact_id, fb.fact_id],
    )
