"""A LoRA adapter's weights file on a base whose output head shares the input embedding's weight
(``tie_word_embeddings``), where ``lora.embeddings: full`` trains one matrix that peft saves under both names.

Folders users get are in peft's own format (both names); checkpoints keep the matrix once, the copies recorded in
the file's metadata (``longpeft.tied``: ``{copy: the name it is tied to}``). Every longpeft reader reads either format
through :func:`adapter_weights` or :func:`load_adapter`, whose model gets a ``tie_weights`` that works on the modules
peft wrapped (:func:`tie_through_peft_wrappers`; docs/recipes.md, "Why longpeft.json").
"""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

from peft import PeftConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import load_peft_weights
from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from .errors import ConfigError, DataError
from .files import replaced_atomically

WEIGHTS_NAME = "adapter_model.safetensors"
TIED_METADATA = "longpeft.tied"
REDO = "re-create it (or copy / download the folder again)"


def tied_copies(model: Any) -> dict[str, str]:
    """``{copy: the name it is tied to}`` among the weights peft saves for the PeftModel ``model``: each
    ``modules_to_save`` weight of its active adapter that is the parameter of an earlier one (empty when none is)."""
    return {copy: source for copy, source, _ in _tied_parameters(model)}


def tied_copies_bytes(model: Any) -> int:
    """Bytes the copies of :func:`tied_copies` add to peft's own format of ``model``'s adapter file."""
    return sum(parameter.numel() * parameter.element_size() for _, _, parameter in _tied_parameters(model))


def _tied_parameters(model: Any) -> list[tuple[str, str, Any]]:
    """``(copy, the name it is tied to, the parameter)`` of each copy of :func:`tied_copies`."""
    adapter = getattr(model, "active_adapter", "default")
    first: dict[int, str] = {}  # id(parameter) -> its first name
    copies = []
    for name, module in model.named_modules():
        if not isinstance(module, ModulesToSaveWrapper) or adapter not in module.modules_to_save:
            continue
        for key, parameter in module.modules_to_save[adapter].named_parameters():
            saved_name = f"{name}.{key}"  # as peft names it in the file (the adapter name left out)
            if id(parameter) in first:
                copies.append((saved_name, first[id(parameter)], parameter))
            else:
                first[id(parameter)] = saved_name
    return copies


def leave_out_tied_copies(model: Any, folder: str | Path) -> dict[str, str]:
    """Rewrite ``folder/adapter_model.safetensors``, as peft wrote it for ``model``, without the copies of
    :func:`tied_copies`, recorded in its metadata; returns what was left out (nothing without a copy or a file)."""
    path = Path(folder) / WEIGHTS_NAME
    copies = tied_copies(model)
    if not copies or not path.is_file():
        return {}
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
        names = set(handle.keys())
        left_out = {copy: source for copy, source in copies.items() if copy in names and source in names}
        if not left_out:
            return {}
        kept = {name: handle.get_tensor(name) for name in names - set(left_out)}
    with replaced_atomically(path) as partial:
        save_file(kept, str(partial), metadata={**metadata, TIED_METADATA: json.dumps(left_out, sort_keys=True)})
    return left_out


def write_tied_copies(folder: str | Path, copies: dict[str, str]) -> dict[str, str]:
    """Rewrite ``folder/adapter_model.safetensors`` in peft's own format: each copy of ``copies`` (``{copy: the name
    it is tied to}``) the file lacks is written as that tensor, and the compact record dropped. Returns the copies
    written. A DataError when a name a copy is tied to is not in the file."""
    path = Path(folder) / WEIGHTS_NAME
    if not copies or not path.is_file():
        return {}
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
        names = set(handle.keys())
        added = {copy: source for copy, source in copies.items() if copy not in names}
        if not added and TIED_METADATA not in metadata:
            return {}
        if lost := sorted(source for source in added.values() if source not in names):
            raise DataError(f"{path}: a tied copy's matrix {lost[0]} is not in the file (a damaged file); {REDO}")
        tensors = {name: handle.get_tensor(name) for name in names}
    tensors.update({copy: tensors[source].clone() for copy, source in added.items()})  # safetensors refuses shared
    with replaced_atomically(path) as partial:  # a failure keeps the old file
        save_file(tensors, str(partial), metadata={k: v for k, v in metadata.items() if k != TIED_METADATA})
    return added


def tied_names(folder: str | Path) -> dict[str, str]:
    """The ``{copy: tied name}`` that ``folder``'s adapter file left out (empty if none); a DataError if unreadable."""
    path = Path(folder) / WEIGHTS_NAME
    if not path.is_file():
        return {}
    try:
        with safe_open(str(path), framework="pt") as handle:
            raw = (handle.metadata() or {}).get(TIED_METADATA)
    except SafetensorError as error:
        raise DataError(f"{path}: could not be read ({str(error).splitlines()[0]}); {REDO}") from None
    if raw is None:
        return {}
    try:
        names = json.loads(raw)
    except ValueError:
        names = None
    if not isinstance(names, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in names.items()):
        raise DataError(f"{path}: its {TIED_METADATA} metadata is not a JSON object of tensor names; {REDO}")
    return names


def adapter_weights(folder: str | Path) -> dict[str, Any]:
    """``folder``'s adapter weights as peft reads them (CPU) with every tied copy; a DataError for a missing source."""
    weights = load_peft_weights(str(folder), device="cpu")
    for copy, source in tied_names(folder).items():
        if source not in weights:
            path = Path(folder) / WEIGHTS_NAME
            raise DataError(
                f"{path}: {copy} is tied to {source}, which the file does not hold (a damaged file); {REDO}"
            )
        weights[copy] = weights[source]
    return weights


