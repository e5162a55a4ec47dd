"""Export a merged HARPE model so plain transformers loads it (trust_remote_code), without longpeft.

``write_remote_code`` copies :mod:`.modeling_harpe` (which imports only torch and transformers)
into the saved folder as ``modeling_harpe.py`` and points config.json's ``auto_map`` at the HARPE
class of the model's architecture.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from . import modeling_harpe
from .modeling_harpe import CAUSAL_LM_CLASS_BY_MODEL_TYPE

MODELING_FILENAME = "modeling_harpe.py"


def write_remote_code(save_dir: str | Path, bases: Sequence[float]) -> None:
    """Make a ``save_pretrained`` folder of a merged HARPE model loadable with plain transformers.

    Writes ``modeling_harpe.py`` beside the weights and sets, in config.json, ``head_rope_bases``
    and ``auto_map = {"AutoModelForCausalLM": "modeling_harpe.Harpe<Arch>ForCausalLM"}``. Then
    ``AutoModelForCausalLM.from_pretrained(save_dir, trust_remote_code=True)`` builds the model
    with the same per-head RoPE, in a process where longpeft is not installed.

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
    if model_type not in CAUSAL_LM_CLASS_BY_MODEL_TYPE:
        raise ValueError(
            f"{config_path}: model_type {model_type!r} has no HARPE export; supported: {sorted(CAUSAL_LM_CLASS_BY_MODEL_TYPE)}"
        )
    kv_heads = config.get("num_key_value_heads") or config.get("num_attention_heads")
    bases = [float(b) for b in bases]
    if len(bases) != kv_heads:
        raise ValueError(f"{config_path}: the model has {kv_heads} key/value heads but {len(bases)} bases were given")
    stored = config.get("head_rope_bases")
    if stored is not None and [float(b) for b in stored] != bases:
        raise ValueError(f"{config_path} already records different head_rope_bases {stored}; export the matching bases")
    (save_dir / MODELING_FILENAME).write_text(Path(modeling_harpe.__file__).read_text())
    config["head_rope_bases"] = bases
    config["auto_map"] = {
        **config.get("auto_map", {}),
        "AutoModelForCausalLM": f"{MODELING_FILENAME[:-3]}.{CAUSAL_LM_CLASS_BY_MODEL_TYPE[model_type]}",
    }
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
