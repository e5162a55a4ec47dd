"""``method: beacon`` trained by the TRL-based runner: the loss falls, only the beacon weights (and LoRA
when asked) change, and the saved adapter loads on the stock base with the same logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback

import longpeft
from longpeft.adapters.beacon import WEIGHTS_FILENAME, beacon_parameters, trainable_beacon_parameters
from longpeft.recipes.runner import prepare, run
from longpeft.recipes.saving import save_adapter
from longpeft.recipes.schema import RecipeError, load_recipe

# compat: also run by `make test-compat` (transformers 5.17, trl 1.15, datasets 4)
pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.compat]


def beacon_recipe(base_dir, data_path, out_dir, *overrides):
    return load_recipe(
        "tiny-beacon-cpu",
        [
            f"model.name_or_path={base_dir}",
            f"data.source={data_path}",
            "data.max_length=256",
            f"output_dir={out_dir}",
            "beacon.window=16",
            "train.max_steps=6",
            "train.per_device_batch_size=1",
            "train.global_batch_size=1",
            "train.learning_rate=0.02",
            "train.save_steps=100",
            *overrides,
        ],
    )


def _eval_loss(model, batch) -> float:
    model.eval()
    with torch.no_grad():
        loss = model(**batch).loss.item()
    model.train()
    return loss


@pytest.mark.parametrize("finetune", ["method", "lora"])
def test_training_changes_only_beacon_and_lora_weights_and_the_adapter_reloads(
    tiny_base_dirs, chat_jsonl, tmp_path, finetune
):
    base = tiny_base_dirs("llama")
    extra = ["finetune=lora", "lora.r=2", "lora.embeddings=none"] if finetune == "lora" else []
    prepared = prepare(beacon_recipe(base, chat_jsonl, tmp_path / "run", *extra))
    trainer, model = prepared.trainer, prepared.trainer.model
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    # the Trainer moved the model to the GPU where there is one
    batch = {k: v.to(model.device) for k, v in batch.items() if k in ("input_ids", "attention_mask", "labels")}
    assert batch["input_ids"].shape[1] > 3 * 16  # several windows
    before_loss = _eval_loss(model, batch)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    names = {id(p): n for n, p in model.named_parameters()}
    beacon = {names[id(p)] for p in trainable_beacon_parameters(model).values()}
    # the last layer's beacon queries shape only the beacons' own outputs, which nothing reads: frozen
    assert len(beacon) == len(beacon_parameters(model)) - 1
    expected = beacon | ({n for n in before if "lora_" in n} if finetune == "lora" else set())
    assert trainable == expected and beacon
    trainer.train()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert beacon <= changed <= expected
    if finetune == "lora":
        assert any("lora_" in n for n in changed)
    assert _eval_loss(model, batch) < before_loss

    adapter_dir = tmp_path / "adapter"
    save_adapter(model, prepared.tokenizer, prepared.spec, adapter_dir, finetune=finetune)
    assert (adapter_dir / WEIGHTS_FILENAME).is_file() and (adapter_dir / "longpeft.json").is_file()
    assert (adapter_dir / "adapter_config.json").is_file() == (finetune == "lora")
    loaded = longpeft.load(str(base), adapter_dir, attn_implementation="sdpa").to(model.device).eval()
    model.eval()
    ids = batch["input_ids"][:1]
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("attn", "pos", "unscored"),
    [
        ("full-coverage", "interleave", False),  # the released layout: its first window's tokens read beacons
        ("full-coverage", "append", True),
        ("step-expansion", "append", True),
        ("step-expansion", "interleave", True),
        ("segmentation", "append", True),
    ],
)
def test_training_labels_leave_the_first_window_out_as_the_authors_do(attn, pos, unscored):
    """Reference: position by position, a target t (label column t, predicted from token t - 1) is left out when
    t <= window, with every layout but full-coverage + interleave."""
    from longpeft.adapters.beacon import METHOD, BeaconConfig

    config = BeaconConfig(
        window=4, ratios=[2], attn=attn, pos=pos, attend_prev=False if attn != "full-coverage" else None
    )
    labels = torch.arange(2 * 11).reshape(2, 11)
    labels[1, 9:] = -100  # padding stays unscored
    expected = labels.clone()
    for row in range(2):
        for t in range(11):
            if unscored and t <= 4:
                expected[row, t] = -100
    assert torch.equal(METHOD.training_labels(config, labels), expected)
    assert labels[0, 1] == 1  # the caller's batch is not changed in place


def test_the_runner_applies_the_rule_to_every_training_batch(tiny_base_dirs, chat_jsonl, tmp_path):
    from longpeft.recipes.trainer import MethodTrainingLabels

    base = tiny_base_dirs("llama")
    prepared = prepare(
        beacon_recipe(
            base,
            chat_jsonl,
            tmp_path / "run",
            "beacon.attn=step-expansion",
            "beacon.pos=append",
            "train.assistant_only_loss=false",
        )
    )  # prompts scored too
    collator = prepared.trainer.data_collator
    assert isinstance(collator, MethodTrainingLabels)
    features = [prepared.trainer.train_dataset[i] for i in range(2)]
    batch, plain = collator(features), collator.collator(features)
    assert (batch["labels"][:, : 16 + 1] == -100).all()
    assert torch.equal(batch["labels"][:, 17:], plain["labels"][:, 17:]) and (plain["labels"][:, :17] != -100).any()
    assert prepared.data_stats["kept"] == 8 and prepared.data_stats["dropped_without_scored_tokens"] == 0
    with pytest.raises(ValueError, match="Activation Beacon does not score the first window"):  # every answer in it
        prepare(
            beacon_recipe(
                base,
                chat_jsonl,
                tmp_path / "short",
                "beacon.attn=step-expansion",
                "beacon.pos=append",
                "beacon.window=256",
                "data.max_length=240",
            )
        )
    assert (
        prepare(
            beacon_recipe(base, chat_jsonl, tmp_path / "short-released", "beacon.window=256", "data.max_length=240")
        ).data_stats["kept"]
        == 8
    )  # the rule, not the data, emptied it
    released = prepare(beacon_recipe(base, chat_jsonl, tmp_path / "released", "train.assistant_only_loss=false"))
    collator = released.trainer.data_collator  # full-coverage + interleave: every target stays
    assert torch.equal(collator(features)["labels"], collator.collator(features)["labels"])


def test_beacon_recipes_validate_and_refuse_what_cannot_train():
    recipe = load_recipe("beacon-llama3-8b-instruct")
    beacon = recipe.beacon.resolved()
    assert (beacon.window, beacon.sink, beacon.ratios, beacon.attn, beacon.pos, beacon.params) == (
        1024,
        1,
        [2, 4, 8],
        "full-coverage",
        "interleave",
        ["q", "k", "v"],
    )
    assert recipe.finetune == "method" and recipe.train.learning_rate == 1e-5 and recipe.data.max_length == 20000
    assert recipe.data.min_length == 7200  # the authors' --min_length
    # stage 1, the authors' pretraining: plain text of 2400..20000 tokens, ratios up to 32, transformers' default lr;
    # the same beacon layout, and stage 2 starts from its adapter
    pretrain = load_recipe("beacon-llama3-8b-instruct-pretrain")
    assert pretrain.beacon.resolved().ratios == [2, 4, 8, 16, 32]
    assert pretrain.beacon.model_dump(exclude={"ratios"}) == recipe.beacon.model_dump(exclude={"ratios"})
    assert (pretrain.data.format, pretrain.data.min_length, pretrain.data.max_length) == ("text", 2400, 20000)
    assert (pretrain.finetune, pretrain.train.learning_rate, pretrain.model) == (
        "method",
        5e-5,
        recipe.model.model_copy(update={"init_from": None}),
    )
    assert Path(recipe.model.init_from) == pretrain.resolved_output_dir() / "adapter"
    paper = load_recipe("beacon-llama3-8b-instruct", ["beacon.attn=step-expansion"]).beacon.resolved()
    assert paper.attn == "step-expansion" and paper.attend_prev is False
    with pytest.raises(RecipeError, match="4-bit"):
        load_recipe("tiny-beacon-cpu", ["model.load_in_4bit=true"])
    with pytest.raises(RecipeError, match="has none"):
        load_recipe("tiny-cpu", ["finetune=method"])


class _KillAtStep3(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 3:
            raise KeyboardInterrupt("killed at step 3")


@pytest.mark.parametrize("finetune", ["method", "lora"])
def test_a_killed_beacon_run_resumes_with_its_trained_beacons(tiny_base_dirs, chat_jsonl, tmp_path, finetune):
    """peft's checkpoints hold LoRA only, the Trainer's would hold the whole frozen base: longpeft's hold the beacon
    weights (beside LoRA, or alone with finetune: method), and a killed run resumes to the straight run's weights."""
    base = tiny_base_dirs("llama")
    extra = ["train.max_steps=4", "train.save_steps=2"]
    if finetune == "lora":
        extra += ["finetune=lora", "lora.r=2", "lora.embeddings=none"]
    straight = run(beacon_recipe(base, chat_jsonl, tmp_path / "straight", *extra))
    killed = beacon_recipe(base, chat_jsonl, tmp_path / "killed", *extra)
    with pytest.raises(KeyboardInterrupt):
        run(killed, callbacks=[_KillAtStep3()])
    checkpoint = tmp_path / "killed" / "checkpoints" / "checkpoint-2"
    weights = sorted(p.name for p in checkpoint.glob("*.safetensors"))
    assert weights == sorted([WEIGHTS_FILENAME] + (["adapter_model.safetensors"] if finetune == "lora" else []))
    beacon_bytes = (checkpoint / WEIGHTS_FILENAME).stat().st_size
    assert (
        sum(p.stat().st_size for p in checkpoint.iterdir() if p.is_file() and p.suffix in (".safetensors", ".bin"))
        < beacon_bytes * 1.5
    )  # no copy of the frozen base (the tiny base is as large as its beacons)
    resumed = run(killed, resume=True)
    names = [WEIGHTS_FILENAME] + (["adapter_model.safetensors"] if finetune == "lora" else [])
    for name in names:
        a, b = load_file(straight.adapter_dir / name), load_file(resumed.adapter_dir / name)
        assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a), name


