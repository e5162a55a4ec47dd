"""One chat-completion call over HTTP with its retries (:func:`chat_completion`), what the server's errors say
(:func:`server_reason`, :func:`refuses_structured_output`) and what its answer holds (:func:`read_completion`).
Nothing here caches or writes a file."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from dataclasses import dataclass
from typing import Any

from .llm_request import LLMConfig, LLMRequest, LLMRunAborted, TaskUsage, is_count


class RetryableError(Exception):
    """A transient failure (see :func:`chat_completion`) that outlasted the retries. ``cause``: the failure in a few
    words, the same for failures of one kind (``"HTTP 503"``, ``"connection failed"``), which give-ups are counted
    by; ``retry_after``: the seconds the server asked to wait, if it did."""

    def __init__(self, message: str, cause: str, retry_after: float | None = None):
        super().__init__(message)
        self.cause = cause
        self.retry_after = retry_after


class NotACompletion(ValueError):
    """An HTTP 200 whose body is not a chat completion (not JSON, no ``choices`` list, no message text); the message
    says what is missing and quotes the body."""


@dataclass
class Completion:
    """What one chat-completion body holds (a field the server left out: empty, None or 0)."""

    text: str  # the first choice's message text
    finish_reason: str | None  # why generation stopped: "stop", "length", ...
    prompt_tokens: int
    completion_tokens: int
    model: str  # the model name the server answered with


def body_excerpt(body: bytes | str, limit: int = 160) -> str:
    """The start of an HTTP body as a quoted one-line string (bytes decoded as UTF-8, invalid bytes replaced), with
    ``...`` when cut: what messages quote of an answer."""
    text = body.decode("utf-8", errors="replace") if isinstance(body, bytes) else body
    return repr(text[:limit]) + ("..." if len(text) > limit else "")


def read_completion(body: bytes) -> Completion:
    """The :class:`Completion` in a chat-completion body (JSON, UTF-8); :class:`NotACompletion` for a body of any
    other shape. The message text may be a string, ``null``, or a list of ``{"type": "text", "text": ...}`` parts."""
    try:
        value = json.loads(body.decode("utf-8"))
    except ValueError:  # UnicodeDecodeError and JSONDecodeError alike
        raise NotACompletion(f"the body is not JSON: {body_excerpt(body)}") from None
    choices = value.get("choices") if isinstance(value, dict) else None
    if not isinstance(choices, list):
        raise NotACompletion(f"the body has no 'choices' list: {body_excerpt(body)}")
    text, finish_reason = "", None
    if choices:
        message = choices[0].get("message") if isinstance(choices[0], dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and all(
            isinstance(part, dict) and isinstance(part.get("text"), str) for part in content
        ):
            content = "".join(part["text"] for part in content)
        if not isinstance(message, dict) or not isinstance(content, (str, type(None))):
            raise NotACompletion(f"choices[0] holds no message text: {body_excerpt(body)}")
        text = content or ""
        reason = choices[0].get("finish_reason")
        finish_reason = reason if isinstance(reason, str) else None
    usage = value.get("usage") if isinstance(value.get("usage"), dict) else {}
    tokens = [usage[name] if is_count(usage.get(name)) else 0 for name in ("prompt_tokens", "completion_tokens")]
    model = value.get("model")
    return Completion(text, finish_reason, *tokens, model if isinstance(model, str) else "")


RETRYABLE_STATUS = (408, 409, 429)  # and every 5xx (the statuses the openai client itself retries)


# Words of a 400/422 body that refuses structured output (OpenAI's "'response_format' of type 'json_schema' is not
# supported", FastAPI's loc ["body", "response_format"], llama.cpp's "JSON schema conversion failed", TGI's "grammar
# is not supported", vLLM's "guided decoding")
STRUCTURED_REFUSAL = re.compile(r"response_format|json_schema|schema|grammar|structured output|guided", re.I)


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
    """Whether an HTTP error refuses the structured output a request asked for: status 400 or 422 whose body names
    the feature (:data:`STRUCTURED_REFUSAL`). Other 400s are about the request itself (a long prompt, a bad
    parameter)."""
    if getattr(error, "status_code", None) not in (400, 422):
        return False
    body = getattr(error, "body", None)
    return bool(STRUCTURED_REFUSAL.search(f"{server_reason(error)} {json.dumps(body, default=str)}"))


async def chat_completion(
    config: LLMConfig,
    client: Any,
    semaphore: asyncio.Semaphore,
    request: LLMRequest,
    sampling: dict[str, Any],
    usage: TaskUsage,
) -> dict[str, Any]:
    """One answered call of ``request`` with the parameters ``sampling`` through the ``openai.AsyncOpenAI``
    ``client`` (built without retries), holding ``semaphore`` while it waits; counts the call, its tokens and retries
    in ``usage`` and returns the cache entry body (``text``, ``finish_reason``, ``usage``, ``created``). Transient
    failures (:data:`RETRYABLE_STATUS`, 5xx, timeouts, connection errors, a 200 that is not a chat completion) are
    retried with exponential backoff or the wait the server asks, capped at ``backoff_max``, then raise
    :class:`RetryableError`. A bad key, model or URL raises :class:`.llm_request.LLMRunAborted`; another 4xx raises
    the ``openai.APIStatusError`` it is."""
    import openai

    delay = config.backoff_initial
    for retry in range(config.max_retries + 1):
        try:
            async with semaphore:
                raw = await client.chat.completions.with_raw_response.create(
                    model=config.model, messages=request.messages, **sampling, **request.params
                )
            answer = read_completion(raw.content)
        except (openai.AuthenticationError, openai.PermissionDeniedError, openai.NotFoundError) as error:
            raise LLMRunAborted(
                f"{config.base_url} refused the request ({type(error).__name__}, HTTP {error.status_code}); "
                f"check {config.api_key_env}, the model name {config.model!r} and the base URL"
            ) from None
        except openai.APITimeoutError:
            cause = f"no answer within llm.timeout ({config.timeout:g} s)"
            failure = RetryableError(cause, cause)
        except openai.APIConnectionError as error:
            failure = RetryableError(f"connection failed ({error.__cause__ or error})", "connection failed")
        except NotACompletion as error:
            failure = RetryableError(f"HTTP 200 but not a chat completion: {error}", "a 200 that is not a completion")
        except openai.APIStatusError as error:
            if error.status_code not in RETRYABLE_STATUS and error.status_code < 500:
                raise
            reason = f"HTTP {error.status_code}"
            failure = RetryableError(f"{reason}: {server_reason(error)}", reason, _retry_after(error))
        else:
            usage.api_calls += 1
            usage.prompt_tokens += answer.prompt_tokens
            usage.completion_tokens += answer.completion_tokens
            return {
                "text": answer.text,
                "finish_reason": answer.finish_reason,
                "usage": {"prompt_tokens": answer.prompt_tokens, "completion_tokens": answer.completion_tokens},
                "created": time.time(),
            }
        if retry == config.max_retries:
            raise failure
        usage.retries += 1
        wait = failure.retry_after if failure.retry_after is not None else delay * (0.5 + random.random())
        await asyncio.sleep(min(wait, config.backoff_max))
        delay = min(delay * 2, config.backoff_max)
    raise AssertionError("unreachable")


def _retry_after(error: Any) -> float | None:
    """Seconds the server asks to wait: its ``retry-after-ms`` header, else ``Retry-After`` in seconds
    (the HTTP-date form is ignored: the backoff applies)."""
    headers = getattr(getattr(error, "response", None), "headers", {})
    for header, scale in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        try:
            return float(headers[header]) / scale
        except (KeyError, ValueError):
            continue
    return None
