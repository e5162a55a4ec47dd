"""The method registry: a method registered in one place is recorded by the runner, applied by
``longpeft.load``, carried through merge and named on the model card."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import longpeft
from longpeft import hub
from longpeft.adapters import METHODS, Method, apply_spec, register, unregister
from longpeft.config import StrictModel
from longpeft.errors import ConfigError
from longpeft.recipes.runner import run
from longpeft.recipes.schema import RecipeError, load_recipe
from longpeft.spec import ContextSpec
from longpeft.tiny import tiny_config, tiny_model


class DummyConfig(StrictModel):
    """A plug-in method: scales the final norm's weight (an observable, mergeable change)."""

    scale: float = 1.0
    note: str | None = None


class Dummy(Method):
    name = "dummy"
    config = DummyConfig

    def apply(self, model, config: DummyConfig) -> None:
        norm = model.get_base_model().model.norm if hasattr(model, "get_base_model") else model.model.norm
        with torch.no_grad():
            norm.weight.mul_(config.scale)
        model.config.dummy_scale = config.scale

    def remove(self, model) -> None:
        pass

    def is_applied(self, model) -> bool:
        return hasattr(model.config, "dummy_scale")

    def resolve(self, config: DummyConfig, context) -> DummyConfig:
        return config.model_copy(update={"note": f"resolved at {context.trained_length}"})

    def export(self, model, folder, config: DummyConfig) -> None:
        (folder / "dummy.json").write_text(json.dumps(config.model_dump()))

    def describe(self, config: DummyConfig) -> list[str]:
        return [f"Dummy plug-in method with scale {config.scale}."]


DUMMY = Dummy()


@pytest.fixture
def dummy_method():
    register(DUMMY)
    yield DUMMY
    unregister("dummy")


def test_a_registered_method_flows_through_recipe_load_merge_and_card(
    dummy_method, tiny_base_dirs, chat_jsonl, tmp_path
):
    base = tiny_base_dirs("llama")
    recipe = load_recipe(
        "tiny-cpu",
        [
            f"model.name_or_path={base}",
            f"data.source={chat_jsonl}",
            "data.max_length=256",
            "dummy.scale=2.0",
            f"output_dir={tmp_path / 'run'}",
            "train.max_steps=1",
            "train.global_batch_size=1",
            "train.per_device_batch_size=1",
            "lora.r=2",
            "lora.embeddings=none",
        ],
    )
    result = run(recipe)
    spec = ContextSpec.load(result.adapter_dir)
    assert spec.methods["dummy"] == {"scale": 2.0, "note": "resolved at 256"}  # recorded by the runner, resolved

    loaded = longpeft.load(str(base), result.adapter_dir).eval()
    assert loaded.config.dummy_scale == 2.0  # applied by longpeft.load
    stock = AutoModelForCausalLM.from_pretrained(base)
    assert torch.equal(loaded.get_base_model().model.norm.weight, 2.0 * stock.model.norm.weight)

    merged_dir = tmp_path / "merged"
    hub.merge(result.adapter_dir, merged_dir)
    assert json.loads((merged_dir / "dummy.json").read_text())["scale"] == 2.0  # export hook ran
    card = hub.model_card_text(ContextSpec.load(merged_dir), eval_rows=[], repo_id="x/y")
    assert "Dummy plug-in method with scale 2.0." in card and "dummy" in card


def test_unregistered_method_sections_are_refused(tmp_path):
    with pytest.raises(RecipeError, match="dummy: unknown key"):
        load_recipe("tiny-cpu", ["dummy.scale=2.0"])
    spec = ContextSpec.from_base(tiny_config("llama"), "rope", methods={"nobody": {"x": 1}})
    with pytest.raises(ValueError, match="nobody"):
        apply_spec(tiny_model("llama"), spec)


def test_method_needs_its_section_when_it_has_required_settings():
    with pytest.raises(RecipeError, match="method: harpe needs a harpe section"):
        load_recipe("tiny-cpu", ["method=harpe"])


def test_registry_order_and_shape():
    assert list(METHODS)[:4] == ["rope", "harpe", "pose", "string"]
    for method in METHODS.values():  # apply/remove on a model, or none (PoSE changes only the training inputs)
        assert issubclass(method.config, StrictModel) and callable(method.resolve)
        assert all(method.overrides(hook) == method.changes_model for hook in ("apply", "remove", "is_applied"))


def test_non_finite_settings_are_refused():
    with pytest.raises(RecipeError, match="rope.rope_theta"):
        load_recipe("tiny-cpu", ["rope.rope_theta=.inf"])
    with pytest.raises(RecipeError, match="train.learning_rate"):
        load_recipe("tiny-cpu", ["train.learning_rate=.nan"])


def test_trl_section_is_validated():
    from longpeft.recipes.validate import validate_recipe

    assert load_recipe("tiny-cpu", ["trl.logging_first_step=true"]).trl == {"logging_first_step": True}
    with pytest.raises(ConfigError, match="trl.not_an_argument: not an argument of trl.SFTConfig"):
        validate_recipe(load_recipe("tiny-cpu", ["trl.not_an_argument=1"]))
    with pytest.raises(RecipeError, match="trl.learning_rate is set by longpeft: use train.learning_rate"):
        load_recipe("tiny-cpu", ["trl.learning_rate=1e-4"])


