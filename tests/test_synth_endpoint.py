"""The endpoint as a synth run meets it, over real HTTP against tests/stub_server.py on 127.0.0.1: the endpoint check
(what it sends, what it reports, its deadline, its errors), a server that ignores response_format, prompt tokens
counted as the server counts them, the cause of every give-up, and property tests over answers of any shape."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from longpeft.errors import ModelSourceError
from longpeft.synth_data.llm_client import LLMClient, LLMConfig, LLMRequest, LLMRunAborted
from longpeft.synth_data.registry import parse_qa_pairs

from stub_server import RawSocketServer, StubServer, stub_template, stub_tokens  # tests/stub_server.py

KEY_ENV = "LONGPEFT_TEST_LLM_KEY"


@pytest.fixture(autouse=True)
def api_key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, "sk-test-endpoint")


def make_client(base_url: str, folder: Path, retry_rejected: bool = False, **overrides) -> LLMClient:
    settings_ = dict(
        base_url=base_url,
        model="stub",
        api_key_env=KEY_ENV,
        backoff_initial=0.0,
        backoff_max=0.0,
        max_concurrency=4,
        timeout=5.0,
    )
    settings_.update(overrides)
    return LLMClient(
        LLMConfig(**settings_),
        folder / "cache",
        folder / "rejects.jsonl",
        show_progress=False,
        retry_rejected=retry_rejected,
    )


def qa_request(text: str):
    """The request the LLM answerer sends for a one-chunk single-detail job over ``text``."""
    from longpeft.synth_data.corpus import Document
    from longpeft.synth_data.qa import Passage, QAJob, job_request

    return job_request(QAJob("single_detail", [Passage(Document("d", "Title", text), 0, len(text))], 2))


TEXTS = [f"Text number {i} begins here. Its second sentence has words. A third sentence ends it." for i in range(6)]


def check(base_url: str, capsys, *extra: str) -> tuple[int, str, str]:
    """``longpeft synth --check-endpoint`` as a user runs it: (exit status, stdout, stderr)."""
    from longpeft.cli import main

    code = main(
        ["synth", "--check-endpoint", "--llm-base-url", base_url, "--llm-model", "stub", "--api-key-env", KEY_ENV]
        + list(extra)
    )
    out = capsys.readouterr()
    return code, out.out, out.err


# ---- the endpoint check: what it sends, what it says -----------------------------------------------------------


@pytest.mark.parametrize("mode", ["auto", "json_schema", "json_object", "off"])
def test_the_check_sends_what_the_run_sends(tmp_path, capsys, mode):
    """For every llm.structured, the check's first request carries what the run's requests carry (response_format,
    sampling); only the messages, max_tokens and the number of items the schema allows differ. Under off no
    response_format is sent at all, and no probe."""
    with StubServer(structured="accept") as server:
        make_client(server.base_url, tmp_path, structured=mode, temperature=0.3).run(
            [qa_request(TEXTS[0])], parse=parse_qa_pairs
        )
        code, out, _ = check(
            server.base_url, capsys, "--set", f"llm.structured={mode}", "--set", "llm.temperature=0.3"
        )
    assert code == 0, out
    run_body, check_body = server.chat_bodies[0], server.chat_bodies[1]

    def params(body):  # all but the messages, max_tokens and the schema's maxItems (the number of questions asked)
        kept = {k: v for k, v in body.items() if k not in ("messages", "max_tokens")}
        return json.loads(re.sub(r', "maxItems": \d+', "", json.dumps(kept)))

    assert params(check_body) == params(run_body)
    assert ("response_format" in check_body) == (mode != "off")
    assert len(server.chat_bodies) == (2 if mode == "off" else 3)  # the run's request, the check's, its probe
    assert f"request     as the run sends it under llm.structured={mode}: " in out
    if mode == "off":
        assert "structured  not asked: llm.structured=off sends no response_format" in out


def test_the_check_reports_an_enforced_schema_and_says_what_it_waits_for(capsys):
    props = {"default_generation_settings": {"n_ctx": 8192}, "total_slots": 1}
    with StubServer(structured="accept", props=props) as server:
        url = server.base_url
        code, out, err = check(url, capsys)
        probe = server.chat_bodies[1]
    assert code == 0, out
    assert probe["response_format"]["json_schema"]["schema"]["required"] == ["word"]  # the one-field probe schema
    assert "answered as 'stub'; the server lists stub" in out and "latency" in out
    assert "structured  yes: json_schema enforced (asked for a plain word under a one-field schema, the server " in out
    assert "answer      passes the builders' parser and is bare JSON of the schema sent" in out
    assert "context     8192 tokens (/props default_generation_settings.n_ctx)" in out
    assert "set it to 1" in out and "result      usable as configured" in out
    assert f"endpoint    {url} (checked within 30 s: --check-timeout)" in out
    assert f"check: POST {url}/chat/completions: the run's first request" in err
    assert "the structured-output probe" in err and "waiting 30 s at most" in err


@pytest.mark.parametrize(
    ("structured", "answer_line"),
    [
        ("drop", "passes the builders' parser, but is not bare JSON of the schema sent"),  # transformers serve
        ("ignore", "passes the builders' parser and is bare JSON of the schema sent"),  # a model that obeys the prompt
    ],
)
def test_the_check_recognises_a_server_that_ignores_response_format(capsys, structured, answer_line):
    """HTTP 200 and an answer that parses are not "accepted": asked for a plain word under a schema, a server that
    drops response_format answers without it. auto is usable (the run falls back); json_schema is not."""
    with StubServer(structured=structured) as server:
        code, out, _ = check(server.base_url, capsys)
        assert code == 0, out
        assert "structured  no: json_schema ignored (HTTP 200, but asked for a plain word under a one-field " in out
        assert "llm.structured=auto notices it from the run's first answers" in out
        assert f"answer      {answer_line}" in out and "usable as configured" in out
        assert "accepted" not in out
        code, out, _ = check(server.base_url, capsys, "--set", "llm.structured=json_schema")
        assert code == 1 and "llm.structured=json_schema would stop the run: set auto or off" in out
        assert "NOT usable as configured" in out


def test_the_check_with_a_refusing_server_and_an_unparseable_answer(capsys):
    with StubServer(structured="refuse") as server:
        code, out, err = check(server.base_url, capsys)
        assert code == 0 and "structured  no: json_schema refused (HTTP 400: response_format" in out
        assert "llm.structured=auto falls back" in out and "context     not reported" in out
        assert "the QA request again with the schema without its item bounds" in err
        assert "the QA request again without response_format" in err
        unbounded = json.dumps(server.response_formats[1])
        assert "maxItems" in json.dumps(server.response_formats[0]) and "Items" not in unbounded
        assert server.response_formats[2] is None and len(server.chat_bodies) == 3  # no probe after a refusal
        code, out, _ = check(server.base_url, capsys, "--set", "llm.structured=json_object")
        assert code == 1 and "would stop the run" in out and "NOT usable" in out
    with StubServer(reply=lambda body: "I cannot help with that.") as server:
        code, out, _ = check(server.base_url, capsys)
        assert code == 1 and "fails the builders' parser" in out


def test_an_answer_cut_at_the_checks_own_budget_is_not_judged(capsys):
    """The check asks for fewer tokens than the run: an answer it cuts there is not a parser failure of the run's
    answers (exit 0, said as such); cut at the run's own llm.max_tokens it is one (exit 1)."""
    long_answer = json.dumps({"qa_pairs": [{"question": "What is said?", "answer": "words " * 400}]})
    with StubServer(reply=lambda body: long_answer, cut_at_max_tokens=True) as server:
        code, out, _ = check(server.base_url, capsys)
        assert code == 0, out
        assert (
            "answer      not judged: cut at 256 tokens, the check's own budget (llm.max_tokens 4096 in the run)" in out
        )
        assert "result      usable as configured as far as seen (the answer was cut short)" in out
        code, out, _ = check(server.base_url, capsys, "--set", "llm.max_tokens=200")
        assert code == 1 and "fails the builders' parser" in out and "(cut at 200 tokens: finish_reason length)" in out
        assert "NOT usable as configured" in out


