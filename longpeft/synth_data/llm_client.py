"""A client for any OpenAI-compatible chat-completions endpoint, built for paid batch generation.

What it adds on top of the ``openai`` package:

- a concurrency limit (``max_concurrency`` requests in flight);
- retries with exponential backoff (and ``retry-after-ms`` / ``Retry-After``) on 408, 409, 429, 5xx,
  timeouts, connection errors and 200 responses whose body is not a chat completion (:mod:`.llm_http`);
- a disk cache of every answer, written the moment it arrives and keyed by the endpoint and the request's content
  (:mod:`.llm_cache`): a killed run resumes without repeating a call that was answered, and answers of one endpoint
  (a stub for a dry run) are never served as another's; a cache file longpeft did not write reads as absent, and the
  usage report counts such files (``foreign_cache_files``), as it counts the lines of the rejects file that are not
  its records (``foreign_rejects_lines``);
- bounded retries on malformed output: the caller's ``parse`` function raises :class:`MalformedOutput` (bad JSON, a
  missing field) and the request is sent again as a new attempt, up to ``max_parse_attempts``; a ``check`` function
  (the quality gates) may reject a parsed answer the same way (:class:`RejectedOutput`), or keep part of it
  (:class:`Checked`: the parts dropped go to the rejects file); an answer the server cut off at ``max_tokens``
  (``finish_reason`` ``length``) is never parsed: it is a :class:`TruncatedOutput` attempt, asked again;
- structured output (``structured``): each request asks for its output schema through ``response_format``, with
  the schema's item bounds (``minItems``, ``maxItems``) until the endpoint refuses a schema holding them (said in
  one line; the request is asked again at once without them); with ``auto``, the first refusal by the endpoint
  (see :func:`refuses_structured_output`) switches the client to the prompt-only JSON contract for the rest of its
  life, with one line on the console (a fallback, not a rejection: the request is asked again at once without
  ``response_format``), and so does an endpoint seen to ignore the field (its first answers are not bare JSON of
  the asked shape: :mod:`.structured_output`; those answers are judged by the parser as any other);
- requests refused by the endpoint (HTTP 4xx) and requests given up after transient failures say why on the console
  (the first :data:`SHOWN_REFUSALS`, then counted), and a prompt longer than the endpoint's context
  (``context_tokens``, or what the server reports at the start: :mod:`.endpoint`) is refused before sending, its
  tokens counted by the server's tokenizer when it offers one (:mod:`.prompt_tokens`);
- a request rejected for good (malformed or gated output in every attempt, an HTTP 4xx refusal, a prompt longer
  than the endpoint's context; :data:`.llm_rejects.REJECT_REASONS`) is marked in the cache: a rerun counts it as
  ``skipped_rejected`` and does not ask it again unless ``retry_rejected``, which replays its cached answers and
  then sends new attempts. One given up after transient failures (``gave_up``) is not marked: a rerun asks it again.
  The rejects file lists what is still rejected, one group of records per request (:mod:`.llm_rejects`);
- token accounting per task (prompt/completion tokens of paid calls, and of answers served from cache);
- a tqdm progress bar.

The API key is read from the environment variable named by ``api_key_env`` when the client starts a
run; it is never stored in the config, the cache, the rejects file, the usage report or any log.

This module holds the client and its request path; its parts live beside it: :mod:`.llm_request` (settings, request,
result, usage counters), :mod:`.llm_output` (what ``parse`` and ``check`` raise, the JSON reader), :mod:`.llm_http`
(one call with its retries, the server's errors), :mod:`.llm_cache` (answers and outcome marks on disk),
:mod:`.llm_rejects` (the rejects file).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from .llm_cache import ResponseCache, outcome_key, request_key
from .llm_http import RetryableError, chat_completion, refuses_structured_output, server_reason
from .llm_output import Checked, MalformedOutput, RejectedOutput, TruncatedOutput
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
from .prompt_tokens import PromptCounter, prompt_counter
from .structured_output import StructuredWatch

SHOWN_REFUSALS = 3  # HTTP 4xx refusals (and give-ups) whose reason is printed; the rest are counted
# A prompt of fewer UTF-8 bytes than the context less this allowance for its chat template is sent uncounted: a token
# covers at least one byte of text, and templates add a few tokens per message plus a preamble (Llama 3.1's date).
TEMPLATE_TOKENS_ALLOWANCE = 64
TEMPLATE_TOKENS_PER_MESSAGE = 16


@dataclass
class _Round:
    """One request's attempts in a run, as :meth:`LLMClient._complete` makes them and judges them (``parse`` and
    ``check``: :meth:`LLMClient.run`).

    Attributes:
        first_key: the cache key of its first attempt without response_format (:func:`.llm_cache.request_key`);
            ``mark_key`` the key of its outcome mark; ``mark`` the mark an earlier run left.
        end: attempts up to here (exclusive); ``replayed``: attempts of an earlier round, replayed from the cache and
            never sent again.
        key: the cache key of the latest attempt as sent; ``api_calls``: the calls paid for.
        outputs: every judged attempt's outcome (attempt, reason, error, the answer's text); ``dropped``: the item
            records of what the checks dropped; ``last_code``: the reason of the latest attempt refused.
    """

    request: LLMRequest
    usage: TaskUsage
    first_key: str
    mark: dict[str, Any] | None
    end: int
    parse: Callable[[str], Any] | None = None
    check: Callable[[LLMRequest, Any], Any] | None = None
    replayed: int = 0
    key: str = ""
    api_calls: int = 0
    last_code: str = "malformed"
    outputs: list[dict[str, Any]] = field(default_factory=list)
    dropped: list[dict[str, Any]] = field(default_factory=list)
    mark_key: str = field(init=False)

    def __post_init__(self) -> None:
        self.mark_key = outcome_key(self.first_key)
        self.key = self.key or self.first_key


class LLMClient:
    """Runs batches of :class:`LLMRequest` against an OpenAI-compatible endpoint.

    Args:
        config: endpoint and retry settings.
        cache_dir: folder of the response cache (created on demand).
        rejects_path: JSONL file receiving requests that failed for good.
        show_progress: draw a tqdm bar per batch.
        prompt_counter: what counts a prompt's tokens for the check against the endpoint's context; by default
            :func:`.prompt_tokens.prompt_counter` picks it at the first run that knows the context (the server's
            ``/tokenize``, else ``llm.tokenizer``, else an estimate that errs short) and says which in one line.
        retry_rejected: ask again the requests an earlier run rejected (by default they are skipped).
    """

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
        self.refusals = 0  # requests refused with HTTP 4xx (their reasons: the first SHOWN_REFUSALS on the console)
        self.gave_up = 0  # requests given up after transient failures (the first SHOWN_REFUSALS said with the cause)
        self._stop: str | None = None  # why the run stops (structured output refused or ignored): no more sends
        self.endpoint: Any = None  # an .endpoint.EndpointInfo, asked once at the first run (context_tokens unset)

    # ---- public API -------------------------------------------------------------------------

    def run(
        self,
        requests: Sequence[LLMRequest],
        parse: Callable[[str], Any] | None = None,
        desc: str = "LLM requests",
        check: Callable[[LLMRequest, Any], Any] | None = None,
    ) -> list[LLMResult]:
        """Send every request (concurrently, cached, retried); results come back in request order.

        ``parse(text)`` turns the model's text into a value or raises :class:`MalformedOutput`;
        without it the text itself is the value. ``check(request, value)`` then returns the value to keep
        or raises :class:`RejectedOutput` (a new attempt follows).
        """
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
        parse: Callable[[str], Any] | None = None,
        desc: str = "LLM requests",
        check: Callable[[LLMRequest, Any], Any] | None = None,
    ) -> list[LLMResult]:
        """Async form of :meth:`run`."""
        import openai

        if not requests:
            return []
        api_key = read_api_key(self.config)
        client = openai.AsyncOpenAI(
            api_key=api_key, base_url=self.config.base_url, max_retries=0, timeout=self.config.timeout
        )
        if self.endpoint is None and self.config.context_tokens is None:
            await self._ask_endpoint(api_key)
        if self.prompt_counter is None and self.context_limit() is not None:
            self.prompt_counter = await asyncio.to_thread(
                prompt_counter, self.config, api_key, min(self.config.timeout, 10.0)
            )
            self._say(f"{self.config.base_url}: prompt tokens are {self.prompt_counter.how}")
        del api_key
        gave_up_before = self._gave_up_causes()
        semaphore = asyncio.Semaphore(self.config.max_concurrency)
        self._first_structured = asyncio.Lock()  # bound to this run's event loop
        bar = tqdm(total=len(requests), desc=desc, unit="req", disable=not self.show_progress)
        try:

            async def one(request: LLMRequest) -> LLMResult:
                result = await self._complete(client, semaphore, request, parse, check)
                bar.update(1)
                bar.set_postfix(self._postfix(), refresh=False)
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
            "foreign_rejects_lines": self.rejects.unread,
        }

    def request_id(self, request: LLMRequest) -> str:
        """The request's identity across runs and structured-output modes: the key of its outcome mark
        (:func:`.llm_cache.outcome_key`), which is also its group in the rejects file."""
        return outcome_key(
            request_key(self.config.base_url, self.config.model, request, sampling_params(self.config), 0)
        )

    def drop_items(self, request: LLMRequest, step: str, attempt: int, dropped: list[dict[str, Any]]) -> None:
        """Record in the rejects file the items a caller dropped from the answer of ``request`` (its ``attempt``) in a
        later ``step`` of its own (say, repeats across the answers of one context); the list replaces what that step
        dropped from this request before (an empty list: nothing any more)."""
        group = f"{self.request_id(request)}/{step}"
        self.rejects.replace(group, [self._item_record(request, group, attempt, item) for item in dropped])

    def context_limit(self) -> tuple[int, str] | None:
        """``(tokens, where from)`` of the endpoint's context, or ``None`` when neither set nor reported."""
        if self.config.context_tokens is not None:
            return self.config.context_tokens, "llm.context_tokens"
        if self.endpoint is not None and self.endpoint.context_tokens is not None:
            return self.endpoint.context_tokens, f"reported by the endpoint's {self.endpoint.context_source}"
        return None

    # ---- internals --------------------------------------------------------------------------

    def _say(self, line: str) -> None:
        tqdm.write(line, file=sys.stderr)

    async def _ask_endpoint(self, api_key: str) -> None:
        """Learn the endpoint's context and slots (:mod:`.endpoint`); say what was learned in one line."""
        from .endpoint import discover

        self.endpoint = await asyncio.to_thread(
            discover, self.config.base_url, self.config.model, api_key, min(self.config.timeout, 10.0)
        )
        info = self.endpoint
        if info.context_tokens is not None:
            self._say(
                f"{self.config.base_url}: context of {info.context_tokens} tokens ({info.context_source}); "
                "longer prompts are refused before sending"
            )
        if info.slots is not None and info.slots < self.config.max_concurrency:
            self._say(
                f"{self.config.base_url}: the server decodes {info.slots} request(s) at once (/props "
                f"total_slots) and llm.max_concurrency is {self.config.max_concurrency}: the others wait in "
                f"its queue, inside llm.timeout ({self.config.timeout:g} s); set llm.max_concurrency "
                f"{info.slots} or raise llm.timeout"
            )

    def _structured_refusal(self, error: Any, response_format: dict[str, Any]) -> None:
        """The endpoint refused ``response_format``: when it held the schema's item bounds, ask without them from
        now on (once, said once); else with ``auto``, fall back to the prompt-only contract (once, said once); with
        ``json_schema`` / ``json_object``, stop the run naming the setting."""
        reason = server_reason(error)
        if self.bounds_refused is None and any(f'"{word}"' in json.dumps(response_format) for word in ITEM_BOUNDS):
            self.bounds_refused = reason
            self._say(
                f"{self.config.base_url} refused the schema with its item bounds (HTTP {error.status_code}: "
                f"{reason}); sending the schema without {'/'.join(ITEM_BOUNDS)} for the rest of the run"
            )
            return
        if self.config.structured != "auto":
            self._stop = (
                f"{self.config.base_url} refused structured output (llm.structured={self.config.structured}; HTTP "
                f"{error.status_code}: {reason}); set llm.structured to auto (falls back to the prompt) or off"
            )
            raise LLMRunAborted(self._stop)
        if self.structured_refused is None:
            self.structured_refused = reason
            self._say(
                f"{self.config.base_url} refused structured output (HTTP {error.status_code}: {reason}); "
                "llm.structured=auto: asking with the prompt's JSON contract only for the rest of the run"
            )

    def _observe(self, sent: dict[str, Any], entry: dict[str, Any]) -> None:
        """Judge one answer to a request carrying ``response_format`` (:class:`.structured_output.StructuredWatch`):
        an endpoint seen to ignore the field is answered as one that refused it (:meth:`_structured_ignored`)."""
        text = entry.get("text")
        verdict = self.structured_watch.observe(
            sent["response_format"], text if isinstance(text, str) else "", entry.get("finish_reason")
        )
        if verdict == "ignored":
            self._structured_ignored(sent["response_format"].get("type", "response_format"))

    def _structured_ignored(self, kind: str) -> None:
        """The endpoint answers HTTP 200 without following ``response_format``: with ``auto``, fall back to the
        prompt-only contract (said in one line); with ``json_schema`` / ``json_object``, stop the run naming the
        setting."""
        seen = (
            f"{self.config.base_url} ignores response_format ({kind} sent, HTTP 200: "
            f"{self.structured_watch.evidence()})"
        )
        if self.config.structured != "auto":
            self._stop = (
                f"{seen}; llm.structured={self.config.structured} needs a server that enforces it: set "
                "llm.structured to auto (falls back to the prompt) or off"
            )
            raise LLMRunAborted(self._stop)
        self.structured_refused = f"ignored: {self.structured_watch.evidence()}"
        self._say(f"{seen}; llm.structured=auto: asking with the prompt's JSON contract only for the rest of the run")

    def _give_up(self, request: LLMRequest, error: RetryableError) -> str:
        """Count a request given up after transient failures by its cause; print the reason for the first
        :data:`SHOWN_REFUSALS` (:meth:`_say_gave_up` counts the others at the end of the batch)."""
        usage = self.usage[request.task]
        usage.gave_up_causes[error.cause] = usage.gave_up_causes.get(error.cause, 0) + 1
        self.gave_up += 1
        line = f"{self.config.base_url}: gave up on a {request.task} request after {self.config.max_retries} retries"
        self._say_first(self.gave_up, f"{line} ({error})", "further give-ups are counted at the end of the batch")
        return f"{self.config.base_url}: gave up after {self.config.max_retries} retries: {error}"

    def _gave_up_causes(self) -> Counter[str]:
        return sum((Counter(usage.gave_up_causes) for usage in self.usage.values()), Counter())

    def _say_gave_up(self, desc: str, before: Counter[str]) -> None:
        """One line for the requests of a batch given up after transient failures, counted by cause."""
        new = self._gave_up_causes() - before
        if new:
            causes = ", ".join(f"{cause}: {count}" for cause, count in sorted(new.items(), key=lambda kv: -kv[1]))
            self._say(
                f"{self.config.base_url}: gave up on {sum(new.values())} {desc} request(s) after "
                f"{self.config.max_retries} retries ({causes}); not marked rejected: a plain rerun asks them again"
            )

    def _refusal(self, request: LLMRequest, error: Any) -> str:
        """Count an HTTP 4xx refusal (reason ``http_refused``) and print the server's reason for the first
        :data:`SHOWN_REFUSALS`."""
        self.refusals += 1
        reason = f"HTTP {error.status_code}: {server_reason(error)}"
        line = f"{self.config.base_url} refused a {request.task} request ({reason})"
        self._say_first(self.refusals, line, "further refusals are counted in the summary")
        return reason

    def _say_first(self, count: int, line: str, further: str) -> None:
        """Say ``line``, the ``count``-th of its kind, when it is one of the first :data:`SHOWN_REFUSALS` (the last
        of them adds ``further``)."""
        if count <= SHOWN_REFUSALS:
            self._say(line + (f"; {further}" if count == SHOWN_REFUSALS else ""))

    def _postfix(self) -> dict[str, int]:
        calls = sum(u.api_calls for u in self.usage.values())
        hits = sum(u.cache_hits for u in self.usage.values())
        tokens = sum(u.prompt_tokens + u.completion_tokens for u in self.usage.values())
        return {"calls": calls, "cached": hits, "tokens": tokens}

    async def _complete(
        self,
        client: Any,
        semaphore: asyncio.Semaphore,
        request: LLMRequest,
        parse: Callable[[str], Any] | None,
        check: Callable[[LLMRequest, Any], Any] | None = None,
    ) -> LLMResult:
        import openai

        run = self._round(request, parse, check)
        if run.mark is not None and run.mark["outcome"] == "rejected" and not self.retry_rejected:
            run.usage.skipped_rejected += 1  # rejected in an earlier run, not asked again: kept in the rejects file
            self.rejects.keep(run.mark_key, self._request_record(run, run.mark["reason"], run.mark["error"], True))
            why = f"rejected in an earlier run ({run.mark['reason']}: {run.mark['error']})"
            return LLMResult(request, False, error=f"{why}; not asked again (--retry-rejected asks again)")
        too_long = await self._too_long(request)
        if too_long is not None:  # no attempt of this round was made
            return self._reject(run, too_long, "prompt_too_long", 0, end=run.end - self.config.max_parse_attempts)
        for attempt in range(run.end):
            try:
                entry = await self._fetch(client, semaphore, run, attempt)
            except RetryableError as error:
                reason = self._give_up(request, error)
                run.outputs.append({"attempt": attempt, "reason": "gave_up", "error": reason})
                return self._reject(run, reason, "gave_up", attempt + 1)
            except openai.APIStatusError as error:  # a request the server refuses (400, 422, ...)
                reason = f"{type(error).__name__}: {self._refusal(request, error)}"
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

    def _round(
        self, request: LLMRequest, parse: Callable[[str], Any] | None, check: Callable[[LLMRequest, Any], Any] | None
    ) -> _Round:
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
        """Why the prompt is not sent (it holds the endpoint's context or more, counted by the prompt counter), or
        None."""
        limit = self.context_limit()
        if limit is None or self.prompt_counter is None or not _may_exceed(request, limit[0]):
            return None
        tokens, counted = await asyncio.to_thread(self.prompt_counter.count, request.messages)
        if tokens < limit[0]:
            return None
        return (
            f"prompt_too_long: the prompt has {tokens} tokens ({counted}), the endpoint's context is "
            f"{limit[0]} ({limit[1]}); not sent"
        )

    async def _fetch(
        self, client: Any, semaphore: asyncio.Semaphore, run: _Round, attempt: int
    ) -> dict[str, Any] | None:
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
                if "response_format" in sent and self.structured_watch.verdict is None:
                    self._observe(sent, entry)  # a rerun learns from the answers it replays
                return entry
            if attempt < run.replayed:
                return None
            try:
                entry = await self._send(client, semaphore, run.request, sent, usage)
            except openai.APIStatusError as error:
                if "response_format" in sent and refuses_structured_output(error):
                    self._structured_refusal(error, sent["response_format"])  # not a rejection; may raise
                    continue
                raise
            if entry is None:  # the endpoint refused structured output while this request waited
                continue
            run.api_calls += 1
            if entry["text"].strip():  # an empty answer (a broken endpoint) is never cached: a rerun asks again
                self.cache.put(run.key, {"key": run.key, "task": run.request.task, **entry})
            return entry

    def _judge(self, run: _Round, attempt: int, entry: dict[str, Any]) -> Any:
        """The value of an answer: parsed and checked; raises :class:`MalformedOutput` (or its kinds) for an empty,
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
                run.dropped += [self._item_record(run.request, run.mark_key, attempt, item) for item in value.dropped]
                value = value.value
        return value

    def _failed_attempt(self, run: _Round, attempt: int, error: MalformedOutput, text: str) -> None:
        """Count an answer :meth:`_judge` refused, by its kind, and record it for the rejects file."""
        run.last_code = error.code
        if isinstance(error, RejectedOutput):
            run.usage.quality_rejected += 1
            run.dropped += [self._item_record(run.request, run.mark_key, attempt, item) for item in error.dropped]
        elif isinstance(error, TruncatedOutput):
            run.usage.truncated += 1
        else:
            run.usage.malformed += 1
        run.outputs.append({"attempt": attempt, "reason": error.code, "error": str(error), "text": text})

    def _item_record(self, request: LLMRequest, group: str, attempt: int, item: dict[str, Any]) -> dict[str, Any]:
        """A rejects-file record of one part of an answer that a ``check`` function dropped (:mod:`.llm_rejects`)."""
        return {
            "kind": "item",
            "request": group,
            "task": request.task,
            "meta": request.meta,
            "attempt": attempt,
            **item,
        }

    def _request_record(self, run: _Round, code: str, reason: str, marked: bool) -> dict[str, Any]:
        """The rejects-file record of a request rejected for ``code`` (:data:`REJECT_REASONS`), with every attempt's
        reason, error and answer (:mod:`.llm_rejects`)."""
        return {
            "kind": "request",
            "request": run.mark_key,
            "key": run.key,
            "task": run.request.task,
            "meta": run.request.meta,
            "reason": code,
            "error": reason,
            "marked": marked,
            "attempts": run.outputs,
        }

    def _reject(self, run: _Round, reason: str, code: str, attempts: int, end: int | None = None) -> LLMResult:
        """Record a request that failed for good; with ``end`` (the attempts made, over every round) its outcome
        mark says so, and a rerun skips it unless ``retry_rejected`` (transient failures give none: a rerun asks
        again)."""
        run.usage.rejected += 1
        run.usage.rejected_reasons[code] = run.usage.rejected_reasons.get(code, 0) + 1
        self.rejects.replace(run.mark_key, [self._request_record(run, code, reason, end is not None), *run.dropped])
        if end is not None:
            self.cache.mark(run.mark_key, run.request.task, "rejected", end, reason=code, error=reason)
        return LLMResult(run.request, False, error=reason, attempts=attempts, api_calls=run.api_calls)

    def _structured(self, request: LLMRequest) -> dict[str, Any]:
        return structured_params(
            self.config, request, refused=self.structured_refused is not None, bounds=self.bounds_refused is None
        )

    async def _send(
        self, client: Any, semaphore: asyncio.Semaphore, request: LLMRequest, sent: dict[str, Any], usage: TaskUsage
    ) -> dict[str, Any] | None:
        """:func:`.llm_http.chat_completion`, except that until the endpoint is known to follow ``response_format``
        (an answer of the asked shape), requests carrying it go one at a time and their answers are judged
        (:meth:`_observe`): a server that refuses structured output refuses one request, and one that ignores it
        answers :data:`.structured_output.IGNORED_AFTER`, not every request of the first wave. After
        :data:`.structured_output.UNDECIDED_AFTER` answers that proved nothing, requests go in parallel and are
        still judged. ``None``: structured output was switched off while this request waited (ask without it)."""
        if self._stop is not None:  # another request stopped the run (its tasks are being cancelled)
            raise LLMRunAborted(self._stop)
        if "response_format" in sent and self.structured_watch.waiting:
            assert self._first_structured is not None
            async with self._first_structured:
                if self._stop is not None:  # another request stopped the run while this one waited
                    raise LLMRunAborted(self._stop)
                if self.structured_watch.waiting:
                    if self._structured(request).get("response_format") != sent["response_format"]:
                        return None  # refused (its item bounds, or all of it) while this request waited
                    entry = await chat_completion(self.config, client, semaphore, request, sent, usage)
                    self._observe(sent, entry)
                    return entry
            if self._structured(request).get("response_format") != sent["response_format"]:
                return None
        entry = await chat_completion(self.config, client, semaphore, request, sent, usage)
        if "response_format" in sent and self.structured_watch.verdict is None:
            self._observe(sent, entry)  # no longer waiting (answers that proved nothing): still judged
        return entry


def _may_exceed(request: LLMRequest, context: int) -> bool:
    """Whether the prompt may hold ``context`` tokens or more: its UTF-8 bytes (a token covers one byte or more of
    text) plus the chat template's allowance (:data:`TEMPLATE_TOKENS_ALLOWANCE`); a shorter one is sent uncounted."""
    size = sum(len(str(m.get("content", "")).encode("utf-8")) for m in request.messages)
    return size + TEMPLATE_TOKENS_ALLOWANCE + TEMPLATE_TOKENS_PER_MESSAGE * len(request.messages) >= context
