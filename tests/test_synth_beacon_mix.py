"""`longpeft synth --config beacon-llama3`: Activation Beacon's fine-tuning mix from your files, end to end on tiny
inputs (tiny tokenizer, stub LLM, the token range shrunk), checked against an independent count: the authors'
proportions (16K QA : 5K instructions : 2K summaries : 5K plain texts) and which records pass each length filter,
counted here with the tokenizer's chat template. Then the stage-2 recipe reads the folder the command wrote."""

from __future__ import annotations

import json
import re
import shlex
from collections import Counter
from pathlib import Path

import pytest

from longpeft.cli import build_parser, main
from longpeft.recipes.data import load_training_data, tokenize_dataset
from longpeft.recipes.schema import load_recipe
from longpeft.synth_data.corpus import generate_document
from longpeft.synth_data.mix import DEFAULT_PLAIN_PROMPT, DEFAULT_SUMMARY_PROMPT
from longpeft.tiny import demo_tokenizer, sample_text

from stub_server import StubServer  # tests/stub_server.py

ROOT = Path(__file__).resolve().parents[1]
KEY_ENV = "LONGPEFT_TEST_LLM_KEY"
OUT = "runs/synth/beacon-llama3"
LOW, HIGH = 150, 400  # the test's stand-in for the authors' 7,200 and 20,000 tokens
SHRINK = [
    f"mix.{source}_{bound}_tokens={value}"
    for source in ("plain", "instruction", "summary")
    for bound, value in (("min", LOW), ("max", HIGH))
]
AUTHORS = {"single_detail": 16, "plain_text": 5, "instruction": 5, "summary": 2}  # training.md's counts / 1000


@pytest.fixture(autouse=True)
def api_key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, "x")


@pytest.fixture(scope="module")
def tok():
    return demo_tokenizer()


def words(n: int, seed: int) -> str:
    """Filler text of about ``n`` tiny-tokenizer tokens (a sentence is ~37)."""
    return " ".join(sample_text(max(1, round(n / 37)), seed=seed))


def conversation_tokens(tok, messages) -> int:
    return len(tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])


