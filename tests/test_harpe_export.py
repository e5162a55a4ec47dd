"""HARPE with LoRA, save/reload, longpeft.load, and the trust_remote_code export (fresh process, no longpeft)."""

from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

import longpeft
from longpeft.adapters.harpe import (
    apply_head_bases,
    has_head_bases,
    peak_valley_bases,
    uniform_bases,
    write_remote_code,
)
from longpeft.spec import ContextSpec
from longpeft.tiny import tiny_model

from export_helpers import imported_modules, run_without_longpeft  # tests/export_helpers.py

IDS = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(1))


def _lora(model, trainable: bool = True):
    """LoRA on q/k/v/o with random B (``init_lora_weights=False``) so the adapter changes the outputs."""
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False
    )
    torch.manual_seed(7)
    return get_peft_model(model, config, autocast_adapter_dtype=False) if trainable else model


def _bases(model) -> list[float]:
    return uniform_bases(50.0, 5e4, model.config.num_key_value_heads)


def test_lora_on_top_trains_a_step():
    model = tiny_model("llama")
    apply_head_bases(model, _bases(model))
    peft_model = _lora(model)
    peft_model.train()
    peft_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora_params = {n: p for n, p in peft_model.named_parameters() if p.requires_grad}
    assert lora_params and all("lora_" in n for n in lora_params)
    before = {n: p.detach().clone() for n, p in lora_params.items()}
    optimizer = torch.optim.AdamW(lora_params.values(), lr=1e-2)
    loss = peft_model(input_ids=IDS, labels=IDS).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in lora_params.values())
    optimizer.step()
    assert any(not torch.equal(before[n], p) for n, p in lora_params.items())
    assert has_head_bases(peft_model)


def test_apply_on_a_peft_wrapped_model():
    bases = _bases(tiny_model("qwen3"))
    patched_then_wrapped = tiny_model("qwen3")
    apply_head_bases(patched_then_wrapped, bases)
    patched_then_wrapped = _lora(patched_then_wrapped)
    wrapped_then_patched = _lora(tiny_model("qwen3"))
    apply_head_bases(wrapped_then_patched, bases)
    with torch.no_grad():
        assert torch.equal(wrapped_then_patched(IDS).logits, patched_then_wrapped(IDS).logits)
        assert not torch.allclose(wrapped_then_patched(IDS).logits, _lora(tiny_model("qwen3"))(IDS).logits)
    assert wrapped_then_patched.config.head_rope_bases == bases


def test_save_and_reload_keep_the_bases(tmp_path):
    model = tiny_model("mistral")
    bases = _bases(model)
    apply_head_bases(model, bases)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["head_rope_bases"] == bases
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert reloaded.config.head_rope_bases == bases
    apply_head_bases(reloaded, reloaded.config.head_rope_bases)
    with torch.no_grad():
        assert torch.equal(reloaded(IDS).logits, model(IDS).logits)


def test_adapter_loads_on_a_stock_base_with_the_same_logits(tmp_path):
    base_dir, adapter_dir = tmp_path / "base", tmp_path / "adapter"
    tiny_model("llama").save_pretrained(base_dir)
    base_config = AutoConfig.from_pretrained(base_dir)
    trained = AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager").eval()
    bases = _bases(trained)
    apply_head_bases(trained, bases)
    trained = _lora(trained).eval()
    trained.save_pretrained(adapter_dir)
    ContextSpec.from_base(base_config, "harpe", base_model=str(base_dir), methods={"harpe": {"bases": bases}}).save(
        adapter_dir
    )

    loaded = longpeft.load(str(base_dir), adapter_dir, attn_implementation="eager").eval()
    assert loaded.config.head_rope_bases == bases
    with torch.no_grad():
        torch.testing.assert_close(loaded(IDS).logits, trained(IDS).logits, atol=1e-6, rtol=1e-6)


_LOAD_WITHOUT_LONGPEFT = r"""
import torch

model_dir, ids_path, out_path = sys.argv[1:4]
model = load_exported(model_dir, "eager")
with torch.no_grad():
    torch.save(model(torch.load(ids_path)).logits, out_path)
print("\nLOADED", type(model).__name__, model.config.head_rope_bases)
"""


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_merged_export_loads_with_plain_transformers_without_longpeft(tmp_path, arch):
    model = tiny_model(arch)
    bases = _bases(model)
    apply_head_bases(model, bases)
    peft_model = _lora(model).eval()
    with torch.no_grad():
        adapter_logits = peft_model(IDS).logits
        merged = peft_model.merge_and_unload().eval()
        merged_logits = merged(IDS).logits
    torch.testing.assert_close(merged_logits, adapter_logits, atol=1e-5, rtol=1e-5)
    export_dir = tmp_path / "export"
    merged.save_pretrained(export_dir)
    write_remote_code(export_dir, bases)
    config = json.loads((export_dir / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"].startswith("modeling_harpe.Harpe")
    assert config["model_type"] == f"harpe_{arch}" and config["head_rope_bases"] == bases
    assert imported_modules(export_dir / "modeling_harpe.py") <= {
        "__future__",
        "collections",
        "sys",
        "types",
        "torch",
        "transformers",
    }

    torch.save(IDS, tmp_path / "ids.pt")
    result = run_without_longpeft(
        _LOAD_WITHOUT_LONGPEFT, [str(export_dir), str(tmp_path / "ids.pt"), str(tmp_path / "logits.pt")], tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"LOADED Harpe{type(model).__name__}" in result.stdout
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), merged_logits, atol=0, rtol=0)


def test_write_remote_code_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="save_pretrained"):
        write_remote_code(tmp_path, [1e4, 1e4])
    tiny_model("llama").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="2 key/value heads but 3 bases"):
        write_remote_code(tmp_path, [1e4, 1e4, 1e4])


def test_harpe_recipes_have_the_paper_settings_and_give_head_bases():
    from longpeft.recipes.schema import load_recipe
    from longpeft.recipes.validate import build_spec
    from longpeft.tiny import tiny_config

    paper = load_recipe("llama2-7b-harpe-128k")
    assert paper.method == "harpe" and paper.harpe.selection == "peak_valley"
    assert (paper.harpe.b_min, paper.harpe.b_max, paper.harpe.stride) == (1e6, 5e6, 3e4)
    assert paper.train.learning_rate == 2e-5 and (paper.train.adam_beta1, paper.train.adam_beta2) == (0.9, 0.95)
    assert paper.target_length == paper.data.max_length == 131072

    tiny = load_recipe("tiny-harpe-cpu")
    spec = build_spec(tiny, tiny_config("llama"), "tiny:llama")
    bases = spec.methods["harpe"]["bases"]
    assert spec.method == "harpe" and len(bases) == 2 and bases[0] == 1e4
    assert bases == peak_valley_bases(1e4, 1e6, 2, 1e4, 16, 1024, show_progress=False)
