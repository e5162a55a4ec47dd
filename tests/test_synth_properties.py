"""Property tests (Hypothesis) of what a synth run finds on disk and what it reports: cache entries and rejects files
of any content are asked again or skipped with a count, never a traceback; after any sequence of runs, rejects.jsonl
lists exactly the requests still rejected and the summary's counts are the file's."""

from __future__ import annotations

import contextlib
import json
import ssl
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from longpeft.synth_data.answer_schema import parse_json_object
from longpeft.synth_data.corpus import Document
from longpeft.synth_data.llm_cache import ResponseCache, is_answer, is_outcome, outcome_key, request_key
from longpeft.synth_data.llm_client import LLMClient, LLMConfig, LLMRequest
from longpeft.synth_data.llm_rejects import rejects_counts
from longpeft.synth_data.llm_request import sampling_params
from longpeft.synth_data.qa import LLMAnswerer, Passage, QAJob, job_prompt, job_request
from longpeft.synth_data.quality import QualityConfig, QualityGates

from stub_server import StubServer  # tests/stub_server.py

pytestmark = pytest.mark.property
KEY_ENV = "LONGPEFT_TEST_LLM_KEY"
PROPERTY = settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def server():
    with StubServer() as running:
        yield running


@pytest.fixture(scope="module", autouse=True)
def one_tls_context():
    """Every run of the client builds an HTTP client, whose default TLS context reads the CA bundle (0.2 s, the most
    of a run against the local stub, which speaks plain HTTP): here the first context is reused."""
    made = ssl.create_default_context()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ssl, "create_default_context", lambda *args, **kwargs: made)
        yield


@pytest.fixture(autouse=True)
def api_key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, "sk-test")


def config_for(base_url: str) -> LLMConfig:
    return LLMConfig(
        base_url=base_url,
        model="stub",
        api_key_env=KEY_ENV,
        structured="off",
        context_tokens=100_000,  # known: no endpoint lookup
        max_retries=0,
        max_parse_attempts=2,
        backoff_initial=0.0,
    )


def make_client(base_url: str, folder: Path) -> LLMClient:
    return LLMClient(config_for(base_url), folder / "cache", folder / "rejects.jsonl", show_progress=False)


def answer_shaped(key: str) -> st.SearchStrategy:
    """A cache answer as longpeft writes it under ``key``, with one field replaced by any JSON value (or left out)."""
    whole = {"key": key, "task": "t", "text": '{"qa_pairs": []}', "finish_reason": "stop", "created": 1.0}
    whole["usage"] = {"prompt_tokens": 3, "completion_tokens": 4}
    fields = st.sampled_from(["key", "text", "finish_reason", "usage", "task"])
    return st.tuples(fields, JSON | st.just(None), st.booleans()).map(
        lambda change: {
            **{k: v for k, v in whole.items() if not (change[2] and k == change[0])},
            **({} if change[2] else {change[0]: change[1]}),
        }
    )


def mark_shaped(key: str) -> st.SearchStrategy:
    """An outcome mark as longpeft writes it under ``key``, with one field replaced by any JSON value."""
    base = {"key": key, "task": "t", "outcome": "rejected", "reason": "malformed", "error": "bad", "end": 2}
    fields = st.sampled_from(["key", "outcome", "reason", "error", "end"])
    values = JSON | st.sampled_from(["answered", "rejected", "gave_up", 0, 10**12, -1, True])
    return st.tuples(fields, values).map(lambda change: {**base, change[0]: change[1]})


def file_bytes(shaped: st.SearchStrategy) -> st.SearchStrategy:
    """File contents: a JSON value of another shape, a near-valid entry, or bytes that are not JSON (cut short,
    binary)."""
    as_json = (JSON | shaped).map(lambda value: json.dumps(value).encode())
    cut = shaped.map(lambda value: json.dumps(value).encode()).flatmap(
        lambda blob: st.integers(0, max(0, len(blob) - 1)).map(lambda n: blob[:n])
    )
    return as_json | cut | st.binary(max_size=40)


