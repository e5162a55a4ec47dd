"""Load a longpeft adapter onto a base model: the ContextSpec first, then the weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from peft import PeftModel
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedModel

from .adapter_weights import load_adapter
from .adapters import apply_spec, load_method_weights, spec_methods
from .base_config import check_base_code, model_location
from .compat import without_checkpointing_notice
from .errors import ConfigError, DataError, ModelSourceError
from .files import check_model_source, is_local, is_whole_model, local_adapter_dir, raised_in
from .reading import check_lora_adapter
from .spec import ContextSpec


def resolve_base(spec: ContextSpec, adapter_dir: str | Path, base: str | Path | None) -> str:
    """The base model to load: ``base``, else the spec's ``base_model`` (a built-in name, a Hub id, or a path looked
    up from the adapter folder first, then from the working directory)."""
    if base is not None:
        return model_location(base)
    if not spec.base_model:
        raise DataError(f"{Path(adapter_dir) / 'longpeft.json'} names no base_model; pass the base model explicitly")
    candidate = Path(adapter_dir) / spec.base_model
    if not Path(spec.base_model).is_absolute() and candidate.exists():
        return str(candidate)
    return model_location(spec.base_model)


def load_tokenizer(adapter: str | Path, base: str | Path | None = None, **kwargs: Any) -> Any:
    """An adapter's tokenizer: from its folder (or Hub repo) when it ships one, else from its base model (``base``,
    default the spec's) at the revision trained on. ``kwargs`` go to ``AutoTokenizer.from_pretrained``."""
    from transformers import AutoTokenizer

    adapter_dir = local_adapter_dir(adapter)
    if any((adapter_dir / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        return AutoTokenizer.from_pretrained(adapter_dir, **kwargs)
    spec = ContextSpec.load(adapter_dir)
    name = resolve_base(spec, adapter_dir, base)
    check_model_source(name, "base model", "; pass the base model (load_tokenizer(adapter, base))")
    return AutoTokenizer.from_pretrained(name, **pin_base_revision(spec, name, kwargs))


# What from_pretrained's look-up of an adapter_config.json in the base repo must honour too (transformers 5.17 to
# 5.23 passes it the token and revision only: under local_files_only=True it still asked the Hub).
ADAPTER_LOOKUP_KWARGS = ("cache_dir", "local_files_only", "subfolder", "proxies", "force_download")
# from_pretrained arguments that also decide where the base's config is read from
CONFIG_KWARGS = ("revision", "trust_remote_code", "token", *ADAPTER_LOOKUP_KWARGS)


def pin_base_revision(spec: ContextSpec, name: str, from_pretrained_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``from_pretrained_kwargs`` pinned to the trained-on commit when the base is the spec's Hub repo, if unpinned."""
    hub_base = name == spec.base_model and not is_local(name)
    if spec.base_revision and hub_base and "revision" not in from_pretrained_kwargs:
        return {**from_pretrained_kwargs, "revision": spec.base_revision}
    return from_pretrained_kwargs


@without_checkpointing_notice()  # peft reads a property transformers deprecates
def load(
    base: str | Path | PreTrainedModel | None,
    adapter_dir: str | Path,
    *,
    is_trainable: bool = False,
    strict_base_id: bool = False,
    **from_pretrained_kwargs: Any,
) -> PeftModel | PreTrainedModel:
    """Load the adapter in ``adapter_dir`` (a folder or Hub id with ``longpeft.json``) onto ``base`` (a model, a Hub
    id or path, None: the spec's), its ContextSpec first; ``strict_base_id`` refuses another base id, and
    ``from_pretrained_kwargs`` go to ``AutoModelForCausalLM.from_pretrained`` (no ``revision``: the commit trained on).
    Returns the PeftModel (the model itself without LoRA weights), spec in ``model.longpeft_spec``; a
    SpecMismatchError, before any weight loads, when the adapter does not fit the base."""
    given, adapter_dir = adapter_dir, local_adapter_dir(adapter_dir)
    spec = ContextSpec.load(adapter_dir)
    if is_whole_model(adapter_dir):  # before the base is looked for: a whole model needs none
        raise ConfigError(
            f"{adapter_dir} holds a whole model (config.json), not an adapter: load it with "
            "AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)"
        )
    recorded = resolve_base(spec, adapter_dir, None) if spec.base_model else None  # for strict_base_id
    if isinstance(base, PreTrainedModel):
        model = base
        spec.check_base(model.config, getattr(model.config, "name_or_path", None), strict_base_id, recorded)
    else:
        name = resolve_base(spec, adapter_dir, base)
        check_model_source(name, "base model", "; pass the base model (longpeft.load(base, adapter))")
        from_pretrained_kwargs.setdefault("trust_remote_code", False)  # never prompt, never run remote code unasked
        from_pretrained_kwargs = pin_base_revision(spec, name, from_pretrained_kwargs)
        trusted, revision = from_pretrained_kwargs["trust_remote_code"], from_pretrained_kwargs.get("revision")
        check_base_code(name, revision, trusted, "trust_remote_code=True")
        kwargs = {k: v for k, v in from_pretrained_kwargs.items() if k in CONFIG_KWARGS}
        spec.check_base(AutoConfig.from_pretrained(name, **kwargs), name, strict_base_id, recorded)
        if lookup := {k: v for k, v in from_pretrained_kwargs.items() if k in ADAPTER_LOOKUP_KWARGS}:
            adapter_kwargs = {**lookup, **(from_pretrained_kwargs.get("adapter_kwargs") or {})}  # the caller's win
            from_pretrained_kwargs = {**from_pretrained_kwargs, "adapter_kwargs": adapter_kwargs}
        model = AutoModelForCausalLM.from_pretrained(name, **from_pretrained_kwargs)
    apply_spec(model, spec)
    if spec.vocab_size and model.get_input_embeddings().num_embeddings != spec.vocab_size:
        model.resize_token_embeddings(spec.vocab_size)
    if (adapter_dir / "generation_config.json").is_file():  # the recipe's eos ids (merge ships the same file)
        model.generation_config = GenerationConfig.from_pretrained(adapter_dir)
    if (adapter_dir / "adapter_config.json").is_file():
        check_lora_adapter(adapter_dir)  # a missing or broken file is named here, never looked for on the Hub
        try:
            model = load_adapter(model, adapter_dir, is_trainable=is_trainable)
        except KeyError as error:  # peft looked a weight its config describes up in the file: the file's fault
            if not raised_in(error, ("peft",), innermost=False):
                raise
            raise DataError(
                f"adapter {given}: adapter_model.safetensors lacks {error.args[0] if error.args else 'a weight'}, "
                "which its adapter_config.json describes (a damaged or edited file: a tied embedding's record "
                "longpeft.tied removed?); re-create the adapter, or copy / download the folder again"
            ) from error
    elif not any(method.keeps_weights for method, _ in spec_methods(spec)):
        raise ModelSourceError(
            f"{adapter_dir} has no adapter_config.json (and its methods keep no weights of their "
            "own): not an adapter folder"
        )
    load_method_weights(model, spec, adapter_dir)
    model.longpeft_spec = spec  # what was applied (e.g. STRING's default L is the trained length)
    return model
