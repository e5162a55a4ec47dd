"""Export a merged HARPE model so plain transformers loads it (trust_remote_code), without longpeft.

``write_remote_code`` writes :mod:`.modeling_harpe` (with longpeft's RoPE helpers inlined, so it
imports only torch and transformers) into the saved folder as ``modeling_harpe.py`` and points config.json's ``auto_map`` at the HARPE
config and model classes of the model's architecture. The exported config gets its own model_type
(``harpe_llama``, ...): transformers would otherwise load the folder without trust_remote_code as
the stock architecture, silently ignoring the per-head bases; now that fails with an error.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Sequence
from pathlib import Path

from . import modeling_harpe
from .modeling_harpe import EXPORT_CLASSES_BY_MODEL_TYPE

MODELING_FILENAME = "modeling_harpe.py"
_INLINE_BEGIN, _INLINE_END = "# longpeft-inline-begin\n", "# longpeft-inline-end\n"


def standalone_modeling_source() -> str:
    """modeling_harpe.py with its longpeft imports replaced by the source of what they import."""
    head, rest = Path(modeling_harpe.__file__).read_text().split(_INLINE_BEGIN)
    _, tail = rest.split(_INLINE_END)
    helpers = "\n\n".join(inspect.getsource(f) for f in modeling_harpe.INLINED_ON_EXPORT)
    tail = tail.replace("INLINED_ON_EXPORT = ", "INLINED_ON_EXPORT = ()  # in longpeft: ", 1)
    return head + "# Inlined from longpeft (rope.py, family.py).\n\n" + helpers + "\n\n" + tail


def write_remote_code(save_dir: str | Path, bases: Sequence[float]) -> None:
    """Make a ``save_pretrained`` folder of a merged HARPE model loadable with plain transformers.

    Writes ``modeling_harpe.py`` beside the weights and sets, in config.json, ``head_rope_bases``,
    ``model_type = "harpe_<type>"``, ``architectures`` and ``auto_map`` (``AutoConfig`` and
    ``AutoModelForCausalLM`` -> the HARPE classes of ``modeling_harpe.py``). Then
    ``AutoModelForCausalLM.from_pretrained(save_dir, trust_remote_code=True)`` builds the model
    with the same per-head RoPE, in a process where longpeft is not installed; without
    ``trust_remote_code`` loading fails instead of giving a model with one base.

    Args:
        save_dir: folder written by ``model.save_pretrained`` (must hold config.json).
        bases: the model's per-KV-head bases (checked against config.json's head count).
    """
    save_dir = Path(save_dir)
    config_path = save_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: call model.save_pretrained({str(save_dir)!r}) first")
    config = json.loads(config_path.read_text())
    model_type = config.get("model_type")
    exported = {classes[0]: base for base, classes in EXPORT_CLASSES_BY_MODEL_TYPE.items()}
    model_type = exported.get(model_type, model_type)  # exporting an export again
    if model_type not in EXPORT_CLASSES_BY_MODEL_TYPE:
        raise ValueError(
            f"{config_path}: model_type {model_type!r} has no HARPE export; supported: {sorted(EXPORT_CLASSES_BY_MODEL_TYPE)}"
        )
    kv_heads = config.get("num_key_value_heads") or config.get("num_attention_heads")
    bases = [float(b) for b in bases]
    if len(bases) != kv_heads:
        raise ValueError(f"{config_path}: the model has {kv_heads} key/value heads but {len(bases)} bases were given")
    stored = config.get("head_rope_bases")
    if stored is not None and [float(b) for b in stored] != bases:
        raise ValueError(f"{config_path} already records different head_rope_bases {stored}; export the matching bases")
    (save_dir / MODELING_FILENAME).write_text(standalone_modeling_source())
    exported_type, config_class, model_class = EXPORT_CLASSES_BY_MODEL_TYPE[model_type]
    module = MODELING_FILENAME[:-3]
    config["head_rope_bases"] = bases
    config["model_type"] = exported_type
    config["architectures"] = [model_class]
    config["auto_map"] = {
        **config.get("auto_map", {}),
        "AutoConfig": f"{module}.{config_class}",
        "AutoModelForCausalLM": f"{module}.{model_class}",
    }
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
