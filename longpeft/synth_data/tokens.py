"""Checks on the tokenizer that data and probe builders measure text with."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError


def require_tokens(tokenizer: Any) -> None:
    """Fail clearly when ``tokenizer`` turns ordinary text into no ids (length-targeted builders would otherwise loop
    or divide by zero)."""
    if not tokenizer.encode("The pass key is 12345. The grass is green.", add_special_tokens=False):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ConfigError(f"the tokenizer {name} encodes text to no token ids; use the model's own tokenizer")
