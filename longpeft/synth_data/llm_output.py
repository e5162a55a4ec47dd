"""The model's text as the client's callers see it: what a ``parse`` or ``check`` function raises when an answer
is unusable (:class:`MalformedOutput`, :class:`RejectedOutput`: the client asks again as a new attempt, and rejects
the request after ``max_parse_attempts``), and the JSON reader most parse functions start from
(:func:`parse_json_object`). Nothing here sends a request or touches a file."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any


class MalformedOutput(ValueError):
    """Raised by a ``parse`` function when the model's text is unusable (bad JSON, missing fields)."""


class RejectedOutput(MalformedOutput):
    """Raised by a ``check`` function when a well-formed answer holds nothing usable (every item failed the
    quality gates): the request is asked again as a new attempt, like malformed output."""


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
