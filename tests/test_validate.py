"""The one validation before any weight loads (longpeft/recipes/validate.py, longpeft/base_config.py), from the
user's side: ``plan`` and ``train`` refuse the same recipes with the same one line and exit status 2, and ``train``
refuses before it writes or loads anything; the base's config read without weights or torch as transformers reads
it; validating a recipe imports no torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from longpeft.cli import main

pytestmark = pytest.mark.compat


def refusal(argv: list[str], capsys) -> str:
    """The one error line of a command that must exit 2."""
    assert main(argv) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1] == "(run with --debug for the traceback)" and "Traceback" not in "\n".join(lines)
    return "\n".join(lines[:-1]).split(": error: ", 1)[1]


def same_refusal(recipe: str, sets: list[str], tmp_path: Path, capsys) -> str:
    """plan's and train's refusal of ``recipe`` with ``sets`` (KEY=VALUE), which must be the same line; train
    leaves its output folder unwritten."""
    out = tmp_path / "run"
    common = [recipe, "--set", f"output_dir={out}", *(a for s in sets for a in ("--set", s))]
    planned, trained = refusal(["plan", *common], capsys), refusal(["train", *common], capsys)
    assert planned == trained
    assert not out.exists(), "train wrote before refusing"
    return planned


@pytest.mark.parametrize(
    ("recipe", "sets", "words"),
    [
        ("tiny-cpu", ["train.keep_attention=99"], "train.keep_attention=99: the model has 2 decoder layers"),
        ("tiny-cpu", ["train.checkpoint_layers=3"], "train.checkpoint_layers=3: the model has 2 decoder layers"),
        ("tiny-cpu", ["lora.target_modules=[nope]"], "lora.target_modules: 'nope' names no module of tiny:llama"),
        ("tiny-cpu", ["lora.target_modules=[mlp]"], "'mlp' names modules LoRA cannot adapt"),
        ("tiny-cpu", ["rope.rope_type=linear"], "rope.rope_type linear reads rope.factor"),
        ("tiny-cpu", ["model.eos_token_ids=[512]"], "model.eos_token_ids [512] are outside the vocabulary (0..511)"),
        ("tiny-cpu", ["data.max_length=1000000000"], "data.max_length: 1,000,000,000 positions is past"),
        ("tiny-cpu", ["rope.max_position_embeddings=1000000000000"], "at most 268,435,456"),
        ("tiny-cpu", ["data.demo.n_conversation=3"], "data.demo.n_conversation: unknown key"),
        ("tiny-beacon-cpu", ["beacon.keep_start=64", "beacon.sink=0"], "beacon.keep_start / beacon.keep_end are"),
        ("tiny-beacon-cpu", ["beacon.ratios=[]"], "beacon.ratios must list at least one ratio"),
        # ratio 0 condenses nothing: the method that bounds the positions is named with its fix
        ("tiny-beacon-cpu", ["beacon.ratios=[0]"], "(beacon as set spans one position per token), beyond the"),
        ("tiny-harpe-cpu", ["train.use_liger_kernel=true"], "train.use_liger_kernel with harpe"),
    ],
)
def test_plan_and_train_refuse_with_the_same_line_before_anything_loads(recipe, sets, words, tmp_path, capsys):
    assert words in same_refusal(recipe, sets, tmp_path, capsys)


def tiny_base_folder(tiny_base_dirs, tmp_path: Path, **config_changes) -> Path:
    """A copy of the saved tiny Llama base with ``config_changes`` in its config.json."""
    folder = tmp_path / "base"
    shutil.copytree(tiny_base_dirs("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **config_changes}))
    return folder


def test_a_base_without_a_chat_template_is_refused_for_conversations(tiny_base_dirs, tmp_path, capsys):
    base = tiny_base_folder(tiny_base_dirs, tmp_path)
    (base / "chat_template.jinja").unlink()
    line = same_refusal("tiny-cpu", [f"model.name_or_path={base}"], tmp_path, capsys)
    assert line.startswith("data.format: messages renders conversations with the tokenizer's chat template")
    assert main(["plan", "tiny-cpu", "--set", f"model.name_or_path={base}", "--set", "data.format=text"]) == 2
    assert "data.source: demo is conversations" in capsys.readouterr().err  # plain text needs no template


def test_a_base_that_needs_its_own_code_is_one_line_in_train_and_merge(tiny_base_dirs, tmp_path, capsys):
    """A model_type transformers has no class for, with the code in the repo: refused before transformers reads it
    (whose ValueError was a traceback), naming the code and the setting. The same code beside a model_type
    transformers knows is not run (transformers builds its own class), and the base is accepted."""
    from longpeft.spec import ContextSpec
    from longpeft.tiny import tiny_config

    auto_map = {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    known = tiny_base_folder(tiny_base_dirs, tmp_path / "known", auto_map=auto_map)
    assert main(["plan", "tiny-cpu", "--set", f"model.name_or_path={known}"]) == 0
    base = tiny_base_folder(tiny_base_dirs, tmp_path, auto_map=auto_map, model_type="custom_lm")
    line = same_refusal("tiny-cpu", [f"model.name_or_path={base}"], tmp_path, capsys)
    assert "ships its own modeling code (modeling_custom.CustomForCausalLM" in line
    assert "set model.trust_remote_code: true if you trust that code" in line
    adapter = tmp_path / "adapter"
    ContextSpec.from_base(tiny_config("llama"), "rope", base_model=str(base)).save(adapter)
    merged = refusal(["merge", str(adapter), "--out", str(tmp_path / "merged")], capsys)
    assert "ships its own modeling code" in merged and "longpeft runs no such code here" in merged
    trusted = ["plan", "tiny-cpu", "--set", f"model.name_or_path={base}", "--set", "model.trust_remote_code=true"]
    assert main(trusted) == 0


def test_a_recipe_whose_base_is_not_here_is_checked_alone_and_train_refuses(tmp_path, capsys):
    sets = ["--set", f"model.name_or_path={tmp_path / 'no-base'}", "--set", f"output_dir={tmp_path / 'run'}"]
    assert main(["plan", "tiny-cpu", *sets]) == 0
    assert "checked without its base's config, which train needs here" in capsys.readouterr().err
    assert "no such folder on this machine" in refusal(["train", "tiny-cpu", *sets], capsys)


def test_the_base_config_is_read_as_transformers_reads_it(tmp_path):
    """config.json as written by transformers 4 (rope_theta + rope_scaling) and 5 (rope_parameters), with the
    defaults the Llama family fills in: the same rope_parameters, heads and sizes as transformers' own config."""
    from transformers import AutoConfig

    from longpeft.base_config import read_base
    from longpeft.family import head_dim_of
    from longpeft.tiny import tiny_settings

    legacy = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 300,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    yarn = {**legacy, "rope_scaling": {"type": "yarn", "factor": 4.0}, "num_key_value_heads": 2}
    plain = {key: value for key, value in legacy.items() if key not in ("rope_theta", "rope_scaling")}
    configs = {"legacy": legacy, "yarn": yarn, "plain": plain}
    for arch in ("llama", "qwen2", "qwen3", "mistral"):
        configs[arch] = {k: v for k, v in tiny_settings(arch).items() if k != "attn_implementation"}
    for name, data in configs.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(data))
        ours, theirs = read_base(str(folder)).config, AutoConfig.from_pretrained(folder)
        for key in ("rope_parameters", "num_key_value_heads", "vocab_size", "max_position_embeddings"):
            assert getattr(ours, key) == getattr(theirs, key), (name, key)
        assert head_dim_of(ours) == head_dim_of(theirs), name


