"""The one config layer, torch-free: :class:`StrictModel` (the base of every settings object: an unknown key is an
error naming its dotted path), ``--set`` overrides, YAML reading, error messages, dtype names.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, get_args

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import ConfigError

DTYPE_NAMES = ("float32", "bfloat16", "float16")
# The most positions a length setting may name: past 2**28 a float32 cos/sin table of one 128-wide head alone takes
# 128 GiB.
MAX_POSITIONS = 2**28


def _within_rope_tables(value: int) -> int:
    if value > MAX_POSITIONS:
        raise ValueError(
            f"{value:,} positions is past what any GPU can hold: at most {MAX_POSITIONS:,} (2**28; a RoPE cos/sin "
            "table of that many positions alone fills a GPU)"
        )
    return value


# A length in tokens (positions): > 0 and at most MAX_POSITIONS.
Positions = Annotated[int, Field(gt=0), AfterValidator(_within_rope_tables)]


class StrictModel(BaseModel):
    """Base of every longpeft settings model: unknown keys are errors, floats must be finite."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=(), validate_assignment=True)

    @field_validator("*", mode="after")
    @classmethod
    def _finite(cls, value: Any, info) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"must be a finite number, got {value}")
        return value


def registration(
    register: Callable[[Any], Any], table: dict[str, Any], aliases: dict[str, str] | None = None
) -> tuple[Callable[[str], None], Callable[[Any], Any]]:
    """A registry's ``(unregister, registered)`` over ``table`` (name -> entry) and its ``aliases`` (alias -> name):
    ``registered(entry)`` does ``register(entry)`` for a ``with`` block, then unregisters it (tests, experiments)."""

    def unregister(name: str) -> None:
        """Remove an entry, and its aliases, from the registry (tests, plug-ins)."""
        entry = table.pop(name, None)
        for alias in getattr(entry, "aliases", ()) if aliases is not None else ():
            aliases.pop(alias, None)

    @contextmanager
    def registered(entry: Any) -> Iterator[Any]:
        register(entry)
        try:
            yield entry
        finally:
            unregister(entry.name)

    return unregister, registered


def torch_dtype(name: str):
    """The torch dtype called ``name`` (one of :data:`DTYPE_NAMES`), with an error naming the choices."""
    if name not in DTYPE_NAMES:
        raise ConfigError(f"dtype {name!r} is not one of {', '.join(DTYPE_NAMES)}")
    import torch

    return getattr(torch, name)


def format_validation_error(source: str, exc: ValidationError, model: type[BaseModel] | None = None) -> str:
    """``source: invalid settings`` then one line per bad key, ``  dotted.key: message``; with ``model`` (the validated
    class), a section's check whose message starts with one of its keys reads ``  beacon.ratios must list ...``."""
    lines = []
    for error in exc.errors():
        key = ".".join(str(p) for p in error["loc"]) or "(top level)"
        message = "unknown key" if error["type"] == "extra_forbidden" else error["msg"].removeprefix("Value error, ")
        field = _leading_field(model, error["loc"], message) if error["type"] == "value_error" else None
        lines.append(f"  {key}.{message}" if field else f"  {key}: {message}")
    return f"{source}: invalid settings\n" + "\n".join(lines)


def _leading_field(model: type[BaseModel] | None, loc: tuple[Any, ...], message: str) -> str | None:
    """The field of the section at ``loc`` (in ``model``) that ``message`` starts with, or None."""
    section = model
    for part in loc:
        field = section.model_fields.get(part) if section is not None and isinstance(part, str) else None
        section = next(iter(_models_of(field.annotation)), None) if field is not None else None
    first = re.match(r"[A-Za-z_]\w*", message)
    if section is None or not loc or first is None or message[first.end() : first.end() + 1] == ".":
        return None
    return first.group() if first.group() in section.model_fields else None


def _models_of(annotation: Any) -> list[type[BaseModel]]:
    """The settings classes an annotation holds (itself, or inside ``X | None``, ``Annotated[...]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for argument in get_args(annotation) for model in _models_of(argument)]


def validate(model: type[StrictModel], data: Any, source: str) -> Any:
    """``model.model_validate(data)`` with a :class:`ConfigError` naming ``source`` and every bad key."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of settings, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(source, exc, model)) from None


def assign(data: dict[str, Any], dotted: str, value: Any, source: str) -> None:
    """Set ``data[a][b][c] = value`` for ``dotted = "a.b.c"``, creating sections on the way."""
    *parents, leaf = dotted.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{source}: {dotted}: {part} is not a section")
    node[leaf] = value


def apply_overrides(data: dict[str, Any], overrides: list[str] | None, source: str) -> dict[str, Any]:
    """Apply ``dotted.key=value`` strings to a nested dict in place (values parsed as YAML); returns it."""
    for override in overrides or []:
        key, sep, raw = override.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"{source}: --set {override!r} must look like section.key=value")
        try:
            value = yaml.safe_load(raw)  # 10 -> int, [1, 2] -> list, null -> None
        except yaml.YAMLError as exc:
            problem = str(exc).splitlines()[0]
            raise ConfigError(
                f"{source}: --set {key}: value {raw!r} is not valid YAML ({problem}); quote it or fix it"
            ) from None
        assign(data, key, value, f"{source}: --set")
    return data


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml's safe loader, refusing a key given twice in one mapping (yaml would keep the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                message = f"key {key!r} appears twice (line {key_node.start_mark.line + 1}); merge the two"
                raise yaml.constructor.ConstructorError(None, None, message, key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def bundled_names(folder: Path) -> list[str]:
    """Names of the YAML files shipped in ``folder`` (bundled recipes, synth configs)."""
    return sorted(path.stem for path in folder.glob("*.yaml"))


def file_or_bundled(path_or_name: str | Path, folder: Path, what: str) -> Path:
    """The file given, else bundled ``folder/NAME.yaml``; else a ConfigError naming ``what`` and the bundled names."""
    path = Path(path_or_name)
    if path.is_file():
        return path
    bundled = folder / f"{path_or_name}.yaml"
    if not bundled.is_file():
        raise ConfigError(
            f"{what} {str(path_or_name)!r} is neither a file nor a bundled {what} ({', '.join(bundled_names(folder))})"
        )
    return bundled


def read_yaml(path: str | Path) -> Any:
    """A YAML (or JSON) file's content, with errors that name the file (a key given twice is one)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such file")
    try:
        return yaml.load(path.read_text(), Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        problem = str(exc).splitlines()[0] if not isinstance(exc, yaml.constructor.ConstructorError) else exc.problem
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ConfigError(f"{where}: not valid YAML ({problem}); fix the file") from None
