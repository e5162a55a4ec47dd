"""Scoring of generated continuations: exact match (first answer token) and recall (answers found)."""

from __future__ import annotations

import re
from collections.abc import Sequence


def normalize(text: str) -> str:
    """Lower-case, with runs of whitespace collapsed to one space and the ends stripped."""
    return re.sub(r"\s+", " ", text).strip().lower()


def exact_match(prediction: str, answer: str) -> float:
    """1.0 when the continuation begins with ``answer`` as a whole word, else 0.0.

    Leading spaces, quotes and colons are skipped, and case is ignored: for the answer ``12345``,
    ``" 12345. Remember"`` scores 1, ``"123456"`` and ``"The 12345"`` score 0.
    """
    text = normalize(prediction).lstrip(" \"'`:*")
    target = normalize(answer)
    if not target or not text.startswith(target):
        return 0.0
    rest = text[len(target) :]
    return 0.0 if rest[:1].isalnum() else 1.0


def recall(prediction: str, answers: Sequence[str]) -> float:
    """Fraction of ``answers`` that appear in the continuation as whole words (case-insensitive)."""
    if not answers:
        raise ValueError("recall needs at least one answer")
    text = normalize(prediction)
    found = sum(1 for a in answers if re.search(rf"(?<![0-9a-z]){re.escape(normalize(a))}(?![0-9a-z])", text))
    return found / len(answers)


def score(prediction: str, answers: Sequence[str], metric: str) -> float:
    """Score one continuation with ``metric`` ("exact": the single answer first; "recall")."""
    if metric == "exact":
        if len(answers) != 1:
            raise ValueError(f"exact match needs exactly one answer, got {len(answers)}")
        return exact_match(prediction, answers[0])
    if metric == "recall":
        return recall(prediction, answers)
    raise ValueError(f"unknown metric {metric!r}; use 'exact' or 'recall'")
