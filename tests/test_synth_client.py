"""LLM client over real HTTP against an OpenAI-compatible stub server on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from longpeft.synth_data.answer_schema import parse_json_object
from longpeft.synth_data.llm_client import LLMClient, LLMConfig, LLMRequest, LLMRunAborted

from stub_server import StubServer  # tests/stub_server.py

KEY_ENV = "LONGPEFT_TEST_LLM_KEY"
SECRET = "sk-test-9f8e7d6c5b4a-never-written"


def parse_qa(text: str) -> dict:
    return parse_json_object(text, ["qa_pairs"])


def make_client(server: StubServer, tmp_path: Path, retry_rejected: bool = False, **overrides) -> LLMClient:
    settings = dict(
        base_url=server.base_url,
        model="stub",
        api_key_env=KEY_ENV,
        backoff_initial=0.01,
        backoff_max=0.05,
        max_concurrency=4,
        timeout=5.0,
    )
    settings.update(overrides)
    return LLMClient(
        LLMConfig(**settings),
        tmp_path / "cache",
        tmp_path / "rejects.jsonl",
        show_progress=False,
        retry_rejected=retry_rejected,
    )


def request(text: str, task: str = "t") -> LLMRequest:
    return LLMRequest(task=task, messages=[{"role": "user", "content": text}], meta={"name": text[:20]})


@pytest.fixture(autouse=True)
def api_key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, SECRET)


def test_retries_injected_429_and_500_then_succeeds(tmp_path):
    with StubServer() as server:
        client = make_client(server, tmp_path)
        results = client.run([request("a [[429*2]]"), request("b [[500*3]]"), request("c")], parse=parse_qa)
    assert all(r.ok for r in results)
    assert server.statuses[429] == 2 and server.statuses[500] == 3 and server.statuses[200] == 3
    usage = client.usage_report()["total"]
    assert usage["retries"] == 5 and usage["api_calls"] == 3 and usage["rejected"] == 0
    assert server.auth_headers and all(h == f"Bearer {SECRET}" for h in server.auth_headers)


def test_timeout_is_retried(tmp_path):
    with StubServer() as server:
        client = make_client(server, tmp_path, timeout=1.0)
        [result] = client.run([request("slow once [[slow=3.0*1]]")], parse=parse_qa)
    assert result.ok and client.usage_report()["total"]["retries"] == 1
    assert server.calls == 2


def test_408_and_409_are_retried_and_retry_after_ms_is_honoured(tmp_path):
    with StubServer() as server:
        client = make_client(server, tmp_path, backoff_max=5.0)
        results = client.run([request("a [[408*1]]"), request("b [[409*2]]")], parse=parse_qa)
        assert all(r.ok for r in results) and server.statuses[408] == 1 and server.statuses[409] == 2
        start = time.monotonic()
        [result] = client.run([request("c [[429*1,retry_ms=600]]")], parse=parse_qa)  # also sends Retry-After: 0
        assert result.ok and time.monotonic() - start >= 0.6
    assert client.usage_report()["total"]["retries"] == 1 + 2 + 1


def test_a_200_that_is_not_a_completion_is_retried_then_rejected(tmp_path):
    """A gateway's HTML page with HTTP 200 (openai hands it back as a str) fails that request only."""
    with StubServer() as server:
        client = make_client(server, tmp_path, max_retries=2)
        once, always, fine = client.run(
            [request("once [[html*1]]"), request("always [[html]]"), request("fine")], parse=parse_qa
        )
    assert once.ok and fine.ok and not always.ok
    assert client.usage_report()["total"]["retries"] == 1 + 2
    [reject] = [json.loads(line) for line in (tmp_path / "rejects.jsonl").read_text().splitlines()]
    assert reject["meta"]["name"] == "always [[html]]"
    assert "not a chat completion" in reject["error"] and "Please sign in" in reject["error"]


