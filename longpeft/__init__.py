"""longpeft: parameter-efficient context extension for Hugging Face causal LMs.

``longpeft.load(base, adapter_dir)`` loads an adapter onto a base model (its ``longpeft.json``
first, then the weights). Importing the package is cheap; torch and transformers load on first use.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

    from .spec import ContextSpec, SpecMismatchError


def load(
    base: str | Path | PreTrainedModel | None,
    adapter_dir: str | Path,
    *,
    is_trainable: bool = False,
    strict_base_id: bool = False,
    **from_pretrained_kwargs: Any,
) -> PeftModel:
    """Load a longpeft adapter: apply its ``longpeft.json`` to the base model, then its weights.

    Args:
        base: a built model, a Hub id or local path, or None to use the spec's base_model.
        adapter_dir: folder (or Hub repo id) with ``adapter_config.json``, the adapter weights and
            ``longpeft.json``.
        is_trainable: load the adapter for further training.
        strict_base_id: also fail when the base's id differs from the one the adapter was trained on.
        **from_pretrained_kwargs: passed to ``AutoModelForCausalLM.from_pretrained`` (dtype,
            device_map, quantization_config, attn_implementation, revision, ...).

    Raises:
        SpecMismatchError: the adapter does not fit the base (checked on the config, before any
            weights are loaded when ``base`` is a path).
    """
    from .loading import load as load_adapter

    return load_adapter(
        base, adapter_dir, is_trainable=is_trainable, strict_base_id=strict_base_id, **from_pretrained_kwargs
    )


def __getattr__(name: str) -> Any:
    if name in ("ContextSpec", "SpecMismatchError"):
        from . import spec

        return getattr(spec, name)
    raise AttributeError(f"module 'longpeft' has no attribute {name!r}")


__all__ = ["ContextSpec", "SpecMismatchError", "load", "__version__"]
