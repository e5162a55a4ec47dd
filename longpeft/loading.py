"""Load a longpeft adapter onto a base model: the ContextSpec first, then the weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from peft import PeftModel
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from .adapters import apply_spec, load_method_weights
from .spec import ContextSpec


def resolve_base(spec: ContextSpec, adapter_dir: str | Path, base: str | Path | None) -> str:
    """The base model to load: the one given, else the spec's ``base_model`` (a Hub id or a path;
    a relative path is looked up from the adapter folder first, then from the working directory)."""
    if base is not None:
        return str(base)
    if not spec.base_model:
        raise ValueError(f"{Path(adapter_dir) / 'longpeft.json'} names no base_model; pass the base model explicitly")
    candidate = Path(adapter_dir) / spec.base_model
    return str(candidate) if not Path(spec.base_model).is_absolute() and candidate.exists() else spec.base_model


def local_adapter_dir(adapter: str | Path) -> Path:
    """A local folder for an adapter given as a folder or a Hub repo id (downloaded once, cached)."""
    path = Path(adapter)
    if path.is_dir():
        return path
    if path.exists() or str(adapter).count("/") != 1:
        raise FileNotFoundError(f"adapter {adapter} is neither a folder nor a Hub repo id (owner/name)")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(adapter)))


def load(
    base: str | Path | PreTrainedModel | None,
    adapter_dir: str | Path,
    *,
    is_trainable: bool = False,
    strict_base_id: bool = False,
    **from_pretrained_kwargs: Any,
) -> PeftModel:
    """Load a longpeft adapter: apply its ContextSpec to the base model, then its weights.

    Args:
        base: a built model, a Hub id or local path, or None to use the spec's base_model.
        adapter_dir: folder (or Hub repo id) with ``adapter_config.json``, the adapter weights and
            ``longpeft.json``.
        is_trainable: load the adapter for further training.
        strict_base_id: also fail when the base's id differs from the one the adapter was trained on.
        **from_pretrained_kwargs: passed to ``AutoModelForCausalLM.from_pretrained`` (dtype,
            device_map, quantization_config, attn_implementation, revision, ...).

    Returns:
        The PeftModel, with the applied ContextSpec as ``model.longpeft_spec``.

    Raises:
        SpecMismatchError: the adapter does not fit the base (checked on the config, before any
            weights are loaded when ``base`` is a path).
    """
    adapter_dir = local_adapter_dir(adapter_dir)
    spec = ContextSpec.load(adapter_dir)
    if isinstance(base, PreTrainedModel):
        model = base
        spec.check_base(model.config, getattr(model.config, "name_or_path", None), strict_base_id)
    else:
        name = resolve_base(spec, adapter_dir, base)
        kwargs = {k: v for k, v in from_pretrained_kwargs.items() if k in ("revision", "trust_remote_code", "token")}
        spec.check_base(AutoConfig.from_pretrained(name, **kwargs), name, strict_base_id)
        model = AutoModelForCausalLM.from_pretrained(name, **from_pretrained_kwargs)
    apply_spec(model, spec)
    if spec.vocab_size and model.get_input_embeddings().num_embeddings != spec.vocab_size:
        model.resize_token_embeddings(spec.vocab_size)
    model = PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=is_trainable)
    load_method_weights(model, spec, adapter_dir)
    model.longpeft_spec = spec  # what was applied (e.g. STRING's default L is the trained length)
    return model
