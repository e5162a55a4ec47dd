"""The warning for inputs longer than the positions a model was trained on (probe prompts, perplexity windows)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any


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
