"""A client for any OpenAI-compatible chat-completions endpoint, built for paid batch generation.

What it adds on top of the ``openai`` package:

- a concurrency limit (``max_concurrency`` requests in flight);
- retries with exponential backoff (and ``retry-after-ms`` / ``Retry-After``) on 408, 409, 429, 5xx,
  timeouts, connection errors and 200 responses whose body is not a chat completion;
- a disk cache keyed by a hash of the endpoint and the request's content (base URL, model, messages,
  parameters, attempt number): every answer is written the moment it arrives, so a killed run resumes
  without repeating a call that was answered and cached, and answers of one endpoint (a stub for a dry
  run) are never served as another's. Caches written before the base URL joined the key are not reused;
- bounded retries on malformed output: the caller's ``parse`` function raises
  :class:`MalformedOutput` (bad JSON, a missing field), the request is sent again as a new attempt,
  and after ``max_parse_attempts`` the request and every raw answer go to the rejects JSONL file; a
  ``check`` function (the quality gates) may reject a parsed answer the same way (:class:`RejectedOutput`);
- structured output (``structured``): each request asks for its output schema through ``response_format``;
  with ``auto``, the first refusal by the endpoint (see :func:`refuses_structured_output`) switches the client
  to the prompt-only JSON contract for the rest of its life, with one line on the console (a fallback, not a
  rejection: the request is asked again at once without ``response_format``);
- requests refused by the endpoint (HTTP 4xx) show the server's reason on the console (the first
  :data:`SHOWN_REFUSALS`; all of them in the rejects file), and a prompt longer than the endpoint's context
  (``context_tokens``, or what the server reports at the start: :mod:`.endpoint`) is refused before sending;
- a request rejected for good (:data:`REJECT_REASONS`: malformed or gated output in every attempt, an HTTP
  4xx refusal, a prompt longer than the endpoint's context) is marked in the cache with its reason: a rerun
  does not ask it again (it counts it as ``skipped_rejected``) unless the client runs with
  ``retry_rejected``, which asks it again with new attempt numbers (the earlier answers are replayed from the
  cache first, so relaxed gates cost nothing). A request given up after transient failures (timeouts, 429,
  5xx; reason ``gave_up``) is not marked: a rerun asks it again;
- token accounting per task (prompt/completion tokens of paid calls, and of answers served from cache);
- a tqdm progress bar.

The API key is read from the environment variable named by ``api_key_env`` when the client starts a
run; it is never stored in the config, the cache, the rejects file, the usage report or any log.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import Field, field_validator
from tqdm.auto import tqdm

from ..config import StrictModel
from ..errors import LongpeftError
from ..files import write_text_atomically


class LLMConfig(StrictModel):
    """Endpoint and behaviour of :class:`LLMClient`. There is deliberately no field for the key."""

    base_url: str = Field("https://api.openai.com/v1", description="OpenAI-compatible endpoint (…/v1)")
    model: str = Field("gpt-4o", description="model name sent with every request")
    api_key_env: str = Field("OPENAI_API_KEY", description="environment variable holding the API key")
    max_concurrency: int = Field(8, ge=1, description="requests in flight at once")
    max_retries: int = Field(
        3, ge=0,
        description="retries of one attempt on 408/409/429/5xx, timeouts, connection errors and non-completion bodies",
    )
    backoff_initial: float = Field(1.0, ge=0, description="first backoff in seconds; doubles per retry")
    backoff_max: float = Field(60.0, ge=0, description="cap on one backoff (and on Retry-After) in seconds")
    timeout: float = Field(
        120.0, gt=0, description="seconds before one HTTP request times out, counting the time it waits in the "
        "server's queue: a server with one slot (llama.cpp's default) answers one request at a time, so use "
        "max_concurrency 1 there, or a timeout of max_concurrency x the time of one answer (with the retries, a "
        "stalled endpoint costs at most timeout x (max_retries + 1) plus backoff per request: 8-9 minutes by default)"
    )
    max_parse_attempts: int = Field(3, ge=1, description="attempts per request when the output is malformed")
    temperature: float = Field(0.7, ge=0, description="sampling temperature")
    max_tokens: int | None = Field(4096, ge=1, description="completion token limit per request")
    structured: Literal["auto", "json_schema", "json_object", "off"] = Field(
        "auto", description="structured output through response_format: 'json_schema' sends each answer's JSON "
        "schema, 'json_object' asks for any JSON object, 'off' sends neither (the prompt states the JSON contract "
        "in every mode, and the parser checks the schema in every mode); 'auto' sends the schema and, the first "
        "time the endpoint refuses it, falls back to 'off' for the rest of the run; 'json_schema' and "
        "'json_object' stop the run when refused"
    )
    context_tokens: int | None = Field(
        None, ge=1, description="tokens one request may hold at the endpoint; a longer prompt is refused before "
        "sending (a reject with reason prompt_too_long). Unset: the value the server reports at the start "
        "(vLLM/SGLang /v1/models max_model_len, llama.cpp /props n_ctx), else no check"
    )

    @field_validator("structured", mode="before")
    @classmethod
    def _bare_off(cls, value: Any) -> Any:
        """YAML reads a bare ``off`` (``structured: off``, ``--set llm.structured=off``) as ``false``."""
        return "off" if value is False else value


class ResponseSchema(Protocol):
    """What the client needs of an answer's schema (:class:`.answer_schema.OutputSchema`)."""

    def response_format(self) -> dict[str, Any]:
        """The ``response_format`` request field asking for the schema."""
        ...


