"""Evaluation runs: an oracle scores 100%, a model that cannot see the needle scores at chance,
heatmaps are written, batching with left padding changes nothing, STRING is switched back off,
memory problems fail early, the CLI works on saved models and adapters."""

from __future__ import annotations

import argparse
import json
import re
from types import SimpleNamespace

import pytest
import torch

from longpeft.adapters.string import enable_string, string_settings
from longpeft.eval import InsufficientMemoryError, check_memory, evaluate, niah_grid, passkey_accuracy
from longpeft.eval.cli import register
from longpeft.eval.generation import greedy_generate
from longpeft.tiny import tiny_model, train_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


class CopyingModel:
    """A stand-in for a causal LM whose ``generate`` reads the needle from the prompt.

    It sees only the last ``visible`` tokens of each prompt (all when None); when the answer is not
    in view it guesses ``digits`` random digits, so its score is chance.
    """

    def __init__(self, tokenizer, visible: int | None = None, digits: int = 1, seed: int = 0):
        self.tokenizer = tokenizer
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
        self.calls.append({"batch": input_ids.shape[0], "eos": eos_token_id, "padded_left": bool((attention_mask[:, 0] == 0).any())})
        rows = []
        for ids, mask in zip(input_ids, attention_mask):
            real = ids[mask.bool()].tolist()
            seen = real if self.visible is None else real[-self.visible :]
            found = self.answer(self.tokenizer.decode(seen))
            guess = "".join(str(int(d)) for d in torch.randint(0, 10, (self.digits,), generator=self.rng))
            new = self.tokenizer.encode(" " + (found or guess) + ".", add_special_tokens=False) + [eos_token_id[-1]]
            new = (new + [pad_token_id] * max_new_tokens)[:max_new_tokens]
            rows.append(torch.cat([ids, torch.tensor(new)]))
        return torch.stack(rows)


def test_oracle_scores_100_percent_and_heatmap_is_written(tokenizer, tmp_path):
    model = CopyingModel(tokenizer)
    result = niah_grid(model, tokenizer, lengths=[400, 700], depths=[0.0, 0.5, 1.0], n_samples=3, out_dir=tmp_path, batch_size=4)
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


@pytest.mark.parametrize(("task", "length", "visible"), [("passkey", 300, 80), ("niah_single", 500, 160)])
def test_model_that_cannot_see_the_needle_scores_at_chance(tokenizer, task, length, visible):
    # The needle sits at depth 0; the model sees only the last tokens (needle and question when
    # the needle is at the end) and otherwise guesses one digit: chance is 1/10.
    model = CopyingModel(tokenizer, visible=visible, digits=1, seed=1)
    result = evaluate(task, model, tokenizer, lengths=[length], n_samples=400, seed=2, depths=[0.0], digits=1, batch_size=50)
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


def test_evaluate_on_tiny_model_restores_string_state(tokenizer, tmp_path):
    model = tiny_model("qwen2", vocab_size=len(tokenizer), attn_implementation="sdpa")
    result = evaluate(
        "passkey", model, tokenizer, lengths=[256], depths=[0.5], n_samples=2,
        string={"shift": 60, "local_window": 8}, out_dir=tmp_path,
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
        "niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "variable_tracking", "common_words",
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
    ContextSpec.from_base(model.config, "rope_base", base_model=str(base_dir)).save(adapter_dir)

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    common = ["--lengths", "256", "--depths", "0.5", "--samples", "1", "--batch-size", "1"]
    args = parser.parse_args(["eval", "passkey", "--model", str(base_dir), "--out", str(tmp_path / "a"), *common])
    assert args.func(args) == 0
    args = parser.parse_args(
        ["eval", "niah", "--model", str(base_dir), "--adapter", str(adapter_dir), "--string",
         "--string-window", "16", "--out", str(tmp_path / "b"), *common, "--depths", "0.0", "1.0"]
    )
    assert args.func(args) == 0
    saved = json.loads((tmp_path / "b" / "niah_single.json").read_text())
    assert saved["string"]["local_window"] == 16 and saved["string"]["shift"] == 256 // 3
    assert (tmp_path / "b" / "niah_single_heatmap.png").exists()
    assert '"task": "niah_single"' in capsys.readouterr().out


def test_demo_report_rows(tokenizer, tmp_path, monkeypatch):
    from peft import LoraConfig, get_peft_model

    from longpeft.eval import demo_report
    from longpeft.spec import ContextSpec

    monkeypatch.setattr(demo_report, "PASSKEY_LENGTHS", (256, 400))  # fewer, shorter prompts than the demo
    monkeypatch.setattr(demo_report, "NIAH_LENGTHS", (512,))
    monkeypatch.setattr(demo_report, "RETRIEVAL_CONTEXT_TOKENS", (120,))

    model = tiny_model("llama", vocab_size=len(tokenizer), attn_implementation="sdpa")
    model.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    adapter_dir = tmp_path / "adapter"
    get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(adapter_dir)
    tokenizer.save_pretrained(adapter_dir)
    ContextSpec.from_base(model.config, "rope_base", base_model=str(tmp_path / "base")).save(adapter_dir)
    rows = demo_report.retrieval_report(tmp_path, adapter_dir, n_samples=1)
    settings = {"base", "base + STRING", "adapter", "adapter + STRING"}
    assert {r["setting"] for r in rows} == settings
    assert {r["task"] for r in rows} == {"passkey", "niah_single", "retrieval"}
    assert len(rows) == 4 * (2 + 1 + 1) and all(0.0 <= r["score"] <= 1.0 for r in rows)
    assert (tmp_path / "eval" / "adapter_STRING" / "niah_single_heatmap.png").exists()
