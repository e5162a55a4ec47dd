"""A base model as longpeft sees it before any weight loads, torch-free: its ``config.json`` as transformers v5 reads
it, its chat template, whether it ships modeling code, its module names (from a ``tiny:`` model, a local or built-in
folder, the Hugging Face cache, or the Hub, bounded); RoPE parameter dicts; transformers' model types and optimizer
names read from its source without importing it (which imports torch) unless its layout is unknown.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import importlib.util
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from .errors import ConfigError, HubTimeoutError, ModelSourceError
from .family import adaptable_kind, module_kinds
from .files import asking_the_hub, hub_preflight, is_local
from .reading import read_json_object

# rope_type -> keys that transformers requires besides "rope_type" and "rope_theta".
ROPE_TYPE_REQUIRED_KEYS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
# Keys a rope type reads besides its required ones (transformers ignores, with a log line, any other key).
ROPE_TYPE_OPTIONAL_KEYS: dict[str, tuple[str, ...]] = {
    "yarn": tuple(
        "original_max_position_embeddings attention_factor beta_fast beta_slow mscale mscale_all_dim truncate".split()
    )
}
# transformers' RoPE base of the Llama family (LlamaConfig.default_theta) when a config.json names none.
DEFAULT_ROPE_THETA = 10_000.0
# rope types whose scaling reads the pretraining length, which transformers fills from max_position_embeddings.
READS_ORIGINAL_LENGTH = ("llama3", "yarn", "longrope")


def unused_rope_keys(rope_type: str, keys: Any) -> list[str]:
    """The ``keys`` a ``rope_type`` does not read (transformers would ignore them)."""
    used = {"rope_type", "rope_theta", "partial_rotary_factor", *ROPE_TYPE_REQUIRED_KEYS.get(rope_type, ())}
    return sorted(set(keys) - used - set(ROPE_TYPE_OPTIONAL_KEYS.get(rope_type, ())))


def rope_parameters_of(config: Any) -> dict[str, Any]:
    """A copy of the config's complete ``rope_parameters`` dict (``rope_type`` and ``rope_theta`` at least)."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or "rope_theta" not in params:
        raise ConfigError(
            f"{type(config).__name__} has no usable rope_parameters ({params!r}); longpeft supports "
            "RoPE models whose transformers v5 config carries rope_parameters with a rope_theta"
        )
    return copy.deepcopy({**params, "rope_type": params.get("rope_type", "default")})


def validate_rope_parameters(params: dict[str, Any]) -> dict[str, Any]:
    """Check a rope_parameters dict for the rope types longpeft supports; returns it unchanged."""
    rope_type = params.get("rope_type", "default")
    if rope_type not in ROPE_TYPE_REQUIRED_KEYS:
        raise ConfigError(
            f"rope_parameters.rope_type={rope_type!r} is not supported; choose one of "
            f"{sorted(ROPE_TYPE_REQUIRED_KEYS)}"
        )
    if "rope_theta" not in params:
        raise ConfigError("rope_parameters needs rope_theta (the RoPE base)")
    if float(params["rope_theta"]) <= 1:
        raise ConfigError(f"rope_parameters.rope_theta must be > 1, got {params['rope_theta']}")
    if missing := [k for k in ROPE_TYPE_REQUIRED_KEYS[rope_type] if k not in params]:
        raise ConfigError(f"rope_parameters with rope_type={rope_type!r} needs {missing}")
    return params