# ---- the endpoint check: bounded, naming the server and quoting its answer ------------------------------------


def test_a_server_that_never_answers_ends_the_check_at_its_deadline(capsys):
    with StubServer(stall=True) as server:
        url = server.base_url
        code, out, err = check(url, capsys, "--check-timeout", "1")
    assert code == 2 and out == ""
    waiting = err.index(f"check: POST {url}/chat/completions: the run's first request")
    failed = err.index(f"error: {url} did not answer the run's first request")
    assert waiting < failed and "within the check's deadline (1 s)" in err and "--check-timeout" in err
    assert err.count("error:") == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    ("server", "said"),
    [
        (
            lambda: RawSocketServer(b"\x8f\xa0\x07 garbage, not HTTP\r\n"),
            "with an answer that is not HTTP (BadStatusLine",
        ),
        (
            lambda: StubServer(raw_reply=lambda body: b"\x8f\x00 <<not json>>"),
            "with HTTP 200 but not a chat completion (the body is not JSON: '\ufffd\\x00 <<not json>>'",
        ),
        (
            lambda: StubServer(raw_reply=lambda body: b'{"object": "list", "data": []}'),
            'with HTTP 200 but not a chat completion (the body has no \'choices\' list: \'{"object": "list"',
        ),
    ],
)
def test_an_answer_that_is_not_a_completion_is_named_and_quoted(capsys, server, said):
    with server() as running:
        url = running.base_url
        code, out, err = check(url, capsys, "--check-timeout", "5")
    assert code == 2, err
    assert f"error: {url} answered the run's first request (a one-question QA request" in err
    assert f" {said}" in err, err
    assert err.count("error:") == 1 and "Traceback" not in err


