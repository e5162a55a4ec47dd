"""Evaluation runs: an oracle scores 100%, a model that cannot see the needle scores at chance,
heatmaps are written, batching with left padding changes nothing (a beacon model's batches hold prompts of one
length), STRING is switched back off,
memory problems fail early, the CLI works on saved models and adapters."""

from __future__ import annotations

import argparse
import json
import re
import warnings
from types import SimpleNamespace

import pytest
import torch

from longpeft.adapters.string import enable_string, string_settings
from longpeft.errors import ConfigError
from longpeft.eval import InsufficientMemoryError, check_memory, evaluate, niah_grid, passkey_accuracy
from longpeft.eval.cli import register
from longpeft.eval.generation import eos_token_ids, generate_batch, pad_token_id
from longpeft.tiny import tiny_model, train_tokenizer


def greedy_generate(model, tokenizer, prompts, max_new_tokens, batch_size=4):
    """Greedy continuations of token-id ``prompts``, ``batch_size`` at a time, as the eval tasks run them."""
    eos_ids = eos_token_ids(model, tokenizer)
    pad_id = pad_token_id(tokenizer, eos_ids)
    return [
        text
        for start in range(0, len(prompts), batch_size)
        for text in generate_batch(
            model, tokenizer, prompts[start : start + batch_size], max_new_tokens, eos_ids, pad_id
        )
    ]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


class CopyingModel:
    """A stand-in for a causal LM whose ``generate`` reads the needle from the prompt.

    It sees only the last ``visible`` tokens of each prompt (all when None); when the answer is not
    in view it guesses ``digits`` random digits, so its score is chance.
    """

    def __init__(self, tokenizer, visible: int | None = None, digits: int = 1, seed: int = 0, reply: str = " {}."):
        self.tokenizer = tokenizer
        self.reply = reply
        self.visible = visible
        self.digits = digits
        self.rng = torch.Generator().manual_seed(seed)
        self.device = torch.device("cpu")
        self.generation_config = SimpleNamespace(eos_token_id=[tokenizer.eos_token_id, 2])
        self.calls = []

    def answer(self, text: str) -> str | None:
        if match := re.search(r"The pass key is (\d+)\.", text):
            return match.group(1)
        asked = re.search(r"special magic number for ([\w-]+)\?", text)
        if asked and (match := re.search(rf"magic number for {re.escape(asked.group(1))} is: (\d+)\.", text)):
            return match.group(1)
        return None

    def generate(self, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id, **kwargs):
        self.calls.append(
            {
                "batch": input_ids.shape[0],
                "eos": eos_token_id,
                "padded_left": bool((attention_mask[:, 0] == 0).any()),
                "lengths": attention_mask.sum(dim=1).tolist(),
            }
        )
        rows = []
        for ids, mask in zip(input_ids, attention_mask):
            real = ids[mask.bool()].tolist()
            seen = real if self.visible is None else real[-self.visible :]
            found = self.answer(self.tokenizer.decode(seen))
            guess = "".join(str(int(d)) for d in torch.randint(0, 10, (self.digits,), generator=self.rng))
            new = self.tokenizer.encode(self.reply.format(found or guess), add_special_tokens=False) + [
                eos_token_id[-1]
            ]
            new = (new + [pad_token_id] * max_new_tokens)[:max_new_tokens]
            rows.append(torch.cat([ids, torch.tensor(new)]))
        return torch.stack(rows)


def test_oracle_scores_100_percent_and_heatmap_is_written(tokenizer, tmp_path):
    model = CopyingModel(tokenizer)
    result = niah_grid(
        model, tokenizer, lengths=[400, 700], depths=[0.0, 0.5, 1.0], n_samples=3, out_dir=tmp_path, batch_size=4
    )
    assert result["score"] == 1.0
    assert all(cell["score"] == 1.0 and cell["n"] == 3 for cell in result["cells"])
    assert len(result["cells"]) == 6
    png = tmp_path / "niah_single_heatmap.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((tmp_path / "niah_single.json").read_text())
    assert saved["score"] == 1.0 and saved["files"]["heatmap"] == str(png)
    # generation stopped on the *second* eos id of the generation config, and batches were used
    assert all(call["eos"][-1] == 2 for call in model.calls)
    assert max(call["batch"] for call in model.calls) == 4


