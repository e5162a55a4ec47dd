"""Batched greedy generation with left padding that stops on every eos id of the model."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..errors import ConfigError


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
