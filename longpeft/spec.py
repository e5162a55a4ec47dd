"""ContextSpec: what a context-extension adapter changes besides its weights.

A PEFT adapter stores LoRA weights only; context extension also changes the RoPE parameters,
per-head bases (HARPE), STRING settings, trained and target lengths. longpeft writes them to
``longpeft.json`` beside ``adapter_config.json`` and applies them before the weights on load, so an
adapter never meets a base model configured differently from the one it was trained on.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import ConfigDict, Field, ValidationError

from .config import StrictModel, format_validation_error
from .errors import ConfigError, DataError, ModelSourceError
from .family import head_dim_of, num_kv_heads
from .reading import read_json
from .rope_parameters import rope_parameters_of

SPEC_FILENAME = "longpeft.json"
SPEC_FORMAT_VERSION = 3
# What a folder's weights are (ContextSpec.weights): a LoRA adapter (maybe with a method's weights), a method's own
# weights only (finetune: method), a whole fully fine-tuned model, or a whole merged model.
WeightsKind = Literal["lora", "method", "full", "merged"]
WEIGHTS_KINDS = get_args(WeightsKind)
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
    vocab_size: int = Field(
        gt=0, le=_MAX_VOCAB, description="before tokens were added (after: ContextSpec.vocab_size)"
    )

    @classmethod
    def of(cls, config: Any) -> BaseShape:
        """The shape of a transformers config."""
        return cls(
            model_type=config.model_type,
            hidden_size=config.hidden_size,
            num_hidden_layers=config.num_hidden_layers,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=num_kv_heads(config),
            head_dim=head_dim_of(config),
            vocab_size=config.vocab_size,
        )


class SpecMismatchError(ConfigError):
    """The adapter's ContextSpec does not fit the base model it is being loaded onto."""


def run_outputs(folder: str | Path) -> list[Path]:
    """What a training run folder holds: its ``adapter/`` and/or ``model/`` (``finetune: full``) folder, each with a
    ``longpeft.json`` (empty for any other folder)."""
    return [Path(folder) / name for name in ("adapter", "model") if (Path(folder) / name / SPEC_FILENAME).is_file()]


