"""``model.init_from``: a run that starts from an earlier run's trained weights (Activation Beacon's pretraining then
fine-tuning; a second LoRA stage). The weights before the first step equal the earlier adapter's files, read here
with safetensors directly; what cannot be continued is refused with the reason."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from longpeft.adapters.beacon import WEIGHTS_FILENAME, beacon_parameters
from longpeft.recipes.runner import prepare, run
from longpeft.recipes.schema import load_recipe
from longpeft.spec import SpecMismatchError

# compat: also run by `make test-compat` (transformers 5.17, trl 1.15, datasets 4)
pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.compat]


def _text_jsonl(path, n=6, words=120):
    """Plain-text documents (the pretraining stage reads text, loss on every token)."""
    vocabulary = "the river city report market north south garden harbor station".split()
    with path.open("w") as f:
        for i in range(n):
            f.write(
                json.dumps({"text": " ".join(vocabulary[(i + j * 7) % len(vocabulary)] for j in range(words))}) + "\n"
            )
    return path


def _beacon(base, data, out, *overrides):
    return load_recipe(
        "tiny-beacon-cpu",
        [
            f"model.name_or_path={base}",
            f"data.source={data}",
            "data.max_length=256",
            f"output_dir={out}",
            "beacon.window=16",
            "train.max_steps=2",
            "train.per_device_batch_size=1",
            "train.global_batch_size=1",
            "train.learning_rate=0.02",
            "train.save_steps=100",
            *overrides,
        ],
    )


def _lora(base, data, out, *overrides):
    return load_recipe(
        "tiny-cpu",
        [
            f"model.name_or_path={base}",
            f"data.source={data}",
            "data.max_length=256",
            f"output_dir={out}",
            "train.max_steps=2",
            "train.global_batch_size=1",
            "train.per_device_batch_size=1",
            "train.save_steps=100",
            "lora.r=2",
            "lora.embeddings=full",
            *overrides,
        ],
    )


@pytest.fixture(scope="module")
def beacon_pretrained(tiny_base_dirs, tmp_path_factory):
    """A finished beacon pretraining stage on plain text (ratios up to 16, as the authors' up to 32)."""
    root = tmp_path_factory.mktemp("pretrain")
    data = _text_jsonl(root / "text.jsonl")
    recipe = _beacon(tiny_base_dirs("llama"), data, root / "pretrain", "data.format=text", "beacon.ratios=[2,4,8,16]")
    return run(recipe)


@pytest.fixture(scope="module")
def lora_stage(tiny_base_dirs, tmp_path_factory):
    from conftest import write_chat_jsonl

    root = tmp_path_factory.mktemp("lora-stage")
    return run(_lora(tiny_base_dirs("llama"), write_chat_jsonl(root / "chat.jsonl"), root / "stage1"))


def test_finetune_starts_from_the_pretrained_beacons_and_records_what_changed(
    beacon_pretrained, tiny_base_dirs, chat_jsonl, tmp_path
):
    saved = load_file(beacon_pretrained.adapter_dir / WEIGHTS_FILENAME)
    recipe = _beacon(
        tiny_base_dirs("llama"), chat_jsonl, tmp_path / "finetune", f"model.init_from={beacon_pretrained.output_dir}"
    )  # the run folder: its adapter/ is found
    prepared = prepare(recipe)
    own = beacon_parameters(prepared.trainer.model)
    assert len(own) == len(saved)
    for name, parameter in own.items():
        torch.testing.assert_close(parameter.detach().cpu(), saved[f"model.{name}"], rtol=0, atol=0)
    fresh = beacon_parameters(prepare(_beacon(tiny_base_dirs("llama"), chat_jsonl, tmp_path / "fresh")).trainer.model)
    assert any(not torch.equal(fresh[n], own[n]) for n in own)  # the copy is not what a fresh run starts from
    start = prepared.resolved["init_from"]
    assert start["weights"] == "method" and start["folder"] == str(beacon_pretrained.adapter_dir)
    assert start["changed_method_settings"]["beacon"]["ratios"] == [[2, 4, 8, 16], [2, 4, 8]]

    finished = run(recipe)  # and it trains on from there
    assert finished.metrics["steps"] == 2
    assert json.loads((finished.output_dir / "recipe.resolved.json").read_text())["init_from"] == start


def test_a_second_lora_stage_starts_from_the_first_stages_lora_and_embedding(
    lora_stage, tiny_base_dirs, chat_jsonl, tmp_path
):
    from peft import get_peft_model_state_dict

    saved = load_file(lora_stage.adapter_dir / "adapter_model.safetensors")
    prepared = prepare(
        _lora(
            tiny_base_dirs("llama"),
            chat_jsonl,
            tmp_path / "stage2",
            f"model.init_from={lora_stage.adapter_dir}",
            "train.learning_rate=0.0001",
        )
    )
    state = get_peft_model_state_dict(prepared.trainer.model)
    assert (
        state.keys() == saved.keys() and any("lora_A" in k for k in saved) and any("embed_tokens" in k for k in saved)
    )
    for name, tensor in saved.items():
        torch.testing.assert_close(state[name].float().cpu(), tensor.float(), rtol=0, atol=0)
    assert prepared.resolved["init_from"]["weights"] == "lora"


def test_what_cannot_be_continued_is_refused_with_the_reason(
    beacon_pretrained, lora_stage, tiny_base_dirs, chat_jsonl, tmp_path
):
    base = tiny_base_dirs("llama")
    with pytest.raises(FileNotFoundError, match=r"model.init_from .*missing: no such folder.*train that stage first"):
        prepare(_beacon(base, chat_jsonl, tmp_path / "a", f"model.init_from={tmp_path / 'missing'}"))
    with pytest.raises(FileNotFoundError, match=r"model.init_from: .*lora-stage0 has no longpeft.json"):
        prepare(_beacon(base, chat_jsonl, tmp_path / "a", f"model.init_from={lora_stage.output_dir.parent}"))
    with pytest.raises(ValueError, match=r"methods with weights \(beacon\) are not this recipe's \(none\).*dropped"):
        prepare(_lora(base, chat_jsonl, tmp_path / "b", f"model.init_from={beacon_pretrained.adapter_dir}"))
    with pytest.raises(ValueError, match=r"methods with weights \(none\) are not this recipe's \(beacon\).*scratch"):
        prepare(
            _beacon(
                base,
                chat_jsonl,
                tmp_path / "c",
                f"model.init_from={lora_stage.adapter_dir}",
                "finetune=lora",
                "lora.r=2",
            )
        )
    with pytest.raises(ValueError, match=r"lora.r, lora.target_modules, lora.embeddings must match"):
        prepare(_lora(base, chat_jsonl, tmp_path / "d", f"model.init_from={lora_stage.adapter_dir}", "lora.r=4"))
    with pytest.raises(ValueError, match=r"missing \[.*gate_proj.lora_A"):
        prepare(
            _lora(
                base,
                chat_jsonl,
                tmp_path / "e",
                f"model.init_from={lora_stage.adapter_dir}",
                "lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj]",
            )
        )
    with pytest.raises(SpecMismatchError, match="does not fit the base model"):
        prepare(
            _lora(tiny_base_dirs("qwen2"), chat_jsonl, tmp_path / "f", f"model.init_from={lora_stage.adapter_dir}")
        )

    whole = tmp_path / "whole"
    shutil.copytree(lora_stage.adapter_dir, whole)
    spec = json.loads((whole / "longpeft.json").read_text())
    (whole / "longpeft.json").write_text(json.dumps({**spec, "weights": "merged"}))
    with pytest.raises(ValueError, match=r"holds a whole model \(merged\).*model.name_or_path"):
        prepare(_lora(base, chat_jsonl, tmp_path / "g", f"model.init_from={whole}"))
