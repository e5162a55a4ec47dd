"""Question-answer generation for the long-context builders: one interface, two implementations.

A :class:`QAJob` says what to ask about (a <= 4K-token chunk, a whole long context, the texts of one
cluster, a book) and how many items to write. :class:`LLMAnswerer` turns jobs into prompts for an
OpenAI-compatible model (GPT-4-style generation, as in the 80K recipe); :class:`ProceduralAnswerer`
answers the same jobs exactly from the facts recorded in procedural documents, with no LLM.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ..errors import DataError
from .answer_schema import BIOGRAPHIES, QA_PAIRS, OutputSchema
from .corpus import TOPIC_DESCRIPTIONS, Document, Fact, article
from .llm_client import LLMClient
from .llm_output import Checked, RejectedOutput, parse_json_object
from .llm_request import LLMRequest, LLMResult
from .quality import QualityGates, Rejection

SYNTH_TASKS = ("single_detail", "multi_detail", "heterogeneous", "biography")


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
        task: one of :data:`SYNTH_TASKS`.
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


# ---- exact answers from recorded facts ------------------------------------------------------------


class ProceduralAnswerer:
    """Exact QA from the ground truth of procedural documents (see :mod:`.corpus`)."""

    def generate(self, jobs: Sequence[QAJob]) -> list[list[QAPair] | None]:
        return [self.answer(job) for job in jobs]

    def answer(self, job: QAJob) -> list[QAPair]:
        for passage in job.passages:
            if not passage.doc.facts:
                raise DataError(
                    f"document {passage.doc.doc_id!r} has no recorded facts: the procedural answerer only works "
                    "on procedural documents; use the LLM answerer for text files"
                )
        rng = random.Random(job.seed)
        method = {
            "single_detail": self._single_detail,
            "multi_detail": self._multi_detail,
            "heterogeneous": self._heterogeneous,
            "biography": self._biography,
        }[job.task]
        return method(job, rng)

    def _single_detail(self, job: QAJob, rng: random.Random) -> list[QAPair]:
        facts = job.passages[0].facts()
        chosen = rng.sample(facts, min(job.n, len(facts)))
        chosen.sort(key=lambda f: f.start)
        return [QAPair(f.question, f.value, [f.fact_id]) for f in chosen]

    def _multi_detail(self, job: QAJob, rng: random.Random) -> list[QAPair]:
        facts = job.passages[0].facts()
        by_kind: dict[str, list[Fact]] = {}
        for fact in facts:
            by_kind.setdefault(fact.kind, []).append(fact)
        makers = [_count_profession, _earlier_birth, _code_sum, _event_order]
        pairs: list[QAPair] = []
        seen: set[str] = set()
        for _ in range(job.n * 8):
            if len(pairs) == job.n:
                break
            pair = rng.choice(makers)(by_kind, rng)
            if pair is not None and pair.question not in seen:
                seen.add(pair.question)
                pairs.append(pair)
        return pairs

    def _heterogeneous(self, job: QAJob, rng: random.Random) -> list[QAPair]:
        docs = [_DocFacts(i + 1, p) for i, p in enumerate(job.passages)]
        makers = [_earliest_founded, _largest_population, _shared_professions, _same_kind, _population_gap]
        pairs: list[QAPair] = []
        seen: set[str] = set()
        for _ in range(job.n * 8):
            if len(pairs) == job.n:
                break
            pair = rng.choice(makers)(docs, rng)
            if pair is not None and pair.question not in seen:
                seen.add(pair.question)
                pairs.append(pair)
        return pairs

    def _biography(self, job: QAJob, rng: random.Random) -> list[QAPair]:
        passage = job.passages[0]
        facts = passage.facts()
        pairs = []
        for character in passage.doc.characters:
            own = [f for f in facts if f.subject == character.name]
            if len(own) < 3:
                continue
            sentences = list(dict.fromkeys(f.sentence for f in own))  # in order of appearance
            pairs.append(
                QAPair(f"Write a short biography of {character.name}.", " ".join(sentences), [f.fact_id for f in own])
            )
        rng.shuffle(pairs)
        return pairs[: job.n]


def _count_profession(by_kind: dict[str, list[Fact]], rng: random.Random) -> QAPair | None:
    # Asks about people *named* in the text: filler prose also mentions unnamed workers ("spoke with a sailor").
    groups: dict[str, list[Fact]] = {}
    for fact in by_kind.get("profession", []):
        groups.setdefault(fact.value, []).append(fact)
    candidates = [p for p, fs in groups.items() if len(fs) >= 2]
    if not candidates:
        return None
    profession = rng.choice(sorted(candidates))
    people = groups[profession]
    names = ", ".join(f.subject for f in people)
    return QAPair(
        f"How many people named in the text worked as {article(profession)}? Name them in order of appearance.",
        f"{len(people)}: {names}.",
        [f.fact_id for f in people],
    )


def _earlier_birth(by_kind: dict[str, list[Fact]], rng: random.Random) -> QAPair | None:
    births = by_kind.get("birth_year", [])
    if len(births) < 2:
        return None
    a, b = rng.sample(births, 2)
    if a.value == b.value:
        return None
    first, second = (a, b) if int(a.value) < int(b.value) else (b, a)
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
    events = by_kind.get("event", [])
    if len(events) < 2:
        return None
    a, b = rng.sample(events, 2)
    if a.value == b.value:
        return None
    first, second = (a, b) if int(a.value) < int(b.value) else (b, a)
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

    @property
    def doc(self) -> Document:
        return self.passage.doc

    def fact(self, kind: str) -> Fact | None:
        return next((f for f in self.passage.facts() if f.kind == kind), None)

    def professions(self) -> dict[str, list[Fact]]:
        found: dict[str, list[Fact]] = {}
        for fact in self.passage.facts():
            if fact.kind == "profession":
                found.setdefault(fact.value, []).append(fact)
        return found


def _extreme(docs: list[_DocFacts], kind: str, largest: bool) -> tuple[_DocFacts, Fact, list[Fact]] | None:
    rows = [(d, d.fact(kind)) for d in docs]
    if any(f is None for _, f in rows):
        return None
    values = [int(f.value) for _, f in rows]
    best = max(values) if largest else min(values)
    if values.count(best) != 1:
        return None
    d, f = rows[values.index(best)]
    return d, f, [f for _, f in rows]


def _earliest_founded(docs: list[_DocFacts], rng: random.Random) -> QAPair | None:
    found = _extreme(docs, "founded", largest=False)
    if found is None:
        return None
    d, f, all_facts = found
    return QAPair(
        "Which of the towns described in these documents was founded earliest?",
        f"{f.subject}, described in Document {d.number}, founded in {f.value}.",
        [x.fact_id for x in all_facts],
    )


def _largest_population(docs: list[_DocFacts], rng: random.Random) -> QAPair | None:
    found = _extreme(docs, "population", largest=True)
    if found is None:
        return None
    d, f, all_facts = found
    return QAPair(
        "Which of the towns described in these documents has the most inhabitants?",
        f"{f.subject}, described in Document {d.number}, with {f.value} inhabitants.",
        [x.fact_id for x in all_facts],
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
    topics = sorted({d.doc.topic for d in docs if d.doc.topic})
    if not topics:
        return None
    topic = rng.choice(topics)
    numbers = [d.number for d in docs if d.doc.topic == topic]
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
    big, small = (a, b) if int(fa.value) > int(fb.value) else (b, a)
    gap = abs(int(fa.value) - int(fb.value))
    return QAPair(
        f"Which has more inhabitants, the town of Document {a.number} or the town of Document {b.number}, and by "
        "how many?",
        f"The town of Document {big.number}, by {gap} inhabitants.",
        [fa.fact_id, fb.fact_id],
    )


# ---- GPT-4-style generation through an OpenAI-compatible endpoint ----------------------------------

SYSTEM_PROMPT = (
    "You write high-quality training data for long-context reading comprehension. You reply with JSON only."
)

# Doubled braces: the prompts go through str.format.
QA_FORMAT = 'Reply with JSON only, in this form: {{"qa_pairs": [{{"question": "...", "answer": "..."}}]}}'

QA_RULES = (
    "Every question must be self-contained: name the people, places or things it asks about, and never "
    "refer to 'the excerpt', 'the passage' or 'the author'. Every answer must be correct according to the "
    "text, complete and concise."
)

PROMPTS = {
    "single_detail": (
        "Below is an excerpt of a longer document.\n\n<excerpt>\n{text}\n</excerpt>\n\n"
        "Write {n} question-answer pairs, each about one specific detail stated in this excerpt. "
        f"{QA_RULES}\n{QA_FORMAT}"
    ),
    "multi_detail": (
        "Below is a long document.\n\n<document>\n{text}\n</document>\n\n"
        "Write {n} question-answer pairs that each need information from several different parts of the "
        "document: counting or listing things mentioned in different places, comparing, ordering events, "
        f"or following how something develops. {QA_RULES}\n{QA_FORMAT}"
    ),
    "heterogeneous": (
        "Below are {k} related but independent documents.\n\n{text}\n\n"
        "Write {n} question-answer pairs about the similarities and differences between these documents. "
        "Refer to documents by number (for example 'Document 2'). "
        f"{QA_RULES}\n{QA_FORMAT}"
    ),
    "biography": (
        "Below is a book.\n\n<book>\n{text}\n</book>\n\n"
        "Identify the {n} main characters of the book and write a biography of each: who they are, where "
        "they come from, what they do, their relationships and what happens to them, using only the book. "
        'Reply with JSON only, in this form: {{"biographies": [{{"name": "...", "biography": "..."}}]}}'
    ),
}


def titled_text(passage: Passage) -> str:
    """The passage's text, headed by its document's title unless the text already starts with it."""
    text = passage.text.strip()
    title = passage.doc.title.strip()
    return text if not title or text.startswith(title) else f"{title}\n{text}"


def numbered_documents(passages: Sequence[Passage]) -> str:
    """The documents of a heterogeneous context, numbered from 1 (the layout of the training context)."""
    return "\n\n".join(f"Document {i + 1}:\n{titled_text(p)}" for i, p in enumerate(passages))


def job_prompt(job: QAJob) -> str:
    """The user prompt of one job."""
    if job.task == "heterogeneous":
        text = "\n\n".join(
            f"<document {i + 1}>\n{titled_text(p)}\n</document {i + 1}>" for i, p in enumerate(job.passages)
        )
        return PROMPTS["heterogeneous"].format(text=text, n=job.n, k=len(job.passages))
    return PROMPTS[job.task].format(text=job.passages[0].text.strip(), n=job.n)


def parse_answer(text: str, schema: OutputSchema) -> list:
    """The list under ``schema.name`` of the JSON answer ``text``, validated against ``schema`` (the one sent as
    ``response_format``); :class:`MalformedOutput` names the first path that breaks it."""
    value = parse_json_object(text)
    schema.validate(value)
    return value[schema.name]


def parse_qa_pairs(text: str) -> list[QAPair]:
    """``{"qa_pairs": [{"question", "answer"}]}`` (:data:`.answer_schema.QA_PAIRS`) -> QA pairs, stripped."""
    return [QAPair(item["question"].strip(), item["answer"].strip()) for item in parse_answer(text, QA_PAIRS)]


def parse_biographies(text: str) -> list[QAPair]:
    """``{"biographies": [{"name", "biography"}]}`` (:data:`.answer_schema.BIOGRAPHIES`) -> one "write a
    biography" turn per character."""
    return [
        QAPair(f"Write a short biography of {item['name'].strip()}.", item["biography"].strip())
        for item in parse_answer(text, BIOGRAPHIES)
    ]