def test_cache_is_per_endpoint(tmp_path):
    """A dry run against the stub, then a run against another endpoint into the same cache: the stub's
    answers are not served as the other endpoint's."""
    requests = [request(f"prompt {i}") for i in range(3)]
    with StubServer() as dry_run, StubServer() as real:
        make_client(dry_run, tmp_path).run(requests, parse=parse_qa)
        make_client(real, tmp_path).run(requests, parse=parse_qa)
        assert dry_run.calls == real.calls == 3
        again = make_client(real, tmp_path, base_url=real.base_url + "/")  # same endpoint, trailing slash
        again.run(requests, parse=parse_qa)
        assert real.calls == 3 and again.usage_report()["total"]["cache_hits"] == 3


def test_persistent_5xx_ends_in_rejects_file(tmp_path):
    with StubServer() as server:
        client = make_client(server, tmp_path, max_retries=2)
        [bad, good] = client.run([request("down [[503*99]]"), request("fine")], parse=parse_qa)
    assert not bad.ok and good.ok
    assert server.statuses[503] == 3  # first try + 2 retries
    rejects = [json.loads(line) for line in (tmp_path / "rejects.jsonl").read_text().splitlines()]
    assert len(rejects) == 1 and "HTTP 503" in rejects[0]["error"] and rejects[0]["meta"]["name"] == "down [[503*99]]"


def test_malformed_output_is_retried_then_rejected(tmp_path):
    with StubServer() as server:
        client = make_client(server, tmp_path, max_parse_attempts=3)
        recovered, hopeless = client.run([request("once [[bad*1]]"), request("always [[bad]]")], parse=parse_qa)
        [missing] = client.run([request("fields")], parse=lambda text: parse_json_object(text, ["no_such_field"]))
    assert recovered.ok and recovered.attempts == 2
    assert not hopeless.ok and hopeless.attempts == 3 and hopeless.api_calls == 3
    assert not missing.ok and missing.attempts == 3  # valid JSON without a required field: rejected too
    rejects = {r["meta"]["name"]: r for r in map(json.loads, (tmp_path / "rejects.jsonl").read_text().splitlines())}
    assert set(rejects) == {"always [[bad]]", "fields"}
    assert [o["attempt"] for o in rejects["always [[bad]]"]["attempts"]] == [0, 1, 2]
    assert all("not valid JSON" in o["error"] for o in rejects["always [[bad]]"]["attempts"])
    assert all(o["reason"] == "malformed" and o["text"] for o in rejects["always [[bad]]"]["attempts"])
    assert all("no_such_field" in o["error"] for o in rejects["fields"]["attempts"])
    assert client.usage_report()["tasks"]["t"]["malformed"] == 1 + 3 + 3


def test_rerun_is_served_from_cache_with_zero_calls(tmp_path):
    requests = [request(f"prompt {i}") for i in range(6)] + [request("always [[bad]]")]
    with StubServer() as server:
        first = make_client(server, tmp_path).run(requests, parse=parse_qa)
        calls = server.calls
        second_client = make_client(server, tmp_path)
        second = second_client.run(requests, parse=parse_qa)
        assert server.calls == calls  # nothing repeated, not even the malformed attempts
    assert [r.value for r in first] == [r.value for r in second]
    usage = second_client.usage_report()["total"]
    assert usage["api_calls"] == 0 and usage["cache_hits"] == 6  # the rejected request is not even replayed
    assert usage["skipped_rejected"] == 1 and "--retry-rejected" in second[-1].error
    assert len((tmp_path / "rejects.jsonl").read_text().splitlines()) == 1  # not duplicated on rerun