def test_an_adapter_folder_given_as_model_is_loaded_with_its_longpeft_json(saved_base_and_adapter, tmp_path, capsys):
    """`--model ADAPTER`: the same scores and STRING settings as `--model BASE --adapter ADAPTER`, not the base
    model with the LoRA weights and without longpeft.json's changes."""
    base_dir, adapter_dir = saved_base_and_adapter
    flags = ["--string", "--string-window", "16", "--lengths", "256", "--depths", "0.5", "--samples", "1"]
    assert (
        run_cli(
            "passkey", "--model", str(base_dir), "--adapter", str(adapter_dir), *flags, "--out", str(tmp_path / "pair")
        )
        == 0
    )
    assert run_cli("passkey", "--model", str(adapter_dir), *flags, "--out", str(tmp_path / "alone")) == 0
    assert "is an adapter folder" in capsys.readouterr().err
    pair, alone = (json.loads((tmp_path / name / "passkey.json").read_text()) for name in ("pair", "alone"))
    assert alone["string"] == pair["string"] and alone["string"]["shift"] == 40
    assert alone["samples"] == pair["samples"]
    with pytest.raises(ConfigError, match="pass the base model as --model and the adapter as --adapter"):
        run_cli("passkey", "--model", str(adapter_dir), "--adapter", str(adapter_dir), "--out", str(tmp_path / "x"))


@pytest.mark.parametrize(("task", "length", "visible"), [("passkey", 300, 80), ("niah_single", 500, 160)])
def test_model_that_cannot_see_the_needle_scores_at_chance(tokenizer, task, length, visible):
    # The needle sits at depth 0; the model sees only the last tokens (needle and question when
    # the needle is at the end) and otherwise guesses one digit: chance is 1/10.
    model = CopyingModel(tokenizer, visible=visible, digits=1, seed=1)
    result = evaluate(
        task, model, tokenizer, lengths=[length], n_samples=400, seed=2, depths=[0.0], digits=1, batch_size=50
    )
    assert 0.05 <= result["score"] <= 0.16  # 400 Bernoulli(0.1) draws: mean within ~3.5 sd
    # needles at the end are in view: scored perfectly
    seen = evaluate(task, model, tokenizer, lengths=[length], n_samples=20, depths=[1.0], digits=1)
    assert seen["score"] == 1.0


def test_passkey_accuracy_by_length(tokenizer):
    result = passkey_accuracy(CopyingModel(tokenizer), tokenizer, [256, 400], n_samples=2, seed=0)
    assert result["by_length"] == {"256": 1.0, "400": 1.0} and result["task"] == "passkey"


def test_generation_stops_at_any_eos(tokenizer):
    class Scripted(CopyingModel):
        def generate(self, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id, **kwargs):
            tail = torch.tensor([[70, 71, 2, 72, 73]] * input_ids.shape[0])[:, :max_new_tokens]
            return torch.cat([input_ids, tail], dim=1)

    out = greedy_generate(Scripted(tokenizer), tokenizer, [[10, 11], [12]], max_new_tokens=5)
    assert out == [tokenizer.decode([70, 71])] * 2


@pytest.mark.parametrize("use_string", [False, True])
def test_left_padded_batches_equal_single_prompts(tokenizer, use_string):
    model = tiny_model("llama", vocab_size=len(tokenizer), attn_implementation="sdpa")
    if use_string:
        enable_string(model, shift=50, local_window=8)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(7, 500, (n,), generator=g).tolist() for n in (120, 90, 101)]
    batched = greedy_generate(model, tokenizer, prompts, max_new_tokens=6, batch_size=3)
    single = [greedy_generate(model, tokenizer, [p], max_new_tokens=6, batch_size=1)[0] for p in prompts]
    assert batched == single


def test_batched_probes_of_a_beacon_model_are_scored_as_one_prompt_at_a_time(tokenizer, single_thread):
    """Activation Beacon refuses left padding; the probe grids batch prompts of one length only (none padded), so a
    beacon model's batched evaluation runs and answers each probe as it does alone."""
    from longpeft.adapters.beacon import BeaconConfig, apply_beacon

    model = tiny_model("llama", vocab_size=len(tokenizer), attn_implementation="sdpa")
    apply_beacon(model, BeaconConfig(window=32, ratios=[2, 4], sink=1).settings())
    options = dict(lengths=[160, 200], depths=[0.25, 0.75], n_samples=1, max_new_tokens=4)
    batched = evaluate("passkey", model, tokenizer, batch_size=4, **options)
    alone = evaluate("passkey", model, tokenizer, batch_size=1, **options)
    assert [s["prediction"] for s in batched["samples"]] == [s["prediction"] for s in alone["samples"]]
    assert len({s["length"] for s in batched["samples"]}) == 2


