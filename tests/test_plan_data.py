"""The planner's time from the data's own sample lengths, against what the runner really trains on."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from longpeft.cli import main
from longpeft.recipes.plan_data import CHARS_PER_TOKEN, count_sample_lengths
from longpeft.recipes.schema import load_recipe
from longpeft.scale import estimate
from longpeft.scale.lengths import SampleLengths
from longpeft.units import format_duration

WORDS = "the river city report market north south garden harbor station".split()
FILLER_WORDS = (5, 12, 30, 60, 90, 140, 260, 330)  # conversations of ~50 to ~900 tiny tokens


def _conversations(path: Path, filler_words=FILLER_WORDS, seed: int = 0) -> Path:
    """Passkey conversations of varied lengths, the answer last."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for n in filler_words:
            filler = " ".join(rng.choice(WORDS) for _ in range(n))
            key = rng.randint(10000, 99999)
            messages = [
                {"role": "user", "content": f"{filler} The passkey is {key}. What is the passkey?"},
                {"role": "assistant", "content": f"The passkey is {key}."},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def _recipe(source: Path, tmp_path: Path, *extra: str):
    return load_recipe(
        "tiny-cpu",
        [
            f"data.source={source}",
            "train.per_device_batch_size=1",
            "train.global_batch_size=1",
            "lora.r=4",
            f"output_dir={tmp_path / 'run'}",
            *extra,
        ],
    )


def _trained_lengths(recipe) -> list[int]:
    """Tokens of every batch of one epoch of the runner's own dataloader (batches of one sample: no padding)."""
    from longpeft.recipes.runner import prepare

    return [batch["input_ids"].shape[1] for batch in prepare(recipe).trainer.get_train_dataloader()]


def _sample_flops(recipe, n: int) -> tuple[float, float]:
    """FLOPs and attention FLOPs of one sample of ``n`` tokens, from the planner's uniform-length path (every sample
    data.max_length tokens, checked against torch's FLOP counter in test_scale_plan.py) at max_length = n."""
    plan = estimate(
        recipe.model_copy(update={"data": recipe.data.model_copy(update={"max_length": n, "min_length": 0})}),
        gpus=1,
        samples=1,
    )
    return plan.flops_per_token * n, plan.attention_flops_per_token * n


@pytest.mark.parametrize(
    "rules",
    [
        ("data.max_length=400", "data.min_length=60"),  # the longest dropped, the shortest dropped
        # the longest cut to 400 tokens, or dropped when the cut leaves no answer
        ("data.max_length=400", "data.truncate=true"),
    ],
)
def test_tokens_and_flops_match_a_direct_count_of_what_the_runner_trains(tmp_path, rules):
    recipe = _recipe(_conversations(tmp_path / "train.jsonl"), tmp_path, "train.num_train_epochs=2", *rules)
    trained = _trained_lengths(recipe)
    assert 2 <= len(trained) < len(FILLER_WORDS)  # the filters did something
    lengths = count_sample_lengths(recipe, progress=False)
    assert sorted(lengths.lengths) == sorted(trained)
    plan = estimate(recipe, gpus=1, sample_lengths=lengths)
    assert plan.tokens == 2 * sum(trained)  # two epochs
    flops = [_sample_flops(recipe, n) for n in trained]
    assert plan.flops_per_token * plan.tokens == pytest.approx(2 * sum(f for f, _ in flops), rel=1e-9)
    assert plan.attention_flops_per_token * plan.tokens == pytest.approx(2 * sum(a for _, a in flops), rel=1e-9)
    # a float32 base on an H100: 0.46, SDPA 0.51
    seconds = 2 * sum((f - a) / 0.46 + a / 0.51 for f, a in flops) / 989e12
    assert plan.hours * 3600 == pytest.approx(seconds, rel=1e-9)


def test_max_steps_cycle_through_the_data_at_its_mean_length(tmp_path):
    recipe = _recipe(_conversations(tmp_path / "train.jsonl"), tmp_path, "data.max_length=1024")
    lengths = count_sample_lengths(recipe, progress=False)
    counted = list(lengths.lengths)
    assert len(counted) == len(FILLER_WORDS)
    steps = load_recipe(
        "tiny-cpu", [f"data.source={tmp_path / 'train.jsonl'}", "train.max_steps=5", "train.global_batch_size=4"]
    )  # 20 samples: 2 passes and 4 of 8 more
    plan = estimate(steps, gpus=1, sample_lengths=lengths)
    assert plan.tokens == round(20 * sum(counted) / len(counted))
    assert "cycling through them, the partial pass at their average" in plan.table()
    by_rows = estimate(recipe, gpus=1, samples=16, sample_lengths=lengths)  # --samples: rows at the counted average
    assert by_rows.tokens == 2 * sum(counted)
    assert "each of the 16 rows planned at the 8 counted samples' average" in by_rows.table()


def test_lengths_are_estimated_from_characters_when_the_tokenizer_is_not_here(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = _conversations(tmp_path / "train.jsonl")
    recipe = load_recipe(
        "llama3-8b-instruct-80k-qlora", [f"data.source={source}", "data.max_length=300", "data.min_length=30"]
    )
    rows = [json.loads(line)["messages"] for line in source.read_text().splitlines()]
    estimated = [math.ceil(sum(len(turn["content"]) for turn in messages) / 4) for messages in rows]
    expected = [n for n in estimated if 30 <= n <= 300]
    assert 0 < len(expected) < len(rows)
    lengths = count_sample_lengths(recipe, progress=False)
    assert CHARS_PER_TOKEN == 4 and sorted(lengths.lengths) == sorted(expected)
    plan = estimate(recipe, gpus=8, sample_lengths=lengths)
    assert plan.tokens == sum(expected)
    line = plan.table().splitlines()[-1]
    assert line.startswith(f"time: {len(expected)} samples (1 epoch of {len(expected)} rows) at their own lengths")
    assert (
        "an estimate of 4 characters per token, the tokenizer of meta-llama/Meta-Llama-3-8B-Instruct is not in "
        "the Hugging Face cache (the planner downloads nothing); the chat template's own tokens not "
        "counted"
    ) in line
    assert "dropped as too long" in line and "dropped as too short" in line


def test_without_local_data_the_time_line_states_the_assumed_samples_and_length(capsys):
    recipe = load_recipe("llama3-8b-instruct-80k-qlora", ["data.source=owner/hub-dataset"])
    lengths = count_sample_lengths(recipe, progress=False)
    assert not lengths.lengths and "is not on this machine" in lengths.unknown
    assert (
        main(
            [
                "plan",
                "llama3-8b-instruct-80k-qlora",
                "--set",
                "data.source=owner/hub-dataset",
                "--gpus",
                "8",
                "--gpu",
                "a800",
            ]
        )
        == 0
    )
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith(
        "time: 1,000 samples (1 epoch of 1,000 rows (assumed: pass --samples N)), each assumed "
        "81,920 tokens long (data.max_length; data.source owner/hub-dataset is not on this machine"
    )
    assert "sample length (tokens)" not in line


def test_the_cli_prints_the_histogram_it_planned_from(tmp_path, capsys):
    source = _conversations(tmp_path / "train.jsonl")
    assert (
        main(["plan", "tiny-cpu", "--set", f"data.source={source}", "--set", "data.max_length=1024", "--gpus", "2"])
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    table = lines[lines.index(next(line for line in lines if line.startswith("sample length (tokens)"))) :]
    assert len(table) == 7 and table[-1].startswith("time: 8 samples (1 epoch of 8 rows) at their own lengths")
    buckets = [line.split() for line in table[1:6]]
    assert [(int(b[0].replace(",", "")), int(b[2].replace(",", ""))) for b in buckets] == [
        (513, 1024),
        (257, 512),
        (129, 256),
        (65, 128),
        (1, 64),
    ]
    assert sum(int(b[3]) for b in buckets) == 8
    assert (
        "; padding to each batch's longest sample not counted; every GPU equally loaded (in the order the recipe "
        "trains them, random (the Trainer's default; train.group_by_length: true groups them), each step waits "
        "for its slowest GPU and each batch is padded to its longest sample: "
    ) in table[-1]  # 2 per batch


def test_utk_sequences_are_the_runners_packing(tmp_path):
    from datasets import Dataset

    from longpeft.recipes.data import pack_for_utk, tokenize_dataset, utk_document_room
    from longpeft.recipes.plan_data import local_tokenizer
    from longpeft.synth_data.utk import add_utk_tokens

    rng = random.Random(1)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 300))) for _ in range(12)]
    source = tmp_path / "texts.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    recipe = load_recipe(
        "tiny-cpu",
        [
            f"data.source={source}",
            "data.format=text",
            "data.max_length=512",
            "data.truncate=true",
            "data.utk={}",
            "lora.embeddings=full",
        ],
    )
    tokenizer, _ = local_tokenizer(recipe)
    documents = tokenize_dataset(Dataset.from_dict({"text": texts}), tokenizer, False)
    letters = add_utk_tokens(tokenizer, max(recipe.data.utk.chunk_counts)).letters  # added already: the same ids
    packed = pack_for_utk(documents, 512, recipe.data.utk, len(letters))
    expected = sorted(sum(row) for row in packed["doc_lengths"])
    lengths = count_sample_lengths(recipe, progress=False)
    assert sorted(lengths.lengths) == expected and lengths.filtered["packed_sequences"] == len(packed)
    assert max(len(ids) for ids in documents["input_ids"]) > utk_document_room(512, recipe.data.utk) or len(packed) > 1
    assert "UtK's own insertions not counted" in lengths.describe()