def write_sources(root: Path, tok) -> dict[str, list]:
    """Sources whose records fall below, inside and above the range; returns each source's candidate conversations
    with their token counts, as the test counts them."""
    (root / "books").mkdir()
    for i in range(16):
        (root / "books" / f"book_{i}.txt").write_text(generate_document(seed=i, n_sentences=60).text)
    plain = [words(n, 100 + i) for i, n in enumerate([40, 40, 80, 200, 250, 600, 700, 800, 900])]
    (root / "redpajama.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in plain))
    alpaca = [
        {"instruction": f"Answer question {i} about the text.", "input": words(n, 200 + i), "output": f"Answer {i}."}
        for i, n in enumerate([10, 40, 180, 200, 220, 240, 260, 300, 700, 800])
    ]
    (root / "LongAlpaca-12k.json").write_text(json.dumps(alpaca))  # a JSON list, as the Hub file is
    booksum = [
        {"chapter": words(n, 300 + i), "summary_text": f"Chapter {i} in short.", "book_id": i}
        for i, n in enumerate([10, 180, 220, 260, 800])
    ]
    (root / "booksum.jsonl").write_text("".join(json.dumps(r) + "\n" for r in booksum))
    candidates = {
        "plain_text": [
            [{"role": "user", "content": DEFAULT_PLAIN_PROMPT}, {"role": "assistant", "content": t}] for t in plain
        ],
        "instruction": [
            [
                {"role": "user", "content": f"{r['instruction']}\n\n{r['input']}"},
                {"role": "assistant", "content": r["output"]},
            ]
            for r in alpaca
        ],
        "summary": [
            [
                {"role": "user", "content": DEFAULT_SUMMARY_PROMPT.replace("{text}", r["chapter"])},
                {"role": "assistant", "content": r["summary_text"]},
            ]
            for r in booksum
        ],
    }
    return {
        task: [(messages, conversation_tokens(tok, messages)) for messages in conversations]
        for task, conversations in candidates.items()
    }


def docs_command() -> list[str]:
    """The `synth --config beacon-llama3` command of docs/beacon.md, as argv."""
    text = re.sub(r"\\\n\s*", " ", (ROOT / "docs" / "beacon.md").read_text())
    [line] = [line for line in text.splitlines() if line.startswith("longpeft synth --config beacon-llama3")]
    return shlex.split(line.split("  #")[0].strip())[1:]


def test_beacon_config_builds_the_authors_mix_and_the_recipe_reads_it(tmp_path, monkeypatch, tok, capsys):
    monkeypatch.chdir(tmp_path)
    candidates = write_sources(tmp_path, tok)
    # the sources reach below, into and above the range (else the filters are not exercised)
    for task, rows in candidates.items():
        assert min(n for _, n in rows) < LOW and max(n for _, n in rows) > HIGH, task
    argv = docs_command()
    assert argv[argv.index("--out") + 1] == OUT  # the docs' command writes where the recipe reads
    sources = {
        "--source": ["books"],
        "--plain-text": ["redpajama.jsonl"],
        "--instructions": ["LongAlpaca-12k.json"],
        "--summaries": ["booksum.jsonl"],
    }
    parsed = build_parser().parse_args(argv)
    assert parsed.config == "beacon-llama3" and set(sources) <= {a for a in argv if a.startswith("--")}
    with StubServer() as server:
        code = main(
            [
                "synth",
                "--config",
                "beacon-llama3",
                "--out",
                OUT,
                *[word for flag, paths in sources.items() for word in (flag, *paths)],
                "--tokenizer",
                "tiny",
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
                "--set",
                "single_detail.contexts=16",
                "--set",
                "single_detail.chunks_per_context=1",
                *[word for setting in SHRINK for word in ("--set", setting)],
            ]
        )
    assert code == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (tmp_path / OUT / "train.jsonl").read_text().splitlines()]
    assert Counter(row["task"] for row in rows) == AUTHORS

    for task in ("instruction", "summary"):  # conversations outside the range are left out, never cut
        inside = [messages for messages, n in candidates[task] if LOW <= n <= HIGH]
        taken = [row["messages"] for row in rows if row["task"] == task]
        assert all(messages in inside for messages in taken) and len(inside) > len(taken)
    texts = [messages[1]["content"] for messages, n in candidates["plain_text"] if n >= LOW]
    plain = [row for row in rows if row["task"] == "plain_text"]
    cut = 0
    for row in plain:  # every plain text is one of the long-enough ones, or a prefix of one cut to fit
        content, n = row["messages"][1]["content"], conversation_tokens(tok, row["messages"])
        assert n == row["num_tokens"] and LOW <= n <= HIGH
        source = next(t for t in texts if t.startswith(content))
        if source != content:
            cut += 1
            assert n >= HIGH - 3  # cut where the range ends
    long_enough = sum(n >= LOW for _, n in candidates["plain_text"])
    inside = sum(LOW <= n <= HIGH for _, n in candidates["plain_text"])
    assert cut >= AUTHORS["plain_text"] - inside and long_enough >= AUTHORS["plain_text"]
    stats = json.loads((tmp_path / OUT / "stats.json").read_text())["build"]
    assert stats["requested"] == {"single_detail": 16}

    recipe = load_recipe("beacon-llama3-8b-instruct")
    assert Path(recipe.data.source) == Path(OUT) / "train.jsonl"
    dataset = load_training_data(recipe.data, tok)  # the recipe's own data section, from the folder written here
    assert dataset["messages"] == [row["messages"] for row in rows]
    tokenized = tokenize_dataset(dataset, tok, assistant_only=True)  # training counts the tokens synth counted
    assert [len(ids) for ids in tokenized["input_ids"]] == [row["num_tokens"] for row in rows]