def test_check_errors_name_the_fix(capsys, monkeypatch):
    class Refusing(StubServer):
        def _answer(self, body, authorization):
            return 400, {"error": {"message": "model 'stub' is not loaded"}}

    with Refusing() as server:
        code, _, err = check(server.base_url, capsys)
    assert code == 2 and "refused the run's first request (a one-question QA request with response_format " in err
    assert "json_schema) (HTTP 400: model 'stub' is not loaded); check LONGPEFT_TEST_LLM_KEY" in err
    with StubServer() as server:
        gone = server.base_url
    code, _, err = check(gone, capsys, "--check-timeout", "2")
    assert code == 2 and f"cannot reach {gone}" in err
    monkeypatch.delenv(KEY_ENV)
    code, _, err = check(gone, capsys)
    assert code == 2 and KEY_ENV in err
    from longpeft.cli import main

    assert main(["synth", "--contexts", "1"]) == 2  # without --check-endpoint, --out is required
    assert "--out: give the output folder" in capsys.readouterr().err
    assert main(["synth", "--check-endpoint", "--check-timeout", "0"]) == 2
    assert "llm.check_timeout" in capsys.readouterr().err


# ---- the run: a server that ignores response_format ------------------------------------------------------------


def test_auto_falls_back_once_when_the_server_ignores_the_schema(tmp_path, capsys):
    """A server that drops response_format (HTTP 200, fenced JSON): the first two answers show it, the run says so in
    one line and asks without it; the answers parse, nothing is rejected; a rerun replays them from the cache."""
    requests = [qa_request(text) for text in TEXTS]
    with StubServer(structured="drop") as server:
        client = make_client(server.base_url, tmp_path, max_concurrency=3)
        results = client.run(requests, parse=parse_qa_pairs)
        assert all(r.ok for r in results)
        assert [f is not None for f in server.response_formats] == [True, True, False, False, False, False]
        err = capsys.readouterr().err
        assert err.count("ignores response_format") == 1
        assert "(json_schema sent, HTTP 200: its first 2 answers are not bare JSON of that shape ('```json" in err
        assert "llm.structured=auto: asking with the prompt's JSON contract only for the rest of the run" in err
        assert client.usage_report()["total"]["rejected"] == 0
        rerun = make_client(server.base_url, tmp_path, max_concurrency=3)
        assert all(r.ok for r in rerun.run(requests, parse=parse_qa_pairs)) and server.calls == 6
        assert capsys.readouterr().err.count("ignores response_format") == 1  # learned from the replayed answers
    with StubServer() as obeying:  # ignores the field too, but its model writes bare JSON: nothing to fall back from
        make_client(obeying.base_url, tmp_path / "other").run(requests, parse=parse_qa_pairs)
        assert all(f is not None for f in obeying.response_formats)
    assert "ignores response_format" not in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["json_schema", "json_object"])