def test_a_synth_output_folder_trains_and_plans_from_its_train_jsonl(tmp_path):
    from longpeft.recipes.data import load_training_data

    folder = tmp_path / "synth"
    folder.mkdir()
    _conversations(folder / "train.jsonl")
    (folder / "stats.json").write_text(json.dumps({"conversations": len(FILLER_WORDS)}))
    (folder / "config.json").write_text(json.dumps({"tokenizer": "tiny"}))
    recipe = _recipe(folder, tmp_path, "data.max_length=1024")
    assert len(load_training_data(recipe.data, None)) == len(FILLER_WORDS)  # not stats.json or config.json
    lengths = count_sample_lengths(recipe, progress=False)
    assert len(lengths.lengths) == len(FILLER_WORDS) and lengths.source == str(folder / "train.jsonl")


def test_uniform_lengths_plan_as_the_max_length_path():
    """Every sample at data.max_length: the same tokens, FLOPs and hours as planning without lengths."""
    recipe = load_recipe("llama3-8b-instruct-80k-qlora")
    assumed = estimate(recipe, gpus=8, samples=40)
    counted = estimate(
        recipe, gpus=8, sample_lengths=SampleLengths(lengths=(81920,) * 40, source="x", counted_with="y")
    )
    assert counted.tokens == assumed.tokens == 40 * 81920
    assert counted.flops_per_token == pytest.approx(assumed.flops_per_token, rel=1e-12)
    assert counted.hours == pytest.approx(assumed.hours, rel=1e-12)
    assert counted.terms == assumed.terms  # memory plans for data.max_length either way


