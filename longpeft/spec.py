"""ContextSpec (``longpeft.json``): what a context-extension adapter changes besides its weights (RoPE parameters,
each method's settings, lengths), applied on load before the weights so the base is configured as in training.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError

from .base_config import BUILTIN_MODELS, rope_parameters_of
from .config import StrictModel, format_validation_error
from .errors import ConfigError, DataError, ModelSourceError
from .family import head_dim_of, num_kv_heads
from .reading import read_json

SPEC_FILENAME = "longpeft.json"
SPEC_FORMAT_VERSION = 3
# What a folder's weights are: LoRA (maybe with a method's), a method's own only, a whole full fine-tune or merge.
WeightsKind = Literal["lora", "method", "full", "merged"]
_MAX_VOCAB = 10_000_000
_MAX_LENGTH = 1 << 31


def _architecture(config: Any) -> str | None:
    """The config's model class name (``LlamaForCausalLM``); None for a config never saved or loaded."""
    return (getattr(config, "architectures", None) or [None])[0]


class BaseShape(StrictModel):
    """What an adapter's base model must match exactly (read off its config before the adapter changes it)."""

    model_config = ConfigDict(strict=True)

    model_type: str
    hidden_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    vocab_size: int = Field(gt=0, le=_MAX_VOCAB)  # before tokens were added (after: ContextSpec.vocab_size)

    @classmethod
    def of(cls, config: Any) -> BaseShape:
        """The shape of a transformers config."""
        kept = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        shape = {key: getattr(config, key) for key in kept}
        return cls(**shape, num_key_value_heads=num_kv_heads(config), head_dim=head_dim_of(config))


class SpecMismatchError(ConfigError):
    """The adapter's ContextSpec does not fit the base model it is being loaded onto."""


def run_outputs(folder: str | Path) -> list[Path]:
    """The ``adapter/`` and ``model/`` folders with a ``longpeft.json`` that a training run folder holds."""
    return [Path(folder) / name for name in ("adapter", "model") if (Path(folder) / name / SPEC_FILENAME).is_file()]


