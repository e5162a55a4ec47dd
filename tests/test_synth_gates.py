"""The gates a weak model's junk must not pass (unfinished, not a question, tautology, restated question), answers cut
off at max_tokens, the schema's item bounds, the labelled set's benchmark, and `synth --plan` refusing the input files
the run refuses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from longpeft.synth_data.corpus import Document
from longpeft.synth_data.llm_client import LLMClient, LLMConfig
from longpeft.synth_data.qa import LLMAnswerer, Passage, QAJob, QAPair, job_evidence, job_instructions
from longpeft.synth_data.quality import QualityGates, not_a_question, restates_question, tautology, unfinished

from stub_server import StubServer  # tests/stub_server.py

ROOT = Path(__file__).resolve().parents[1]
LABELLED = json.loads((ROOT / "tests" / "data" / "synth_gates_labelled.json").read_text(encoding="utf-8"))
KEY_ENV = "LONGPEFT_TEST_LLM_KEY"


@pytest.fixture(autouse=True)
def api_key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, "sk-test")


def job_about(context: str, task: str = "single_detail", n: int = 3) -> QAJob:
    text = LABELLED["contexts"][context]
    return QAJob(task, [Passage(Document(context, text.split("\n")[0], text), 0, len(text))], n)


def verdicts(context: str, pairs: list[tuple[str, str]], task: str = "single_detail") -> list[str]:
    """``kept`` or the reason of each pair, judged alone by the default gates against the context's text."""
    the_job = job_about(context, task)
    out = []
    for question, answer in pairs:
        verdict = QualityGates().check(
            task, [QAPair(question, answer)], job_evidence(the_job), job_instructions(the_job)
        )
        out.append("kept" if verdict.kept else verdict.rejected[0][1].reason)
    return out


def test_the_rows_a_llama_cpp_server_kept_are_rejected_with_their_reasons():
    copyleft = (
        "The most important difference between copyleft and copyleft is that copyleft is a copyleft that is not a "
        "copyleft."
    )
    assert verdicts(
        "license",
        [
            (copyleft, "Copyleft is a copyleft that is not a copyleft."),
            ("What is the purpose of this License?", "This License is a kind of"),
            ("What is copyleft?", copyleft),  # the statement as an answer: a tautology
            ("What is copyleft?", "Copyleft is copyleft."),
            ("What is the purpose of this License?", "The purpose of this License."),
        ],
    ) == ["not_a_question", "unfinished", "tautology", "tautology", "restates_question"]
    the_job = job_about("license")
    verdict = QualityGates().check(
        "single_detail",
        [QAPair(copyleft, "Copyleft."), QAPair("What does section 8 say?", "It says that a distributor loses the")],
        job_evidence(the_job),
        job_instructions(the_job),
    )
    details = [r.detail for _, r in verdict.rejected]
    assert details[0].startswith("question: a statement, not a question or a request")
    assert details[1] == "answer: stops on 'the': 'It says that a distributor loses the'"


def test_short_correct_answers_and_questions_phrased_as_requests_pass():
    """GPT-4-class items the gates must not reject: one-word and one-number answers, requests instead of
    questions (after an opening clause too), a choice among the question's options, yes and no, negations."""
    assert (
        verdicts(
            "river",
            [
                ("In which year was the first stone bridge across the Selmer built?", "1847."),
                ("Name the river whose first stone bridge was built at Holt in 1847.", "The Selmer River."),
                ("List the three tributaries of the Selmer River.", "The Wenn, the Ostra and the Lisk."),
                ("Based on the text, identify the sea into which the Selmer flows.", "The Grey Sea."),
                ("Which tributary joins the Selmer near its mouth, the Wenn or the Lisk?", "The Lisk."),
                ("Did salmon return to the Selmer?", "Yes."),
                ("Was the dam finished before 1911?", "No, the dam was finished in 1911."),
                ("At what height does the Selmer rise", "1,240 metres."),  # no question mark: still a question
                ("How long is the Selmer River?", "412 kilometres (from the Kaldor Hills to Aberhyde)."),
            ],
        )
        == ["kept"] * 9
    )


