"""ContextSpec: what a context-extension adapter changes besides its weights.

A PEFT adapter stores LoRA weights only; context extension also changes the RoPE parameters,
per-head bases (HARPE), STRING settings, trained and target lengths. longpeft writes them to
``longpeft.json`` beside ``adapter_config.json`` and applies them before the weights on load, so an
adapter never meets a base model configured differently from the one it was trained on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from .family import num_kv_heads
from .rope import head_dim_of, rope_parameters_of

SPEC_FILENAME = "longpeft.json"
SPEC_FORMAT_VERSION = 3
# What a folder's weights are (ContextSpec.weights, format 3): a LoRA adapter (maybe with a method's weights), a
# method's own weights only (finetune: method), a whole fully fine-tuned model, or a whole merged model.
WEIGHTS_KINDS = ("lora", "method", "full", "merged")

# Base-config fields that an adapter must match exactly (read by _shape_of).
# Specs written before num_hidden_layers was recorded lack it; they are not checked on it.
_SHAPE_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "vocab_size")
# Format-1 fields that became sections of ``methods`` in format 2.
_V1_METHOD_FIELDS = ("rope_parameters", "max_position_embeddings", "head_bases", "string", "pose", "beacon")
_V1_METHOD_NAMES = {"rope_base": "rope"}


def _architecture(config: Any) -> str | None:
    """The config's model class name (``LlamaForCausalLM``); None for a config never saved or loaded."""
    return (getattr(config, "architectures", None) or [None])[0]


def _shape_of(config: Any) -> dict[str, Any]:
    return {
        "model_type": config.model_type,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": num_kv_heads(config),
        "head_dim": head_dim_of(config),
        "vocab_size": config.vocab_size,
    }