def test_explicit_structured_modes_stop_when_the_schema_is_ignored(tmp_path, mode):
    with StubServer(structured="drop", reply=lambda body: "Here are the questions you asked for.") as server:
        with pytest.raises(
            LLMRunAborted, match=rf"ignores response_format \({mode} sent, HTTP 200: .*llm.structured="
        ):
            make_client(server.base_url, tmp_path, structured=mode).run(
                [qa_request(t) for t in TEXTS], parse=parse_qa_pairs
            )
        assert server.calls == 2


def test_the_verdict_needs_answers_that_prove_something():
    """Bare JSON of the sent shape means followed; a fence, prose or another shape does not; an empty answer, or one
    cut at max_tokens that starts as a JSON object, proves nothing and is not counted; a cut one that starts
    otherwise shows the field was not enforced."""
    from longpeft.synth_data.answer_schema import QA_PAIRS, StructuredWatch, follows_response_format

    schema = QA_PAIRS.response_format()
    pairs = json.dumps({"qa_pairs": [{"question": "Q?", "answer": "A."}]})
    assert follows_response_format(schema, pairs) and follows_response_format(schema, '  {"qa_pairs": []}\n')
    for text in (f"```json\n{pairs}\n```", f"Sure! {pairs}", '{"qa_pairs": [{"question": "Q?"}]}', "[]", "OK"):
        assert not follows_response_format(schema, text), text
    assert follows_response_format({"type": "json_object"}, '{"any": 1}')
    assert not follows_response_format({"type": "json_object"}, "[1]")
    watch = StructuredWatch()
    assert watch.observe(schema, ' {"qa_pairs": [{"question": "cut', "length") is None
    assert watch.observe(schema, "   ", "stop") is None and watch.unfollowed == []
    assert watch.observe(schema, "```json\n{", "length") is None and watch.observe(schema, "Fine", None) == "ignored"
    assert watch.observe(schema, pairs, "stop") is None  # settled, said once
    followed = StructuredWatch()
    assert followed.observe(schema, "OK", "stop") is None and followed.observe(schema, pairs, "stop") == "followed"


def test_answers_that_prove_nothing_stop_the_wait_but_not_the_judging(tmp_path, capsys):
    """An endpoint whose answers are all cut at max_tokens as JSON never settles the verdict: after UNDECIDED_AFTER
    of them requests stop going one at a time, and a later answer still settles it."""
    from longpeft.synth_data.answer_schema import QA_PAIRS, UNDECIDED_AFTER, StructuredWatch

    schema = QA_PAIRS.response_format()
    watch = StructuredWatch()
    for _ in range(UNDECIDED_AFTER):
        assert watch.waiting and watch.observe(schema, '{"qa_pairs": [{"question": "cut', "length") is None
    assert not watch.waiting and watch.verdict is None
    assert watch.observe(schema, "Fine", "stop") is None and watch.observe(schema, "Sure", "stop") == "ignored"

    cut = json.dumps({"qa_pairs": [{"question": "What is said?", "answer": "words " * 400}]})
    with StubServer(reply=lambda body: cut, cut_at_max_tokens=True) as server:
        client = make_client(server.base_url, tmp_path, max_tokens=32)
        results = client.run([qa_request(text) for text in TEXTS], parse=parse_qa_pairs, desc="cut")
    assert client.structured_watch.undecided >= UNDECIDED_AFTER and client.structured_watch.verdict is None
    assert len(results) == len(TEXTS) and not any(result.ok for result in results)  # cut answers do not parse


