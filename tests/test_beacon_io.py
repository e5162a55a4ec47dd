"""Beacon weights on disk: save and load on a stock base (with and without LoRA), the merged export
loaded in a fresh process without longpeft, and the converter from the authors' checkpoints."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

import longpeft
from longpeft import hub
from longpeft.adapters.beacon import (
    WEIGHTS_FILENAME,
    BeaconConfig,
    apply_beacon,
    beacon_parameters,
    load_beacon_weights,
    save_beacon_weights,
)
from longpeft.cli import main
from longpeft.errors import DataError
from longpeft.hub import convert_authors_beacon
from longpeft.spec import ContextSpec

from export_helpers import imported_modules, run_without_longpeft  # tests/export_helpers.py

# compat: also run by `make test-compat` (transformers 5.17, trl 1.15, datasets 4)
pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.compat]

IDS = torch.randint(3, 500, (1, 45), generator=torch.Generator().manual_seed(3))


def beacon_config(**changes) -> BeaconConfig:
    return BeaconConfig(**{"window": 8, "ratios": [2], "sink": 1, "params": ["q", "k", "v", "o"], **changes})


def trained_beacon_model(base_dir, config: BeaconConfig, seed: int = 0):
    """The base with beacons whose weights moved away from their initial copies (as after training)."""
    model = AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="sdpa").eval()
    apply_beacon(model, config.settings())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in beacon_parameters(model).values():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return model


def write_adapter(model, base_dir, config: BeaconConfig, adapter_dir) -> None:
    if hasattr(model, "peft_config"):
        model.save_pretrained(adapter_dir)
    save_beacon_weights(model, adapter_dir)
    ContextSpec.from_base(
        AutoConfig.from_pretrained(base_dir),
        "beacon",
        base_model=str(base_dir),
        methods={"beacon": config.resolved().model_dump()},
    ).save(adapter_dir)


@pytest.mark.parametrize("projection,with_lora", [("full", False), ("lora", False), ("full", True)])
def test_saved_adapter_loads_on_a_stock_base_with_the_same_logits(tiny_base_dirs, tmp_path, projection, with_lora):
    base_dir = tiny_base_dirs("qwen2")
    config = beacon_config(projection=projection, **({"lora_rank": 4} if projection == "lora" else {}))
    model = trained_beacon_model(base_dir, config)
    if with_lora:  # LoRA on the base, wrapped after the beacons as the runner does
        torch.manual_seed(1)
        model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
        model.eval()
    write_adapter(model, base_dir, config, tmp_path / "adapter")
    loaded = longpeft.load(str(base_dir), tmp_path / "adapter", attn_implementation="sdpa").eval()
    assert hasattr(loaded, "peft_config") == with_lora
    with torch.no_grad():
        torch.testing.assert_close(loaded(IDS).logits, model(IDS).logits, atol=1e-6, rtol=0)
    other = AutoModelForCausalLM.from_pretrained(base_dir)
    apply_beacon(other, beacon_config(projection="lora" if projection == "full" else "full").settings())
    with pytest.raises(ValueError, match="does not fit the model's beacon weights"):
        load_beacon_weights(other, tmp_path / "adapter")


_LOAD_WITHOUT_LONGPEFT = r"""
import torch

model_dir, ids_path, out_path = sys.argv[1:4]
model = load_exported(model_dir, "sdpa")
ids = torch.load(ids_path)
with torch.no_grad():
    logits = model(ids).logits
    generated = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
