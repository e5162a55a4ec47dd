"""The modeling file an export ships (HARPE, STRING, Activation Beacon) for ``trust_remote_code=True`` without
longpeft: modules whose longpeft imports sit between ``# longpeft-inline-begin`` and ``# longpeft-inline-end``,
joined into one file with those imports replaced by the helpers' source."""

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
    """One Python file: ``docstring``, the ``helpers``' source (longpeft functions the modules import between the
    markers, using torch only), then each of ``modules`` (in dependency order) without its marked imports."""
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
    """``(config path, config.json content, base model_type)`` of a ``save_pretrained`` folder, exported or not;
    FileNotFoundError without config.json, ConfigError for a model_type the export does not know."""
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
    """Write ``source`` as ``modeling_filename`` beside ``config_path`` (those three from :func:`saved_config`) and set
    in config.json the ``settings`` its classes read, ``architectures``, ``auto_map`` and the method's own
    ``model_type`` (loading without ``trust_remote_code`` then fails instead of silently building the stock model);
    ``classes_by_model_type``: base model_type -> (exported model_type, config class, causal-LM class)."""
    (config_path.parent / modeling_filename).write_text(source)
    exported_type, config_class, model_class = classes_by_model_type[model_type]
    module = Path(modeling_filename).stem
    config.update(settings, model_type=exported_type, architectures=[model_class])
    config["auto_map"] = {
        **config.get("auto_map", {}),
        "AutoConfig": f"{module}.{config_class}",
        "AutoModelForCausalLM": f"{module}.{model_class}",
    }
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
