"""Long-context builders, procedural corpus, exact QA, clustering, mixing, outputs, CLI, demo set."""

from __future__ import annotations

import json
import random
import re
from collections import Counter

import pytest
from datasets import load_from_disk

from longpeft.cli import main
from longpeft.synth_data.builders import (
    LengthConfig,
    LongContextBuilder,
    cluster_documents,
    procedural_cluster_pool,
    procedural_document,
    procedural_long_documents,
)
from longpeft.synth_data.corpus import GENERAL_PROFESSIONS, TOPIC_DESCRIPTIONS, TOPICS, corpus_texts, generate_document
from longpeft.synth_data.demo import build_demo_dataset
from longpeft.synth_data.mix import MixConfig, mix
from longpeft.synth_data.procedural_qa import _count_profession, _DocFacts, _shared_professions
from longpeft.synth_data.qa import LLMAnswerer, Passage, ProceduralAnswerer, QAJob
from longpeft.tiny import demo_tokenizer

LENGTH = LengthConfig(min_tokens=1500, max_tokens=2000, chunk_tokens=256, qa_reserve_tokens=300)


@pytest.fixture(scope="module")
def tok():
    """The tiny tokenizer as the demo trains it (procedural corpus + filler)."""
    return demo_tokenizer()


@pytest.fixture(scope="module")
def built(tok):
    """Every task built once from procedural documents, with the documents for checking answers."""
    builder = LongContextBuilder(tok, ProceduralAnswerer(), LENGTH, seed=0)
    counter = builder.counter
    docs = {
        task: procedural_long_documents(counter, task, 3, LENGTH, seed=0)
        for task in ("single_detail", "multi_detail", "biography")
    }
    pool = procedural_cluster_pool(counter, contexts=3, docs_per_context=4, length=LENGTH, seed=0)
    plans = (
        builder.plan("single_detail", docs["single_detail"], contexts=3, chunks_per_context=2, questions_per_chunk=3)
        + builder.plan("multi_detail", docs["multi_detail"], contexts=3, questions=4)
        + builder.plan("biography", docs["biography"], contexts=3, characters=3)
        + builder.plan("heterogeneous", pool, contexts=3, questions=4)
    )
    rows = builder.build(plans)
    documents = {d.doc_id: d for group in [*docs.values(), pool] for d in group}
    return builder, rows, documents


def turns(row):
    """(question, answer) pairs of a conversation; the first question follows the context."""
    messages = row["messages"]
    pairs = [(messages[i]["content"], messages[i + 1]["content"]) for i in range(0, len(messages), 2)]
    pairs[0] = (pairs[0][0].rsplit("\n\n", 1)[1], pairs[0][1])
    return pairs


def facts_of(row, documents):
    return {f.fact_id: f for doc_id in row["sources"] for f in documents[doc_id].facts}


def named_workers(text):
    """(name, profession) of every person the text itself names with a profession, in order of appearance."""
    return re.findall(r"([A-Z][a-z]+ [A-Z][a-z]+) (?:worked as|made a living as) an? ([a-z ]+)\.", text)


def named_professions(text):
    return {profession for _, profession in named_workers(text)}


