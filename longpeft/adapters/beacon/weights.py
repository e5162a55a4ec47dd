"""Beacon weights on disk: ``beacon_adapter.safetensors`` beside ``longpeft.json``, under the authors' tensor names
(``model.layers.{i}.self_attn.beacon_{q,k,v,o}_proj.{weight,bias}``, ``...beacon_q_proj.lora_A.weight`` /
``lora_B.weight`` with ``projection: lora``, ``model.beacon_embed_tokens.weight``), and :data:`AUTHORS_TENSOR`, the
beacon tensors of the authors' released models, which ``longpeft.hub`` reads (no remote code runs)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from ...errors import DataError
from ...family import head_dim_of, num_kv_heads
from ...reading import safetensors_header
from ..registry import gathered_tensors
from .patch import beacon_parameters, causal_lm_of

WEIGHTS_FILENAME = "beacon_adapter.safetensors"
AUTHORS_TENSOR = re.compile(
    r"^model\.(layers\.\d+\.self_attn\.beacon_[qkvo]_proj\.(weight|bias)|beacon_embed_tokens\.weight)$"
)


def authors_tensor_shape(name: str, config: Any) -> tuple[int, ...]:
    """The shape an authors' beacon tensor ``name`` (matching :data:`AUTHORS_TENSOR`) has on a base of ``config``: the
    base's own projection's (a bias: its output size), or ``(1, hidden)`` for ``beacon_embed_tokens``."""
    hidden = config.hidden_size
    if name.endswith("beacon_embed_tokens.weight"):
        return (1, hidden)
    projection = name.split(".")[-2][len("beacon_")]  # q, k, v or o
    width = (num_kv_heads(config) if projection in ("k", "v") else config.num_attention_heads) * head_dim_of(config)
    out_size, in_size = (hidden, width) if projection == "o" else (width, hidden)
    return (out_size,) if name.endswith(".bias") else (out_size, in_size)


def save_beacon_weights(
    model: nn.Module, folder: str | Path, state_dict: dict[str, torch.Tensor] | None = None
) -> Path:
    """Write ``beacon_adapter.safetensors`` (float32, under the authors' tensor names) into ``folder``; returns its
    path. ``state_dict``: the gathered weights of a sharded model (keyed as ``model.state_dict()``), read instead."""
    path = Path(folder) / WEIGHTS_FILENAME
    path.parent.mkdir(parents=True, exist_ok=True)
    prefix = causal_lm_of(model).base_model_prefix
    gathered = gathered_tensors(model, beacon_parameters(model), state_dict)
    tensors = {f"{prefix}.{name}": t.float().contiguous().cpu() for name, t in gathered.items()}
    if not tensors:
        raise ValueError("the model has no beacon weights to save; apply Activation Beacon first")
    save_file(tensors, str(path), metadata={"format": "pt", "source": "longpeft"})
    return path


def load_beacon_weights(model: nn.Module, folder: str | Path) -> None:
    """Load ``beacon_adapter.safetensors`` from ``folder`` into a model that has beacons of the same shape; raises
    FileNotFoundError (no weights file) or DataError (names or shapes that do not match, listed)."""
    path = Path(folder) / WEIGHTS_FILENAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: the adapter's longpeft.json names Activation Beacon but its beacon weights are missing"
        )
    prefix = causal_lm_of(model).base_model_prefix
    own = {f"{prefix}.{name}": p for name, p in beacon_parameters(model).items()}
    safetensors_header(path)  # a truncated or foreign file is named before safetensors reads it
    with safe_open(str(path), framework="pt") as f:
        stored = set(f.keys())
        missing, unexpected = sorted(set(own) - stored), sorted(stored - set(own))
        if missing or unexpected:
            raise DataError(
                f"{path} does not fit the model's beacon weights: missing {missing[:4]}"
                f"{'...' if len(missing) > 4 else ''}, unexpected {unexpected[:4]}"
                f"{'...' if len(unexpected) > 4 else ''} (projection kind or params differ?)"
            )
        with torch.no_grad():
            for name, parameter in own.items():
                tensor = f.get_tensor(name)
                if tensor.shape != parameter.shape:
                    raise DataError(
                        f"{path}: {name} has shape {tuple(tensor.shape)}, the model expects "
                        f"{tuple(parameter.shape)}; load it on the base model it was trained on"
                    )
                parameter.copy_(tensor.to(parameter.dtype))
