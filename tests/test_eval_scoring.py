"""Scoring functions on hand-made continuations."""

from __future__ import annotations

import pytest

from longpeft.eval.scoring import exact_match, normalize, recall, score


def test_normalize():
    assert normalize("  The\n\tPass  KEY ") == "the pass key"


@pytest.mark.parametrize(
    ("prediction", "expected"),
    [
        (" 12345", 1.0),
        ("12345. Remember it.", 1.0),
        (' "12345"', 1.0),
        (": 12345 is the key", 1.0),
        ("\n12345\n", 1.0),
        ("123456", 0.0),  # a longer number is wrong
        ("1234", 0.0),
        ("The pass key is 12345", 0.0),  # must come first
        ("", 0.0),
        ("54321", 0.0),
        (" 12345.6", 0.0),  # numbers continued through a separator are other numbers
        (" 12345,678", 0.0),
        (" 12345-7", 0.0),
        (" 12345_9", 0.0),
        (" 12345, then", 1.0),
        (" 12345.", 1.0),
    ],
)
def test_exact_match(prediction, expected):
    assert exact_match(prediction, "12345") == expected


def test_exact_match_words_ignore_case():
    assert exact_match(" Geology.", "geology") == 1.0
    assert exact_match(" geologys", "geology") == 0.0


def test_recall():
    answers = ["1111", "2222", "3333", "4444"]
    assert recall("1111, 2222, 3333 and 4444.", answers) == 1.0
    assert recall("2222 and 4444", answers) == 0.5
    assert recall("11112222", answers) == 0.0  # digits glued to others are not the answer
    assert recall("nothing here", answers) == 0.0
    assert recall("They are: ABCDE, fghij", ["abcde", "FGHIJ", "KLMNO"]) == pytest.approx(2 / 3)


def test_score_dispatch_and_errors():
    assert score(" 7", ["7"], "exact") == 1.0
    assert score("1 and 3", ["1", "2", "3", "4"], "recall") == 0.5
    with pytest.raises(ValueError, match="exactly one answer"):
        score("1", ["1", "2"], "exact")
    with pytest.raises(ValueError, match="unknown metric"):
        score("1", ["1"], "f1")
    with pytest.raises(ValueError, match="at least one answer"):
        recall("x", [])


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("The pass key is 60494.", 1.0),  # a chat reply: the answer need not come first
        ("60494", 1.0),
        ("Sure! THE PASS KEY IS: **60494**", 1.0),
        ("The pass key is 604941.", 0.0),  # word boundaries: a longer number is wrong
        ("The pass key is 160494.", 0.0),
        ("The pass key is 6049.", 0.0),
        ("The pass key is 60494.5.", 0.0),
        ("The pass key is 1.60494 or 60494,1.", 0.0),
        ("It is 1.60494, no: 60494.", 1.0),  # one whole occurrence is enough
        ("I do not know.", 0.0),
        ("", 0.0),
    ],
)
def test_contains_scores_chat_replies(reply, expected):
    assert score(reply, ["60494"], "contains") == expected


def test_contains_words_ignore_case():
    assert score("The first topic we discussed is Geology.", ["geology"], "contains") == 1.0
    assert score("We discussed geologys.", ["geology"], "contains") == 0.0


def test_contains_needs_one_answer():
    with pytest.raises(ValueError, match="exactly one answer"):
        score("1 2", ["1", "2"], "contains")