def _llm_config(base_url: str, **extra):
    from longpeft.synth_data.pipeline import SynthConfig

    return SynthConfig.model_validate(
        {
            "tokenizer": "tiny",
            "answerer": "llm",
            "progress": False,
            "length": {"min_tokens": 1024, "max_tokens": 1536, "chunk_tokens": 256},
            "single_detail": {"contexts": 2, "chunks_per_context": 2},
            "multi_detail": {"contexts": 1},
            "heterogeneous": {"contexts": 1},
            "biography": {"contexts": 1},
            "llm": {"base_url": base_url, "model": "stub", "api_key_env": "STUB_KEY", "max_tokens": 300},
            **extra,
        }
    )


def test_synth_plan_counts_the_requests_and_tokens_the_build_sends(tmp_path, monkeypatch, capsys):
    """The plan's requests and input tokens against what a stub endpoint really receives during the build, counted by
    the server's own tokenizer (llama.cpp's /apply-template and /tokenize), not the training one; a second plan finds
    them all in the cache; --plan requests no completion."""
    from longpeft.synth_data.build_plan import plan_build
    from longpeft.synth_data.pipeline import synthesize
    from longpeft.tiny import demo_tokenizer

    from stub_server import StubServer, default_reply, stub_template, stub_tokens

    monkeypatch.setenv("STUB_KEY", "x")
    received = []

    def recording(body):
        received.append(body["messages"])
        return default_reply(body)

    tokenizer = demo_tokenizer()
    with StubServer(reply=recording, tokenize="llama.cpp") as server:
        config = _llm_config(server.base_url)
        plan = plan_build(config, tmp_path / "out", tokenizer=tokenizer)
        assert server.calls == 0 and not (tmp_path / "out").exists()  # no completion asked, nothing written
        assert "/tokenize" in server.tokenize_calls
        synthesize(config, tmp_path / "out", tokenizer=tokenizer)
        assert (
            main(
                [
                    "synth",
                    "--out",
                    str(tmp_path / "out"),
                    "--tokenizer",
                    "tiny",
                    "--answerer",
                    "llm",
                    "--llm-base-url",
                    server.base_url,
                    "--llm-model",
                    "stub",
                    "--api-key-env",
                    "STUB_KEY",
                    "--min-tokens",
                    "1024",
                    "--max-tokens",
                    "1536",
                    "--chunk-tokens",
                    "256",
                    "--contexts",
                    "1",
                    "--set",
                    "single_detail.contexts=2",
                    "--set",
                    "single_detail.chunks_per_context=2",
                    "--set",
                    "llm.max_tokens=300",
                    "--no-progress",
                    "--plan",
                    "--tokens-per-minute",
                    "6000",
                ]
            )
            == 0
        )
        assert server.calls == len(received)  # the CLI's plan sent nothing either
    counted = sum(len(stub_tokens(stub_template(messages))) for messages in received)
    assert plan.requests == len(received) == 2 * 2 + 1 + 1 + 1 and plan.input_tokens == counted
    assert {task: t.requests for task, t in plan.tasks.items()} == {
        "single_detail": 4,
        "multi_detail": 1,
        "biography": 1,
        "heterogeneous": 1,
    }
    report = capsys.readouterr().out
    total = next(line for line in report.splitlines() if line.startswith("total"))
    assert total.split() == ["total", "7", f"{counted:,}", f"{7 * 300:,}", "7"]  # all 7 in the cache by then
    assert (
        "7 requests to stub; no completion was requested" in report
        and "input tokens: counted by the server's tokenizer (llama.cpp POST /apply-template and /tokenize)" in report
        and "estimate: 0.0 s for the 0 requests not in the cache" in report
    )
    again = plan_build(config, tmp_path / "out", tokenizer=tokenizer)  # answered: a resumed run sends none
    assert again.to_send == 0 and again.requests - again.to_send == 7