def test_retry_rejected_asks_again_and_keeps_what_was_answered(tmp_path):
    """A request rejected for malformed output is marked with its reason: a rerun skips it, --retry-rejected
    (``retry_rejected``) asks it again with new attempts (answered, it leaves rejects.jsonl), and a later plain rerun
    replays that answer."""
    requests = [request("fine"), request("bad three times [[bad*3]]")]
    with StubServer() as server:
        first = make_client(server, tmp_path).run(requests, parse=parse_qa)
        assert first[0].ok and not first[1].ok and server.calls == 1 + 3
        [reject] = [json.loads(line) for line in (tmp_path / "rejects.jsonl").read_text().splitlines()]
        assert reject["reason"] == "malformed" and reject["kind"] == "request"
        skipped = make_client(server, tmp_path).run(requests, parse=parse_qa)
        assert server.calls == 4 and not skipped[1].ok
        assert "rejected in an earlier run (malformed:" in skipped[1].error
        retry = make_client(server, tmp_path, retry_rejected=True)
        again = retry.run(requests, parse=parse_qa)
        assert again[1].ok and again[1].attempts == 4  # 3 cached malformed answers replayed, then 1 new call
        assert server.calls == 4 + 1 and retry.usage_report()["total"]["cache_hits"] == 1 + 3
        later = make_client(server, tmp_path)
        replayed = later.run(requests, parse=parse_qa)
        assert server.calls == 5 and [r.value for r in replayed] == [r.value for r in again]
        assert later.usage_report()["total"]["skipped_rejected"] == 0
    assert (tmp_path / "rejects.jsonl").read_text() == ""  # answered: no longer listed as rejected


def test_a_check_rejection_is_asked_again_and_recorded_as_quality(tmp_path):
    """``check`` raising RejectedOutput makes a new attempt, like malformed output; when every attempt fails,
    the reject record says 'quality', and --retry-rejected asks again."""
    from longpeft.synth_data.llm_client import RejectedOutput

    verdicts = iter([False, True] + [False] * 3 + [False] * 3 + [True])  # a; b; b retried: 3 replayed, 1 new

    def check(req, value):
        if not next(verdicts):
            raise RejectedOutput("every item failed the quality gates (placeholder)")
        return value

    with StubServer() as server:
        client = make_client(server, tmp_path, max_parse_attempts=3)
        [second_try] = client.run([request("a")], parse=parse_qa, check=check)
        [hopeless] = client.run([request("b")], parse=parse_qa, check=check)
        assert second_try.ok and second_try.attempts == 2 and not hopeless.ok
        assert client.usage_report()["total"]["quality_rejected"] == 1 + 3
        [reject] = [json.loads(line) for line in (tmp_path / "rejects.jsonl").read_text().splitlines()]
        assert reject["reason"] == "quality" and "quality gates" in reject["error"]
        [skipped] = make_client(server, tmp_path).run([request("b")], parse=parse_qa, check=check)
        assert not skipped.ok and server.calls == 2 + 3
        retry = make_client(server, tmp_path, retry_rejected=True)
        [retried] = retry.run([request("b")], parse=parse_qa, check=check)
        assert retried.ok and retried.attempts == 4 and server.calls == 2 + 3 + 1
        [relaxed] = make_client(server, tmp_path, retry_rejected=True).run(
            [request("b")], parse=parse_qa, check=lambda req, value: value
        )
        assert relaxed.ok and relaxed.attempts == 1 and server.calls == 6  # a relaxed check costs no call


def test_transient_failures_are_not_marked_rejected(tmp_path):
    """A request given up after retries (a server down) is asked again by a plain rerun: once answered it leaves the
    rejects file, and once rejected as malformed its record says so, with no trace of gave_up; a 4xx refusal is not
    asked again and stays."""
    requests = [request("down [[503*2]]"), request("refused [[400*1]]"), request("then bad [[503*2,bad]]")]
    with StubServer() as server:
        down, refused, bad = make_client(server, tmp_path, max_retries=1).run(requests, parse=parse_qa)
        assert not down.ok and not refused.ok and not bad.ok
        first = [json.loads(line)["reason"] for line in (tmp_path / "rejects.jsonl").read_text().splitlines()]
        assert sorted(first) == ["gave_up", "gave_up", "http_refused"]
        again = make_client(server, tmp_path).run(requests, parse=parse_qa)
        assert again[0].ok and not again[1].ok and not again[2].ok
        assert "rejected in an earlier run (http_refused: BadRequestError: HTTP 400: injected HTTP 400)" in (
            again[1].error
        )
    records = [json.loads(line) for line in (tmp_path / "rejects.jsonl").read_text().splitlines()]
    assert sorted((r["reason"], r["marked"], [a["reason"] for a in r["attempts"]]) for r in records) == [
        ("http_refused", True, ["http_refused"]),
        ("malformed", True, ["malformed"] * 3),
    ]


