"""A client for any OpenAI-compatible chat-completions endpoint, built for paid batch generation (docs/synth.md).

On top of the ``openai`` package it adds: a concurrency limit; retries with backoff (:mod:`.llm_http`); a disk cache
of every answer, keyed by the endpoint and the request (:mod:`.llm_cache`), so that a killed run resumes without
paying twice; new attempts, up to ``max_parse_attempts``, for an answer that ``parse`` or ``check`` refuses or that
the server cut off; structured output with its fallbacks (``llm.structured``, :mod:`.answer_schema`); prompts longer
than the endpoint's context refused before sending (:mod:`.endpoint`); requests rejected for good marked in the cache
(a rerun skips them unless ``retry_rejected``) and listed in the rejects file (:mod:`.llm_rejects`); token accounting
per task (:class:`.llm_request.TaskUsage`). The API key is read from the environment when a run starts, and written
nowhere.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from .answer_schema import Checked, MalformedOutput, RejectedOutput, StructuredWatch, TruncatedOutput
from .endpoint import PromptCounter, prompt_counter
from .llm_cache import ResponseCache, outcome_key, request_key
from .llm_http import RetryableError, chat_completion, refuses_structured_output, server_reason
from .llm_rejects import RejectsLog
from .llm_request import (
    ITEM_BOUNDS,
    LLMConfig,
    LLMRequest,
    LLMResult,
    LLMRunAborted,
    TaskUsage,
    read_api_key,
    sampling_params,
    structured_params,
)

SHOWN_REFUSALS = 3  # HTTP 4xx refusals (and give-ups) whose reason is printed; the rest are counted
# A prompt of fewer UTF-8 bytes than the context less this allowance for its chat template is sent uncounted: a token
# covers at least one byte of text, and templates add a few tokens per message plus a preamble (Llama 3.1's date).
TEMPLATE_TOKENS_ALLOWANCE = 64
TEMPLATE_TOKENS_PER_MESSAGE = 16
Parse = Callable[[str], Any]  # the model's text -> a value, or MalformedOutput
Check = Callable[[LLMRequest, Any], Any]  # (request, value) -> the value kept (or Checked), or RejectedOutput


def _item_record(request: LLMRequest, group: str, attempt: int, item: dict[str, Any]) -> dict[str, Any]:
    """A rejects-file record of one part of an answer that a check dropped (:mod:`.llm_rejects`)."""
    return {"kind": "item", "request": group, "task": request.task, "meta": request.meta, "attempt": attempt, **item}


@dataclass
class _Round:
    """One request's attempts in a run."""

    request: LLMRequest
    usage: TaskUsage
    first_key: str  # the cache key of its attempt 0 without response_format
    mark: dict[str, Any] | None  # the outcome mark an earlier run left
    end: int  # the round ends before this attempt
    parse: Parse | None = None
    check: Check | None = None
    replayed: int = 0  # attempts before this one are read from the cache only, never sent
    key: str = ""  # the cache key of the latest attempt as sent
    api_calls: int = 0
    last_code: str = "malformed"  # the reason of the latest attempt refused
    outputs: list[dict[str, Any]] = field(default_factory=list)  # each judged attempt: attempt, reason, error, text
    dropped: list[dict[str, Any]] = field(default_factory=list)  # the item records the checks dropped
    mark_key: str = field(init=False)  # the key of its outcome mark

    def __post_init__(self) -> None:
        self.mark_key = outcome_key(self.first_key)
        self.key = self.key or self.first_key

    def drop(self, attempt: int, items: list[dict[str, Any]]) -> None:
        self.dropped += [_item_record(self.request, self.mark_key, attempt, item) for item in items]

    def record(self, code: str, reason: str, marked: bool) -> dict[str, Any]:
        """The rejects-file record of this request rejected for ``code``, with every attempt (:mod:`.llm_rejects`)."""
        return {
            "kind": "request",
            "request": self.mark_key,
            "key": self.key,
            "task": self.request.task,
            "meta": self.request.meta,
            "reason": code,
            "error": reason,
            "marked": marked,
            "attempts": self.outputs,
        }