def test_module_names_from_the_config_are_the_built_models(tmp_path):
    """The Llama family's module table (family.module_kinds) against the model built on the meta device, for
    every tiny architecture; an architecture without a table is built there (its names as transformers gives them)."""
    from longpeft.base_config import BaseConfig, BaseFacts
    from longpeft.family import module_kinds
    from longpeft.tiny import TINY_ARCHITECTURES, tiny_settings

    for arch in TINY_ARCHITECTURES:
        settings = {k: v for k, v in tiny_settings(arch).items() if k != "attn_implementation"}
        table = module_kinds(BaseConfig(settings, arch))
        facts = BaseFacts(arch, arch, BaseConfig({**settings, "model_type": "unlisted"}, arch), None, False)
        with pytest.raises(Exception, match="does not know model_type 'unlisted'"):
            facts.module_kinds()
        built = BaseFacts(arch, arch, BaseConfig(settings, arch), None, False)
        assert table is not None and table == _meta_kinds(built.config.to_dict()), arch


def _meta_kinds(config: dict) -> dict[str, str]:
    from longpeft.base_config import _meta_module_kinds

    return _meta_module_kinds(config, "tiny")


def test_an_architecture_outside_the_family_has_its_modules_checked(capsys):
    """gpt2 (Conv1D projections, no q_proj): its modules come from the meta-device build."""
    from longpeft.base_config import BaseConfig, BaseFacts

    gpt2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 100, "n_positions": 128}
    shape = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 128}
    config = BaseConfig({**gpt2, **shape}, "gpt2")
    kinds = BaseFacts("gpt2", "gpt2", config, None, False).module_kinds()
    assert kinds["transformer.h.0.attn.c_attn"] == "Conv1D" and "q_proj" not in " ".join(kinds)


