"""``longpeft plan`` refuses what ``longpeft train`` refuses, through the same checks; its own flags are finite;
durations read in the unit that keeps them readable."""

from __future__ import annotations

import os
import sys

import pytest

from longpeft.cli import main
from longpeft.errors import ConfigError
from longpeft.launch.start import accelerate_executable
from longpeft.launch.topology import gradient_accumulation
from longpeft.recipes.schema import load_recipe
from longpeft.units import format_duration

RECIPE = "llama3-8b-instruct-80k-qlora"  # global batch 8, per-device batch 1


@pytest.mark.parametrize(
    "seconds, text",
    [
        (0, "0.0 s"),
        (42, "42.0 s"),
        (59.94, "59.9 s"),
        (60, "1.0 min"),
        (750, "12.5 min"),
        (3599, "60.0 min"),
        (3600, "1.0 h"),
        (3.2 * 3600, "3.2 h"),
    ],
)
def test_durations_switch_unit_at_a_minute_and_an_hour(seconds, text):
    assert format_duration(seconds) == text


@pytest.mark.parametrize(
    "override, field",
    [
        ("train.adam_beta1=5", "train.adam_beta1"),
        ("train.adam_beta2=1", "train.adam_beta2"),
        ("train.optim=notanoptimizer", "train.optim"),
    ],
)
def test_plan_and_train_refuse_the_same_optimizer_settings(override, field, capsys):
    with pytest.raises(ConfigError, match=field):  # the one validation both commands load the recipe through
        load_recipe(RECIPE, [override])
    for command in (["plan", RECIPE], ["train", RECIPE, "--launch", "ddp", "--gpus", "8", "--print-command"]):
        assert main([*command, "--set", override]) == 2
        assert field in capsys.readouterr().err


def test_a_known_optimizer_name_is_kept():
    assert load_recipe(RECIPE, ["train.optim=adamw_torch_fused"]).train.optim == "adamw_torch_fused"


def test_plan_refuses_a_global_batch_the_gpus_do_not_divide_as_train_does(capsys):
    recipe = load_recipe(RECIPE)
    assert gradient_accumulation(recipe, 4) == 2
    with pytest.raises(ConfigError, match=r"global_batch_size=8 is not a multiple of .* x 16 .* multiple of 16"):
        gradient_accumulation(recipe, 16)
    assert main(["plan", RECIPE, "--gpus", "16"]) == 2
    plan_error = capsys.readouterr().err
    assert main(["train", RECIPE, "--launch", "ddp", "--gpus", "16", "--print-command"]) == 2
    train_error = capsys.readouterr().err
    assert "train.global_batch_size=8 is not a multiple" in plan_error

    def message(err):
        return next(line for line in err.splitlines() if ": error: " in line).split(": error: ")[1]

    assert message(plan_error) == message(train_error)
    assert main(["plan", RECIPE, "--gpus", "8"]) == 0  # 8 divides 8: one sample per GPU per step


@pytest.mark.parametrize("flag", ["--mfu", "--gpu-memory", "--inter-node-gbps"])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_plan_flags_must_be_finite(flag, value, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["plan", RECIPE, "--gpus", "8", flag, value])
    assert exit_.value.code == 2 and f"{value} is not a finite number" in capsys.readouterr().err


def test_a_short_run_is_planned_in_minutes_not_as_zero_hours(capsys):
    assert main(["plan", RECIPE, "--gpus", "8", "--set", "train.max_steps=3"]) == 0
    time_line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("time:"))
    assert time_line.endswith(" min") and "0.0 h" not in time_line


def test_plan_prints_the_effective_assistant_only_loss(capsys):
    assert main(["plan", "tiny-cpu"]) == 0
    assert '"assistant_only_loss": true' in capsys.readouterr().out
    text = load_recipe("tiny-cpu", ["data.format=text", "data.source=retrieval"])
    assert text.train.assistant_only_loss is False


def test_the_launch_finds_accelerate_beside_the_interpreter(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", "")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    with pytest.raises(ConfigError, match="pip install accelerate"):
        accelerate_executable()
    beside = tmp_path / "accelerate"
    beside.write_text("#!/bin/sh\n")
    beside.chmod(0o755)
    assert accelerate_executable() == str(beside)
    assert os.access(beside, os.X_OK)


def _error(err: str) -> str:
    return next(line for line in err.splitlines() if ": error: " in line).split(": error: ")[1]


@pytest.mark.parametrize("theta", ["1.0001", "9999"])
def test_plan_and_train_refuse_a_rope_base_below_the_models_own(theta, tmp_path, capsys):
    """tiny-cpu's base model turns with base 10000: a smaller rope.rope_theta shortens every wavelength instead of
    extending the context, and plan refuses it in train's words (both resolve the recipe against the base through
    one path, build_spec)."""
    messages = []
    for command in (["plan", "tiny-cpu"], ["train", "tiny-cpu", "--set", f"output_dir={tmp_path}"]):
        assert main([*command, "--set", f"rope.rope_theta={theta}"]) == 2
        messages.append(_error(capsys.readouterr().err))
    assert messages[0] == messages[1]
    assert messages[0].startswith(f"rope.rope_theta={float(theta):g} is below the base model's own RoPE base 10000")
    assert main(["plan", "tiny-cpu", "--set", "rope.rope_theta=10000"]) == 0  # the model's own base is kept


def test_a_rope_base_below_a_real_bases_is_refused_before_anything_loads():
    """The 80K recipe's base (Llama-3-8B-Instruct, config values) turns with 500000."""
    from transformers import LlamaConfig

    from longpeft.recipes.validate import build_spec

    config = LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    )
    assert build_spec(load_recipe(RECIPE), config, "base").rope_parameters["rope_theta"] == 2e8
    with pytest.raises(ConfigError, match="rope.rope_theta=100000 is below the base model's own RoPE base 500000"):
        build_spec(load_recipe(RECIPE, ["rope.rope_theta=1e5"]), config, "base")
