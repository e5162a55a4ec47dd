"""`longpeft export` / `merge` end by saying what the output needs to be served: a plain transformers model (the RoPE
base and context length in config.json, where serving engines and llama.cpp's GGUF converter read them), or one that
needs trust_remote_code (a method's modeling file), with what to do for a plain one."""

from __future__ import annotations

import json

import pytest
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from longpeft.cli import main
from longpeft.hub import serving_note
from longpeft.spec import ContextSpec
from longpeft.tiny import tiny_config

ROPE = {"rope_type": "default", "rope_theta": 2e6, "max_position_embeddings": 1024}
STRING = {"shift": 16, "local_window": 4, "trained_length": 48, "cos_sin_scale": None}


@pytest.fixture
def adapter_with_string(tiny_base_dirs, tmp_path):
    """A tiny RoPE-base adapter (LoRA on q_proj) whose longpeft.json also switches STRING on."""
    base_dir = tiny_base_dirs("llama")
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    adapter = tmp_path / "adapter"
    get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(adapter)
    ContextSpec.from_base(
        model.config, "rope", base_model=str(base_dir), methods={"rope": ROPE, "string": STRING}
    ).save(adapter)
    return adapter


def test_export_says_which_outputs_need_trust_remote_code(adapter_with_string, tmp_path, capsys, single_thread):
    remote, plain = tmp_path / "remote", tmp_path / "plain"
    assert main(["export", str(adapter_with_string), "--out", str(remote), "--dtype", "float32"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == (
        f"{remote} needs trust_remote_code=True: string run in its own modeling file (modeling_string.py, "
        "architecture StringLlamaForCausalLM). It loads with transformers; it does not convert to GGUF (llama.cpp's "
        "converter does not know that architecture) and engines that run their own model code (vLLM, SGLang, "
        "llama.cpp) have no string; for a plain model pass --without string (docs/recipes.md#serving-engines)."
    )
    assert json.loads((remote / "config.json").read_text())["architectures"] == ["StringLlamaForCausalLM"]

    assert (
        main(["export", str(adapter_with_string), "--out", str(plain), "--dtype", "float32", "--without", "string"])
        == 0
    )
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == (
        f"{plain} is a plain transformers model (no trust_remote_code): its RoPE base and context length (1024 "
        "positions) are in config.json, where vLLM, SGLang and llama.cpp's convert_hf_to_gguf.py read them "
        "(docs/recipes.md#serving-engines)."
    )
    config = json.loads((plain / "config.json").read_text())
    # what the note promises: the stock architecture, and the keys the engines and the converter read
    assert config["architectures"] == ["LlamaForCausalLM"] and "auto_map" not in config
    assert (config["rope_theta"], config["rope_parameters"]["rope_theta"]) == (2e6, 2e6)
    assert config["max_position_embeddings"] == 1024


def test_a_trained_method_with_a_modeling_file_has_no_plain_export(tmp_path, monkeypatch):
    """HARPE and Activation Beacon are part of the trained weights: the note says there is no plain export."""
    from longpeft.adapters import METHODS

    folder = tmp_path / "merged"
    spec = ContextSpec.from_base(tiny_config("llama"), "harpe")
    spec.model_copy(update={"methods": {**spec.methods, "harpe": {}}}).save(folder)
    (folder / "config.json").write_text(json.dumps({"architectures": ["HarpeLlamaForCausalLM"]}))
    (folder / "modeling_harpe.py").write_text("")
    assert METHODS["harpe"].remote_code and not METHODS["harpe"].inference_only
    note = serving_note(folder)
    assert note.startswith(
        f"{folder} needs trust_remote_code=True: harpe run in its own modeling file "
        "(modeling_harpe.py, architecture HarpeLlamaForCausalLM)"
    )
    assert "; harpe is part of the trained model, so there is no plain export of it" in note
