"""Question-answer generation for the registered synth tasks (:mod:`.registry`): :class:`LLMAnswerer` asks an
OpenAI-compatible model with each task's prompt, schema and parser and judges the items by the quality gates;
:class:`ProceduralAnswerer` answers the same jobs exactly from the facts of procedural documents, with no LLM."""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence

from ..errors import DataError
from .answer_schema import Checked, RejectedOutput
from .llm_client import LLMClient
from .llm_request import LLMRequest, LLMResult
from .quality import QualityGates, Verdict
from .registry import Passage as Passage  # the job types are importable from here, beside their answerers
from .registry import QAJob, QAPair, get_task

SYSTEM_PROMPT = (
    "You write high-quality training data for long-context reading comprehension. You reply with JSON only."
)


class ProceduralAnswerer:
    """Exact QA from the ground truth of procedural documents (see :mod:`.corpus`): each task's ``answer``."""

    def generate(self, jobs: Sequence[QAJob]) -> list[list[QAPair] | None]:
        return [self.answer(job) for job in jobs]

    def answer(self, job: QAJob) -> list[QAPair]:
        for passage in job.passages:
            if not passage.doc.facts:
                raise DataError(
                    f"document {passage.doc.doc_id!r} has no recorded facts: the procedural answerer only works "
                    "on procedural documents; use the LLM answerer for text files"
                )
        return get_task(job.task).answer(job, random.Random(job.seed))


def job_prompt(job: QAJob, text: str | None = None) -> str:
    """The user prompt of one job: its task's prompt over the job's passages (over ``text`` when given)."""
    task = get_task(job.task)
    return task.prompt.format(text=task.layout(job.passages) if text is None else text, n=job.n, k=len(job.passages))


def job_request(job: QAJob, index: int = 0) -> LLMRequest:
    """The chat request :class:`LLMAnswerer` sends for ``job`` (the ``index``-th of its batch, for the rejects
    file); its schema, its task's, holds at most ``job.n`` items."""
    return LLMRequest(
        task=job.task,
        messages=[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": job_prompt(job)}],
        schema=get_task(job.task).schema.bounded(job.n),
        meta={
            "job": index,
            "sources": [p.doc.doc_id for p in job.passages],
            "spans": [[p.start, p.end] for p in job.passages],
        },
    )


def job_evidence(job: QAJob) -> str:
    """The text a job's answers must be grounded in: its task's ``evidence`` (a chunk, a document, documents)."""
    return get_task(job.task).evidence(job.passages)


def job_instructions(job: QAJob) -> str:
    """The prompt of ``job`` without its text: what an answer must not copy."""
    return SYSTEM_PROMPT + "\n" + job_prompt(job, text="")


class LLMAnswerer:
    """Generates QA for every job with one concurrent, cached batch per task through :class:`LLMClient`. The quality
    ``gates`` drop items (to the rejects file); an answer whose items all fail is asked again, like malformed output.
    Of the items kept, the first ``job.n`` are used; questions repeating one of the same context are dropped too."""

    def __init__(self, client: LLMClient, gates: QualityGates | None = None):
        self.client = client
        self.gates = gates if gates is not None else QualityGates()

    def generate(self, jobs: Sequence[QAJob]) -> list[list[QAPair] | None]:
        results: list[list[QAPair] | None] = [None] * len(jobs)
        answered: dict[int, LLMResult] = {}
        by_task: dict[str, list[int]] = {}  # one batch per task, in the order the jobs come
        for i, job in enumerate(jobs):
            by_task.setdefault(job.task, []).append(i)
        check = functools.partial(self._check, jobs)
        for name, indices in by_task.items():
            batch = [job_request(jobs[i], i) for i in indices]
            for i, result in zip(indices, self.client.run(batch, get_task(name).parse, f"{name} (LLM)", check)):
                answered[i] = result
                results[i] = result.value if result.ok else None
        self._drop_repeats_across_jobs(jobs, results, answered)
        return results

    def _check(self, jobs: Sequence[QAJob], request: LLMRequest, pairs: list[QAPair]) -> Checked:
        """The items of an answer to ``request`` (a request of ``jobs``) the quality gates keep, and those dropped."""
        job = jobs[request.meta["job"]]
        subject = get_task(job.task).subject
        subjects = [subject(p.question) for p in pairs] if subject is not None else None
        verdict = self.gates.check(job.task, pairs, job_evidence(job), job_instructions(job), subjects)
        dropped = rejected_items(verdict)
        if not verdict.kept:
            reasons = ", ".join(sorted({r.reason for _, r in verdict.rejected}))
            raise RejectedOutput(f"every item failed the quality gates ({reasons})", dropped)
        self.gates.unused[job.task] += max(0, len(verdict.kept) - job.n)  # passed, beyond what the job asked
        return Checked(verdict.kept[: job.n], dropped)

    def _drop_repeats_across_jobs(
        self, jobs: Sequence[QAJob], results: list[list[QAPair] | None], answered: dict[int, LLMResult]
    ) -> None:
        """Near-duplicate questions across the jobs of one context: a task's jobs about one document (which gives one
        context per task: the single-detail chunks). What is dropped goes to the rejects file with its request."""
        kept: dict[tuple[str, str], list[str]] = {}
        for i, job in enumerate(jobs):
            if not results[i]:
                continue
            earlier = kept.setdefault((job.task, job.passages[0].doc.doc_id), [])
            verdict = self.gates.check_repeats(job.task, results[i], earlier)
            result = answered[i]
            self.client.drop_items(result.request, "repeats", result.attempts - 1, rejected_items(verdict))
            results[i] = verdict.kept
            earlier.extend(p.question for p in verdict.kept)


def rejected_items(verdict: Verdict) -> list[dict[str, str]]:
    """The rejects-file fields of each QA pair (or biography turn) the quality gates dropped."""
    return [
        {"reason": rejection.reason, "detail": rejection.detail, "question": pair.question, "answer": pair.answer}
        for pair, rejection in verdict.rejected
    ]
