"""ContextSpec persistence and checks; longpeft.load restores what plain peft loading loses; merge."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

import longpeft
from longpeft import hub
from longpeft.adapters import apply_spec
from longpeft.cli import main
from longpeft.errors import ConfigError, DataError
from longpeft.spec import ContextSpec, SpecMismatchError
from longpeft.tiny import tiny_config, tiny_model

from export_helpers import imported_modules, run_without_longpeft  # tests/export_helpers.py

pytestmark = pytest.mark.compat  # also run by `make test-compat` (transformers 5.17, trl 1.15, datasets 4)


def make_adapter(base_dir, out_dir, rope_theta=2e6, max_positions=1024, seed=1):
    """A rope-base-expanded model with a non-trivial LoRA (random A and B) and a trained embedding row set."""
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    spec = ContextSpec.from_base(
        model.config,
        "rope",
        base_model=str(base_dir),
        methods={"rope": {"rope_type": "default", "rope_theta": rope_theta, "max_position_embeddings": max_positions}},
        trained_length=max_positions,
        target_length=max_positions,
    )
    apply_spec(model, spec)
    torch.manual_seed(seed)
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        modules_to_save=["embed_tokens"],
        init_lora_weights=False,
    )
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        peft_model.base_model.model.model.embed_tokens.modules_to_save["default"].weight.add_(0.01)
    peft_model.save_pretrained(out_dir)
    spec.save(out_dir)
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(out_dir)
    return peft_model.eval(), spec


IDS = torch.arange(5, 200)[None]


def test_spec_roundtrip_and_unknown_field(tmp_path):
    spec = ContextSpec.from_base(
        tiny_config("llama"), "rope", methods={"rope": {"rope_type": "default", "rope_theta": 5.0e5}}
    )
    spec.save(tmp_path)
    assert ContextSpec.load(tmp_path) == spec
    data = json.loads((tmp_path / "longpeft.json").read_text())
    assert sorted(data) == sorted(ContextSpec.model_fields) and data["format_version"] == 3
    assert data["base_shape"] == {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 512,
    }
    (tmp_path / "longpeft.json").write_text(json.dumps({**data, "surprise": 1}))
    with pytest.raises(DataError, match="surprise: unknown key"):
        ContextSpec.load(tmp_path)
    (tmp_path / "longpeft.json").write_text(json.dumps({**data, "base_shape": {**data["base_shape"], "heads": 4}}))
    with pytest.raises(DataError, match=r"base_shape\.heads: unknown key"):
        ContextSpec.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="longpeft.json"):
        ContextSpec.load(tmp_path / "nothing")


FORMAT_3 = Path(__file__).parent / "longpeft_format3.json"  # written by the ContextSpec before it was a StrictModel


def test_a_format_3_file_round_trips_byte_for_byte(tmp_path):
    """longpeft.json stays format 3: a file an earlier build wrote loads, saves to the same bytes, and equals the
    spec built from the same settings now."""
    spec = ContextSpec.from_dict(json.loads(FORMAT_3.read_text()))
    assert spec.save(tmp_path).read_bytes() == FORMAT_3.read_bytes()
    assert spec == ContextSpec.from_base(
        tiny_config("llama"),
        "harpe",
        base_model="org/base",
        trained_length=1024,
        target_length=2048,
        methods={
            "rope": {"rope_type": "default", "rope_theta": 2.0e6, "max_position_embeddings": 2048},
            "harpe": {"bases": [1.0e4, 5.0e5]},
            "string": {"shift": 600, "local_window": 128},
        },
        recipe_hash="ab" * 32,
        weights="lora",
        library_version="0.1.0",
    )
    assert spec.methods["harpe"]["bases"] == [1.0e4, 5.0e5] and spec.max_position_embeddings == 2048


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"format_version": None},
            "is in format 1, written by a development version of longpeft before its first "
            "release; this version reads format 3 only: re-create the adapter",
        ),
        ({"format_version": 2}, "is in format 2, .* re-create the adapter"),
        ({"format_version": 4}, "has format_version 4, newer than the 3 this longpeft reads; upgrade longpeft"),
        ({"format_version": "3"}, "format_version must be the integer 3, got '3'"),
        ({"base_shape": "x"}, "base_shape: Input should be a valid dictionary"),
        ({"vocab_size": 99999999999}, "vocab_size: Input should be less than or equal to 10000000"),
        ({"base_shape": {"vocab_size": -1}}, r"base_shape\.vocab_size: Input should be greater than 0"),
        ({"trained_length": "1024"}, "trained_length: Input should be a valid integer"),
        ({"trained_length": True}, "trained_length: Input should be a valid integer"),
        ({"weights": "qlora"}, "weights: Input should be 'lora', 'method', 'full' or 'merged'"),
        ({"methods": {"rope": 5}}, r"methods\.rope: Input should be a valid dictionary"),
    ],
)
def test_a_longpeft_json_it_cannot_read_is_a_clear_error(tmp_path, change, message):
    data = json.loads(FORMAT_3.read_text())
    for key, value in change.items():
        if isinstance(value, dict):
            data[key] = {**data[key], **value}
        elif value is None:
            del data[key]
        else:
            data[key] = value
    (tmp_path / "longpeft.json").write_text(json.dumps(data))
    with pytest.raises(DataError, match=message):
        ContextSpec.load(tmp_path)
    (tmp_path / "longpeft.json").write_text("[]")
    with pytest.raises(DataError, match="must hold a JSON object, got list"):
        ContextSpec.load(tmp_path)


@pytest.mark.parametrize(
    "override, field",
    [
        ({"hidden_size": 128}, "hidden_size"),
        ({"num_attention_heads": 8, "head_dim": 16}, "num_attention_heads"),
        ({"num_key_value_heads": 1}, "num_key_value_heads"),
        ({"vocab_size": 999}, "vocab_size"),
        ({"num_hidden_layers": 3}, "num_hidden_layers"),  # peft would drop or miss whole layers' LoRA weights
    ],
)
def test_spec_mismatch_names_the_field(override, field):
    spec = ContextSpec.from_base(tiny_config("llama"), "rope")
    with pytest.raises(SpecMismatchError, match=field):
        spec.check_base(tiny_config("llama", **override))


def test_spec_mismatch_architecture_and_base_id():
    spec = ContextSpec.from_base(tiny_config("llama"), "rope", base_model="org/model-a")
    spec.architecture = "LlamaForCausalLM"
    other = tiny_config("qwen2")
    other.architectures = ["Qwen2ForCausalLM"]
    with pytest.raises(SpecMismatchError, match="architecture"):
        spec.check_base(other)
    same = tiny_config("llama")
    same.architectures = ["LlamaForCausalLM"]
    spec.check_base(same, "org/model-b")  # another path for the same weights is fine by default
    with pytest.raises(SpecMismatchError, match="base model id"):
        spec.check_base(same, "org/model-b", strict_base_id=True)


def test_strict_base_id_accepts_the_adapters_own_relative_or_builtin_base(tiny_base_dirs, tmp_path):
    """strict_base_id compared the recorded name (../base, longpeft:toy-base) with the resolved path: it refused
    the adapter's own base."""
    from longpeft.base_config import TOY_BASE, model_location

    shutil.copytree(tiny_base_dirs("llama"), tmp_path / "run" / "base")
    make_adapter(tmp_path / "run" / "base", tmp_path / "run" / "adapter")
    spec = ContextSpec.load(tmp_path / "run" / "adapter")
    spec.base_model = "../base"  # as the runner records a base inside the run folder
    spec.save(tmp_path / "run" / "adapter")
    longpeft.load(None, tmp_path / "run" / "adapter", strict_base_id=True)
    with pytest.raises(SpecMismatchError, match="base model id"):  # another copy is still refused
        longpeft.load(str(tiny_base_dirs("llama")), tmp_path / "run" / "adapter", strict_base_id=True)

    toy = AutoModelForCausalLM.from_pretrained(model_location(TOY_BASE))
    get_peft_model(toy, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(tmp_path / "toy")
    ContextSpec.from_base(toy.config, "rope", base_model=TOY_BASE).save(tmp_path / "toy")
    longpeft.load(None, tmp_path / "toy", strict_base_id=True)
    longpeft.load(TOY_BASE, tmp_path / "toy", strict_base_id=True)


def test_load_applies_the_adapters_generation_config(tiny_base_dirs, tmp_path):
    """The recipe's eos ids (generation_config.json in the adapter) were dropped by longpeft.load; merge kept them."""
    from transformers import GenerationConfig

    base_dir = tiny_base_dirs("llama")
    make_adapter(base_dir, tmp_path / "adapter")
    generation = GenerationConfig.from_pretrained(base_dir)
    generation.eos_token_id = [6, 2, 3]
    generation.save_pretrained(tmp_path / "adapter")
    assert longpeft.load(None, tmp_path / "adapter").generation_config.eos_token_id == [6, 2, 3]


def test_load_reads_the_bases_config_with_cache_dir(tiny_base_dirs, tmp_path, monkeypatch):
    """cache_dir (and local_files_only, ...) reached from_pretrained but not the base's AutoConfig; and
    from_pretrained's own look-up of an adapter_config.json in the base repo asked the Hub despite local_files_only
    (transformers passes it the token and revision only: 20 s of retries here, where the Hub cannot be reached)."""
    import huggingface_hub.file_download

    from longpeft import files

    def no_hub(*args, **kwargs):
        raise AssertionError(f"asked the Hub for {args} {kwargs} under local_files_only=True")

    monkeypatch.setattr(huggingface_hub.file_download, "get_hf_file_metadata", no_hub)

    snapshot = tmp_path / "cache" / "models--someorg--tiny-base" / "snapshots" / ("a" * 40)
    shutil.copytree(tiny_base_dirs("llama"), snapshot)
    (tmp_path / "cache" / "models--someorg--tiny-base" / "refs").mkdir()
    (tmp_path / "cache" / "models--someorg--tiny-base" / "refs" / "main").write_text("a" * 40)
    make_adapter(tiny_base_dirs("llama"), tmp_path / "adapter")
    monkeypatch.setattr(files, "hub_preflight", lambda *args, **kwargs: None)
    model = longpeft.load(
        "someorg/tiny-base", tmp_path / "adapter", cache_dir=str(tmp_path / "cache"), local_files_only=True
    )
    assert model.longpeft_spec.rope_parameters["rope_theta"] == 2e6


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_load_restores_rope_base_where_plain_peft_does_not(arch, tiny_base_dirs, tmp_path):
    base_dir = tiny_base_dirs(arch)
    trained, _ = make_adapter(base_dir, tmp_path / "adapter")
    with torch.no_grad():
        expected = trained(IDS).logits

        loaded = longpeft.load(str(base_dir), tmp_path / "adapter").eval()
        assert loaded.config.rope_parameters["rope_theta"] == 2e6
        assert (loaded(IDS).logits - expected).abs().max() < 1e-5

        # Why the spec exists: plain peft loading keeps the stock base's RoPE base.
        plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), tmp_path / "adapter").eval()
        assert plain.config.rope_parameters["rope_theta"] == 10000.0
        assert (plain(IDS).logits - expected).abs().max() > 1e-2


