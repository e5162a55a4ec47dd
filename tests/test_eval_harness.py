"""The lm-evaluation-harness bridge (`longpeft eval harness`): a local multiple-choice task (a YAML and a jsonl written
here, no download) scored through HFLM over `longpeft.load(...)` equals the accuracy computed directly with the model;
the adapter's RoPE change is in effect (its loglikelihoods are not the base's); HFLM's max_length is the extended
length from longpeft.json; bad flags and a missing lm-eval fail with messages naming what to do."""

from __future__ import annotations

import argparse
import json
import logging
import sys

import pytest
import torch

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'longpeft[eval]')")

from longpeft.errors import ConfigError, OutputFolderError
from longpeft.eval.cli import register
from longpeft.eval.harness import extended_length, harness_lm, import_lm_eval, run_harness
from longpeft.tiny import tiny_model, train_tokenizer

TASK = "tiny_choice"
CHOICES = ["north", "south garden", "harbor station"]
EXTENDED = 1024  # the adapter's max_position_embeddings; the tiny base has 256


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


@pytest.fixture(scope="module")
def base_and_adapter(tokenizer, tmp_path_factory):
    """A tiny base (RoPE base 1e4, 256 positions) and an adapter whose longpeft.json raises the base to 1e6 and the
    positions to 1024. Its LoRA is peft's initialisation (B = 0), so it changes the logits through its RoPE alone."""
    from peft import LoraConfig, get_peft_model

    from longpeft.spec import ContextSpec

    folder = tmp_path_factory.mktemp("harness")
    base_dir, adapter_dir = folder / "base", folder / "adapter"
    model = tiny_model("llama", vocab_size=len(tokenizer))
    model.save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(adapter_dir)
    rope = {"rope_type": "default", "rope_theta": 1e6, "max_position_embeddings": EXTENDED}
    ContextSpec.from_base(model.config, "rope", base_model=str(base_dir), methods={"rope": rope}).save(adapter_dir)
    return base_dir, adapter_dir


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """A local lm-eval task: a loglikelihood multiple choice over a jsonl file (lm-eval's `json` loader)."""
    folder = tmp_path_factory.mktemp("tasks")
    words = "the river city report market north south garden harbor station".split()
    rows = [
        {
            "question": " ".join(words[(i + j) % len(words)] for j in range(24 + 3 * i)) + " . The answer is",
            "label": i % len(CHOICES),
        }
        for i in range(6)
    ]
    (folder / "docs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / f"{TASK}.yaml").write_text(f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / "docs.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: {json.dumps(CHOICES)}
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""")
    return folder, rows


def direct_loglikelihoods(model, tokenizer, rows) -> list[list[float]]:
    """log p(" " + choice | question) for every row and choice, one unpadded forward per pair: the context's tokens,
    then the continuation's (the tokens the whole text has beyond the context's)."""
    scores = []
    with torch.no_grad():
        for row in rows:
            context = tokenizer(row["question"]).input_ids
            per_choice = []
            for choice in CHOICES:
                whole = tokenizer(row["question"] + " " + choice).input_ids
                assert whole[: len(context)] == context
                logprobs = model(torch.tensor([whole])).logits[0].float().log_softmax(-1)
                per_choice.append(
                    sum(logprobs[position - 1, whole[position]].item() for position in range(len(context), len(whole)))
                )
            scores.append(per_choice)
    return scores


def harness_loglikelihoods(results) -> list[list[float]]:
    samples = sorted(results["samples"][TASK], key=lambda sample: sample["doc_id"])
    return [[response[0][0] for response in sample["resps"]] for sample in samples]


def accuracy(scores, rows) -> float:
    return sum(max(range(len(CHOICES)), key=s.__getitem__) == row["label"] for s, row in zip(scores, rows)) / len(rows)


def test_harness_on_longpeft_load_equals_a_direct_computation_and_keeps_the_adapters_rope(
    tokenizer, base_and_adapter, task_dir, single_thread
):
    from transformers import AutoModelForCausalLM

    import longpeft

    base_dir, adapter_dir = base_and_adapter
    folder, rows = task_dir
    model = longpeft.load(str(base_dir), adapter_dir).eval()
    results = run_harness(
        model,
        tokenizer,
        [TASK],
        include_path=folder,
        max_length=extended_length(adapter_dir),
        batch_size=2,
        log_samples=True,
    )
    reference = direct_loglikelihoods(model, tokenizer, rows)
    got = harness_loglikelihoods(results)
    assert (torch.tensor(got) - torch.tensor(reference)).abs().max() < 1e-4
    assert results["results"][TASK]["acc,none"] == pytest.approx(accuracy(reference, rows))
    assert results["longpeft"]["max_length"] == EXTENDED

    base = AutoModelForCausalLM.from_pretrained(base_dir).eval()  # the stock base: RoPE base 1e4
    on_base = direct_loglikelihoods(base, tokenizer, rows)
    # The adapter's RoPE base is in effect: the harness's numbers are not the base's, by far more than the 1e-4 above
    # (about 4e-3 here: a random tiny model, 40-60 token prompts).
    assert (torch.tensor(got) - torch.tensor(on_base)).abs().max() > 1e-3


def test_harness_on_a_tied_base_with_a_trained_embedding(tokenizer, task_dir, tmp_path, single_thread):
    """``eval harness`` on a tied base whose adapter trains the embedding (``lora.embeddings: full`` on SmolLM2 or
    Llama-3.2): HFLM's ``tie_weights()`` keeps the adapter's model, whose accuracy the CLI reports."""
    from peft import LoraConfig, get_peft_model

    import longpeft
    from longpeft.spec import ContextSpec

    base_dir, adapter_dir = tmp_path / "base", tmp_path / "adapter"
    model = tiny_model("llama-tied", vocab_size=len(tokenizer))
    model.save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    peft_model = get_peft_model(
        model,
        LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["model.embed_tokens"], ensure_weight_tying=True),
    )
    with torch.no_grad():
        peft_model.get_base_model().get_input_embeddings().weight.mul_(3.0)  # a trained embedding, also the head
    peft_model.save_pretrained(adapter_dir)
    ContextSpec.from_base(model.config, "rope", base_model=str(base_dir)).save(adapter_dir)
    folder, rows = task_dir
    out = tmp_path / "harness.json"
    flags = ["--tasks", TASK, "--include-path", str(folder), "--log-samples", "--out", str(out)]
    assert run_cli("harness", "--model", str(base_dir), "--adapter", str(adapter_dir), *flags) == 0
    reference = direct_loglikelihoods(longpeft.load(str(base_dir), adapter_dir).eval(), tokenizer, rows)
    got = harness_loglikelihoods(json.loads(out.read_text()))
    assert (torch.tensor(got) - torch.tensor(reference)).abs().max() < 1e-4
    stock = direct_loglikelihoods(tiny_model("llama-tied", vocab_size=len(tokenizer)).eval(), tokenizer, rows)
    assert (torch.tensor(got) - torch.tensor(stock)).abs().max() > 1e-2  # the trained embedding is in effect


def test_max_length_is_the_extended_length_from_longpeft_json(tokenizer, base_and_adapter):
    import longpeft

    base_dir, adapter_dir = base_and_adapter
    assert extended_length(adapter_dir) == EXTENDED and extended_length(base_dir) is None
    model = longpeft.load(str(base_dir), adapter_dir)
    assert harness_lm(model, tokenizer, max_length=extended_length(adapter_dir)).max_length == EXTENDED
    assert tiny_model("llama", vocab_size=len(tokenizer)).config.max_position_embeddings == 256


def test_lm_evals_notice_for_a_built_model_does_not_reach_the_user(tokenizer, base_and_adapter, caplog):
    """HFLM logs "`pretrained` model kwarg is not of type `str` ... do not launch via accelerate" for every built
    model: longpeft hands it one by design, so that record is dropped; the logger's other records pass."""
    from lm_eval.models import huggingface

    import longpeft

    base_dir, adapter_dir = base_and_adapter
    filters = list(huggingface.eval_logger.filters)
    with caplog.at_level(logging.WARNING):
        harness_lm(longpeft.load(str(base_dir), adapter_dir), tokenizer)
        huggingface.eval_logger.warning("another lm-eval warning")
    messages = [record.getMessage() for record in caplog.records]
    assert "another lm-eval warning" in messages and not [m for m in messages if "not of type `str`" in m]
    assert huggingface.eval_logger.filters == filters


