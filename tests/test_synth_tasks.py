"""The synth-task contract (``longpeft/synth_data/registry.py``), checked on every registered task:

- its prompt is built over a job's passages with the number of items asked, and its instructions (what an answer
  must not copy) hold none of the job's text;
- its schema is JSON Schema in the strict-mode subset (objects closed, every property required), and its parser
  takes an answer of that shape and refuses others;
- the quality gates judge its items: an answer of placeholders is rejected, the same answer kept with the gates off;
- ``synth --plan`` counts the requests its run sends to the stub server (tests/stub_server.py) and their tokens as the
  server counts them, and the procedural answerer builds its conversations offline;
- the built-in tasks' requests keep their cache keys, and no module but the registrations names a task in a
  condition.

A task registered later (a plug-in) is one ``register`` line: :func:`test_a_plug_in_task_is_one_register_line`
defines one here, with a flag and a schema of its own, and builds its conversations with ``longpeft synth``.
"""

from __future__ import annotations

import ast
import json
import random
import re
from pathlib import Path

import pytest
from pydantic import Field

from longpeft.cli import main
from longpeft.errors import ConfigError
from longpeft.synth_data.answer_schema import MalformedOutput, OutputSchema
from longpeft.synth_data.build_plan import plan_build
from longpeft.synth_data.builders import LengthConfig, LongContextBuilder, whole_contexts
from longpeft.synth_data.corpus import Document
from longpeft.synth_data.llm_cache import request_key
from longpeft.synth_data.llm_client import LLMClient, LLMConfig
from longpeft.synth_data.llm_request import sampling_params, structured_params
from longpeft.synth_data.pipeline import synth_config_model, synthesize
from longpeft.synth_data.qa import (
    LLMAnswerer,
    Passage,
    ProceduralAnswerer,
    QAJob,
    QAPair,
    job_instructions,
    job_prompt,
    job_request,
)
from longpeft.synth_data.quality import QualityConfig, QualityGates
from longpeft.synth_data.registry import TASKS, Flag, SynthTask, TaskConfig, get_task, register, registered
from longpeft.tiny import demo_tokenizer

from stub_server import StubServer, stub_template, stub_tokens  # tests/stub_server.py

PACKAGE = Path(__file__).resolve().parents[1] / "longpeft"
LENGTH = {"min_tokens": 1024, "max_tokens": 1536, "chunk_tokens": 256}
KEY_ENV = "LONGPEFT_TEST_LLM_KEY"


@pytest.fixture(autouse=True)
def api_key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, "sk-test")


@pytest.fixture(scope="module")
def tok():
    return demo_tokenizer()


def first_job(name: str, tok) -> QAJob:
    """The first job of one context of ``name``, planned from procedural documents."""
    builder = LongContextBuilder(tok, ProceduralAnswerer(), LengthConfig(**LENGTH), seed=0)
    [plan] = builder.plan(name, contexts=1)
    return plan.jobs[0]


def instance(schema: dict, text: str, items: int = 2):
    """An instance of ``schema`` whose strings are all ``text`` and whose lists hold ``items`` items."""
    if schema["type"] == "object":
        return {key: instance(sub, text, items) for key, sub in schema["properties"].items()}
    if schema["type"] == "array":
        return [instance(schema["items"], text, items) for _ in range(items)]
    return text


def client_for(server: StubServer, folder: Path) -> LLMClient:
    config = LLMConfig(base_url=server.base_url, model="stub", api_key_env=KEY_ENV, max_retries=0, backoff_initial=0)
    return LLMClient(config, folder / "cache", folder / "rejects.jsonl", show_progress=False)


@pytest.mark.parametrize("name", list(TASKS))
def test_its_prompt_is_built_over_the_passages_of_a_job(name, tok):
    job = first_job(name, tok)
    prompt, instructions = job_prompt(job), job_instructions(job)
    for passage in job.passages:
        opening = passage.text.strip()[:80]
        assert opening in prompt and opening not in instructions
    more = QAJob(job.task, job.passages, job.n + 4)
    assert job_prompt(more) != prompt and str(job.n + 4) in job_prompt(more)
    assert job_request(job).messages[-1] == {"role": "user", "content": prompt}


KEYWORDS = {"type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems", "minLength"}