class MalformedOutput(ValueError):
    """Raised by a ``parse`` function when the model's text is unusable (bad JSON, missing fields)."""


class RejectedOutput(MalformedOutput):
    """Raised by a ``check`` function when a well-formed answer holds nothing usable (every item failed the
    quality gates): the request is asked again as a new attempt, like malformed output."""


class LLMRunAborted(LongpeftError, RuntimeError):
    """An error no retry can fix (bad key, unknown model or endpoint): the whole run stops."""


@dataclass
class LLMRequest:
    """One chat-completion request.

    Attributes:
        task: accounting bucket (e.g. ``"single_detail"``).
        messages: chat messages ``[{"role": ..., "content": ...}]``.
        params: extra request parameters; part of the cache key.
        meta: free-form identifiers written to the rejects file; not part of the cache key.
        schema: the JSON schema of the answer (:mod:`.answer_schema`), sent as ``response_format`` as
            ``LLMConfig.structured`` says; the ``response_format`` actually sent is part of the cache key.
    """

    task: str
    messages: list[dict[str, str]]
    params: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    schema: ResponseSchema | None = None


@dataclass
class LLMResult:
    """Outcome of one request: ``value`` is the parsed output when ``ok``; ``error`` says why not."""

    request: LLMRequest
    ok: bool
    value: Any = None
    text: str | None = None
    error: str | None = None
    attempts: int = 0
    api_calls: int = 0


@dataclass
class TaskUsage:
    """Token accounting of one task: paid calls, and answers replayed from the cache."""

    api_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cache_hits: int = 0
    cached_prompt_tokens: int = 0
    cached_completion_tokens: int = 0
    retries: int = 0
    malformed: int = 0
    quality_rejected: int = 0  # attempts whose every item failed the quality gates
    rejected: int = 0
    rejected_reasons: dict[str, int] = field(default_factory=dict)  # ``rejected`` per reason (REJECT_REASONS)
    skipped_rejected: int = 0  # requests rejected in an earlier run, not asked again (no --retry-rejected)


class _RetryableError(Exception):
    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