def test_extended_length_is_the_target_length_when_longer(tokenizer, tmp_path):
    """A method that reads past its positions (Activation Beacon, STRING) records a longer target length."""
    from longpeft.spec import ContextSpec

    config = tiny_model("llama", vocab_size=len(tokenizer)).config
    ContextSpec.from_base(config, "beacon", target_length=4096).save(tmp_path)
    assert extended_length(tmp_path) == 4096


def run_cli(*argv):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["eval", *argv])
    return args.func(args)


def test_cli_prints_the_table_and_writes_the_results(
    tokenizer, base_and_adapter, task_dir, tmp_path, capsys, single_thread
):
    import longpeft

    base_dir, adapter_dir = base_and_adapter
    folder, rows = task_dir
    out = tmp_path / "results" / "harness.json"
    assert (
        run_cli(
            "harness",
            "--model",
            str(base_dir),
            "--adapter",
            str(adapter_dir),
            "--tasks",
            TASK,
            "--include-path",
            str(folder),
            "--limit",
            "4",
            "--batch-size",
            "3",
            "--out",
            str(out),
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert f"|{TASK}|" in printed.replace(" ", "") and f"max_length {EXTENDED}; wrote {out}" in printed
    saved = json.loads(out.read_text())
    reference = direct_loglikelihoods(longpeft.load(str(base_dir), adapter_dir).eval(), tokenizer, rows[:4])
    assert saved["results"][TASK]["acc,none"] == pytest.approx(accuracy(reference, rows[:4]))
    assert saved["longpeft"] == {"max_length": EXTENDED, "tasks": [TASK], "limit": 4}
    assert "samples" not in saved


@pytest.mark.parametrize(
    ("flags", "error", "message"),
    [
        (["--tasks", TASK, "--lengths", "256"], ConfigError, r"--lengths: not used by eval harness"),
        (["--tasks", TASK, "--metadata", "[1]"], ConfigError, r"--metadata must be a JSON object"),
        (["--tasks", TASK, "--metadata", "{x"], ConfigError, r"--metadata is not JSON"),
        ([], ConfigError, r"eval harness needs --tasks"),
    ],
)
def test_cli_refuses_bad_flags_naming_them(base_and_adapter, task_dir, tmp_path, flags, error, message):
    base_dir, _ = base_and_adapter
    with pytest.raises(error, match=message):
        run_cli(
            "harness",
            "--model",
            str(base_dir),
            "--include-path",
            str(task_dir[0]),
            "--out",
            str(tmp_path / "r.json"),
            *flags,
        )


def test_an_unknown_task_is_named(base_and_adapter, task_dir, tmp_path, monkeypatch):
    """The task names are checked against the index before the model runs (an index with lm-eval's own tasks takes
    10-30 s to build: this one holds the local task only)."""
    from types import SimpleNamespace

    from longpeft.eval import harness

    monkeypatch.setattr(
        harness, "task_manager", lambda tasks, include_path, metadata: SimpleNamespace(all_tasks=[TASK])
    )
    base_dir, _ = base_and_adapter
    with pytest.raises(
        ConfigError,
        match=r"--tasks no_such_task: not a task, group or tag of lm-eval nor under "
        r"--include-path .*lm-eval ls tasks",
    ):
        run_cli(
            "harness",
            "--model",
            str(base_dir),
            "--tasks",
            f"{TASK},no_such_task",
            "--include-path",
            str(task_dir[0]),
            "--out",
            str(tmp_path / "r.json"),
        )


def test_cli_refuses_a_folder_as_out_and_harness_flags_elsewhere(base_and_adapter, task_dir, tmp_path):
    base_dir, _ = base_and_adapter
    with pytest.raises(OutputFolderError, match=r"--out .* is a folder; eval harness writes one JSON file"):
        run_cli("harness", "--model", str(base_dir), "--tasks", TASK, "--out", str(tmp_path))
    with pytest.raises(ConfigError, match=r"--tasks, --limit: not used by eval passkey"):
        run_cli("passkey", "--model", str(base_dir), "--tasks", TASK, "--limit", "2", "--out", str(tmp_path))


def test_without_lm_eval_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` raises ImportError
    with pytest.raises(ConfigError, match=r"needs lm-evaluation-harness .*pip install 'longpeft\[eval\]'"):
        import_lm_eval()


def test_a_beacon_model_is_scored_one_request_at_a_time(tokenizer, task_dir, single_thread):
    """lm-eval pads a batch's requests to one length; a beacon model would read a padded request differently from
    the request alone (its windows start at the same index in every row), so --batch-size > 1 is refused first, and
    one request at a time scores each as the direct computation does (windows of 16 tokens: the questions fill 2-4)."""
    from longpeft.adapters.beacon import BeaconConfig, apply_beacon

    folder, rows = task_dir
    model = tiny_model("llama", vocab_size=len(tokenizer), attn_implementation="sdpa")
    apply_beacon(model, BeaconConfig(window=16, ratios=[2], inference_ratios=[2], sink=1).settings())
    with pytest.raises(ConfigError, match=r"--batch-size 2: lm-eval pads .* Activation Beacon .* use --batch-size 1"):
        run_harness(model, tokenizer, [TASK], include_path=folder, batch_size=2)
    results = run_harness(model, tokenizer, [TASK], include_path=folder, log_samples=True)
    got, reference = harness_loglikelihoods(results), direct_loglikelihoods(model, tokenizer, rows)
    assert (torch.tensor(got) - torch.tensor(reference)).abs().max() < 1e-4