def methods_from_v1(fields: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Format-1 fields (``rope_parameters``, ``head_bases``, ``string``, ...) as format-2 method sections.

    Pops those fields from ``fields``.
    """
    methods: dict[str, dict[str, Any]] = {}
    rope = fields.pop("rope_parameters", None)
    max_positions = fields.pop("max_position_embeddings", None)
    if rope is not None or max_positions is not None:
        methods["rope"] = {**(rope or {}), "max_position_embeddings": max_positions}
    bases = fields.pop("head_bases", None)
    if bases:
        methods["harpe"] = {"bases": list(bases)}
    for name in ("string", "pose", "beacon"):
        section = fields.pop(name, None)
        if section:
            methods[name] = dict(section)
    return methods


class SpecMismatchError(ValueError):
    """The adapter's ContextSpec does not fit the base model it is being loaded onto."""


def run_outputs(folder: str | Path) -> list[Path]:
    """What a training run folder holds: its ``adapter/`` and/or ``model/`` (``finetune: full``) folder, each with a
    ``longpeft.json`` (empty for any other folder)."""
    return [Path(folder) / name for name in ("adapter", "model") if (Path(folder) / name / SPEC_FILENAME).is_file()]


@dataclasses.dataclass
class ContextSpec:
    """Non-weight changes of a context-extension adapter (persisted as ``longpeft.json``).

    Attributes:
        method: the recipe's method (a registered method name, e.g. ``rope``, ``harpe``), for cards and tags.
        architecture: the base model's class name, e.g. ``LlamaForCausalLM``.
        base_shape: model_type, hidden size, heads, KV heads, head dim and vocab size of the base
            model before the adapter (vocab size after resizing is in ``vocab_size``).
        original_rope_parameters / original_max_position_embeddings: the base's complete
            ``rope_parameters`` and ``max_position_embeddings``.
        methods: one section per applied method (registry name -> its config as a dict), e.g.
            ``{"rope": {"rope_type": "default", "rope_theta": 2e8, "max_position_embeddings": 81920}}``.
        base_model: Hub id or path of the base model the adapter was trained on.
        base_revision: revision (commit) of the base model, when known.
        vocab_size: vocabulary size of the adapted model (differs from the base when tokens were added).
        trained_length / target_length: training sequence length and the length it should work at.
        recipe_hash: sha256 of the resolved recipe that trained the adapter.
        library_version: longpeft version that wrote the spec.
        weights: what the folder's weights are, one of ``WEIGHTS_KINDS`` (format 3; None in older folders, whose
            files tell: :func:`longpeft.hub.folder_weights`).
    """

    method: str
    architecture: str | None
    base_shape: dict[str, Any]
    original_rope_parameters: dict[str, Any]
    original_max_position_embeddings: int
    methods: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    base_model: str | None = None
    base_revision: str | None = None
    vocab_size: int | None = None
    trained_length: int | None = None
    target_length: int | None = None
    recipe_hash: str | None = None
    library_version: str | None = None
    weights: str | None = None
    format_version: int = SPEC_FORMAT_VERSION

    def __post_init__(self) -> None:
        self.method = _V1_METHOD_NAMES.get(self.method, self.method)
        if not isinstance(self.method, str) or not self.method:
            raise ValueError(f"ContextSpec.method must be a method name, got {self.method!r}")
        if not isinstance(self.methods, dict) or not all(
            isinstance(k, str) and isinstance(v, dict) for k, v in self.methods.items()
        ):
            raise ValueError("ContextSpec.methods must map method names to sections (mappings)")

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

    @property
    def head_bases(self) -> list[float] | None:
        """HARPE's per-KV-head bases, if the adapter has them."""
        return (self.methods.get("harpe") or {}).get("bases")

    @property
    def string(self) -> dict[str, Any] | None:
        """STRING settings switched on when the adapter is loaded, if any."""
        return self.methods.get("string")

    # ---- construction ----------------------------------------------------------------------

    @classmethod
    def from_base(cls, config: Any, method: str, base_model: str | None = None, **changes: Any) -> ContextSpec:
        """A spec that starts from a base model's config and records ``changes`` on top of it.

        Args:
            config: the base model's config, before any change.
            method: the recipe's method name.
            base_model: Hub id or path of the base (defaults to ``config.name_or_path``).
            **changes: any ContextSpec field, e.g. ``methods={...}``, ``trained_length=...``; the
                format-1 fields (``rope_parameters``, ``max_position_embeddings``, ``head_bases``,
                ``string``, ``pose``) are accepted and stored as method sections.
        """
        from . import __version__

        original = rope_parameters_of(config)
        methods = {"rope": {**original, "max_position_embeddings": config.max_position_embeddings}}
        legacy = {k: changes.pop(k) for k in _V1_METHOD_FIELDS if k in changes}
        legacy.setdefault("rope_parameters", original)
        legacy.setdefault("max_position_embeddings", config.max_position_embeddings)
        methods.update(methods_from_v1(legacy))
        methods.update(changes.pop("methods", {}))
        fields: dict[str, Any] = dict(
            method=method,
            architecture=_architecture(config),
            base_shape=_shape_of(config),
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
        return dataclasses.asdict(self)

    def save(self, directory: str | Path) -> Path:
        """Write ``longpeft.json`` into ``directory`` (created if missing); returns its path.

        Raises ValueError for a non-finite number (JSON has no Infinity/NaN).
        """
        path = Path(directory) / SPEC_FILENAME
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            text = json.dumps(self.to_dict(), indent=2, sort_keys=True, allow_nan=False)
        except ValueError as exc:
            raise ValueError(f"cannot write {path}: a setting is not a finite number ({exc})") from None
        path.write_text(text + "\n")
        return path

    @classmethod
    def load(cls, directory: str | Path) -> ContextSpec:
        """Read ``longpeft.json`` (format 1, 2 or 3) from an adapter directory, with errors that name the file."""
        path = Path(directory) / SPEC_FILENAME
        if not path.is_file() and (outputs := run_outputs(directory)):
            raise FileNotFoundError(f"{directory} is a training run folder: give the folder it wrote, "
                                    f"{' or '.join(map(str, outputs))}")
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} not found: this directory was not written by longpeft (or the spec was deleted); "
                "without it the adapter's RoPE changes are unknown"
            )
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from exc
        return cls.from_dict(data, str(path))

    @classmethod
    def from_dict(cls, data: Any, source: str = SPEC_FILENAME) -> ContextSpec:
        """A spec from the content of a ``longpeft.json``; formats 1 and 2 are upgraded to the current one."""
        if not isinstance(data, dict):
            raise ValueError(f"{source} must hold a JSON object, got {type(data).__name__}")
        data = dict(data)
        version = data.get("format_version", 1)
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise ValueError(f"{source}: format_version must be a positive integer, got {version!r}")
        if version > SPEC_FORMAT_VERSION:
            raise ValueError(f"{source} has format_version {version}; upgrade longpeft to read it")
        if version == 1:
            data["methods"] = methods_from_v1(data)
        data["format_version"] = SPEC_FORMAT_VERSION  # format 2 lacks only ``weights`` (None: unknown)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{source} has unknown fields {unknown}; it was written by a newer longpeft?")
        problems = _type_problems(data)
        if problems:
            raise ValueError(f"{source}: " + "; ".join(problems))
        try:
            return cls(**data)
        except TypeError as exc:
            raise ValueError(f"{source} is missing fields: {exc}") from exc

    # ---- checks ----------------------------------------------------------------------------

    def check_base(
        self, config: Any, base_model: str | None = None, strict_base_id: bool = False, recorded: str | None = None
    ) -> None:
        """Fail with :class:`SpecMismatchError` when ``config`` is not the base this spec was made for.

        Compares architecture (when both sides know it), model type, hidden size, layers (when the spec
        records them), heads, KV heads, head dim and vocab size. The base id is
        compared when both are known and ``strict_base_id`` is set (a local copy of the same model
        has another path, so by default a differing id is not an error); ``recorded`` is where the spec's
        ``base_model`` resolves to (a path relative to the adapter, a built-in model's folder), compared by location.
        """
        problems = []
        architecture = _architecture(config)
        if architecture and self.architecture and architecture != self.architecture:
            problems.append(f"architecture: adapter {self.architecture}, base {architecture}")
        actual = _shape_of(config)
        for key in _SHAPE_FIELDS:
            expected = self.base_shape.get(key)
            if key == "vocab_size" and actual[key] in (self.base_shape.get(key), self.vocab_size):
                continue
            if expected is not None and actual[key] != expected:
                problems.append(f"{key}: adapter expects {expected}, base has {actual[key]}")
        if strict_base_id and base_model and self.base_model and not _same_model(base_model, recorded or self.base_model):
            problems.append(f"base model id: adapter was trained on {self.base_model!r}, got {base_model!r}")
        if problems:
            raise SpecMismatchError(
                "this adapter does not fit the base model: " + "; ".join(problems)
                + ". Load the base model the adapter was trained on."
            )