def test_unfinished_texts():
    for text in ("This License is a kind of", "It came from the quarry and the", "The Wenn, the Ostra,", "(1913"):
        assert unfinished(text), text
    for text in ("Anna Voss.", "1847", "It was built for the workers and their families.", "The book was his"):
        assert unfinished(text) is None, text


def test_questions_statements_and_requests():
    statements = ["The lighthouse was built in 1843.", "The history of the Selmer River", "Tomas Hale designed it."]
    assert all(not_a_question(s) for s in statements)
    questions = [
        "Who built it?",
        "Who built it",
        "In which year was it built",
        "Name the keeper.",
        "Please list the three tributaries.",
        "Using the figures given, calculate the growth of the colony.",
        'Which word comes first, "storm" or "ledger?"',
    ]
    assert [not_a_question(q) for q in questions] == [None] * len(questions)


def test_tautologies_and_loops():
    for text in (
        "Copyleft is a copyleft that is not a copyleft.",
        "The blue ledger is the blue ledger.",
        "Lake Marra is a lake that is a lake.",
        "the difference between copyleft and copyleft",
        "In 1903, in 1903, in 1903, the river flooded.",
        "copyleft copyleft license copyleft copyleft",
    ):
        assert tautology(text), text
    for text in (
        "More and more salmon returned after 1998.",
        "Copyleft is a licensing method that keeps modified versions free.",
        "Pieter Marten and Anna Voss married; Pieter later became the second keeper.",
        "The town of Document 1 or the town of Document 2",
    ):
        assert tautology(text) is None, text


def test_restatements():
    assert restates_question("When was the dam finished?", "The dam was finished.", 0.75)
    assert restates_question("What happened in 1874?", "In 1874 something happened.", 0.75)
    assert restates_question("Who was the first keeper, Ilse or Pieter?", "Ilse.", 0.75) is None  # a choice
    assert restates_question("Who was the first keeper, Ilse or Pieter?", "Ilse.", 0.3)  # with a low coverage
    assert restates_question("Is Varn a fishing village?", "Yes, Varn is a fishing village.", 0.75) is None
    assert restates_question("Did the dam stop the floods?", "The dam did not stop the floods.", 0.75) is None


# ---- the labelled set and its benchmark ------------------------------------------------------------------------


def test_the_labelled_set_is_well_formed():
    outputs = LABELLED["outputs"]
    assert len({o["id"] for o in outputs}) == len(outputs)
    for output in outputs:
        assert output["context"] in LABELLED["contexts"] and output["finish_reason"] in ("stop", "length")
        assert output["model"] in ("weak", "gpt4") and output["split"] in ("dev", "held_out")
        assert all(i["label"] in ("good", "bad") and i["kind"] and i["question"] for i in output["items"])
    issue = [o for o in outputs if o["source"].startswith("issue 39")]
    assert [i["label"] for o in issue for i in o["items"]] == ["bad", "bad"]


