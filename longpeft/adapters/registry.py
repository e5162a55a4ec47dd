"""The method registry: the one table that recipes, launches, ``longpeft.load``, merge/export and model cards read.

A method is a folder ``longpeft/adapters/<name>/`` (CONTRIBUTING.md, "One shape for every method") and one
:func:`register` line in ``longpeft/adapters/__init__.py``; other modules call its :class:`Method` hooks and never
name it."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import ValidationError

from ..config import StrictModel, registration
from ..errors import ConfigError, DataError

if TYPE_CHECKING:  # the registry itself needs no torch: method configs import it
    import torch
    from torch import nn


def imported_on_call(module: str, name: str) -> staticmethod:
    """The function ``module.name`` as a :class:`Method` hook, imported when first called (registering imports no
    torch); the hook keeps the function's name and module (tracebacks, the contract test)."""

    def hook(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    hook.__name__ = hook.__qualname__ = name
    hook.__module__ = module
    return staticmethod(hook)


def torch_names(package: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """The module ``__getattr__`` (PEP 562) of a method package: its public torch names (``names``: name -> the
    submodule defining it, the package's ``TORCH_NAMES``) are imported on first use."""

    def __getattr__(name: str) -> Any:  # noqa: N807 - the module hook's name
        if name in names:
            return getattr(importlib.import_module(f"{package}.{names[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


@dataclass(frozen=True)
class ResolveContext:
    """What ``resolve`` may read when an adapter is created."""

    base_config: Any  # the base model's transformers config, before any change
    trained_length: int | None  # the training sequence length (tokens)
    target_length: int | None  # the length the adapter should work at
    configs: dict[str, StrictModel]  # the recipe's other methods' configs, already resolved, in registry order


@dataclass(frozen=True)
class CollatorContext:
    """What a method's data collator is built from, besides its config."""

    pad_token_id: int  # the tokenizer's padding id
    max_length: int  # the training window (``data.max_length``), tokens
    seed: int  # the run's seed (``train.seed``), which seeds a collator's random draws


@dataclass(frozen=True)
class LongSamples:
    """Samples longer than the training window a method's collator takes, drawing the window from each (plain text)."""

    tokens: int  # the most tokens a sample keeps on its way to the collator
    limit: str  # the setting that bounds ``tokens``, as ``key=value (why)``, for messages
    setting: str  # the setting that asks for it, as ``key: value``
    off: str  # the setting that turns it off, as ``key: value``


# The ways of training a method may be unable to run under (its ``conflicts`` keys), each with what to do instead.
RUN_FEATURES = {
    "sharded_weights": "use --launch ddp",  # FSDP2, DeepSpeed ZeRO-3: every layer's weights gathered collectively
    "split_sequences": "use --launch ddp",  # Ulysses (--launch ulysses), context parallelism (accelerate cp_size > 1)
    "liger_kernels": "set train.use_liger_kernel: false",  # Liger's RMSNorm, SwiGLU and RoPE kernels
    "unsloth": "use train.backend: transformers",  # unsloth's own attention, decoder-layer and RoPE kernels
}
# A run feature of every method with a collator: the run already has a data collator (``data.utk``'s).
COLLATOR = "collator"


class Method:
    """One context-extension method: a subclass sets ``name`` and ``config`` and overrides only the hooks the method
    needs; the others do nothing. A hook takes the base hook's arguments, in order (``config``: the method's resolved
    section); it is a method, ``staticmethod(f)`` for a function of ``config.py`` or :func:`imported_on_call` for
    torch code. The registry holds one instance of each."""

    name: ClassVar[str]  # its recipe section and ``longpeft.json`` key (``rope``, ``harpe``, ...)
    config: ClassVar[type[StrictModel]]  # the pydantic config class (in the method's ``config.py``)
    remote_code: ClassVar[bool] = False  # ``export`` writes a modeling file (``trust_remote_code=True``)
    # changes no weight, unused in training (STRING): recorded for ``longpeft.load``; ``merge --without`` leaves it out
    inference_only: ClassVar[bool] = False
    # every model has it (RoPE): recipes and ``longpeft.json`` always carry its section, model cards do not tag it
    implied: ClassVar[bool] = False
    # ``{other: why}``: a method's name or a :data:`RUN_FEATURES` key it cannot run with; ``why`` says what breaks
    conflicts: ClassVar[Mapping[str, str]] = MappingProxyType({})
    plan_lever: ClassVar[str] = ""  # with weights of its own: what to change when they are a large memory term
    # why a request padded to a batch's length reads differently from the request alone ('': it does not)
    padded_batches: ClassVar[str] = ""

    # ---- its settings

    def resolve(self, config: Any, context: ResolveContext) -> Any:
        """The config with its derived fields filled, when an adapter is created (default: as given)."""
        return config

    def describe(self, config: Any) -> list[str]:
        """Model-card sentences (default: none)."""
        return []

    # ---- on a built model: apply, remove and is_applied together, or none (PoSE changes only the training inputs)

    def apply(self, model: Any, config: Any) -> None:
        """Give a built model the method, in place (applying again replaces the settings)."""

    def remove(self, model: Any) -> None:
        """Undo :meth:`apply` exactly."""

    def is_applied(self, model: Any) -> bool:
        """Whether the method is on ``model``."""
        return False

    def model_span(self, model: Any, length: int) -> tuple[int, int]:
        """``(positions, keys)``: the positions an input of ``length`` tokens occupies on a model the method is
        applied to, and the keys one query reads at most (:func:`model_span`)."""
        return length, length

    def export(self, model: Any, folder: Path, config: Any) -> None:
        """Write what a merged or full model saved to ``folder`` needs besides its weights (a modeling file, ...)."""

    # ---- weights it keeps outside peft's adapter file (Activation Beacon's): all four, with ``plan_lever``, or none

    def weight_parameters(self, model: Any) -> dict[str, Any]:
        """``{name: Parameter}``, the trainable ones on a model the method is applied to."""
        return {}

    def save_weights(self, model: Any, folder: Path, config: Any, state_dict: dict[str, Any] | None) -> None:
        """Write them into ``folder``; ``state_dict`` is None, or the gathered weights of a model sharded across
        processes (read them with :func:`gathered_tensors`)."""

    def load_weights(self, model: Any, folder: Path, config: Any) -> None:
        """Load them from ``folder`` onto a model the method is applied to."""

    def planned_weights(self, config: Any, shape: Any) -> tuple[int, int]:
        """``(trainable, frozen)`` float32 parameter counts of them on a base of ``shape`` (``plan.ModelShape``)."""
        return 0, 0

    # ---- what it changes in a training run besides the model

    def collator(self, config: Any, context: CollatorContext) -> Any:
        """The data collator the run trains with, or None (TRL's); it clashes with any other collator."""
        return None

    def long_samples(self, config: Any, target_length: int | None) -> LongSamples | None:
        """The samples longer than the training window its collator takes (``target_length``: the recipe's)."""
        return None

    def training_span(self, config: Any, length: int, max_positions: int) -> int:
        """The positions a training input of ``length`` tokens occupies (a recipe's: the least its methods set)."""
        return length

    def training_labels(self, config: Any, labels: torch.Tensor) -> torch.Tensor:
        """A training batch's ``labels [batch, seq]`` (unshifted, -100 = not scored) with those the method leaves out
        of the loss set to -100, as a new tensor."""
        return labels

    # ---- what the registry and the call sites ask of the hooks

    def overrides(self, hook: str) -> bool:
        """Whether this method's class gives ``hook`` (a hook name) instead of the base's default."""
        return getattr(type(self), hook) is not getattr(Method, hook)

    @property
    def changes_model(self) -> bool:
        """Whether it changes a built model (``apply``), not only the training inputs."""
        return self.overrides("apply")

    @property
    def keeps_weights(self) -> bool:
        """Whether it keeps weights of its own outside peft's adapter file."""
        return self.overrides("save_weights")

    def __repr__(self) -> str:
        return f"<method {getattr(self, 'name', '?')}: {type(self).__module__}.{type(self).__qualname__}>"


# Hooks a method gives together, or none of: a model change, its own weights.
MODEL_HOOKS = ("apply", "remove", "is_applied")
WEIGHT_HOOKS = ("weight_parameters", "save_weights", "load_weights", "planned_weights")

METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    """Add ``method`` to the registry (methods apply in registration order) and return it; ValueError when it breaks
    the contract (no ``name`` or ``config``, a taken name, a partial hook group, no ``plan_lever`` or reasons)."""
    name = getattr(method, "name", None)
    if not isinstance(name, str) or not isinstance(getattr(method, "config", None), type):
        raise ValueError(f"{method!r}: a Method subclass sets name (its section) and config (the section's class)")
    if name in METHODS and METHODS[name] is not method:
        raise ValueError(f"a method named {name!r} is already registered")
    for group in (MODEL_HOOKS, WEIGHT_HOOKS):
        missing = [hook for hook in group if not method.overrides(hook)]
        if 0 < len(missing) < len(group):
            together = f"{', '.join(group[:-1])} and {group[-1]} together"
            raise ValueError(f"method {name}: give {together} (missing {missing}), or none of them")
    if method.keeps_weights and not method.plan_lever:
        raise ValueError(f"method {name}: weights of its own need a plan_lever (what to change when they are large)")
    if method.overrides("model_span") and not method.changes_model:
        raise ValueError(f"method {name}: model_span reads a model the method is applied to; give {MODEL_HOOKS}")
    empty = [other for other, why in method.conflicts.items() if not why]
    if empty:
        raise ValueError(f"method {name}: conflicts {empty} need a reason (what breaks)")
    METHODS[name] = method
    return method


unregister, registered = registration(register, METHODS)  # tests, plug-ins


def get_method(name: str) -> Method:
    """The registered method called ``name``, with an error listing the known ones."""
    if name not in METHODS:
        raise KeyError(f"unknown longpeft method {name!r}; known methods: {', '.join(METHODS)}")
    return METHODS[name]


def applied_methods(model: Any) -> list[Method]:
    """The registered methods on ``model`` (their ``is_applied``), in registry order."""
    return [method for method in METHODS.values() if method.is_applied(model)]


# ---- conflicts: declared in the registry, checked here only ------------------------------------------------------


class MethodConflict(ConfigError):
    """Methods that cannot run together, or a method that cannot run the way a run trains."""


@dataclass(frozen=True)
class Conflict:
    """One refused combination: ``first`` and ``second`` (methods, or a setting and a method), why, and the fix;
    ``feature``: the :data:`RUN_FEATURES` key it is about, or None for two methods."""

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
    """Every refused combination among the methods ``names`` and the ways a run trains, ``run``: ``{feature: the
    setting asking for it}`` with :data:`RUN_FEATURES` keys (``{"sharded_weights": "--launch fsdp2"}``) or
    :data:`COLLATOR` for the run's own data collator (``{"collator": "data.utk"}``)."""
    names, run = list(names), dict(run or {})
    unknown = sorted(set(run) - set(RUN_FEATURES) - {COLLATOR})
    if unknown:
        raise ValueError(f"unknown run features {unknown}; known: {', '.join([*RUN_FEATURES, COLLATOR])}")
    found = []
    for i, name in enumerate(names):
        method = get_method(name)
        for other in names[i + 1 :]:
            why = pair_conflict(name, other)
            if why:  # the method that declares it first
                first, second = (name, other) if other in method.conflicts else (other, name)
                found.append(Conflict(first, second, why, "remove one of the two sections"))
        for feature, setting in run.items():
            if feature in method.conflicts:
                found.append(Conflict(setting, name, method.conflicts[feature], RUN_FEATURES[feature], feature))
    collators = [run[COLLATOR]] if COLLATOR in run else []
    collators += [name for name in names if get_method(name).overrides("collator")]
    for first, second in zip(collators, collators[1:]):
        found.append(Conflict(first, second, "each brings its own data collator", "use one of them"))
    return found


def check_conflicts(names: Iterable[str], run: Mapping[str, str] | None = None) -> None:
    """Refuse the first combination :func:`find_conflicts` finds (:class:`MethodConflict`)."""
    found = find_conflicts(names, run)
    if found:
        raise MethodConflict(str(found[0]))


def check_applicable(model: Any, name: str) -> None:
    """Refuse (:class:`MethodConflict`) switching method ``name`` on over a method it cannot run with."""
    for other in applied_methods(model):
        why = other.name != name and pair_conflict(name, other.name)
        if why:
            raise MethodConflict(
                f"this model has {other.name} on, and {name} cannot be combined with it: {why}; "
                f"remove {other.name} from the model first"
            )


# ---- what an input costs a model with methods on ----------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpan:
    """What an input of some length costs a built model, once its applied methods are counted."""

    positions: int  # the positions it occupies (compare with ``max_position_embeddings``)
    keys: int  # the keys one query reads at most (what attention memory grows with)
    methods: tuple[str, ...]  # the applied methods that bound them (empty: both are the input's length)


def model_span(model: Any, length: int) -> ModelSpan:
    """The :class:`ModelSpan` of an input of ``length`` tokens on ``model`` (its applied methods' least bounds)."""
    bounding = [m for m in METHODS.values() if m.overrides("model_span") and m.is_applied(model)]
    spans = {m.name: m.model_span(model, length) for m in bounding}
    bounds = list(spans.values()) or [(length, length)]
    return ModelSpan(min(p for p, _ in bounds), min(k for _, k in bounds), methods=tuple(spans))


def config_of(name: str, data: dict[str, Any] | StrictModel) -> StrictModel:
    """A method's config from a ``longpeft.json`` section, or as given; DataError naming each bad field."""
    config_class = get_method(name).config
    if isinstance(data, config_class):
        return data
    try:
        return config_class.model_validate(data)
    except ValidationError as exc:
        problems = [f"{'.'.join(map(str, error['loc'])) or '(section)'}: {error['msg']}" for error in exc.errors()]
    raise DataError(
        f"longpeft.json methods.{name}: {'; '.join(problems)} (written by a newer longpeft, or edited by hand?)"
    )


def gathered_tensors(
    model: nn.Module, parameters: dict[str, nn.Parameter], state_dict: dict[str, torch.Tensor] | None
) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` for ``parameters`` (``{name: parameter of model}``): their own data, or the tensors a
    gathered ``state_dict`` (keyed as ``model.state_dict()``) holds for them; ValueError for a sharded one it lacks."""
    from torch.distributed.tensor import DTensor

    qualified = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    tensors = {}
    for name, parameter in parameters.items():
        tensor = (state_dict or {}).get(qualified.get(id(parameter)), parameter.detach())
        if tensor.numel() == 0 or isinstance(tensor, DTensor):
            raise ValueError(
                f"{name} is sharded across processes and the gathered state dict lacks it (DeepSpeed ZeRO-3 gathers "
                "nothing without stage3_gather_16bit_weights_on_model_save: true, and only the trainable weights of a "
                "LoRA run); use --launch fsdp2 or ddp"
            )
        tensors[name] = tensor
    return tensors
