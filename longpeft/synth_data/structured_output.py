"""Whether an endpoint follows ``response_format``, judged from its answers: a server may refuse the field (HTTP
400/422) or drop it without a word (``transformers serve`` answers HTTP 200 with whatever the model writes). A server
that enforces it answers bare JSON of the asked shape (:func:`follows_response_format`); :class:`StructuredWatch`
keeps the verdict over a run. Nothing here sends a request or touches a file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from .answer_schema import OutputSchema
from .llm_http import body_excerpt

IGNORED_AFTER = 2  # answers not of the asked shape, before any that is, that show a server ignoring the field
UNDECIDED_AFTER = 4  # answers that prove nothing (empty, cut as JSON) after which requests stop waiting for a verdict

Verdict = Literal["followed", "ignored"]


def follows_response_format(response_format: dict[str, Any], text: str) -> bool:
    """Whether ``text`` is what a server enforcing ``response_format`` returns: one bare JSON object that, for a
    ``json_schema``, conforms to the schema sent (as :meth:`.answer_schema.OutputSchema.validate` checks it)."""
    spec = response_format.get("json_schema")
    try:
        value = json.loads(text)
        if isinstance(value, dict) and response_format.get("type") == "json_schema" and isinstance(spec, dict):
            OutputSchema(str(spec.get("name", "schema")), spec["schema"]).validate(value)
    except (ValueError, KeyError, TypeError):  # not JSON; the schema broken (MalformedOutput), or not a schema
        return False
    return isinstance(value, dict)


def judge_answer(response_format: dict[str, Any], text: str, finish_reason: str | None) -> bool | None:
    """Whether an answer to a request carrying ``response_format`` shows the field followed (``True``) or not
    (``False``); ``None`` when it proves nothing: empty, or cut at ``max_tokens`` as it starts a JSON object."""
    if not text.strip():
        return None
    if finish_reason == "length":
        return None if text.lstrip().startswith("{") else False
    return follows_response_format(response_format, text)


@dataclass
class StructuredWatch:
    """The verdict on one endpoint's handling of ``response_format``, from the answers to requests carrying it."""

    verdict: Verdict | None = None  # followed: an answer had the asked shape; ignored: IGNORED_AFTER did not before
    unfollowed: list[str] = field(default_factory=list)  # quoted starts of the answers without the shape
    undecided: int = 0  # answers that proved nothing

    @property
    def waiting(self) -> bool:
        """Whether requests carrying the field should still go one at a time: no verdict yet, and fewer than
        :data:`UNDECIDED_AFTER` answers that proved nothing."""
        return self.verdict is None and self.undecided < UNDECIDED_AFTER

    def observe(self, response_format: dict[str, Any], text: str, finish_reason: str | None) -> Verdict | None:
        """Count one answer to a request carrying ``response_format``; the verdict when this answer settles it, else
        ``None``."""
        if self.verdict is not None:
            return None
        followed = judge_answer(response_format, text, finish_reason)
        if followed is None:
            self.undecided += 1
        elif followed:
            self.verdict = "followed"
        else:
            self.unfollowed.append(body_excerpt(text, 60))
            self.verdict = "ignored" if len(self.unfollowed) >= IGNORED_AFTER else None
        return self.verdict

    def evidence(self) -> str:
        """The answers behind an ``"ignored"`` verdict, quoted, for one line of the console."""
        return f"its first {len(self.unfollowed)} answers are not bare JSON of that shape ({self.unfollowed[0]})"
