"""transformers' ``tie_weights`` on a model whose tied modules peft wrapped.

On a base whose output head shares the input embedding's weight (``tie_word_embeddings``), an adapter that trains
the embedding wraps both modules: ``modules_to_save`` (``lora.embeddings: full``) puts each in a
``ModulesToSaveWrapper`` holding the original module and one trained copy per adapter, and peft ties the two
wrappers version by version (``ensure_weight_tying``: the head's copy holds the embedding copy's parameter; the two
originals keep the base's one parameter). A wrapper holds no parameter named ``weight``: its ``__getattr__`` serves
the active version's.

transformers' ``tie_weights()`` (lm-eval's ``HFLM`` calls it on the model it is given; so do
``resize_token_embeddings`` and accelerate's big-model loading) recomputes the tied pairs from the config
(``lm_head.weight`` -> ``model.embed_tokens.weight``) and ties each with ``setattr(module, "weight", source)`` on
the module that owns the name. On the head's wrapper ``nn.Module.register_parameter`` refuses a name that
``__getattr__`` already answers (``KeyError: "attribute 'weight' already exists"``); were it accepted, it would
give the wrapper a parameter of its own, the embedding's active trained copy, outside every version, in the
state dict peft saves and in the head's forward with the adapter off.

:func:`tie_through_peft_wrappers` gives the base model of a PeftModel a ``tie_weights`` that ties a pair whose
module peft wrapped version by version (the original to the original, each adapter's copy to the same adapter's
copy) and leaves every other pair to transformers, so tying again is what it should be: nothing changes on a model
peft tied as it built it, and a tie that something broke is restored.
"""

from __future__ import annotations

import types
from typing import Any

from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper
from torch import nn

ORIGINAL = ""  # the version key of a wrapper's original (base) module


def module_versions(module: nn.Module) -> dict[str, nn.Module]:
    """``{version: the module holding that version's weights}`` of a module peft may have wrapped: ``""`` (the
    original module), then each adapter's trained copy of a ``modules_to_save`` wrapper. Trainable tokens and LoRA
    layers have the original only (their trained part is a delta; peft ties a tied pair's deltas itself)."""
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
    """Tie ``target`` to ``source`` (parameter names of ``model``) version by version: each version of the target's
    module gets the parameter of the same version of the source's module; a version the source lacks stays as peft
    built it (a head copy trained on its own, without ``ensure_weight_tying``), and an unwrapped side stands for
    its original."""
    target_module, target_attribute = owner(model, target)
    source_module, source_attribute = owner(model, source)
    sources = module_versions(source_module)
    for version, module in module_versions(target_module).items():
        if version in sources:
            parameter = getattr(sources[version], source_attribute)
            if getattr(module, target_attribute, None) is not parameter:
                setattr(module, target_attribute, parameter)


def tie_weights(self: Any, missing_keys: set[str] | None = None, recompute_mapping: bool = True) -> None:
    """transformers' ``PreTrainedModel.tie_weights`` (same arguments) on a model whose tied modules peft may have
    wrapped: the pairs peft wrapped are tied version by version (:func:`tie_versions`), every other pair by the
    model's own ``tie_weights``."""
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
    """Give ``model``'s base model (a PeftModel's, or ``model`` itself) the :func:`tie_weights` of this module;
    returns ``model``. On a model without a pair peft wrapped it ties as transformers does (after a merge, too)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(base, "get_expanded_tied_weights_keys") and "tie_weights" not in vars(base):
        base.tie_weights = types.MethodType(tie_weights, base)
    return model
