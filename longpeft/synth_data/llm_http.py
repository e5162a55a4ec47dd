"""One chat-completion call over HTTP, as the client makes it: the retries and backoff of one attempt, and what
the server's errors say.

:func:`chat_completion` sends one request through an ``openai.AsyncOpenAI`` client (built without retries of its
own) and retries transient failures (:data:`RETRYABLE_STATUS`, every 5xx, timeouts, connection errors, a 200 whose
body is not a chat completion) with exponential backoff, or the wait the server asks (``retry-after-ms``,
``Retry-After``), capped at ``backoff_max``. Out of retries it raises :class:`RetryableError`; a bad key, model or
URL raises :class:`.llm_request.LLMRunAborted`; any other refusal (HTTP 4xx) reaches the caller as the
``openai.APIStatusError`` it is, whose server reason :func:`server_reason` reads and whose refusal of structured
output :func:`refuses_structured_output` recognizes. Nothing here caches or writes a file.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from typing import Any

from .llm_request import LLMConfig, LLMRequest, LLMRunAborted, TaskUsage


class RetryableError(Exception):
    """A transient failure (see :func:`chat_completion`) that outlasted the retries; ``retry_after``: the seconds
    the server asked to wait, if it did."""

    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


RETRYABLE_STATUS = (408, 409, 429)  # and every 5xx (the statuses the openai client itself retries)


# Words of a 400/422 body that refuses structured output (OpenAI: "Invalid parameter: 'response_format' of type
# 'json_schema' is not supported with this model"; vLLM/FastAPI validation: loc ["body", "response_format"];
# llama.cpp: "JSON schema conversion failed"; TGI: "grammar is not supported"; vLLM: "guided decoding").
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
    """Whether an HTTP error answers a request carrying ``response_format`` by refusing structured output: status
    400 or 422 whose body names the feature (:data:`STRUCTURED_REFUSAL`). Other 400s (a prompt beyond the
    context, a bad parameter) are about the request itself: falling back would hide them and double the cost."""
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
    """One answered call of ``request`` with ``sampling`` (the parameters sent, ``response_format`` included)
    through the ``openai.AsyncOpenAI`` ``client``, holding the ``semaphore`` (the requests in flight) while it waits,
    retrying transient failures and counting the call, its tokens and its retries in ``usage``; returns the cache
    entry body (``text``, ``finish_reason``, ``usage``, ``created``)."""
    import openai

    delay = config.backoff_initial
    for retry in range(config.max_retries + 1):
        try:
            async with semaphore:
                response = await client.chat.completions.create(
                    model=config.model, messages=request.messages, **sampling, **request.params
                )
            if not isinstance(getattr(response, "choices", None), list):  # openai returns a non-JSON body as str
                raise ValueError(f"got {str(response)[:200]!r}")
        except (openai.AuthenticationError, openai.PermissionDeniedError, openai.NotFoundError) as error:
            raise LLMRunAborted(
                f"{config.base_url} refused the request ({type(error).__name__}, HTTP {error.status_code}); "
                f"check {config.api_key_env}, the model name {config.model!r} and the base URL"
            ) from None
        except (openai.APITimeoutError, openai.APIConnectionError) as error:
            failure = RetryableError(f"{type(error).__name__}: {error}")
        except (ValueError, openai.APIResponseValidationError) as error:  # a 200 whose body is not a completion
            failure = RetryableError(f"the response body is not a chat completion ({type(error).__name__}: {error})")
        except openai.APIStatusError as error:
            if error.status_code not in RETRYABLE_STATUS and error.status_code < 500:
                raise
            failure = RetryableError(f"HTTP {error.status_code}", _retry_after(error))
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
    response = getattr(error, "response", None)
    if response is None:
        return None
    for header, scale in (("retry-after-ms", 1000.0), ("retry-after", 1.0)):
        try:
            return float(response.headers[header]) / scale
        except (KeyError, ValueError):
            continue
    return None