RETRYABLE_STATUS = (408, 409, 429)  # and every 5xx (the statuses the openai client itself retries)
REJECT_REASONS = ("malformed", "quality", "http_refused", "prompt_too_long", "gave_up")
"""Why a request was rejected for good (``reason`` in the rejects file, ``rejected_reasons`` in the usage):
``malformed`` output or output failing the ``quality`` gates in every attempt, ``http_refused`` by the endpoint
with HTTP 4xx (the error holds the server's reason), a prompt longer than the endpoint's context
(``prompt_too_long``, never sent), ``gave_up`` after transient failures. All but ``gave_up`` are marked in the
cache (a rerun skips them unless ``retry_rejected``). A refusal of structured output that makes ``auto`` fall
back to the prompt is not a rejection."""
SHOWN_REFUSALS = 3  # HTTP 4xx refusals whose server reason is printed; the rest are counted
# Words of a 400/422 body that refuses structured output (OpenAI: "Invalid parameter: 'response_format' of type
# 'json_schema' is not supported with this model"; vLLM/FastAPI validation: loc ["body", "response_format"];
# llama.cpp: "JSON schema conversion failed"; TGI: "grammar is not supported"; vLLM: "guided decoding").
STRUCTURED_REFUSAL = re.compile(r"response_format|json_schema|schema|grammar|structured output|guided", re.I)
CHARS_PER_TOKEN_ESTIMATE = 5  # without a tokenizer: fewer tokens than GPT-4/Llama-3 vocabularies give (~4 chars)
MESSAGE_OVERHEAD_TOKENS = 8  # chat-template tokens around one message (role header, end of turn), an upper bound


def server_reason(error: Any) -> str:
    """The server's own words in an HTTP error: ``error.message`` of an OpenAI-style body, FastAPI's ``detail``
    (vLLM, SGLang), else the body or the exception text; one line, at most 300 characters."""
    body = getattr(error, "body", None)
    if isinstance(body, dict):
        inner = body.get("error", body)
        inner = inner if isinstance(inner, dict) else {"message": inner}
        text = inner.get("message") or inner.get("detail") or body.get("detail") or json.dumps(body)
    else:
        text = body if isinstance(body, str) and body.strip() else str(error)
    text = " ".join(str(text if not isinstance(text, (list, dict)) else json.dumps(text)).split())
    return text if len(text) <= 300 else text[:297] + "..."


def refuses_structured_output(error: Any) -> bool:
    """Whether an HTTP error answers a request carrying ``response_format`` by refusing structured output: status
    400 or 422 whose body names the feature (:data:`STRUCTURED_REFUSAL`). Other 400s (a prompt beyond the
    context, a bad parameter) are about the request itself: falling back would hide them and double the cost."""
    if getattr(error, "status_code", None) not in (400, 422):
        return False
    body = getattr(error, "body", None)
    return bool(STRUCTURED_REFUSAL.search(f"{server_reason(error)} {json.dumps(body, default=str)}"))


def structured_params(config: LLMConfig, request: LLMRequest, refused: bool = False) -> dict[str, Any]:
    """The ``response_format`` parameter ``request`` carries under ``config.structured`` (empty when none is sent:
    ``off``, no schema, or ``auto`` after the endpoint ``refused`` it); part of the cache key."""
    if request.schema is None or config.structured == "off" or (config.structured == "auto" and refused):
        return {}
    if config.structured == "json_object":
        return {"response_format": {"type": "json_object"}}
    return {"response_format": request.schema.response_format()}