def test_killed_run_resumes_without_repeating_answered_calls(tmp_path):
    n_requests, concurrency = 16, 2
    script = textwrap.dedent(f"""
        import sys
        from longpeft.synth_data.llm_client import LLMClient, LLMConfig, LLMRequest
        config = LLMConfig(base_url=sys.argv[1], model="stub", api_key_env="{KEY_ENV}", max_concurrency={concurrency})
        client = LLMClient(config, sys.argv[2], sys.argv[3], show_progress=False)
        client.run([LLMRequest("t", [{{"role": "user", "content": f"prompt {{i}}"}}]) for i in range({n_requests})])
    """)
    with StubServer(latency=0.05) as server:
        child = subprocess.Popen(
            [sys.executable, "-c", script, server.base_url, str(tmp_path / "cache"), str(tmp_path / "rejects.jsonl")],
            env={**os.environ},
            stderr=subprocess.PIPE,
        )
        deadline = time.time() + 60
        while server.calls < 6 and time.time() < deadline and child.poll() is None:
            time.sleep(0.01)
        child.send_signal(signal.SIGKILL)
        child.wait()
        assert child.returncode == -signal.SIGKILL, child.stderr.read().decode()
        cached = len(list((tmp_path / "cache").glob("*/*.json")))
        assert 0 < cached < n_requests
        before = server.calls
        client = make_client(server, tmp_path, max_concurrency=concurrency)
        results = client.run([request(f"prompt {i}") for i in range(n_requests)])
        assert all(r.ok for r in results)
        assert server.calls - before == n_requests - cached  # every cached answer reused
        repeated = sum(1 for n in server.prompt_calls.values() if n > 1)
        assert repeated <= concurrency  # only answers still in flight at the kill are asked again
        third = server.calls
        make_client(server, tmp_path).run([request(f"prompt {i}") for i in range(n_requests)])
        assert server.calls == third


def test_bad_key_aborts_the_run(tmp_path):
    class Refusing(StubServer):
        def _answer(self, body, authorization):
            return 401, {"error": {"message": "invalid key", "type": "auth"}}

    with Refusing() as server:
        with pytest.raises(LLMRunAborted, match=KEY_ENV):
            make_client(server, tmp_path).run([request("x")])


def test_missing_key_names_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_ENV)
    with StubServer() as server:
        with pytest.raises(LLMRunAborted, match=KEY_ENV):
            make_client(server, tmp_path).run([request("x")])


def test_config_has_no_key_field():
    with pytest.raises(ValueError, match="api_key"):
        LLMConfig(api_key="sk-should-not-be-accepted")


def test_api_key_appears_in_no_written_file(tmp_path):
    """A whole `synth` run with the LLM answerer: config, cache, rejects, stats, data hold no key."""
    from longpeft.cli import main

    source = tmp_path / "docs"
    source.mkdir()
    from longpeft.synth_data.corpus import generate_document

    for i in range(2):
        text = generate_document(seed=i, n_sentences=60).text
        # book_1 asks the stub for malformed answers in every sentence, so every job about it fails
        (source / f"book_{i}.txt").write_text(text.replace(". ", ". [[bad]] ") if i else text)
    out = tmp_path / "out"
    with StubServer() as server:
        code = main(
            [
                "synth",
                "--out",
                str(out),
                "--answerer",
                "llm",
                "--source",
                str(source),
                "--tasks",
                "single_detail,multi_detail",
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
                KEY_ENV,
                "--no-progress",
                "--set",
                "llm.backoff_initial=0.01",
            ]
        )
    assert code == 0
    assert any(h == f"Bearer {SECRET}" for h in server.auth_headers)  # the key was really used
    written = [p for p in out.rglob("*") if p.is_file()]
    assert (out / "rejects.jsonl") in written and (out / "llm_cache").is_dir()
    for path in written:
        assert SECRET.encode() not in path.read_bytes(), f"API key written to {path}"
    stats = json.loads((out / "stats.json").read_text())
    assert stats["llm_usage"]["total"]["api_calls"] > 0
    assert stats["build"]["skipped"]["single_detail"]["generation_failed"] == 1
    assert stats["build"]["skipped"]["multi_detail"]["generation_failed"] == 1
    assert stats["counts"] == {"single_detail": 1, "multi_detail": 1}
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert len(rejects) == 2 + 1 and all(r["meta"]["sources"] == [str(source / "book_1.txt")] for r in rejects)