def test_load_rejects_adapter_for_another_base(tiny_base_dirs, tmp_path):
    make_adapter(tiny_base_dirs("llama"), tmp_path / "adapter")
    with pytest.raises(SpecMismatchError, match="num_attention_heads|architecture"):
        longpeft.load(str(tiny_base_dirs("qwen2")), tmp_path / "adapter")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_merged_model_loads_with_plain_transformers_and_equal_logits(arch, tiny_base_dirs, tmp_path):
    base_dir = tiny_base_dirs(arch)
    trained, _ = make_adapter(base_dir, tmp_path / "adapter")
    result = hub.merge(tmp_path / "adapter", tmp_path / "merged")
    assert result["max_abs_logit_diff"] < 1e-4
    # A fresh process with nothing but transformers: config.json must carry the new RoPE base.
    script = (
        "import sys, torch; from transformers import AutoModelForCausalLM as A; "
        f"m = A.from_pretrained(r'{tmp_path / 'merged'}').eval(); "
        f"torch.save(m(torch.arange(5, 200)[None]).logits, r'{tmp_path / 'logits.pt'}')"
    )
    subprocess.run([sys.executable, "-c", script], check=True)
    merged_logits = torch.load(tmp_path / "logits.pt")
    with torch.no_grad():
        expected = trained(IDS).logits
    assert (merged_logits - expected).abs().max() < 1e-4
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert config["rope_parameters"]["rope_theta"] == 2e6
    assert config["max_position_embeddings"] == 1024