def check_strict(schema: dict, path: str = "$") -> None:
    """``schema`` is JSON Schema in the subset strict structured output takes everywhere (written apart from
    :mod:`longpeft.synth_data.answer_schema`)."""
    assert set(schema) <= KEYWORDS and schema["type"] in ("object", "array", "string"), path
    if schema["type"] == "object":
        assert schema["additionalProperties"] is False and schema["required"] == list(schema["properties"]), path
        for key, sub in schema["properties"].items():
            check_strict(sub, f"{path}.{key}")
    elif schema["type"] == "array":
        check_strict(schema["items"], f"{path}[]")
        assert all(isinstance(schema.get(k, 0), int) and schema.get(k, 0) >= 0 for k in ("minItems", "maxItems"))


@pytest.mark.parametrize("name", list(TASKS))
def test_its_schema_is_strict_json_schema_and_its_parser_follows_it(name, tok):
    task = TASKS[name]
    check_strict(task.schema.schema)
    sent = job_request(first_job(name, tok)).schema.response_format(bounds=True)
    assert sent["type"] == "json_schema" and sent["json_schema"]["name"] == task.schema.name
    check_strict(sent["json_schema"]["schema"])
    items = task.parse(json.dumps(instance(task.schema.schema, "Ilse Marten kept the light.", items=3)))
    assert len(items) == 3 and all(isinstance(item, QAPair) and item.question and item.answer for item in items)
    assert all("Ilse Marten kept the light." in (item.question + item.answer) for item in items)
    for wrong in ("{}", '{"other": []}', json.dumps(instance(task.schema.schema, " ")), "not json"):
        with pytest.raises(MalformedOutput):
            task.parse(wrong)


@pytest.mark.parametrize("name", list(TASKS))
def test_the_quality_gates_judge_its_items(name, tok, tmp_path):
    job = first_job(name, tok)
    placeholders = json.dumps(instance(TASKS[name].schema.schema, "..."))
    with StubServer(reply=lambda body: placeholders) as server:
        gated = client_for(server, tmp_path / "gated")
        answerer = LLMAnswerer(gated)
        assert answerer.generate([job]) == [None]  # every attempt's items rejected
        assert answerer.gates.report()["rejected_per_task"][name]["placeholder"] > 0
        items = [r for r in gated.rejects.records() if r["kind"] == "item"]
        assert items and {(r["task"], r["reason"]) for r in items} == {(name, "placeholder")}
        ungated = LLMAnswerer(client_for(server, tmp_path / "ungated"), QualityGates(QualityConfig(enabled=False)))
        [kept] = ungated.generate([job])
        assert kept and len(kept) == min(2, job.n)


def llm_config(base_url: str, name: str, answerer: str = "llm"):
    contexts = {task: {"contexts": 1 if task == name else 0} for task in TASKS}
    return synth_config_model().model_validate(
        {
            "tokenizer": "tiny",
            "answerer": answerer,
            "progress": False,
            "length": LENGTH,
            **contexts,
            "llm": {"base_url": base_url, "model": "stub", "api_key_env": KEY_ENV, "max_tokens": 300},
        }
    )


@pytest.mark.parametrize("name", list(TASKS))
def test_synth_plan_counts_the_requests_and_tokens_its_run_sends(name, tok, tmp_path):
    with StubServer(tokenize="llama.cpp") as server:  # the plan counts with the server's own tokenizer
        config = llm_config(server.base_url, name)
        plan = plan_build(config, tmp_path / "out", tokenizer=tok)
        assert server.calls == 0 and list(plan.tasks) == [name] and plan.requests >= 1
        _, stats = synthesize(config, tmp_path / "out", tokenizer=tok)
        assert server.calls == len(server.chat_bodies) == plan.requests and stats["counts"] == {name: 1}
        sent = sum(len(stub_tokens(stub_template(body["messages"]))) for body in server.chat_bodies)
        assert plan.tasks[name].input_tokens == sent
        assert plan_build(config, tmp_path / "out", tokenizer=tok).to_send == 0  # the cache answers them all


@pytest.mark.parametrize("name", list(TASKS))
def test_the_procedural_answerer_builds_its_conversations_offline(name, tok, tmp_path):
    _, stats = synthesize(llm_config("http://127.0.0.1:9/v1", name, answerer="procedural"), tmp_path, tokenizer=tok)
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert stats["counts"] == {name: 1} and [row["task"] for row in rows] == [name]
    assert len(rows[0]["messages"]) >= 2 and rows[0]["messages"][-1]["role"] == "assistant"