def test_bundled_config_holds_the_authors_numbers():
    """training.md: --min_length 7200, --max_length 20000; 16K QA, 5K LongAlpaca, 2K BookSum, 5K RedPajama."""
    from longpeft.config import read_yaml, validate
    from longpeft.synth_data.pipeline import SynthConfig

    data = read_yaml(ROOT / "longpeft/synth_data/configs/beacon-llama3.yaml")
    data["source"]["paths"] = ["books/"]  # the files the command line gives
    data["mix"].update(plain_text="p.jsonl", instructions="i.json", summaries="s.jsonl")
    config = validate(SynthConfig, data, "beacon-llama3")
    mix = config.mix
    assert (
        config.single_detail.contexts,
        config.multi_detail.contexts,
        config.heterogeneous.contexts,
        config.biography.contexts,
    ) == (16000, 0, 0, 0)
    assert config.length.min_tokens == 7200 and config.length.max_tokens <= 20000
    for source in ("plain", "instruction", "summary"):
        assert (getattr(mix, f"{source}_min_tokens"), getattr(mix, f"{source}_max_tokens")) == (7200, 20000)
    assert mix.plain_truncate
    total = 16000 / (1 - mix.plain_ratio - mix.instruction_ratio - mix.summary_ratio)
    assert [round(total * ratio) for ratio in (mix.plain_ratio, mix.instruction_ratio, mix.summary_ratio)] == [
        5000,
        5000,
        2000,
    ]


def test_missing_or_malformed_sources_fail_before_any_request(tmp_path, tok, capsys):
    write_sources(tmp_path, tok)
    (tmp_path / "bad.jsonl").write_text(
        json.dumps({"chapter": "x", "summary_text": "y"}) + "\n" + json.dumps({"chapter": "only a text"}) + "\n"
    )
    base = [
        "synth",
        "--config",
        "beacon-llama3",
        "--out",
        str(tmp_path / "out"),
        "--tokenizer",
        "tiny",
        "--source",
        str(tmp_path / "books"),
        "--plain-text",
        str(tmp_path / "redpajama.jsonl"),
        "--instructions",
        str(tmp_path / "LongAlpaca-12k.json"),
        "--llm-base-url",
        "http://127.0.0.1:9/v1",
        "--api-key-env",
        KEY_ENV,
        "--no-progress",
    ]
    for extra, message in [
        ([], "summary_ratio > 0 needs mix.summaries (a file or folder; --summaries PATH)"),
        (
            ["--summaries", str(tmp_path / "booksum.json")],
            f"mix.summaries (--summaries) {tmp_path / 'booksum.json'} does not exist",
        ),
        (
            ["--summaries", str(tmp_path / "bad.jsonl")],
            f"{tmp_path / 'bad.jsonl'}:2: a summarisation record needs string fields 'chapter' and 'summary_text'",
        ),
    ]:
        assert main([*base, *extra]) == 2  # the endpoint (nothing listens there) is never reached
        assert message in capsys.readouterr().err


def test_instructions_read_the_authors_conversations_files_and_json_lists(tmp_path):
    """The authors' data files are .json with one {"conversations": [...]} record per line; the Hub's LongAlpaca is
    one JSON list. Both load; a turn without its content is named by file and line."""
    from longpeft.errors import DataError
    from longpeft.synth_data.mix import load_instructions

    turns = [{"role": "user", "content": "Question?"}, {"role": "assistant", "content": "Answer."}]
    lines, listed = tmp_path / "longalpaca.json", tmp_path / "list.json"
    lines.write_text(json.dumps({"conversations": turns}) + "\n\n" + json.dumps({"messages": turns}) + "\n")
    listed.write_text(json.dumps([{"instruction": "Question?", "output": "Answer."}]))
    assert load_instructions(lines) == [turns, turns] and load_instructions(listed) == [turns]
    lines.write_text(json.dumps({"conversations": turns}) + "\n" + json.dumps({"conversations": [{"role": "user"}]}))
    with pytest.raises(DataError, match=re.escape(f"{lines}:2: every turn needs string fields 'role' and 'content'")):
        load_instructions(lines)


def test_contexts_flag_keeps_the_tasks_the_config_turned_off():
    """`--contexts N` sizes the config's tasks: with beacon-llama3 (single-detail QA only) it does not switch the
    other builders on."""
    from longpeft.synth_data.cli import resolve_config

    files = ["--source", "books/", "--plain-text", "p.jsonl", "--instructions", "i.json", "--summaries", "s.jsonl"]
    args = build_parser().parse_args(["synth", "--config", "beacon-llama3", "--out", "o", "--contexts", "3", *files])
    config = resolve_config(args)
    assert [
        getattr(config, task).contexts for task in ("single_detail", "multi_detail", "heterogeneous", "biography")
    ] == [3, 0, 0, 0]