def test_synth_plan_time_is_the_slowest_limit(tmp_path):
    from longpeft.synth_data.build_plan import BuildPlan, TaskRequests

    plan = BuildPlan(
        tasks={
            "single_detail": TaskRequests(requests=100, input_tokens=500_000, cached=10, cached_input_tokens=50_000)
        },
        conversations=50,
        output_tokens_per_request=400,
        output_tokens_from="--output-tokens",
        counted_with="the tokenizer tiny",
        model="m",
        concurrency=8,
        max_parse_attempts=3,
    )
    limits = plan.time_limits(output_tokens_per_second=20, tokens_per_minute=100_000, requests_per_minute=30)
    assert limits["concurrency"] == math.ceil(90 / 8) * 400 / 20  # 12 waves of 20 s
    assert limits["tokens per minute"] == 60 * (450_000 + 90 * 400) / 100_000
    assert limits["requests per minute"] == 60 * 90 / 30
    report = plan.report(20, 100_000, 30)
    assert "time at 100,000 tokens/min (input and output): 4.9 min   <- the limit" in report


def test_synth_plan_needs_an_llm_answerer_and_bounded_outputs(tmp_path):
    from longpeft.synth_data.build_plan import plan_build
    from longpeft.synth_data.pipeline import SynthConfig

    with pytest.raises(ValueError, match="answerer is procedural, which calls no LLM"):
        plan_build(SynthConfig(), tmp_path)
    unbounded = _llm_config("http://127.0.0.1:9/v1", llm={"max_tokens": None})
    with pytest.raises(ValueError, match="give --output-tokens N"):
        plan_build(unbounded, tmp_path)