class ContextSpec(StrictModel):
    """Non-weight changes of a context-extension adapter (persisted as ``longpeft.json``, format 3).

    Attributes:
        method: the recipe's method (a registered method name, e.g. ``rope``, ``harpe``), for cards and tags.
        architecture: the base model's class name, e.g. ``LlamaForCausalLM``.
        base_shape: model_type, hidden size, layers, heads, KV heads, head dim and vocab size of the base
            model before the adapter (vocab size after resizing is in ``vocab_size``).
        original_rope_parameters / original_max_position_embeddings: the base's complete
            ``rope_parameters`` and ``max_position_embeddings``.
        methods: one section per applied method (registry name -> its config as a dict), e.g.
            ``{"rope": {"rope_type": "default", "rope_theta": 2e8, "max_position_embeddings": 81920}}``.
        base_model: the base model the adapter was trained on: a Hub id, a built-in model's name, or a local folder
            by its path relative to the folder holding this file (:func:`base_reference`).
        base_revision: revision (commit) of the base model, when known.
        vocab_size: vocabulary size of the adapted model (differs from the base when tokens were added).
        trained_length / target_length: training sequence length and the length it should work at.
        recipe_hash: sha256 of the resolved recipe that trained the adapter.
        library_version: longpeft version that wrote the spec.
        weights: what the folder's weights are, one of ``WEIGHTS_KINDS``; every longpeft command that writes a
            folder records it (None for a spec built in Python and saved without it:
            :func:`longpeft.hub.folder_weights` then reads it off the folder's files).

    Every field is checked on construction and on assignment (types are strict: ``"3"`` is not a number); an
    unknown key is refused by name.
    """

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

    # ---- what the methods changed, read back ------------------------------------------------

    @property
    def rope_parameters(self) -> dict[str, Any]:
        """The adapted model's complete rope_parameters (the base's when the spec changes none)."""
        rope = self.methods.get("rope")
        if not rope:
            return dict(self.original_rope_parameters)
        return {k: v for k, v in rope.items() if v is not None and k != "max_position_embeddings"}

    @property
    def max_position_embeddings(self) -> int:
        """The adapted model's ``max_position_embeddings``."""
        return (self.methods.get("rope") or {}).get("max_position_embeddings") or self.original_max_position_embeddings

    # ---- construction ----------------------------------------------------------------------

    @classmethod
    def from_base(cls, config: Any, method: str, base_model: str | None = None, **changes: Any) -> ContextSpec:
        """A spec that starts from a base model's config and records ``changes`` on top of it.

        Args:
            config: the base model's config, before any change.
            method: the recipe's method name.
            base_model: Hub id or path of the base (defaults to ``config.name_or_path``).
            **changes: any ContextSpec field, e.g. ``trained_length=...``; ``methods={name: section}`` adds to
                (or replaces) the ``rope`` section that records the base's own RoPE.
        """
        from . import __version__

        original = rope_parameters_of(config)
        methods = {
            "rope": {**original, "max_position_embeddings": config.max_position_embeddings},
            **changes.pop("methods", {}),
        }
        fields: dict[str, Any] = dict(
            method=method,
            architecture=_architecture(config),
            base_shape=BaseShape.of(config),
            original_rope_parameters=original,
            original_max_position_embeddings=config.max_position_embeddings,
            methods=methods,
            base_model=base_model or getattr(config, "name_or_path", None) or None,
            base_revision=getattr(config, "_commit_hash", None),
            vocab_size=config.vocab_size,
            library_version=__version__,
        )
        fields.update(changes)
        return cls(**fields)

    # ---- persistence -----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The content of ``longpeft.json``."""
        return self.model_dump()

    def save(self, directory: str | Path) -> Path:
        """Write ``longpeft.json`` into ``directory`` (created if missing); returns its path.

        Raises ConfigError for a non-finite number (JSON has no Infinity/NaN).
        """
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
        """Read ``longpeft.json`` from an adapter directory, with errors that name the file.

        Raises:
            ModelSourceError: the folder has no ``longpeft.json`` (a training run folder: naming the folders it holds).
            DataError: the file is not a format-3 ``longpeft.json`` (see :meth:`from_dict`).
        """
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
        """A spec from the content of a ``longpeft.json`` (format 3).

        Raises:
            DataError: naming ``source`` and what is wrong: not a JSON object, another format (an earlier one:
                re-create the adapter with this version; a later one: upgrade longpeft), or each bad key.
        """
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

    # ---- checks ----------------------------------------------------------------------------

    def check_base(
        self, config: Any, base_model: str | None = None, strict_base_id: bool = False, recorded: str | None = None
    ) -> None:
        """Fail with :class:`SpecMismatchError` when ``config`` is not the base this spec was made for.

        Compares architecture (when both sides know it), model type, hidden size, layers, heads, KV heads,
        head dim and vocab size. The base id is
        compared when both are known and ``strict_base_id`` is set (a local copy of the same model
        has another path, so by default a differing id is not an error); ``recorded`` is where the spec's
        ``base_model`` resolves to (a path relative to the adapter, a built-in model's folder), compared by location.
        """
        problems = []
        architecture = _architecture(config)
        if architecture and self.architecture and architecture != self.architecture:
            problems.append(f"architecture: adapter {self.architecture}, base {architecture}")
        actual = BaseShape.of(config).model_dump()
        for key, expected in self.base_shape.model_dump().items():
            if key == "vocab_size" and actual[key] in (expected, self.vocab_size):
                continue
            if actual[key] != expected:
                problems.append(f"{key}: adapter expects {expected}, base has {actual[key]}")
        if (
            strict_base_id
            and base_model
            and self.base_model
            and not _same_model(base_model, recorded or self.base_model)
        ):
            problems.append(f"base model id: adapter was trained on {self.base_model!r}, got {base_model!r}")
        if problems:
            raise SpecMismatchError(
                "this adapter does not fit the base model: "
                + "; ".join(problems)
                + ". Load the base model the adapter was trained on."
            )


def base_reference(name: str, folder: str | Path) -> str:
    """How the ``longpeft.json`` (and ``adapter_config.json``) of ``folder`` names the base model ``name``: a local
    folder by its path relative to ``folder`` (``../base``, always starting with ``.``: the two can move together,
    and the file holds no path of this machine), a Hub id or a built-in model's name as given."""
    from .builtin_models import BUILTIN_MODELS

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
