"""Probe generators: exact token lengths, needle placement, determinism, clear errors."""

from __future__ import annotations

import re

import pytest

from longpeft.eval.registry import DEPTH_TASKS, PROBE_TASKS, ProbeBuilder, make_probes
from longpeft.tiny import train_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


@pytest.mark.parametrize("task", PROBE_TASKS)
@pytest.mark.parametrize("chat", [False, True])
def test_exact_lengths_and_answers_in_prompt(tokenizer, task, chat):
    probes = make_probes(task, tokenizer, [900, 1333], [0.0, 0.6, 1.0], n_samples=2, seed=3, chat=chat)
    assert len(probes) == 2 * 2 * (3 if task in DEPTH_TASKS else 1)
    for probe in probes:
        assert len(probe.input_ids) == probe.length
        text = tokenizer.decode(probe.input_ids)
        for answer in probe.answers:
            assert answer in text
        if chat:
            assert text.endswith("<|assistant|>\n")
        else:
            assert not text.endswith("\n")


def test_needle_positions_follow_depth(tokenizer):
    builder = ProbeBuilder(tokenizer, seed=0)
    positions = []
    for depth in (0.0, 0.25, 0.5, 0.75, 1.0):
        probe = builder.passkey(2000, depth)
        key = probe.answers[0]
        needle = tokenizer.encode(
            f" The pass key is {key}. Remember it. {key} is the pass key.", add_special_tokens=False
        )
        pos = probe.metadata["needle_position"]
        assert probe.input_ids[pos : pos + len(needle)] == needle
        positions.append(pos)
        if depth == 0.0:
            assert tokenizer.decode(probe.input_ids[:pos]).endswith("I will quiz you about it.")
        if depth == 1.0:
            assert tokenizer.decode(probe.input_ids[pos + len(needle) :]).startswith(" What is the pass key?")
    assert positions == sorted(positions)
    # depth 0.5 lands near the middle of the haystack (within a sentence or two)
    assert abs(positions[2] - (positions[0] + positions[-1]) / 2) < 30


def test_deterministic_given_seed(tokenizer):
    a = make_probes("niah_multikey", tokenizer, [800], [0.5], n_samples=3, seed=7)
    b = make_probes("niah_multikey", tokenizer, [800], [0.5], n_samples=3, seed=7)
    c = make_probes("niah_multikey", tokenizer, [800], [0.5], n_samples=3, seed=8)
    assert [p.to_dict() for p in a] == [p.to_dict() for p in b]
    assert [p.input_ids for p in a] != [p.input_ids for p in c]
    assert len({tuple(p.input_ids) for p in a}) == 3  # samples differ from each other


def test_task_structure(tokenizer):
    builder = ProbeBuilder(tokenizer, seed=1)
    multi = builder.make("niah_multiquery", 1500, 0.2)
    assert multi.metric == "recall" and len(multi.answers) == 2 and len(multi.metadata["keys"]) == 4
    values = builder.make("niah_multivalue", 1500, 0.2)
    assert len(values.answers) == 4 and len(set(values.answers)) >= 2
    vt = builder.make("variable_tracking", 1500)
    text = tokenizer.decode(vt.input_ids)
    assert f"VAR {vt.answers[0]} = {vt.metadata['value']}." in text
    for a, b in zip(vt.answers, vt.answers[1:]):
        assert text.index(f"VAR {b} = VAR {a}.") > text.index(f"VAR {a} =")
    cwe = builder.make("common_words", 1500)
    body = tokenizer.decode(cwe.input_ids)
    counts = {w: body.count(f". {w} ") for w in cwe.answers}
    assert min(counts.values()) >= 3
    # was in needle_positions
    assert cwe.needle_positions == [] and cwe.metadata == {"common_freq": min(counts.values())}
    topic = builder.make("topic_retrieval", 1500)
    text = tokenizer.decode(topic.input_ids)
    assert text.index(f"topic of {topic.answers[0]}.") < min(
        text.index(f"topic of {t}.") for t in topic.metadata["topics"][1:]
    )


def test_clear_errors(tokenizer):
    with pytest.raises(ValueError, match="shorter than its fixed text"):
        make_probes("passkey", tokenizer, [50], [0.5], n_samples=1)
    with pytest.raises(ValueError, match="unknown probe task"):
        make_probes("needle", tokenizer, [500])
    with pytest.raises(ValueError, match="depth"):
        make_probes("passkey", tokenizer, [500], [1.5], n_samples=1)
    with pytest.raises(ValueError, match="n_queries"):
        ProbeBuilder(tokenizer).niah(800, 0.5, n_keys=1, n_queries=2)


@pytest.mark.parametrize("task", ["passkey", "niah_single", "topic_retrieval"])
def test_single_answer_metric_follows_prompt_style(tokenizer, task):
    # Plain prompts end right before the answer ("... The pass key is"): the continuation must start
    # with it. A chat model replies in its own words ("The pass key is 60494."): the answer must appear.
    assert make_probes(task, tokenizer, [700], [0.5], n_samples=1)[0].metric == "exact"
    assert make_probes(task, tokenizer, [700], [0.5], n_samples=1, chat=True)[0].metric == "contains"


@pytest.mark.parametrize("task", ["passkey", "niah_single", "niah_multikey", "variable_tracking", "topic_retrieval"])
@pytest.mark.parametrize("chat", [False, True])
def test_filler_ends_on_a_whole_sentence_before_the_question(tokenizer, task, chat):
    # Consecutive lengths give every remainder of the last filler sentence; none may be cut
    # ("... The sun What is the pass key?"), and every length stays exact.
    probes = make_probes(task, tokenizer, range(600, 640), [0.0, 0.5], n_samples=1, seed=5, chat=chat)
    for probe in probes:
        assert len(probe.input_ids) == probe.length
        text = tokenizer.decode(probe.input_ids)
        before = text[: max(text.rfind(" What "), text.rfind(" Question:"))]
        last = re.split(r"(?<=\.) ", before)[-1]
        assert before.endswith(".") and last[:1].isupper(), (probe.length, before[-80:])


def test_haystack_is_whole_sentences_of_exact_length(tokenizer):
    builder = ProbeBuilder(tokenizer, seed=0)
    for kind in ("passkey", "essay"):
        for n in [0, *range(12, 90)]:
            ids, starts = builder.haystack(n, kind)
            assert len(ids) == n and starts[-1] == n
            for begin, end in zip(starts, starts[1:]):
                sentence = tokenizer.decode(ids[begin:end]).strip()
                assert sentence[:1].isupper() and sentence.endswith(".") and sentence.count(".") == 1, sentence
    with pytest.raises(ValueError, match="whole filler sentences"):
        builder.haystack(1, "passkey")
