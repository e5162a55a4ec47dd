"""Quality gates on LLM-written items: hand-written good and bad rows, procedural answers, a synth run's counts."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest

from longpeft.synth_data.builders import (
    LengthConfig,
    LongContextBuilder,
    procedural_cluster_pool,
    procedural_long_documents,
)
from longpeft.synth_data.builtin import biography_subject
from longpeft.synth_data.corpus import Document
from longpeft.synth_data.qa import (
    Passage,
    ProceduralAnswerer,
    QAJob,
    QAPair,
    job_evidence,
    job_instructions,
    job_request,
)
from longpeft.synth_data.quality import REASONS, QualityConfig, QualityGates, jaccard, stem, words
from longpeft.tiny import demo_tokenizer

from stub_server import StubServer, default_reply, junk_reply  # tests/stub_server.py

TEXT = """The Lighthouse Keepers of Varn

Varn is a fishing village on the northern coast. Its lighthouse was built in 1843 by the engineer Tomas Hale, who \
also designed the harbour wall. The first keeper was Ilse Marten, a former sailmaker from Brenn. She kept the light \
for thirty-one years and recorded every storm in a blue ledger.

In 1874 a winter storm destroyed half of the harbour wall. Ilse Marten's son, Pieter Marten, led the repairs with \
forty volunteers. The village council paid for the stone, which came by cart from the quarry at Oldmoor. Pieter \
later became the second keeper and married Anna Voss, the village schoolteacher.