def test_synth_against_a_server_that_drops_response_format(tmp_path, capsys):
    """The whole command against a server like transformers serve: rows are built and the fallback is said once."""
    from longpeft.cli import main
    from longpeft.synth_data.corpus import generate_document

    source = tmp_path / "docs"
    source.mkdir()
    (source / "book.txt").write_text(generate_document(seed=0, n_sentences=60).text)
    with StubServer(structured="drop") as server:
        code = main(
            ["synth", "--out", str(tmp_path / "out"), "--answerer", "llm", "--source", str(source)]
            + ["--tasks", "single_detail", "--contexts", "1", "--min-tokens", "300", "--max-tokens", "2000"]
            + ["--chunk-tokens", "128", "--llm-base-url", server.base_url, "--llm-model", "stub"]
            + ["--api-key-env", KEY_ENV, "--no-progress"]
        )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.err.count("ignores response_format") == 1
    assert sum(f is not None for f in server.response_formats) == 2
    assert json.loads((tmp_path / "out" / "stats.json").read_text())["counts"] == {"single_detail": 1}


# ---- prompt tokens, counted as the server counts them ------------------------------------------------------------

PUNCTUATED = [{"role": "user", "content": "Alpha, beta; gamma. " * 30}]  # 90 words; the stub counts 180 + template


@pytest.mark.parametrize(
    ("kind", "how"),
    [
        ("llama.cpp", "counted by the server's tokenizer (llama.cpp POST /apply-template and /tokenize)"),
        ("vllm", "counted by the server's tokenizer (vLLM POST /tokenize, chat template applied)"),
    ],
)
def test_the_gate_counts_with_the_servers_tokenizer(tmp_path, capsys, kind, how):
    """The gate's count is the server's own (the tokens it charges for the prompt): a prompt of exactly the context
    is refused before sending, one token less is sent; llm.tokenizer does not override the server."""
    exact = len(stub_tokens(stub_template(PUNCTUATED)))
    with StubServer(tokenize=kind) as server:
        [refused] = make_client(server.base_url, tmp_path / "a", context_tokens=exact, tokenizer="no/such-tok").run(
            [LLMRequest("t", PUNCTUATED)]
        )
        assert not refused.ok and server.calls == 0
        assert f"the prompt has {exact} tokens ({how}), the endpoint's context is {exact}" in refused.error
        fits = make_client(server.base_url, tmp_path / "b", context_tokens=exact + 1)
        assert fits.run([LLMRequest("t", PUNCTUATED)])[0].ok and server.calls == 1
        assert fits.usage_report()["total"]["prompt_tokens"] == exact  # what the server charged
    assert f"prompt tokens are {how}" in capsys.readouterr().err


def test_prompt_longer_than_the_context_is_refused_before_sending(tmp_path):
    """llm.context_tokens: the limit is inclusive (no room left for the answer); a refused prompt is marked, skipped
    by a rerun, asked again with --retry-rejected once the context is larger."""
    request = LLMRequest("t", [{"role": "user", "content": "word " * 100}])  # 100 words
    with StubServer() as server:
        refused = make_client(server.base_url, tmp_path, context_tokens=100).run([request])
        assert server.calls == 0 and not refused[0].ok and "prompt_too_long" in refused[0].error
        [skipped] = make_client(server.base_url, tmp_path, context_tokens=101).run([request])  # marked
        assert not skipped.ok and "prompt_too_long" in skipped.error and "--retry-rejected" in skipped.error
        [reject] = [json.loads(line) for line in (tmp_path / "rejects.jsonl").read_text().splitlines()]
        assert reject["reason"] == "prompt_too_long" and reject["attempts"] == []
        retry = make_client(server.base_url, tmp_path, retry_rejected=True, context_tokens=101)
        assert retry.run([request])[0].ok and server.calls == 1
        assert (tmp_path / "rejects.jsonl").read_text() == ""  # answered: no longer listed