def test_export_and_push_dry_run_write_cards(tiny_base_dirs, tmp_path):
    make_adapter(tiny_base_dirs("llama"), tmp_path / "adapter")
    (tmp_path / "adapter" / "eval_results.json").write_text(
        json.dumps({"rows": [{"task": "passkey", "setting": "adapter", "length": 512, "score": 0.75}]})
    )
    base_path = str(tiny_base_dirs("llama"))  # the adapter names its base by this local path
    hub.export(tmp_path / "adapter", tmp_path / "export", dtype="bfloat16")
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    assert (tmp_path / "export" / "model.safetensors").is_file()
    assert base_path not in (tmp_path / "export" / "README.md").read_text()  # a card never names a local path
    hub.export(tmp_path / "adapter", tmp_path / "export-id", dtype="bfloat16", verify=False, base_id="owner/base")
    assert "base_model: owner/base" in (tmp_path / "export-id" / "README.md").read_text()
    assert json.loads((tmp_path / "export-id" / "longpeft.json").read_text())["base_model"] == "owner/base"
    for bad in ("owner/base\n# Injected heading", "not an id/with/slashes", "owner/ba se"):
        with pytest.raises(ConfigError, match=r"--base-id .* is not a Hub repo id"):
            hub.export(tmp_path / "adapter", tmp_path / "never", verify=False, base_id=bad)
        with pytest.raises(ConfigError, match=r"--base-id .* is not a Hub repo id"):
            hub.push(tmp_path / "adapter", "someone/tiny-80k", dry_run=tmp_path / "never", base_id=bad)
    with pytest.raises(ConfigError, match=r"--repo .* is not a Hub repo id"):
        hub.push(tmp_path / "adapter", "someone/tiny 80k", dry_run=tmp_path / "never")
    assert not (tmp_path / "never").exists()

    with pytest.warns(UserWarning, match="names its base model by a local path"):
        hub.push(tmp_path / "adapter", "someone/tiny-80k", dry_run=tmp_path / "upload-local")
    card = (tmp_path / "upload-local" / "README.md").read_text()
    assert base_path not in card and "base_model:" not in card.split("---")[1]
    assert 'longpeft.load("BASE_MODEL", "someone/tiny-80k")  # BASE_MODEL: the Hub id or folder' in card
    assert json.loads((tmp_path / "upload-local" / "longpeft.json").read_text())["base_model"] is None

    staged = hub.push(tmp_path / "adapter", "someone/tiny-80k", dry_run=tmp_path / "upload", base_id="owner/base")
    names = sorted(p.name for p in (tmp_path / "upload").iterdir())
    assert staged == str(tmp_path / "upload")
    assert {"adapter_config.json", "adapter_model.safetensors", "longpeft.json", "README.md"} <= set(names)
    card = (tmp_path / "upload" / "README.md").read_text()
    metadata = card.split("---")[1]
    assert (
        "base_model: owner/base" in metadata
        and "library_name: peft" in metadata
        and "rope_theta: 2000000.0" in metadata
    )
    assert 'longpeft.load("owner/base", "someone/tiny-80k")' in card
    assert "| passkey | adapter | 512 | 0.750 |" in card
    with pytest.raises(FileExistsError, match="not empty"):
        hub.push(tmp_path / "adapter", "someone/tiny-80k", dry_run=tmp_path / "upload", base_id="owner/base")


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """A one-step tiny HARPE run with finetune: full: its model/ folder holds the whole model, modeling_harpe.py
    (auto_map) and longpeft.json, and names its base by a local path (../base)."""
    from longpeft.recipes.runner import run
    from longpeft.recipes.schema import load_recipe

    out = tmp_path_factory.mktemp("full-run")
    recipe = load_recipe(
        "tiny-harpe-cpu",
        [
            "finetune=full",
            f"output_dir={out}",
            "train.max_steps=1",
            "train.global_batch_size=1",
            "train.per_device_batch_size=1",
            "data.max_length=256",
            "data.demo.n_conversations=4",
            "data.demo.context_tokens=100",
        ],
    )
    return run(recipe).output_dir