def rope_parameters_from_json(config: dict[str, Any]) -> dict[str, Any]:
    """The ``rope_parameters`` transformers v5 gives a Llama-family ``config.json`` dict: its ``rope_scaling`` (v4) or
    ``rope_parameters``, completed from the top level (``rope_type`` from v4's ``type`` or ``default``, ``rope_theta``
    or :data:`DEFAULT_ROPE_THETA`, ``partial_rotary_factor``, a scaling type's original length)."""
    params = copy.deepcopy(config.get("rope_scaling") or config.get("rope_parameters") or {})
    if not isinstance(params, dict):
        raise ConfigError(f"rope_parameters {params!r} is not a mapping of RoPE settings")
    theta = config.get("rope_theta")
    params.setdefault("rope_theta", theta if theta is not None else DEFAULT_ROPE_THETA)
    if config.get("partial_rotary_factor") is not None:
        params.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    params.setdefault("rope_type", params.get("type", "default"))
    if params["rope_type"] in READS_ORIGINAL_LENGTH:
        if (original := config.get("original_max_position_embeddings")) is not None:
            params["original_max_position_embeddings"] = original
        elif config.get("max_position_embeddings") is not None:
            params.setdefault("original_max_position_embeddings", config["max_position_embeddings"])
    return params


def _source(relative: str) -> ast.Module | None:
    """The parsed source of ``transformers/<relative>``, or None when it is not there."""
    spec = importlib.util.find_spec("transformers")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / relative
    return ast.parse(path.read_text()) if path.is_file() else None


@lru_cache(maxsize=1)
def optimizer_names() -> tuple[str, ...]:
    """The optimizer names transformers' Trainer accepts (``training_args.OptimizerNames``)."""
    tree = _source("training_args.py")
    for node in tree.body if tree is not None else ():
        if isinstance(node, ast.ClassDef) and node.name == "OptimizerNames":
            names = tuple(
                statement.value.value
                for statement in node.body
                if isinstance(statement, ast.Assign)
                and isinstance(statement.value, ast.Constant)
                and isinstance(statement.value.value, str)
            )
            if names:
                return names
    from transformers.training_args import OptimizerNames

    return tuple(name.value for name in OptimizerNames)


@lru_cache(maxsize=1)
def model_types() -> frozenset[str]:
    """Every ``model_type`` transformers has a config class for (``CONFIG_MAPPING_NAMES``' keys, read from source)."""
    found: set[str] = set()
    for relative in ("models/auto/auto_mappings.py", "models/auto/configuration_auto.py"):
        tree = _source(relative)
        for node in ast.walk(tree) if tree is not None else ():
            if isinstance(node, (ast.Assign, ast.Expr)) and "CONFIG_MAPPING_NAMES" in ast.unparse(
                node.targets[0] if isinstance(node, ast.Assign) else getattr(node.value, "func", node.value)
            ):
                found |= _string_keys(node.value)
    if found:
        return frozenset(found)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return frozenset(CONFIG_MAPPING_NAMES)


def _string_keys(node: ast.AST) -> set[str]:
    """The first strings of the ``(str, str)`` pairs and the string keys of the dicts inside ``node``."""
    keys = set()
    for inner in ast.walk(node):
        if isinstance(inner, ast.Tuple) and len(inner.elts) == 2 and _is_string(inner.elts[0]):
            keys.add(inner.elts[0].value)
        elif isinstance(inner, ast.Dict):
            keys |= {key.value for key in inner.keys if key is not None and _is_string(key)}
    return keys


