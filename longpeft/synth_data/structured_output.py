"""Whether an endpoint follows ``response_format``, judged from what it answers.

A server can refuse ``response_format`` (HTTP 400/422: :func:`.llm_http.refuses_structured_output`) or take the
request and drop the field without a word: ``transformers serve`` logs "Ignoring unsupported fields in the request:
{'response_format'}" and answers HTTP 200 with whatever the model writes. Only the answers tell the second case
apart. A server that enforces the field decodes under it, so its answer is bare JSON of the asked shape: no Markdown
fence, no prose around it (:func:`follows_response_format`). An empty answer proves nothing, and neither does one
cut at ``max_tokens`` (``finish_reason`` ``"length"``) that starts as a JSON object; a cut one that starts otherwise
proves the field was not enforced (:func:`judge_answer`).

:class:`StructuredWatch` keeps the verdict over a run: the first answer of that shape means the endpoint follows
the field; :data:`IGNORED_AFTER` answers not of that shape before any that is mean it ignores the field. After
:data:`UNDECIDED_AFTER` answers that prove nothing, the run stops waiting for a verdict
(:attr:`StructuredWatch.waiting`) and goes on judging later answers as they come. Nothing here sends a request or
touches a file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from .answer_schema import OutputSchema
from .llm_http import body_excerpt
from .llm_output import MalformedOutput

IGNORED_AFTER = 2  # answers not of the asked shape, before any that is, that show a server ignoring the field
UNDECIDED_AFTER = 4  # answers that prove nothing (empty, cut as JSON) after which requests stop waiting for a verdict

Verdict = Literal["followed", "ignored"]


def follows_response_format(response_format: dict[str, Any], text: str) -> bool:
    """Whether ``text`` is what a server enforcing ``response_format`` returns: one bare JSON object that, for a
    ``json_schema``, conforms to the schema sent (types, required fields, items, ``minItems``; the sent schema
    carries no string lengths, so an empty string conforms, and ``maxItems`` is not checked)."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    if not isinstance(value, dict):
        return False
    spec = response_format.get("json_schema")
    if response_format.get("type") != "json_schema" or not isinstance(spec, dict):
        return True
    try:
        OutputSchema(str(spec.get("name", "schema")), spec["schema"]).validate(value)
    except (MalformedOutput, ValueError, KeyError, TypeError):
        return False
    return True


def judge_answer(response_format: dict[str, Any], text: str, finish_reason: str | None) -> bool | None:
    """Whether an answer to a request carrying ``response_format`` shows the field followed (``True``) or not
    (``False``); ``None`` when it proves nothing (see the module docstring)."""
    if not text.strip():
        return None
    if finish_reason == "length":
        return None if text.lstrip().startswith("{") else False
    return follows_response_format(response_format, text)


@dataclass
class StructuredWatch:
    """The verdict on one endpoint's handling of ``response_format``, from the answers to requests carrying it.

    Attributes:
        verdict: ``"followed"`` once an answer had the asked shape, ``"ignored"`` once :data:`IGNORED_AFTER` answers
            did not before any did, else ``None``.
        unfollowed: quoted starts of the answers that did not have the shape (for the message).
        undecided: answers that proved nothing either way.
    """

    verdict: Verdict | None = None
    unfollowed: list[str] = field(default_factory=list)
    undecided: int = 0

    @property
    def waiting(self) -> bool:
        """Whether requests carrying the field should still go one at a time: no verdict yet, and fewer than
        :data:`UNDECIDED_AFTER` answers that proved nothing (an endpoint whose every answer is cut at
        ``max_tokens`` would otherwise hold the whole run to one request at a time)."""
        return self.verdict is None and self.undecided < UNDECIDED_AFTER

    def observe(self, response_format: dict[str, Any], text: str, finish_reason: str | None) -> Verdict | None:
        """Count one answer (its ``text`` and ``finish_reason``) to a request carrying ``response_format``; returns
        the verdict when this answer settles it, else ``None`` (also once it is settled: it is said once)."""
        followed = None if self.verdict is not None else judge_answer(response_format, text, finish_reason)
        if followed is None:
            self.undecided += self.verdict is None
            return None
        if followed:
            self.verdict = "followed"
            return self.verdict
        self.unfollowed.append(body_excerpt(text, 60))
        if len(self.unfollowed) >= IGNORED_AFTER:
            self.verdict = "ignored"
            return self.verdict
        return None

    def evidence(self) -> str:
        """The answers behind an ``"ignored"`` verdict, quoted, for one line of the console."""
        return f"its first {len(self.unfollowed)} answers are not bare JSON of that shape ({self.unfollowed[0]})"