def request_key(base_url: str, model: str, request: LLMRequest, sampling: dict[str, Any], attempt: int) -> str:
    """SHA-256 of the endpoint and the request content: base URL (without trailing slashes), model,
    messages, sampling and extra params, attempt number."""
    payload = {
        "base_url": base_url.rstrip("/"),
        "model": model,
        "messages": request.messages,
        "params": {**sampling, **request.params},
        "attempt": attempt,
    }
    blob = json.dumps(payload, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def outcome_key(first_key: str) -> str:
    """Cache key of a request's outcome mark, from the key of its first attempt."""
    return hashlib.sha256(f"{first_key}/outcome".encode()).hexdigest()


class ResponseCache:
    """One JSON file per answered request (and per outcome mark, :func:`outcome_key`) under
    ``root/<key[:2]>/<key>.json``, written atomically."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root)

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.json"

    def get(self, key: str) -> dict[str, Any] | None:
        path = self._path(key)
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except json.JSONDecodeError:  # never written by us (writes are atomic); treat as missing
            return None

    def put(self, key: str, entry: dict[str, Any]) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(entry, ensure_ascii=False), encoding="utf-8")
        os.replace(tmp, path)

    def __len__(self) -> int:
        return sum(1 for _ in self.root.glob("*/*.json")) if self.root.is_dir() else 0


class RejectsLog:
    """JSONL of requests that ended without a usable answer (one line per request key), appended to as they fail; a
    request answered by a later ``retry_rejected`` round leaves it (:meth:`answered`), so the file lists what is still
    rejected."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self._seen: set[str] = set()
        if self.path.is_file():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    self._seen.add(json.loads(line)["key"])
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue

    def add(self, record: dict[str, Any]) -> None:
        if record["key"] in self._seen:
            return
        self._seen.add(record["key"])
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")

    def answered(self, mark: str) -> None:
        """Drop the records of the request whose outcome mark is ``mark`` (their ``mark`` field): it is answered."""
        if not self.path.is_file():
            return
        kept, dropped = [], set()
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                kept.append(line)
                continue
            if isinstance(record, dict) and record.get("mark") == mark:
                dropped.add(record.get("key"))
            else:
                kept.append(line)
        if dropped:
            write_text_atomically(self.path, "".join(line + "\n" for line in kept))
            self._seen -= dropped


def strip_code_fence(text: str) -> str:
    """Remove a surrounding Markdown code fence (```json ... ```) if the model added one."""
    match = re.fullmatch(r"\s*```[\w-]*\s*\n?(.*?)\n?```\s*", text, flags=re.DOTALL)
    return match.group(1) if match else text


def parse_json_object(text: str, required: Sequence[str] = ()) -> dict[str, Any]:
    """Parse ``text`` as one JSON object that has every key in ``required``; else :class:`MalformedOutput`."""
    try:
        value = json.loads(strip_code_fence(text))
    except json.JSONDecodeError as error:
        raise MalformedOutput(f"not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise MalformedOutput(f"expected a JSON object, got {type(value).__name__}")
    missing = [key for key in required if key not in value]
    if missing:
        raise MalformedOutput(f"JSON object lacks field(s) {missing}")
    return value


def sampling_params(config: LLMConfig) -> dict[str, Any]:
    """The sampling parameters every request carries (part of its cache key)."""
    sampling: dict[str, Any] = {"temperature": config.temperature}
    if config.max_tokens is not None:
        sampling["max_tokens"] = config.max_tokens
    return sampling


class LLMClient:
    """Runs batches of :class:`LLMRequest` against an OpenAI-compatible endpoint.

    Args:
        config: endpoint and retry settings.
        cache_dir: folder of the response cache (created on demand).
        rejects_path: JSONL file receiving requests that failed for good.
        show_progress: draw a tqdm bar per batch.
        count_tokens: text -> tokens, for the prompt-length check against the endpoint's context (the builder's
            training tokenizer); without it a prompt is estimated at :data:`CHARS_PER_TOKEN_ESTIMATE` characters
            per token, fewer tokens than usual vocabularies give, so only surely-too-long prompts are refused.
        retry_rejected: ask again the requests an earlier run rejected (by default they are skipped).
    """

    def __init__(
        self,
        config: LLMConfig,
        cache_dir: str | os.PathLike[str],
        rejects_path: str | os.PathLike[str],
        show_progress: bool = True,
        count_tokens: Callable[[str], int] | None = None,
        retry_rejected: bool = False,
    ):
        self.config = config
        self.retry_rejected = retry_rejected
        self.cache = ResponseCache(cache_dir)
        self.rejects = RejectsLog(rejects_path)
        self.show_progress = show_progress
        self.count_tokens = count_tokens
        self.usage: dict[str, TaskUsage] = {}
        self.structured_refused: str | None = None  # the server's reason, once it refused structured output
        self.structured_accepted = False  # the endpoint answered a request carrying response_format
        self._first_structured: asyncio.Lock | None = None  # one structured request at a time until then
        self.refusals = 0  # requests refused with HTTP 4xx (their reasons: the first SHOWN_REFUSALS on the console)
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
        # Called from inside an event loop (a notebook): run the batch on a private loop in a thread.
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = asyncio.run(coroutine)
            except BaseException as error:  # re-raised in the caller's thread
                box["error"] = error

        thread = threading.Thread(target=target)
        thread.start()
        thread.join()
        if "error" in box:
            raise box["error"]
        return box["value"]

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
        api_key = os.environ.get(self.config.api_key_env)
        if not api_key:
            raise LLMRunAborted(
                f"environment variable {self.config.api_key_env} is not set; export your API key there "
                "(any non-empty value for a local server without authentication)"
            )
        client = openai.AsyncOpenAI(
            api_key=api_key, base_url=self.config.base_url, max_retries=0, timeout=self.config.timeout
        )
        if self.endpoint is None and self.config.context_tokens is None:
            await self._ask_endpoint(api_key)
        del api_key
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
                return list(await asyncio.gather(*tasks))
            except BaseException:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
        finally:
            bar.close()
            await client.close()

    def usage_report(self) -> dict[str, Any]:
        """Per-task token accounting plus totals, as a JSON-ready dict."""
        tasks = {name: vars(usage).copy() for name, usage in sorted(self.usage.items())}
        total: dict[str, Any] = {}
        for usage in tasks.values():
            for key, value in usage.items():
                if isinstance(value, dict):  # rejected_reasons: summed per reason
                    merged = total.setdefault(key, {})
                    for reason, count in value.items():
                        merged[reason] = merged.get(reason, 0) + count
                else:
                    total[key] = total.get(key, 0) + value
        return {"model": self.config.model, "base_url": self.config.base_url, "tasks": tasks, "total": total}

    def context_limit(self) -> tuple[int, str] | None:
        """``(tokens, where from)`` of the endpoint's context, or ``None`` when neither set nor reported."""
        if self.config.context_tokens is not None:
            return self.config.context_tokens, "llm.context_tokens"
        if self.endpoint is not None and self.endpoint.context_tokens is not None:
            return self.endpoint.context_tokens, f"reported by the endpoint's {self.endpoint.context_source}"
        return None

    def prompt_tokens(self, request: LLMRequest) -> tuple[int, str]:
        """``(tokens, how counted)`` of the request's messages, with :data:`MESSAGE_OVERHEAD_TOKENS` per message."""
        overhead = MESSAGE_OVERHEAD_TOKENS * len(request.messages)
        texts = [str(m.get("content", "")) for m in request.messages]
        if self.count_tokens is None:
            return sum(len(t) for t in texts) // CHARS_PER_TOKEN_ESTIMATE + overhead, (
                f"estimated at {CHARS_PER_TOKEN_ESTIMATE} characters per token")
        return sum(self.count_tokens(t) for t in texts) + overhead, "counted with the training tokenizer"

    # ---- internals --------------------------------------------------------------------------

    def _say(self, line: str) -> None:
        tqdm.write(line, file=sys.stderr)

    async def _ask_endpoint(self, api_key: str) -> None:
        """Learn the endpoint's context and slots (:mod:`.endpoint`); say what was learned in one line."""
        from .endpoint import discover

        self.endpoint = await asyncio.to_thread(discover, self.config.base_url, self.config.model, api_key,
                                                min(self.config.timeout, 10.0))
        info = self.endpoint
        if info.context_tokens is not None:
            self._say(f"{self.config.base_url}: context of {info.context_tokens} tokens ({info.context_source}); "
                      "longer prompts are refused before sending")
        if info.slots is not None and info.slots < self.config.max_concurrency:
            self._say(f"{self.config.base_url}: the server decodes {info.slots} request(s) at once (/props "
                      f"total_slots) and llm.max_concurrency is {self.config.max_concurrency}: the others wait in "
                      f"its queue, inside llm.timeout ({self.config.timeout:g} s); set llm.max_concurrency "
                      f"{info.slots} or raise llm.timeout")

    def _structured_refusal(self, error: Any) -> None:
        """The endpoint refused ``response_format``: with ``auto``, fall back to the prompt-only contract (once,
        said once); with ``json_schema`` / ``json_object``, stop the run naming the setting."""
        reason = server_reason(error)
        if self.config.structured != "auto":
            raise LLMRunAborted(
                f"{self.config.base_url} refused structured output (llm.structured={self.config.structured}; HTTP "
                f"{error.status_code}: {reason}); set llm.structured to auto (falls back to the prompt) or off"
            )
        if self.structured_refused is None:
            self.structured_refused = reason
            self._say(f"{self.config.base_url} refused structured output (HTTP {error.status_code}: {reason}); "
                      "llm.structured=auto: asking with the prompt's JSON contract only for the rest of the run")

    def _refusal(self, request: LLMRequest, error: Any) -> str:
        """Count an HTTP 4xx refusal (reason ``http_refused``) and print the server's reason for the first
        :data:`SHOWN_REFUSALS`."""
        self.refusals += 1
        reason = f"HTTP {error.status_code}: {server_reason(error)}"
        if self.refusals <= SHOWN_REFUSALS:
            more = "; further refusals are counted in the summary" if self.refusals == SHOWN_REFUSALS else ""
            self._say(f"{self.config.base_url} refused a {request.task} request ({reason}){more}")
        return reason

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

        usage = self.usage.setdefault(request.task, TaskUsage())
        sampling = sampling_params(self.config)
        outputs: list[dict[str, Any]] = []
        api_calls = 0
        # The outcome mark is keyed on the request without response_format (the sampling alone, attempt 0): the
        # same mark whether structured output is sent, or was refused and the prompt-only contract is used (the
        # answers themselves are keyed on what is sent, sampling and response_format).
        first_key = request_key(self.config.base_url, self.config.model, request, sampling, 0)
        mark_key = outcome_key(first_key)
        mark = self.cache.get(mark_key)
        end = self.config.max_parse_attempts
        if mark is not None and mark.get("outcome") == "rejected":
            if not self.retry_rejected:
                usage.skipped_rejected += 1
                why = f"rejected in an earlier run ({mark['reason']}: {mark['error']})"
                return LLMResult(request, False, error=f"{why}; not asked again (--retry-rejected asks again)")
            end = mark["end"] + self.config.max_parse_attempts  # replay the cached attempts, then new ones
        elif mark is not None:  # answered by an attempt of a retry round
            end = max(end, mark["end"])
        state = {"mark_key": mark_key, "end": end}
        key = ""
        last_code = "malformed"
        limit = self.context_limit()
        if limit is not None and _utf8_bytes(request) + MESSAGE_OVERHEAD_TOKENS * len(request.messages) >= limit[0]:
            tokens, counted = self.prompt_tokens(request)  # tokens <= bytes: a shorter prompt surely fits, uncounted
            if tokens >= limit[0]:
                state["end"] = end - self.config.max_parse_attempts  # no attempt of this round was made
                reason = (f"prompt_too_long: the prompt has {tokens} tokens ({counted}), the endpoint's context is "
                          f"{limit[0]} ({limit[1]}); not sent")
                return self._reject(request, first_key, usage, reason, outputs, 0, 0, "prompt_too_long", state)
        for attempt in range(end):
            entry = None
            while entry is None:  # a second pass only when the endpoint refused structured output (llm.structured)
                sent = {**sampling, **self._structured(request)}  # what is sent is what the key holds
                key = request_key(self.config.base_url, self.config.model, request, sent, attempt)
                entry = self.cache.get(key)
                if entry is not None:
                    usage.cache_hits += 1
                    usage.cached_prompt_tokens += entry["usage"]["prompt_tokens"]
                    usage.cached_completion_tokens += entry["usage"]["completion_tokens"]
                    break
                try:
                    entry = await self._send(client, semaphore, request, sent, usage)
                    if entry is None:  # the endpoint refused structured output while this request waited
                        continue
                except _RetryableError as error:
                    reason = f"{self.config.base_url}: gave up after {self.config.max_retries} retries: {error}"
                    return self._reject(request, key, usage, reason, outputs, attempt + 1, api_calls, "gave_up")
                except openai.APIStatusError as error:  # a request the server refuses (400, 422, ...)
                    if "response_format" in sent and refuses_structured_output(error):
                        self._structured_refusal(error)  # raises unless llm.structured is auto; not a rejection
                        continue
                    state["end"] = attempt + 1
                    reason = self._refusal(request, error)
                    return self._reject(request, key, usage, f"{type(error).__name__}: {reason}", outputs,
                                        attempt + 1, api_calls, "http_refused", state)
                api_calls += 1
                if entry["text"].strip():  # an empty answer (a broken endpoint) is never cached: a rerun asks again
                    self.cache.put(key, {"key": key, "task": request.task, **entry})
            text = entry["text"]
            try:
                if not text.strip():
                    raise MalformedOutput(f"{self.config.base_url} returned an empty answer")
                value = parse(text) if parse is not None else text
                if check is not None:
                    value = check(request, value)
            except MalformedOutput as error:
                last_code = "quality" if isinstance(error, RejectedOutput) else "malformed"
                if last_code == "quality":
                    usage.quality_rejected += 1
                else:
                    usage.malformed += 1
                outputs.append({"attempt": attempt, "text": text, "error": str(error)})
                continue
            if mark is not None:  # a retry round answered: later reruns replay up to this attempt
                self.cache.put(mark_key, {"key": mark_key, "task": request.task, "outcome": "answered",
                                          "end": attempt + 1})
                if mark.get("outcome") == "rejected":
                    self.rejects.answered(mark_key)
            return LLMResult(request, True, value=value, text=text, attempts=attempt + 1, api_calls=api_calls)
        what = "output failing the quality gates" if last_code == "quality" else "malformed output"
        reason = f"{what} in all {end} attempts"  # more than max_parse_attempts in a --retry-rejected round
        return self._reject(request, key, usage, reason, outputs, end, api_calls, last_code, state)

    def _reject(
        self,
        request: LLMRequest,
        key: str,
        usage: TaskUsage,
        reason: str,
        outputs: list[dict[str, Any]],
        attempts: int,
        api_calls: int,
        code: str,
        state: dict[str, Any] | None = None,
    ) -> LLMResult:
        """Record a request that failed for good; ``state`` (``mark_key``, ``end``) marks it in the cache so a
        rerun skips it unless ``retry_rejected`` (transient failures pass no state: a rerun asks again)."""
        usage.rejected += 1
        usage.rejected_reasons[code] = usage.rejected_reasons.get(code, 0) + 1
        self.rejects.add(
            {"key": key, "kind": "request", "task": request.task, "meta": request.meta, "reason": code,
             "error": reason, "attempts": attempts, "outputs": outputs,
             **({"mark": state["mark_key"]} if state is not None else {})}
        )
        if state is not None:
            self.cache.put(state["mark_key"], {"key": state["mark_key"], "task": request.task, "outcome": "rejected",
                                               "reason": code, "error": reason, "end": state["end"]})
        return LLMResult(request, False, error=reason, attempts=attempts, api_calls=api_calls)

    def _structured(self, request: LLMRequest) -> dict[str, Any]:
        return structured_params(self.config, request, refused=self.structured_refused is not None)

    async def _send(
        self,
        client: Any,
        semaphore: asyncio.Semaphore,
        request: LLMRequest,
        sent: dict[str, Any],
        usage: TaskUsage,
    ) -> dict[str, Any] | None:
        """:meth:`_call`, except that until the endpoint has answered one request carrying ``response_format``,
        such requests go one at a time: a server that refuses structured output refuses one request, not every
        request of the first wave. ``None``: it was refused while this request waited (ask without it)."""
        if "response_format" in sent and not self.structured_accepted:
            assert self._first_structured is not None
            async with self._first_structured:
                if not self.structured_accepted:
                    if "response_format" not in self._structured(request):
                        return None
                    entry = await self._call(client, semaphore, request, sent, usage)
                    self.structured_accepted = True
                    return entry
        return await self._call(client, semaphore, request, sent, usage)

    async def _call(
        self,
        client: Any,
        semaphore: asyncio.Semaphore,
        request: LLMRequest,
        sampling: dict[str, Any],
        usage: TaskUsage,
    ) -> dict[str, Any]:
        """One answered call (retrying transient failures); returns the cache entry body."""
        import openai

        delay = self.config.backoff_initial
        for retry in range(self.config.max_retries + 1):
            try:
                async with semaphore:
                    response = await client.chat.completions.create(
                        model=self.config.model, messages=request.messages, **sampling, **request.params
                    )
                if not isinstance(getattr(response, "choices", None), list):  # openai returns a non-JSON body as str
                    raise ValueError(f"got {str(response)[:200]!r}")
            except (openai.AuthenticationError, openai.PermissionDeniedError, openai.NotFoundError) as error:
                raise LLMRunAborted(
                    f"{self.config.base_url} refused the request ({type(error).__name__}, HTTP {error.status_code}); "
                    f"check {self.config.api_key_env}, the model name {self.config.model!r} and the base URL"
                ) from None
            except (openai.APITimeoutError, openai.APIConnectionError) as error:
                failure = _RetryableError(f"{type(error).__name__}: {error}")
            except (ValueError, openai.APIResponseValidationError) as error:  # a 200 whose body is not a completion
                failure = _RetryableError(f"the response body is not a chat completion ({type(error).__name__}: "
                                          f"{error})")
            except openai.APIStatusError as error:
                if error.status_code not in RETRYABLE_STATUS and error.status_code < 500:
                    raise
                failure = _RetryableError(f"HTTP {error.status_code}", _retry_after(error))
            else:
                text = response.choices[0].message.content if response.choices else None
                counts = response.usage
                prompt_tokens = int(getattr(counts, "prompt_tokens", 0) or 0)
                completion_tokens = int(getattr(counts, "completion_tokens", 0) or 0)
                usage.api_calls += 1
                usage.prompt_tokens += prompt_tokens
                usage.completion_tokens += completion_tokens
                return {
                    "text": text or "",
                    "finish_reason": response.choices[0].finish_reason if response.choices else None,
                    "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens},
                    "created": time.time(),
                }
            if retry == self.config.max_retries:
                raise failure
            usage.retries += 1
            wait = failure.retry_after if failure.retry_after is not None else delay * (0.5 + random.random())
            await asyncio.sleep(min(wait, self.config.backoff_max))
            delay = min(delay * 2, self.config.backoff_max)
        raise AssertionError("unreachable")


def _utf8_bytes(request: LLMRequest) -> int:
    return sum(len(str(m.get("content", "")).encode("utf-8")) for m in request.messages)


def _retry_after(error: Any) -> float | None:
    """Seconds the server asks to wait: its ``retry-after-ms`` header, else ``Retry-After`` in seconds
    (the HTTP-date form is ignored: the backoff applies)."""
    response = getattr(error, "response", None)
    if response is None:
        return None
    for header, scale in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        try:
            return float(response.headers[header]) / scale
        except (KeyError, ValueError):
            continue
    return None