def _logits(folder: Path) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    with torch.no_grad():
        return model(IDS).logits.float()


def test_push_dry_run_of_a_full_fine_tune_run_stages_the_model(full_run, tmp_path):
    """Pushing a finetune: full run folder stages its model/ folder as a whole model (not adapter/, which it lacks),
    never as an adapter: a peft card would tell users to call longpeft.load, which refuses whole models."""
    (full_run / "eval_results.json").write_text(json.dumps({"rows": [{"task": "passkey", "score": 0.5}]}))
    staged = Path(
        hub.push(
            full_run, "someone/tiny-full", dtype="float32", base_id="someone/tiny-base", dry_run=tmp_path / "upload"
        )
    )
    names = {p.name for p in staged.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "modeling_harpe.py",
        "tokenizer.json",
        "generation_config.json",
        "longpeft.json",
        "README.md",
        "eval_results.json",
    } <= names
    assert "adapter_config.json" not in names
    config = json.loads((staged / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_harpe.HarpeLlamaForCausalLM"
    assert config["dtype"] == "float32"
    assert ContextSpec.load(staged).base_model == "someone/tiny-base"
    torch.testing.assert_close(_logits(staged), _logits(full_run / "model"), atol=0, rtol=0)
    card = (staged / "README.md").read_text()
    metadata = card.split("---")[1]
    assert "base_model: someone/tiny-base" in metadata and "library_name: transformers" in metadata
    assert "- full-finetune" in metadata and "- lora" not in metadata
    assert "fully fine-tuned" in card and "every weight of someone/tiny-base was trained" in card
    assert 'AutoModelForCausalLM.from_pretrained("someone/tiny-full", trust_remote_code=True)' in card
    assert 'AutoTokenizer.from_pretrained("someone/tiny-full", trust_remote_code=True)' in card  # no prompt
    assert ContextSpec.load(full_run / "model").weights == "full" and ContextSpec.load(staged).weights == "full"
    # training turned use_cache off; the runner saves it on, and staging turns it on in older folders
    assert json.loads((full_run / "model" / "config.json").read_text())["use_cache"] is True
    assert config["use_cache"] is True
    assert "longpeft.load" not in card and "| passkey |" in card


def test_push_casts_a_full_fine_tune_to_dtype_and_merged_changes_nothing(full_run, tmp_path):
    from safetensors import safe_open

    from longpeft.cli import main

    args = ["push", str(full_run / "model"), "--repo", "someone/tiny-full", "--base-id", "someone/tiny-base"]
    assert main([*args, "--dry-run", str(tmp_path / "bf16")]) == 0  # the default --dtype: bfloat16
    assert main([*args, "--merged", "--dry-run", str(tmp_path / "merged")]) == 0
    for name in ("model.safetensors", "config.json", "longpeft.json", "README.md"):
        assert (tmp_path / "bf16" / name).read_bytes() == (tmp_path / "merged" / name).read_bytes()
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(tmp_path / "bf16" / "model.safetensors", framework="pt") as f:
        assert {f.get_slice(key).get_dtype() for key in f.keys()} == {"BF16"}
    torch.testing.assert_close(_logits(tmp_path / "bf16"), _logits(full_run / "model"), atol=0.05, rtol=0)


def test_push_of_a_merged_model_gets_a_merged_card(full_run, tiny_base_dirs, tmp_path):
    """An exported folder (config.json, no adapter_config.json) was pushed with a "fully fine-tuned" card; the card
    follows what longpeft.json records. A whole model whose longpeft.json lacks the record is refused, naming it."""
    make_adapter(tiny_base_dirs("llama"), tmp_path / "adapter")
    hub.export(tmp_path / "adapter", tmp_path / "export", dtype="bfloat16")
    assert ContextSpec.load(tmp_path / "export").weights == "merged"
    for merged in (False, True):
        staged = Path(
            hub.push(
                tmp_path / "export",
                "someone/tiny-merged",
                merged=merged,
                base_id="someone/base",
                dry_run=tmp_path / f"upload-{merged}",
            )
        )
        card = (staged / "README.md").read_text()
        metadata = card.split("---")[1]
        assert "# someone/base extended with longpeft" in card and "fully fine-tuned" not in card
        assert (
            "full-finetune" not in metadata and "- lora" not in metadata and "library_name: transformers" in metadata
        )
        assert ContextSpec.load(staged).weights == "merged"
    staged = Path(
        hub.push(full_run / "model", "someone/full", base_id="someone/base", dry_run=tmp_path / "upload-full")
    )
    assert ContextSpec.load(staged).weights == "full" and "- full-finetune" in (staged / "README.md").read_text()
    unrecorded = tmp_path / "unrecorded"
    shutil.copytree(full_run / "model", unrecorded)
    spec = ContextSpec.load(unrecorded)
    spec.weights = None
    spec.save(unrecorded)
    with pytest.raises(DataError, match=r"unrecorded/longpeft.json does not record what this whole model is"):
        hub.push(unrecorded, "someone/full", base_id="someone/base", dry_run=tmp_path / "upload-unrecorded")


def test_push_makes_the_repo_equal_the_staged_folder(tiny_base_dirs, tmp_path, monkeypatch):
    """upload_folder without delete_patterns kept an earlier push's adapter_config.json beside a later merged
    model, and --private did not make an existing repository private. The Hub is simulated by a folder;
    upload_folder honours delete_patterns as the Hub does."""
    import fnmatch

    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / ".gitattributes").write_text("*.safetensors filter=lfs\n")

    visibility = {}

    class FakeApi:  # create_repo(exist_ok=True) leaves an existing repository's visibility alone, as the Hub does
        def create_repo(self, repo_id, private=None, exist_ok=False):
            visibility.setdefault(repo_id, bool(private))

        def update_repo_settings(self, repo_id, private=None):
            visibility[repo_id] = private

        def upload_folder(self, repo_id, folder_path, commit_message, delete_patterns=None, **kwargs):
            for path in list(repo.iterdir()):
                if path.name != ".gitattributes" and any(fnmatch.fnmatch(path.name, p) for p in delete_patterns or []):
                    path.unlink()
            for path in Path(folder_path).iterdir():
                shutil.copy(path, repo / path.name)
            return "commit"

    monkeypatch.setattr(hub, "HfApi", FakeApi)
    monkeypatch.setattr(hub, "hub_preflight", lambda *args, **kwargs: None)
    trained, _ = make_adapter(tiny_base_dirs("llama"), tmp_path / "adapter")
    hub.push(tmp_path / "adapter", "someone/tiny-80k", base_id="someone/base")
    assert (repo / "adapter_config.json").is_file()
    assert visibility == {"someone/tiny-80k": False}
    hub.push(
        tmp_path / "adapter", "someone/tiny-80k", merged=True, dtype="float32", base_id="someone/base", private=True
    )
    assert not (repo / "adapter_config.json").exists() and (repo / ".gitattributes").is_file()
    assert visibility == {"someone/tiny-80k": True}  # --private on an existing public repository makes it private
    model = AutoModelForCausalLM.from_pretrained(repo).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, trained(IDS).logits, atol=1e-4, rtol=0)


