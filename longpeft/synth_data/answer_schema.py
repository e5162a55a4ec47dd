"""What an LLM's answer must be. One JSON schema per output (:class:`OutputSchema`), sent to the endpoint as
``response_format`` and checked by the tasks' parsers (:meth:`OutputSchema.parse`), so the two cannot drift apart.
What makes an answer unusable (each a new attempt, up to ``max_parse_attempts``): :class:`MalformedOutput` from a
``parse`` function, :class:`RejectedOutput` from a ``check`` function, :class:`TruncatedOutput` from the client; a
``check`` function that keeps part of an answer returns :class:`Checked`. Whether an endpoint follows
``response_format``, judged from its answers (:class:`StructuredWatch`): a server may refuse the field (HTTP 400/422)
or drop it without a word (``transformers serve`` answers HTTP 200 with whatever the model writes). Nothing here
sends a request or touches a file.

Schemas use a subset of JSON Schema: ``type`` (object, array, string), ``properties``, ``required``,
``additionalProperties: false``, ``items``, ``minItems``, ``maxItems`` and ``minLength``. Unlike a plain validator,
the checker strips whitespace before ``minLength``, ignores extra keys and does not check ``maxItems`` (the builders
use the first items that pass the gates). The endpoint never gets ``minLength``, and gets the item bounds
(:data:`ITEM_BOUNDS`) only with ``bounds=True``, until it refuses them (docs/synth.md).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from .llm_http import body_excerpt
from .llm_request import ITEM_BOUNDS  # sent where the endpoint accepts them (response_format(bounds=True))


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
    if missing := [key for key in required if key not in value]:
        raise MalformedOutput(f"JSON object lacks field(s) {missing}")
    return value


PARSER_ONLY_KEYWORDS = ("minLength",)  # checked by the parser, never sent
_KEYWORDS = {"type", "properties", "required", "additionalProperties", "items", *PARSER_ONLY_KEYWORDS, *ITEM_BOUNDS}
_PY_TYPES = {"object": dict, "array": list, "string": str}


@dataclass(frozen=True)
class OutputSchema:
    """A named JSON schema for one builder output: ``name`` is the ``json_schema.name`` sent (letters, digits, ``_``
    and ``-``), ``schema`` the JSON schema (the subset of the module docstring; ValueError outside it)."""

    name: str
    schema: dict[str, Any]

    def __post_init__(self) -> None:
        _check_subset(self.schema, "$")

    def response_format(self, bounds: bool = False) -> dict[str, Any]:
        """The ``response_format`` request field asking for this schema (strict structured output): without
        :data:`PARSER_ONLY_KEYWORDS`, and without :data:`ITEM_BOUNDS` unless ``bounds``."""
        schema = _without(self.schema, PARSER_ONLY_KEYWORDS + (() if bounds else ITEM_BOUNDS))
        return {"type": "json_schema", "json_schema": {"name": self.name, "schema": schema, "strict": True}}

    def bounded(self, max_items: int) -> OutputSchema:
        """This schema with its list (the one property, :attr:`name`) holding at most ``max_items`` items."""
        listed = {**self.schema["properties"][self.name], "maxItems": max_items}
        return OutputSchema(self.name, {**self.schema, "properties": {**self.schema["properties"], self.name: listed}})

    def parse(self, text: str) -> list[Any]:
        """The list under :attr:`name` of the JSON answer ``text``, validated against this schema;
        :class:`MalformedOutput` names the first path that breaks it."""
        value = parse_json_object(text)
        self.validate(value)
        return value[self.name]

    def validate(self, value: Any) -> None:
        """Raise :class:`MalformedOutput` naming the first path (``$.qa_pairs[0].question``) that breaks the
        schema."""
        _validate(value, self.schema, "$")


def _check_subset(schema: dict[str, Any], path: str) -> None:
    unknown = set(schema) - _KEYWORDS
    if unknown or schema.get("type") not in _PY_TYPES:
        outside = sorted(unknown) or schema.get("type")
        raise ValueError(f"{path}: schema uses {outside!r}, outside the supported subset")
    for name, sub in schema.get("properties", {}).items():
        _check_subset(sub, f"{path}.{name}")
    if "items" in schema:
        _check_subset(schema["items"], f"{path}[]")


def _without(schema: dict[str, Any], keywords: tuple[str, ...]) -> dict[str, Any]:
    copy = {key: value for key, value in schema.items() if key not in keywords}
    if "properties" in copy:
        copy["properties"] = {name: _without(sub, keywords) for name, sub in copy["properties"].items()}
    if "items" in copy:
        copy["items"] = _without(copy["items"], keywords)
    return copy


def _validate(value: Any, schema: dict[str, Any], path: str) -> None:
    kind = schema["type"]
    if not isinstance(value, _PY_TYPES[kind]):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        article = "an" if kind[0] in "ao" else "a"
        raise MalformedOutput(f"{path}: expected {article} {kind}, got {type(value).__name__} {shown}")
    if kind == "object":
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                _validate(value[key], sub, f"{path}.{key}")
        if missing := [key for key in schema.get("required", []) if key not in value]:
            raise MalformedOutput(f"{path}: lacks field(s) {missing}")
    elif kind == "array":
        if len(value) < schema.get("minItems", 0):
            raise MalformedOutput(f"{path}: {len(value)} item(s), at least {schema['minItems']} needed")
        for index, item in enumerate(value):
            _validate(item, schema["items"], f"{path}[{index}]")
    elif len(value.strip()) < schema.get("minLength", 0):
        raise MalformedOutput(
            f"{path}: empty string" if not value.strip() else f"{path}: shorter than {schema['minLength']} characters"
        )


NON_EMPTY_TEXT = {"type": "string", "minLength": 1}


def object_schema(fields: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The schema of an object with exactly ``fields`` (name -> schema), all required."""
    return {"type": "object", "properties": fields, "required": list(fields), "additionalProperties": False}


def _list_of(name: str, item_fields: dict[str, dict[str, Any]]) -> OutputSchema:
    return OutputSchema(
        name, object_schema({name: {"type": "array", "items": object_schema(item_fields), "minItems": 1}})
    )


QA_PAIRS = _list_of("qa_pairs", {"question": NON_EMPTY_TEXT, "answer": NON_EMPTY_TEXT})
"""``{"qa_pairs": [{"question", "answer"}, ...]}``: single-detail, multi-detail and heterogeneous QA."""

BIOGRAPHIES = _list_of("biographies", {"name": NON_EMPTY_TEXT, "biography": NON_EMPTY_TEXT})
"""``{"biographies": [{"name", "biography"}, ...]}``: the biography task."""


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
        if (followed := judge_answer(response_format, text, finish_reason)) is None:
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
