"""Sliding-window perplexity of a model on a text, without materialising full-vocabulary logits."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..errors import ConfigError, DataError, DataNotFoundError
from ..family import backbone_of, causal_lm_of
from .flags import WINDOW
from .generation import check_memory, warn_beyond_positions

LOGIT_CHUNK = 1024  # positions per lm_head call: at most LOGIT_CHUNK x vocab fp32 logits at a time


def _target_nll(hidden: torch.Tensor, targets: torch.Tensor, head: Any) -> torch.Tensor:
    """Sum of -log p(targets) from ``hidden [n, hidden]`` predicting ``targets [n]``, in chunks."""
    total = torch.zeros((), dtype=torch.float64, device=hidden.device)
    for start in range(0, hidden.shape[0], LOGIT_CHUNK):
        logits = head(hidden[start : start + LOGIT_CHUNK]).float()
        total += F.cross_entropy(logits, targets[start : start + LOGIT_CHUNK], reduction="sum").double()
    return total


def sliding_window_perplexity(
    model: Any,
    tokenizer: Any,
    text: str | None = None,
    input_ids: list[int] | torch.Tensor | None = None,
    window: int = WINDOW.default,
    stride: int | None = None,
    max_tokens: int | None = None,
) -> dict[str, Any]:
    """Perplexity with a sliding window: each window of ``window`` tokens (context + scored) scores only the tokens
    not scored before (the last ``stride`` of it, all of the first window), conditioned on the rest of the window.
    Give ``text`` (tokenized with the tokenizer's special tokens) or ``input_ids``; ``stride``: default
    ``window // 2``, ``window`` for disjoint windows; ``max_tokens``: score only the first ``max_tokens`` tokens.
    Returns ``{"perplexity", "nll_per_token", "n_scored", "n_tokens", "window", "stride"}``; ``window`` is the
    longest input a forward got (``min(window, n_tokens)``)."""
    if (text is None) == (input_ids is None):
        raise ValueError("give exactly one of text or input_ids")
    stride = window // 2 if stride is None else stride
    if window < 2 or not 1 <= stride <= window:
        raise ConfigError(f"need window >= 2 and 1 <= stride <= window, got window={window}, stride={stride}")
    ids = torch.as_tensor(tokenizer(text)["input_ids"] if text is not None else input_ids, dtype=torch.long)
    ids = ids.flatten()[:max_tokens]
    n_tokens = ids.numel()
    if n_tokens < 2:
        raise DataError(f"the text has {n_tokens} token(s); perplexity needs at least 2")
    warn_beyond_positions(model, [min(window, n_tokens)])  # the longest input a forward gets
    check_memory(model, 1, min(window, n_tokens), logits_tokens=min(LOGIT_CHUNK, window))
    backbone, head = backbone_of(model), causal_lm_of(model).get_output_embeddings()
    if head is None:
        raise ConfigError(
            f"{type(causal_lm_of(model)).__name__} has no output embedding (lm_head); is it a causal LM?"
        )
    device = getattr(model, "device", torch.device("cpu"))
    total_nll, n_scored, scored_until = 0.0, 0, 0
    n_windows = -(-max(n_tokens - window, 0) // stride) + 1
    for begin in tqdm(range(0, n_tokens, stride), total=n_windows, desc=f"perplexity (window {window})", leave=False):
        end = min(begin + window, n_tokens)
        chunk = ids[begin:end].to(device)
        first_target = max(scored_until, begin + 1)  # the first token of the text is never predicted
        with torch.no_grad():
            hidden = backbone(input_ids=chunk[None], use_cache=False).last_hidden_state[0]
            predictors = hidden[first_target - 1 - begin : end - 1 - begin]
            total_nll += float(_target_nll(predictors, chunk[first_target - begin :], head))
        n_scored += end - first_target
        scored_until = end
        if end == n_tokens:
            break
    nll = total_nll / n_scored
    counts = {"n_scored": n_scored, "n_tokens": n_tokens, "window": min(window, n_tokens), "stride": stride}
    return {"perplexity": math.exp(nll), "nll_per_token": nll, **counts}


def perplexity_of_file(model: Any, tokenizer: Any, path: str | Path, **options: Any) -> dict[str, Any]:
    """:func:`sliding_window_perplexity` on a UTF-8 text file."""
    path = Path(path)
    if not path.is_file():
        raise DataNotFoundError(f"text file {path} does not exist; pass a UTF-8 text file with --text")
    result = sliding_window_perplexity(model, tokenizer, text=path.read_text(encoding="utf-8"), **options)
    return {**result, "text": str(path)}