LIGHTHOUSE = (
    "The lighthouse of Port Elwen was built in 1871 by the engineer Mara Quill. Its lamp burned whale oil until "
    "1903, when it was converted to electricity. Mara Quill lived in the keeper's house with her brother Tomas Quill."
)
MILL = "The town of Varn was founded in 1650 beside the river. Its mill ground wheat for three villages."
# The cache keys of one request per built-in task, as the client sends it first (sampling and response_format,
# attempt 0) and as its outcome is marked (sampling only): a change to a prompt, a schema or a request's body
# changes them, and a rerun into an existing output folder would then pay for every request again.
CACHE_KEYS = {
    "single_detail": (
        "283bd832d60ab5fd18fd851c2f705084d4b5f30a405c5bf37f9197a7df30da03",
        "30eb2c06e5a7c4170ba90abf08717109e1940d8bc42a6c8205a48e53fd123436",
    ),
    "multi_detail": (
        "53ef88066fd9e09127733cc41e9ef7c194b2d7095a8d007f24483d942c0c7a43",
        "f50d6a745e92f414e9e9db732e427dbffbcefc174107b5a9a85783fce6e097dc",
    ),
    "biography": (
        "40f4cef208bb6e9931635da64513ae3e9e1af911b59f00d81151269be8ea43ca",
        "a272594a6a3decc5435563f1e4134fc361f6c3a5631a3f0c203276036bb4ace7",
    ),
    "heterogeneous": (
        "7a02fd5fff4bc2ebd80bd54bdbfa6002e4178d49d877a190339a49c1dd176dbe",
        "d61dc564f655f82398436c210cb3b974550f07c05bf76c155f2f651274cc80a5",
    ),
}


def test_the_built_in_tasks_keep_their_cache_keys():
    lighthouse, mill = Document("lighthouse", "Port Elwen", LIGHTHOUSE), Document("mill", "Varn", MILL)
    whole = Passage(lighthouse, 0, len(LIGHTHOUSE))
    jobs = {
        "single_detail": QAJob("single_detail", [Passage(lighthouse, 0, 74)], 3),
        "multi_detail": QAJob("multi_detail", [whole], 5),
        "biography": QAJob("biography", [whole], 2),
        "heterogeneous": QAJob("heterogeneous", [whole, Passage(mill, 0, len(MILL))], 4),
    }
    config = LLMConfig()
    keys = {}
    for name, job in jobs.items():
        request, sampling = job_request(job), sampling_params(config)
        sent = {**sampling, **structured_params(config, request)}
        keys[name] = tuple(request_key(config.base_url, config.model, request, p, 0) for p in (sent, sampling))
    assert keys == CACHE_KEYS


def test_no_module_but_the_registrations_names_a_task_in_a_condition():
    """The run, the plan, the CLI, the answerers and the gates ask the registry: outside
    ``longpeft/synth_data/builtin.py`` no module of ``longpeft/synth_data`` compares with or tests membership in a
    task's name."""
    problems = []
    for path in sorted((PACKAGE / "synth_data").glob("*.py")):
        if path.name == "builtin.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                constants = {n.value for o in operands for n in ast.walk(o) if isinstance(n, ast.Constant)}
                if set(TASKS) & constants:
                    problems.append(f"{path.name}:{node.lineno}")
    assert problems == []


# ---- a plug-in task: quotes about the people a document names ----------------------------------------------------


class QuotesConfig(TaskConfig):
    quotes: int = Field(2, ge=1, description="quotes asked per context")