def test_merge_and_push_merged_with_a_moved_base(tiny_base_dirs, tmp_path):
    """A base that is not where longpeft.json says: merge names the missing folder and --base at once (not late in
    AutoConfig), and merge and push take the base --base gives."""
    base_dir = tiny_base_dirs("llama")
    make_adapter(base_dir, tmp_path / "adapter")
    spec = ContextSpec.load(tmp_path / "adapter")
    spec.base_model = "/data/old-machine/llama-base"
    spec.save(tmp_path / "adapter")
    with pytest.raises(FileNotFoundError, match="no such folder.*--base"):
        hub.merge(tmp_path / "adapter", tmp_path / "merged")
    assert (
        main(
            [
                "push",
                str(tmp_path / "adapter"),
                "--repo",
                "someone/x",
                "--merged",
                "--base",
                str(base_dir),
                "--base-id",
                "someone/base",
                "--dry-run",
                str(tmp_path / "upload"),
            ]
        )
        == 0
    )
    assert ContextSpec.load(tmp_path / "upload").weights == "merged"


def test_a_failed_push_dry_run_leaves_nothing_behind(tiny_base_dirs, tmp_path, monkeypatch):
    make_adapter(tiny_base_dirs("llama"), tmp_path / "adapter")

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(hub, "write_model_card", broken)
    with pytest.raises(OSError, match="disk full"):
        hub.push(tmp_path / "adapter", "someone/x", base_id="someone/base", dry_run=tmp_path / "upload")
    assert not (tmp_path / "upload").exists() and not (tmp_path / ".upload.partial").exists()
    monkeypatch.undo()
    hub.push(tmp_path / "adapter", "someone/x", base_id="someone/base", dry_run=tmp_path / "upload")
    assert (tmp_path / "upload" / "README.md").is_file()


