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

from .rope import head_dim_of, rope_parameters_of

SPEC_FILENAME = "longpeft.json"
SPEC_FORMAT_VERSION = 1
METHODS = ("rope_base", "harpe", "string", "pose", "beacon")

# Base-config fields that an adapter must match exactly (read by _shape_of).
_SHAPE_FIELDS = ("model_type", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")


def _architecture(config: Any) -> str | None:
    """The config's model class name (``LlamaForCausalLM``); None for a config never saved or loaded."""
    return (getattr(config, "architectures", None) or [None])[0]


def _shape_of(config: Any) -> dict[str, Any]:
    return {
        "model_type": config.model_type,
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        "head_dim": head_dim_of(config),
        "vocab_size": config.vocab_size,
    }


class SpecMismatchError(ValueError):
    """The adapter's ContextSpec does not fit the base model it is being loaded onto."""


@dataclasses.dataclass
class ContextSpec:
    """Non-weight changes of a context-extension adapter (persisted as ``longpeft.json``).

    Attributes:
        method: the longpeft method that produced the adapter, one of ``METHODS``.
        base_model: Hub id or local path of the base model the adapter was trained on.
        base_revision: revision (commit) of the base model, when known.
        architecture: the base model's class name, e.g. ``LlamaForCausalLM``.
        base_shape: model_type, hidden size, heads, KV heads, head dim and vocab size of the base
            model before the adapter (vocab size after resizing is in ``vocab_size``).
        original_rope_parameters / rope_parameters: the base's and the adapted model's complete
            transformers ``rope_parameters`` dicts.
        original_max_position_embeddings / max_position_embeddings: the base's and the adapted
            model's ``config.max_position_embeddings``.
        head_bases: HARPE, one RoPE base per KV head (query heads use their KV head's base).
        string: STRING settings (shift S, local window W, ...) to switch on at inference.
        pose / beacon: settings of those methods.
        vocab_size: vocabulary size of the adapted model (differs from the base when tokens were added).
        trained_length / target_length: training sequence length and the length it should work at.
        recipe_hash: sha256 of the resolved recipe that trained the adapter.
        library_version: longpeft version that wrote the spec.
    """

    method: str
    architecture: str | None
    base_shape: dict[str, Any]
    original_rope_parameters: dict[str, Any]
    rope_parameters: dict[str, Any]
    original_max_position_embeddings: int
    max_position_embeddings: int
    base_model: str | None = None
    base_revision: str | None = None
    vocab_size: int | None = None
    head_bases: list[float] | None = None
    string: dict[str, Any] | None = None
    pose: dict[str, Any] | None = None
    beacon: dict[str, Any] | None = None
    trained_length: int | None = None
    target_length: int | None = None
    recipe_hash: str | None = None
    library_version: str | None = None
    format_version: int = SPEC_FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"ContextSpec.method={self.method!r} is not one of {METHODS}")

    # ---- construction ----------------------------------------------------------------------

    @classmethod
    def from_base(cls, config: Any, method: str, base_model: str | None = None, **changes: Any) -> ContextSpec:
        """A spec that starts from a base model's config and records ``changes`` on top of it.

        Args:
            config: the base model's config, before any change.
            method: one of ``METHODS``.
            base_model: Hub id or path of the base (defaults to ``config.name_or_path``).
            **changes: any ContextSpec field, e.g. ``rope_parameters=...``, ``trained_length=...``.
        """
        from . import __version__

        original = rope_parameters_of(config)
        fields: dict[str, Any] = dict(
            method=method,
            architecture=_architecture(config),
            base_shape=_shape_of(config),
            original_rope_parameters=original,
            rope_parameters=dict(original),
            original_max_position_embeddings=config.max_position_embeddings,
            max_position_embeddings=config.max_position_embeddings,
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
        """Write ``longpeft.json`` into ``directory`` (created if missing); returns its path."""
        path = Path(directory) / SPEC_FILENAME
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        return path

    @classmethod
    def load(cls, directory: str | Path) -> ContextSpec:
        """Read ``longpeft.json`` from an adapter directory, with errors that name the file."""
        path = Path(directory) / SPEC_FILENAME
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} not found: this directory was not written by longpeft (or the spec was deleted); "
                "without it the adapter's RoPE changes are unknown"
            )
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from exc
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{path} has unknown fields {unknown}; it was written by a newer longpeft?")
        if data.get("format_version", SPEC_FORMAT_VERSION) > SPEC_FORMAT_VERSION:
            raise ValueError(f"{path} has format_version {data['format_version']}; upgrade longpeft to read it")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ValueError(f"{path} is missing fields: {exc}") from exc

    # ---- checks ----------------------------------------------------------------------------

    def check_base(self, config: Any, base_model: str | None = None, strict_base_id: bool = False) -> None:
        """Fail with :class:`SpecMismatchError` when ``config`` is not the base this spec was made for.

        Compares architecture (when both sides know it), model type, hidden size, heads, KV heads,
        head dim and vocab size. The base id is
        compared when both are known and ``strict_base_id`` is set (a local copy of the same model
        has another path, so by default a differing id is not an error).
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
        if strict_base_id and base_model and self.base_model and base_model != self.base_model:
            problems.append(f"base model id: adapter was trained on {self.base_model!r}, got {base_model!r}")
        if problems:
            raise SpecMismatchError(
                "this adapter does not fit the base model: " + "; ".join(problems)
                + ". Load the base model the adapter was trained on."
            )


def recipe_hash(resolved: dict[str, Any]) -> str:
    """sha256 of a resolved recipe (sorted JSON), recorded in the spec."""
    return hashlib.sha256(json.dumps(resolved, sort_keys=True, default=str).encode()).hexdigest()