REQUEST = LLMRequest("t", [{"role": "user", "content": "Give one pair about the harbour."}])


def keys(base_url: str) -> tuple[str, str]:
    """The answer key (attempt 0) and the outcome mark key of REQUEST as the client above sends it."""
    first = request_key(base_url, "stub", REQUEST, sampling_params(config_for(base_url)), 0)
    return first, outcome_key(first)


@PROPERTY
@given(data=st.data(), where=st.sampled_from(["answer", "mark"]))
def test_a_cache_file_of_any_content_is_asked_again_or_skipped_with_a_count(server, data, where):
    answer_key, mark_key = keys(server.base_url)
    key = answer_key if where == "answer" else mark_key
    content = data.draw(file_bytes(answer_shaped(key) if where == "answer" else mark_shaped(key)))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cache" / key[:2] / f"{key}.json"
        path.parent.mkdir(parents=True)
        path.write_bytes(content)
        try:
            value = json.loads(content.decode("utf-8"))
        except ValueError:
            value = None
        ours = (is_answer if where == "answer" else is_outcome)(value, key)
        client = make_client(server.base_url, Path(tmp))
        calls = server.calls
        [result] = client.run([REQUEST])
        report = client.usage_report()
        usage = report["total"]
        after = ResponseCache(Path(tmp) / "cache")  # what a later run finds: the file replaced, if it was foreign
        assert (after.answer(key) if where == "answer" else after.outcome(key)) is not None
    asked = server.calls - calls
    if where == "mark" and ours and value["outcome"] == "rejected":
        assert not result.ok and asked == 0 and usage["skipped_rejected"] == 1  # skipped, and counted
    elif where == "answer" and ours and value.get("finish_reason") != "length":
        assert result.ok and asked == 0 and usage["cache_hits"] == 1  # replayed
    elif where == "answer" and ours:
        assert result.ok and asked == 1 and usage["truncated"] == 1  # replayed, cut off: asked again
    else:
        assert result.ok and asked == 1  # asked again
    assert report["foreign_cache_files"] == (0 if ours else 1)  # counted for the summary's line