def test_bundled_llama3_80k_config_mixes_as_the_paper(tmp_path, capsys):
    """`--config llama3-80k` (the 80K recipe's data): without your files it names the flag to give; with them
    (shrunk here to 2 contexts per task, tiny tokenizer, stub LLM) it mixes plain text and instructions to the
    paper's 3.5K : 5K : 12K."""
    from longpeft.cli import main
    from longpeft.synth_data.corpus import generate_document

    out = tmp_path / "out"
    assert main(["synth", "--config", "llama3-8k", "--out", str(out)]) == 2
    assert (
        "synth config 'llama3-8k' is neither a file nor a bundled synth config (beacon-llama3, llama3-80k)"
        in capsys.readouterr().err
    )
    assert main(["synth", "--config", "llama3-80k", "--out", str(out), "--source", str(tmp_path)]) == 2
    assert "needs mix.plain_text (a file or folder; --plain-text PATH)" in capsys.readouterr().err
    source = tmp_path / "books"
    source.mkdir()
    for i in range(2):
        (source / f"book_{i}.txt").write_text(generate_document(seed=i, n_sentences=60).text)
    plain, instructions = tmp_path / "plain.jsonl", tmp_path / "instructions.jsonl"
    plain.write_text(
        "".join(json.dumps({"text": generate_document(seed=10 + i, n_sentences=16).text}) + "\n" for i in range(10))
    )
    instructions.write_text(
        "".join(json.dumps({"instruction": f"Say {i}.", "input": "", "output": str(i)}) + "\n" for i in range(20))
    )
    with StubServer() as server:
        code = main(
            [
                "synth",
                "--config",
                "llama3-80k",
                "--out",
                str(out),
                "--source",
                str(source),
                "--plain-text",
                str(plain),
                "--instructions",
                str(instructions),
                "--tokenizer",
                "tiny",
                "--tasks",
                "single_detail,multi_detail",
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
                KEY_ENV,
                "--no-progress",
                "--set",
                "llm.backoff_initial=0.01",
            ]
        )
    assert code == 0, capsys.readouterr().err
    counts = json.loads((out / "stats.json").read_text())["counts"]
    # 4 x 5/3.5, 4 x 12/3.5
    assert counts == {"single_detail": 2, "multi_detail": 2, "plain_text": 6, "instruction": 14}
    assert server.auth_headers  # the LLM answered


def test_a_failed_retry_round_is_recorded_again(tmp_path):
    """--retry-rejected on a request still answered badly: 3 new attempts after the 3 replayed, one rejects record
    that replaces the first and lists all 6 attempts, and a plain rerun skips it again and keeps that record."""
    with StubServer() as server:
        make_client(server, tmp_path).run([request("always [[bad]]")], parse=parse_qa)
        [again] = make_client(server, tmp_path, retry_rejected=True).run([request("always [[bad]]")], parse=parse_qa)
        assert not again.ok and again.attempts == 6 and again.api_calls == 3 and server.calls == 6
        [skipped] = make_client(server, tmp_path).run([request("always [[bad]]")], parse=parse_qa)
        assert not skipped.ok and server.calls == 6
    records = [json.loads(line) for line in (tmp_path / "rejects.jsonl").read_text().splitlines()]
    assert [[a["attempt"] for a in r["attempts"]] for r in records] == [[0, 1, 2, 3, 4, 5]]
    assert records[0]["error"] == "malformed output in all 6 attempts"


