"""train.backend: unsloth, without unsloth or a GPU: the refusal when it cannot run, and the whole backend
(RoPE through the config, the rotary check, LoRA, the adapter folder) against a stand-in FastLanguageModel
that behaves like unsloth 2026.10's: once keeping the requested RoPE, once stacking its linear scaling."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from longpeft.cli import main
from longpeft.errors import ConfigError
from longpeft.recipes import unsloth_backend
from longpeft.recipes.runner import run
from longpeft.recipes.schema import RecipeError, load_recipe
from longpeft.rope import RotaryMismatch, check_rotary_frequencies, set_rope_parameters
from longpeft.tiny import tiny_model

pytestmark = pytest.mark.compat


class StandInFastLanguageModel:
    """unsloth's FastLanguageModel API on CPU. ``from_pretrained(model_name, config=, max_seq_length=, ...)``
    returns ``(model, tokenizer)``; ``get_peft_model(model, r=, ...)`` returns a peft model.

    With ``reads_checkpoint_config`` it decides, as unsloth does, that the model needs linear "kaiokendev"
    scaling when ``max_seq_length`` exceeds ``max_position_embeddings``, but reads that from the checkpoint
    instead of the config it was given, and installs unsloth's linear rotary: ``inv_freq`` unchanged,
    positions divided by ``scaling_factor``.
    """

    reads_checkpoint_config = False
    calls: list[dict] = []

    @classmethod
    def from_pretrained(
        cls,
        model_name,
        max_seq_length=None,
        dtype=None,
        load_in_4bit=True,
        config=None,
        use_gradient_checkpointing="unsloth",
        random_state=3407,
        **kwargs,
    ):
        cls.calls.append({"config": config, "max_seq_length": max_seq_length, "load_in_4bit": load_in_4bit, **kwargs})
        model = AutoModelForCausalLM.from_pretrained(model_name, config=config, dtype=dtype)
        positions = config.max_position_embeddings
        if cls.reads_checkpoint_config:
            positions = json.loads((Path(model_name) / "config.json").read_text())["max_position_embeddings"]
        if max_seq_length > positions:
            rotary = model.model.rotary_emb
            rotary.scaling_factor = max_seq_length / positions
            forward = rotary.forward
            rotary.forward = lambda x, position_ids, **kw: forward(x, position_ids / rotary.scaling_factor, **kw)
        return model, AutoTokenizer.from_pretrained(model_name)

    @staticmethod
    def get_peft_model(
        model, r, lora_alpha, lora_dropout, target_modules, modules_to_save, use_gradient_checkpointing, random_state
    ):
        from peft import LoraConfig, get_peft_model

        if use_gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.enable_input_require_grads()
        config = LoraConfig(
            r=r,
            lora_alpha=lora_alpha,
            lora_dropout=lora_dropout,
            target_modules=target_modules,
            modules_to_save=modules_to_save,
            task_type="CAUSAL_LM",
        )
        return get_peft_model(model, config)


def unsloth_recipe(base_dir, data_path, out_dir, *extra):
    return load_recipe(
        "tiny-cpu",
        [
            f"model.name_or_path={base_dir}",
            f"data.source={data_path}",
            "data.max_length=512",
            "rope.max_position_embeddings=1024",
            f"output_dir={out_dir}",
            "lora.r=4",
            "train.max_steps=2",
            "train.save_steps=2",
            "train.per_device_batch_size=1",
            "train.global_batch_size=1",
            "train.backend=unsloth",
            *extra,
        ],
    )


@pytest.fixture
def stand_in(monkeypatch):
    StandInFastLanguageModel.calls = []
    monkeypatch.setattr(StandInFastLanguageModel, "reads_checkpoint_config", False)
    monkeypatch.setattr(unsloth_backend, "fast_language_model", lambda: StandInFastLanguageModel)
    return StandInFastLanguageModel


@pytest.mark.skipif(importlib.util.find_spec("unsloth") is not None, reason="unsloth is installed here")
def test_missing_unsloth_is_one_line_naming_the_key_and_the_install(tmp_path, capsys):
    code = main(["train", "tiny-cpu", "--set", "train.backend=unsloth", "--set", f"output_dir={tmp_path / 'run'}"])
    assert code == 2
    message = capsys.readouterr().err.splitlines()[0]
    assert "train.backend: unsloth" in message and "pip install -r requirements-gpu-unsloth.txt" in message
    assert not (tmp_path / "run" / "adapter").exists()


def test_no_cuda_is_refused_even_with_unsloth_installed(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "unsloth" else real(name, *a)
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="train.backend: unsloth needs a CUDA GPU"):
        unsloth_backend.fast_language_model()


def test_unsupported_settings_are_refused_naming_the_backend():
    with pytest.raises(
        RecipeError,
        match=r"train.backend: unsloth does not support harpe \(unsloth replaces the "
        "attention forward that rotates with HARPE's per-head bases",
    ):
        load_recipe("tiny-harpe-cpu", ["train.backend=unsloth"])
    with pytest.raises(RecipeError, match="train.activation_offloading"):
        load_recipe("tiny-cpu", ["train.backend=unsloth", "train.activation_offloading=true"])
    with pytest.raises(RecipeError, match="train.backend"):
        load_recipe("tiny-cpu", ["train.backend=deepspeed"])


def test_unsloth_backend_gets_the_rope_through_the_config_and_writes_the_default_adapter_folder(
    stand_in, tiny_base_dirs, chat_jsonl, tmp_path
):
    import longpeft

    base = tiny_base_dirs("llama")  # trained positions 256, base 1e4
    result = run(unsloth_recipe(base, chat_jsonl, tmp_path / "unsloth"))
    (call,) = stand_in.calls
    assert call["config"].rope_parameters["rope_theta"] == 1e6 and call["max_seq_length"] == 512
    assert call["config"].max_position_embeddings == 1024 >= call["max_seq_length"]  # so unsloth adds no scaling
    resolved = json.loads((result.output_dir / "recipe.resolved.json").read_text())
    assert resolved["backend"] == "unsloth" and resolved["lora"]["r"] == 4
    assert resolved["lora"]["modules_to_save"] == ["model.embed_tokens"]
    assert call["use_exact_model_name"] is True  # not unsloth's pre-quantized mirror of the base

    default = run(unsloth_recipe(base, chat_jsonl, tmp_path / "default", "train.backend=transformers"))
    files = {p.name for p in result.adapter_dir.iterdir()}
    assert (
        files == {p.name for p in default.adapter_dir.iterdir()}
        and {"adapter_model.safetensors", "longpeft.json"} <= files
    )
    spec, default_spec = (
        json.loads((d / "longpeft.json").read_text()) for d in (result.adapter_dir, default.adapter_dir)
    )
    assert spec["methods"] == default_spec["methods"] and spec["methods"]["rope"]["rope_theta"] == 1e6
    loaded = longpeft.load(None, result.adapter_dir)
    check_rotary_frequencies(loaded, loaded.config)
    assert loaded.config.rope_parameters["rope_theta"] == 1e6


def test_stacked_linear_scaling_is_refused_before_training(
    stand_in, monkeypatch, tiny_base_dirs, chat_jsonl, tmp_path
):
    monkeypatch.setattr(stand_in, "reads_checkpoint_config", True)  # 512 > the checkpoint's 256 positions: x2
    with pytest.raises(
        RotaryMismatch,
        match=r"train.backend: unsloth changed the RoPE after FastLanguageModel"
        r".from_pretrained .*positions scaled by 2\b",
    ):
        run(unsloth_recipe(tiny_base_dirs("llama"), chat_jsonl, tmp_path / "run"))
    assert not (tmp_path / "run" / "adapter").exists() and not (tmp_path / "run" / "checkpoints").exists()


def test_rotary_check_compares_effective_frequencies_and_attention_scaling():
    model = tiny_model("llama")
    check_rotary_frequencies(model, model.config)
    set_rope_parameters(
        model, {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 256}
    )
    check_rotary_frequencies(model, model.config)  # transformers' own yarn: frequencies and attention scaling agree
    model.model.rotary_emb.attention_scaling = 1.0
    with pytest.raises(RotaryMismatch, match="attention scaling"):
        check_rotary_frequencies(model, model.config)
    stacked = tiny_model("llama")
    stacked.model.rotary_emb.inv_freq /= 4  # transformers' linear type scales the frequencies themselves
    with pytest.raises(RotaryMismatch, match="positions scaled by 4"):
        check_rotary_frequencies(stacked, stacked.config)
