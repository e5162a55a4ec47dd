"""`longpeft synth --check-endpoint`: one small request to the configured endpoint, before a long run.

It reports the model that answered, the latency of a one-question request, whether structured
output works (the request asks for the QA schema the builders use, :data:`.answer_schema.QA_PAIRS`,
as ``llm.structured`` would send it: ``json_object`` when so configured, else ``json_schema``; on a
refusal it asks again without it), whether the answer passes the builders' parser, and the context
length and slots when the server reports them (:mod:`.endpoint`). Nothing is cached or written.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from .answer_schema import QA_PAIRS
from .corpus import Document
from .endpoint import EndpointInfo, discover
from .llm_http import refuses_structured_output, server_reason
from .llm_output import MalformedOutput
from .llm_request import LLMConfig, LLMRunAborted
from .qa import Passage, QAJob, job_request, parse_qa_pairs

CHECK_TEXT = (
    "The lighthouse of Port Elwen was built in 1871 by the engineer Mara Quill. Its lamp burned whale oil "
    "until 1903, when it was converted to electricity."
)
CHECK_MAX_TOKENS = 256  # a one-question answer fits; a slow endpoint shows in the latency, not in a long answer


@dataclass
class EndpointCheck:
    """What the check found.

    Attributes:
        answered_model: the model name in the answer (servers often report their own).
        latency_s: seconds of the answered request (structured, or plain after a refusal).
        completion_tokens: tokens of that answer, as the server counted them.
        structured_sent: the ``response_format`` type tried (``json_schema`` or ``json_object``).
        structured_refusal: the server's reason when it refused structured output, else ``None``.
        parse_error: why the answer fails the builders' parser, else ``None``.
        info: context length and slots, as the server reports them.
    """

    config: LLMConfig
    answered_model: str
    latency_s: float
    completion_tokens: int
    structured_sent: str
    structured_refusal: str | None
    parse_error: str | None
    info: EndpointInfo

    @property
    def usable(self) -> bool:
        """The run would work as configured: an answer that parses, and no refused structured output that
        ``llm.structured`` would not fall back from."""
        stops = self.structured_refusal is not None and self.config.structured in ("json_schema", "json_object")
        return self.parse_error is None and not stops

    def report(self) -> str:
        config, info = self.config, self.info
        listed = f"; the server lists {', '.join(info.models)}" if info.models else ""
        lines = [
            f"endpoint    {config.base_url}",
            f"model       {config.model} (answered as {self.answered_model!r}{listed})",
            f"latency     {self.latency_s:.2f} s for a one-question request ({self.completion_tokens} completion "
            "tokens)",
        ]
        if self.structured_refusal is None:
            structured = f"yes: {self.structured_sent} accepted"
        else:
            then = {
                "auto": "llm.structured=auto falls back to the prompt's JSON contract",
                "off": "llm.structured=off does not ask for it",
            }.get(config.structured, f"llm.structured={config.structured} would stop the run: set auto or off")
            structured = f"no: {self.structured_sent} refused ({self.structured_refusal}); {then}"
        lines.append(f"structured  {structured}")
        lines.append(
            "answer      "
            + (
                "passes the builders' parser"
                if self.parse_error is None
                else f"fails the builders' parser: {self.parse_error}"
            )
        )
        if info.context_tokens is not None:
            lines.append(
                f"context     {info.context_tokens} tokens ({info.context_source})"
                + (
                    f"; llm.context_tokens={config.context_tokens} is used instead"
                    if config.context_tokens is not None
                    else ""
                )
            )
        else:
            lines.append(
                "context     not reported"
                + (
                    ""
                    if config.context_tokens is not None
                    else ": set llm.context_tokens to refuse longer prompts before sending"
                )
            )
        if info.slots is not None:
            advice = (
                f"; llm.max_concurrency is {config.max_concurrency}: set it to {info.slots}, or raise "
                "llm.timeout (it counts the time a request waits in the server's queue)"
                if info.slots < config.max_concurrency
                else ""
            )
            lines.append(f"slots       {info.slots} request(s) decoded at once (/props total_slots){advice}")
        lines.append("result      " + ("usable as configured" if self.usable else "NOT usable as configured"))
        return "\n".join(lines)


def check_endpoint(config: LLMConfig) -> EndpointCheck:
    """Run the check against ``config``'s endpoint; an unreachable endpoint, a bad key or model, or a refused
    request raise :class:`~.llm_request.LLMRunAborted` naming what to fix."""
    import openai

    api_key = os.environ.get(config.api_key_env)
    if not api_key:
        raise LLMRunAborted(
            f"environment variable {config.api_key_env} is not set; export your API key there "
            "(any non-empty value for a local server without authentication)"
        )
    info = discover(config.base_url, config.model, api_key, min(config.timeout, 10.0))
    client = openai.OpenAI(api_key=api_key, base_url=config.base_url, max_retries=0, timeout=config.timeout)
    request = job_request(
        QAJob("single_detail", [Passage(Document("check", "Port Elwen", CHECK_TEXT), 0, len(CHECK_TEXT))], 1)
    )
    kind = "json_object" if config.structured == "json_object" else "json_schema"
    response_format = {"type": "json_object"} if kind == "json_object" else QA_PAIRS.response_format()
    refusal = None
    try:
        try:
            start = time.monotonic()
            response = client.chat.completions.create(
                model=config.model,
                messages=request.messages,
                temperature=config.temperature,
                max_tokens=CHECK_MAX_TOKENS,
                response_format=response_format,
            )
        except openai.APIStatusError as error:
            if not refuses_structured_output(error):
                raise
            refusal = f"HTTP {error.status_code}: {server_reason(error)}"
            start = time.monotonic()
            response = client.chat.completions.create(
                model=config.model,
                messages=request.messages,
                temperature=config.temperature,
                max_tokens=CHECK_MAX_TOKENS,
            )
        latency = time.monotonic() - start
    except (openai.APITimeoutError, openai.APIConnectionError) as error:
        raise LLMRunAborted(
            f"cannot reach {config.base_url} ({type(error).__name__}: {error}); check llm.base_url "
            f"and that the server runs (llm.timeout is {config.timeout:g} s)"
        ) from None
    except openai.APIStatusError as error:
        raise LLMRunAborted(
            f"{config.base_url} refused the check request (HTTP {error.status_code}: "
            f"{server_reason(error)}); check {config.api_key_env}, llm.model {config.model!r} and "
            "llm.base_url"
        ) from None
    finally:
        client.close()
    choices = getattr(response, "choices", None)
    if not isinstance(choices, list) or not choices:
        raise LLMRunAborted(
            f"{config.base_url} answered with something that is not a chat completion: "
            f"{str(response)[:200]!r}; check llm.base_url (it ends in /v1)"
        )
    text = choices[0].message.content or ""
    try:
        parse_qa_pairs(text)
        parse_error = None
    except MalformedOutput as error:
        parse_error = f"{error} (answer: {text[:120]!r})"
    usage = getattr(response, "usage", None)
    return EndpointCheck(
        config=config,
        answered_model=str(getattr(response, "model", "") or "?"),
        latency_s=latency,
        completion_tokens=int(getattr(usage, "completion_tokens", 0) or 0),
        structured_sent=kind,
        structured_refusal=refusal,
        parse_error=parse_error,
        info=info,
    )