def test_push_refuses_an_ambiguous_run_folder(full_run, tmp_path):
    shutil.copytree(full_run / "model", tmp_path / "run" / "model")
    shutil.copytree(full_run / "model", tmp_path / "run" / "adapter")
    with pytest.raises(ValueError, match="holds both adapter/ and model/"):
        hub.push(tmp_path / "run", "someone/tiny-full", base_id="someone/tiny-base", dry_run=tmp_path / "upload")


def test_a_recipe_string_section_is_off_while_training_and_on_in_the_model_it_writes(tmp_path):
    """STRING is an inference-time method: a recipe's string section trains without it (on in training, it would
    remap the far distances the run is meant to learn), and the whole model the run writes loads with it on
    through modeling_string.py; pushing that model keeps it."""
    from transformers import TrainerCallback

    from longpeft.adapters.string import disable_string, enable_string, string_settings
    from longpeft.recipes.runner import run
    from longpeft.recipes.schema import load_recipe

    seen = []

    class RecordString(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            seen.append(string_settings(model))

    recipe = load_recipe(
        "tiny-cpu",
        [
            "finetune=full",
            f"output_dir={tmp_path / 'run'}",
            "train.max_steps=1",
            "train.global_batch_size=1",
            "train.per_device_batch_size=1",
            "data.max_length=512",
            "data.demo.n_conversations=2",
            "data.demo.context_tokens=100",
            "string.shift=64",
            "string.local_window=8",
        ],
    )
    model_dir = run(recipe, callbacks=[RecordString()]).adapter_dir
    assert seen == [None]
    staged = Path(
        hub.push(
            model_dir, "someone/tiny-full", base_id="someone/tiny-base", dtype="float32", dry_run=tmp_path / "upload"
        )
    )
    for folder in (model_dir, staged):
        assert (folder / "modeling_string.py").is_file()
        loaded = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
        assert string_settings(loaded) == {
            "shift": 64,
            "local_window": 8,
            "trained_length": 512,
            "cos_sin_scale": None,
        }
    assert "trust_remote_code=True" in (staged / "README.md").read_text()
    # longpeft's switches act on the exported file's STRING too (replace, then off: the stock attention again)
    ids = torch.arange(5, 205)[None]
    stock = AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True)
    disable_string(stock)
    with torch.no_grad():
        plain = stock(ids).logits
        enable_string(loaded, shift=32, local_window=4)
        assert string_settings(loaded)["shift"] == 32 and (loaded(ids).logits - plain).abs().max() > 1e-3
        disable_string(loaded)
        assert string_settings(loaded) is None and torch.equal(loaded(ids).logits, plain)


def test_load_refuses_a_whole_fine_tuned_model_instead_of_dropping_its_weights(tiny_base_dirs, tmp_path):
    """A finetune: full folder (config.json + weights + longpeft.json) is not an adapter. With a method that keeps
    weights of its own (Activation Beacon), loading it as one would give the base plus those weights, silently."""
    base_dir = tiny_base_dirs("llama")
    trained, spec = make_adapter(base_dir, tmp_path / "adapter")
    full = tmp_path / "model"
    trained.merge_and_unload().save_pretrained(full)
    spec.save(full)
    with pytest.raises(ValueError, match="holds a whole model"):
        longpeft.load(None, full)
    spec.base_model = "../gone-base"  # refused before the base is looked for (it was: "no such folder")
    spec.save(full)
    with pytest.raises(ValueError, match="holds a whole model"):
        longpeft.load(None, full)


def _with_string(adapter_dir: Path) -> None:
    spec = ContextSpec.load(adapter_dir)
    spec.methods["string"] = {"shift": 16, "local_window": 4, "trained_length": 48, "cos_sin_scale": None}
    spec.save(adapter_dir)


_STRING_WITHOUT_LONGPEFT = r"""
import torch

model_dir, ids_path, out_path = sys.argv[1:4]
model = load_exported(model_dir, "sdpa")
ids = torch.load(ids_path)
with torch.no_grad():
    logits = model(ids).logits
    generated = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    # the exported file's own switch: STRING off gives the stock attention
    sys.modules[type(model).__module__].disable_string(model)
    plain = model(ids).logits
torch.save({"logits": logits, "generated": generated, "plain": plain}, out_path)
print("\nLOADED", type(model).__name__, model.config.string["shift"])
"""