def test_random_order_steps_wait_for_their_slowest_gpu():
    """Hand-counted cases whose answer does not depend on the shuffle (one GPU-second per token)."""
    from longpeft.scale.lengths import ordered_seconds

    def seconds(n):
        return n

    # two GPUs, one sample each: every step holds the 10 and the 1, and lasts 10 (balanced: 5.5)
    assert ordered_seconds([10, 1], seconds, 3, per_device_batch=1, data_parallel=2, accumulation=1) == 30
    # one GPU, batches of two: the 1 is padded to 10
    assert ordered_seconds([10, 1], seconds, 3, per_device_batch=2, data_parallel=1, accumulation=1) == 60
    # two GPUs, two micro-batches each before the all-reduce: the GPU with the 10 takes 10 + 1
    assert ordered_seconds([10, 1, 1, 1], seconds, 2, per_device_batch=1, data_parallel=2, accumulation=2) == 22
    # equal lengths: no waiting
    assert ordered_seconds([5] * 8, seconds, 4, per_device_batch=1, data_parallel=4, accumulation=1) == 20


def test_an_epoch_ends_as_accelerate_and_the_trainer_end_it():
    """Hand-counted epoch ends in grouped order, which starts each epoch with its longest sample."""
    from longpeft.scale.lengths import epoch_steps, ordered_seconds

    def seconds(n):
        return n

    # two GPUs, 3 samples: the second step's other GPU trains the epoch's first sample again (even_batches)
    assert epoch_steps(3, 1, 2, 1) == 2
    assert ordered_seconds([10, 1, 1], seconds, 2, 1, 2, 1, grouped=True) == 10 + 10
    # one GPU, batches of two: the epoch's last batch holds the one sample left, unpadded
    assert epoch_steps(3, 2, 1, 1) == 2
    assert ordered_seconds([10, 1, 1], seconds, 4, 2, 1, 1, grouped=True) == 2 * (2 * 10 + 1)
    # one GPU, 5 micro-batches in steps of 2: the epoch's last step has one
    assert epoch_steps(5, 1, 1, 2) == 3
    assert ordered_seconds([10, 1, 1, 1, 1], seconds, 3, 1, 1, 2, grouped=True) == (10 + 1) + (1 + 1) + 1


def test_the_time_line_gives_the_random_order_hours_beside_the_balanced_ones():
    recipe = load_recipe("llama3-8b-instruct-80k-qlora", ["train.group_by_length=false"])
    mixed = SampleLengths(lengths=(81920,) * 8 + (2048,) * 56, source="x", counted_with="y")
    plan = estimate(recipe, gpus=8, sample_lengths=mixed)
    waiting = plan.assumptions["hours_in_order"]
    assert plan.hours < waiting <= 8 * plan.hours
    assert (
        plan.table()
        .splitlines()[-1]
        .endswith(
            f"; every GPU equally loaded (in the order the recipe trains them, random (the Trainer's default; "
            f"train.group_by_length: true groups them), each step waits for its slowest GPU: "
            f"{format_duration(waiting * 3600)}) = {format_duration(plan.hours * 3600)}"
        )
    )
    uniform = SampleLengths(lengths=(4096,) * 64, source="x", counted_with="y")
    assert estimate(recipe, gpus=8, sample_lengths=uniform).assumptions["hours_in_order"] is None
    bf16 = load_recipe("llama3-8b-instruct-80k-qlora", ["model.load_in_4bit=false"])  # ulysses: one sample on all GPUs
    assert estimate(bf16, gpus=8, launch="ulysses", sample_lengths=mixed).assumptions["hours_in_order"] is None
