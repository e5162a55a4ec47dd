"""``longpeft synth --plan``: the LLM requests a data build will send, their tokens and time, before any call.

The plan reads and checks the inputs and plans the contexts as the run does (:mod:`.pipeline`), builds every request
as :class:`~.qa.LLMAnswerer` would, and counts instead of sending: first attempts only (one per QA job; those the
cache already answers apart), input tokens as the endpoint counts them (:mod:`.endpoint`), output tokens at
``llm.max_tokens`` (an upper bound) or ``--output-tokens``, and the time as the slowest of three limits: the requests
in flight decoding at ``--output-tokens-per-second``, and the endpoint's tokens and requests per minute when given.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from ..errors import ConfigError
from ..units import format_duration

OUTPUT_TOKENS_PER_SECOND = 50.0  # one request's decoding speed when --output-tokens-per-second is not given


@dataclass
class TaskRequests:
    """One task's first-attempt requests: how many, their input tokens, and how many the cache answers already."""

    requests: int = 0
    input_tokens: int = 0
    cached: int = 0
    cached_input_tokens: int = 0


@dataclass
class BuildPlan:
    """What a build will ask of the LLM (see the module docstring)."""

    tasks: dict[str, TaskRequests]
    conversations: int  # contexts planned: at most one conversation each
    output_tokens_per_request: int
    output_tokens_from: str  # where output_tokens_per_request comes from
    counted_with: str  # what counted the input tokens (PromptCounter.how)
    model: str
    concurrency: int
    max_parse_attempts: int
    skipped: dict[str, dict[str, int]] = field(default_factory=dict)  # contexts the planning already skipped

    @property
    def requests(self) -> int:
        return sum(task.requests for task in self.tasks.values())

    @property
    def to_send(self) -> int:
        """Requests the cache does not answer."""
        return sum(task.requests - task.cached for task in self.tasks.values())

    @property
    def input_tokens(self) -> int:
        return sum(task.input_tokens for task in self.tasks.values())

    def time_limits(
        self,
        output_tokens_per_second: float = OUTPUT_TOKENS_PER_SECOND,
        tokens_per_minute: float | None = None,
        requests_per_minute: float | None = None,
    ) -> dict[str, float]:
        """Seconds each limit allows the uncached requests to take, by limit: ``concurrency`` (always),
        ``tokens per minute`` and ``requests per minute`` (when given). The build takes about the largest."""
        unsent_input = sum(task.input_tokens - task.cached_input_tokens for task in self.tasks.values())
        tokens = unsent_input + self.to_send * self.output_tokens_per_request
        waves = math.ceil(self.to_send / self.concurrency)  # the requests in flight together take as long as one
        limits = {"concurrency": waves * self.output_tokens_per_request / output_tokens_per_second}
        if tokens_per_minute:
            limits["tokens per minute"] = 60 * tokens / tokens_per_minute
        if requests_per_minute:
            limits["requests per minute"] = 60 * self.to_send / requests_per_minute
        return limits

    def report(
        self,
        output_tokens_per_second: float = OUTPUT_TOKENS_PER_SECOND,
        tokens_per_minute: float | None = None,
        requests_per_minute: float | None = None,
    ) -> str:
        """The plan as text: requests and tokens per task, then the time under each limit and the estimate."""
        out = self.output_tokens_per_request

        def row(name: str, requests: int, input_tokens: int, cached: int) -> str:
            return f"{name:<15} {requests:>9,} {input_tokens:>14,} {requests * out:>14,} {cached:>9,}"

        lines = [
            f"longpeft synth --plan: {self.conversations:,} contexts planned, {self.requests:,} requests to "
            f"{self.model}; no completion was requested",
            f"{'task':<15} {'requests':>9} {'input tokens':>14} {'output tokens':>14} {'in cache':>9}",
            *(row(name, task.requests, task.input_tokens, task.cached) for name, task in self.tasks.items()),
            row("total", self.requests, self.input_tokens, self.requests - self.to_send),
            f"input tokens: {self.counted_with}; output tokens: {out:,} per request ({self.output_tokens_from}); "
            f"first attempts only (a malformed answer is asked again, up to {self.max_parse_attempts} "
            "attempts, and failed calls are retried: not counted)",
        ]
        for task, reasons in self.skipped.items():
            lines.append(
                f"skipped while planning ({task}): " + ", ".join(f"{n} {reason}" for reason, n in reasons.items())
            )
        limits = self.time_limits(output_tokens_per_second, tokens_per_minute, requests_per_minute)
        assumed = (
            " (assumed; --output-tokens-per-second)" if output_tokens_per_second == OUTPUT_TOKENS_PER_SECOND else ""
        )
        given = {  # of the limits given
            "concurrency": f"{self.concurrency} requests in flight, each decoding {output_tokens_per_second:g} "
            f"output tokens/s{assumed}",
            "tokens per minute": f"{tokens_per_minute or 0:,.0f} tokens/min (input and output)",
            "requests per minute": f"{requests_per_minute or 0:,.0f} requests/min",
        }
        slowest = max(limits, key=limits.get)
        for limit, seconds in limits.items():
            mark = "   <- the limit" if limit == slowest else ""
            lines.append(f"time at {given[limit]}: {format_duration(seconds)}{mark}")
        if len(limits) == 1:
            lines.append(
                "no rate limit given: --tokens-per-minute and --requests-per-minute (your endpoint's "
                "limits) bound the time too"
            )
        lines.append(
            f"estimate: {format_duration(limits[slowest])} for the {self.to_send:,} requests not in the cache"
        )
        return "\n".join(lines)