@pytest.mark.parametrize(
    "key",
    [
        "packing",
        "save_strategy",
        "dataloader_num_workers",
        "disable_tqdm",
        "activation_checkpointing",
        "save_only_model",
    ],
)
def test_trl_keys_longpeft_sets_or_needs_are_refused_when_the_recipe_is_read(key):
    with pytest.raises(RecipeError, match=f"trl.{key} is set by longpeft: "):
        load_recipe("tiny-cpu", [f"trl.{key}=true"])


@pytest.mark.parametrize("recipe", ["tiny-cpu", "tiny-beacon-cpu"])
def test_every_sft_argument_longpeft_sets_is_refused_in_the_trl_section(recipe, tmp_path):
    """The refusal list covers what the runner passes (a trl key among them would crash SFTConfig with a bare
    TypeError); the UtK variant adds its dataset arguments."""
    from longpeft.recipes.schema import TRL_KEYS_OWNED_BY_RECIPE
    from longpeft.recipes.trainer import sft_arguments

    (tmp_path / "docs.jsonl").write_text('{"text": "a document"}\n')
    utk = [f"data.source={tmp_path / 'docs.jsonl'}", "data.format=text", "data.utk.probability=0.5"]
    for overrides in ([], utk) if recipe == "tiny-cpu" else ([],):
        arguments = sft_arguments(load_recipe(recipe, overrides), tmp_path)
        assert ("dataset_kwargs" in arguments) == bool(overrides)
        assert set(arguments) <= set(TRL_KEYS_OWNED_BY_RECIPE), set(arguments) - set(TRL_KEYS_OWNED_BY_RECIPE)


def test_cli_help_and_recipe_list_import_no_torch():
    """`longpeft --help` and `plan --list` stay fast: nothing heavy is imported to print them."""
    import subprocess
    import sys

    code = (
        "import sys, contextlib, io\n"
        "from longpeft.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['plan', '--list'])\n"
        "    try:\n"
        "        main(['--help'])\n"
        "    except SystemExit:\n"
        "        pass\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'trl', 'peft', 'matplotlib') if m in sys.modules)\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_string_is_visible_in_the_model_repr():
    from longpeft.adapters.string import disable_string, enable_string

    model = tiny_model("llama")
    enable_string(model, shift=64, local_window=16)
    assert "STRING(shift=64, local_window=16, trained_length=256)" in repr(model)
    disable_string(model)
    assert "STRING" not in repr(model)


def test_push_names_the_base_by_its_hub_id(tiny_base_dirs, tmp_path):
    base = tiny_base_dirs("llama")
    model = AutoModelForCausalLM.from_pretrained(base)
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    adapter = tmp_path / "adapter"
    peft_model.save_pretrained(adapter)
    ContextSpec.from_base(model.config, "rope", base_model=str(base)).save(adapter)
    staged = hub.push(adapter, "someone/tiny-long", dry_run=tmp_path / "upload", base_id="owner/tiny-base")
    staged = ContextSpec.load(staged)
    assert staged.base_model == "owner/tiny-base"
    card = (tmp_path / "upload" / "README.md").read_text()
    assert "base_model: owner/tiny-base" in card and str(base) not in card
    assert (
        json.loads((tmp_path / "upload" / "adapter_config.json").read_text())["base_model_name_or_path"]
        == "owner/tiny-base"
    )
    assert ContextSpec.load(adapter).base_model == str(base)  # the source adapter is untouched


def test_load_shows_its_real_signature():
    import inspect

    parameters = inspect.signature(longpeft.load).parameters
    assert list(parameters)[:2] == ["base", "adapter_dir"] and "strict_base_id" in parameters
    assert "longpeft.json" in longpeft.load.__doc__


def test_launch_checks_read_the_registry(dummy_method):
    """A plug-in's weights outside LoRA (its weights hooks) are refused with LoRA under ZeRO-3 (its checkpoints gather
    only the trainable weights); a plug-in's sharded_weights conflict is refused under every sharded launch, with its
    reason."""
    from longpeft.launch import check_launch

    recipe = load_recipe("tiny-cpu", ["dummy.scale=2.0"])
    for launch in ("ddp", "fsdp2", "zero3"):
        check_launch(recipe, launch)
    unregister("dummy")

    def not_called(*args):
        raise AssertionError("the launch checks only read whether a method has weights")

    class Weighted(Dummy):
        plan_lever = "dummy.scale"
        weight_parameters = save_weights = load_weights = planned_weights = staticmethod(not_called)

    class Conflicting(Dummy):
        conflicts = {"sharded_weights": "it counts the processes' steps"}

    register(Weighted())
    with pytest.raises(ValueError, match="zero3 with finetune: lora and dummy: .* gathers only the trainable"):
        check_launch(recipe, "zero3")
    check_launch(recipe, "fsdp2")
    unregister("dummy")
    register(Conflicting())
    for launch in ("fsdp2", "zero3"):
        with pytest.raises(
            ValueError, match=f"--launch {launch} with dummy: it counts the processes' steps; use --launch ddp"
        ):
            check_launch(recipe, launch)
    check_launch(recipe, "ddp")
