"""The method registry: the one table that recipes, launches, ``longpeft.load``, merge/export and model cards read.

Every context-extension method has one shape (peft's tuners are the model) and one folder under
``longpeft/adapters/<name>/`` with the same files:

- ``config.py``: its config, a :class:`~longpeft.config.StrictModel` that is both its recipe section and its
  ``longpeft.json`` section (``methods.<name>``), and pure settings logic; no torch;
- ``modeling.py``: the torch code (what changes on a model, or in its training inputs);
- ``export.py``, where the method exports: the files a merged model needs;
- ``__init__.py``: ``METHOD``, the :class:`Method` naming its hooks (named functions), and the public names.

A method package's ``__init__.py`` imports no torch: registering the methods and validating a recipe (its sections,
their ``resolve``) need none. Its hooks into torch code are :func:`imported_on_call`, and its public torch names load
on first use (:func:`torch_names`).

Adding a method is that folder and one :func:`register` line in ``longpeft/adapters/__init__.py``; every other
module reads what it needs from the :class:`Method` fields, and never names a method. What a method cannot run
with (another method, or a way of training: weight sharding, split sequences, Liger's kernels, unsloth, a second
data collator) is declared in its ``conflicts`` and refused by :func:`check_conflicts` (recipes, launches) and
:func:`check_applicable` (switching a method on over another).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from ..config import StrictModel
from ..errors import ConfigError, DataError

if TYPE_CHECKING:  # the registry itself needs no torch: method configs import it
    import torch
    from torch import nn


def imported_on_call(module: str, name: str) -> Callable[..., Any]:
    """The function ``module.name`` as a method hook, imported when the hook is first called: a method's torch code
    (``modeling.py``, ``patch.py``, ...) is named in its :class:`Method` without being imported, so registering it
    imports no torch. The hook keeps the function's name and module (tracebacks, the contract test)."""

    def hook(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    hook.__name__ = hook.__qualname__ = name
    hook.__module__ = module
    return hook


def torch_names(package: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """The module ``__getattr__`` (PEP 562) of a method package whose public torch names (``names``: name -> the
    package's submodule that defines it) are imported on first use, so that importing the package needs no torch."""

    def __getattr__(name: str) -> Any:  # noqa: N807 - the module hook's name
        if name in names:
            return getattr(importlib.import_module(f"{package}.{names[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


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


def keep_config(config: StrictModel, context: ResolveContext) -> StrictModel:
    """The ``resolve`` of a method with nothing to derive: its config as given."""
    return config


@dataclass(frozen=True)
class MethodWeights:
    """Weights a method keeps outside peft's adapter file (Activation Beacon's projections and embedding): they train
    while the base stays frozen, beside LoRA if any, and are written beside the adapter.

    Attributes:
        parameters: ``parameters(model) -> {name: Parameter}``, the trainable ones on a model the method is applied to.
        save: ``save(model, folder, config, state_dict)``; ``state_dict`` is None, or the gathered weights of a model
            sharded across processes (read them with :func:`gathered_tensors`).
        load: ``load(model, folder, config)`` onto a model the method is applied to.
        planned: ``planned(config, shape) -> (trainable, frozen)``, the parameter counts of these float32 weights on a
            base of ``shape`` (a :class:`longpeft.scale.plan.ModelShape`), for ``longpeft plan``: trainable ones cost
            weight, gradient and AdamW state, frozen ones their weight.
        plan_lever: what to change in the method's section when these weights are a large memory term.
    """

    parameters: Callable[[Any], dict[str, Any]]
    save: Callable[[Any, Path, Any, dict[str, Any] | None], None]
    load: Callable[[Any, Path, Any], None]
    planned: Callable[[Any, Any], tuple[int, int]]
    plan_lever: str


@dataclass(frozen=True)
class CollatorContext:
    """What a method's data collator is built from, besides its config.

    Attributes:
        pad_token_id: the tokenizer's padding id.
        max_length: the training window (``data.max_length``), tokens.
        seed: the run's seed (``train.seed``); a collator that draws at random seeds its draws from it.
    """

    pad_token_id: int
    max_length: int
    seed: int


@dataclass(frozen=True)
class LongSamples:
    """Samples longer than the training window that a method's collator takes, drawing the window from each (so
    stretches of text are skipped: plain text only, a conversation would lose the context its answers need).

    Attributes:
        tokens: the most tokens a sample keeps on its way to the collator.
        limit: the setting that bounds ``tokens``, as ``key=value (why)``, for messages.
        setting: the setting that asks for it, as ``key: value``.
        off: the setting that turns it off, as ``key: value``.
    """

    tokens: int
    limit: str
    setting: str
    off: str


@dataclass(frozen=True)
class MethodTraining:
    """What a method changes in a training run besides the model (each hook optional).

    Attributes:
        collator: ``collator(config, context: CollatorContext) -> collator``, the data collator the run trains with
            (a method with one cannot run with another collator: ``data.utk``'s, another method's).
        long_samples: ``long_samples(config, target_length) -> LongSamples | None`` (``target_length``: the recipe's,
            or None), when the collator takes samples longer than the training window.
        span: ``span(config, length, max_positions) -> int``, the positions a training input of ``length`` tokens
            occupies (default: ``length``); Activation Beacon keeps it inside the base's range, PoSE's position ids
            reach its target length.
        labels: ``labels(config, labels) -> labels`` on a training batch's ``labels [batch, seq]`` (unshifted,
            -100 = not scored): those the method leaves out of the training loss set to -100 (Activation Beacon, as
            its authors: the first window, unless full-coverage + interleave).
    """

    collator: Callable[[Any, CollatorContext], Any] | None = None
    long_samples: Callable[[Any, int | None], LongSamples | None] | None = None
    span: Callable[[Any, int, int], int] | None = None
    labels: Callable[[Any, torch.Tensor], torch.Tensor] | None = None


# The ways of training a method may be unable to run under, each with what to do instead. A method's ``conflicts``
# names them (besides other methods); a check passes the ones a run uses, with the setting that asks for each.
RUN_FEATURES = {
    "sharded_weights": "use --launch ddp",  # FSDP2, DeepSpeed ZeRO-3: every layer's weights gathered collectively
    "split_sequences": "use --launch ddp",  # Ulysses (--launch ulysses), context parallelism (accelerate cp_size > 1)
    "liger_kernels": "set train.use_liger_kernel: false",  # Liger's RMSNorm, SwiGLU and RoPE kernels
    "unsloth": "use train.backend: transformers",  # unsloth's own attention, decoder-layer and RoPE kernels
}
# A run feature of every method with a collator: the run already has a data collator (``data.utk``'s).
COLLATOR = "collator"


@dataclass(frozen=True)
class Method:
    """One context-extension method.

    Attributes:
        name: its recipe section and ``longpeft.json`` key (``rope``, ``harpe``, ...).
        config: the pydantic config class (in the method's ``config.py``).
        resolve: ``resolve(config, context) -> config`` fills derived fields when an adapter is created.
        apply / remove / is_applied: ``apply(model, config)`` gives a built model the method, in place;
            ``remove(model)`` undoes it exactly; ``is_applied(model)`` tells whether it is on. All three, or none for
            a method that changes only the training inputs (PoSE).
        describe: ``describe(config) -> list[str]`` model-card sentences.
        export: ``export(model, folder, config)`` after a merged or full model was saved to ``folder``.
        remote_code: an exported model needs ``trust_remote_code=True`` (a modeling file ships with it).
        weights: the weights it keeps outside peft's adapter file (:class:`MethodWeights`), or None.
        training: what it changes in a training run besides the model (:class:`MethodTraining`; none by default).
        model_span: ``model_span(model, length) -> (positions, keys)`` on a model the method is applied to: the
            positions an input of ``length`` tokens occupies and the keys one query reads at most (default:
            ``length`` both). STRING bounds the positions; Activation Beacon both.
        inference_only: the method changes no weight and training does not use it (STRING): recipes record it for
            ``longpeft.load``, and a merge may leave it out when asked (``--without``).
        implied: every model has it (RoPE parameters): recipes and ``longpeft.json`` always carry its section (its
            defaults when a recipe leaves it out), and model cards do not tag it.
        conflicts: ``{other: why}``, what the method cannot run with: another method's name (a recipe naming both is
            refused, and so is switching one on over the other) or a key of :data:`RUN_FEATURES`. ``why`` says
            what breaks; the message adds both sides and the fix.
    """

    name: str
    config: type[StrictModel]
    resolve: Callable[[Any, ResolveContext], Any] = keep_config
    apply: Callable[[Any, Any], None] | None = None
    remove: Callable[[Any], None] | None = None
    is_applied: Callable[[Any], bool] | None = None
    describe: Callable[[Any], list[str]] | None = None
    export: Callable[[Any, Path, Any], None] | None = None
    remote_code: bool = False
    weights: MethodWeights | None = None
    training: MethodTraining = field(default_factory=MethodTraining)
    model_span: Callable[[Any, int], tuple[int, int]] | None = None
    inference_only: bool = False
    implied: bool = False
    conflicts: Mapping[str, str] = field(default_factory=dict)


METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    """Add ``method`` to the registry (methods apply in registration order); returns it.

    Raises:
        ValueError: another method has its name, it gives only some of ``apply``/``remove``/``is_applied`` (or
            none, with a model_span), or a ``conflicts`` entry has no reason.
    """
    if method.name in METHODS and METHODS[method.name] is not method:
        raise ValueError(f"a method named {method.name!r} is already registered")
    hooks = {"apply": method.apply, "remove": method.remove, "is_applied": method.is_applied}
    if len({hook is None for hook in hooks.values()}) > 1:
        missing = [name for name, hook in hooks.items() if hook is None]
        raise ValueError(
            f"method {method.name}: give apply, remove and is_applied together (missing {missing}), or "
            "none of them for a method that changes only the training inputs"
        )
    if method.apply is None and method.model_span is not None:
        raise ValueError(
            f"method {method.name}: model_span reads a model the method is applied to; give apply, "
            "remove and is_applied"
        )
    empty = [other for other, why in method.conflicts.items() if not why]
    if empty:
        raise ValueError(f"method {method.name}: conflicts {empty} need a reason (what breaks)")
    METHODS[method.name] = method
    return method


def unregister(name: str) -> None:
    """Remove a method from the registry (tests, plug-ins)."""
    METHODS.pop(name, None)


@contextmanager
def registered(method: Method) -> Iterator[Method]:
    """Register ``method`` for the ``with`` block, and unregister it afterwards (tests, experiments)."""
    register(method)
    try:
        yield method
    finally:
        unregister(method.name)


def get_method(name: str) -> Method:
    """The registered method called ``name``, with an error listing the known ones."""
    if name not in METHODS:
        raise KeyError(f"unknown longpeft method {name!r}; known methods: {', '.join(METHODS)}")
    return METHODS[name]


# ---- conflicts: declared in the registry, checked here only ------------------------------------------------------


class MethodConflict(ConfigError):
    """Methods that cannot run together, or a method that cannot run the way a run trains."""


@dataclass(frozen=True)
class Conflict:
    """One refused combination: ``first`` and ``second`` (methods, or a setting and a method), why, and the fix.

    ``feature``: the run feature (a :data:`RUN_FEATURES` key) the method cannot run under, or None for a pair.
    """

    first: str
    second: str
    why: str
    fix: str
    feature: str | None = None

    def __str__(self) -> str:
        if self.feature is not None:
            return f"{self.first} with {self.second}: {self.why}; {self.fix}"
        return f"{self.first} and {self.second} cannot be combined: {self.why}; {self.fix}"


def pair_conflict(name: str, other: str) -> str | None:
    """Why methods ``name`` and ``other`` cannot run together (declared by either of them), or None."""
    return get_method(name).conflicts.get(other) or get_method(other).conflicts.get(name)


def find_conflicts(names: Iterable[str], run: Mapping[str, str] | None = None) -> list[Conflict]:
    """Every refused combination among the methods ``names`` and the ways a run trains.

    Args:
        names: registered method names (a recipe's sections).
        run: ``{feature: the setting that asks for it}``, e.g. ``{"sharded_weights": "--launch fsdp2"}``; features
            are :data:`RUN_FEATURES` keys, or :data:`COLLATOR` when the run has a data collator of its own
            (``{"collator": "data.utk"}``), which clashes with every method that brings one.
    """
    names, run = list(names), dict(run or {})
    unknown = sorted(set(run) - set(RUN_FEATURES) - {COLLATOR})
    if unknown:
        raise ValueError(f"unknown run features {unknown}; known: {', '.join([*RUN_FEATURES, COLLATOR])}")
    found = []
    for i, name in enumerate(names):
        for other in names[i + 1 :]:
            why = pair_conflict(name, other)
            if why:  # the method that declares it first
                first, second = (name, other) if other in get_method(name).conflicts else (other, name)
                found.append(Conflict(first, second, why, "remove one of the two sections"))
        method = get_method(name)
        for feature, setting in run.items():
            if feature in method.conflicts:
                found.append(Conflict(setting, name, method.conflicts[feature], RUN_FEATURES[feature], feature))
    collators = [name for name in names if get_method(name).training.collator is not None]
    if COLLATOR in run:
        collators.insert(0, run[COLLATOR])
    for first, second in zip(collators, collators[1:]):
        found.append(Conflict(first, second, "each brings its own data collator", "use one of them"))
    return found


def check_conflicts(names: Iterable[str], run: Mapping[str, str] | None = None) -> None:
    """Refuse the first combination :func:`find_conflicts` finds.

    Raises:
        MethodConflict: naming both sides, why, and what to do.
    """
    found = find_conflicts(names, run)
    if found:
        raise MethodConflict(str(found[0]))


def check_applicable(model: Any, name: str) -> None:
    """Refuse switching method ``name`` on over a method it cannot run with (their declared conflict).

    Raises:
        MethodConflict: naming the method that is on, why, and what to do.
    """
    for other in METHODS.values():
        if other.name == name or other.is_applied is None or not other.is_applied(model):
            continue
        why = pair_conflict(name, other.name)
        if why:
            raise MethodConflict(
                f"this model has {other.name} on, and {name} cannot be combined with it: {why}; "
                f"remove {other.name} from the model first"
            )


# ---- what an input costs a model with methods on ----------------------------------------------------------------


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
    spans = {
        m.name: m.model_span(model, length)
        for m in METHODS.values()
        if m.model_span is not None and m.is_applied(model)
    }
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
        problems = "; ".join(
            f"{'.'.join(map(str, error['loc'])) or '(section)'}: {error['msg']}" for error in exc.errors()
        )
        raise DataError(
            f"longpeft.json methods.{name}: {problems} (written by a newer longpeft, or edited by hand?)"
        ) from None


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