def test_every_task_is_built_within_the_token_range(built, tok):
    builder, rows, _ = built
    assert Counter(r["task"] for r in rows) == {
        "single_detail": 3,
        "multi_detail": 3,
        "biography": 3,
        "heterogeneous": 3,
    }
    for row in rows:
        measured = len(tok.apply_chat_template(row["messages"], tokenize=True, return_dict=True)["input_ids"])
        assert measured == row["num_tokens"]
        assert LENGTH.min_tokens <= measured <= LENGTH.max_tokens, (row["id"], measured)
        roles = [m["role"] for m in row["messages"]]
        assert roles == ["user", "assistant"] * (len(roles) // 2) and len(roles) >= 4


def test_long_context_is_in_the_first_turn_only(built):
    _, rows, documents = built
    for row in rows:
        first = row["messages"][0]["content"]
        for doc_id in row["sources"]:
            title = documents[doc_id].title
            assert title in first
            assert all(title not in m["content"] for m in row["messages"][1:])


def test_single_detail_answers_are_recorded_facts_inside_small_chunks(built, tok):
    _, rows, documents = built
    for row in (r for r in rows if r["task"] == "single_detail"):
        meta = json.loads(row["meta"])
        doc = documents[row["sources"][0]]
        chunks = meta["chunks"]
        assert len(chunks) == 2
        for start, end in chunks:
            assert len(tok(doc.text[start:end], add_special_tokens=False)["input_ids"]) <= LENGTH.chunk_tokens
        facts = facts_of(row, documents)
        context = row["messages"][0]["content"]
        for (question, answer), evidence in zip(turns(row), meta["evidence"]):
            [fact] = [facts[i] for i in evidence]
            assert question == fact.question and answer == fact.value
            assert fact.sentence in context and fact.value in fact.sentence
            assert any(start <= fact.start and fact.end <= end for start, end in chunks)


def check_multi_detail(question, answer, used, in_context):
    """Recompute a multi-detail answer from the facts; returns which kind of question it was."""
    assert len(used) >= 2 and all(f in in_context for f in used)
    if "sum of the numbers" in question:
        assert int(answer) == sum(int(f.value) for f in used)
        return "sum"
    if question.startswith("How many people named in the text"):
        profession = re.search(r"worked as an? (.+?)\?", question).group(1)
        everyone = [f.subject for f in in_context if f.kind == "profession" and f.value == profession]
        assert answer == f"{len(everyone)}: {', '.join(everyone)}."
        return "count"
    first = min(used, key=lambda f: int(f.value))
    if question.startswith("Who was born earlier"):
        assert answer.startswith(f"{first.subject}, born in {first.value};")
        return "birth"
    assert question.startswith("Which came first")
    assert answer.startswith(f"The council {first.get('verb')} the {first.subject} first, in {first.value};")
    return "event"


def test_multi_detail_answers_aggregate_the_facts_of_the_context(built):
    _, rows, documents = built
    kinds = Counter()
    for row in (r for r in rows if r["task"] == "multi_detail"):
        facts = facts_of(row, documents)
        context = row["messages"][0]["content"]
        in_context = [f for f in facts.values() if f.sentence in context]
        for (question, answer), evidence in zip(turns(row), json.loads(row["meta"])["evidence"]):
            kinds[check_multi_detail(question, answer, [facts[i] for i in evidence], in_context)] += 1
    assert sum(kinds.values()) >= 9


def test_every_multi_detail_question_kind_on_a_long_document():
    doc = generate_document(seed=5, n_sentences=800)
    passage = Passage(doc, 0, len(doc.text))
    pairs = ProceduralAnswerer().answer(QAJob("multi_detail", [passage], n=16, seed=0))
    facts = {f.fact_id: f for f in doc.facts}
    kinds = Counter(
        check_multi_detail(p.question, p.answer, [facts[i] for i in p.evidence], passage.facts()) for p in pairs
    )
    assert set(kinds) == {"sum", "count", "birth", "event"} and len(pairs) == 16


def test_profession_questions_ask_about_named_people_and_the_text_agrees():
    """Filler prose also mentions unnamed workers ("spoke with a sailor", "every sailor knew"), so the
    profession questions ask about people *named* in the text, and their answers are read off the text."""
    professions = TOPICS["harbor"]["professions"] + GENERAL_PROFESSIONS
    loose_mentions_differ = 0
    for seed in range(8):
        a, b = (generate_document(seed=2 * seed + i, n_sentences=200, topic="harbor") for i in (0, 1))
        docs = [_DocFacts(1, Passage(a, 0, len(a.text))), _DocFacts(2, Passage(b, 0, len(b.text)))]
        pair = _shared_professions(docs, random.Random(seed))
        assert (
            pair.question == "Which professions are held both by someone named in Document 1 and by someone "
            "named in Document 2?"
        )
        shared = sorted(named_professions(a.text) & named_professions(b.text))
        assert pair.answer == (
            ", ".join(shared) + "." if shared else "None: no profession is held by people named in both."
        )
        mentioned = [p for p in professions if all(re.search(rf"\b{p}\b", d.text) for d in (a, b))]
        loose_mentions_differ += mentioned != shared

        by_kind = {}
        for fact in a.facts:
            by_kind.setdefault(fact.kind, []).append(fact)
        pair = _count_profession(by_kind, random.Random(seed))
        if pair is None:
            continue
        match = re.fullmatch(
            r"How many people named in the text worked as an? (.+)\? Name them in order of "
            r"appearance\.",
            pair.question,
        )
        assert match, pair.question
        people = [name for name, p in named_workers(a.text) if p == match.group(1)]
        assert pair.answer == f"{len(people)}: {', '.join(people)}."
    assert loose_mentions_differ  # "mentioned in both" would have had another answer


def test_heterogeneous_contexts_hold_one_cluster_and_compare_documents(built):
    _, rows, documents = built
    for row in (r for r in rows if r["task"] == "heterogeneous"):
        docs = [documents[d] for d in row["sources"]]
        assert len(docs) >= 2 and len({d.topic for d in docs}) == 1  # one cluster = one topic here
        context = row["messages"][0]["content"]
        for number, doc in enumerate(docs, 1):
            assert f"Document {number}:\n{doc.title}" in context
        for question, answer in turns(row):
            if "founded earliest" in question:
                earliest = min(docs, key=lambda d: d.profile["founded"])
                assert (
                    answer == f"{earliest.profile['town']}, described in Document {docs.index(earliest) + 1}, "
                    f"founded in {earliest.profile['founded']}."
                )
            elif "most inhabitants" in question:
                biggest = max(docs, key=lambda d: d.profile["population"])
                assert answer.startswith(f"{biggest.profile['town']}, described in Document {docs.index(biggest) + 1}")
            elif "Which professions are held both" in question:
                a, b = (int(n) for n in re.findall(r"Document (\d+)", question))
                shared = sorted(named_professions(docs[a - 1].text) & named_professions(docs[b - 1].text))
                assert answer == (
                    ", ".join(shared) + "." if shared else "None: no profession is held by people named in both."
                )
            elif "and by how many" in question:
                a, b = (docs[int(n) - 1].profile["population"] for n in re.findall(r"Document (\d+)", question))
                assert answer.endswith(f"by {abs(a - b)} inhabitants.")
            else:
                assert question == f"Which of the documents describe {TOPIC_DESCRIPTIONS[docs[0].topic]}?"


def test_biographies_state_exactly_the_characters_facts(built):
    _, rows, documents = built
    for row in (r for r in rows if r["task"] == "biography"):
        doc = documents[row["sources"][0]]
        context = row["messages"][0]["content"]
        names = {c.name for c in doc.characters}
        for (question, answer), evidence in zip(turns(row), json.loads(row["meta"])["evidence"]):
            name = re.fullmatch(r"Write a short biography of (.+)\.", question).group(1)
            assert name in names
            facts = [f for f in doc.facts if f.fact_id in evidence]
            assert all(f.subject == name and f.sentence in context for f in facts)
            assert answer == " ".join(dict.fromkeys(f.sentence for f in facts))


def test_clustering_groups_documents_by_topic(tok):
    docs = [
        generate_document(seed=s, n_sentences=80, topic=t, doc_id=f"{t}-{s}")
        for t in ("harbor", "railway", "orchard")
        for s in range(4)
    ]
    clusters = cluster_documents(docs, 3, seed=0)
    assert sorted(sorted(docs[i].topic for i in c) for c in clusters) == [
        ["harbor"] * 4,
        ["orchard"] * 4,
        ["railway"] * 4,
    ]


def test_procedural_corpus_is_deterministic_and_its_facts_are_where_recorded():
    a, b = generate_document(seed=7, n_sentences=300), generate_document(seed=7, n_sentences=300)
    assert a.text == b.text and a.facts == b.facts
    assert generate_document(seed=8, n_sentences=300).text != a.text
    for fact in a.facts:
        assert a.text[fact.start : fact.end] == fact.sentence and fact.value in fact.sentence
    keyed = Counter(f.question for f in a.facts)
    assert max(keyed.values()) == 1  # each question has one answer in the document
    assert corpus_texts(3, seed=1) == corpus_texts(3, seed=1)


def test_procedural_document_hits_its_token_target(tok):
    from longpeft.synth_data.builders import TokenCounter

    counter = TokenCounter(tok)
    for target in (600, 3000):
        doc = procedural_document(counter, target, seed=3)
        assert target <= counter.count(doc.text) <= 1.06 * target


def test_llm_answerer_builds_conversations_through_the_stub(tok, tmp_path, monkeypatch):
    from longpeft.synth_data.llm_client import LLMClient, LLMConfig

    from stub_server import StubServer

    monkeypatch.setenv("STUB_KEY", "x")
    docs = procedural_long_documents(
        LongContextBuilder(tok, ProceduralAnswerer(), LENGTH).counter, "biography", 2, LENGTH, 1
    )
    with StubServer() as server:
        config = LLMConfig(base_url=server.base_url, model="stub", api_key_env="STUB_KEY")
        client = LLMClient(config, tmp_path / "cache", tmp_path / "rejects.jsonl", show_progress=False)
        builder = LongContextBuilder(tok, LLMAnswerer(client), LENGTH, seed=0)
        rows = builder.build(
            builder.plan("single_detail", docs, contexts=2, chunks_per_context=2, questions_per_chunk=2)
            + builder.plan("biography", docs, contexts=2, characters=2)
        )
    assert Counter(r["task"] for r in rows) == {"single_detail": 2, "biography": 2}
    for row in rows:
        assert LENGTH.min_tokens <= row["num_tokens"] <= LENGTH.max_tokens
    # 2 chunks x 2 questions (the stub offers 3 per request), the last turn trimmed where max_tokens is passed
    assert sorted(len(turns(r)) for r in rows if r["task"] == "single_detail") == [3, 4]
    for row in rows:
        source = next(d for d in docs if d.doc_id == row["sources"][0])
        for question, answer in turns(row):
            # the stub's grounded answers (sentences of the source) come through the quality gates
            assert all(sentence in source.text for sentence in re.split(r"(?<=\.) ", answer))
            if row["task"] == "biography":
                name = re.fullmatch(r"Write a short biography of (.+)\.", question).group(1)
                assert name in {c.name for c in source.characters} and name in answer
    assert client.usage_report()["tasks"]["single_detail"]["api_calls"] == 4
    assert client.usage_report()["tasks"]["biography"]["api_calls"] == 2


def test_mixing_by_ratio_with_length_filters(built, tok, tmp_path):
    builder, rows, _ = built
    synthetic = rows[:6]
    plain = tmp_path / "plain.jsonl"
    texts = ["short text. " * 5] * 10 + ["a much longer plain text. " * 200] * 10
    plain.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    instructions = tmp_path / "sft.jsonl"
    records = [{"instruction": f"Say {i}.", "input": "", "output": f"{i}"} for i in range(5)]
    records += [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}] * 5
    instructions.write_text("".join(json.dumps(r) + "\n" for r in records))
    config = MixConfig(
        plain_text=str(plain),
        plain_ratio=0.25,
        plain_min_tokens=200,
        instructions=str(instructions),
        instruction_ratio=0.25,
        instruction_max_tokens=100,
    )
    mixed, stats = mix(synthetic, builder.counter, config, seed=0)
    counts = Counter(r["task"] for r in mixed)
    assert counts["plain_text"] == 3 and counts["instruction"] == 3  # 6 synthetic = 50% of 12
    assert all(r["num_tokens"] >= 200 for r in mixed if r["task"] == "plain_text")
    assert stats["plain_text"]["taken"] == 3 and stats["instruction"]["wanted"] == 3
    assert [r["id"] for r in mixed] == [r["id"] for r in mix(synthetic, builder.counter, config, seed=0)[0]]
    with pytest.raises(ValueError, match="below 1"):
        MixConfig(plain_text="x", plain_ratio=0.6, instructions="y", instruction_ratio=0.5)