def test_the_benchmark_reports_what_the_run_keeps(tmp_path):
    """scripts/bench_synth_gates.py on a two-output set: a truncated answer (its good item is lost with it) and an
    answer with a good and a bad item; its last line holds the counts and rates of exactly that."""
    outputs = [
        {
            "id": "cut",
            "context": "river",
            "task": "single_detail",
            "model": "weak",
            "source": "test",
            "split": "dev",
            "finish_reason": "length",
            "items": [{"question": "How long is the Selmer?", "answer": "412 km.", "label": "good", "kind": "short"}],
        },
        {
            "id": "two",
            "context": "river",
            "task": "single_detail",
            "model": "gpt4",
            "source": "test",
            "split": "held_out",
            "finish_reason": "stop",
            "items": [
                {"question": "How long is the Selmer?", "answer": "412 kilometres.", "label": "good", "kind": "short"},
                {
                    "question": "What is the Selmer?",
                    "answer": "The Selmer is the Selmer.",
                    "label": "bad",
                    "kind": "t",
                },
            ],
        },
    ]
    data = tmp_path / "set.json"
    data.write_text(json.dumps({"contexts": LABELLED["contexts"], "outputs": outputs}))
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_synth_gates.py"), "--data", str(data), "--show"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert {k: result[k] for k in ("items", "bad", "good", "rejected", "precision", "recall", "good_kept")} == {
        "items": 3,
        "bad": 1,
        "good": 2,
        "rejected": 2,
        "precision": 0.5,
        "recall": 1.0,
        "good_kept": 0.5,
    }
    assert "truncated" in run.stdout and "tautology" in run.stdout


# ---- answers cut off at max_tokens, and the schema's item bounds, over HTTP -------------------------------------


def client_for(server: StubServer, tmp_path: Path, **settings) -> LLMClient:
    config = LLMConfig(
        base_url=server.base_url, model="stub", api_key_env=KEY_ENV, backoff_initial=0.01, timeout=10, **settings
    )
    return LLMClient(config, tmp_path / "cache", tmp_path / "rejects.jsonl", show_progress=False)


def good_answer(n: int = 3) -> str:
    pairs = [
        ("How long is the Selmer River?", "412 kilometres."),
        ("In which year was the first stone bridge across the Selmer built?", "1847."),
        ("Where does the Selmer River rise?", "In the Kaldor Hills."),
        ("Which sea does the Selmer enter?", "The Grey Sea."),
        ("What did the first stone bridge replace?", "A ferry."),
    ]
    return json.dumps({"qa_pairs": [{"question": q, "answer": a} for q, a in pairs[:n]]})


def test_answers_cut_off_at_max_tokens_are_never_kept(tmp_path):
    """A server that stops at llm.max_tokens: every attempt is truncated (never parsed), the request is rejected as
    truncated with each attempt's reason; an answer that is complete JSON but reported finish_reason length is never
    kept either; one truncated attempt followed by a whole answer keeps the whole answer."""
    calls = {"n": 0}

    def sometimes_cut(body):
        calls["n"] += 1
        return (good_answer(), "length" if calls["n"] == 1 else "stop")

    with StubServer(reply=lambda body: good_answer(), cut_at_max_tokens=True) as server:
        client = client_for(server, tmp_path / "a", max_tokens=20)
        assert LLMAnswerer(client).generate([job_about("river")]) == [None]
        [record] = client.rejects.records()
        assert record["reason"] == "truncated" and [a["reason"] for a in record["attempts"]] == ["truncated"] * 3
        assert record["error"] == "output cut off at llm.max_tokens in all 3 attempts"
        assert record["attempts"][0]["error"].startswith("cut off at llm.max_tokens (20; finish_reason length)")
        assert client.usage_report()["total"]["truncated"] == 3
        server.reply = lambda body: (good_answer(), "length")
        whole_but_cut = client_for(server, tmp_path / "b")
        assert LLMAnswerer(whole_but_cut).generate([job_about("river")]) == [None]
        server.reply = sometimes_cut
        second = client_for(server, tmp_path / "c")
        [kept] = LLMAnswerer(second).generate([job_about("river")])
        assert len(kept) == 3 and second.rejects.records() == []


