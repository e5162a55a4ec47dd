"""Context-extension methods, one folder each, in one registry (:mod:`.registry`), and what runs them all on a
model: :func:`apply_spec` gives a built model every non-weight change of a ``longpeft.json``, in registry order."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import DataError
from ..spec import ContextSpec
from . import beacon, harpe, pose, rope_base, string
from .registry import (
    METHODS,
    RUN_FEATURES,
    CollatorContext,
    LongSamples,
    Method,
    MethodConflict,
    ModelSpan,
    ResolveContext,
    applied_methods,
    check_applicable,
    check_conflicts,
    config_of,
    find_conflicts,
    gathered_tensors,
    get_method,
    model_span,
    register,
    registered,
    unregister,
)

if TYPE_CHECKING:  # registering the methods and reading their sections need no torch (see .registry)
    import torch
    from torch import nn

register(rope_base.METHOD)
register(harpe.METHOD)
register(pose.METHOD)
register(string.METHOD)
register(beacon.METHOD)


def spec_methods(spec: ContextSpec) -> list[tuple[Method, object]]:
    """``(method, config)`` for every method recorded in ``spec``, in registry order; DataError for a method this
    longpeft does not know (a newer version's, or an unimported plug-in's)."""
    unknown = sorted(set(spec.methods) - set(METHODS))
    if unknown:
        raise DataError(
            f"longpeft.json uses methods {unknown} that this longpeft does not know (known: {', '.join(METHODS)}); "
            "upgrade longpeft or import the plug-in that registers them"
        )
    return [(METHODS[name], config_of(name, spec.methods[name])) for name in METHODS if name in spec.methods]


def apply_spec(model: nn.Module, spec: ContextSpec, training: bool = False) -> None:
    """Give ``model`` every non-weight change recorded in ``spec``, in place; ``training`` leaves out the
    ``inference_only`` methods (STRING). Raises SpecMismatchError or MethodConflict before changing anything."""
    spec.check_base(model.config)
    methods = spec_methods(spec)
    check_conflicts(method.name for method, _ in methods)
    for method, config in methods:
        if not (training and method.inference_only):
            method.apply(model, config)


def load_method_weights(model: nn.Module, spec: ContextSpec, folder: str | Path) -> None:
    """Load the weights that methods keep outside peft's adapter file (e.g. beacon projections)."""
    for method, config in spec_methods(spec):
        method.load_weights(model, Path(folder), config)


def save_method_weights(
    model: nn.Module, spec: ContextSpec, folder: str | Path, state_dict: dict[str, torch.Tensor] | None = None
) -> None:
    """Save the weights that methods keep outside peft's adapter file into ``folder``; ``state_dict``: the gathered
    weights of a model sharded across processes (FSDP, ZeRO-3), keyed as ``model.state_dict()``, or None."""
    for method, config in spec_methods(spec):
        method.save_weights(model, Path(folder), config, state_dict)


def export_methods(model: nn.Module, spec: ContextSpec, folder: str | Path) -> None:
    """Run every method's export hook on a merged or fully fine-tuned model saved in ``folder``."""
    for method, config in spec_methods(spec):
        method.export(model, Path(folder), config)


__all__ = ["apply_spec", "export_methods", "load_method_weights", "save_method_weights", "spec_methods"]
# the registry's
__all__ += ["METHODS", "RUN_FEATURES", "CollatorContext", "LongSamples", "Method", "MethodConflict", "ModelSpan"]
__all__ += ["ResolveContext", "applied_methods", "check_applicable", "check_conflicts", "config_of", "find_conflicts"]
__all__ += ["gathered_tensors", "get_method", "model_span", "register", "registered", "unregister"]