# ---- structured output: one schema for the request and the parser ---------------------------------------------


def qa_request(text: str, task: str = "single_detail"):
    """The request the LLM answerer sends for a one-chunk job over ``text`` (its schema included)."""
    from longpeft.synth_data.corpus import Document
    from longpeft.synth_data.qa import Passage, QAJob, job_request

    return job_request(QAJob(task, [Passage(Document("d", "Title", text), 0, len(text))], 2))


def test_parsers_validate_against_the_schema_and_name_the_path():
    from longpeft.synth_data.builtin import parse_biographies
    from longpeft.synth_data.llm_client import MalformedOutput
    from longpeft.synth_data.registry import parse_qa_pairs

    bad = {
        '{"qa_pairs": [{"question": 5}]}': r"\$\.qa_pairs\[0\]\.question: expected a string, got int 5",
        '{"qa_pairs": [{"question": "Who?"}]}': r"\$\.qa_pairs\[0\]: lacks field\(s\) \['answer'\]",
        '{"qa_pairs": [{"question": "Who?", "answer": "A."}, {"question": " ", "answer": "B."}]}': (
            r"\$\.qa_pairs\[1\]\.question: empty string"
        ),
        '{"qa_pairs": []}': r"\$\.qa_pairs: 0 item\(s\), at least 1 needed",
        '{"qa_pairs": {"question": "Who?"}}': r"\$\.qa_pairs: expected an array, got dict",
        '{"answers": []}': r"\$: lacks field\(s\) \['qa_pairs'\]",
        "[1, 2]": r"expected a JSON object",
    }
    for text, message in bad.items():
        with pytest.raises(MalformedOutput, match=message):
            parse_qa_pairs(text)
    with pytest.raises(MalformedOutput, match=r"\$\.biographies\[0\]\.name: expected a string, got NoneType"):
        parse_biographies('{"biographies": [{"name": null, "biography": "x"}]}')
    # extra keys are ignored, strings are stripped, a code fence is removed
    pairs = parse_qa_pairs(
        '```json\n{"qa_pairs": [{"question": " Who built it? ", "answer": "Mara.", "why": 1}], "note": "x"}\n```'
    )
    assert [(p.question, p.answer) for p in pairs] == [("Who built it?", "Mara.")]
    [bio] = parse_biographies('{"biographies": [{"name": "Mara Quill", "biography": "An engineer."}]}')
    assert (bio.question, bio.answer) == ("Write a short biography of Mara Quill.", "An engineer.")


def test_the_schema_sent_is_the_one_the_parser_checks():
    """What goes out as response_format is the parser's schema without its length constraints: the same fields,
    types and required keys, and strict mode's additionalProperties: false on every object."""
    from longpeft.synth_data.answer_schema import BIOGRAPHIES, QA_PAIRS
    from longpeft.synth_data.registry import TASKS

    def shape(schema):  # the schema with minItems/minLength dropped, written independently of the module
        return {
            k: ({n: shape(s) for n, s in v.items()} if k == "properties" else shape(v) if k == "items" else v)
            for k, v in schema.items()
            if k not in ("minItems", "maxItems", "minLength")
        }

    for schema in (QA_PAIRS, BIOGRAPHIES):
        sent = schema.response_format()
        assert sent["type"] == "json_schema" and sent["json_schema"]["strict"] is True
        assert sent["json_schema"]["name"] == schema.name
        assert sent["json_schema"]["schema"] == shape(schema.schema)
        item = sent["json_schema"]["schema"]["properties"][schema.name]["items"]
        assert item["additionalProperties"] is False and set(item["required"]) == set(item["properties"])
    assert TASKS["single_detail"].schema is QA_PAIRS and TASKS["biography"].schema is BIOGRAPHIES
    # a job's schema is its task's, bounded to the items it asks for: sent with the bounds first, without on refusal
    sent = qa_request("Some text.").schema.response_format(bounds=True)["json_schema"]["schema"]
    assert sent["properties"]["qa_pairs"]["maxItems"] == 2 and sent["properties"]["qa_pairs"]["minItems"] == 1
    assert shape(sent) == shape(QA_PAIRS.schema)
    assert qa_request("Some text.").schema.response_format() == QA_PAIRS.response_format()
    from longpeft.synth_data.answer_schema import OutputSchema

    with pytest.raises(ValueError, match=r"\$\.a: schema uses \['pattern'\], outside the supported subset"):
        OutputSchema("x", {"type": "object", "properties": {"a": {"type": "string", "pattern": "^x$"}}})