def test_evaluate_on_tiny_model_restores_string_state(tokenizer, tmp_path):
    model = tiny_model("qwen2", vocab_size=len(tokenizer), attn_implementation="sdpa")
    result = evaluate(
        "passkey",
        model,
        tokenizer,
        lengths=[256],
        depths=[0.5],
        n_samples=2,
        string={"shift": 60, "local_window": 8},
        out_dir=tmp_path,
    )
    assert result["string"] == {"shift": 60, "local_window": 8, "trained_length": 256, "cos_sin_scale": None}
    assert string_settings(model) is None
    enable_string(model, shift=100, local_window=4)
    evaluate("topic_retrieval", model, tokenizer, lengths=[700], n_samples=1, string={"shift": 70, "local_window": 8})
    assert string_settings(model)["shift"] == 100  # the earlier settings are back
    assert 0.0 <= result["score"] <= 1.0 and len(result["samples"]) == 2
    assert (tmp_path / "passkey_heatmap.png").exists()


def test_ruler_runs_all_tasks(tokenizer, tmp_path):
    model = CopyingModel(tokenizer)
    result = evaluate("ruler", model, tokenizer, lengths=[1500], n_samples=1, depths=[0.5], out_dir=tmp_path)
    assert set(result["tasks"]) == {
        "niah_single",
        "niah_multikey",
        "niah_multivalue",
        "niah_multiquery",
        "variable_tracking",
        "common_words",
    }
    assert result["tasks"]["niah_single"]["score"] == 1.0 and result["tasks"]["niah_multikey"]["score"] == 1.0
    assert (tmp_path / "ruler.json").exists() and (tmp_path / "variable_tracking_by_length.png").exists()


def test_memory_estimate_fails_early_with_the_need(tokenizer):
    model = tiny_model("llama", vocab_size=len(tokenizer))  # eager: full score matrices
    assert check_memory(model, 1, 256) > 0
    with pytest.raises(InsufficientMemoryError, match=r"needs about [0-9.]+ GiB"):
        evaluate("passkey", model, tokenizer, lengths=[3_000_000], n_samples=1)


def test_cli_on_saved_model_and_adapter(tokenizer, tmp_path, capsys):
    from peft import LoraConfig, get_peft_model

    from longpeft.spec import ContextSpec

    base_dir, adapter_dir = tmp_path / "base", tmp_path / "adapter"
    model = tiny_model("llama", vocab_size=len(tokenizer), attn_implementation="sdpa")
    model.save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    peft_model.save_pretrained(adapter_dir)
    ContextSpec.from_base(model.config, "rope", base_model=str(base_dir)).save(adapter_dir)

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    common = ["--lengths", "256", "--depths", "0.5", "--samples", "1", "--batch-size", "1"]
    args = parser.parse_args(["eval", "passkey", "--model", str(base_dir), "--out", str(tmp_path / "a"), *common])
    assert args.func(args) == 0
    args = parser.parse_args(
        [
            "eval",
            "niah",
            "--model",
            str(base_dir),
            "--adapter",
            str(adapter_dir),
            "--string",
            "--string-window",
            "16",
            "--out",
            str(tmp_path / "b"),
            *common,
            "--depths",
            "0.0",
            "1.0",
        ]
    )
    assert args.func(args) == 0
    saved = json.loads((tmp_path / "b" / "niah_single.json").read_text())
    assert saved["string"]["local_window"] == 16 and saved["string"]["shift"] == 256 // 3
    assert (tmp_path / "b" / "niah_single_heatmap.png").exists()
    assert '"task": "niah_single"' in capsys.readouterr().out


def test_chat_replies_in_their_own_words_score(tokenizer):
    # "The pass key is 60494." is right in a chat reply; a plain continuation must start with the answer.
    model = CopyingModel(tokenizer, reply="The pass key is {}.")
    common = dict(lengths=[400], depths=[0.0, 1.0], n_samples=2)
    chat = evaluate("passkey", model, tokenizer, chat=True, **common)
    assert chat["metric"] == "contains" and chat["score"] == 1.0
    plain = evaluate("passkey", model, tokenizer, **common)
    assert plain["metric"] == "exact" and plain["score"] == 0.0


