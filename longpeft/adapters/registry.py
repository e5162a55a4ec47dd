"""The method registry: one table that recipes, ``longpeft.load``, merge/export and model cards use.

Every context-extension method has one shape (peft's tuners are the model):

- a config, a :class:`~longpeft.config.StrictModel` subclass that is both its recipe section and
  its ``longpeft.json`` section (``methods.<name>``);
- ``resolve(config, context)``: fill what is derived when an adapter is created (HARPE's bases,
  the complete RoPE parameters, STRING's default shift from the trained length);
- ``apply(model, config)`` / ``remove(model)`` / ``is_applied(model)`` on a built model;
- optional hooks: ``save`` / ``load`` (weights outside LoRA, e.g. beacon projections, written beside
  the adapter), ``export`` (files a merged or full model needs, e.g. a modeling file with
  ``auto_map``), ``describe`` (model-card lines).

Adding a method is one folder under ``longpeft/adapters/`` and one :func:`register` call in
``longpeft/adapters/__init__.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from torch import nn

from ..config import StrictModel
from ..errors import DataError


@dataclass(frozen=True)
class ResolveContext:
    """What ``resolve`` may read when an adapter is created.

    Attributes:
        base_config: the base model's transformers config, before any change.
        trained_length: the training sequence length (tokens).
        target_length: the length the adapter should work at.
        configs: the other methods' configs of the same recipe (already resolved, in registry order).
    """

    base_config: Any
    trained_length: int | None
    target_length: int | None
    configs: dict[str, StrictModel]


def _identity(config: StrictModel, context: ResolveContext) -> StrictModel:
    return config


@dataclass(frozen=True)
class Method:
    """One context-extension method.

    Attributes:
        name: its recipe section and ``longpeft.json`` key (``rope``, ``harpe``, ...).
        config: the pydantic config class.
        apply: ``apply(model, config)`` gives a built model the method, in place.
        remove: ``remove(model)`` undoes ``apply`` exactly.
        is_applied: ``is_applied(model)`` tells whether the method is active on ``model``.
        resolve: ``resolve(config, context) -> config`` fills derived fields at adapter creation.
        save / load: ``save(model, folder, config, state_dict)`` / ``load(model, folder, config)`` for
            weights that live outside peft's adapter file; ``state_dict`` is None, or the gathered weights
            of a model sharded across processes (read them with :func:`gathered_tensors`).
        export: ``export(model, folder, config)`` after a merged or full model was saved to ``folder``.
        describe: ``describe(config) -> list[str]`` model-card sentences.
        remote_code: an exported model needs ``trust_remote_code=True`` (a modeling file ships with it).
        parameters: ``parameters(model) -> {name: Parameter}``, the method's own weights (beacon
            projections and embedding): they train while the base stays frozen, beside LoRA if any.
        span: ``span(config, length, max_positions) -> int``, the positions an input of ``length``
            tokens occupies in training (default: ``length``); Activation Beacon keeps it inside the base's range,
            PoSE's position ids reach its target length.
        model_span: ``model_span(model, length) -> (positions, keys)`` on a model the method is applied to:
            the positions an input of ``length`` tokens occupies and the keys one query reads at most
            (default: ``length`` both). STRING bounds the positions; Activation Beacon both.
        planned_parameters: ``planned_parameters(config, shape) -> (trainable, frozen)``, the parameter counts
            of the method's own float32 weights on a base of ``shape`` (a :class:`longpeft.scale.plan.ModelShape`),
            for ``longpeft plan``: trainable ones cost weight, gradient and AdamW state, frozen ones their weight.
        plan_lever: what to change in the method's section when its weights are a large memory term.
        inference_only: the method changes no weight and training did not use it (STRING): a merge may leave it
            out when asked (``--without``), giving a model that loads without its modeling file.
        excludes: ``{other method: why}``, methods this one cannot run with; a recipe naming both is refused.
        sharding_conflict: why the method cannot train with its model's weights sharded across processes (FSDP2,
            DeepSpeed ZeRO-3), or None; ``train --launch fsdp2|zero3|ulysses`` (and ``plan``) refuse it with this.
        kernel_conflict: why the method cannot train with Liger's fused kernels (``train.use_liger_kernel``: RMSNorm,
            SwiGLU and a RoPE kernel that replaces transformers' rotation of queries and keys), or None.
        training_labels: ``training_labels(config, labels) -> labels`` on a training batch's ``labels [batch, seq]``
            (unshifted, -100 = not scored): the labels with those the method leaves out of the training loss set to
            -100 (Activation Beacon, as its authors: the first window, unless full-coverage + interleave).
    """

    name: str
    config: type[StrictModel]
    apply: Callable[[Any, Any], None]
    remove: Callable[[Any], None]
    is_applied: Callable[[Any], bool]
    resolve: Callable[[Any, ResolveContext], Any] = _identity
    save: Callable[[Any, Path, Any, dict[str, Any] | None], None] | None = None
    load: Callable[[Any, Path, Any], None] | None = None
    export: Callable[[Any, Path, Any], None] | None = None
    describe: Callable[[Any], list[str]] | None = None
    remote_code: bool = False
    parameters: Callable[[Any], dict[str, Any]] | None = None
    span: Callable[[Any, int, int], int] | None = None
    model_span: Callable[[Any, int], tuple[int, int]] | None = None
    planned_parameters: Callable[[Any, Any], tuple[int, int]] | None = None
    plan_lever: str | None = None
    training_labels: Callable[[Any, torch.Tensor], torch.Tensor] | None = None
    inference_only: bool = False
    excludes: dict[str, str] = field(default_factory=dict)
    sharding_conflict: str | None = None
    kernel_conflict: str | None = None


METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    """Add ``method`` to the registry (methods apply in registration order); returns it."""
    if method.name in METHODS and METHODS[method.name] is not method:
        raise ValueError(f"a method named {method.name!r} is already registered")
    METHODS[method.name] = method
    return method


def unregister(name: str) -> None:
    """Remove a method from the registry (tests, plug-ins)."""
    METHODS.pop(name, None)


def get_method(name: str) -> Method:
    """The registered method called ``name``, with an error listing the known ones."""
    if name not in METHODS:
        raise KeyError(f"unknown longpeft method {name!r}; known methods: {', '.join(METHODS)}")
    return METHODS[name]


@dataclass(frozen=True)
class ModelSpan:
    """What an input of some length costs a built model, once its applied methods are counted.

    Attributes:
        positions: the positions it occupies (compare with ``max_position_embeddings``).
        keys: the keys one query reads at most (what attention memory grows with).
        methods: the applied methods that bound them (empty: both are the input's length).
    """

    positions: int
    keys: int
    methods: tuple[str, ...]


def model_span(model: Any, length: int) -> ModelSpan:
    """The :class:`ModelSpan` of an input of ``length`` tokens on ``model`` (the smallest bound of its applied
    methods' ``model_span`` hooks)."""
    spans = {m.name: m.model_span(model, length) for m in METHODS.values() if m.model_span is not None and m.is_applied(model)}
    return ModelSpan(
        positions=min((p for p, _ in spans.values()), default=length),
        keys=min((k for _, k in spans.values()), default=length),
        methods=tuple(spans),
    )


def config_of(name: str, data: dict[str, Any] | StrictModel) -> StrictModel:
    """A method's config from a dict (``longpeft.json`` section) or as given.

    Raises:
        ValueError: the section does not validate, naming ``methods.<name>`` and each bad field.
    """
    config_class = get_method(name).config
    if isinstance(data, config_class):
        return data
    try:
        return config_class.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, error['loc'])) or '(section)'}: {error['msg']}" for error in exc.errors())
        raise DataError(f"longpeft.json methods.{name}: {problems} (written by a newer longpeft, or edited by hand?)") from None


def gathered_tensors(
    model: nn.Module, parameters: dict[str, nn.Parameter], state_dict: dict[str, torch.Tensor] | None
) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` for ``parameters`` (``{name: parameter of model}``): their own data, or with a
    gathered ``state_dict`` (keyed as ``model.state_dict()``) the tensors it holds for them.

    Raises:
        ValueError: a parameter has no whole tensor to save (sharded and absent from ``state_dict``).
    """
    from torch.distributed.tensor import DTensor

    qualified = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    tensors = {}
    for name, parameter in parameters.items():
        tensor = parameter.detach()
        if state_dict and qualified.get(id(parameter)) in state_dict:
            tensor = state_dict[qualified[id(parameter)]]
        if tensor.numel() == 0 or isinstance(tensor, DTensor):
            raise ValueError(
                f"{name} is sharded across processes and the gathered state dict lacks it (DeepSpeed ZeRO-3 gathers "
                "nothing without stage3_gather_16bit_weights_on_model_save: true, and only the trainable weights of a "
                "LoRA run); use --launch fsdp2 or ddp"
            )
        tensors[name] = tensor
    return tensors
