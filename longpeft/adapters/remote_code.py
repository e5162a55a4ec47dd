"""Shared by the exports that ship a modeling file (HARPE, Activation Beacon): plain transformers loads
the saved folder with ``trust_remote_code=True``, in a process where longpeft is not installed.

A method's modeling code lives in longpeft modules whose only longpeft imports sit between
``# longpeft-inline-begin`` and ``# longpeft-inline-end`` markers. :func:`standalone_source` joins
those modules into one file, drops the marked imports and inlines the helper functions they used.
:func:`point_config_at_remote_code` writes that file beside the weights and rewrites config.json:
the method's own ``model_type`` (so loading without ``trust_remote_code`` fails instead of silently
building the stock model), ``architectures``, ``auto_map`` and the method's settings.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from ..errors import ConfigError

INLINE_BEGIN, INLINE_END = "# longpeft-inline-begin\n", "# longpeft-inline-end\n"
_FUTURE = "from __future__ import annotations\n"


def standalone_source(docstring: str, modules: Sequence[ModuleType], helpers: Sequence[Callable]) -> str:
    """One Python file: ``docstring``, the ``helpers``' source, then each module without its marked imports.

    Args:
        docstring: the file's docstring (what it is, that longpeft wrote it).
        modules: modules in dependency order (a module may use names of the ones before it).
        helpers: longpeft functions the modules import between the markers (they may use torch only).
    """
    parts = [f'"""{docstring}"""\n\n', _FUTURE, "\nimport torch\n\n# Inlined from longpeft.\n\n"]
    parts += [inspect.getsource(helper) + "\n\n" for helper in helpers]
    for module in modules:
        text = Path(module.__file__).read_text()
        if INLINE_BEGIN in text:
            head, rest = text.split(INLINE_BEGIN)
            text = head + rest.split(INLINE_END, 1)[1]
        parts.append(f"# ---- {module.__name__} " + "-" * max(0, 80 - len(module.__name__)) + "\n")
        parts.append(text.replace(_FUTURE, "", 1) + "\n\n")
    return "".join(parts)


def saved_config(
    save_dir: str | Path, classes_by_model_type: dict[str, tuple[str, str, str]], what: str
) -> tuple[Path, dict[str, Any], str]:
    """``(config path, config.json content, base model_type)`` of a ``save_pretrained`` folder.

    An already exported folder (``model_type`` = the method's own) gives its base model_type back.

    Raises:
        FileNotFoundError: no config.json; ValueError: a model_type the export does not know.
    """
    config_path = Path(save_dir) / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: call model.save_pretrained({str(save_dir)!r}) first")
    config = json.loads(config_path.read_text())
    exported = {classes[0]: base for base, classes in classes_by_model_type.items()}
    model_type = exported.get(config.get("model_type"), config.get("model_type"))
    if model_type not in classes_by_model_type:
        raise ConfigError(
            f"{config_path}: model_type {model_type!r} has no {what} export; "
            f"supported: {sorted(classes_by_model_type)}"
        )
    return config_path, config, model_type


def point_config_at_remote_code(
    config_path: Path,
    config: dict[str, Any],
    model_type: str,
    classes_by_model_type: dict[str, tuple[str, str, str]],
    modeling_filename: str,
    source: str,
    settings: dict[str, Any],
) -> None:
    """Write ``source`` as ``modeling_filename`` beside config.json and point config.json at its classes.

    Args:
        config_path, config, model_type: from :func:`saved_config`.
        classes_by_model_type: base model_type -> (exported model_type, config class, causal-LM class).
        modeling_filename: e.g. ``modeling_harpe.py``.
        source: the file's content (:func:`standalone_source`).
        settings: config.json entries the classes read (e.g. ``{"head_rope_bases": [...]}``).
    """
    (config_path.parent / modeling_filename).write_text(source)
    exported_type, config_class, model_class = classes_by_model_type[model_type]
    module = modeling_filename[: -len(".py")]
    config.update(settings)
    config["model_type"] = exported_type
    config["architectures"] = [model_class]
    config["auto_map"] = {
        **config.get("auto_map", {}),
        "AutoConfig": f"{module}.{config_class}",
        "AutoModelForCausalLM": f"{module}.{model_class}",
    }
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