@pytest.mark.parametrize(
    ("models_info", "props", "source"),
    [
        ({"max_model_len": 60}, None, "/v1/models max_model_len"),  # vLLM, SGLang
        (
            {"meta": {"n_ctx_train": 100000}},
            {"default_generation_settings": {"n_ctx": 60}, "total_slots": 1},
            "/props default_generation_settings.n_ctx",
        ),  # llama.cpp
        ({}, {"n_ctx": 60}, "/props n_ctx"),  # older llama.cpp
    ],
)
def test_context_learned_from_the_server(tmp_path, capsys, models_info, props, source):
    long = LLMRequest("t", [{"role": "user", "content": "y " * 80}])  # 80 words
    with StubServer(models_info=models_info, props=props) as server:
        client = make_client(server.base_url, tmp_path)
        bad, good = client.run([long, LLMRequest("t", [{"role": "user", "content": "short"}])])
        assert not bad.ok and good.ok and server.calls == 1
    assert f"the endpoint's context is 60 (reported by the endpoint's {source})" in bad.error
    err = capsys.readouterr().err
    assert "context of 60 tokens" in err
    assert ("decodes 1 request(s) at once" in err) == bool(props and props.get("total_slots"))


def test_endpoint_lookups_are_tolerant():
    from longpeft.synth_data.endpoint import EndpointInfo, read_models, read_props, server_root

    assert server_root("http://h:8080/v1/") == "http://h:8080" and server_root("http://h/api") == "http://h/api"
    for body in (None, "text", {"data": "x"}, {"data": [1, {"id": "m", "max_model_len": "big"}]}):
        info = EndpointInfo()
        read_models(body, "m", info)
        read_props(body, info)
        assert info.context_tokens is None and info.slots is None
    info = EndpointInfo()
    read_models({"data": [{"id": "a", "max_model_len": 1}, {"id": "m", "context_length": 4096}]}, "m", info)
    assert (info.models, info.context_tokens, info.context_source) == (["a", "m"], 4096, "/v1/models context_length")
    other = EndpointInfo()
    read_models({"data": [{"id": "a", "max_model_len": 1}, {"id": "b", "max_model_len": 2}]}, "m", other)
    assert other.context_tokens is None  # several models, none of them ours: nothing to say


def test_without_a_server_tokenizer_the_estimate_errs_short(tmp_path, capsys):
    """No /tokenize and no llm.tokenizer: one token per word, fewer than the server counts, so a prompt the server
    would take is never refused; only one whose words alone reach the context is."""
    with StubServer() as server:
        [sent] = make_client(server.base_url, tmp_path / "a", context_tokens=91).run([LLMRequest("t", PUNCTUATED)])
        assert sent.ok and server.calls == 1
        [refused] = make_client(server.base_url, tmp_path / "b", context_tokens=90).run([LLMRequest("t", PUNCTUATED)])
        assert not refused.ok and server.calls == 1
        assert "the prompt has 90 tokens (estimated at one token per word, an under-count" in refused.error
    assert "prompt tokens are estimated at one token per word" in capsys.readouterr().err


def test_llm_tokenizer_counts_with_its_chat_template(tmp_path):
    from longpeft.tiny import demo_tokenizer

    tokenizer = demo_tokenizer()
    tokenizer.save_pretrained(tmp_path / "tok")
    text = tokenizer.apply_chat_template(PUNCTUATED, tokenize=False, add_generation_prompt=True)
    exact = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    with StubServer() as server:
        client = make_client(server.base_url, tmp_path, context_tokens=exact, tokenizer=str(tmp_path / "tok"))
        [refused] = client.run([LLMRequest("t", PUNCTUATED)])
    assert server.calls == 0
    assert f"the prompt has {exact} tokens (counted with llm.tokenizer {tmp_path / 'tok'} (its chat template" in (
        refused.error
    )
    with StubServer() as server, pytest.raises(ModelSourceError, match="llm.tokenizer .*no such folder"):
        make_client(server.base_url, tmp_path / "b", context_tokens=50, tokenizer=str(tmp_path / "none")).run(
            [LLMRequest("t", PUNCTUATED)]
        )


@pytest.mark.property
@given(texts=st.lists(st.text(max_size=40), min_size=1, max_size=4))
def test_the_estimate_never_counts_more_than_a_tokenizer(tokenizer, texts):
    """For any text, one token per word is at most what a byte-level BPE (the in-memory tokenizer) and the stub
    server's tokenizer count."""
    from longpeft.synth_data.endpoint import estimate_tokens

    messages = [{"role": "user", "content": text} for text in texts]
    estimate = estimate_tokens(messages)
    assert estimate <= sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts)
    assert estimate <= sum(len(stub_tokens(t)) for t in texts)


