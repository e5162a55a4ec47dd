"""Export of a merged or fully fine-tuned model with new RoPE parameters: config.json as transformers 4 reads it."""

from __future__ import annotations

import json
from pathlib import Path

from .config import RopeConfig


def write_legacy_rope_keys(folder: Path, config: RopeConfig) -> None:
    """Also write a saved model's RoPE parameters as transformers 4 reads them: top-level ``rope_theta``, and
    ``rope_scaling`` for a scaled rope type (null for the default one). transformers 5 saves only ``rope_parameters``,
    and a reader of the old keys (serving stacks pinned to transformers < 5) would silently build the architecture's
    default base (10,000 for Llama); transformers 5 reads the file as before."""
    path = folder / "config.json"
    data = json.loads(path.read_text())
    params = config.rope_parameters()
    scaling = {key: value for key, value in params.items() if key != "rope_theta"}
    data["rope_theta"] = params["rope_theta"]
    data["rope_scaling"] = scaling if scaling.get("rope_type", "default") != "default" else None
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