def test_samples_keep_the_needle_position_and_optionally_the_prompt(tokenizer, tmp_path):
    from longpeft.eval.registry import make_probes

    grid = dict(lengths=[300, 400], depths=[0.0, 1.0], n_samples=1, seed=4)
    result = evaluate("passkey", CopyingModel(tokenizer), tokenizer, **grid)
    assert all("prompt" not in s for s in result["samples"])  # off by default: prompts are large
    result = evaluate("passkey", CopyingModel(tokenizer), tokenizer, save_prompts=True, out_dir=tmp_path, **grid)
    probes = make_probes("passkey", tokenizer, grid["lengths"], grid["depths"], n_samples=1, seed=4)
    saved = json.loads((tmp_path / "passkey.json").read_text())["samples"]
    for sample, probe in zip(saved, probes):
        (position,) = sample["needle_positions"]
        assert sample["depth"] == probe.depth and sample["prompt"] == tokenizer.decode(probe.input_ids)
        key = sample["answers"][0]
        assert tokenizer.decode(probe.input_ids[position:]).startswith(f" The pass key is {key}.")


def test_batches_hold_one_length_and_the_cost_is_announced(tokenizer, capsys):
    model = CopyingModel(tokenizer)
    evaluate("passkey", model, tokenizer, lengths=[300, 400], depths=[0.5], n_samples=3, batch_size=2)
    assert [call["lengths"] for call in model.calls] == [[400, 400], [400], [300, 300], [300]]
    err = capsys.readouterr().err
    assert re.search(r"passkey: 6 prompts of 300-400 tokens in 4 batches .*2,100 prompt tokens", err), err
    assert re.search(r"forward passes", err) and re.search(r"first batch \(2 x 400 tokens\) took .* about", err), err


def test_warns_once_when_prompts_exceed_the_model_positions(tokenizer):
    model = tiny_model("llama", vocab_size=len(tokenizer), attn_implementation="sdpa")  # 256 positions
    common = dict(depths=[0.5], n_samples=1, max_new_tokens=1)
    with pytest.warns(UserWarning, match=r"300, 320 tokens .* max_position_embeddings=256") as caught:
        evaluate("passkey", model, tokenizer, lengths=[200, 300, 320], **common)
    assert len([w for w in caught if "max_position_embeddings" in str(w.message)]) == 1
    with warnings.catch_warnings():  # STRING keeps every distance inside the trained range: no warning
        warnings.simplefilter("error")
        evaluate("passkey", model, tokenizer, lengths=[300], string={"shift": 100, "local_window": 8}, **common)
    with pytest.warns(UserWarning, match=r"400 tokens .* max_position_embeddings=256 even with string on"):
        evaluate("passkey", model, tokenizer, lengths=[400], string={"shift": 100, "local_window": 8}, **common)


def test_model_span_counts_string_positions_but_every_key():
    """STRING bounds the positions (largest scored distance + 1), not the keys a query reads (the memory check)."""
    from longpeft.adapters import ModelSpan, model_span
    from longpeft.adapters.string import disable_string, enable_string

    model = tiny_model("llama", attn_implementation="sdpa")
    assert model_span(model, 400) == ModelSpan(400, 400, ())
    enable_string(model, shift=100, local_window=8)
    assert model_span(model, 400) == ModelSpan(400 - 100 + 8, 400, ("string",))
    assert model_span(model, 60) == ModelSpan(60, 60, ("string",))  # shorter than the shift: nothing moves
    disable_string(model)
    assert model_span(model, 400).methods == ()


@pytest.fixture(scope="module")
def saved_base_and_adapter(tokenizer, tmp_path_factory):
    """A tiny base (256 positions) and a LoRA adapter whose longpeft.json says it was trained at 120 tokens."""
    from peft import LoraConfig, get_peft_model

    from longpeft.spec import ContextSpec

    folder = tmp_path_factory.mktemp("saved")
    base_dir, adapter_dir = folder / "base", folder / "adapter"
    model = tiny_model("llama", vocab_size=len(tokenizer), attn_implementation="sdpa")
    model.save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(adapter_dir)
    ContextSpec.from_base(model.config, "rope", base_model=str(base_dir), trained_length=120).save(adapter_dir)
    return base_dir, adapter_dir


def run_cli(*argv):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["eval", *argv])
    return args.func(args)