def record_lines() -> st.SearchStrategy:
    """Lines of a rejects file: records as longpeft writes them, with fields of any JSON, garbage, cut lines."""
    record = st.fixed_dictionaries(
        {
            "kind": st.sampled_from(["request", "item"]) | JSON,
            "request": st.sampled_from(["a", "b"]) | JSON,
            "reason": st.sampled_from(["malformed", "quality", "placeholder"]) | JSON,
            "attempts": st.lists(st.fixed_dictionaries({"reason": st.text(max_size=8) | JSON}), max_size=3) | JSON,
        }
    )
    line = record.map(json.dumps).map(str.encode)
    return st.lists(
        line | line.map(lambda b: b[: len(b) // 2]) | JSON.map(json.dumps).map(str.encode) | st.binary(max_size=30)
    )


@PROPERTY
@given(lines=record_lines())
def test_a_rejects_file_of_any_content_is_read_with_a_count_and_rewritten_as_records(server, lines):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rejects.jsonl"
        path.write_bytes(b"\n".join(line.replace(b"\n", b" ") for line in lines))
        client = make_client(server.base_url, Path(tmp))
        foreign = client.rejects.foreign
        bad = LLMRequest("t", [{"role": "user", "content": "[[bad]] always malformed"}])
        results = client.run([REQUEST, bad], parse=parse_json_object)
        client.rejects.finish()
        written = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert [r.ok for r in results] == [True, False]
    assert [r["kind"] for r in written] == ["request"]  # the file's state: the one request still rejected
    assert client.rejects.counts() == rejects_counts(written)
    assert client.usage_report()["foreign_rejects_lines"] == foreign  # counted for the summary's line


# ---- sequences of runs ------------------------------------------------------------------------------------------

TEXT = (
    "Varn is a fishing village on the northern coast. Its lighthouse was built in 1843 by the engineer Tomas Hale. "
    "The first keeper was Ilse Marten, a former sailmaker from Brenn. In 1874 a winter storm destroyed half of the "
    "harbour wall, and Pieter Marten led the repairs with forty volunteers."
)
JOBS = [
    QAJob(task, [Passage(Document(f"doc-{i}", "Varn", TEXT), 0, len(TEXT))], 2)
    for i, task in enumerate(["single_detail", "multi_detail", "heterogeneous"])
]
GOOD = [("When was the lighthouse of Varn built?", "In 1843."), ("Who led the repairs?", "Pieter Marten.")]
JUNK = [("...", "..."), ("What is Varn?", "Varn is Varn.")]
BEHAVIOURS = ("good", "partial", "junk", "bad", "cut", "down", "refused")


def reply_for(behaviours: dict[str, str]):
    def pairs(items):
        return json.dumps({"qa_pairs": [{"question": q, "answer": a} for q, a in items]})

    def reply(body):
        kind = behaviours[body["messages"][-1]["content"]]
        if kind == "bad":
            return "not json at all"
        if kind == "cut":
            return (pairs(GOOD), "length")
        return pairs({"good": GOOD, "partial": GOOD[:1] + JUNK, "junk": JUNK}.get(kind, GOOD))

    def status(body):
        return {"down": 503, "refused": 400}.get(behaviours[body["messages"][-1]["content"]], 200)

    return reply, status


RUN = st.tuples(st.lists(st.sampled_from(BEHAVIOURS), min_size=3, max_size=3), st.booleans(), st.booleans())


@settings(PROPERTY, max_examples=max(1, settings.default.max_examples // 2))  # up to 4 runs an example
@given(runs=st.lists(RUN, min_size=1, max_size=4))
def test_after_any_sequence_of_runs_the_rejects_file_is_what_is_still_rejected(server, runs):
    """Runs over the same jobs, each with its own server behaviour per request, with or without --retry-rejected
    and with the gates on or off: after each, rejects.jsonl holds a request record for exactly the requests without
    an answer (skipped ones keep their earlier reason), no record of an answered request but the items dropped from
    its answers, and the counts the summary prints are those of the file."""
    prompts = [job_prompt(job) for job in JOBS]
    previous: dict[str, str] = {}  # request id -> reason in the file after the last run
    with tempfile.TemporaryDirectory() as tmp, served_by(server):
        for behaviours, retry, gates_on in runs:
            server.reply, server.status = reply_for(dict(zip(prompts, behaviours)))
            client = make_client(server.base_url, Path(tmp))
            client.retry_rejected = retry
            answerer = LLMAnswerer(client, QualityGates(QualityConfig(enabled=gates_on)))
            results = answerer.generate(JOBS)
            client.rejects.finish()
            lines = (Path(tmp) / "rejects.jsonl").read_text(encoding="utf-8").splitlines()
            written = [json.loads(line) for line in lines]
            ids = [client.request_id(job_request(job, i)) for i, job in enumerate(JOBS)]
            requests = {r["request"]: r for r in written if r["kind"] == "request"}
            assert len(requests) == sum(r["kind"] == "request" for r in written)  # one record per request
            assert set(requests) == {rid for rid, result in zip(ids, results) if result is None}
            for rid in ids:
                if rid in requests and rid in previous and not retry and previous[rid] != "gave_up":
                    assert requests[rid]["reason"] == previous[rid]  # skipped: the earlier record stays
            items = [r for r in written if r["kind"] == "item"]
            assert all(r["request"].split("/")[0] in ids for r in items)
            assert client.rejects.counts() == rejects_counts(written, client.rejects.carried)
            # the items listed are what this run's gates drop: none with the gates off, the junk items with them on
            assert (not gates_on and not items) or {(r["question"], r["answer"], r["reason"]) for r in items} <= {
                (*JUNK[0], "placeholder"),
                (*JUNK[1], "tautology"),
            }
            previous = {rid: r["reason"] for rid, r in requests.items()}


@contextlib.contextmanager
def served_by(server: StubServer):
    """The module's server, its reply and status put back afterwards."""
    reply, status = server.reply, server.status
    try:
        yield
    finally:
        server.reply, server.status = reply, status