The lighthouse was electrified in 1921. Today it is a museum, and the blue ledger is displayed in its lower room."""

BOOK = Document(doc_id="varn", title="The Lighthouse Keepers of Varn", text=TEXT)

# What a GPT-4-class model writes about TEXT: paraphrases, one-word factual answers, counts in words.
GOOD_SINGLE = [
    (
        "In which year was the lighthouse of Varn built, and by whom?",
        "It was built in 1843 by the engineer Tomas Hale.",
    ),
    (
        "What did Ilse Marten do before she became the keeper of the Varn lighthouse?",
        "She was a sailmaker from Brenn.",
    ),
    (
        "Where did the stone for the repairs of the harbour wall come from?",
        "It came by cart from the quarry at Oldmoor, paid for by the village council.",
    ),
    ("When was the Varn lighthouse electrified?", "1921."),
    ("Whom did Pieter Marten marry?", "Anna Voss."),
    ("How many volunteers helped Pieter Marten repair the harbour wall?", "Forty."),
    ("How long did Ilse Marten keep the light of Varn?", "For thirty-one years."),
]
GOOD_MULTI = [
    (
        "How many years passed between the building of the Varn lighthouse and the storm that destroyed half of the "
        "harbour wall?",
        "31 years: the lighthouse was built in 1843 and the storm struck in 1874.",
    ),
    ("Who kept the Varn lighthouse, in order?", "First Ilse Marten, then her son Pieter Marten."),
    ("Which of the people named in the text was born in Oldmoor?", "None."),
]
GOOD_BIOGRAPHIES = {
    "Ilse Marten": (
        "Ilse Marten was the first keeper of the Varn lighthouse. Before that she was a sailmaker in Brenn. She kept "
        "the light for thirty-one years and recorded every storm in a blue ledger, which is now displayed in the "
        "lighthouse museum. Her son Pieter Marten led the repairs of the harbour wall after the storm of 1874 and "
        "later became the second keeper."
    ),
    "Pieter Marten": (
        "Pieter Marten is the son of Ilse Marten, the first keeper of the lighthouse. After a winter storm destroyed "
        "half of the harbour wall in 1874, he led forty volunteers in its repair. He later became the second keeper "
        "of the Varn lighthouse and married Anna Voss, the village schoolteacher."
    ),
    "Anna Voss": (  # named as often as her husband once "Anna's" counts as a mention
        "Anna Voss was the village schoolteacher of Varn. Anna's husband was Pieter Marten, the son of the first "
        "keeper; Pieter later became the second keeper of the lighthouse."
    ),
}

# (question, answer, reason): each bad single-detail row and the gate that must reject it
BAD_SINGLE = [
    ("...", "...", "placeholder"),
    ("<question>", "<answer>", "placeholder"),
    ("When was the Varn lighthouse built?", "Answer", "placeholder"),
    (
        "Which detail is stated in this excerpt? Write 3 question-answer pairs, each about one specific detail.",
        "1843.",
        "prompt_echo",
    ),
    ('{"question": "When was it built?", "answer": "1843"}', "1843.", "prompt_echo"),
    (
        "What colour was the lamp of the Varn lighthouse?",
        "The text does not mention the colour of the lamp.",
        "refusal",
    ),
    ("Who paid for the stone?", "As an AI language model, I cannot know who paid for it.", "refusal"),
    ("Sure, here are three questions about the text:", "1. When was the lighthouse built?", "refusal"),
    ("What was the colour of the lamp?", "There is no mention of the lamp's colour in the text.", "refusal"),
    ("Who built the lighthouse?", "N/A", "placeholder"),
    (".-", "1843.", "too_short"),
    ("Varn?", "A fishing village.", "too_short"),
    ("When was the lighthouse built?", "-", "too_short"),
    ("Who designed the harbour wall of Varn?", "The Dutch architect Hendrik Cuypers, in 1790.", "ungrounded"),
    ("What was Ilse Marten's profession before she kept the light?", "She was a fisherman in Oslo.", "ungrounded"),
]


def job(task: str = "single_detail", n: int = 3) -> QAJob:
    return QAJob(task, [Passage(BOOK, 0, len(TEXT))], n)


def judge(task: str, pairs, gates: QualityGates | None = None, subjects=None):
    gates = gates or QualityGates()
    items = [QAPair(q, a) for q, a in pairs]
    the_job = job(task)
    return gates, gates.check(task, items, job_evidence(the_job), job_instructions(the_job), subjects)


def test_good_gpt4_class_rows_are_kept():
    gates, verdict = judge("single_detail", GOOD_SINGLE)
    assert verdict.rejected == [] and len(verdict.kept) == len(GOOD_SINGLE)
    _, verdict = judge("multi_detail", GOOD_MULTI, gates)
    assert verdict.rejected == []
    names = list(GOOD_BIOGRAPHIES)
    bios = [(f"Write a short biography of {name}.", text) for name, text in GOOD_BIOGRAPHIES.items()]
    _, verdict = judge("biography", bios, gates, subjects=names)
    assert verdict.rejected == []
    assert gates.report() == {
        "enabled": True,
        "checked": 13,
        "kept": 13,
        "unused": 0,
        "rejected": {},
        "rejected_per_task": {},
    }


@pytest.mark.parametrize(
    "question,answer,reason", BAD_SINGLE, ids=[f"{r}-{i}" for i, (_, _, r) in enumerate(BAD_SINGLE)]
)
def test_each_bad_row_is_rejected_with_its_reason(question, answer, reason):
    """Next to the good rows (kept, and unchanged by the bad one), the bad row alone is rejected, for its reason."""
    gates, verdict = judge("single_detail", [*GOOD_SINGLE[:2], (question, answer)])
    assert [p.question for p in verdict.kept] == [q for q, _ in GOOD_SINGLE[:2]]
    [(pair, rejection)] = verdict.rejected
    assert (pair.question, rejection.reason) == (question, reason), rejection.detail
    assert gates.report()["rejected"] == {reason: 1}


def test_ungrounded_names_the_missing_words_and_honours_the_threshold():
    row = ("Who designed the harbour wall of Varn?", "Tomas Hale designed it, a Dutch engineer from Oslo.")
    # content words not in the question: tomas, hale, dutch, engineer, oslo -> 3 of 5 present (60%)
    for fraction, kept in ((0.6, True), (0.61, False)):
        _, verdict = judge("single_detail", [row], QualityGates(QualityConfig(min_grounded_fraction=fraction)))
        assert bool(verdict.kept) == kept
    _, verdict = judge("single_detail", [row], QualityGates(QualityConfig(min_grounded_fraction=0.8)))
    [(_, rejection)] = verdict.rejected
    assert rejection.reason == "ungrounded"
    assert "2 of 5 content words" in rejection.detail and "'dutch', 'oslo'" in rejection.detail


def test_numbers_are_normalised_and_exempt_only_where_answers_compute():
    assert words("It has 5,326 inhabitants.") == ["it", "has", "5326", "inhabitants"]
    assert stem("forty") == "40" and stem("lived") == stem("lives") == stem("living") == stem("live")
    row = [("How many years did Ilse Marten keep the light?", "She kept it for 32 years.")]
    assert judge("single_detail", row)[1].rejected[0][1].reason == "ungrounded"  # 32 is not in the text
    assert judge("multi_detail", row)[1].rejected == []  # a count or a sum: computed, not quoted


def test_biography_of_someone_else_is_rejected():
    names = ["Ilse Marten", "Pieter Marten", "Anna Voss", "Rolf Danner"]
    about_pieter = (
        "Anna Voss was the village schoolteacher. Pieter Marten led forty volunteers in the repair of the "
        "harbour wall. Pieter Marten later became the second keeper. Pieter married Anna."
    )
    bios = [
        GOOD_BIOGRAPHIES["Ilse Marten"],
        GOOD_BIOGRAPHIES["Pieter Marten"],
        about_pieter,
        "Rolf Danner was a captain who sailed from Varn and kept the light for thirty-one years in the lighthouse.",
    ]
    pairs = [(f"Write a short biography of {name}.", bio) for name, bio in zip(names, bios)]
    _, verdict = judge("biography", pairs, subjects=names)
    assert [biography_subject(p.question) for p in verdict.kept] == ["Ilse Marten", "Pieter Marten"]
    details = {biography_subject(p.question): r for p, r in verdict.rejected}
    anna, rolf = details["Anna Voss"], details["Rolf Danner"]
    assert anna.reason == "wrong_subject" and "mostly about 'Pieter Marten'" in anna.detail
    assert rolf.reason == "wrong_subject" and "does not occur in the book" in rolf.detail
    # the case: a "biography" that is another person's name
    _, verdict = judge(
        "biography", [("Write a short biography of Ilse Marten.", "Pieter Marten")], subjects=["Ilse Marten"]
    )
    assert verdict.rejected[0][1].reason == "too_short"
    _, verdict = judge(
        "biography",
        [("Write a short biography of Anna Voss.", GOOD_BIOGRAPHIES["Ilse Marten"])],
        subjects=["Anna Voss"],
    )
    assert verdict.rejected[0][1].detail == "the biography never names 'Anna Voss'"


def test_near_duplicate_questions_within_a_context():
    assert jaccard("When was the Varn lighthouse electrified?", "When was the lighthouse of Varn electrified?") > 0.8
    pairs = [
        ("When was the Varn lighthouse electrified?", "1921."),
        ("When was the lighthouse of Varn electrified?", "In 1921."),
        ("Where was Ilse Marten from?", "Brenn."),
        ("When was Ilse Marten from?", "Brenn."),
    ]
    _, verdict = judge("single_detail", pairs)
    assert [p.question for p, _ in verdict.rejected] == [pairs[1][0]]
    assert verdict.rejected[0][1].reason == "near_duplicate"
    gates = QualityGates()
    repeats = gates.check_repeats(
        "single_detail", [QAPair(pairs[1][0], "1921."), QAPair(pairs[2][0], "Brenn.")], [pairs[0][0]]
    )
    assert [p.question for p in repeats.kept] == [pairs[2][0]]
    # questions naming different numbers are different questions
    assert (
        judge(
            "heterogeneous",
            [
                ("Which is larger, Document 1 or Document 2?", "Document 1."),
                ("Which is larger, Document 1 or Document 3?", "Document 3."),
            ],
        )[1].rejected
        == []
    )


def test_gates_can_be_switched_off():
    bad = [(q, a) for q, a, _ in BAD_SINGLE]
    _, verdict = judge("single_detail", bad, QualityGates(QualityConfig(enabled=False)))
    assert len(verdict.kept) == len(bad)
    _, verdict = judge("single_detail", bad, QualityGates(QualityConfig(disable=["ungrounded", "refusal"])))
    # "Sure, here are three questions about the text:" ends on a colon: unfinished, once refusal is off
    assert {r.reason for _, r in verdict.rejected} == {"placeholder", "prompt_echo", "too_short", "unfinished"}
    with pytest.raises(ValueError, match="disable"):
        QualityConfig(disable=["grounding"])


@pytest.fixture(scope="module")
def procedural_items():
    """Every task's procedural answers (exact, from recorded facts): a bank of correct items."""
    length = LengthConfig(min_tokens=1500, max_tokens=2000, chunk_tokens=256, qa_reserve_tokens=300)
    builder = LongContextBuilder(demo_tokenizer(), ProceduralAnswerer(), length, seed=0)
    counter = builder.counter
    plans = (
        builder.plan(
            "single_detail",
            procedural_long_documents(counter, "single_detail", 3, length, 0),
            contexts=3,
            chunks_per_context=2,
            questions_per_chunk=3,
        )
        + builder.plan(
            "multi_detail", procedural_long_documents(counter, "multi_detail", 3, length, 0), contexts=3, questions=6
        )
        + builder.plan(
            "biography", procedural_long_documents(counter, "biography", 3, length, 0), contexts=3, characters=4
        )
        + builder.plan("heterogeneous", procedural_cluster_pool(counter, 3, 4, length, 0), contexts=3, questions=6)
    )
    return [(j, ProceduralAnswerer().answer(j)) for plan in plans for j in plan.jobs]