def test_the_schema_bounds_its_items_where_the_server_accepts_it(tmp_path, capsys):
    """Each request's schema holds maxItems = the items asked: a server that enforces it writes no more; a server
    that refuses a schema with item bounds gets, after one line, the schema without them (still structured), and
    every request is answered."""
    with StubServer(reply=lambda body: good_answer(5), structured="accept") as server:
        client = client_for(server, tmp_path / "accept")
        jobs = [job_about("river", n=2), job_about("river", "multi_detail", n=3)]  # no repeats across chunks
        assert [len(r) for r in LLMAnswerer(client).generate(jobs)] == [2, 3]
        bounds = [f["json_schema"]["schema"]["properties"]["qa_pairs"]["maxItems"] for f in server.response_formats]
        assert sorted(bounds) == [2, 3]
    with StubServer(reply=lambda body: good_answer(5), structured="no_bounds") as server:
        client = client_for(server, tmp_path / "no_bounds")
        answerer = LLMAnswerer(client)
        assert [len(r) for r in answerer.generate(jobs)] == [2, 3]  # the first items that pass
        assert answerer.gates.report()["unused"] == 3 + 2
        sent = [json.dumps(f) for f in server.response_formats]
        assert server.statuses[400] == 1 and "maxItems" in sent[0]
        assert all("json_schema" in f and "maxItems" not in f and "minItems" not in f for f in sent[1:])
    err = capsys.readouterr().err
    assert err.count("refused the schema with its item bounds") == 1 and "'minItems' is not permitted" in err
    assert "refused structured output" not in err


# ---- synth --plan refuses the input files the run refuses -------------------------------------------------------


def write_inputs(folder: Path) -> dict[str, Path]:
    folder.mkdir()
    book = folder / "book.txt"
    book.write_text(LABELLED["contexts"]["river"] * 20)
    plain = folder / "plain.jsonl"
    plain.write_text(json.dumps({"text": LABELLED["contexts"]["varn"]}) + "\n")
    garbage = folder / "garbage.jsonl"
    garbage.write_bytes(b'{"text": "fine"}\n\xff\xfe\x00binary\n')
    empty = folder / "empty.jsonl"
    empty.write_text("\n")
    bad_record = folder / "bad.jsonl"
    bad_record.write_text(json.dumps({"prompt": "no instruction field"}) + "\n")
    return {"book": book, "plain": plain, "garbage": garbage, "empty": empty, "bad": bad_record}


BAD_INPUTS = {
    "missing plain text": (["--plain-text", "{folder}/nope.jsonl", "--plain-ratio", "0.2"], "does not exist"),
    "garbage plain text": (["--plain-text", "{garbage}", "--plain-ratio", "0.2"], "garbage.jsonl:2: not UTF-8 text"),
    "empty plain text": (["--plain-text", "{empty}", "--plain-ratio", "0.2"], "holds no record: nothing to mix in"),
    "bad instructions": (["--instructions", "{bad}", "--instruction-ratio", "0.2"], "bad.jsonl:1: an instruction"),
    "missing summaries": (["--summaries", "{folder}/nope.json", "--summary-ratio", "0.1"], "nope.json does not exist"),
    "a file with no ratio": (["--plain-text", "{plain}"], "mix.plain_text is set but its ratio is 0"),
    "missing source": (["--source", "{folder}/nothing"], "does not exist"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_plan_refuses_the_input_files_the_run_refuses(tmp_path, capsys, case):
    """`synth --plan` runs the run's own check of every input file: each bad file is refused by both, with exit 2
    and the same error line, before any request."""
    from longpeft.cli import main

    files = write_inputs(tmp_path / "in")
    extra, message = BAD_INPUTS[case]
    extra = [arg.format(folder=tmp_path / "in", **files) for arg in extra]
    source = [] if "--source" in extra else ["--source", str(files["book"])]
    base = ["synth", "--out", str(tmp_path / "out"), "--answerer", "llm", "--tokenizer", "tiny", *source, *extra]
    base += ["--llm-base-url", "http://127.0.0.1:9/v1", "--api-key-env", KEY_ENV, "--no-progress"]
    lines = []
    for argv in (base, [*base, "--plan"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("longpeft synth: error: ") and message in err, err
        lines.append(err)
    assert lines[0] == lines[1]