def _is_string(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


TOY_BASE = "longpeft:toy-base"
BUILTIN_MODELS = {TOY_BASE: Path(__file__).parent / "toy_base"}


def model_location(name: str | Path) -> str:
    """Where to load ``name`` from: a built-in model's packaged folder (``longpeft:toy-base``), else ``name``."""
    return str(BUILTIN_MODELS.get(str(name), name))


TINY_PREFIX = "tiny:"
# The keys of config.json a causal LM must have for longpeft to plan and check it.
REQUIRED_KEYS = tuple(
    "model_type hidden_size num_hidden_layers num_attention_heads vocab_size max_position_embeddings".split()
)
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # where transformers 5 saves a tokenizer's template


class BaseNotHere(ModelSourceError):
    """The base's config is not readable here now: a missing local folder, or the Hub offline or silent."""


class BaseConfig:
    """A ``config.json`` (from ``source``) read as transformers v5 does (``rope_parameters``, ``num_key_value_heads``,
    ``head_dim`` completed); a ModelSourceError when a :data:`REQUIRED_KEYS` value is missing or unusable."""

    def __init__(self, data: dict[str, Any], source: str) -> None:
        if missing := [key for key in REQUIRED_KEYS if not _usable(key, data.get(key))]:
            raise ModelSourceError(
                f"{source}: config.json has no usable {', '.join(missing)}; is it a causal LM's config (a model "
                "folder's config.json)?"
            )
        values = dict(data)
        if values.get("num_key_value_heads") is None:
            values["num_key_value_heads"] = values["num_attention_heads"]
        if values.get("head_dim") is None:
            values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
        values["rope_parameters"] = rope_parameters_from_json(values)
        self._values, self.source = values, source

    def __getattr__(self, name: str) -> Any:
        values = self.__dict__.get("_values", {})
        if name in values:
            return values[name]
        raise AttributeError(f"{self.__dict__.get('source', 'config.json')} has no {name!r}")

    def to_dict(self) -> dict[str, Any]:
        return dict(self._values)


def _usable(key: str, value: Any) -> bool:
    if key == "model_type":
        return isinstance(value, str) and bool(value)
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@dataclass(frozen=True)
class BaseFacts:
    """A base before loading: its ``name`` as given, the ``source`` (a path, or ``tiny:ARCH``) of its ``config``, its
    tokenizer's ``chat_template`` (None if none or not found) and whether its tokenizer files were found."""

    name: str
    source: str
    config: BaseConfig
    chat_template: str | None
    tokenizer_found: bool

    @property
    def remote_code(self) -> str | None:
        """The class of the base's own modeling code (its config.json's ``auto_map``), or None."""
        auto_map = getattr(self.config, "auto_map", None)
        if not isinstance(auto_map, dict):
            return None
        found = auto_map.get("AutoModelForCausalLM") or auto_map.get("AutoModel") or auto_map.get("AutoConfig")
        return str(found[0] if isinstance(found, list) else found) if found else None

    def runs_own_code(self, trusted: bool) -> bool:
        """Whether transformers would build this base with the code it ships (``trusted``, or no class of its own)."""
        return self.remote_code is not None and (trusted or self.config.model_type not in model_types())

    def check_remote_code(self, trusted: bool, setting: str | None) -> None:
        """Raise a ConfigError for a ``model_type`` transformers has no class for, unless the base ships code for it
        and is ``trusted``; ``setting`` names the key or flag that allows it (None where nothing does)."""
        model_type = self.config.model_type
        if model_type in model_types() or trusted and self.remote_code:
            return
        if self.remote_code is None:
            raise ConfigError(
                f"{self.name}: transformers does not know its model_type {model_type!r} and the base ships no code "
                "for it; upgrade transformers, or use another base"
            )
        allow = f"set {setting} if you trust that code, or" if setting else "longpeft runs no such code here:"
        raise ConfigError(
            f"{self.name} ships its own modeling code ({self.remote_code} in its config.json's auto_map) for its "
            f"model_type {model_type!r}, which transformers has no class of; it runs only when allowed: {allow} use "
            "a base transformers supports itself"
        )

    def module_kinds(self) -> dict[str, str]:
        """``{module name: kind}`` of the causal LM this config builds (:func:`~longpeft.family.module_kinds`); for
        architectures outside the Llama family the model is built on the ``meta`` device (torch and transformers)."""
        kinds = module_kinds(self.config)
        return kinds if kinds is not None else _meta_module_kinds(self.config.to_dict(), self.name)


def read_base(name: str, revision: str | None = None, what: str = "model.name_or_path") -> BaseFacts:
    """The :class:`BaseFacts` of the base ``name`` (``tiny:ARCH``, a built-in name, a local folder or a Hub id) at
    ``revision``; ``what`` names the setting in messages. Raises BaseNotHere (a missing local folder, or a Hub model
    not in the cache while the Hub is offline or silent), or ModelSourceError (a folder without config.json, a
    config.json no causal LM's, a Hub repo that does not exist)."""
    if name.startswith(TINY_PREFIX):
        from .tiny import CHAT_TEMPLATE, demo_vocab_size, tiny_settings

        try:
            settings = tiny_settings(name[len(TINY_PREFIX) :], vocab_size=demo_vocab_size())
        except ConfigError as error:  # an unknown architecture
            raise ConfigError(f"{what} {name}: {error}") from None
        return BaseFacts(name, name, BaseConfig(settings, name), CHAT_TEMPLATE, tokenizer_found=True)
    location = model_location(name)
    if is_local(location):
        folder = Path(location)
        if not folder.is_dir():
            raise BaseNotHere(f"{what} {name}: no such folder on this machine (and not a Hub repo id owner/name)")
        if not (folder / "config.json").is_file():
            raise ModelSourceError(f"{what} {name}: the folder has no config.json; point it at a model's folder")
        return _folder_facts(name, folder, str(folder / "config.json"))
    return _hub_facts(name, revision, what)


def check_base_code(name: str, revision: str | None, trusted: bool, setting: str | None) -> None:
    """:meth:`BaseFacts.check_remote_code` of the base ``name``, if its config is readable here."""
    with contextlib.suppress(BaseNotHere):
        read_base(name, revision, "base model").check_remote_code(trusted, setting)


def _folder_facts(name: str, folder: Path, source: str) -> BaseFacts:
    config = BaseConfig(read_json_object(folder / "config.json", "the base's config"), source)
    tokenizer_file = folder / TOKENIZER_CONFIG
    template_file = folder / CHAT_TEMPLATE_FILE
    tokenizer = read_json_object(tokenizer_file, "the base's tokenizer config") if tokenizer_file.is_file() else {}
    template = tokenizer.get("chat_template")  # a string, or a list of named ones: the one named default
    if isinstance(template, list):
        template = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = template.get("default")
    template = template_file.read_text() if template_file.is_file() else template
    found = tokenizer_file.is_file() or template_file.is_file()
    return BaseFacts(name, source, config, template if isinstance(template, str) and template else None, found)


def _hub_facts(name: str, revision: str | None, what: str) -> BaseFacts:
    """A Hub base: its config files from the cache, or downloaded (config, tokenizer config, chat template)."""
    from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import EntryNotFoundError

    cached = try_to_load_from_cache(name, "config.json", revision=revision)
    if isinstance(cached, str):
        return _folder_facts(name, Path(cached).parent, cached)
    if constants.HF_HUB_OFFLINE:
        raise BaseNotHere(f"{what} {name}: its config.json is not in the Hugging Face cache and HF_HUB_OFFLINE is set")
    try:
        hub_preflight(name, what)
        with asking_the_hub(name, "base model"):
            try:
                folder = Path(hf_hub_download(name, "config.json", revision=revision)).parent
            except EntryNotFoundError:
                raise ModelSourceError(f"base model {name}: the Hub repo has no config.json; is it a model?") from None
            for optional in (TOKENIZER_CONFIG, CHAT_TEMPLATE_FILE):  # where the repo has them
                with contextlib.suppress(EntryNotFoundError):
                    hf_hub_download(name, optional, revision=revision)
    except (HubTimeoutError, OSError) as error:
        if isinstance(error, ModelSourceError):
            raise
        raise BaseNotHere(f"{what} {name}: its config.json could not be fetched ({error})") from None
    return _folder_facts(name, folder, str(folder / "config.json"))


def _meta_module_kinds(config: dict[str, Any], name: str) -> dict[str, str]:
    """:meth:`BaseFacts.module_kinds` of the model ``config`` builds, built on the ``meta`` device (no weights);
    a ConfigError names the base ``name`` when transformers cannot build its config."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = {key: value for key, value in config.items() if key not in ("auto_map", "architectures")}
    model_type = settings.pop("model_type")
    try:
        built = AutoConfig.for_model(model_type, **settings)
    except (ValueError, KeyError) as error:
        raise ConfigError(
            f"{name}: transformers does not know model_type {model_type!r} ({str(error).splitlines()[0][:120]}); "
            "upgrade transformers or use another base"
        ) from None
    with init_empty_weights(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(built)
    return {module_name: adaptable_kind(module) for module_name, module in model.named_modules() if module_name}