def test_a_checkpoint_without_its_beacon_weights_is_refused_with_what_to_do(tiny_base_dirs, chat_jsonl, tmp_path):
    base = tiny_base_dirs("llama")
    recipe = beacon_recipe(
        base,
        chat_jsonl,
        tmp_path / "run",
        "finetune=lora",
        "lora.r=2",
        "lora.embeddings=none",
        "train.max_steps=2",
        "train.save_steps=2",
    )
    run(recipe)
    # e.g. written by an older longpeft
    (tmp_path / "run" / "checkpoints" / "checkpoint-2" / WEIGHTS_FILENAME).unlink()
    with pytest.raises(ValueError, match="checkpoint-2 lacks the method weights.*delete that folder"):
        run(recipe, resume=True)


def test_beacon_weights_are_saved_from_a_gathered_state_dict(tiny_base_dirs, tmp_path):
    """A sharded run (FSDP, ZeRO-3) saves from the state dict the Trainer gathered, not from the sharded parameters."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from longpeft.adapters.beacon import BeaconConfig, apply_beacon, save_beacon_weights

    model = AutoModelForCausalLM.from_pretrained(str(tiny_base_dirs("llama")), attn_implementation="sdpa")
    apply_beacon(model, BeaconConfig(window=16).settings())
    model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    gathered = {name: tensor + 1 for name, tensor in model.state_dict().items()}
    saved = load_file(save_beacon_weights(model, tmp_path / "gathered", gathered))
    own = beacon_parameters(model)
    assert len(saved) == len(own)
    for name, parameter in own.items():
        torch.testing.assert_close(saved[f"model.{name}"], parameter.detach() + 1, atol=0, rtol=0)
    some = next(iter(own.values()))
    some.data = torch.empty(0)  # what a ZeRO-3 process holds of a parameter
    with pytest.raises(
        ValueError, match="sharded across processes.*stage3_gather_16bit_weights_on_model_save.*fsdp2 or ddp"
    ):
        save_beacon_weights(model, tmp_path / "sharded")


def test_two_process_ddp_equals_one_process(tiny_base_dirs, chat_jsonl, tmp_path):
    """--launch ddp, the launch Activation Beacon trains under: 2 CPU processes whose samples span different numbers
    of windows give the losses (rel 1e-4) and beacon weights (atol 1e-5) of one process with the same global batch.
    One condensing ratio: random ratios are drawn from each process's own generator, so they differ from one
    process's draws."""
    import subprocess
    import sys
    from pathlib import Path

    from longpeft.launch import launch_command

    from run_helpers import assert_same_weights, logged_losses  # tests/run_helpers.py

    base = tiny_base_dirs("llama")
    overrides = [
        f"model.name_or_path={base}",
        f"data.source={chat_jsonl}",
        "data.max_length=256",
        "beacon.window=16",
        "beacon.ratios=[4]",
        "train.max_steps=2",
        "train.per_device_batch_size=1",
        "train.global_batch_size=2",
        "train.learning_rate=0.02",
    ]
    two = tmp_path / "ddp"
    command = launch_command(
        load_recipe("tiny-beacon-cpu", overrides), "tiny-beacon-cpu", "ddp", 2, [*overrides, f"output_dir={two}"]
    )
    command[:2] = [str(Path(sys.executable).parent / "accelerate"), "launch", "--main_process_port", "29539"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    single = run(load_recipe("tiny-beacon-cpu", [*overrides, f"output_dir={tmp_path / 'one'}"]))

    assert logged_losses(two)[1] == pytest.approx(logged_losses(single.output_dir)[1], rel=1e-4)
    assert_same_weights(
        single.adapter_dir / WEIGHTS_FILENAME, two / "adapter" / WEIGHTS_FILENAME, atol=1e-5, rtol=1e-4
    )