def test_procedural_answers_pass_the_gates(procedural_items):
    """Correct answers of every task, with computed counts, sums and gaps, keep; the only rejection is a true
    repeat (the same two people asked about in the other order)."""
    gates = QualityGates()
    for the_job, pairs in procedural_items:
        subjects = [biography_subject(p.question) for p in pairs] if the_job.task == "biography" else None
        verdict = gates.check(the_job.task, pairs, job_evidence(the_job), job_instructions(the_job), subjects)
        for pair, rejection in verdict.rejected:
            assert rejection.reason == "near_duplicate" and "(similarity 1.00)" in rejection.detail, pair
    report = gates.report()
    assert report["checked"] >= 50 and report["kept"] >= report["checked"] - 1
    assert set(report["rejected_per_task"]) <= {"multi_detail"}


def test_stub_answers_pass_and_junk_answers_fail_each_gate(procedural_items):
    """tests/stub_server.py: default_reply's items all pass; junk_reply adds one bad item per gate."""
    for the_job, _ in procedural_items:
        body = {"messages": job_request(the_job).messages}  # the request the LLM answerer sends
        key = "biographies" if the_job.task == "biography" else "qa_pairs"
        for reply, expect_rejected in ((default_reply, False), (junk_reply, True)):
            items = json.loads(reply(body))[key]
            if key == "biographies":
                pairs = [QAPair(f"Write a short biography of {i['name']}.", i["biography"]) for i in items]
                subjects = [i["name"] for i in items]
            else:
                pairs, subjects = [QAPair(i["question"], i["answer"]) for i in items], None
            gates = QualityGates()
            verdict = gates.check(the_job.task, pairs, job_evidence(the_job), job_instructions(the_job), subjects)
            if not expect_rejected:
                assert verdict.rejected == [], verdict.rejected
                continue
            reasons = Counter(r.reason for _, r in verdict.rejected)
            expected = {"too_short", "wrong_subject"} if key == "biographies" else set(REASONS) - {"wrong_subject"}
            assert set(reasons) == expected, verdict.rejected
            assert len(verdict.kept) == len(json.loads(default_reply(body))[key])


