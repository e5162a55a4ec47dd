"""The JSON every LLM-built output must be: one schema per output (:class:`OutputSchema`), sent to the endpoint as
``response_format`` and checked by the tasks' parsers (:meth:`OutputSchema.parse`), so the two cannot drift apart.

Schemas use a subset of JSON Schema: ``type`` (object, array, string), ``properties``, ``required``,
``additionalProperties: false``, ``items``, ``minItems``, ``maxItems`` and ``minLength``. Unlike a plain validator,
the checker strips whitespace before ``minLength``, ignores extra keys and does not check ``maxItems`` (the builders
use the first items that pass the gates). The endpoint never gets ``minLength``, and gets the item bounds
(:data:`ITEM_BOUNDS`) only with ``bounds=True``, until it refuses them (docs/synth.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .llm_output import MalformedOutput, parse_json_object
from .llm_request import ITEM_BOUNDS  # sent where the endpoint accepts them (response_format(bounds=True))

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
        raise MalformedOutput(
            f"{path}: expected {'an' if kind[0] in 'ao' else 'a'} {kind}, got {type(value).__name__} {_short(value)}"
        )
    if kind == "object":
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                _validate(value[key], sub, f"{path}.{key}")
        missing = [key for key in schema.get("required", []) if key not in value]
        if missing:
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


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


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
