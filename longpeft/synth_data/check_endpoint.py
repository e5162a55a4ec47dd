"""`longpeft synth --check-endpoint` (docs/synth.md): the server's facts, the run's first request as the run sends
it (a smaller ``max_tokens``), its answer judged as the run judges it, a probe asking for a plain word under the same
kind of ``response_format`` and, after a refusal of ``response_format``, the request again without the item bounds,
then without it; all within ``llm.check_timeout``, each wait announced on stderr. A failure raises
:class:`~.llm_request.LLMRunAborted`: one line naming the server, what was awaited, a quote of the answer and the
fix. Nothing is cached or written.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .answer_schema import MalformedOutput, OutputSchema, judge_answer, object_schema
from .corpus import Document
from .endpoint import EndpointInfo, HttpAnswer, NoHttpAnswer, discover, http_json
from .llm_http import (
    Completion,
    NotACompletion,
    body_excerpt,
    read_completion,
    refuses_structured_output,
    server_reason,
)
from .llm_request import LLMConfig, LLMRunAborted, read_api_key, sampling_params, structured_params
from .qa import Passage, QAJob, job_request
from .registry import get_task

CHECK_TEXT = (
    "The lighthouse of Port Elwen was built in 1871 by the engineer Mara Quill. Its lamp burned whale oil "
    "until 1903, when it was converted to electricity."
)
CHECK_MAX_TOKENS = 256  # a one-question answer fits; a slow endpoint shows in the latency, not in a long answer
LOOKUP_TIMEOUT = 5.0  # seconds for each of the server's self-description lookups, within the deadline
PROBE_MESSAGES = [
    {"role": "user", "content": "Reply with the single word OK as plain text: no JSON, no quotes, nothing else."}
]
PROBE_SCHEMA = OutputSchema("probe", object_schema({"word": {"type": "string"}}))
PROBE_MAX_TOKENS = 64  # {"word": "OK"} takes a handful of tokens
CHECK_TASK = "single_detail"  # the task of the QA request checked: one question over CHECK_TEXT


@dataclass
class EndpointCheck:
    """What the check saw, and its requests to one endpoint, each within what is left of the deadline
    (``llm.check_timeout``) and announced by ``say``."""

    config: LLMConfig
    api_key: str = field(repr=False)
    say: Callable[[str], None] = field(repr=False)
    end: float = field(init=False)  # time.monotonic() of the deadline
    info: EndpointInfo = field(default_factory=EndpointInfo)  # what the server says about itself
    answer: Completion = field(default_factory=lambda: Completion("", None, 0, 0, ""))  # to the last QA request sent
    latency_s: float = 0.0  # of that request
    structured_sent: str | None = None  # the response_format type the run sends first; None under off
    structured_refusal: str | None = None  # the server's reason when it refused response_format
    bounds_refusal: str | None = None  # the server's reason when it refused the schema's item bounds
    enforced: bool | None = None  # the probe's verdict; None: not probed, or its answer proves nothing
    probe_answer: str | None = None  # a quote of the probe's answer (or of its HTTP error)
    answer_follows: bool | None = None  # the QA answer is bare JSON of the schema sent; None: none sent, or no proof
    parse_error: str | None = None  # why the builders' parser refuses the QA answer

    def __post_init__(self) -> None:
        self.end = time.monotonic() + self.config.check_timeout

    @property
    def usable(self) -> bool:
        """The run would work as configured: an answer that parses, and no refused or ignored structured output
        that ``llm.structured`` (``json_schema``, ``json_object``) would not fall back from."""
        explicit = self.config.structured in ("json_schema", "json_object")
        stops = explicit and (self.structured_refusal is not None or self.enforced is False)
        return (self.parse_error is None or self.cut_short) and not stops

    @property
    def cut_short(self) -> bool:
        """The answer stopped at the check's own ``max_tokens``, below the run's: what the parser says of it tells
        nothing of the run's whole answers."""
        run_max = self.config.max_tokens
        return self.answer.finish_reason == "length" and (run_max is None or run_max > self.max_tokens)

    def report(self) -> str:
        """The check's report, one line per finding."""
        config, info, answer = self.config, self.info, self.answer
        listed = f"; the server lists {', '.join(info.models)}" if info.models else ""
        sent = f"response_format {self.structured_sent}" if self.structured_sent else "no response_format"
        lines = [
            f"endpoint    {config.base_url} (checked within {config.check_timeout:g} s: --check-timeout)",
            f"model       {config.model} (answered as {answer.model or '?'!r}{listed})",
            f"latency     {self.latency_s:.2f} s for a one-question request ({answer.completion_tokens} completion "
            "tokens)",
            f"request     as the run sends it under llm.structured={config.structured}: {sent}, temperature "
            f"{config.temperature:g}; max_tokens {self.max_tokens} here ({self._run_max} in the run)",
            f"structured  {self._structured_line()}",
            f"answer      {self._answer_line()}",
        ]
        own = config.context_tokens is not None  # llm.context_tokens set: the server's figure is not used
        if info.context_tokens is not None:
            used = f"; llm.context_tokens={config.context_tokens} is used instead" if own else ""
            lines.append(f"context     {info.context_tokens} tokens ({info.context_source}){used}")
        else:
            advice = "" if own else ": set llm.context_tokens to refuse longer prompts before sending"
            lines.append(f"context     not reported{advice}")
        if info.slots is not None:
            advice = (
                f"; llm.max_concurrency is {config.max_concurrency}: set it to {info.slots}, or raise "
                "llm.timeout (it counts the time a request waits in the server's queue)"
                if info.slots < config.max_concurrency
                else ""
            )
            lines.append(f"slots       {info.slots} request(s) decoded at once (/props total_slots){advice}")
        seen = " as far as seen (the answer was cut short)" if self.usable and self.parse_error is not None else ""
        lines.append("result      " + (f"usable as configured{seen}" if self.usable else "NOT usable as configured"))
        return "\n".join(lines)

    @property
    def _run_max(self) -> str:
        return f"llm.max_tokens {self.config.max_tokens}" if self.config.max_tokens else "no max_tokens"

    @property
    def max_tokens(self) -> int:
        """The QA request's ``max_tokens``: the run's, at most :data:`CHECK_MAX_TOKENS`."""
        return min(self.config.max_tokens or CHECK_MAX_TOKENS, CHECK_MAX_TOKENS)

    def _structured_line(self) -> str:
        kind, mode = self.structured_sent, self.config.structured
        stops = f"llm.structured={mode} would stop the run: set auto or off"
        if kind is None:
            return (
                "not asked: llm.structured=off sends no response_format (the prompt states the JSON contract and the "
                "parser checks the schema)"
            )
        if self.structured_refusal is not None:
            then = "llm.structured=auto falls back to the prompt's JSON contract" if mode == "auto" else stops
            return f"no: {kind} refused ({self.structured_refusal}); {then}"
        probe = "a one-field schema" if kind == "json_schema" else "json_object"
        if self.bounds_refusal is not None:
            probe += f"; the schema's item bounds were refused ({self.bounds_refusal}): the run sends it without them"
        asked = f"asked for a plain word under {probe}, the server answered {self.probe_answer}"
        if self.enforced is True:
            return f"yes: {kind} enforced ({asked})"
        if self.enforced is False:
            auto = (
                "llm.structured=auto notices it from the run's first answers and asks with the prompt's JSON contract"
            )
            then = f"{auto} only" if mode == "auto" else stops
            return f"no: {kind} ignored (HTTP 200, but {asked}, not JSON of that shape); {then}"
        return (
            f"unknown: {kind} taken (HTTP 200), but the probe's answer proves nothing ({self.probe_answer}); the run "
            "judges the answers themselves"
        )

    def _answer_line(self) -> str:
        cut_off = self.answer.finish_reason == "length"
        cut = f" (cut at {self.max_tokens} tokens: finish_reason length)" if cut_off else ""
        if self.parse_error is not None and self.cut_short:
            return (
                f"not judged: cut at {self.max_tokens} tokens, the check's own budget ({self._run_max} in the run), "
                f"so the parser saw part of it ({self.parse_error}); the run judges its whole answers"
            )
        if self.parse_error is not None:
            return f"fails the builders' parser: {self.parse_error}{cut}"
        if self.answer_follows is False:
            return (
                "passes the builders' parser, but is not bare JSON of the schema sent (a server enforcing it returns "
                f"nothing else): {body_excerpt(self.answer.text, 60)}{cut}"
            )
        return "passes the builders' parser" + (" and is bare JSON of the schema sent" if self.answer_follows else "")

    def left(self) -> float:
        """Seconds left of the deadline."""
        return max(self.end - time.monotonic(), 0.0)

    def post(self, messages: list[dict[str, str]], params: dict[str, Any], what: str) -> tuple[HttpAnswer, float]:
        """POST one chat request within the deadline; the HTTP answer, whatever its status, and its seconds."""
        config, base, seconds = self.config, self.config.base_url, self.config.check_timeout
        url = base.rstrip("/") + "/chat/completions"
        left = self.left()
        if left <= 0:
            raise LLMRunAborted(
                f"{base}: the check's deadline ({seconds:g} s) passed before {what}; give it more time with "
                "--check-timeout"
            )
        self.say(f"check: POST {url}: {what}; waiting {left:.0f} s at most")
        start = time.monotonic()
        try:
            answer = http_json(url, {"model": config.model, "messages": messages, **params}, self.api_key, left)
        except NoHttpAnswer as error:
            message = {
                "timeout": f"{base} did not answer {what} within the check's deadline ({seconds:g} s): a server "
                "still loading its model, stalled, or busy with other requests; see its log, or give it more time "
                "with --check-timeout",
                "unreachable": f"cannot reach {base} ({error}); check llm.base_url and that the server runs",
                "not_http": f"{base} answered {what} with {error}; check llm.base_url (the address of an "
                "OpenAI-compatible server, ending in /v1)",
            }
            raise LLMRunAborted(message.get(error.kind, message["not_http"])) from None
        return answer, time.monotonic() - start

    def ask(self, messages: list[dict[str, str]], params: dict[str, Any], what: str) -> str | None:
        """Send a QA request: its answer and seconds become :attr:`answer` and :attr:`latency_s`. Returns the
        server's reason when it refused the ``response_format`` in ``params``, else ``None``; another failure raises
        :class:`LLMRunAborted`."""
        config = self.config
        answer, self.latency_s = self.post(messages, params, what)
        self.answer = Completion("", None, 0, 0, "")
        if answer.status_code != 200:
            if "response_format" in params and refuses_structured_output(answer):
                return f"HTTP {answer.status_code}: {server_reason(answer)}"
            raise LLMRunAborted(
                f"{config.base_url} refused {what} (HTTP {answer.status_code}: {server_reason(answer)}); check "
                f"{config.api_key_env}, llm.model {config.model!r} and llm.base_url"
            )
        try:
            self.answer = read_completion(answer.raw)
        except NotACompletion as error:
            raise LLMRunAborted(
                f"{config.base_url} answered {what} with HTTP 200 but not a chat completion ({error}); check "
                "llm.base_url (it ends in /v1)"
            ) from None

    def probe(self, kind: str) -> tuple[bool | None, str]:
        """``(whether the server enforces response_format of kind, a quote of the probe's answer)``, the verdict
        ``None`` when the answer proves nothing."""
        response_format = {"type": "json_object"} if kind == "json_object" else PROBE_SCHEMA.response_format()
        params = {**sampling_params(self.config), "max_tokens": PROBE_MAX_TOKENS, "response_format": response_format}
        what = f"the structured-output probe (a plain word asked for, under {kind})"
        answer, _ = self.post(PROBE_MESSAGES, params, what)
        if answer.status_code != 200:
            return None, f"HTTP {answer.status_code}: {server_reason(answer)}"
        try:
            probe = read_completion(answer.raw)
        except NotACompletion as error:
            return None, str(error)
        if not probe.text.strip():
            return None, "an empty answer"
        cut = f", cut at {PROBE_MAX_TOKENS} tokens" if probe.finish_reason == "length" else ""
        return judge_answer(response_format, probe.text, probe.finish_reason), body_excerpt(probe.text, 60) + cut