def synth_argv(out: Path, source: Path, server: StubServer, *extra: str) -> list[str]:
    return [
        "synth",
        "--out",
        str(out),
        "--answerer",
        "llm",
        "--source",
        str(source),
        "--tasks",
        "single_detail,multi_detail,biography",
        "--contexts",
        "2",
        "--min-tokens",
        "300",
        "--max-tokens",
        "2000",
        "--chunk-tokens",
        "128",
        "--llm-base-url",
        server.base_url,
        "--llm-model",
        "stub",
        "--api-key-env",
        "LONGPEFT_TEST_LLM_KEY",
        "--no-progress",
        "--set",
        "llm.backoff_initial=0.01",
        *extra,
    ]


def test_synth_run_counts_rejections_by_reason_and_retry_rejected_asks_again(tmp_path, monkeypatch, capsys):
    """`longpeft synth` against the stub: junk items are dropped and counted per reason in stats.json, the
    console and rejects.jsonl; the requests about one book, answered with placeholders only, are rejected,
    skipped by a plain rerun, and asked again by --retry-rejected, which keeps the first run's rows."""
    from longpeft.cli import main
    from longpeft.synth_data.corpus import generate_document

    monkeypatch.setenv("LONGPEFT_TEST_LLM_KEY", "sk-test")
    source = tmp_path / "books"
    source.mkdir()
    books = [generate_document(seed=i, n_sentences=60, kind="story") for i in range(2)]
    for i, book in enumerate(books):
        (source / f"book_{i}.txt").write_text(book.text)
    placeholders = json.dumps(
        {"qa_pairs": [{"question": "...", "answer": "..."}], "biographies": [{"name": "...", "biography": "..."}]}
    )
    names_of_book_1 = {c.name for c in books[1].characters} - {c.name for c in books[0].characters}
    assert names_of_book_1

    def weak_model(body):
        prompt = json.dumps(body)
        return placeholders if any(name in prompt for name in names_of_book_1) else junk_reply(body)

    out = tmp_path / "out"
    with StubServer(reply=weak_model) as server:
        assert main(synth_argv(out, source, server)) == 0
        console = capsys.readouterr().out
        stats = json.loads((out / "stats.json").read_text())
        first_rows = (out / "train.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
        calls = server.calls
        # a plain rerun: nothing asked, the rejected requests skipped and counted, the same rows
        assert main(synth_argv(out, source, server)) == 0
        rerun_console = capsys.readouterr().out
        assert server.calls == calls and (out / "train.jsonl").read_text().splitlines() == first_rows
        server.reply = default_reply  # the cause is fixed
        assert main(synth_argv(out, source, server, "--retry-rejected")) == 0
        retry_stats = json.loads((out / "stats.json").read_text())
        assert server.calls > calls
    quality = stats["quality"]
    assert set(quality["rejected"]) == set(REASONS)  # junk_reply: one bad item per gate
    assert all(count > 0 for count in quality["rejected"].values())
    assert quality["kept"] == quality["checked"] - sum(quality["rejected"].values())
    line = next(line for line in console.splitlines() if "quality gates:" in line)
    for reason, count in quality["rejected"].items():
        assert f"{reason} {count}" in line
    items = [r for r in records if r["kind"] == "item"]
    assert {r["reason"] for r in items} == set(quality["rejected"]) and all(r["detail"] for r in items)
    requests = [r for r in records if r["kind"] == "request"]
    assert requests and all(r["reason"] == "quality" for r in requests)
    assert stats["llm_usage"]["total"]["rejected"] == len(requests)
    after_retry = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert not [r for r in after_retry if r["kind"] == "request"]  # answered now: no longer listed as rejected
    skipped = re.search(r"(\d+) of them rejected in an earlier run and not asked again", rerun_console)
    assert skipped and int(skipped.group(1)) == len(requests) and "--retry-rejected" in rerun_console
    # the retry builds the contexts of book_1 too; the first run's rows stay, none twice
    rows = (out / "train.jsonl").read_text().splitlines()
    assert sum(retry_stats["counts"].values()) > sum(stats["counts"].values())
    conversations = [json.dumps(json.loads(row)["messages"]) for row in rows]
    assert len(set(conversations)) == len(rows) and len({json.loads(row)["id"] for row in rows}) == len(rows)
    assert {json.dumps(json.loads(row)["messages"]) for row in first_rows} <= set(conversations)
    assert retry_stats["llm_usage"]["total"]["skipped_rejected"] == 0


def test_synth_with_structured_fallback_junk_refusals_and_a_short_context(tmp_path, monkeypatch, capsys):
    """Both sides at once: a server that refuses response_format (the fallback is said once per run and is no
    rejection), answers junk items (dropped per gate), placeholder-only biographies (reason quality), refuses
    every request about book_1 (http_refused), and a context too short for the longest prompt (prompt_too_long).
    The summary counts each reason; a plain rerun asks only the one structured request that finds the fallback
    again and skips the rejected; --retry-rejected after the causes are fixed asks them again."""
    from longpeft.cli import main
    from longpeft.synth_data.corpus import generate_document

    monkeypatch.setenv("LONGPEFT_TEST_LLM_KEY", "sk-test")
    source = tmp_path / "books"
    source.mkdir()
    for i in range(2):
        text = generate_document(seed=i, n_sentences=60, kind="story").text
        (source / f"book_{i}.txt").write_text(text.replace(". ", ". [[400*99]] ") if i else text)
    placeholders = json.dumps(
        {"qa_pairs": [{"question": "...", "answer": "..."}], "biographies": [{"name": "...", "biography": "..."}]}
    )

    def weak_model(body):
        return placeholders if "biograph" in body["messages"][-1]["content"].lower() else junk_reply(body)

    out = tmp_path / "out"
    short = ("--set", "llm.context_tokens=400")  # the longest prompt (a multi_detail one) has 437 words, others < 300
    expected = {"quality": 1, "http_refused": 3, "prompt_too_long": 1}
    with StubServer(structured="refuse", reply=weak_model) as server:
        assert main(synth_argv(out, source, server, *short)) == 0
        first = capsys.readouterr()
        stats = json.loads((out / "stats.json").read_text())
        first_rows = (out / "train.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
        calls, refused = server.calls, server.statuses[400]
        assert main(synth_argv(out, source, server, *short)) == 0  # a plain rerun
        rerun = capsys.readouterr()
        rerun_stats = json.loads((out / "stats.json").read_text())
        # only the structured probe, refused with the item bounds, then without
        assert server.calls == calls + 2 and server.statuses[400] == refused + 2
        assert (out / "train.jsonl").read_text().splitlines() == first_rows
        server.reply = default_reply  # the causes fixed: a better model, a larger context
        assert main(synth_argv(out, source, server, "--retry-rejected")) == 0
        retry = capsys.readouterr()
        retry_stats = json.loads((out / "stats.json").read_text())
        assert server.calls > calls + 2
    for run in (first, rerun, retry):
        assert run.err.count("refused structured output") == 1
    assert first.err.count("injected HTTP 400") == 3 and "further refusals are counted" in first.err
    total = stats["llm_usage"]["total"]
    assert total["rejected_reasons"] == expected and total["rejected"] == sum(expected.values())
    assert "rejects.jsonl: 5 request(s) rejected: quality 1, http_refused 3, prompt_too_long 1 (" in first.out
    assert set(stats["quality"]["rejected"]) == set(REASONS) - {"wrong_subject"}  # no biography got through
    first_requests = [r for r in records if r["kind"] == "request"]
    assert Counter(r["reason"] for r in first_requests) == expected
    assert not any("response_format" in r.get("error", "") for r in records)  # the fallback is no rejection
    assert rerun_stats["llm_usage"]["total"]["skipped_rejected"] == sum(expected.values())
    assert rerun_stats["llm_usage"]["total"]["rejected"] == 0 and "injected HTTP 400" not in rerun.err
    assert "rejects.jsonl: 5 request(s) rejected: quality 1, http_refused 3, prompt_too_long 1" in rerun.out
    assert "5 of them rejected in an earlier run and not asked again" in rerun.out
    assert rerun_stats["rejects"]["requests"] == stats["rejects"]["requests"] == expected  # the file still lists them
    retried = retry_stats["llm_usage"]["total"]
    # the prompt too long was about book_1 too: sent now, the server refuses it like the other three
    assert retried["skipped_rejected"] == 0 and retried["rejected_reasons"] == {"http_refused": 4}
    after_retry = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert "quality" not in {r["reason"] for r in after_retry if r["kind"] == "request"}  # answered: it left
    assert sum(retry_stats["counts"].values()) > sum(stats["counts"].values())
    assert {json.dumps(json.loads(row)["messages"]) for row in first_rows} <= {
        json.dumps(json.loads(row)["messages"]) for row in (out / "train.jsonl").read_text().splitlines()
    }


def test_grounded_stub_answers_pass_the_gates_with_structured_output(tmp_path, monkeypatch, capsys):
    """A server that accepts response_format answers only the schema's fields: the gates judge its grounded items
    as without structured output (the same kept items, the same rows), and no request is rejected."""
    from longpeft.cli import main
    from longpeft.synth_data.corpus import generate_document

    monkeypatch.setenv("LONGPEFT_TEST_LLM_KEY", "sk-test")
    source = tmp_path / "books"
    source.mkdir()
    (source / "book_0.txt").write_text(generate_document(seed=0, n_sentences=60, kind="story").text)
    runs = {}
    for mode in ("accept", "ignore"):
        with StubServer(structured=mode) as server:
            assert (
                main(
                    synth_argv(
                        tmp_path / mode,
                        source,
                        server,
                        "--set",
                        f"llm.structured={'json_schema' if mode == 'accept' else 'off'}",
                    )
                )
                == 0
            )
            sent = [f is not None for f in server.response_formats]
            assert sent and all(sent) == (mode == "accept") and any(sent) == (mode == "accept")
        stats = json.loads((tmp_path / mode / "stats.json").read_text())
        rows = [json.loads(row)["messages"] for row in (tmp_path / mode / "train.jsonl").read_text().splitlines()]
        runs[mode] = (stats["quality"], stats["llm_usage"]["total"]["rejected"], rows)
    assert "refused structured output" not in capsys.readouterr().err
    quality, rejected, rows = runs["accept"]
    assert runs["accept"] == runs["ignore"] and rejected == 0 and len(rows) == 3  # one row per task
    assert quality["kept"] >= quality["checked"] - 1  # the stub's quoted questions may repeat one another


def test_cache_entries_of_another_shape_are_asked_again_with_one_line(tmp_path, monkeypatch, capsys):
    """The cache entries a user or another program may leave (`"text": 12345`, `[1, 2]`, `{}`, `"usage": "lots"`, a
    cut file): the rerun asks those requests again, says how many files it met in one line, and builds the same
    rows; no traceback."""
    from longpeft.cli import main
    from longpeft.synth_data.corpus import generate_document

    monkeypatch.setenv("LONGPEFT_TEST_LLM_KEY", "sk-test")
    source = tmp_path / "books"
    source.mkdir()
    for i in range(2):
        (source / f"book_{i}.txt").write_text(generate_document(seed=i, n_sentences=60, kind="story").text)
    out = tmp_path / "out"
    with StubServer() as server:
        assert main(synth_argv(out, source, server)) == 0
        rows = (out / "train.jsonl").read_text()
        answers = sorted(p for p in (out / "llm_cache").glob("*/*.json") if '"text"' in p.read_text())
        assert len(answers) >= 5
        entries = [json.loads(p.read_text()) for p in answers]
        answers[0].write_text(json.dumps({**entries[0], "text": 12345}))
        answers[1].write_text("[1, 2]")
        answers[2].write_text("{}")
        answers[3].write_text(json.dumps({**entries[3], "usage": "lots"}))
        answers[4].write_text(answers[4].read_text()[:20])
        capsys.readouterr()
        calls = server.calls
        assert main(synth_argv(out, source, server)) == 0
        assert server.calls == calls + 5
    console = capsys.readouterr().out
    assert console.count("were not cache entries longpeft writes") == 1
    assert "llm_cache: 5 file(s) were not cache entries longpeft writes" in console
    assert (out / "train.jsonl").read_text() == rows
    assert all(json.loads(p.read_text())["text"].startswith("{") for p in answers)  # replaced by the new answers
