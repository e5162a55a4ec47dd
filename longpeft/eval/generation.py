"""Evaluation forwards: batched greedy generation with left padding that stops on every eos id of the model, and
the checks before a forward: the memory estimate (fail early, with the estimated need, when inputs cannot fit) and
the warning for inputs longer than the positions a model was trained on."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError, LongpeftError
from ..family import head_dim_of


def eos_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """All end-of-sequence ids: the generation config's (a list for e.g. Llama-3-Instruct), the
    model config's and the tokenizer's, without duplicates."""
    ids: list[int] = []
    for owner in (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer):
        value = getattr(owner, "eos_token_id", None)
        for i in value if isinstance(value, (list, tuple)) else [value]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    if not ids:
        raise ConfigError("the model and tokenizer define no eos token id; set generation_config.eos_token_id")
    return ids


def pad_token_id(tokenizer: Any, eos_ids: Sequence[int]) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)``, each ``[batch, longest]``, padded on the left."""
    longest = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if len(prompt):
            input_ids[row, longest - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
            attention_mask[row, longest - len(prompt) :] = 1
    return input_ids, attention_mask


# Plain greedy decoding whatever the model's generation_config says: a saved repetition penalty (some instruct models
# ship 1.05), banned n-grams or words, a minimum length or beams would change what a probe's answer is scored on
# (a repetition penalty pushes the model away from the needle's own digits in the prompt).
GREEDY = dict(do_sample=False, num_beams=1, repetition_penalty=1.0, no_repeat_ngram_size=0, min_new_tokens=0)
GREEDY |= dict.fromkeys(  # every other sampling setting or constraint unset
    "temperature top_p top_k penalty_alpha dola_layers bad_words_ids suppress_tokens begin_suppress_tokens "
    "sequence_bias forced_bos_token_id forced_eos_token_id exponential_decay_length_penalty".split()
)


def generate_batch(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_ids: Sequence[int],
    pad_id: int,
) -> list[str]:
    """Greedy continuations (:data:`GREEDY`) of one left-padded batch of token-id prompts, each cut at the first
    eos id and decoded without special tokens."""
    input_ids, attention_mask = left_pad(prompts, pad_id)
    device = getattr(model, "device", torch.device("cpu"))
    with torch.no_grad():
        generated = model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            max_new_tokens=max_new_tokens,
            **GREEDY,
            eos_token_id=list(eos_ids),
            pad_token_id=pad_id,
        )
    rows = generated[:, input_ids.shape[1] :].tolist()
    cuts = [next((k for k, token in enumerate(row) if token in eos_ids), len(row)) for row in rows]
    return [tokenizer.decode(row[:cut], skip_special_tokens=True) for row, cut in zip(rows, cuts)]


class InsufficientMemoryError(LongpeftError, MemoryError):
    """The evaluation input is estimated not to fit in the device's free memory."""


def estimate_forward_bytes(
    config: Any,
    batch_size: int,
    seq_len: int,
    dtype_bytes: int = 2,
    attn_implementation: str = "sdpa",
    logits_tokens: int = 1,
) -> int:
    """Bytes a no-grad forward of ``batch_size`` x ``seq_len`` tokens needs beyond the weights: the KV cache of all
    layers, one layer's activations (hidden, MLP and q/k/v/o), the attention workspace (eager: the full
    ``[heads, seq, seq]`` fp32 scores; SDPA/flash: the fp32 output plus STRING's extra copy of keys and values) and
    the fp32 logits of ``logits_tokens`` positions per sequence."""
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
    """Raise InsufficientMemoryError when a forward of ``batch_size`` x ``seq_len`` will not fit, counting the keys one
    query reads at most (``Method.model_span``: with Activation Beacon its memory plus one window); returns the
    estimated bytes."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "num_hidden_layers"):
        return 0  # not a transformers model (e.g. a test double): nothing to estimate
    from ..adapters import model_span

    seq_len = model_span(model, seq_len).keys
    device = getattr(model, "device", torch.device("cpu"))
    implementation = getattr(config, "_attn_implementation", None) or "sdpa"
    dtype_bytes = next(iter(model.parameters()), torch.empty(0)).element_size()  # fp32 (4 bytes) for no weights
    need = estimate_forward_bytes(config, batch_size, seq_len, dtype_bytes, implementation, logits_tokens)
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