def test_merge_keeps_string_in_a_modeling_file_and_leaves_it_out_when_told(tiny_base_dirs, tmp_path, capsys):
    """STRING changes no weight: the merged model carries it in modeling_string.py (trust_remote_code), and a fresh
    process without longpeft gives base + adapter's logits and tokens with STRING on, beyond the shift. With
    --without string the merged model is the stock architecture and equals base + adapter with STRING off."""
    from longpeft.adapters.string import disable_string

    make_adapter(tiny_base_dirs("llama"), tmp_path / "adapter")
    _with_string(tmp_path / "adapter")
    ids = torch.arange(5, 105)[None]  # 100 tokens: far keys beyond the shift of 16
    adapter = longpeft.load(None, tmp_path / "adapter").eval()
    with torch.no_grad():
        with_string = adapter(ids).logits
        tokens = adapter.generate(input_ids=ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        disable_string(adapter)
        without_string = adapter(ids).logits
    assert (with_string - without_string).abs().max() > 1e-3  # STRING was really on in the adapter

    result = hub.merge(tmp_path / "adapter", tmp_path / "merged")
    merged = tmp_path / "merged"
    assert result["left_out"] == [] and result["max_abs_logit_diff"] < 1e-4
    saved = json.loads((merged / "config.json").read_text())
    assert saved["model_type"] == "string_llama" and saved["string"]["shift"] == 16
    assert saved["auto_map"]["AutoModelForCausalLM"] == "modeling_string.StringLlamaForCausalLM"
    assert saved["rope_parameters"]["rope_theta"] == 2e6  # what the adapter changed besides STRING stays too
    assert imported_modules(merged / "modeling_string.py") <= {
        "__future__",
        "collections",
        "dataclasses",
        "flash_attn",
        "logging",
        "math",
        "sys",
        "typing",
        "torch",
        "transformers",
    }  # flash_attn: imported lazily, on the flash path only
    torch.save(ids, tmp_path / "ids.pt")
    run = run_without_longpeft(
        _STRING_WITHOUT_LONGPEFT, [str(merged), str(tmp_path / "ids.pt"), str(tmp_path / "out.pt")], tmp_path
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "LOADED StringLlamaForCausalLM 16" in run.stdout
    out = torch.load(tmp_path / "out.pt")
    torch.testing.assert_close(out["logits"], with_string, atol=1e-4, rtol=0)
    assert torch.equal(out["generated"], tokens)
    torch.testing.assert_close(out["plain"], without_string, atol=1e-4, rtol=0)
    evaluate = [
        "eval",
        "passkey",
        "--model",
        str(merged),
        "--lengths",
        "160",
        "--samples",
        "1",
        "--out",
        str(tmp_path / "ev"),
    ]
    assert main(evaluate) == 2  # its modeling file does not run unasked
    assert "ships its own modeling code" in capsys.readouterr().err
    assert main([*evaluate, "--trust-remote-code"]) == 0

    result = hub.merge(tmp_path / "adapter", tmp_path / "plain", without=("string",))
    assert result["left_out"] == ["string"] and result["max_abs_logit_diff"] < 1e-4
    assert "string" not in ContextSpec.load(tmp_path / "plain").methods
    assert not (tmp_path / "plain" / "modeling_string.py").exists()
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / "plain").eval()  # no trust_remote_code needed
        assert (plain(ids).logits - without_string).abs().max() < 1e-4
    with pytest.raises(ValueError, match="--without harpe: the adapter has no such method"):
        hub.merge(tmp_path / "adapter", tmp_path / "other", without=("harpe",))
    with pytest.raises(
        ValueError,
        match="--without rope: the adapter was trained with it.*only inference-time "
        r"methods \(string\)",
    ):
        hub.merge(tmp_path / "adapter", tmp_path / "other", without=("rope",))
    assert not (tmp_path / "other").exists()


def test_a_failed_merge_leaves_no_half_written_output(tiny_base_dirs, tmp_path, monkeypatch):
    make_adapter(tiny_base_dirs("llama"), tmp_path / "adapter")

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(hub, "export_methods", broken)
    with pytest.raises(OSError, match="disk full"):
        hub.merge(tmp_path / "adapter", tmp_path / "merged")
    assert not (tmp_path / "merged").exists() and not (tmp_path / ".merged.partial").exists()
    monkeypatch.undo()
    (tmp_path / "merged").mkdir()  # an empty --out is fine
    assert hub.merge(tmp_path / "adapter", tmp_path / "merged")["max_abs_logit_diff"] < 1e-4
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")  # --out . (it failed at the end: "." has no name to rename)
    hub.merge(tmp_path / "adapter", ".", verify=False)
    assert (tmp_path / "here" / "model.safetensors").is_file() and Path.cwd() == tmp_path / "here"


def test_merge_refuses_a_base_saved_quantized(tiny_base_dirs, tmp_path):
    base = tmp_path / "base-4bit"
    shutil.copytree(tiny_base_dirs("llama"), base)
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "bitsandbytes",
        "load_in_4bit": True,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_compute_dtype": "float32",
    }
    (base / "config.json").write_text(json.dumps(config))
    make_adapter(tiny_base_dirs("llama"), tmp_path / "adapter")
    with pytest.raises(ValueError, match="is saved quantized .*bitsandbytes.*full-precision base"):
        hub.merge(tmp_path / "adapter", tmp_path / "merged", base=str(base))
    assert not (tmp_path / "merged").exists()


