"""The built-in synth tasks, one :func:`~.registry.register` line each: the data recipe of "Extending Llama-3's
Context Ten-Fold Overnight". ``single_detail`` asks about chunks (<= ``length.chunk_tokens``) of a long context,
``multi_detail`` aggregates several places of one long document, ``biography`` writes one per main character of a
book, and ``heterogeneous`` compares the texts of one cluster (TF-IDF + k-means) packed into one context."""

from __future__ import annotations

import re
from collections.abc import Sequence

from pydantic import Field

from . import procedural_qa
from .answer_schema import BIOGRAPHIES
from .builders import (
    ContextPlan,
    LongContextBuilder,
    cluster_documents,
    procedural_cluster_pool,
    sentence_end_after,
    sentence_end_before,
    whole_contexts,
)
from .corpus import Document
from .registry import Flag, Passage, QAJob, QAPair, SynthTask, TaskConfig, numbered_documents, register, titled_text


class SingleDetailConfig(TaskConfig):
    contexts: int = Field(4, ge=0, description="conversations to build")
    chunks_per_context: int = Field(2, ge=1, description="chunks (<= length.chunk_tokens) asked about per context")
    questions_per_chunk: int = Field(3, ge=1)


class MultiDetailConfig(TaskConfig):
    questions: int = Field(5, ge=1)


class HeterogeneousConfig(TaskConfig):
    questions: int = Field(5, ge=1)
    docs_per_context: int = Field(4, ge=2, description="procedural source: documents packed per context")
    n_clusters: int | None = Field(
        None,
        ge=1,
        description="k-means clusters (default: the generated topics, or ~1.25 contexts' worth of your files each)",
    )


class BiographyConfig(TaskConfig):
    characters: int = Field(3, ge=1, description="biographies (main characters) per book")


# Doubled braces: the prompts go through str.format.
QA_FORMAT = 'Reply with JSON only, in this form: {{"qa_pairs": [{{"question": "...", "answer": "..."}}]}}'

QA_RULES = (
    "Every question must be self-contained: name the people, places or things it asks about, and never "
    "refer to 'the excerpt', 'the passage' or 'the author'. Every answer must be correct according to the "
    "text, complete and concise."
)

SINGLE_DETAIL_PROMPT = (
    "Below is an excerpt of a longer document.\n\n<excerpt>\n{text}\n</excerpt>\n\n"
    "Write {n} question-answer pairs, each about one specific detail stated in this excerpt. "
    f"{QA_RULES}\n{QA_FORMAT}"
)
MULTI_DETAIL_PROMPT = (
    "Below is a long document.\n\n<document>\n{text}\n</document>\n\n"
    "Write {n} question-answer pairs that each need information from several different parts of the "
    "document: counting or listing things mentioned in different places, comparing, ordering events, "
    f"or following how something develops. {QA_RULES}\n{QA_FORMAT}"
)
HETEROGENEOUS_PROMPT = (
    "Below are {k} related but independent documents.\n\n{text}\n\n"
    "Write {n} question-answer pairs about the similarities and differences between these documents. "
    "Refer to documents by number (for example 'Document 2'). "
    f"{QA_RULES}\n{QA_FORMAT}"
)
BIOGRAPHY_PROMPT = (
    "Below is a book.\n\n<book>\n{text}\n</book>\n\n"
    "Identify the {n} main characters of the book and write a biography of each: who they are, where "
    "they come from, what they do, their relationships and what happens to them, using only the book. "
    'Reply with JSON only, in this form: {{"biographies": [{{"name": "...", "biography": "..."}}]}}'
)


def tagged_documents(passages: Sequence[Passage]) -> str:
    """The documents of a heterogeneous job as its prompt shows them: each between numbered tags."""
    return "\n\n".join(f"<document {i + 1}>\n{titled_text(p)}\n</document {i + 1}>" for i, p in enumerate(passages))


def parse_biographies(text: str) -> list[QAPair]:
    """``{"biographies": [{"name", "biography"}]}`` (:data:`.answer_schema.BIOGRAPHIES`) -> one "write a
    biography" turn per character."""
    return [
        QAPair(f"Write a short biography of {item['name'].strip()}.", item["biography"].strip())
        for item in BIOGRAPHIES.parse(text)
    ]


_BIOGRAPHY_TURN = re.compile(r"Write a short biography of (.+)\.\s*$", re.DOTALL)


def biography_subject(question: str) -> str:
    """The name in a "Write a short biography of NAME." turn (the whole question if it is not one)."""
    match = _BIOGRAPHY_TURN.match(question.strip())
    return match.group(1).strip() if match else question