def plan_build(
    config, out_dir: str | Path, tokenizer: PreTrainedTokenizerBase | None = None, output_tokens: int | None = None
) -> BuildPlan:
    """Plan the build of ``config`` (a SynthConfig with ``answerer: llm``) into ``out_dir``, requesting no
    completion and writing nothing; a procedural answerer, or no bound on the output tokens, raises ConfigError.
    ``tokenizer`` (default: ``config.tokenizer``) lays out the contexts, never counts the prompts; ``output_tokens``
    are the completion tokens expected per request (default ``config.llm.max_tokens``, an upper bound)."""
    from .endpoint import prompt_counter
    from .llm_cache import ResponseCache, request_key
    from .llm_request import sampling_params, structured_params
    from .pipeline import CACHE_DIR, load_tokenizer, plan_contexts, read_inputs
    from .qa import ProceduralAnswerer, job_request

    if config.answerer != "llm":
        raise ConfigError(
            "longpeft synth --plan: this config's answerer is procedural, which calls no LLM (exact QA "
            "offline); set answerer: llm (--answerer llm) to plan an LLM build"
        )
    if output_tokens is None and config.llm.max_tokens is None:
        raise ConfigError(
            "longpeft synth --plan: llm.max_tokens is not set, so a request's output is unbounded; give "
            "--output-tokens N (the completion tokens you expect per request)"
        )
    files = read_inputs(config).documents  # every input file checked as the run checks it
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.tokenizer)
    builder, plans = plan_contexts(config, tokenizer, ProceduralAnswerer(), files)  # planning only: never asked
    cache = ResponseCache(Path(out_dir) / CACHE_DIR)
    llm, sampling = config.llm, sampling_params(config.llm)
    counter = prompt_counter(llm, os.environ.get(llm.api_key_env))
    tasks: dict[str, TaskRequests] = {}
    jobs = [job for plan in plans for job in plan.jobs]
    first_how = counted_with = counter.how
    for index, job in enumerate(tqdm(jobs, desc="counting prompt tokens", unit="req", disable=not config.progress)):
        request = job_request(job, index)
        task = tasks.setdefault(job.task, TaskRequests())
        tokens, how = counter.count(request.messages)
        if how != first_how and counted_with == first_how:  # the tokenizer failed: the estimate stands in from here
            counted_with = f"{first_how}; from prompt {index + 1} on {how}"
        task.requests += 1
        task.input_tokens += tokens
        variants = ((False, True), (False, False), (True, True))  # the schema with bounds, without, none (auto)
        sent = ({**sampling, **structured_params(llm, request, *variant)} for variant in variants)
        if any(cache.answer(request_key(llm.base_url, llm.model, request, params, 0)) is not None for params in sent):
            task.cached += 1
            task.cached_input_tokens += tokens
    return BuildPlan(
        tasks=tasks,
        conversations=len(plans),
        output_tokens_per_request=output_tokens if output_tokens is not None else llm.max_tokens,
        output_tokens_from="--output-tokens"
        if output_tokens is not None
        else "llm.max_tokens, an upper bound; --output-tokens N for your expectation",
        counted_with=counted_with,
        model=llm.model,
        concurrency=llm.max_concurrency,
        max_parse_attempts=llm.max_parse_attempts,
        skipped=builder.report.to_dict()["skipped"],
    )