def test_a_bad_method_section_names_it(tiny_base_dirs, tmp_path):
    make_adapter(tiny_base_dirs("llama"), tmp_path / "adapter")
    spec = ContextSpec.load(tmp_path / "adapter")
    spec.methods["rope"]["new_key"] = 1
    spec.save(tmp_path / "adapter")
    with pytest.raises(
        ValueError, match=r"longpeft.json methods.rope: new_key: Extra inputs are not permitted .*newer"
    ):
        longpeft.load(None, tmp_path / "adapter")


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 2e6},
        {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 256},
    ],
)
def test_saved_models_carry_the_rope_keys_transformers_4_reads(tmp_path, rope):
    """transformers 5 saves only rope_parameters: transformers 4.39 built the merged demo model with base 10,000
    instead of 2e6 (logits off by up to 19.9 over 800 tokens; equal once these keys are written). transformers 5
    reads the file as before."""
    from longpeft.adapters.rope_base import RopeConfig, expand_rope_base, write_legacy_rope_keys

    model = tiny_model("llama")
    expand_rope_base(model, rope, 1024)
    model.save_pretrained(tmp_path)
    before = AutoModelForCausalLM.from_pretrained(tmp_path).model.rotary_emb
    write_legacy_rope_keys(tmp_path, RopeConfig(**model.config.rope_parameters, max_position_embeddings=1024))
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["rope_theta"] == rope["rope_theta"]
    scaled = {k: v for k, v in saved["rope_parameters"].items() if k != "rope_theta"}
    assert saved["rope_scaling"] == (None if rope["rope_type"] == "default" else scaled)
    after = AutoModelForCausalLM.from_pretrained(tmp_path).model.rotary_emb
    assert torch.equal(after.inv_freq, before.inv_freq) and after.attention_scaling == before.attention_scaling


def test_a_merged_model_records_its_rope_base_for_older_readers(tiny_base_dirs, tmp_path):
    make_adapter(tiny_base_dirs("llama"), tmp_path / "adapter")
    hub.merge(tmp_path / "adapter", tmp_path / "merged")
    saved = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert saved["rope_theta"] == saved["rope_parameters"]["rope_theta"] == 2e6 and saved["rope_scaling"] is None


def test_a_hub_base_is_loaded_at_the_commit_the_adapter_was_trained_on(tiny_base_dirs, tmp_path, monkeypatch):
    """``base_revision`` was recorded but not used: load/merge took the base repository's newest commit. Here the Hub
    cache (offline) holds two commits of someone/base; main is a different model without a tokenizer."""
    import json

    import huggingface_hub

    from longpeft.loading import load, load_tokenizer

    base_dir = tiny_base_dirs("llama")
    trained, _ = make_adapter(base_dir, tmp_path / "adapter")
    repo = tmp_path / "cache" / "models--someone--base"
    old, new = "a" * 40, "b" * 40
    shutil.copytree(base_dir, repo / "snapshots" / old)
    changed = AutoModelForCausalLM.from_pretrained(base_dir)
    with torch.no_grad():
        changed.lm_head.weight.mul_(2.0)  # the repository updated after training
    changed.save_pretrained(repo / "snapshots" / new)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(new)
    spec_path = tmp_path / "adapter" / "longpeft.json"
    spec = json.loads(spec_path.read_text())
    spec.update(base_model="someone/base", base_revision=old)
    spec_path.write_text(json.dumps(spec))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "adapter" / name).unlink()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    cache = str(tmp_path / "cache")

    model = load(None, tmp_path / "adapter", cache_dir=cache).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(IDS).logits, trained(IDS).logits, atol=1e-5, rtol=0)
    assert load_tokenizer(tmp_path / "adapter", cache_dir=cache).encode("hello") == AutoTokenizer.from_pretrained(
        base_dir
    ).encode("hello")
    # a revision given explicitly wins
    newest = load(None, tmp_path / "adapter", cache_dir=cache, revision="main").eval()
    with torch.no_grad():
        assert (newest(IDS).logits - trained(IDS).logits).abs().max() > 1e-2


def test_loading_prints_no_deprecation_notice_of_the_libraries_it_calls(tiny_base_dirs, tmp_path):
    """peft reads `is_gradient_checkpointing`, which transformers deprecates: longpeft.load does not pass that
    FutureWarning on (and leaves the warning filters as they were)."""
    import warnings

    make_adapter(tiny_base_dirs("llama"), tmp_path / "adapter")
    before = list(warnings.filters)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        longpeft.load(None, tmp_path / "adapter")
    assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)]
    assert warnings.filters == before