def plan_single_detail(
    builder: LongContextBuilder, name: str, settings: SingleDetailConfig, documents: Sequence[Document] | None
) -> list[ContextPlan]:
    """QA about ``chunks_per_context`` chunks (<= ``length.chunk_tokens``) spread over each context, one job each."""
    plans = []
    for document, context, offsets, rng in builder.long_contexts(name, documents, settings.contexts):
        region = len(offsets) // settings.chunks_per_context
        if region < 1:
            builder.report.skip(name, "context_shorter_than_chunk_count")
            continue
        jobs, spans = [], []
        for c in range(settings.chunks_per_context):
            width = min(builder.length.chunk_tokens, region)
            first = c * region + rng.randint(0, region - width)
            start, end = offsets[first][0], offsets[first + width - 1][1]
            if first > 0:  # start after a sentence end, end on one: chunks hold whole sentences
                snapped = sentence_end_after(document.text, start)
                start = snapped if snapped < end else start
            end = sentence_end_before(document.text, end, start)
            while start < end and document.text[start].isspace():
                start += 1
            spans.append([start, end])
            passage = Passage(document, start, end)
            jobs.append(QAJob(name, [passage], settings.questions_per_chunk, seed=rng.randrange(2**31)))
        plans.append(ContextPlan(name, [context], jobs, context.text, {"chunks": spans}))
    return plans


def plan_heterogeneous(
    builder: LongContextBuilder, name: str, settings: HeterogeneousConfig, documents: Sequence[Document] | None
) -> list[ContextPlan]:
    """Cluster the documents (TF-IDF + k-means) and pack texts of one cluster into each context; the clusters
    default to the topics of a generated pool (one per context), or to about 1.25 contexts' worth of your files."""
    contexts, n_clusters = settings.contexts, settings.n_clusters
    if documents is None:
        documents = procedural_cluster_pool(
            builder.counter, contexts, settings.docs_per_context, builder.length, builder.seed, builder.show_progress
        )
        n_clusters = n_clusters or len({d.topic for d in documents})
    rng = builder.rng(name)
    budget_min, budget_max = builder.length.context_budget()
    sizes = [builder.counter.count(d.text) for d in documents]
    usable = [i for i, n in enumerate(sizes) if n <= budget_max // 2]
    if len(documents) - len(usable):
        builder.report.skip(name, "document_too_long_to_pair", len(documents) - len(usable))
    if len(usable) < 2:
        builder.report.skip(name, "too_few_documents", contexts)
        return []
    if n_clusters is None:  # default: clusters of about 1.25 contexts' worth of documents
        median = sorted(sizes[i] for i in usable)[len(usable) // 2]
        per_context = max(2.0, (budget_min + budget_max) / 2 / max(median, 1))
        n_clusters = max(1, round(len(usable) / (1.25 * per_context)))
    clusters = cluster_documents([documents[i] for i in usable], min(n_clusters, len(usable)), seed=builder.seed)
    plans: list[ContextPlan] = []
    queues = [[usable[i] for i in cluster] for cluster in clusters]
    for queue in queues:
        rng.shuffle(queue)
    packed_any = True
    while len(plans) < contexts and packed_any:
        packed_any = False
        for queue in queues:
            if len(plans) == contexts:
                break
            picked = _pack(queue, sizes, rng.randint(budget_min, budget_max), budget_min, budget_max)
            if picked is None:
                continue
            packed_any = True
            passages = [Passage(documents[i], 0, len(documents[i].text)) for i in picked]
            job = QAJob(name, passages, settings.questions, rng.randrange(2**31))
            plans.append(ContextPlan(name, passages, [job], numbered_documents(passages)))
    if len(plans) < contexts:
        builder.report.skip(name, "clusters_exhausted", contexts - len(plans))
    return plans


def _pack(queue: list[int], sizes: Sequence[int], target: int, low: int, high: int) -> list[int] | None:
    """Take documents from ``queue`` towards ``target`` tokens, never passing ``high``: the picked indices (then
    removed from ``queue``) when they are at least two and reach ``low`` tokens, else None."""
    picked, total = [], 0
    for index in queue:
        if total >= target:
            break
        if total + sizes[index] <= high:
            picked.append(index)
            total += sizes[index]
    if total < low or len(picked) < 2:
        return None
    for index in picked:
        queue.remove(index)
    return picked


# ---- the records: SynthTask(name, config, planner, prompt, exact answers, ...) --------------------------------

QUESTIONS_PER_CHUNK = Flag(
    "--questions-per-chunk", "single-detail questions per chunk (default 3)", "questions_per_chunk", {"type": int}
)
register(
    SynthTask(
        "single_detail",
        SingleDetailConfig,
        plan_single_detail,
        SINGLE_DETAIL_PROMPT,
        procedural_qa.single_detail,
        flags=(QUESTIONS_PER_CHUNK,),
    )
)
register(
    SynthTask(
        "multi_detail",
        MultiDetailConfig,
        whole_contexts("questions"),
        MULTI_DETAIL_PROMPT,
        procedural_qa.multi_detail,
        computed_numbers=True,
    )
)
register(
    SynthTask(
        "biography",
        BiographyConfig,
        whole_contexts("characters"),
        BIOGRAPHY_PROMPT,
        procedural_qa.biography,
        schema=BIOGRAPHIES,
        parse=parse_biographies,
        subject=biography_subject,
        documents={"kind": "story", "n_characters": 5},  # chronicles with several main characters
    )
)
register(
    SynthTask(
        "heterogeneous",
        HeterogeneousConfig,
        plan_heterogeneous,
        HETEROGENEOUS_PROMPT,
        procedural_qa.heterogeneous,
        layout=tagged_documents,
        evidence=numbered_documents,
        computed_numbers=True,
    )
)