def test_structured_auto_sends_the_schema_and_the_cache_key_holds_it(tmp_path):
    """auto against a server that enforces response_format: every request carries the schema; the same requests
    with llm.structured=off are other cache entries (asked again), and auto again is served from the cache."""
    from longpeft.synth_data.registry import parse_qa_pairs

    requests = [qa_request(f"Text number {i}.") for i in range(3)]
    with StubServer(structured="accept") as server:
        results = make_client(server, tmp_path).run(requests, parse=parse_qa_pairs)
        assert all(r.ok for r in results) and server.calls == 3
        assert all(f["json_schema"]["name"] == "qa_pairs" for f in server.response_formats)
        make_client(server, tmp_path, structured="off").run(requests, parse=parse_qa_pairs)
        assert server.calls == 6 and server.response_formats[3:] == [None] * 3
        make_client(server, tmp_path, structured="json_object").run(requests, parse=parse_qa_pairs)
        assert server.calls == 9 and server.response_formats[6:] == [{"type": "json_object"}] * 3
        again = make_client(server, tmp_path)
        again.run(requests, parse=parse_qa_pairs)
        assert server.calls == 9 and again.usage_report()["total"]["cache_hits"] == 3


def test_structured_auto_falls_back_once_when_refused(tmp_path, capsys):
    """A server without structured output answers 400 to response_format: the client drops the schema's item bounds
    first, then the schema, each said once, asks every request again without it, and never sends it again in this
    run; a rerun finds those answers in the cache."""
    from longpeft.synth_data.registry import parse_qa_pairs

    requests = [
        qa_request(f"Text number {i} begins here. Its second sentence has words. A third sentence ends it.")
        for i in range(6)
    ]
    with StubServer(structured="refuse", latency=0.02) as server:
        client = make_client(server, tmp_path, max_concurrency=3)
        results = client.run(requests, parse=parse_qa_pairs)
        assert all(r.ok for r in results) and all(len(r.value) == 3 for r in results)  # the stub writes 3
        refused = server.statuses[400]
        assert refused == 2  # one structured request goes first (with bounds, then without); the others wait
        assert sum(f is not None for f in server.response_formats) == refused
        assert server.statuses[200] == 6
        client.run([qa_request("One more text.")], parse=parse_qa_pairs)
        assert server.response_formats[-1] is None and server.statuses[400] == refused
        err = capsys.readouterr().err
        assert err.count("refused structured output") == 1 and "not supported by this server" in err
        assert err.count("refused the schema with its item bounds") == 1
        usage = client.usage_report()["total"]
        assert usage["rejected"] == 0 and usage["rejected_reasons"] == {}  # a fallback is no rejection
        rerun = make_client(server, tmp_path)
        assert all(r.ok for r in rerun.run(requests, parse=parse_qa_pairs))
        assert rerun.usage_report()["total"]["cache_hits"] == 6
        assert server.statuses[200] == 7 and server.statuses[400] == 4  # the rerun's two refusals, then cache hits


@pytest.mark.parametrize("mode", ["json_schema", "json_object"])
def test_explicit_structured_modes_never_fall_back(tmp_path, mode):
    with StubServer(structured="refuse") as server:
        with pytest.raises(LLMRunAborted, match=rf"refused structured output \(llm.structured={mode}; HTTP 400"):
            make_client(server, tmp_path, structured=mode).run([qa_request("Text.")])
        assert server.statuses[200] == 0


