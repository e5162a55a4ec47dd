"""The client's settings (:class:`LLMConfig`), one request (:class:`LLMRequest`), its outcome (:class:`LLMResult`),
the parameters every request carries (part of its cache key), one task's token accounting (:class:`TaskUsage`), and
the error that stops a whole run (:class:`LLMRunAborted`). Nothing here sends a request or touches a file."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from pydantic import Field, field_validator

from ..config import StrictModel
from ..errors import LongpeftError


class LLMConfig(StrictModel):
    """Endpoint and behaviour of :class:`.llm_client.LLMClient`. There is deliberately no field for the key."""

    base_url: str = Field("https://api.openai.com/v1", description="OpenAI-compatible endpoint (…/v1)")
    model: str = Field("gpt-4o", description="model name sent with every request")
    api_key_env: str = Field("OPENAI_API_KEY", description="environment variable holding the API key")
    max_concurrency: int = Field(8, ge=1, description="requests in flight at once")
    max_retries: int = Field(
        3, ge=0, description="retries of one attempt on 408/409/429/5xx, timeouts, connection errors, non-completions"
    )
    backoff_initial: float = Field(1.0, ge=0, description="first backoff in seconds; doubles per retry")
    backoff_max: float = Field(60.0, ge=0, description="cap on one backoff (and on Retry-After) in seconds")
    timeout: float = Field(
        120.0, gt=0, description="seconds before one HTTP request times out, its wait in the server's queue included"
    )
    max_parse_attempts: int = Field(3, ge=1, description="attempts per request when the output is malformed")
    temperature: float = Field(0.7, ge=0, description="sampling temperature")
    max_tokens: int | None = Field(4096, ge=1, description="completion token limit per request")
    structured: Literal["auto", "json_schema", "json_object", "off"] = Field(
        "auto",
        description="response_format sent: the answer's JSON schema, any JSON object, or none; 'auto' falls back to "
        "'off' once the endpoint refuses or ignores the schema, where the others stop the run (docs/synth.md)",
    )
    context_tokens: int | None = Field(
        None,
        ge=1,
        description="tokens one request may hold at the endpoint (a longer prompt is rejected before sending); "
        "unset: what the server reports at the start, else no check",
    )
    tokenizer: str | None = Field(
        None,
        description="the endpoint model's tokenizer (folder or Hub id), to count prompts when the server has no "
        "/tokenize; unset: an estimate of one token per word, which errs short. Never the training tokenizer",
    )
    check_timeout: float = Field(
        30.0, gt=0, description="seconds the whole synth --check-endpoint waits for the endpoint; --check-timeout"
    )

    @property
    def lookup_timeout(self) -> float:
        """Seconds for each lookup outside the chat route (the server's facts, its tokenizer): at most 10."""
        return min(self.timeout, 10.0)

    @field_validator("structured", mode="before")
    @classmethod
    def _bare_off(cls, value: Any) -> Any:
        """YAML reads a bare ``off`` (``structured: off``, ``--set llm.structured=off``) as ``false``."""
        return "off" if value is False else value


ITEM_BOUNDS = ("minItems", "maxItems")  # bound a list's length: sent until the endpoint refuses a schema with them


class ResponseSchema(Protocol):
    """What the client needs of an answer's schema (:class:`.answer_schema.OutputSchema`)."""

    def response_format(self, bounds: bool = False) -> dict[str, Any]:
        """The ``response_format`` request field asking for the schema (with its item bounds when ``bounds``)."""
        ...


class LLMRunAborted(LongpeftError, RuntimeError):
    """An error no retry can fix (bad key, unknown model or endpoint): the whole run stops."""


def read_api_key(config: LLMConfig) -> str:
    """The API key, from the environment variable ``config.api_key_env``; :class:`LLMRunAborted` when it is unset."""
    if not (key := os.environ.get(config.api_key_env)):
        raise LLMRunAborted(
            f"environment variable {config.api_key_env} is not set; export your API key there "
            "(any non-empty value for a local server without authentication)"
        )
    return key


@dataclass
class LLMRequest:
    """One chat-completion request; all but ``meta`` is part of its cache key (the schema as the response_format
    sent)."""

    task: str  # accounting bucket ("single_detail")
    messages: list[dict[str, str]]  # [{"role": ..., "content": ...}]
    params: dict[str, Any] = field(default_factory=dict)  # extra request parameters
    meta: dict[str, Any] = field(default_factory=dict)  # free-form identifiers written to the rejects file
    schema: ResponseSchema | None = None  # the answer's JSON schema, sent as llm.structured says (.answer_schema)


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
    truncated: int = 0  # attempts cut off at max_tokens (finish_reason length), never parsed
    rejected: int = 0
    rejected_reasons: dict[str, int] = field(default_factory=dict)  # ``rejected`` per reason (REJECT_REASONS)
    skipped_rejected: int = 0  # requests rejected in an earlier run, not asked again (no --retry-rejected)
    gave_up_causes: dict[str, int] = field(default_factory=dict)  # ``gave_up`` rejections per cause (RetryableError)


def is_count(value: Any) -> bool:
    """Whether ``value`` is a JSON count: a non-negative integer, not a boolean."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def sampling_params(config: LLMConfig) -> dict[str, Any]:
    """The sampling parameters every request carries (part of its cache key)."""
    sampling: dict[str, Any] = {"temperature": config.temperature}
    if config.max_tokens is not None:
        sampling["max_tokens"] = config.max_tokens
    return sampling


def structured_params(
    config: LLMConfig, request: LLMRequest, refused: bool = False, bounds: bool = True
) -> dict[str, Any]:
    """The ``response_format`` parameter ``request`` carries under ``config.structured``: none under ``off``, without
    a schema, or under ``auto`` once the endpoint ``refused`` it; the schema's item bounds unless ``bounds`` is
    false. Part of the cache key."""
    if request.schema is None or config.structured == "off" or (config.structured == "auto" and refused):
        return {}
    if config.structured == "json_object":
        return {"response_format": {"type": "json_object"}}
    return {"response_format": request.schema.response_format(bounds=bounds)}