QUOTES = OutputSchema(
    "quotes",
    {
        "type": "object",
        "properties": {
            "quotes": {
                "type": "array",
                "minItems": 1,
                "items": {
                    "type": "object",
                    "properties": {"person": {"type": "string", "minLength": 1}, "quote": {"type": "string"}},
                    "required": ["person", "quote"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["quotes"],
        "additionalProperties": False,
    },
)
QUOTES_PROMPT = (
    "Below is a document.\n\n<document>\n{text}\n</document>\n\nQuote {n} sentences of the document, each about "
    'one person it names. Reply with JSON only, in this form: {{"quotes": [{{"person": "...", "quote": "..."}}]}}'
)


def parse_quotes(text: str) -> list[QAPair]:
    return [
        QAPair(f"What does the text say about {q['person'].strip()}?", q["quote"].strip()) for q in QUOTES.parse(text)
    ]


def quote_facts(job: QAJob, rng: random.Random) -> list[QAPair]:
    facts = [f for f in job.passages[0].facts() if f.kind in ("birth_year", "birthplace", "profession")]
    people = list({f.subject: f for f in facts}.values())
    chosen = sorted(rng.sample(people, min(job.n, len(people))), key=lambda f: f.start)
    return [QAPair(f"What does the text say about {f.subject}?", f.sentence, [f.fact_id]) for f in chosen]


PLUG_IN = SynthTask(
    "quotes",
    QuotesConfig,
    whole_contexts("quotes"),
    QUOTES_PROMPT,
    quote_facts,
    schema=QUOTES,
    parse=parse_quotes,
    flags=(Flag("--quotes", "quotes per context", "quotes", {"type": int}),),
)


def quote_reply(body: dict) -> str:
    """The stub model's answer to a quotes prompt: each sentence of the document naming a person, with the name."""
    document = re.search(r"<document>\n(.*)\n</document>", body["messages"][-1]["content"], re.DOTALL).group(1)
    found = {}
    for sentence in re.split(r"(?<=[.!?])\s+", document):
        name = re.search(r"\b[A-Z][a-z]+ [A-Z][a-z]+\b", sentence)
        if name and len(sentence.split()) >= 5:
            found.setdefault(name.group(0), sentence)
    return json.dumps({"quotes": [{"person": p, "quote": q} for p, q in found.items()]})


def synth(out: Path, *argv: str) -> int:
    length = ["--min-tokens", "1024", "--max-tokens", "1536", "--chunk-tokens", "256"]
    return main(["synth", "--out", str(out), "--tokenizer", "tiny", *length, "--no-progress", *argv])


def rows_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]


def test_a_plug_in_task_is_one_register_line(tmp_path, capsys):
    with registered(PLUG_IN):
        assert synth(tmp_path / "exact", "--tasks", "quotes", "--contexts", "2", "--quotes", "3") == 0
        rows = rows_of(tmp_path / "exact")
        assert [row["task"] for row in rows] == ["quotes", "quotes"]
        assert all(sum(m["role"] == "assistant" for m in row["messages"]) == 3 for row in rows)  # --quotes 3
        saved = json.loads((tmp_path / "exact" / "config.json").read_text())
        assert saved["quotes"] == {"contexts": 2, "quotes": 3} and saved["single_detail"]["contexts"] == 0
        with StubServer(reply=quote_reply) as server:
            llm = ["--answerer", "llm", "--llm-base-url", server.base_url, "--llm-model", "stub"]
            llm += ["--api-key-env", KEY_ENV, "--tasks", "quotes", "--contexts", "2"]
            capsys.readouterr()
            assert synth(tmp_path / "llm", *llm, "--plan") == 0
            assert server.calls == 0 and re.search(r"^quotes\s+2\s", capsys.readouterr().out, re.MULTILINE)
            assert synth(tmp_path / "llm", *llm) == 0
            assert server.calls == 2
            assert all(body["response_format"]["json_schema"]["name"] == "quotes" for body in server.chat_bodies)
        rows = rows_of(tmp_path / "llm")
        assert [row["task"] for row in rows] == ["quotes", "quotes"]
        for row in rows:
            context = row["messages"][0]["content"]
            answers = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
            assert len(answers) == 2 and all(answer in context for answer in answers)  # quotes of its own document
    assert "quotes" not in TASKS and "quotes" not in synth_config_model().model_fields
    assert synth(tmp_path / "gone", "--tasks", "quotes") == 2
    assert "--tasks: unknown task(s) ['quotes']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        synth(tmp_path / "gone", "--quotes", "3")


def test_register_refuses_what_would_break_the_config_or_the_cli():
    def task(name: str = "other", config: type = QuotesConfig, *flags: Flag) -> SynthTask:
        return SynthTask(name, config, whole_contexts("quotes"), "{text}", quote_facts, flags=flags)

    with pytest.raises(ValueError, match="'multi_detail' is already registered"):
        register(task("multi_detail"))
    with pytest.raises(ValueError, match="must be an identifier"):
        register(task("two words"))
    with pytest.raises(ValueError, match="config must be a subclass of TaskConfig"):
        register(task("other", LengthConfig))
    with pytest.raises(ValueError, match="--questions-per-chunk is another task's flag"):
        register(task("other", QuotesConfig, get_task("single_detail").flags[0]))
    with pytest.raises(ValueError, match="sets 'words', not a field of its config"):
        register(task("other", QuotesConfig, Flag("--words", "x", "words")))
    assert "other" not in TASKS
    with registered(task("mix")):
        with pytest.raises(ConfigError, match=r"synth task\(s\) \['mix'\] bear the name of a synth config field"):
            synth_config_model()
    with pytest.raises(ConfigError, match="unknown synth task 'nope'; choose one of single_detail, multi_detail"):
        get_task("nope")