TASK_SCHEMAS = {
    "single_detail": QA_PAIRS,
    "multi_detail": QA_PAIRS,
    "heterogeneous": QA_PAIRS,
    "biography": BIOGRAPHIES,
}
"""The output schema of each task's answer (sent as ``response_format``, checked by its parser)."""


def job_request(job: QAJob, index: int = 0) -> LLMRequest:
    """The chat request :class:`LLMAnswerer` sends for ``job`` (the ``index``-th of its batch, for the rejects
    file); its schema holds at most ``job.n`` items."""
    return LLMRequest(
        task=job.task,
        messages=[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": job_prompt(job)}],
        schema=TASK_SCHEMAS[job.task].bounded(job.n),
        meta={
            "job": index,
            "sources": [p.doc.doc_id for p in job.passages],
            "spans": [[p.start, p.end] for p in job.passages],
        },
    )


_BIOGRAPHY_TURN = re.compile(r"Write a short biography of (.+)\.\s*$", re.DOTALL)


def biography_subject(question: str) -> str:
    """The name in a "Write a short biography of NAME." turn (the whole question if it is not one)."""
    match = _BIOGRAPHY_TURN.match(question.strip())
    return match.group(1).strip() if match else question


def job_evidence(job: QAJob) -> str:
    """The text a job's answers must be grounded in: its chunk or document, or the numbered documents."""
    if job.task == "heterogeneous":
        return numbered_documents(job.passages)
    return "\n\n".join(titled_text(p) for p in job.passages)


def job_instructions(job: QAJob) -> str:
    """The prompt of ``job`` without its text: what an answer must not copy."""
    return SYSTEM_PROMPT + "\n" + PROMPTS[job.task].format(text="", n=job.n, k=len(job.passages))


class LLMAnswerer:
    """Generates QA for every job with one concurrent, cached batch per task through :class:`LLMClient`.

    Every parsed item goes through the quality gates (``gates``, default :class:`~.quality.QualityGates` with
    default thresholds): a rejected item is dropped, counted and written to the rejects file; an answer whose
    items are all rejected is asked again as a new attempt, like malformed output (a fresh sample usually
    passes, and otherwise the whole conversation of that context would be lost). Of the items kept, the first
    ``job.n`` are used (more are counted as surplus). Questions repeating an earlier one of the same context (the
    chunks of one single-detail document) are dropped too.
    """

    def __init__(self, client: LLMClient, gates: QualityGates | None = None):
        self.client = client
        self.gates = gates if gates is not None else QualityGates()

    def generate(self, jobs: Sequence[QAJob]) -> list[list[QAPair] | None]:
        results: list[list[QAPair] | None] = [None] * len(jobs)
        answered: dict[int, LLMResult] = {}
        for task in SYNTH_TASKS:
            indices = [i for i, job in enumerate(jobs) if job.task == task]
            if not indices:
                continue
            batch = [job_request(jobs[i], i) for i in indices]
            parse = parse_biographies if task == "biography" else parse_qa_pairs
            results_of_task = self.client.run(batch, parse=parse, desc=f"{task} (LLM)", check=self._checker(jobs))
            for i, result in zip(indices, results_of_task):
                answered[i] = result
                results[i] = result.value if result.ok else None
        self._drop_repeats_across_chunks(jobs, results, answered)
        return results

    def _checker(self, jobs: Sequence[QAJob]) -> Callable[[LLMRequest, list[QAPair]], Checked]:
        def check(request: LLMRequest, pairs: list[QAPair]) -> Checked:
            job = jobs[request.meta["job"]]
            subjects = [biography_subject(p.question) for p in pairs] if job.task == "biography" else None
            verdict = self.gates.check(job.task, pairs, job_evidence(job), job_instructions(job), subjects)
            dropped = [item_record(pair, rejection) for pair, rejection in verdict.rejected]
            if not verdict.kept:
                reasons = ", ".join(sorted({r.reason for _, r in verdict.rejected}))
                raise RejectedOutput(f"every item failed the quality gates ({reasons})", dropped)
            self.gates.surplus(job.task, len(verdict.kept) - job.n)
            return Checked(verdict.kept[: job.n], dropped)

        return check

    def _drop_repeats_across_chunks(
        self, jobs: Sequence[QAJob], results: list[list[QAPair] | None], answered: dict[int, LLMResult]
    ) -> None:
        """Near-duplicate questions across the jobs of one context: the single-detail chunks of one document
        (each document gives one context per task). What is dropped goes to the rejects file with its request."""
        kept: dict[str, list[str]] = {}
        for i, job in enumerate(jobs):
            if job.task != "single_detail" or not results[i]:
                continue
            earlier = kept.setdefault(job.passages[0].doc.doc_id, [])
            verdict = self.gates.check_repeats(job.task, results[i], earlier)
            result = answered[i]
            dropped = [item_record(pair, rejection) for pair, rejection in verdict.rejected]
            self.client.drop_items(result.request, "repeats", result.attempts - 1, dropped)
            results[i] = verdict.kept
            earlier.extend(p.question for p in verdict.kept)


def item_record(pair: QAPair, rejection: Rejection) -> dict[str, str]:
    """The rejects-file fields of a QA pair (or biography turn) the quality gates dropped."""
    return {"reason": rejection.reason, "detail": rejection.detail, "question": pair.question, "answer": pair.answer}
