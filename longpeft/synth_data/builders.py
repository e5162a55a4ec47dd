"""Long-context conversation builders for every synth task (:mod:`.registry`): the context and the first question in
the first user turn, each further QA pair one more turn, of ``min_tokens`` to ``max_tokens`` tokens (chat template
included)."""

from __future__ import annotations

import functools
import json
import math
import random
import re
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import Field, model_validator
from tqdm.auto import tqdm

from ..config import StrictModel
from ..errors import ConfigError
from .corpus import TOPICS, Document, generate_document
from .probes import require_tokens
from .registry import TASKS, Passage, QAGenerator, QAJob, QAPair, get_task

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DEFAULT_CONTEXT_TEMPLATE = "Read the following text and answer the questions after it.\n\n{context}\n\n{question}"

_SENTENCE_END = re.compile(r"[.!?][\"')\]]*(?=\s)|\n")


class LengthConfig(StrictModel):
    """Token budget of one conversation (chat template included)."""

    min_tokens: int = Field(65536, ge=1, description="shortest conversation kept")
    max_tokens: int = Field(81920, ge=1, description="longest conversation kept")
    chunk_tokens: int = Field(4096, ge=16, description="largest chunk a single-detail question is about")
    qa_reserve_tokens: int = Field(1024, ge=0, description="room left after the context for the QA turns")

    @model_validator(mode="after")
    def _ordered(self) -> LengthConfig:
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) is larger than max_tokens ({self.max_tokens})")
        return self

    def context_budget(self) -> tuple[int, int]:
        """Token range for a context: from a little above ``min_tokens`` up to ``max_tokens`` minus the
        QA reserve (the reserve shrinks to half the range when the range is narrow)."""
        low = self.min_tokens + 8  # slack for re-tokenisation at the cut
        reserve = min(self.qa_reserve_tokens, (self.max_tokens - self.min_tokens) // 2)
        return low, max(low, self.max_tokens - reserve)


class TokenCounter:
    """Token counts and character offsets for one tokenizer (a fast tokenizer: offsets are required)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        require_tokens(tokenizer)
        if not getattr(tokenizer, "is_fast", False):
            raise ConfigError("the builders need a fast tokenizer (character offsets); load it with use_fast=True")
        self.tokenizer = tokenizer

    def count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def offsets(self, text: str) -> list[tuple[int, int]]:
        """``(start, end)`` character span of every token of ``text``."""
        encoding = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return [tuple(span) for span in encoding["offset_mapping"]]

    def conversation(self, messages: list[dict[str, str]]) -> int:
        """Tokens of a conversation as the trainer will see it (the chat template when there is one)."""
        if getattr(self.tokenizer, "chat_template", None):
            encoded = self.tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)
            return len(encoded["input_ids"])
        return sum(self.count(m["content"]) for m in messages) + 4 * len(messages)

    @functools.cached_property
    def tokens_per_sentence(self) -> float:
        """Average tokens per procedural sentence (estimated once from a sample document)."""
        return self.count(generate_document(seed=12345, n_sentences=300).text) / 300


def procedural_document(counter: TokenCounter, min_tokens: int, seed: int, **options: Any) -> Document:
    """A procedural document of ``min_tokens`` to ~1.05 x ``min_tokens`` tokens (``options``: of
    :func:`~.corpus.generate_document`), its sentence count adjusted in a few regenerations."""
    floor = max(4, 4 * options.get("n_characters", 4))  # generate_document needs 4 per character
    n_sentences = max(floor, math.ceil(min_tokens / counter.tokens_per_sentence))
    best: Document | None = None
    best_tokens = 0
    for _ in range(8):
        document = generate_document(seed=seed, n_sentences=n_sentences, **options)
        tokens = counter.count(document.text)
        if tokens >= min_tokens and (best is None or tokens < best_tokens):
            best, best_tokens = document, tokens
        if min_tokens <= tokens <= 1.05 * min_tokens:
            break
        step = math.ceil(n_sentences * (min_tokens * 1.02 / tokens - 1))
        n_sentences = max(floor, n_sentences + (step or (1 if tokens < min_tokens else -1)))
    while best is None:  # still short: grow until long enough
        n_sentences = math.ceil(n_sentences * 1.2) + 1
        document = generate_document(seed=seed, n_sentences=n_sentences, **options)
        if counter.count(document.text) >= min_tokens:
            best = document
    return best


def exchange(user: str, assistant: str) -> list[dict[str, str]]:
    """A user turn and the assistant's answer, in ``messages`` format."""
    return [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]


def sentence_end_after(text: str, position: int, window: int = 600) -> int:
    """First sentence end at or after ``position`` (within ``window`` chars), else ``position``."""
    match = _SENTENCE_END.search(text, position, min(len(text), position + window))
    return match.end() if match else position


def sentence_end_before(text: str, position: int, floor: int) -> int:
    """Last sentence end in ``(floor, position]``, else ``position``."""
    ends = [match.end() for match in _SENTENCE_END.finditer(text, floor, position)]
    return ends[-1] if ends and ends[-1] > floor else position


@dataclass
class ContextPlan:
    """One future conversation: its context and the QA jobs about it."""

    task: str
    passages: list[Passage]
    jobs: list[QAJob]
    context_text: str
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class BuildReport:
    """What happened per task: contexts asked for, conversations built, and why others were skipped."""

    requested: Counter[str] = field(default_factory=Counter)
    built: Counter[str] = field(default_factory=Counter)
    skipped: dict[str, Counter[str]] = field(default_factory=dict)

    def skip(self, task: str, reason: str, n: int = 1) -> None:
        self.skipped.setdefault(task, Counter())[reason] += n

    def to_dict(self) -> dict[str, Any]:
        skipped = {task: dict(reasons) for task, reasons in self.skipped.items()}
        return {"requested": dict(self.requested), "built": dict(self.built), "skipped": skipped}


class LongContextBuilder:
    """Plans contexts (each task by its planner), asks ``answerer`` for QA, and assembles conversations within
    ``length``, measured with ``tokenizer`` (fast) and its chat template. ``context_template``: the first user turn,
    with ``{context}`` and ``{question}``; ``seed`` seeds every random choice."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        answerer: QAGenerator,
        length: LengthConfig,
        context_template: str = DEFAULT_CONTEXT_TEMPLATE,
        seed: int = 0,
        show_progress: bool = False,
    ):
        if "{context}" not in context_template or "{question}" not in context_template:
            raise ConfigError("context_template needs both {context} and {question}")
        self.counter = TokenCounter(tokenizer)
        self.answerer = answerer
        self.length = length
        self.context_template = context_template
        self.seed = seed
        self.show_progress = show_progress
        self.report = BuildReport()

    def plan(self, task: str, documents: Sequence[Document] | None = None, **settings: Any) -> list[ContextPlan]:
        """The contexts and QA jobs of the registered ``task`` (no QA is generated yet), with ``settings``: fields of
        its config section (``contexts``: conversations to build, and its own); from ``documents``, or from
        procedural documents generated here when they are None."""
        record = get_task(task)
        section = record.config(**settings)
        self.report.requested[record.name] += section.contexts
        return record.plan(self, record.name, section, documents)

    def rng(self, task: str) -> random.Random:
        """The random choices of ``task``'s planning (seeded by the builder's seed)."""
        return random.Random(f"{self.seed}/{task}/0")

    def long_contexts(
        self, task: str, documents: Sequence[Document] | None, count: int
    ) -> Iterator[tuple[Document, Passage, list[tuple[int, int]], random.Random]]:
        """Yield (document, context passage, token offsets inside it, the task's rng) for up to ``count`` documents
        in a random order, one context each, of ``documents`` or, when None, of ``count`` procedural ones."""
        if documents is None:
            documents = procedural_long_documents(
                self.counter, task, count, self.length, self.seed, self.show_progress
            )
        rng = self.rng(task)
        order = list(range(len(documents)))
        rng.shuffle(order)
        produced = 0
        for index in order:
            if produced == count:
                break
            document = documents[index]
            offsets = self.counter.offsets(document.text)
            target = rng.randint(*self.length.context_budget())
            if len(offsets) < self.length.min_tokens:
                self.report.skip(task, "document_too_short")
                continue
            end = len(document.text)
            if len(offsets) > target:
                end = sentence_end_after(document.text, offsets[target - 1][1])
            inside = [span for span in offsets if span[1] <= end]
            produced += 1
            yield document, Passage(document, 0, end), inside, rng

    def build(self, plans: Sequence[ContextPlan]) -> list[dict[str, Any]]:
        """Generate QA for every plan in one batch, then assemble and length-check the conversations."""
        jobs = [job for plan in plans for job in plan.jobs]
        answers = iter(self.answerer.generate(jobs))
        rows = []
        for plan in tqdm(plans, desc="assembling conversations", unit="conv", disable=not self.show_progress):
            qa_lists = [next(answers) for _ in plan.jobs]
            if (row := self.assemble(plan, qa_lists)) is not None:
                row["id"] = f"{plan.task}-{self.report.built[plan.task]:05d}"
                self.report.built[plan.task] += 1
                rows.append(row)
        return rows

    def assemble(self, plan: ContextPlan, qa_lists: Sequence[list[QAPair] | None]) -> dict[str, Any] | None:
        """The conversation of one plan, trimmed to ``max_tokens``; None (and a skip reason) if impossible."""
        if not (pairs := [pair for qa in qa_lists if qa for pair in qa]):
            self.report.skip(plan.task, "no_qa" if all(qa is not None for qa in qa_lists) else "generation_failed")
            return None
        messages = self._messages(plan.context_text, pairs)
        tokens = self.counter.conversation(messages)
        while tokens > self.length.max_tokens and len(pairs) > 1:
            pairs = pairs[:-1]
            messages = self._messages(plan.context_text, pairs)
            tokens = self.counter.conversation(messages)
        if not self.length.min_tokens <= tokens <= self.length.max_tokens:
            self.report.skip(plan.task, "too_long" if tokens > self.length.max_tokens else "too_short")
            return None
        meta = {**plan.meta, "context_chars": len(plan.context_text), "evidence": [pair.evidence for pair in pairs]}
        meta["failed_jobs"] = sum(qa is None for qa in qa_lists)
        return {
            "task": plan.task,
            "messages": messages,
            "num_tokens": tokens,
            "sources": [p.doc.doc_id for p in plan.passages],
            "meta": json.dumps(meta),
        }

    def _messages(self, context: str, pairs: Sequence[QAPair]) -> list[dict[str, str]]:
        first = self.context_template.format(context=context.strip(), question=pairs[0].question)
        return [turn for i, p in enumerate(pairs) for turn in exchange(p.question if i else first, p.answer)]


def whole_contexts(count: str) -> Callable[..., list[ContextPlan]]:
    """A task's planner (:attr:`.registry.SynthTask.plan`): one context per long document, and one job about all
    of it asking for ``settings.<count>`` items (``"questions"``: multi-detail QA, ``"characters"``: biographies)."""

    def plan(
        builder: LongContextBuilder, name: str, settings: Any, documents: Sequence[Document] | None
    ) -> list[ContextPlan]:
        return [
            ContextPlan(
                name, [context], [QAJob(name, [context], getattr(settings, count), rng.randrange(2**31))], context.text
            )
            for _, context, _, rng in builder.long_contexts(name, documents, settings.contexts)
        ]

    return plan


def cluster_documents(documents: Sequence[Document], n_clusters: int, seed: int = 0) -> list[list[int]]:
    """The member indices of each non-empty cluster of documents: TF-IDF vectors clustered with k-means."""
    from sklearn.cluster import KMeans
    from sklearn.feature_extraction.text import TfidfVectorizer

    vectors = TfidfVectorizer(stop_words="english", sublinear_tf=True, max_features=50000).fit_transform(
        [d.text for d in documents]
    )
    labels = KMeans(n_clusters=n_clusters, n_init=4, random_state=seed).fit_predict(vectors)
    clusters = [[i for i, label in enumerate(labels) if label == c] for c in range(n_clusters)]
    return [c for c in clusters if c]


def procedural_long_documents(
    counter: TokenCounter, task: str, count: int, length: LengthConfig, seed: int, progress: bool = False
) -> list[Document]:
    """``count`` procedural documents long enough for any context length of ``length``, of the kind ``task`` asks
    for (its record's ``documents``: the biographies' are chronicles with several main characters)."""
    options, rng = get_task(task).documents, random.Random(f"{seed}/{task}/documents")
    return [
        procedural_document(
            counter, length.max_tokens + 64, seed=rng.randrange(2**31), doc_id=f"{task}-doc-{i}", **options
        )
        for i in tqdm(range(count), desc=f"{task} documents", unit="doc", disable=not progress)
    ]


def procedural_cluster_pool(
    counter: TokenCounter,
    contexts: int,
    docs_per_context: int,
    length: LengthConfig,
    seed: int,
    progress: bool = False,
) -> list[Document]:
    """Shorter procedural documents on a few topics, enough to pack ``contexts`` heterogeneous contexts."""
    rng = random.Random(f"{seed}/heterogeneous/documents")
    budget_min, budget_max = length.context_budget()
    # aim the sum of docs_per_context documents (each up to 5% over its minimum) at the budget's middle
    doc_tokens = max(64, int((budget_min + budget_max) / 2 / docs_per_context / 1.025))
    topics, pool = sorted(TOPICS), []
    for c in tqdm(range(contexts), desc="heterogeneous documents", unit="context", disable=not progress):
        for d in range(docs_per_context + 1):
            options = {"topic": topics[c % len(topics)], "doc_id": f"heterogeneous-doc-{c}-{d}", "n_characters": 1}
            pool.append(procedural_document(counter, doc_tokens, seed=rng.randrange(2**31), **options))
    return pool


def task_counts(rows: Sequence[dict[str, Any]]) -> dict[str, int]:
    """Conversations per task, in the registry's order first."""
    counts = Counter(row["task"] for row in rows)
    ordered = {task: counts[task] for task in TASKS if task in counts}
    ordered.update({task: n for task, n in counts.items() if task not in ordered})
    return ordered