def test_a_400_that_is_not_about_structured_output_is_no_fallback(tmp_path, capsys):
    """HTTP 4xx refusals: the server's reason reaches the console for the first three, all are counted, the
    rejects file keeps the reason; a 400 that does not name structured output leaves it on."""
    from longpeft.synth_data.llm_client import refuses_structured_output

    with StubServer(structured="accept") as server:
        client = make_client(server, tmp_path)
        results = client.run([qa_request(f"Text {i} [[400*9]].") for i in range(5)] + [qa_request("Fine.")])
        assert [r.ok for r in results] == [False] * 5 + [True]
        assert server.response_formats[-1] is not None  # still structured
    err = capsys.readouterr().err
    assert err.count("injected HTTP 400") == 3 and "further refusals are counted" in err
    assert client.usage_report()["total"]["rejected_reasons"] == {"http_refused": 5}
    rejects = [json.loads(line) for line in (tmp_path / "rejects.jsonl").read_text().splitlines()]
    assert len(rejects) == 5 and all(
        r["reason"] == "http_refused" and "injected HTTP 400" in r["error"] for r in rejects
    )

    class Error:
        def __init__(self, status, body):
            self.status_code, self.body = status, body

    assert refuses_structured_output(Error(422, {"detail": [{"loc": ["body", "response_format"], "msg": "x"}]}))
    assert refuses_structured_output(Error(400, {"message": "JSON schema conversion failed"}))
    assert not refuses_structured_output(Error(400, {"message": "the request exceeds the available context size"}))
    assert not refuses_structured_output(Error(500, {"message": "response_format crashed"}))


def test_synth_against_a_server_without_structured_output(tmp_path, capsys):
    """The whole command against a server that refuses response_format: rows are built, the fallback is said once,
    and the server's reasons for refusing other requests (every request about book_1) reach the console."""
    from longpeft.cli import main
    from longpeft.synth_data.corpus import generate_document

    source = tmp_path / "docs"
    source.mkdir()
    for i in range(2):
        text = generate_document(seed=i, n_sentences=60).text
        (source / f"book_{i}.txt").write_text(text.replace(". ", ". [[400*99]] ") if i else text)
    out = tmp_path / "out"
    with StubServer(structured="refuse") as server:
        code = main(
            [
                "synth",
                "--out",
                str(out),
                "--answerer",
                "llm",
                "--source",
                str(source),
                "--tasks",
                "single_detail,biography",
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
                KEY_ENV,
                "--no-progress",
            ]
        )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.err.count("refused structured output") == 1
    assert captured.err.count("injected HTTP 400") == 3 and "further refusals are counted" in captured.err
    stats = json.loads((out / "stats.json").read_text())
    assert stats["counts"] == {"single_detail": 1, "biography": 1}
    total = stats["llm_usage"]["total"]
    assert total["rejected"] == 3 and total["rejected_reasons"] == {"http_refused": 3}  # 2 chunks and 1 book
    assert "rejects.jsonl: 3 request(s) rejected: http_refused 3 (HTTP 4xx reasons: the first are above)" in (
        captured.out
    )
    assert stats["rejects"]["requests"] == {"http_refused": 3}
    assert sum(f is not None for f in server.response_formats) == 2  # one structured request, refused twice


def test_a_bare_off_in_yaml_is_the_structured_mode_off():
    """YAML 1.1 reads ``structured: off`` (and ``--set llm.structured=off``) as false: it means ``off``."""
    import yaml

    assert LLMConfig(**yaml.safe_load("structured: off")).structured == "off"
    assert LLMConfig(structured=False).structured == "off"
    assert LLMConfig(structured="off").structured == "off" and LLMConfig().structured == "auto"
    with pytest.raises(ValueError, match="structured"):
        LLMConfig(structured=True)