def test_cli_string_shift_defaults_to_the_adapters_trained_length(saved_base_and_adapter, tmp_path):
    base_dir, adapter_dir = saved_base_and_adapter
    assert (
        run_cli(
            "passkey",
            "--model",
            str(base_dir),
            "--adapter",
            str(adapter_dir),
            "--string",
            "--string-window",
            "16",
            "--lengths",
            "256",
            "--depths",
            "0.5",
            "--samples",
            "1",
            "--save-prompts",
            "--out",
            str(tmp_path),
        )
        == 0
    )
    saved = json.loads((tmp_path / "passkey.json").read_text())
    assert saved["string"]["trained_length"] == 120 and saved["string"]["shift"] == 40  # not 256 // 3
    assert "What is the pass key?" in saved["samples"][0]["prompt"]


def test_string_defaults_to_the_same_trained_length_for_an_adapter_and_its_merged_model(
    saved_base_and_adapter, tmp_path
):
    """The merged model's folder carries the adapter's longpeft.json (trained at 120 tokens; 256 positions): STRING's
    default L and S are read from it, from the CLI and from Python, as they are for base + adapter."""
    from transformers import AutoModelForCausalLM

    import longpeft
    from longpeft import hub
    from longpeft.adapters.string import enable_string

    base_dir, adapter_dir = saved_base_and_adapter
    hub.merge(adapter_dir, tmp_path / "merged", verify=False)
    common = ["passkey", "--string", "--string-window", "16", "--lengths", "256", "--depths", "0.5", "--samples", "1"]
    run_cli(*common, "--model", str(base_dir), "--adapter", str(adapter_dir), "--out", str(tmp_path / "adapter"))
    run_cli(*common, "--model", str(tmp_path / "merged"), "--out", str(tmp_path / "merged-eval"))
    settings = [
        json.loads((tmp_path / name / "passkey.json").read_text())["string"] for name in ("adapter", "merged-eval")
    ]
    assert settings[0] == settings[1] and (settings[0]["trained_length"], settings[0]["shift"]) == (120, 40)

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    on_adapter = enable_string(longpeft.load(str(base_dir), adapter_dir), local_window=16)
    assert enable_string(merged, local_window=16) == on_adapter and on_adapter["shift"] == 40
    assert enable_string(tiny_model("llama"), local_window=16)["shift"] == 256 // 3  # no longpeft.json: the positions


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--string", "--string-window", "0"], r"--string-window: must be >= 1, got 0"),
        (["--max-new-tokens", "0"], r"--max-new-tokens: must be >= 1, got 0"),
        (["--string", "--string-shift", "0"], r"--string-shift: must be >= 1, got 0"),
    ],
)
def test_cli_rejects_bad_numbers_naming_the_flag(saved_base_and_adapter, tmp_path, capsys, flags, message):
    base_dir, _ = saved_base_and_adapter
    with pytest.raises(SystemExit):
        run_cli("passkey", "--model", str(base_dir), "--lengths", "256", "--out", str(tmp_path), *flags)
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--string", "--string-shift", "40", "--string-window", "64"], r"--string-window 64 .*--string-shift 40"),
        (["--string", "--string-shift", "256"], r"--string-shift 256 .*longest prompt \(--lengths\) has 256 tokens"),
        (["--string"], r"--string-window 128 .*shift 40 = trained length 120 // 3 \(from the adapter's longpeft.json"),
        (["--string-shift", "40"], r"--string-shift needs --string"),
    ],
)
def test_cli_rejects_bad_string_settings_naming_the_flag(saved_base_and_adapter, tmp_path, flags, message):
    base_dir, adapter_dir = saved_base_and_adapter
    with pytest.raises(ValueError, match=message) as error:
        run_cli(
            "passkey",
            "--model",
            str(base_dir),
            "--adapter",
            str(adapter_dir),
            "--lengths",
            "256",
            "--out",
            str(tmp_path),
            *flags,
        )
    assert "local_window" not in str(error.value)


@pytest.mark.parametrize(
    ("task", "flags", "message"),
    [
        (
            "perplexity",
            ["--text", "t.txt", "--chat", "--depths", "0.5"],
            r"--depths, --chat: not used by eval perplexity",
        ),
        (
            "passkey",
            ["--text", "t.txt", "--window", "64"],
            r"--text, --window: not used by eval passkey \(its own flags",
        ),
        (
            "common_words",
            ["--depths", "0.5"],
            r"--depths: not used by eval common_words \(its prompts have no needle depth",
        ),
    ],
)
def test_cli_refuses_flags_the_task_does_not_use(saved_base_and_adapter, tmp_path, task, flags, message):
    base_dir, _ = saved_base_and_adapter
    with pytest.raises(ValueError, match=message):
        run_cli(task, "--model", str(base_dir), "--out", str(tmp_path), *flags)