@pytest.mark.parametrize(("text", "words"), [("\x85", 0), ("a \x1c\x1d b", 2), ("\u200b", 0), ("a\x85b", 1)])
def test_the_estimate_counts_words_with_a_visible_character(text, words):
    """A run of control or format characters alone (which a tokenizer's normalizer may drop) is no word; the
    in-memory tokenizer counts no token for NEL alone (found by the slow property profile)."""
    from longpeft.synth_data.endpoint import estimate_tokens

    assert estimate_tokens([{"role": "user", "content": text}]) == words


def test_a_tokenizer_route_that_failed_is_not_asked_again():
    """After a failure every count is the estimate, said as such: a silent server costs its timeout once."""
    from longpeft.synth_data.endpoint import PromptCounter, TokenizeError, estimate_tokens

    calls = []

    def failing(messages):
        calls.append(messages)
        raise TokenizeError("POST http://127.0.0.1:9/tokenize: no answer within 10 s")

    counter = PromptCounter("counted by the server's tokenizer", failing)
    messages = [{"role": "user", "content": "three short words"}]
    first, second = counter.count(messages), counter.count(messages)
    assert first == second == (estimate_tokens(messages), counter.how) and len(calls) == 1
    assert "as the tokenizer failed (POST http://127.0.0.1:9/tokenize: no answer within 10 s)" in counter.how


def test_an_http_error_with_an_empty_body_names_the_status_and_the_url():
    from longpeft.synth_data.endpoint import HttpAnswer
    from longpeft.synth_data.llm_http import server_reason

    reason = server_reason(HttpAnswer("http://127.0.0.1:9/v1/chat/completions", 404, b""))
    assert reason == "HTTP 404 from http://127.0.0.1:9/v1/chat/completions, empty body"


# ---- give-ups say why ----------------------------------------------------------------------------------------------


def test_every_give_up_says_its_cause(tmp_path, capsys):
    with StubServer(stall=True) as stalled:
        client = make_client(stalled.base_url, tmp_path / "a", timeout=0.3, max_retries=0)
        results = client.run([LLMRequest("t", [{"role": "user", "content": f"q{i}"}]) for i in range(5)], desc="t")
    assert not any(r.ok for r in results)
    err = capsys.readouterr().err
    assert err.count("gave up on a t request after 0 retries (no answer within llm.timeout (0.3 s))") == 3
    assert "further give-ups are counted at the end of the batch" in err
    assert "gave up on 5 t request(s) after 0 retries (no answer within llm.timeout (0.3 s): 5)" in err
    assert client.usage_report()["total"]["gave_up_causes"] == {"no answer within llm.timeout (0.3 s)": 5}
    with StubServer() as server:
        client = make_client(server.base_url, tmp_path / "b", max_retries=1)
        client.run([LLMRequest("t", [{"role": "user", "content": "q [[503*9]]"}])], desc="t")
    err = capsys.readouterr().err
    assert "gave up on a t request after 1 retries (HTTP 503: injected HTTP 503)" in err
    assert "(HTTP 503: 1); not marked rejected: a plain rerun asks them again" in err


def test_the_synth_summary_gives_the_cause_of_its_give_ups(tmp_path, capsys):
    from longpeft.cli import main
    from longpeft.synth_data.corpus import generate_document

    source = tmp_path / "docs"
    source.mkdir()
    (source / "book.txt").write_text(generate_document(seed=0, n_sentences=40).text)
    with StubServer(stall=True) as server:
        code = main(
            ["synth", "--out", str(tmp_path / "out"), "--answerer", "llm", "--source", str(source)]
            + ["--tasks", "single_detail", "--contexts", "1", "--min-tokens", "300", "--max-tokens", "2000"]
            + ["--chunk-tokens", "128", "--llm-base-url", server.base_url, "--llm-model", "stub"]
            + ["--api-key-env", KEY_ENV, "--no-progress", "--set", "llm.timeout=0.3", "--set", "llm.max_retries=0"]
        )
    captured = capsys.readouterr()
    assert code == 3
    gave_up = json.loads((tmp_path / "out" / "stats.json").read_text())["llm_usage"]["total"]["rejected"]
    assert f"request(s) rejected: gave_up {gave_up} (no answer within llm.timeout (0.3 s): {gave_up})" in captured.out


