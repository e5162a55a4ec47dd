"""Scoring of generated continuations: exact match (the answer first: plain prompts end where it begins), contains
(the answer anywhere: chat replies, in the model's own words) and recall (the fraction of answers found). All rules
match whole words after :func:`normalize`: for ``60494``, ``604941`` is wrong, and so are numbers that continue it
through a separator (``60494.1``, ``60494,123``, ``60494-7``)."""

from __future__ import annotations

import re
from collections.abc import Sequence


def normalize(text: str) -> str:
    """Lower-case, with runs of whitespace collapsed to one space and the ends stripped."""
    return re.sub(r"\s+", " ", text).strip().lower()


# A number glued to a number answer through one of these is another number (12345.6, 12345,678, 12345-7).
_NUMBER_JOINERS = ".,_-"


def _glued(before: str, target: str, after: str) -> bool:
    """Whether ``target``, between the texts ``before`` and ``after``, is part of a longer word or number."""
    if before[-1:].isalnum() or after[:1].isalnum():
        return True
    if target[-1:].isdigit() and after[:1] in _NUMBER_JOINERS and after[1:2].isdigit():
        return True
    return bool(target[:1].isdigit() and before[-1:] in _NUMBER_JOINERS and before[-2:-1].isdigit())


def exact_match(prediction: str, answer: str) -> float:
    """1.0 when the continuation begins with ``answer`` as a whole word, else 0.0. Leading spaces, quotes and colons
    are skipped, and case is ignored: for the answer ``12345``, ``" 12345. Remember"`` scores 1, ``"123456"``,
    ``"12345.6"`` and ``"The 12345"`` score 0."""
    text, target = normalize(prediction).lstrip(" \"'`:*"), normalize(answer)
    return float(bool(target) and text.startswith(target) and not _glued("", target, text[len(target) :]))


def _appears(text: str, answer: str) -> bool:
    """Whether ``answer`` is in the normalized ``text`` as whole words (nothing glued on, see :func:`_glued`)."""
    target = normalize(answer)
    return bool(target) and any(
        not _glued(text[: m.start()], target, text[m.end() :]) for m in re.finditer(re.escape(target), text)
    )


def contains(prediction: str, answer: str) -> float:
    """1.0 when ``answer`` appears anywhere in the reply as whole words (case-insensitive), else 0.0:
    for ``60494``, ``"The pass key is 60494."`` scores 1, ``"604941"`` scores 0."""
    return float(_appears(normalize(prediction), answer))


def recall(prediction: str, answers: Sequence[str]) -> float:
    """Fraction of ``answers`` that appear in the continuation as whole words (case-insensitive)."""
    if not answers:
        raise ValueError("recall needs at least one answer")
    text = normalize(prediction)
    return sum(_appears(text, a) for a in answers) / len(answers)


SINGLE_ANSWER_METRICS = {"exact": exact_match, "contains": contains}


def score(prediction: str, answers: Sequence[str], metric: str) -> float:
    """Score one continuation with ``metric``: "exact" (the single answer first: plain prompts),
    "contains" (the single answer anywhere: chat replies) or "recall" (fraction of answers found)."""
    if metric in SINGLE_ANSWER_METRICS:
        if len(answers) != 1:
            raise ValueError(f"{metric} match needs exactly one answer, got {len(answers)}")
        return SINGLE_ANSWER_METRICS[metric](prediction, answers[0])
    if metric == "recall":
        return recall(prediction, answers)
    raise ValueError(f"unknown metric {metric!r}; use 'exact', 'contains' or 'recall'")