def load_weights_into(model: Any, folder: str | Path) -> Any:
    """Load :func:`adapter_weights` into the PeftModel ``model``; returns peft's load result (``missing_keys``
    includes the base's weights; ``unexpected_keys``)."""
    return set_peft_model_state_dict(model, adapter_weights(folder))


def missing_adapter_weights(model: Any, result: Any) -> list[str]:
    """The weights of ``model``'s active adapter (LoRA, ``modules_to_save``) that a load (``result``) left unset."""
    marker = f".{getattr(model, 'active_adapter', 'default')}."
    return [name for name in result.missing_keys if marker in name]


def load_adapter(model: Any, folder: str | Path, is_trainable: bool = False) -> Any:
    """``PeftModel.from_pretrained(model, folder, is_trainable=is_trainable)`` that also reads a file without its
    tied copies, with :func:`tie_through_peft_wrappers`'s ``tie_weights``. A ConfigError for a compact file on a base
    that ``device_map`` offloaded in part, a DataError when it lacks weights its config describes."""
    if not tied_names(folder):
        return tie_through_peft_wrappers(PeftModel.from_pretrained(model, str(folder), is_trainable=is_trainable))
    if any(parameter.device.type == "meta" for parameter in model.parameters()):
        raise ConfigError(
            f"{folder}: this adapter keeps its tied embedding once, which longpeft loads onto a base "
            "held in memory whole; load the base without offloading part of it to CPU or disk "
            "(device_map)"
        )
    config = PeftConfig.from_pretrained(str(folder))
    config.inference_mode = not is_trainable
    peft_model = get_peft_model(model, config)
    if missing := missing_adapter_weights(peft_model, load_weights_into(peft_model, folder)):
        raise DataError(
            f"{Path(folder) / WEIGHTS_NAME}: lacks {len(missing)} weights of the adapter its "
            f"adapter_config.json describes (e.g. {missing[0]}); re-create the folder (or copy / download "
            "it again)"
        )
    if not is_trainable:
        peft_model.eval()
    return tie_through_peft_wrappers(peft_model)


ORIGINAL = ""  # the version key of a wrapper's original (base) module


def module_versions(module: nn.Module) -> dict[str, nn.Module]:
    """``{version: the module holding that version's weights}`` of a module peft may have wrapped: :data:`ORIGINAL`,
    then each adapter's copy of a ``modules_to_save`` wrapper (other wrappers have the original only)."""
    if isinstance(module, ModulesToSaveWrapper):
        return {ORIGINAL: module.original_module, **dict(module.modules_to_save.items())}
    if isinstance(module, AuxiliaryTrainingWrapper):
        return {ORIGINAL: module.original_module}
    if isinstance(module, BaseTunerLayer):
        return {ORIGINAL: module.get_base_layer()}
    return {ORIGINAL: module}


def owner(model: nn.Module, parameter_name: str) -> tuple[nn.Module, str]:
    """The module that holds ``parameter_name`` (``lm_head.weight``) by transformers' naming, and the attribute."""
    module_name, _, attribute = parameter_name.rpartition(".")
    return (model.get_submodule(module_name) if module_name else model), attribute


def is_peft_wrapped(module: nn.Module) -> bool:
    """Whether ``module`` is one of peft's wrappers (its weights live in the versions of :func:`module_versions`)."""
    return isinstance(module, (AuxiliaryTrainingWrapper, BaseTunerLayer))  # ModulesToSaveWrapper included


def tie_versions(model: nn.Module, target: str, source: str) -> None:
    """Tie ``target`` to ``source`` of ``model`` version by version; a version the source lacks stays as built."""
    target_module, target_attribute = owner(model, target)
    source_module, source_attribute = owner(model, source)
    sources = module_versions(source_module)
    for version, module in module_versions(target_module).items():
        if version in sources:
            parameter = getattr(sources[version], source_attribute)
            if getattr(module, target_attribute, None) is not parameter:
                setattr(module, target_attribute, parameter)


def tie_weights(self: Any, missing_keys: set[str] | None = None, recompute_mapping: bool = True) -> None:
    """transformers' ``PreTrainedModel.tie_weights`` (same arguments), tying the pairs peft wrapped by
    :func:`tie_versions` and every other pair by the model's own ``tie_weights``."""
    stock = type(self).tie_weights
    tied = self.get_expanded_tied_weights_keys(all_submodels=True) if recompute_mapping else self.all_tied_weights_keys
    wrapped = {
        target: source
        for target, source in tied.items()
        if is_peft_wrapped(owner(self, target)[0]) or is_peft_wrapped(owner(self, source)[0])
    }
    if not wrapped:
        stock(self, missing_keys=missing_keys, recompute_mapping=recompute_mapping)
        return
    for target, source in wrapped.items():
        tie_versions(self, target, source)
    mapping = self.all_tied_weights_keys
    self.all_tied_weights_keys = {target: source for target, source in tied.items() if target not in wrapped}
    try:
        stock(self, missing_keys=missing_keys, recompute_mapping=False)  # the pairs left
    finally:
        self.all_tied_weights_keys = mapping


def tie_through_peft_wrappers(model: Any) -> Any:
    """Give ``model``'s base model (a PeftModel's, or itself) this module's :func:`tie_weights`; returns ``model``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(base, "get_expanded_tied_weights_keys") and "tie_weights" not in vars(base):
        base.tie_weights = types.MethodType(tie_weights, base)
    return model