def _same_model(a: str, b: str) -> bool:
    """Whether two model names are the same Hub id or lead to the same folder."""
    return a == b or (Path(a).exists() and Path(b).exists() and Path(a).resolve() == Path(b).resolve())


_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "method": (str,),
    "architecture": (str, type(None)),
    "base_shape": (dict,),
    "original_rope_parameters": (dict,),
    "original_max_position_embeddings": (int,),
    "methods": (dict,),
    "base_model": (str, type(None)),
    "base_revision": (str, type(None)),
    "vocab_size": (int, type(None)),
    "trained_length": (int, type(None)),
    "target_length": (int, type(None)),
    "recipe_hash": (str, type(None)),
    "library_version": (str, type(None)),
    "weights": (str, type(None)),
}
_MAX_VOCAB = 10_000_000


def _type_problems(data: dict[str, Any]) -> list[str]:
    """What is of the wrong type or out of range in a ``longpeft.json`` object."""
    problems = []
    for key, types in _FIELD_TYPES.items():
        value = data.get(key)
        if key in data and (not isinstance(value, types) or isinstance(value, bool)):
            wanted = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            problems.append(f"{key} must be {wanted}, got {type(value).__name__}")
    for key in ("vocab_size", "trained_length", "target_length", "original_max_position_embeddings"):
        value = data.get(key)
        if isinstance(value, int) and not 0 < value <= (_MAX_VOCAB if key == "vocab_size" else 1 << 31):
            problems.append(f"{key}={value} is out of range")
    if isinstance(data.get("weights"), str) and data["weights"] not in WEIGHTS_KINDS:
        problems.append(f"weights must be one of {', '.join(WEIGHTS_KINDS)}, got {data['weights']!r}")
    shape_vocab = (data.get("base_shape") or {}).get("vocab_size") if isinstance(data.get("base_shape"), dict) else None
    if isinstance(shape_vocab, int) and not 0 < shape_vocab <= _MAX_VOCAB:
        problems.append(f"base_shape.vocab_size={shape_vocab} is out of range")
    return problems


def recipe_hash(resolved: dict[str, Any]) -> str:
    """sha256 of a resolved recipe (sorted JSON), recorded in the spec."""
    return hashlib.sha256(json.dumps(resolved, sort_keys=True, default=str).encode()).hexdigest()
