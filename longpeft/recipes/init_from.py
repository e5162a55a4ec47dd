"""Start a run from the trained weights of an earlier one (``model.init_from``): training in stages.

The run loads its base and applies its methods as usual, then copies in the earlier adapter's methods' own weights
and, when it trained LoRA, its LoRA weights and trained embedding rows. Refused, with the reason: a folder that is
not a longpeft adapter, a whole model, a base of another shape, methods with weights on one side only, LoRA weights
for a run that trains none. Changed method settings are allowed, printed and recorded.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..adapters import load_method_weights, spec_methods
from ..errors import ConfigError, ModelSourceError
from ..files import local_adapter_dir
from ..spec import SPEC_FILENAME, ContextSpec
from .schema import Recipe

WEIGHTED_KINDS = ("lora", "method")  # what a folder must hold to start a run from (ContextSpec.weights)


def adapter_folder(location: str) -> Path:
    """The adapter folder ``model.init_from`` names: the folder itself, a run folder's ``adapter/``, or a Hub repo
    (downloaded once)."""
    folder = local_adapter_dir(
        location, "model.init_from", "; train that stage first, or name its run's adapter/ folder"
    )
    if not (folder / SPEC_FILENAME).is_file() and (folder / "adapter" / SPEC_FILENAME).is_file():
        folder = folder / "adapter"
    if not (folder / SPEC_FILENAME).is_file():
        raise ModelSourceError(
            f"model.init_from: {folder} has no {SPEC_FILENAME}; point it at the adapter/ folder "
            "of a finished longpeft run (train that stage first)"
        )
    return folder


def method_differences(earlier: ContextSpec, spec: ContextSpec) -> dict[str, dict[str, list[Any]]]:
    """``{method: {key: [earlier value, this run's value]}}`` for every method setting that changed between the
    stages (a method one side lacks shows as ``{"applied": [bool, bool]}``)."""
    differences: dict[str, dict[str, list[Any]]] = {}
    for name in sorted(set(earlier.methods) | set(spec.methods)):
        before, now = earlier.methods.get(name), spec.methods.get(name)
        if before is None or now is None:
            changed = {"applied": [before is not None, now is not None]}
        else:
            keys = sorted(set(before) | set(now))
            changed = {key: [before.get(key), now.get(key)] for key in keys if before.get(key) != now.get(key)}
        if changed:
            differences[name] = changed
    return differences


@dataclass
class InitAdapter:
    """The adapter a run starts from: its folder, what its weights are (``lora`` or ``method``) and the method
    settings this run changes (:func:`method_differences`)."""

    folder: Path
    kind: str
    differences: dict[str, dict[str, list[Any]]]

    def to_dict(self) -> dict[str, Any]:
        return {"folder": str(self.folder), "weights": self.kind, "changed_method_settings": self.differences}

    def load_into(self, model: Any, spec: ContextSpec) -> None:
        """Copy the earlier adapter's methods' own weights, and LoRA's when :attr:`kind` is ``lora``, into ``model``
        (the trainer's), then say on stderr which method settings this stage changes. Raises ConfigError: LoRA
        weights that do not fit this run's (names or shapes, listed)."""
        load_method_weights(model, spec, self.folder)
        if self.kind == "lora":
            _load_lora(model, self.folder)
        changes = "; ".join(
            f"{name}.{key}: {before!r} -> {now!r}"
            for name, keys in self.differences.items()
            for key, (before, now) in keys.items()
        )
        if changes:
            message = f"longpeft: starting from {self.folder}, with these method settings changed: {changes}"
            print(message, file=sys.stderr)


def check_init_adapter(recipe: Recipe, spec: ContextSpec, base_config: Any) -> InitAdapter:
    """The recipe's ``model.init_from``, checked against this run's ``spec`` and ``base_config``. Raises
    FileNotFoundError: not an adapter folder; ValueError: weights this run cannot start from; SpecMismatchError: the
    earlier run's base has another shape."""
    from ..hub import folder_weights

    folder = adapter_folder(recipe.model.init_from)
    earlier = ContextSpec.load(folder)
    kind = folder_weights(folder, earlier)
    where = f"model.init_from ({folder})"
    if kind not in WEIGHTED_KINDS:
        raise ConfigError(
            f"{where} holds a whole model ({kind}), not an adapter: set model.name_or_path to it and "
            "drop model.init_from"
        )
    earlier.check_base(base_config)
    theirs, ours = (
        {method.name for method, _ in spec_methods(stage) if method.keeps_weights} for stage in (earlier, spec)
    )
    if theirs != ours:
        raise ConfigError(
            f"{where}: its methods with weights ({', '.join(sorted(theirs)) or 'none'}) are not "
            f"this recipe's ({', '.join(sorted(ours)) or 'none'}): "
            + ("their weights would be dropped" if theirs - ours else "they would start from scratch")
            + "; start from a run of the same method"
        )
    if kind == "lora" and recipe.finetune != "lora":
        raise ConfigError(
            f"{where} trained LoRA weights, which finetune: {recipe.finetune} would drop; set "
            "finetune: lora (with the earlier run's lora section)"
        )
    return InitAdapter(folder, kind, method_differences(earlier, spec))


def _load_lora(model: Any, folder: Path) -> None:
    from ..adapter_weights import load_weights_into
    from ..reading import check_lora_adapter

    where = f"model.init_from ({folder})"
    check_lora_adapter(folder, "model.init_from")  # a missing or broken file is named, never looked for on the Hub
    try:
        result = load_weights_into(model, folder)  # a tied embedding the file keeps once is tied again
    except RuntimeError as error:  # size mismatch
        reason = str(error).splitlines()[-1].strip()
        raise ConfigError(
            f"{where}: its LoRA weights do not fit this run's (lora.r, lora.target_modules, "
            f"lora.embeddings must match the earlier run's): {reason}"
        ) from None
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    missing = [name for name in result.missing_keys if name in trained]
    if result.unexpected_keys or missing:
        raise ConfigError(
            f"{where}: its LoRA weights do not fit this run's (lora.target_modules, lora.embeddings "
            f"must match the earlier run's): missing {missing[:4]}, unexpected {result.unexpected_keys[:4]}"
        )
