"""What makes an answer unusable (each a new attempt, up to ``max_parse_attempts``): :class:`MalformedOutput` from a
``parse`` function, :class:`RejectedOutput` from a ``check`` function, :class:`TruncatedOutput` from the client; what
a ``check`` function returns when it keeps part of an answer (:class:`Checked`); the JSON reader of the parsers."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any


class MalformedOutput(ValueError):
    """Raised by a ``parse`` function when the model's text is unusable (bad JSON, missing fields). ``code``: the
    attempt's reason in the rejects file (:data:`.llm_rejects.REJECT_REASONS`)."""

    code = "malformed"


class TruncatedOutput(MalformedOutput):
    """An answer the server stopped at ``llm.max_tokens`` (``finish_reason`` ``length``): never parsed or kept."""

    code = "truncated"


class RejectedOutput(MalformedOutput):
    """Raised by a ``check`` function when a well-formed answer holds nothing usable (every item failed the quality
    gates). ``dropped``: a record of each item that failed (as :attr:`Checked.dropped`)."""

    code = "quality"

    def __init__(self, message: str, dropped: Iterable[dict[str, Any]] = ()):
        super().__init__(message)
        self.dropped = list(dropped)


@dataclass
class Checked:
    """What a ``check`` function returns when it keeps part of an answer (it may also return the value alone): the
    ``value`` kept, and one JSON-ready record per part dropped (``reason``, ``detail``, the part's fields), which the
    client writes to the rejects file."""

    value: Any
    dropped: list[dict[str, Any]] = field(default_factory=list)


CODE_FENCE = re.compile(r"\s*```[\w-]*\s*\n?(.*?)\n?```\s*", flags=re.DOTALL)  # ```json ... ``` around an answer


def parse_json_object(text: str, required: Sequence[str] = ()) -> dict[str, Any]:
    """Parse ``text`` (in a Markdown code fence or not) as one JSON object that has every key in ``required``; else
    :class:`MalformedOutput`."""
    fenced = CODE_FENCE.fullmatch(text)
    try:
        value = json.loads(fenced.group(1) if fenced else text)
    except json.JSONDecodeError as error:
        raise MalformedOutput(f"not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise MalformedOutput(f"expected a JSON object, got {type(value).__name__}")
    missing = [key for key in required if key not in value]
    if missing:
        raise MalformedOutput(f"JSON object lacks field(s) {missing}")
    return value