def _say_on_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def check_endpoint(config: LLMConfig, say: Callable[[str], None] = _say_on_stderr) -> EndpointCheck:
    """Run the check against ``config``'s endpoint (see the module docstring), telling ``say`` what it waits for."""
    check = EndpointCheck(config, read_api_key(config), say)
    lookup = min(LOOKUP_TIMEOUT, check.left() / 3)  # two lookups leave a third of the deadline to the requests
    say(
        f"check: GET {config.base_url.rstrip('/')}/models and /props (what the server says about itself; "
        f"{lookup:.3g} s each at most; the whole check {config.check_timeout:g} s at most)"
    )
    check.info = discover(config.base_url, config.model, check.api_key, lookup)
    request = job_request(
        QAJob(CHECK_TASK, [Passage(Document("check", "Port Elwen", CHECK_TEXT), 0, len(CHECK_TEXT))], 1)
    )
    sampling = {**sampling_params(config), "max_tokens": check.max_tokens}

    def ask(structured: dict[str, Any], what: str) -> str | None:  # the server's reason when it refused structured
        return check.ask(request.messages, {**sampling, **structured}, what)

    structured, unbounded = structured_params(config, request), structured_params(config, request, bounds=False)
    kind = check.structured_sent = structured["response_format"]["type"] if structured else None
    sent = f"with response_format {kind}" if kind else "without response_format"
    check.structured_refusal = ask(structured, f"the run's first request (a one-question QA request {sent})")
    if check.structured_refusal is not None and unbounded != structured:  # the run's next step: without the bounds
        check.bounds_refusal, structured = check.structured_refusal, unbounded
        what = "the QA request again with the schema without its item bounds (as the run does)"
        check.structured_refusal = ask(structured, what)
    if check.structured_refusal is not None:
        ask({}, "the QA request again without response_format (as llm.structured=auto does)")
    elif structured:
        check.enforced, check.probe_answer = check.probe(kind)
        check.answer_follows = judge_answer(
            structured["response_format"], check.answer.text, check.answer.finish_reason
        )
    try:
        get_task(request.task).parse(check.answer.text)
    except MalformedOutput as error:
        check.parse_error = f"{error} (answer: {body_excerpt(check.answer.text, 120)})"
    return check