def test_cli_refuses_an_unknown_dtype(saved_base_and_adapter, tmp_path, capsys):
    base_dir, _ = saved_base_and_adapter
    with pytest.raises(SystemExit):
        run_cli("passkey", "--model", str(base_dir), "--dtype", "bf16", "--out", str(tmp_path))
    assert "--dtype: invalid choice: 'bf16'" in capsys.readouterr().err


def test_greedy_ignores_the_decoding_settings_a_model_ships(tokenizer):
    """A saved repetition penalty (some instruct models ship one), banned n-grams or beams must not change what
    a probe's answer is scored on."""
    model = tiny_model("llama", vocab_size=len(tokenizer)).eval()
    prompts = [list(range(3, 43)), list(range(50, 80))]
    plain = greedy_generate(model, tokenizer, prompts, 16)
    config = model.generation_config
    config.repetition_penalty, config.no_repeat_ngram_size, config.num_beams, config.bad_words_ids = 4.0, 2, 3, [[7]]
    assert greedy_generate(model, tokenizer, prompts, 16) == plain


def test_the_string_a_model_runs_is_reported(tokenizer):
    """STRING an adapter's longpeft.json (or a merged model) switched on is in the result, not only --string's."""
    model = tiny_model("llama", vocab_size=len(tokenizer)).eval()
    settings = enable_string(model, shift=100, local_window=8)
    result = evaluate("passkey", model, tokenizer, lengths=[200], depths=[0.5], n_samples=1)
    assert result["string"] == settings == string_settings(model)


def test_a_grid_is_counted_once_per_cell_and_batched_as_it_runs(tokenizer):
    from longpeft.eval.tasks import build_probe_grid

    grid = build_probe_grid("passkey", tokenizer, [300, 300], depths=[0.5, 0.5], n_samples=2)
    assert grid.lengths == [300] and len(grid.probes) == 2 and grid.largest_batch(4) == 2
    result = evaluate(
        "passkey", CopyingModel(tokenizer), tokenizer, lengths=[300, 300], depths=[0.5, 0.5], n_samples=2
    )
    assert [cell["n"] for cell in result["cells"]] == [2]


def test_ruler_builds_every_task_before_generating(tokenizer, tmp_path):
    """common_words needs the longest prompt of the six: a length too short for it fails before any generation,
    instead of after five tasks' work was done and thrown away."""
    model = CopyingModel(tokenizer)
    with pytest.raises(ValueError, match=r"too short for .* common words.*--lengths"):
        evaluate("ruler", model, tokenizer, lengths=[400], n_samples=1, depths=[0.5], out_dir=tmp_path)
    assert model.calls == [] and not list(tmp_path.iterdir())
    result = evaluate("ruler", model, tokenizer, lengths=[700], n_samples=1, depths=[0.5], out_dir=tmp_path)
    assert {f.name for f in tmp_path.glob("*.json")} == {f"{t}.json" for t in result["tasks"]} | {"ruler.json"}


def test_string_true_on_a_loaded_adapter_uses_its_trained_length(tokenizer, tmp_path):
    """`evaluate(longpeft.load(...), string=True)`: S = trained_length // 3, not max_positions // 3."""
    import longpeft
    from longpeft.eval.tasks import string_enabled
    from longpeft.spec import ContextSpec

    model = tiny_model("llama", vocab_size=len(tokenizer))
    base_dir, adapter_dir = tmp_path / "base", tmp_path / "adapter"
    model.save_pretrained(base_dir)
    from peft import LoraConfig, get_peft_model

    get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(adapter_dir)
    ContextSpec.from_base(
        model.config,
        "rope",
        base_model=str(base_dir),
        trained_length=600,
        methods={"rope": {**model.config.rope_parameters, "max_position_embeddings": 1024}},
    ).save(adapter_dir)
    loaded = longpeft.load(str(base_dir), adapter_dir)
    with string_enabled(loaded, True) as settings:
        assert (settings["trained_length"], settings["shift"]) == (600, 200)
    assert enable_string(loaded)["shift"] == 200  # the Python API's default is the CLI's (trained length // 3)