# ---- property tests: answers of any shape --------------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12,
)
CONTENT = st.one_of(
    st.text(max_size=80),
    JSON.map(json.dumps),
    st.builds(lambda pairs: json.dumps({"qa_pairs": pairs}), st.lists(JSON, max_size=3)),
)
BODIES = st.one_of(
    st.binary(max_size=60),  # not JSON, not UTF-8
    JSON.map(lambda value: json.dumps(value).encode()),  # JSON of any shape
    st.builds(  # a completion whose parts have any shape
        lambda choice, usage: json.dumps({"choices": [choice], "usage": usage}).encode(),
        st.fixed_dictionaries({"message": st.one_of(JSON, st.fixed_dictionaries({"content": JSON}))}),
        JSON,
    ),
    st.builds(  # a well-formed completion whose content is anything
        lambda content, finish: json.dumps(
            {"choices": [{"message": {"content": content}, "finish_reason": finish}], "usage": {"prompt_tokens": 3}}
        ).encode(),
        CONTENT,
        st.sampled_from(["stop", "length", None]),
    ),
)


@pytest.mark.property
def test_the_client_re_asks_or_skips_any_answer_with_a_count(tmp_path, capsys):
    """A server answering any bytes with HTTP 200: each request is answered, or re-asked and rejected as malformed,
    or given up with a console line saying why; never an error out of the client."""
    served = {}
    with StubServer(raw_reply=lambda body: served["body"]) as server:

        @given(body=BODIES)
        @settings(suppress_health_check=[HealthCheck.too_slow])
        def one(body: bytes) -> None:
            served["body"] = body
            folder = tmp_path / str(server.calls)  # a fresh cache: each example reaches the server
            client = make_client(server.base_url, folder, max_retries=0, max_parse_attempts=2, structured="off")
            [result] = client.run([qa_request(TEXTS[0])], parse=parse_qa_pairs, desc="t")
            usage = client.usage_report()["total"]
            err = capsys.readouterr().err
            if result.ok:
                assert usage["rejected"] == 0 and result.value
            elif usage["rejected_reasons"] == {"gave_up": 1}:
                assert "gave up on a single_detail request after 0 retries (HTTP 200 but not a chat completion" in err
                assert "gave up on 1 t request(s) after 0 retries (a 200 that is not a completion: 1)" in err
            else:  # malformed (or another gate's reason) in both attempts, and said in the result
                assert usage["rejected"] == 1 and "gave_up" not in usage["rejected_reasons"]
                assert "in all 2 attempts" in result.error

        one()


@pytest.mark.property
def test_the_check_reports_any_answer_in_its_lines(capsys):
    """The endpoint check against a server answering any bytes: exit 0 or 1 with its report, or 2 with one line
    naming the server; never a traceback."""
    from longpeft.cli import main

    served = {}
    with StubServer(raw_reply=lambda body: served["body"]) as server:

        @given(body=BODIES, mode=st.sampled_from(["auto", "json_schema", "off"]))
        @settings(suppress_health_check=[HealthCheck.too_slow])
        def one(body: bytes, mode: str) -> None:
            served["body"] = body
            code = main(
                ["synth", "--check-endpoint", "--llm-base-url", server.base_url, "--llm-model", "stub"]
                + ["--api-key-env", KEY_ENV, "--check-timeout", "10", "--set", f"llm.structured={mode}"]
            )
            out = capsys.readouterr()
            if code == 2:
                errors = [line for line in out.err.splitlines() if "error:" in line]
                assert len(errors) == 1 and server.base_url in errors[0] and out.out == ""
            else:
                assert code in (0, 1) and out.out.splitlines()[-1].startswith("result      ")
                assert ("NOT usable" in out.out) == (code == 1)

        one()