def test_cli_writes_jsonl_dataset_stats_and_histogram(tmp_path, capsys):
    out = tmp_path / "synth"
    args = [
        "--out",
        str(out),
        "--contexts",
        "1",
        "--min-tokens",
        "800",
        "--max-tokens",
        "1200",
        "--chunk-tokens",
        "128",
        "--no-progress",
        "--seed",
        "3",
    ]
    assert main(["synth", *args]) == 0
    rows = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert Counter(r["task"] for r in rows) == {
        "single_detail": 1,
        "multi_detail": 1,
        "heterogeneous": 1,
        "biography": 1,
    }
    dataset = load_from_disk(str(out / "dataset"))
    assert dataset.column_names == ["id", "task", "messages", "num_tokens", "sources", "meta"]
    assert dataset["messages"][0] == rows[0]["messages"]
    stats = json.loads((out / "stats.json").read_text())
    assert stats["counts"] == {"single_detail": 1, "multi_detail": 1, "heterogeneous": 1, "biography": 1}
    assert all(800 <= r["num_tokens"] <= 1200 for r in rows)
    assert (out / "length_hist.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "config.json").read_text())["length"]["min_tokens"] == 800
    assert "single_detail" in capsys.readouterr().out


def test_cli_names_a_bad_config_key(tmp_path, capsys):
    config = tmp_path / "synth.yaml"
    config.write_text("length:\n  min_tokenz: 10\n")
    assert main(["synth", "--config", str(config), "--out", str(tmp_path / "o")]) == 2
    assert "min_tokenz" in capsys.readouterr().err
    assert main(["synth", "--out", str(tmp_path / "o"), "--tasks", "single,biography"]) == 2
    assert main(["synth", "--out", str(tmp_path / "o"), "--source", str(tmp_path)]) == 2  # files need the LLM answerer
    with pytest.raises(SystemExit) as exit_info:
        main(["synth", "--help"])
    assert exit_info.value.code == 0 and "--answerer" in capsys.readouterr().out


def test_cli_names_an_unsupported_source_file_and_a_bad_jsonl_line(tmp_path, capsys):
    notes, bad = tmp_path / "notes.md", tmp_path / "bad.jsonl"
    notes.write_text("# notes\n")
    bad.write_text('{"text": "a"}\n{"text": "b",}\n')
    for source, message in [
        (notes, f"source file {notes}: unsupported type '.md'; use .txt (one document per file) or .jsonl"),
        (bad, f"{bad}:2: not valid JSON ("),
    ]:
        assert main(["synth", "--out", str(tmp_path / "o"), "--answerer", "llm", "--source", str(source)]) == 2
        assert message in capsys.readouterr().err


def test_retrieval_texts_hold_no_bos_and_tokenize_to_the_drawn_length(tok):
    """A BOS-adding tokenizer: the texts must not carry the BOS that training's tokenization adds again."""
    import copy

    from tokenizers import processors

    from longpeft.synth_data.retrieval_docs import build_retrieval_dataset

    bos_tok = copy.deepcopy(tok)
    bos = bos_tok.bos_token_id
    bos_tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos_tok.bos_token} $A", special_tokens=[(bos_tok.bos_token, bos)]
    )
    texts = build_retrieval_dataset(bos_tok, n_documents=9, min_tokens=300, max_tokens=300, seed=0)["text"]
    for text in texts:
        ids = bos_tok(text)["input_ids"]  # as recipes/data.py tokenizes plain text
        assert bos_tok.bos_token not in text and ids.count(bos) == 1 and len(ids) == 300


def test_demo_dataset_is_exact_retrieval_and_deterministic(tok):
    first = build_demo_dataset(tok, n_conversations=6, context_tokens=300, seed=0)
    again = build_demo_dataset(tok, n_conversations=6, context_tokens=300, seed=0)
    assert first["messages"] == again["messages"]
    assert build_demo_dataset(tok, n_conversations=6, context_tokens=300, seed=1)["messages"] != first["messages"]
    assert len(first) == 6 and "messages" in first.column_names
    for row in first:
        context = row["messages"][0]["content"]
        assert 300 <= row["num_tokens"] <= 300 + 48 * 4 + 64
        for question, answer in turns(row):
            subject = re.search(
                r"(?:What number is the (.+) marked with|How many inhabitants does (\w+) have|"
                r"In which year was (\w+) founded)\?",
                question,
            )
            assert subject, question
            if subject.group(1):
                assert f"The {subject.group(1)} is marked with the number {answer}." in context
            else:
                assert answer in context