def test_the_hub_base_config_is_downloaded_alone_and_checked(tmp_path, capsys):
    """A Hub base not in the cache: plan downloads its config.json and tokenizer config only (bounded, from the fake
    Hub) and checks the recipe against them as train would."""
    from fake_hub import FakeHub, pointed_at

    from longpeft.tiny import tiny_settings

    config = json.dumps({k: v for k, v in tiny_settings("llama").items() if k != "attn_implementation"}).encode()
    files = {"config.json": config, "tokenizer_config.json": b'{"chat_template": "{{ messages }}"}'}
    with FakeHub("files", files=files) as hub, pointed_at(hub.endpoint, cache=str(tmp_path / "hub")):
        base = ["--set", "model.name_or_path=owner/model"]
        assert main(["plan", "tiny-cpu", *base, "--set", "model.eos_token_ids=[600]"]) == 2
        assert "model.eos_token_ids [600] are outside the vocabulary (0..511)" in capsys.readouterr().err
        assert main(["plan", "tiny-cpu", *base]) == 0
    assert not [request for request in hub.requests if "safetensors" in request or "tokenizer.json" in request]
    assert {"GET /owner/model/resolve/main/config.json", "GET /owner/model/resolve/main/tokenizer_config.json"} <= set(
        hub.requests
    )


def test_hub_answers_of_another_shape_name_the_repo(tmp_path, capsys):
    """An empty file listing used to name a cache folder, a listing the client cannot read a library's key."""
    from fake_hub import FakeHub, pointed_at

    with FakeHub("files", files={}) as hub, pointed_at(hub.endpoint):
        line = refusal(["merge", "someone/a", "--out", str(tmp_path / "out")], capsys)
    assert line.startswith("adapter someone/a: the Hub at ") and "lists no file in it" in line
    with FakeHub("answer", answer={"id": 3, "sha": None, "siblings": {}}) as hub, pointed_at(hub.endpoint):
        line = refusal(["merge", "someone/a", "--out", str(tmp_path / "out")], capsys)
    assert "adapter someone/a: the Hub at " in line and "answered in a shape its client cannot read" in line


def test_a_tied_adapter_without_its_record_of_tied_names_is_one_line(tmp_path, capsys):
    """longpeft.tied removed from an adapter file that left the tied head out: peft's KeyError becomes one line
    naming the adapter and the weight."""
    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file

    from longpeft.adapter_weights import leave_out_tied_copies
    from longpeft.spec import ContextSpec
    from longpeft.tiny import tiny_model

    base, adapter = tmp_path / "base", tmp_path / "adapter"
    tiny_model("llama-tied", vocab_size=400).save_pretrained(base)
    lora = LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["model.embed_tokens"], ensure_weight_tying=True)
    model = get_peft_model(tiny_model("llama-tied", vocab_size=400), lora)
    model.save_pretrained(adapter)
    leave_out_tied_copies(model, adapter)
    ContextSpec.from_base(model.config, "rope", base_model=str(base)).save(adapter)
    weights = adapter / "adapter_model.safetensors"
    save_file(load_file(weights), str(weights), metadata={"format": "pt"})  # the record of tied names removed
    with torch.device("cpu"):
        line = refusal(["merge", str(adapter), "--out", str(tmp_path / "merged"), "--no-verify"], capsys)
    assert line.startswith(f"adapter {adapter}: adapter_model.safetensors lacks ") and "lm_head" in line


@pytest.mark.parametrize("command", ["train", "plan"])
def test_train_and_plan_take_the_recipe_and_its_overrides_alike(command, capsys):
    """The recipe and ``--set`` are declared once (``longpeft/cli/arguments.py``): both commands show its help."""
    with pytest.raises(SystemExit):
        main([command, "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "--set KEY=VALUE override a recipe key, e.g. --set train.max_steps=10 (repeatable)" in shown
    assert "recipe recipe YAML path or bundled recipe name" in shown


def test_validating_a_recipe_imports_no_torch():
    """load_recipe of every bundled recipe, plan (no --gpus) of the recipes whose methods validate without torch,
    and ``longpeft --help``, in a fresh process: neither torch nor transformers is imported (CONTRIBUTING.md,
    rules)."""
    code = (
        "import sys, io, contextlib\n"
        "from longpeft.recipes.schema import bundled_recipes, load_recipe\n"
        "from longpeft.cli import main\n"
        "for name in bundled_recipes(): load_recipe(name)\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    names = ('toy-extend-cpu', 'tiny-cpu', 'llama3-8b-instruct-80k-qlora')\n"
        "    codes = [main(['plan', name]) for name in names]\n"
        "    try: main(['--help'])\n"
        "    except SystemExit as exit: codes.append(exit.code)\n"
        "print(codes, sorted(m for m in ('torch', 'transformers', 'trl', 'peft') if m in sys.modules))\n"
    )
    env = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.stdout.splitlines()[-1] == "[0, 0, 0, 0] []", done.stderr[-2000:]


def test_transformers_facts_are_read_from_its_source_as_its_objects_hold_them():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.training_args import OptimizerNames

    from longpeft.base_config import model_types, optimizer_names

    assert optimizer_names() == tuple(name.value for name in OptimizerNames)
    assert model_types() == set(CONFIG_MAPPING_NAMES)


def test_the_tiny_bases_vocabulary_is_read_without_transformers():
    from longpeft.tiny import demo_tokenizer, demo_vocab_size

    assert demo_vocab_size() == len(demo_tokenizer())