class ContextSpec(StrictModel):
    """What an adapter changes besides weights (``longpeft.json``, format 3), checked on construction and assignment:
    ``methods`` one section per applied method, ``base_model`` a Hub id, built-in name or folder relative to this
    file's (:func:`base_reference`), ``vocab_size`` the adapted model's, ``weights`` None when unrecorded."""

    model_config = ConfigDict(strict=True)

    method: str = Field(min_length=1)
    architecture: str | None
    base_shape: BaseShape
    original_rope_parameters: dict[str, Any]
    original_max_position_embeddings: int = Field(gt=0, le=_MAX_LENGTH)
    methods: dict[str, dict[str, Any]] = Field(default_factory=dict)
    base_model: str | None = None
    base_revision: str | None = None
    vocab_size: int | None = Field(None, gt=0, le=_MAX_VOCAB)
    trained_length: int | None = Field(None, gt=0, le=_MAX_LENGTH)
    target_length: int | None = Field(None, gt=0, le=_MAX_LENGTH)
    recipe_hash: str | None = None
    library_version: str | None = None
    weights: WeightsKind | None = None
    format_version: Literal[SPEC_FORMAT_VERSION] = SPEC_FORMAT_VERSION

    @property
    def rope_parameters(self) -> dict[str, Any]:
        """The adapted model's complete rope_parameters (the base's when the spec changes none)."""
        if not (rope := self.methods.get("rope")):
            return dict(self.original_rope_parameters)
        return {k: v for k, v in rope.items() if v is not None and k != "max_position_embeddings"}

    @property
    def max_position_embeddings(self) -> int:
        """The adapted model's ``max_position_embeddings``."""
        return (self.methods.get("rope") or {}).get("max_position_embeddings") or self.original_max_position_embeddings

    @classmethod
    def from_base(cls, config: Any, method: str, base_model: str | None = None, **changes: Any) -> ContextSpec:
        """A spec of the base ``config`` (before any change) for ``method``, with ``changes`` (any field) on top;
        ``methods={name: section}`` adds to (or replaces) the ``rope`` section of the base's own RoPE.
        ``base_model`` defaults to ``config.name_or_path``."""
        from . import __version__

        original = rope_parameters_of(config)
        rope = {**original, "max_position_embeddings": config.max_position_embeddings}
        methods = {"rope": rope, **changes.pop("methods", {})}
        base_model = base_model or getattr(config, "name_or_path", None) or None
        sizes = dict(original_max_position_embeddings=config.max_position_embeddings, vocab_size=config.vocab_size)
        fields = dict(method=method, architecture=_architecture(config), base_shape=BaseShape.of(config), **sizes)
        fields |= dict(original_rope_parameters=original, methods=methods, base_model=base_model)
        fields |= dict(base_revision=getattr(config, "_commit_hash", None), library_version=__version__)
        return cls(**(fields | changes))

    def to_dict(self) -> dict[str, Any]:
        """The content of ``longpeft.json``."""
        return self.model_dump()

    def save(self, directory: str | Path) -> Path:
        """Write ``longpeft.json`` into ``directory``; returns its path (a ConfigError for a non-finite number)."""
        path = Path(directory) / SPEC_FILENAME
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            text = json.dumps(self.to_dict(), indent=2, sort_keys=True, allow_nan=False)
        except ValueError as exc:
            raise ConfigError(f"cannot write {path}: a setting is not a finite number ({exc})") from None
        path.write_text(text + "\n")
        return path

    @classmethod
    def load(cls, directory: str | Path) -> ContextSpec:
        """Read ``longpeft.json`` from an adapter directory: a ModelSourceError when there is none (for a training
        run folder, naming the folders it holds), a DataError when it is not a format-3 one (:meth:`from_dict`)."""
        path = Path(directory) / SPEC_FILENAME
        if not path.is_file() and (outputs := run_outputs(directory)):
            raise ModelSourceError(
                f"{directory} is a training run folder: give the folder it wrote, {' or '.join(map(str, outputs))}"
            )
        if not path.is_file():
            raise ModelSourceError(
                f"{path} not found: this directory was not written by longpeft (or the spec was deleted); "
                "without it the adapter's RoPE changes are unknown"
            )
        return cls.from_dict(read_json(path), str(path))

    @classmethod
    def from_dict(cls, data: Any, source: str = SPEC_FILENAME) -> ContextSpec:
        """A spec from a ``longpeft.json``'s content; a DataError naming ``source`` unless a valid format-3 object."""
        if not isinstance(data, dict):
            raise DataError(f"{source} must hold a JSON object, got {type(data).__name__}")
        version = data.get("format_version")
        if version != SPEC_FORMAT_VERSION or isinstance(version, bool):
            raise DataError(_format_problem(source, version))
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise DataError(
                format_validation_error(source, exc).replace(
                    "invalid settings",
                    "not a longpeft.json this version reads (written by a newer longpeft, or edited by hand?)",
                )
            ) from None

    def check_base(
        self, config: Any, base_model: str | None = None, strict_base_id: bool = False, recorded: str | None = None
    ) -> None:
        """A :class:`SpecMismatchError` when ``config`` differs from the spec's architecture (both known) or shape, or
        (``strict_base_id``) ``base_model`` is not the spec's base (or ``recorded``) by id or path."""
        problems = []
        if (architecture := _architecture(config)) and self.architecture and architecture != self.architecture:
            problems.append(f"architecture: adapter {self.architecture}, base {architecture}")
        actual = BaseShape.of(config).model_dump()
        for key, expected in self.base_shape.model_dump().items():
            if key == "vocab_size" and actual[key] in (expected, self.vocab_size):
                continue
            if actual[key] != expected:
                problems.append(f"{key}: adapter expects {expected}, base has {actual[key]}")
        expected_base = recorded or self.base_model
        if strict_base_id and base_model and self.base_model and not _same_model(base_model, expected_base):
            problems.append(f"base model id: adapter was trained on {self.base_model!r}, got {base_model!r}")
        if problems:
            raise SpecMismatchError(
                f"this adapter does not fit the base model: {'; '.join(problems)}. Load the base model the adapter "
                "was trained on."
            )


def base_reference(name: str, folder: str | Path) -> str:
    """How ``folder``'s longpeft.json names the base ``name``: a local folder by its path relative to ``folder``
    (always starting with ``.``), a Hub id or a built-in model's name as given."""
    if name in BUILTIN_MODELS or not Path(name).exists():
        return name
    relative = os.path.relpath(Path(name).resolve(), Path(folder).resolve())
    return relative if relative.startswith(".") else f"./{relative}"


def _same_model(a: str, b: str) -> bool:
    """Whether two model names are the same Hub id or lead to the same folder."""
    return a == b or (Path(a).exists() and Path(b).exists() and Path(a).resolve() == Path(b).resolve())


def _format_problem(source: str, version: Any) -> str:
    """Why a ``longpeft.json`` with this ``format_version`` (None: no such key) is not read, and what to do."""
    if version is None or (type(version) is int and 0 < version < SPEC_FORMAT_VERSION):
        return (
            f"{source} is in format {version or 1}, written by a development version of longpeft before its "
            f"first release; this version reads format {SPEC_FORMAT_VERSION} only: re-create the adapter (or "
            "model) with this version"
        )
    if type(version) is int and version > SPEC_FORMAT_VERSION:
        return (
            f"{source} has format_version {version}, newer than the {SPEC_FORMAT_VERSION} this longpeft reads; "
            "upgrade longpeft to read it"
        )
    return f"{source}: format_version must be the integer {SPEC_FORMAT_VERSION}, got {version!r}"


def recipe_hash(resolved: dict[str, Any]) -> str:
    """sha256 of a resolved recipe (sorted JSON), recorded in the spec."""
    return hashlib.sha256(json.dumps(resolved, sort_keys=True, default=str).encode()).hexdigest()
