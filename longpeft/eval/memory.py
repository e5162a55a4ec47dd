"""Checks before evaluation forwards: the memory estimate (fail early, with the estimated need, when inputs cannot
fit) and the warning for inputs longer than the positions a model was trained on."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import LongpeftError
from ..family import head_dim_of


class InsufficientMemoryError(LongpeftError, MemoryError):
    """The evaluation input is estimated not to fit in the device's free memory."""


def _dtype_bytes(model: Any) -> int:
    try:
        return next(model.parameters()).element_size()
    except (StopIteration, AttributeError):
        return 4


def estimate_forward_bytes(
    config: Any,
    batch_size: int,
    seq_len: int,
    dtype_bytes: int = 2,
    attn_implementation: str = "sdpa",
    logits_tokens: int = 1,
) -> int:
    """Bytes a no-grad forward of ``batch_size`` x ``seq_len`` tokens needs beyond the weights.

    Counts the KV cache of all layers, one layer's activations (hidden, MLP and q/k/v/o), the
    attention workspace (the full ``[heads, seq, seq]`` fp32 scores for eager attention; for
    SDPA/flash, the fp32 output plus STRING's extra copy of keys and values) and the fp32 logits of
    ``logits_tokens`` positions per sequence.
    """
    heads, hidden, head_dim = config.num_attention_heads, config.hidden_size, head_dim_of(config)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    intermediate = getattr(config, "intermediate_size", 4 * hidden)
    tokens = batch_size * seq_len
    kv_cache = 2 * config.num_hidden_layers * tokens * kv_heads * head_dim * dtype_bytes
    activations = tokens * (4 * hidden + 3 * intermediate + (heads + 2 * kv_heads) * head_dim) * dtype_bytes
    if attn_implementation == "eager":
        attention = 2 * batch_size * heads * seq_len * seq_len * 4
    else:
        attention = tokens * heads * head_dim * 4 + 2 * tokens * kv_heads * head_dim * dtype_bytes
    return kv_cache + activations + attention + batch_size * logits_tokens * config.vocab_size * 4  # fp32 logits


def available_bytes(device: torch.device | str) -> int:
    """Free memory on ``device``: CUDA free memory, or the system's MemAvailable for the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    meminfo = Path("/proc/meminfo")
    lines = meminfo.read_text().splitlines() if meminfo.exists() else []
    available = [int(line.split()[1]) * 1024 for line in lines if line.startswith("MemAvailable:")]
    return available[0] if available else os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_memory(model: Any, batch_size: int, seq_len: int, logits_tokens: int = 1, headroom: float = 0.9) -> int:
    """Raise InsufficientMemoryError when a forward of ``batch_size`` x ``seq_len`` will not fit.

    Counts the keys one query reads at most (``Method.model_span``: with Activation Beacon its memory plus one
    window, whatever ``seq_len``). Returns the estimated bytes.
    """
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "num_hidden_layers"):
        return 0  # not a transformers model (e.g. a test double): nothing to estimate
    from ..adapters import model_span

    seq_len = model_span(model, seq_len).keys
    device = getattr(model, "device", torch.device("cpu"))
    implementation = getattr(config, "_attn_implementation", None) or "sdpa"
    need = estimate_forward_bytes(config, batch_size, seq_len, _dtype_bytes(model), implementation, logits_tokens)
    free = available_bytes(device)
    if need > headroom * free:
        raise InsufficientMemoryError(
            f"evaluating {batch_size} x {seq_len} tokens needs about {need / 2**30:.2f} GiB beyond the weights "
            f"({implementation} attention), but only {free / 2**30:.2f} GiB is free on {device}; lower --batch-size "
            "or the longest length, or use sdpa/flash attention instead of eager"
        )
    return need


def warn_beyond_positions(model: Any, lengths: Sequence[int]) -> None:
    """Warn (one warning for all ``lengths``) when inputs (prompts, perplexity windows) span more positions than
    the model's ``max_position_embeddings``, counted with the applied methods that bound them (STRING: its largest
    scored distance + 1; Activation Beacon: its memory plus one window; see ``Method.model_span``)."""
    max_positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if not max_positions:
        return
    from ..adapters import model_span

    spans = {n: model_span(model, n) for n in lengths}
    over = [n for n in lengths if spans[n].positions > max_positions]
    if over:
        methods = " and ".join(spans[over[0]].methods)
        warnings.warn(
            f"inputs of {', '.join(map(str, over))} tokens are longer than the model's max_position_embeddings="
            f"{max_positions}{f' even with {methods} on' if methods else ''}: positions beyond it were never trained, "
            "so expect low scores there unless the model was extended for them",
            stacklevel=2,
        )