class LLMClient:
    """Runs batches of :class:`LLMRequest` against the endpoint of ``config``, with its response cache in
    ``cache_dir`` (created on demand) and its rejects file at ``rejects_path``; ``show_progress`` draws a tqdm bar per
    batch. ``prompt_counter`` counts a prompt's tokens against the endpoint's context (default: the one
    :func:`.endpoint.prompt_counter` picks). ``retry_rejected`` asks again what an earlier run rejected."""

    def __init__(
        self,
        config: LLMConfig,
        cache_dir: str | os.PathLike[str],
        rejects_path: str | os.PathLike[str],
        show_progress: bool = True,
        prompt_counter: PromptCounter | None = None,
        retry_rejected: bool = False,
    ):
        self.config = config
        self.retry_rejected = retry_rejected
        self.cache = ResponseCache(cache_dir)
        self.rejects = RejectsLog(rejects_path)
        self.show_progress = show_progress
        self.prompt_counter = prompt_counter
        self.usage: dict[str, TaskUsage] = {}
        self.structured_refused: str | None = None  # why structured output is off: refused, or seen ignored
        self.structured_watch = StructuredWatch()  # whether the endpoint follows response_format, from its answers
        self.bounds_refused: str | None = None  # the server's reason, once it refused the schema's item bounds
        self._first_structured: asyncio.Lock | None = None  # one structured request at a time until it is known
        self._openai: Any = None  # this run's openai.AsyncOpenAI
        self._in_flight: asyncio.Semaphore | None = None  # this run's requests in flight
        self.refusals = 0  # requests refused with HTTP 4xx (their reasons: the first SHOWN_REFUSALS on the console)
        self.gave_up = 0  # requests given up after transient failures (the first SHOWN_REFUSALS said with the cause)
        self._stop: str | None = None  # why the run stops (structured output refused or ignored): no more sends
        self.endpoint: Any = None  # an .endpoint.EndpointInfo, asked once at the first run (context_tokens unset)

    def run(
        self,
        requests: Sequence[LLMRequest],
        parse: Parse | None = None,
        desc: str = "LLM requests",
        check: Check | None = None,
    ) -> list[LLMResult]:
        """Send every request (concurrently, cached, retried); results come back in request order. ``parse(text)``
        turns the model's text into a value (default: the text) or raises :class:`MalformedOutput`; ``check(request,
        value)`` then returns the value to keep (or a :class:`Checked`) or raises :class:`RejectedOutput`."""
        coroutine = self.arun(requests, parse, desc, check)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(coroutine)
        with ThreadPoolExecutor(max_workers=1) as pool:  # inside an event loop (a notebook): a private loop, a thread
            return pool.submit(asyncio.run, coroutine).result()  # its error is raised here

    async def arun(
        self,
        requests: Sequence[LLMRequest],
        parse: Parse | None = None,
        desc: str = "LLM requests",
        check: Check | None = None,
    ) -> list[LLMResult]:
        """Async form of :meth:`run`."""
        import openai

        if not requests:
            return []
        api_key = read_api_key(self.config)
        client = self._openai = openai.AsyncOpenAI(
            api_key=api_key, base_url=self.config.base_url, max_retries=0, timeout=self.config.timeout
        )
        self._in_flight = asyncio.Semaphore(self.config.max_concurrency)
        if self.endpoint is None and self.config.context_tokens is None:
            await self._ask_endpoint(api_key)
        if self.prompt_counter is None and self.context_limit() is not None:
            self.prompt_counter = await asyncio.to_thread(prompt_counter, self.config, api_key)
            self._say(f"{self.config.base_url}: prompt tokens are {self.prompt_counter.how}")
        del api_key
        gave_up_before = self._gave_up_causes()
        self._first_structured = asyncio.Lock()  # bound to this run's event loop
        bar = tqdm(total=len(requests), desc=desc, unit="req", disable=not self.show_progress)

        async def one(request: LLMRequest) -> LLMResult:
            result = await self._complete(request, parse, check)
            bar.update(1)
            usages = self.usage.values()
            tokens = sum(u.prompt_tokens + u.completion_tokens for u in usages)
            calls, hits = sum(u.api_calls for u in usages), sum(u.cache_hits for u in usages)
            bar.set_postfix({"calls": calls, "cached": hits, "tokens": tokens}, refresh=False)
            return result

        tasks = [asyncio.ensure_future(one(request)) for request in requests]
        try:
            results = list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        finally:
            bar.close()
            await client.close()
            self.rejects.flush()
        self._say_gave_up(desc, gave_up_before)
        return results

    def usage_report(self) -> dict[str, Any]:
        """Per-task token accounting plus totals, as a JSON-ready dict."""
        tasks = {name: vars(usage).copy() for name, usage in sorted(self.usage.items())}
        total: dict[str, Any] = {}
        for usage in tasks.values():
            for key, value in usage.items():
                if isinstance(value, dict):  # counts by reason or cause: summed per reason or cause
                    total[key] = dict(Counter(total.get(key)) + Counter(value))
                else:
                    total[key] = total.get(key, 0) + value
        return {
            "model": self.config.model,
            "base_url": self.config.base_url,
            "tasks": tasks,
            "total": total,
            "foreign_cache_files": self.cache.foreign,
            "foreign_rejects_lines": self.rejects.foreign,
        }

    def request_id(self, request: LLMRequest) -> str:
        """The request's identity across runs and structured-output modes: the key of its outcome mark, which is also
        its group in the rejects file."""
        return outcome_key(
            request_key(self.config.base_url, self.config.model, request, sampling_params(self.config), 0)
        )

    def drop_items(self, request: LLMRequest, step: str, attempt: int, dropped: list[dict[str, Any]]) -> None:
        """Record in the rejects file the items a caller dropped from the answer of ``request`` (its ``attempt``) in a
        later ``step`` of its own; the list replaces what that step dropped from this request before."""
        group = f"{self.request_id(request)}/{step}"
        self.rejects.replace(group, [_item_record(request, group, attempt, item) for item in dropped])

    def context_limit(self) -> tuple[int, str] | None:
        """``(tokens, where from)`` of the endpoint's context, or ``None`` when neither set nor reported."""
        if self.config.context_tokens is not None:
            return self.config.context_tokens, "llm.context_tokens"
        if self.endpoint is not None and self.endpoint.context_tokens is not None:
            return self.endpoint.context_tokens, f"reported by the endpoint's {self.endpoint.context_source}"
        return None

    def _say(self, line: str) -> None:
        tqdm.write(line, file=sys.stderr)

    async def _ask_endpoint(self, api_key: str) -> None:
        """Learn the endpoint's context and slots (:mod:`.endpoint`), and say what matters of it."""
        from .endpoint import discover

        config = self.config
        info = self.endpoint = await asyncio.to_thread(
            discover, config.base_url, config.model, api_key, config.lookup_timeout
        )
        if info.context_tokens is not None:
            self._say(
                f"{config.base_url}: context of {info.context_tokens} tokens ({info.context_source}); "
                "longer prompts are refused before sending"
            )
        if info.slots is not None and info.slots < config.max_concurrency:
            self._say(
                f"{config.base_url}: the server decodes {info.slots} request(s) at once (/props total_slots) and "
                f"llm.max_concurrency is {config.max_concurrency}: the others wait in its queue, inside llm.timeout "
                f"({config.timeout:g} s); set llm.max_concurrency {info.slots} or raise llm.timeout"
            )

    def _structured_refusal(self, error: Any, request: LLMRequest, response_format: dict[str, Any]) -> None:
        """The endpoint refused ``response_format``: when it held the schema's item bounds, ask without them from now
        on (said once); else fall back as :meth:`_structured_off` says."""
        reason, base = server_reason(error), self.config.base_url
        refused = f"HTTP {error.status_code}: {reason}"
        unbounded = structured_params(self.config, request, bounds=False).get("response_format")
        if self.bounds_refused is None and response_format != unbounded:
            self.bounds_refused = reason
            self._say(
                f"{base} refused the schema with its item bounds ({refused}); sending the schema without "
                f"{'/'.join(ITEM_BOUNDS)} for the rest of the run"
            )
            return
        stop = f"{base} refused structured output (llm.structured={self.config.structured}; {refused});"
        self._structured_off(f"{base} refused structured output ({refused})", stop, reason)

    def _observe(self, sent: dict[str, Any], entry: dict[str, Any]) -> None:
        """Judge an answer to a request carrying ``response_format`` (:class:`.answer_schema.StructuredWatch`);
        an endpoint seen to ignore the field is answered as one that refused it."""
        if "response_format" not in sent:
            return
        watch, response_format = self.structured_watch, sent["response_format"]
        if watch.observe(response_format, entry["text"], entry.get("finish_reason")) == "ignored":
            seen = (
                f"{self.config.base_url} ignores response_format ({response_format.get('type', 'response_format')} "
                f"sent, HTTP 200: {watch.evidence()})"
            )
            stop = f"{seen}; llm.structured={self.config.structured} needs a server that enforces it:"
            self._structured_off(seen, stop, f"ignored: {watch.evidence()}")

    def _structured_off(self, seen: str, stop: str, why: str) -> None:
        """Structured output refused or ignored: under ``auto``, ask with the prompt-only JSON contract for the rest
        of the run (``seen`` said once, ``why`` kept); under ``json_schema`` / ``json_object``, stop the run
        (``stop``)."""
        if self.config.structured != "auto":
            self._stop = f"{stop} set llm.structured to auto (falls back to the prompt) or off"
            raise LLMRunAborted(self._stop)
        if self.structured_refused is None:
            self.structured_refused = why
            self._say(
                f"{seen}; llm.structured=auto: asking with the prompt's JSON contract only for the rest of the run"
            )

    def _gave_up_causes(self) -> Counter[str]:
        return sum((Counter(usage.gave_up_causes) for usage in self.usage.values()), Counter())

    def _say_gave_up(self, desc: str, before: Counter[str]) -> None:
        """One line for the requests of a batch given up after transient failures, counted by cause."""
        if new := self._gave_up_causes() - before:
            causes = ", ".join(f"{cause}: {count}" for cause, count in sorted(new.items(), key=lambda kv: -kv[1]))
            self._say(
                f"{self.config.base_url}: gave up on {sum(new.values())} {desc} request(s) after "
                f"{self.config.max_retries} retries ({causes}); not marked rejected: a plain rerun asks them again"
            )

    def _say_first(self, count: int, line: str, further: str) -> None:
        """Say ``line``, the ``count``-th of its kind, when it is one of the first :data:`SHOWN_REFUSALS` (the last
        of them adds ``further``)."""
        if count <= SHOWN_REFUSALS:
            self._say(line + (f"; {further}" if count == SHOWN_REFUSALS else ""))

    async def _complete(self, request: LLMRequest, parse: Parse | None, check: Check | None) -> LLMResult:
        import openai

        run, base = self._round(request, parse, check), self.config.base_url
        if run.mark is not None and run.mark["outcome"] == "rejected" and not self.retry_rejected:
            run.usage.skipped_rejected += 1  # rejected in an earlier run, not asked again: kept in the rejects file
            self.rejects.keep(run.mark_key, run.record(run.mark["reason"], run.mark["error"], True))
            why = f"rejected in an earlier run ({run.mark['reason']}: {run.mark['error']})"
            return LLMResult(request, False, error=f"{why}; not asked again (--retry-rejected asks again)")
        if (too_long := await self._too_long(request)) is not None:  # no attempt of this round was made
            return self._reject(run, too_long, "prompt_too_long", 0, end=run.end - self.config.max_parse_attempts)
        for attempt in range(run.end):
            try:
                entry = await self._fetch(run, attempt)
            except RetryableError as error:  # counted by cause; the first few said with the cause
                run.usage.gave_up_causes[error.cause] = run.usage.gave_up_causes.get(error.cause, 0) + 1
                self.gave_up += 1
                retries = f"after {self.config.max_retries} retries"
                line = f"{base}: gave up on a {request.task} request {retries} ({error})"
                self._say_first(self.gave_up, line, "further give-ups are counted at the end of the batch")
                reason = f"{base}: gave up {retries}: {error}"
                run.outputs.append({"attempt": attempt, "reason": "gave_up", "error": reason})
                return self._reject(run, reason, "gave_up", attempt + 1)
            except openai.APIStatusError as error:  # a request the server refuses (400, 422, ...)
                self.refusals += 1
                refusal = f"HTTP {error.status_code}: {server_reason(error)}"
                line = f"{base} refused a {request.task} request ({refusal})"
                self._say_first(self.refusals, line, "further refusals are counted in the summary")
                reason = f"{type(error).__name__}: {refusal}"
                run.outputs.append({"attempt": attempt, "reason": "http_refused", "error": reason})
                return self._reject(run, reason, "http_refused", attempt + 1, end=attempt + 1)
            if entry is None:  # an earlier round's answer no longer in the cache: not paid for again
                continue
            try:
                value = self._judge(run, attempt, entry)
            except MalformedOutput as error:
                self._failed_attempt(run, attempt, error, entry["text"])
                continue
            if run.mark is not None or run.mark_key in self.cache.foreign_keys:  # a retry round answered (or a
                self.cache.mark(run.mark_key, request.task, "answered", attempt + 1)  # foreign mark): replay to here
            self.rejects.replace(run.mark_key, run.dropped)
            return LLMResult(
                request, True, value=value, text=entry["text"], attempts=attempt + 1, api_calls=run.api_calls
            )
        tried = Counter(output["reason"] for output in run.outputs)  # the attempts judged (an uncached replay is not)
        if len(tried) == 1:
            what = {"quality": "output failing the quality gates", "truncated": "output cut off at llm.max_tokens"}
            reason = f"{what.get(run.last_code, 'malformed output')} in all {len(run.outputs)} attempts"
        else:
            counts = ", ".join(f"{code} {n}" for code, n in tried.items())
            reason = f"no usable output in {len(run.outputs)} attempts ({counts})"
        return self._reject(run, reason, run.last_code, run.end, end=run.end)

    def _round(self, request: LLMRequest, parse: Parse | None, check: Check | None) -> _Round:
        """The attempts of ``request`` in this run, from the outcome mark an earlier run left: after a rejection,
        its attempts are replayed from the cache and ``llm.max_parse_attempts`` new ones follow; after a retry round
        answered, the attempts before the answer are replays."""
        # The mark is keyed without response_format: the same whether structured output is sent or was refused.
        first_key = request_key(self.config.base_url, self.config.model, request, sampling_params(self.config), 0)
        mark = self.cache.outcome(outcome_key(first_key))
        usage = self.usage.setdefault(request.task, TaskUsage())
        run = _Round(request, usage, first_key, mark, self.config.max_parse_attempts, parse, check)
        if mark is not None and mark["outcome"] == "rejected":
            run.replayed, run.end = mark["end"], mark["end"] + self.config.max_parse_attempts
        elif mark is not None:  # answered by attempt end - 1 of a retry round
            run.replayed, run.end = mark["end"] - 1, max(run.end, mark["end"])
        return run

    async def _too_long(self, request: LLMRequest) -> str | None:
        """Why the prompt is not sent (it holds the endpoint's context or more), or None. A prompt whose UTF-8 bytes
        plus the chat template's allowance are fewer is sent uncounted: a token covers one byte of text or more."""
        limit = self.context_limit()
        if limit is None or self.prompt_counter is None:
            return None
        size = sum(len(str(message.get("content", "")).encode("utf-8")) for message in request.messages)
        if size + TEMPLATE_TOKENS_ALLOWANCE + TEMPLATE_TOKENS_PER_MESSAGE * len(request.messages) < limit[0]:
            return None
        tokens, counted = await asyncio.to_thread(self.prompt_counter.count, request.messages)
        if tokens < limit[0]:
            return None
        return (
            f"prompt_too_long: the prompt has {tokens} tokens ({counted}), the endpoint's context is "
            f"{limit[0]} ({limit[1]}); not sent"
        )

    async def _fetch(self, run: _Round, attempt: int) -> dict[str, Any] | None:
        """The answer to ``attempt``: from the cache, else sent (and cached); None for an attempt of an earlier
        round no longer in the cache. A refusal of structured output sends it again without; other failures raise
        (:class:`RetryableError` after the retries, ``openai.APIStatusError`` for a refused request)."""
        import openai

        usage = run.usage
        while True:  # a second pass only when the endpoint refused structured output (llm.structured)
            sent = {**sampling_params(self.config), **self._structured(run.request)}  # what the key holds is sent
            run.key = request_key(self.config.base_url, self.config.model, run.request, sent, attempt)
            entry = self.cache.answer(run.key)
            if entry is not None:
                usage.cache_hits += 1
                usage.cached_prompt_tokens += entry["usage"]["prompt_tokens"]
                usage.cached_completion_tokens += entry["usage"]["completion_tokens"]
                self._observe(sent, entry)  # a rerun learns from the answers it replays
                return entry
            if attempt < run.replayed:
                return None
            try:
                entry = await self._send(run, sent)
            except openai.APIStatusError as error:
                if "response_format" in sent and refuses_structured_output(error):
                    self._structured_refusal(error, run.request, sent["response_format"])  # may raise
                    continue
                raise
            if entry is None:  # the endpoint refused structured output while this request waited
                continue
            run.api_calls += 1
            if entry["text"].strip():  # an empty answer (a broken endpoint) is never cached: a rerun asks again
                self.cache.put(run.key, {"key": run.key, "task": run.request.task, **entry})
            return entry

    def _judge(self, run: _Round, attempt: int, entry: dict[str, Any]) -> Any:
        """The value of an answer, parsed and checked; raises :class:`MalformedOutput` (or its kinds) for an empty,
        cut off, malformed or gated one. Items ``check`` drops join ``run.dropped``."""
        text = entry["text"]
        if not text.strip():
            raise MalformedOutput(f"{self.config.base_url} returned an empty answer")
        if entry.get("finish_reason") == "length":
            raise TruncatedOutput(
                f"cut off at llm.max_tokens ({self.config.max_tokens}; finish_reason length) after "
                f"{entry['usage']['completion_tokens']} completion tokens"
            )
        value = run.parse(text) if run.parse is not None else text
        if run.check is not None:
            value = run.check(run.request, value)
            if isinstance(value, Checked):
                run.drop(attempt, value.dropped)
                value = value.value
        return value

    def _failed_attempt(self, run: _Round, attempt: int, error: MalformedOutput, text: str) -> None:
        """Count an answer :meth:`_judge` refused, by its kind, and record it for the rejects file."""
        run.last_code = error.code
        if isinstance(error, RejectedOutput):
            run.usage.quality_rejected += 1
            run.drop(attempt, error.dropped)
        elif isinstance(error, TruncatedOutput):
            run.usage.truncated += 1
        else:
            run.usage.malformed += 1
        run.outputs.append({"attempt": attempt, "reason": error.code, "error": str(error), "text": text})

    def _reject(self, run: _Round, reason: str, code: str, attempts: int, end: int | None = None) -> LLMResult:
        """Record a request that failed for good; with ``end`` (the attempts made, over every round) its outcome
        mark says so, and a rerun skips it unless ``retry_rejected`` (transient failures give none)."""
        run.usage.rejected += 1
        run.usage.rejected_reasons[code] = run.usage.rejected_reasons.get(code, 0) + 1
        self.rejects.replace(run.mark_key, [run.record(code, reason, end is not None), *run.dropped])
        if end is not None:
            self.cache.mark(run.mark_key, run.request.task, "rejected", end, reason=code, error=reason)
        return LLMResult(run.request, False, error=reason, attempts=attempts, api_calls=run.api_calls)

    def _structured(self, request: LLMRequest) -> dict[str, Any]:
        return structured_params(
            self.config, request, refused=self.structured_refused is not None, bounds=self.bounds_refused is None
        )

    async def _send(self, run: _Round, sent: dict[str, Any]) -> dict[str, Any] | None:
        """:func:`.llm_http.chat_completion`; until the endpoint's handling of ``response_format`` is known
        (:attr:`.answer_schema.StructuredWatch.waiting`), requests carrying it go one at a time, so that a server
        refusing it refuses one request and one ignoring it answers a few. Every answer to such a request is judged
        (:meth:`_observe`). ``None``: structured output changed while this request waited (ask again)."""

        async def send() -> dict[str, Any]:
            entry = await chat_completion(self.config, self._openai, self._in_flight, run.request, sent, run.usage)
            self._observe(sent, entry)
            return entry

        if "response_format" in sent and self.structured_watch.waiting:
            assert self._first_structured is not None
            async with self._first_structured:
                if self._stop is None and self.structured_watch.waiting and not self._changed(run.request, sent):
                    return await send()
        if self._stop is not None:  # another request stopped the run (its tasks are being cancelled)
            raise LLMRunAborted(self._stop)
        return None if self._changed(run.request, sent) else await send()

    def _changed(self, request: LLMRequest, sent: dict[str, Any]) -> bool:
        """Whether ``request`` would now carry another ``response_format`` than ``sent`` (refused meanwhile: its
        item bounds, or all of it)."""
        return self._structured(request).get("response_format") != sent.get("response_format")