torch.save({"logits": logits, "generated": generated}, out_path)
print("\nLOADED", type(model).__name__, model.config.beacon["window"])
"""


def test_merged_export_loads_in_a_fresh_process_without_longpeft(tiny_base_dirs, tmp_path):
    base_dir = tiny_base_dirs("llama")
    config = beacon_config()
    model = trained_beacon_model(base_dir, config)
    torch.manual_seed(1)
    model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "o_proj"], init_lora_weights=False)).eval()
    write_adapter(model, base_dir, config, tmp_path / "adapter")
    result = hub.merge(tmp_path / "adapter", tmp_path / "merged")
    assert result["max_abs_logit_diff"] < 1e-5
    export = tmp_path / "merged"
    saved = json.loads((export / "config.json").read_text())
    assert saved["model_type"] == "beacon_llama" and saved["beacon"]["sink"] == 1
    assert saved["auto_map"]["AutoModelForCausalLM"] == "modeling_beacon.BeaconLlamaForCausalLM"
    assert imported_modules(export / "modeling_beacon.py") <= {
        "__future__",
        "collections",
        "contextlib",
        "dataclasses",
        "functools",
        "math",
        "sys",
        "types",
        "typing",
        "torch",
        "transformers",
        "bitsandbytes",
    }  # bitsandbytes: imported lazily, for a 4-bit base only
    with torch.no_grad():
        expected = model(IDS).logits
        expected_tokens = model.generate(input_ids=IDS, max_new_tokens=12, do_sample=False, pad_token_id=0)
    torch.save(IDS, tmp_path / "ids.pt")
    run = run_without_longpeft(
        _LOAD_WITHOUT_LONGPEFT, [str(export), str(tmp_path / "ids.pt"), str(tmp_path / "out.pt")], tmp_path
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "LOADED BeaconLlamaForCausalLM 8" in run.stdout
    out = torch.load(tmp_path / "out.pt")
    torch.testing.assert_close(out["logits"], expected, atol=1e-5, rtol=0)
    assert torch.equal(out["generated"], expected_tokens)


def fake_authors_checkpoint(model, folder, config: BeaconConfig, mix: str = "step-random") -> None:
    """A full model as the authors release it: every tensor (base and beacon) in two shards with an
    index, and config.json with their beacon_* settings (ratio mix ``mix``) and remote-code auto_map."""
    folder.mkdir()
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    names = sorted(state)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(folder / file), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    settings = json.loads(model.config.to_json_string())
    settings.pop("beacon")
    settings.update(
        beacon_window=config.window,
        beacon_stride=config.window,
        beacon_attn=config.attn,
        beacon_pos=config.pos,
        beacon_ratio=config.ratios,
        beacon_ratio_mix=mix,
        beacon_param=config.params,
        beacon_sink_size=config.sink,
        beacon_attend_prev=True,
        beacon_embed_init="eos",
        beacon_parallel_window=1,
        auto_map={"AutoModelForCausalLM": "modeling_llama.LlamaForCausalLM"},
    )
    (folder / "config.json").write_text(json.dumps(settings))


def test_converter_round_trips_an_authors_checkpoint(tiny_base_dirs, tmp_path, capsys):
    base_dir = tiny_base_dirs("llama")
    config = beacon_config()
    model = trained_beacon_model(base_dir, config, seed=5)
    fake_authors_checkpoint(model, tmp_path / "authors", config)
    assert (
        main(["convert-beacon", str(tmp_path / "authors"), "--base", str(base_dir), "--out", str(tmp_path / "ours")])
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["tensors"] == 2 * 4 + 1 and report["beacon"]["sink"] == 1
    spec = json.loads((tmp_path / "ours" / "longpeft.json").read_text())
    assert spec["method"] == "beacon" and spec["methods"]["beacon"]["params"] == ["q", "k", "v", "o"]
    loaded = longpeft.load(str(base_dir), tmp_path / "ours", attn_implementation="sdpa").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(IDS).logits, model(IDS).logits, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="not built on"):
        convert_authors_beacon(tmp_path / "authors", tmp_path / "other", base=tiny_base_dirs("qwen2"))
    with pytest.raises(ValueError, match="not an Activation Beacon checkpoint"):
        convert_authors_beacon(base_dir, tmp_path / "other", base=base_dir)
    with pytest.raises(FileExistsError, match="--out .* is not empty"):  # refused before anything is read
        convert_authors_beacon(tmp_path / "missing-model", tmp_path / "ours", base=base_dir)


@pytest.mark.parametrize("length,expected", [(488, 2), (489, 4)])
def test_a_converted_model_adapts_its_ratio_as_the_authors_count(tiny_base_dirs, tmp_path, length, expected):
    """One length each side of the authors' first adapt-16 boundary on the tiny base (256 positions, window 8):
    ratio 2 reaches (256 - 8) x 2 + 8 = 504 = 488 + 16 tokens. The converted model records their rule; it picks
    their ratio (the reference: ``test_beacon_layout.authors_choice``) and reads exactly as the same model held at
    that one ratio, where longpeft's own rule, counting the sink and the last window's beacons, takes 4 at 488."""
    from test_beacon_layout import authors_choice

    from longpeft.adapters.beacon import BeaconCache, backbone_of

    assert authors_choice((2, 4, 8), 8, 256, length + 16) == expected
    base_dir = tiny_base_dirs("llama")
    config = beacon_config(ratios=[2, 4, 8])
    fake_authors_checkpoint(trained_beacon_model(base_dir, config, seed=7), tmp_path / "authors", config, "adapt-16")
    convert_authors_beacon(tmp_path / "authors", tmp_path / "ours", base=base_dir)
    spec = json.loads((tmp_path / "ours" / "longpeft.json").read_text())["methods"]["beacon"]
    assert (spec["layout_rule"], spec["inference_ratio_mix"]) == ("authors", "adapt-16")
    model = longpeft.load(str(base_dir), tmp_path / "ours", attn_implementation="sdpa").eval()
    ids = torch.randint(3, 500, (1, length), generator=torch.Generator().manual_seed(length))
    backbone = backbone_of(model)
    settings = backbone.beacon_settings
    logits = {}
    for name, changes in [
        ("authors", {}),
        ("held", {"inference_ratios": (expected,)}),
        ("longpeft", {"layout_rule": "longpeft"}),
    ]:
        backbone.beacon_settings = dataclasses.replace(settings, **changes)
        cache = BeaconCache()
        with torch.no_grad():
            logits[name] = model(ids, past_key_values=cache).logits
        if name != "held":
            logits[name + " ratio"] = cache.state.chosen_ratio
    backbone.beacon_settings = settings
    assert logits["authors ratio"] == expected and logits["longpeft ratio"] == 4
    torch.testing.assert_close(logits["authors"], logits["held"], atol=1e-6, rtol=0)
    assert (float((logits["authors"] - logits["longpeft"]).abs().max()) > 1e-3) == (expected == 2)


@pytest.mark.parametrize("damage", ["nan", "inf", "shape", "embedding"])
def test_converter_refuses_damaged_beacon_tensors_before_writing(tiny_base_dirs, tmp_path, damage):
    """A NaN, an infinity or a wrong shape in the authors' beacon tensors is named with its file before anything is
    written (such an adapter failed only at load, or loaded and scored 0)."""
    from safetensors.torch import load_file

    from longpeft.adapters.beacon.weights import authors_tensor_shape

    base_dir = tiny_base_dirs("llama")
    config = beacon_config()
    model = trained_beacon_model(base_dir, config, seed=5)
    fake_authors_checkpoint(model, tmp_path / "authors", config)
    index = json.loads((tmp_path / "authors" / "model.safetensors.index.json").read_text())["weight_map"]
    name = (
        "model.beacon_embed_tokens.weight"
        if damage == "embedding"
        else "model.layers.1.self_attn.beacon_k_proj.weight"
    )
    shard = tmp_path / "authors" / index[name]
    tensors = load_file(shard)
    assert tuple(tensors[name].shape) == authors_tensor_shape(name, model.config)  # the reference shapes hold
    if damage in ("nan", "inf"):
        tensors[name][0, 0] = float(damage)
        message = rf"{re.escape(str(shard))}: {re.escape(name)} holds 1 NaN or infinite values"
    else:
        tensors[name] = torch.cat([tensors[name], tensors[name][:1]])
        message = rf"{re.escape(name)} has shape \(\d+, \d+\), and on the base .* it must be \(\d+, \d+\)"
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(DataError, match=message):
        convert_authors_beacon(tmp_path / "authors", tmp_path / "ours", base=base_dir)
    assert not (tmp_path / "ours").exists()


def test_the_authors_tensor_shapes_follow_grouped_query_attention():
    from types import SimpleNamespace

    from longpeft.adapters.beacon.weights import authors_tensor_shape

    config = SimpleNamespace(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    layer = "model.layers.3.self_attn.beacon_{}_proj.{}"
    assert authors_tensor_shape(layer.format("q", "weight"), config) == (4096, 4096)
    assert authors_tensor_shape(layer.format("k", "weight"), config) == (1024, 4096)
    assert authors_tensor_shape(layer.format("v", "bias"), config) == (1024,)
    assert authors_tensor_shape(layer.format("o", "weight"), config) == (4096, 4096)
    assert authors_tensor_shape("model.beacon_embed_tokens.weight", config) == (1, 4096)


@pytest.mark.parametrize(
    ("their_mix", "training", "inference"),
    [
        ("adapt-1024", "adapt-1024", "adapt-1024"),
        ("adapt-16", "adapt-16", "adapt-16"),  # their code reads its one mix at inference too
        ("step-random", "step-random", "adapt-1024"),  # a random draw at inference would be a coin toss; ours adapts
        ("instance-random", "instance-random", "adapt-1024"),
        ("sequence", "sequence", "sequence"),  # deterministic: their cycle at inference too
    ],
)
def test_converter_keeps_the_authors_adapt_mix_for_inference(their_mix, training, inference):
    from longpeft.adapters.beacon.authors_config import config_from_authors

    config = config_from_authors({"beacon_window": 16, "beacon_ratio": [2, 4, 8], "beacon_ratio_mix": their_mix})
    assert (config.ratio_mix, config.inference_ratio_mix, config.inference_ratios) == (training, inference, [2, 4, 8])
    assert config.layout_rule == "authors"


@pytest.mark.parametrize(
    "their_config,message",
    [
        (
            {"beacon_attn": "step-expansion", "beacon_pos": "interleave", "beacon_attend_prev": False},
            "hides window slots 0 and 1 instead of the beacons",
        ),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "counts max_position_embeddings x 2.0 positions"),
    ],
)
def test_the_converter_refuses_what_the_authors_rule_cannot_reproduce(their_config, message):
    from longpeft.adapters.beacon.authors_config import config_from_authors

    with pytest.raises(ValueError, match=message):
        config_from_authors({"beacon_window": 16, "beacon_ratio": [2], **their_config})


def test_eval_runs_passkey_and_perplexity_with_beacons_inside_the_positions(tiny_base_dirs, tmp_path, recwarn):
    from longpeft.adapters import ModelSpan, model_span
    from longpeft.tiny import sample_text

    base_dir = tiny_base_dirs("llama")  # 256 positions
    config = beacon_config(window=32, ratios=[2, 4, 8], inference_ratio_mix="adapt-32")
    write_adapter(trained_beacon_model(base_dir, config), base_dir, config, tmp_path / "adapter")
    common = ["--model", str(base_dir), "--adapter", str(tmp_path / "adapter"), "--out", str(tmp_path / "eval")]
    assert main(["eval", "passkey", "--lengths", "600", "--samples", "2", "--batch-size", "2", *common]) == 0
    assert json.loads((tmp_path / "eval" / "passkey.json").read_text())["lengths"] == [600]
    (tmp_path / "text.txt").write_text(" ".join(sample_text(60)))
    assert (
        main(
            ["eval", "perplexity", "--text", str(tmp_path / "text.txt"), "--window", "700", "--stride", "700", *common]
        )
        == 0
    )
    assert json.loads((tmp_path / "eval" / "perplexity.json").read_text())["perplexity"] > 1
    assert not [w for w in recwarn if "max_position_embeddings" in str(w.message)]  # beacons stay inside 256
    loaded = longpeft.load(str(base_dir), tmp_path / "adapter")
    # memory grows with length / ratio: 100K tokens at ratio 8 read 1 + 3124 * 4 + 32 + 4 keys at most
    assert model_span(loaded, 600).positions < 256 and model_span(loaded, 100_000) == ModelSpan(
        12533, 12533, ("beacon",)
    )


def test_a_beacon_only_adapter_can_be_pushed(tiny_base_dirs, tmp_path):
    """finetune: method writes no LoRA files, only the beacon weights and longpeft.json: push stages it."""
    base_dir = tiny_base_dirs("llama")
    config = beacon_config()
    write_adapter(trained_beacon_model(base_dir, config), base_dir, config, tmp_path / "adapter")
    staged = hub.push(tmp_path / "adapter", "someone/tiny-beacon", dry_run=tmp_path / "upload", base_id="owner/base")
    names = {p.name for p in Path(staged).iterdir()}
    assert {WEIGHTS_FILENAME, "longpeft.json", "README.md"} <= names and "adapter_config.json" not in names
    assert json.loads((Path(staged) / "longpeft.json").read_text())["base_model"] == "owner/base"
    # its card is not a LoRA adapter's (peft, lora, PeftModel), and unknown lengths (convert-beacon) are left out
    spec = ContextSpec.load(tmp_path / "adapter")
    spec.trained_length = spec.target_length = spec.weights = None  # as written before format 3, converted
    spec.save(tmp_path / "adapter")
    staged = Path(
        hub.push(tmp_path / "adapter", "someone/tiny-beacon", dry_run=tmp_path / "upload3", base_id="owner/base")
    )
    card = (staged / "README.md").read_text()
    metadata = card.split("---")[1]
    assert (
        "library_name" not in metadata and "- lora" not in metadata and "PeftModel" not in card and "None" not in card
    )
    assert 'longpeft.load("owner/base", "someone/tiny-beacon")' in card and "no LoRA weights" in card
    positions = spec.max_position_embeddings  # beacon reads past the window without new positions
    assert f"Positions unchanged at {positions}; the methods below extend" in card
    assert "Context extended" not in card and "RoPE: " not in card
    assert ContextSpec.load(staged).weights == "method"
    (tmp_path / "empty").mkdir()
    ContextSpec.from_base(AutoConfig.from_pretrained(base_dir), "beacon").save(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="lacks .*weights"):
        hub.push(tmp_path / "empty", "someone/x", dry_run=tmp_path / "upload2")
