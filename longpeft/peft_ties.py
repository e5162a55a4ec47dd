"""transformers' ``tie_weights`` on a model whose tied modules peft wrapped.

With ``lora.embeddings: full`` on a tied base, peft wraps the embedding and the head in ``ModulesToSaveWrapper`` and
ties them version by version; transformers' ``tie_weights()`` (called by lm-eval's ``HFLM``, resizing, accelerate)
fails on such a wrapper (``KeyError: "attribute 'weight' already exists"``). :func:`tie_through_peft_wrappers` gives
the model a ``tie_weights`` that ties wrapped pairs version by version and leaves the others to transformers.
"""

from __future__ import annotations

import types
from typing import Any

from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper
from torch import nn

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
    """Tie the parameter ``target`` to ``source`` of ``model`` version by version (:func:`module_versions`); a
    version the source lacks stays as peft built it."""
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
