"""Recipes: validation errors, QLoRA on CPU, chunked loss, kill + resume, the 80K recipe's settings."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import TrainerCallback

from longpeft import recipes
from longpeft.cli import main
from longpeft.launch.topology import gradient_accumulation
from longpeft.recipes.runner import prepare, run
from longpeft.recipes.schema import RecipeError, load_recipe

from conftest import write_chat_jsonl  # tests/conftest.py
from run_helpers import (  # tests/run_helpers.py
    assert_resumed_as_uninterrupted,
    assert_same_weights,
    logged_losses,
    undo_after_checkpoint,
)

pytestmark = pytest.mark.compat  # also run by `make test-compat` (transformers 5.17, trl 1.15, datasets 4)


def tiny_recipe(base_dir, data_path, out_dir, **train):
    settings = dict(max_steps=2, save_steps=2, per_device_batch_size=1, global_batch_size=1, seed=0)
    settings.update(train)
    return load_recipe(
        "tiny-cpu",
        [
            f"model.name_or_path={base_dir}",
            f"data.source={data_path}",
            "data.max_length=256",
            "rope.max_position_embeddings=512",
            f"output_dir={out_dir}",
            "lora.r=4",
        ]
        + [f"train.{k}={v}" for k, v in settings.items()],
    )


def test_bad_key_fails_naming_it(tmp_path, capsys):
    recipe = yaml.safe_load((Path(recipes.__file__).parent / "tiny-cpu.yaml").read_text())
    recipe["lora"]["rank"] = 8
    recipe["train"]["learning_rate"] = "fast"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert "lora.rank: unknown key" in err and "train.learning_rate" in err and str(path) in err
    # and through the real console entry point
    proc = subprocess.run([sys.executable, "-m", "longpeft.cli", "plan", str(path)], capture_output=True, text=True)
    assert proc.returncode != 0 and "lora.rank" in proc.stderr


def test_overrides_and_unknown_recipe():
    with pytest.raises(RecipeError, match="neither a file nor a bundled recipe"):
        load_recipe("no-such-recipe")
    with pytest.raises(RecipeError, match="section.key=value"):
        load_recipe("tiny-cpu", ["train.max_steps"])
    assert load_recipe("tiny-cpu", ["train.max_steps=3"]).train.max_steps == 3


def test_global_batch_derives_accumulation():
    recipe = load_recipe("llama3-8b-instruct-80k-qlora")
    assert gradient_accumulation(recipe, 8) == 1
    assert gradient_accumulation(recipe, 2) == 4
    with pytest.raises(ValueError, match="global_batch_size"):
        gradient_accumulation(recipe, 3)


def test_80k_recipe_has_the_paper_settings():
    r = load_recipe("llama3-8b-instruct-80k-qlora")
    assert (r.lora.r, r.lora.alpha, r.lora.embeddings) == (32, 16, "full")
    assert r.lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert r.rope.rope_theta == 2e8 and r.rope.max_position_embeddings == 81920
    assert (r.train.learning_rate, r.train.lr_scheduler_type, r.train.warmup_steps) == (5e-5, "linear", 0)
    assert (r.train.per_device_batch_size, r.train.global_batch_size, r.train.num_train_epochs) == (1, 8, 1)
    assert r.model.load_in_4bit and r.model.bnb_4bit_quant_type == "nf4"
    assert r.model.eos_token_ids == [128001, 128009] and r.data.max_length == 81920
    assert r.train.gradient_checkpointing and r.train.assistant_only_loss


def test_chunked_loss_equals_full_logits_loss(tiny_base_dirs, chat_jsonl, tmp_path):
    """The trainer's loss never builds [batch, seq, vocab] logits, and equals the direct computation."""
    prepared = prepare(
        tiny_recipe(
            tiny_base_dirs("llama"), chat_jsonl, tmp_path / "run", per_device_batch_size=2, global_batch_size=2
        )
    )
    trainer = prepared.trainer
    batch = next(iter(trainer.get_train_dataloader()))
    model = trainer.model.eval()
    with torch.no_grad():
        fused = model(**{k: v for k, v in batch.items() if k != "labels"}, labels=batch["labels"], fused_lm_head=True)
        assert getattr(fused, "logits", None) is None
        loss = trainer.compute_loss(model, dict(batch))
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"][:, 1:]
    assert (labels != -100).any() and (labels == -100).any()  # assistant-only: prompt tokens are masked
    reference = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=-100
    )
    assert torch.allclose(loss, reference, atol=1e-5)


def test_qlora_4bit_trains_on_cpu(tiny_base_dirs, chat_jsonl, tmp_path):
    import bitsandbytes as bnb

    recipe = tiny_recipe(tiny_base_dirs("qwen2"), chat_jsonl, tmp_path / "run", max_steps=2)
    recipe.model.load_in_4bit = True
    recipe.model.dtype = "float32"
    prepared_check = prepare(recipe)
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in prepared_check.trainer.model.modules())
    result = run(recipe.model_copy(update={"output_dir": str(tmp_path / "run2")}))
    assert result.metrics["steps"] == 2 and torch.isfinite(torch.tensor(result.metrics["final_loss"]))
    weights = load_file(result.adapter_dir / "adapter_model.safetensors")
    lora_b = [v for k, v in weights.items() if "lora_B" in k]
    assert lora_b and all(v.abs().sum() > 0 for v in lora_b)  # B starts at zero: training moved it
    assert any("embed_tokens" in k for k in weights)  # the full embedding is trained and saved
    spec = json.loads((result.adapter_dir / "longpeft.json").read_text())
    assert spec["methods"]["rope"]["rope_theta"] == 1e6 and spec["method"] == "rope"
    assert (result.output_dir / "loss.png").is_file() and (result.output_dir / "metrics.json").is_file()
    lines = (result.output_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines if "loss" in json.loads(line)] == [1, 2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_activation_offloading_without_a_gpu_is_refused_before_the_base_loads(tiny_base_dirs, chat_jsonl, tmp_path):
    """TRL's offloader fails on CPU with "'NoneType' object has no attribute 'type'"; the runner says why first."""
    recipe = tiny_recipe(tiny_base_dirs("llama"), chat_jsonl, tmp_path / "run", max_steps=1)
    recipe.train.activation_offloading = True
    with pytest.raises(ValueError, match="train.activation_offloading .* no CUDA GPU"):
        prepare(recipe)
    assert not (tmp_path / "run" / "adapter").exists()


@pytest.mark.parametrize("trainable_dtype", [None, "bfloat16"])
def test_qlora_keeps_trained_weights_in_float32_and_the_residual_stream_in_bf16(
    tiny_base_dirs, chat_jsonl, tmp_path, trainable_dtype
):
    """TRL casts trained weights to bf16 over a 4-bit base: at lr 5e-5 AdamW then lost 44 % of the embedding's
    updates (tiny model, 2 steps). They stay float32 (lora.trainable_dtype), and the float32 embedding copy's output
    is cast back to bf16, so the layers' inputs (what checkpointing keeps) do not double."""
    recipe = tiny_recipe(tiny_base_dirs("llama"), chat_jsonl, tmp_path / "run", max_steps=2, learning_rate=5e-5)
    recipe.model.load_in_4bit, recipe.model.dtype = True, "bfloat16"
    recipe.lora.trainable_dtype = trainable_dtype
    trainer = prepare(recipe).trainer
    trained = {name: p for name, p in trainer.model.named_parameters() if p.requires_grad}
    assert {p.dtype for p in trained.values()} == {torch.bfloat16 if trainable_dtype else torch.float32}
    layer_inputs = []
    layer = trainer.model.get_base_model().model.layers[0]
    layer.register_forward_pre_hook(
        lambda m, args, kwargs: layer_inputs.append((args or [kwargs["hidden_states"]])[0].dtype), with_kwargs=True
    )
    embedding = next(p for name, p in trained.items() if "embed_tokens" in name)
    before = embedding.detach().clone()
    trainer.train()
    assert set(layer_inputs) == {torch.bfloat16}
    rows = (embedding.detach() != before).any(dim=1)
    moved = (embedding.detach()[rows] != before[rows]).float().mean().item()
    assert rows.sum() > 10 and (moved == 1.0 if trainable_dtype is None else moved < 0.9)


class KillAtStep(TrainerCallback):
    """Simulates a kill: raise once the given optimizer step is done (after the checkpoint before it)."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise KeyboardInterrupt(f"killed at step {self.step}")


def test_kill_and_resume_gives_the_uninterrupted_adapter(tiny_base_dirs, chat_jsonl, tmp_path):
    base = tiny_base_dirs("llama")
    settings = dict(max_steps=4, save_steps=2, per_device_batch_size=1, global_batch_size=2)
    straight = run(tiny_recipe(base, chat_jsonl, tmp_path / "straight", **settings))

    killed = tiny_recipe(base, chat_jsonl, tmp_path / "killed", **settings)
    with pytest.raises(KeyboardInterrupt):
        run(killed, callbacks=[KillAtStep(3)])
    with pytest.raises(FileExistsError, match="--resume"):
        run(killed)
    resumed = run(killed, resume=True)

    a = load_file(straight.adapter_dir / "adapter_model.safetensors")
    b = load_file(resumed.adapter_dir / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key], b[key], atol=1e-6), key
    records = [json.loads(line) for line in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]  # the killed step 3 is not logged twice


@pytest.mark.launch_matrix  # the older stack: the kill-and-resume test above runs two processes too
def test_two_process_training_with_accelerate_on_cpu(tiny_base_dirs, chat_jsonl, tmp_path):
    """`longpeft train --launch ddp`'s command (the shipped ddp.yaml, the recipe's float32: no autocast) spawns 2 CPU
    processes (gloo); the global batch is split across them."""
    from longpeft.launch import launch_command

    out = tmp_path / "mp"
    overrides = [
        f"model.name_or_path={tiny_base_dirs('llama')}",
        f"data.source={chat_jsonl}",
        f"output_dir={out}",
        "train.max_steps=2",
        "train.global_batch_size=2",
        "train.per_device_batch_size=1",
        "data.max_length=256",
    ]
    command = launch_command(load_recipe("tiny-cpu", overrides), "tiny-cpu", "ddp", 2, overrides)
    assert command[:2] == ["accelerate", "launch"] and command[command.index("--mixed_precision") + 1] == "no"
    command[:2] = [str(Path(sys.executable).parent / "accelerate"), "launch", "--main_process_port", "29531"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, failure(proc)
    resolved = json.loads((out / "recipe.resolved.json").read_text())
    assert resolved["world_size"] == 2 and resolved["gradient_accumulation_steps"] == 1
    assert resolved["distributed_type"].endswith("MULTI_CPU")  # DDP over gloo
    assert (out / "adapter" / "adapter_model.safetensors").is_file() and (out / "adapter" / "longpeft.json").is_file()
    summary = json.loads((out / "metrics.json").read_text())
    assert summary["steps"] == 2 and summary["train"]["epoch"] == 0.5  # 2 steps x 2 processes = 4 of 8 samples

    # DDP equals one process with the same global batch (1 sample x 2 accumulation steps), to float32 rounding.
    single = run(
        load_recipe(
            "tiny-cpu",
            [
                f"model.name_or_path={tiny_base_dirs('llama')}",
                f"data.source={chat_jsonl}",
                f"output_dir={tmp_path / 'one'}",
                "train.max_steps=2",
                "train.global_batch_size=2",
                "train.per_device_batch_size=1",
                "data.max_length=256",
            ],
        )
    )

    assert logged_losses(out)[1] == pytest.approx(logged_losses(single.output_dir)[1], rel=1e-4)
    assert_same_weights(
        single.adapter_dir / "adapter_model.safetensors",
        out / "adapter" / "adapter_model.safetensors",
        atol=1e-5,
        rtol=1e-4,
    )


def test_two_process_kill_and_resume_equals_an_uninterrupted_run(tiny_base_dirs, chat_jsonl, tmp_path):
    """2 processes: a run killed after checkpoint 2 of 4, resumed with --resume, ends with the adapter and
    loss curve of the run that was never interrupted."""

    def launch(out, *extra):
        command = [
            str(Path(sys.executable).parent / "accelerate"),
            "launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            "29532",
            "-m",
            "longpeft.cli",
            "train",
            "tiny-cpu",
            *extra,
            "--set",
            f"model.name_or_path={tiny_base_dirs('llama')}",
            "--set",
            f"data.source={chat_jsonl}",
            "--set",
            f"output_dir={out}",
            "--set",
            "train.max_steps=4",
            "--set",
            "train.save_steps=2",
            "--set",
            "train.global_batch_size=2",
            "--set",
            "train.per_device_batch_size=1",
            "--set",
            "data.max_length=256",
            "--set",
            "lora.embeddings=none",
        ]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, failure(proc)

    whole, killed = tmp_path / "whole", tmp_path / "killed"
    launch(whole)
    undo_after_checkpoint(whole, killed, 2, 4)
    launch(killed, "--resume")
    assert_resumed_as_uninterrupted(whole, killed, [1, 2, 3, 4])


def sharded_launch(launch, out, base, data, processes, port, *extra, on_cpu=False, recipe="tiny-cpu"):
    """accelerate launch with the shipped FSDP2 or ZeRO-3 config (fp32 here, so it can be compared with one process).
    ``on_cpu``: FSDP2 through tests/fsdp2_cpu_entry.py, which lets accelerate's FSDP2 path run on CPU processes
    (DeepSpeed needs no such help: its CPU accelerator runs ZeRO-3 over gloo under accelerate as it is)."""
    from longpeft.launch import config_file

    lifted = on_cpu and launch == "fsdp2"
    entry = [str(Path(__file__).with_name("fsdp2_cpu_entry.py"))] if lifted else ["-m", "longpeft.cli"]
    command = [
        str(Path(sys.executable).parent / "accelerate"),
        "launch",
        "--config_file",
        str(config_file(launch)),
        "--num_processes",
        str(processes),
        "--mixed_precision",
        "no",
        "--main_process_port",
        str(port),
        *entry,
        "train",
        recipe,
        "--set",
        f"model.name_or_path={base}",
        "--set",
        f"data.source={data}",
        "--set",
        f"output_dir={out}",
        "--set",
        "train.max_steps=2",
        "--set",
        "train.global_batch_size=2",
        "--set",
        "train.per_device_batch_size=1",
        "--set",
        "data.max_length=256",
        *extra,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


SHARDED = [pytest.param("fsdp2", id="fsdp2"), pytest.param("zero3", id="zero3")]
DISTRIBUTED_TYPE = {"fsdp2": "FSDP", "zero3": "DEEPSPEED"}
# what a sharded checkpoint holds instead of whole weights: accelerate's DCP folders, DeepSpeed's partitions
SHARDS = {"fsdp2": "pytorch_model_fsdp_0/*.distcp", "zero3": "global_step*/*zero_pp_rank_1*"}


def failure(proc: subprocess.CompletedProcess) -> str:
    """What a failed multi-process run printed that explains it: every rank's error lines, then the end."""
    errors = [line for line in proc.stderr.splitlines() if re.search(r"Error|enforce|what\(\)", line)]
    return "\n".join(errors[:40]) + "\n...\n" + proc.stderr[-2000:]


@pytest.mark.launch_matrix
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_fsdp2_launch_on_cpu_is_refused_instead_of_running_ddp(tiny_base_dirs, chat_jsonl, tmp_path):
    """accelerate makes every multi-process CPU run MULTI_CPU (DDP) whatever the config says; the runner refuses."""
    proc = sharded_launch("fsdp2", tmp_path / "run", tiny_base_dirs("llama"), chat_jsonl, 2, 29533)
    assert proc.returncode != 0
    assert "the launch config asks for FSDP, but accelerate set up MULTI_CPU" in proc.stderr, failure(proc)
    assert not (tmp_path / "run" / "adapter").exists()


@pytest.mark.launch_matrix  # make test runs the DDP kill-and-resume above; make test-slow runs these
@pytest.mark.parametrize("launch", [SHARDED[0], "zero3"])
def test_two_process_sharded_run_equals_one_process_and_resumes_from_sharded_checkpoints(
    tiny_base_dirs, chat_jsonl, tmp_path, launch
):
    """FSDP2 or DeepSpeed ZeRO-3 (LoRA + trained embedding, parameters sharded over 2 processes: GPUs, or CPU
    processes over gloo: FSDP2 through tests/fsdp2_cpu_entry.py) gives the losses (rel 1e-3) and adapter (atol 1e-4) of
    one process with the same global batch (1 sample x 2 accumulation steps). Its checkpoints are sharded: the run
    killed after checkpoint 2 of 4 and resumed with --resume ends with the adapter and losses of the whole run."""
    base, on_cpu = tiny_base_dirs("llama"), torch.cuda.device_count() < 2
    port = {"fsdp2": 29534, "zero3": 29550}[launch]  # and the next two
    steps = ("--set", "train.max_steps=4", "--set", "train.save_steps=2")
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    proc = sharded_launch(launch, whole, base, chat_jsonl, 2, port, *steps, on_cpu=on_cpu)
    assert proc.returncode == 0, failure(proc)
    resolved = json.loads((whole / "recipe.resolved.json").read_text())
    assert resolved["distributed_type"].endswith(DISTRIBUTED_TYPE[launch]) and resolved["world_size"] == 2
    single = run(
        load_recipe(
            "tiny-cpu",
            [
                f"model.name_or_path={base}",
                f"data.source={chat_jsonl}",
                f"output_dir={tmp_path / 'one'}",
                "train.max_steps=4",
                "train.save_steps=2",
                "train.global_batch_size=2",
                "train.per_device_batch_size=1",
                "data.max_length=256",
            ],
        )
    )
    assert logged_losses(whole)[1] == pytest.approx(logged_losses(single.output_dir)[1], rel=1e-3)
    assert_same_weights(
        single.adapter_dir / "adapter_model.safetensors",
        whole / "adapter" / "adapter_model.safetensors",
        atol=1e-4,
        rtol=1e-3,
    )

    assert any((whole / "checkpoints" / "checkpoint-2").glob(SHARDS[launch]))  # sharded, not whole
    undo_after_checkpoint(whole, killed, 2, 4)
    proc = sharded_launch(launch, killed, base, chat_jsonl, 2, port + 1, *steps, "--resume", on_cpu=on_cpu)
    assert proc.returncode == 0, failure(proc)
    assert "resuming from" in proc.stderr and "checkpoint-2" in proc.stderr
    assert_resumed_as_uninterrupted(whole, killed, [1, 2, 3, 4])

    shutil.rmtree(killed / "adapter")  # killed after the last checkpoint: its weights are saved, no step trained
    proc = sharded_launch(launch, killed, base, chat_jsonl, 2, port + 2, *steps, "--resume", on_cpu=on_cpu)
    assert proc.returncode == 0, failure(proc)
    assert "checkpoint-4 is the run's last step; saving it without training" in proc.stderr
    assert_resumed_as_uninterrupted(whole, killed, [1, 2, 3, 4])


@pytest.fixture(scope="module")
def qlora_one_process(tiny_base_dirs, tmp_path_factory):
    """The QLoRA run (4-bit NF4 base, LoRA) in one process, with the global batch of the sharded runs."""
    data = write_chat_jsonl(tmp_path_factory.mktemp("qlora-data") / "train.jsonl")
    out = tmp_path_factory.mktemp("qlora-one") / "run"
    run(
        load_recipe(
            "tiny-cpu",
            [
                f"model.name_or_path={tiny_base_dirs('llama')}",
                f"data.source={data}",
                f"output_dir={out}",
                "model.load_in_4bit=true",
                "train.max_steps=2",
                "train.global_batch_size=2",
                "train.per_device_batch_size=1",
                "data.max_length=256",
            ],
        )
    )
    return data, out


@pytest.mark.launch_matrix
@pytest.mark.parametrize("launch", SHARDED)
def test_qlora_with_its_4bit_base_sharded_equals_one_process(tiny_base_dirs, qlora_one_process, tmp_path, launch):
    """A 4-bit NF4 base (quant storage in the compute dtype) under --launch fsdp2 or zero3 over 2 processes: the
    losses (rel 1e-3) and the adapter (atol 1e-4) of one process with the same global batch."""
    data, single = qlora_one_process
    port = {"fsdp2": 29546, "zero3": 29547}[launch]
    proc = sharded_launch(
        launch,
        tmp_path / "sharded",
        tiny_base_dirs("llama"),
        data,
        2,
        port,
        "--set",
        "model.load_in_4bit=true",
        on_cpu=torch.cuda.device_count() < 2,
    )
    assert proc.returncode == 0, failure(proc)
    resolved = json.loads((tmp_path / "sharded" / "recipe.resolved.json").read_text())
    assert resolved["distributed_type"].endswith(DISTRIBUTED_TYPE[launch]) and resolved["quantization"]["load_in_4bit"]
    assert logged_losses(tmp_path / "sharded")[1] == pytest.approx(logged_losses(single)[1], rel=1e-3)
    assert_same_weights(
        single / "adapter" / "adapter_model.safetensors",
        tmp_path / "sharded" / "adapter" / "adapter_model.safetensors",
        atol=1e-4,
        rtol=1e-3,
    )


@pytest.mark.launch_matrix
@pytest.mark.parametrize(("recipe", "port"), [("tiny-cpu", 29548), ("tiny-harpe-cpu", 29549)])
def test_ulysses_sequence_parallel_equals_one_process(tiny_base_dirs, chat_jsonl, tmp_path, recipe, port):
    """--launch ulysses over 2 processes (DeepSpeed ZeRO-3 with each sequence split in two, the attention heads
    exchanged all-to-all; the command built by longpeft.launch), with one RoPE base or HARPE's per-head bases: the
    losses (rel 1e-3) and adapter (atol 1e-4) of one process with the same global batch. Every sequence is padded to
    256 tokens here: on CPU, gloo gathers only equal shapes across the sequence-parallel group (NCCL takes any)."""
    from longpeft.launch import launch_command

    overrides = [
        f"model.name_or_path={tiny_base_dirs('llama')}",
        f"data.source={chat_jsonl}",
        "data.max_length=256",
        "train.max_steps=2",
        "train.global_batch_size=1",
        "train.per_device_batch_size=1",
        "trl.pad_to_multiple_of=256",
    ]
    command = launch_command(
        load_recipe(recipe, overrides), recipe, "ulysses", 2, [*overrides, f"output_dir={tmp_path / 'ulysses'}"]
    )
    command[:2] = [str(Path(sys.executable).parent / "accelerate"), "launch", "--main_process_port", str(port)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, failure(proc)
    resolved = json.loads((tmp_path / "ulysses" / "recipe.resolved.json").read_text())
    assert resolved["distributed_type"].endswith("DEEPSPEED") and resolved["world_size"] == 2
    assert resolved["effective_global_batch_size"] == 1  # both processes read the same sequence
    single = run(load_recipe(recipe, [*overrides, f"output_dir={tmp_path / 'one'}"]))
    assert logged_losses(tmp_path / "ulysses")[1] == pytest.approx(logged_losses(single.output_dir)[1], rel=1e-3)
    assert_same_weights(
        single.adapter_dir / "adapter_model.safetensors",
        tmp_path / "ulysses" / "adapter" / "adapter_model.safetensors",
        atol=1e-4,
        rtol=1e-3,
    )


@pytest.mark.launch_matrix
@pytest.mark.parametrize("launch", SHARDED)
def test_sharded_full_fine_tune_of_harpe_equals_one_process(tiny_base_dirs, chat_jsonl, tmp_path, launch):
    """The HARPE recipe's run (finetune: full under --launch fsdp2 or zero3, every weight sharded over 2 processes):
    the losses (rel 1e-3) and the saved model (atol 1e-4), per-head bases included, of one process with the same
    global batch. Under DeepSpeed, whose engine re-creates the rotary buffers, this also checks that the per-head
    frequencies survive (KeepRotaryFrequencies)."""
    base = tiny_base_dirs("llama")
    full = ("--set", "finetune=full", "--set", "rope.max_position_embeddings=1024")
    port = {"fsdp2": 29538, "zero3": 29542}[launch]
    proc = sharded_launch(
        launch,
        tmp_path / "sharded",
        base,
        chat_jsonl,
        2,
        port,
        *full,
        on_cpu=torch.cuda.device_count() < 2,
        recipe="tiny-harpe-cpu",
    )
    assert proc.returncode == 0, failure(proc)
    single = run(
        load_recipe(
            "tiny-harpe-cpu",
            [
                f"model.name_or_path={base}",
                f"data.source={chat_jsonl}",
                f"output_dir={tmp_path / 'one'}",
                "finetune=full",
                "rope.max_position_embeddings=1024",
                "train.max_steps=2",
                "train.global_batch_size=2",
                "train.per_device_batch_size=1",
                "data.max_length=256",
            ],
        )
    )

    assert logged_losses(tmp_path / "sharded")[1] == pytest.approx(logged_losses(single.output_dir)[1], rel=1e-3)
    one = load_file(single.adapter_dir / "model.safetensors")
    two = load_file(tmp_path / "sharded" / "model" / "model.safetensors")
    assert one.keys() == two.keys() and len(one) > 10
    for key in one:
        torch.testing.assert_close(two[key], one[key], atol=1e-4, rtol=1e-3)
    configs = [
        json.loads((folder / "config.json").read_text())
        for folder in (single.adapter_dir, tmp_path / "sharded" / "model")
    ]
    assert configs[0]["head_rope_bases"] == configs[1]["head_rope_bases"] and configs[1]["auto_map"]


@pytest.mark.launch_matrix
@pytest.mark.parametrize(("launch", "how", "port"), [("fsdp2", "FSDP", 29537), ("zero3", "DeepSpeed ZeRO-3", 29544)])
def test_beacon_under_sharding_is_refused_before_training(tiny_base_dirs, chat_jsonl, tmp_path, launch, how, port):
    """Activation Beacon under FSDP2 or ZeRO-3 (here from the launch config itself, as a user's own accelerate config
    would set it): the processes' window counts differ, so their collectives would not match (gloo failed mid-step;
    NCCL would hang). The runner refuses before the first step."""
    proc = sharded_launch(
        launch, tmp_path / "run", tiny_base_dirs("llama"), chat_jsonl, 2, port, on_cpu=True, recipe="tiny-beacon-cpu"
    )
    assert proc.returncode != 0
    assert f"{how} with beacon: Activation Beacon runs the decoder once per window" in proc.stderr, failure(proc)
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())


def test_80k_recipe_builds_its_trainer_on_a_tiny_stand_in(tmp_path, capsys):
    """`longpeft plan --build --stand-in llama`: no download, every paper setting in the printed config."""
    # an earlier stage's adapter was trained on the real base: the stand-in leaves it out (it would not fit)
    code = main(
        [
            "plan",
            "llama3-8b-instruct-80k-qlora",
            "--build",
            "--stand-in",
            "llama",
            "--output-dir",
            str(tmp_path),
            "--set",
            "model.init_from=runs/no-such-stage/adapter",
        ]
    )
    assert code == 0
    resolved = json.loads(capsys.readouterr().out)
    assert resolved["init_from"] is None and resolved["recipe"]["model"]["init_from"] is None
    recipe, spec, lora = resolved["recipe"], resolved["context_spec"], resolved["lora"]
    assert (lora["r"], lora["lora_alpha"], lora["modules_to_save"]) == (32, 16.0, ["model.embed_tokens"])
    assert sorted(recipe["lora"]["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    rope = spec["methods"]["rope"]
    assert rope["rope_theta"] == 2e8 and rope["max_position_embeddings"] == 81920
    assert resolved["quantization"]["load_in_4bit"] and resolved["quantization"]["bnb_4bit_quant_type"] == "nf4"
    train = recipe["train"]
    assert (train["learning_rate"], train["lr_scheduler_type"], train["warmup_steps"]) == (5e-5, "linear", 0)
    assert (train["num_train_epochs"], train["gradient_checkpointing"], train["assistant_only_loss"]) == (
        1.0,
        True,
        True,
    )
    assert resolved["effective_global_batch_size"] == 8 and resolved["gradient_accumulation_steps"] == 8
    assert recipe["data"]["max_length"] == 81920 and recipe["model"]["eos_token_ids"] == [128001, 128009]


def test_plain_text_data_trains_on_every_token(tiny_base_dirs, tmp_path):
    path = tmp_path / "text.jsonl"
    path.write_text(
        "".join(json.dumps({"text": f"Report {i}: the river city market opened early."}) + "\n" for i in range(4))
    )
    recipe = tiny_recipe(tiny_base_dirs("llama"), path, tmp_path / "run", per_device_batch_size=2, global_batch_size=2)
    recipe = recipe.model_copy(update={"data": recipe.data.model_copy(update={"format": "text"})})
    prepared = prepare(recipe)
    batch = next(iter(prepared.trainer.get_train_dataloader()))
    assert not prepared.trainer.args.assistant_only_loss
    real = batch["attention_mask"].bool()
    assert (batch["labels"][real] != -100).all()  # no prompt masking on plain text
    with pytest.raises(RecipeError, match="assistant_only_loss"):
        load_recipe("tiny-cpu", ["data.format=text", "data.source=x.jsonl", "train.assistant_only_loss=true"])


def test_bundled_recipes_validate():
    from longpeft.recipes import bundled_recipes

    names = bundled_recipes()
    assert {"tiny-cpu", "llama3-8b-instruct-80k-qlora", "tiny-harpe-cpu", "llama2-7b-harpe-128k"} <= set(names)
    for name in names:
        load_recipe(name)


def test_harpe_recipe_trains_loads_and_merges(tiny_base_dirs, chat_jsonl, tmp_path):
    """method: harpe end to end: bases chosen at adapter creation, recorded, re-applied, exported."""
    import longpeft
    from longpeft import hub
    from longpeft.adapters.harpe import has_head_bases

    recipe = load_recipe(
        "tiny-harpe-cpu",
        [
            f"model.name_or_path={tiny_base_dirs('llama')}",
            f"data.source={chat_jsonl}",
            "data.max_length=256",
            f"output_dir={tmp_path / 'run'}",
            "train.max_steps=1",
            "train.global_batch_size=1",
            "train.per_device_batch_size=1",
            "lora.r=4",
        ],
    )
    result = run(recipe)
    spec = json.loads((result.adapter_dir / "longpeft.json").read_text())
    bases = spec["methods"]["harpe"]["bases"]
    assert spec["method"] == "harpe" and len(bases) == 2  # one base per KV head
    assert bases[0] == 10000.0 and bases == sorted(bases)
    loaded = longpeft.load(None, result.adapter_dir).eval()
    assert has_head_bases(loaded)
    merged = hub.merge(result.adapter_dir, tmp_path / "merged")
    assert merged["max_abs_logit_diff"] < 1e-4
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert "AutoModelForCausalLM" in config["auto_map"] and config["head_rope_bases"] == bases


def test_tiny_base_run_folder_can_be_moved(chat_jsonl, tmp_path):
    """A base generated inside the run folder is named relative to the adapter in longpeft.json."""
    import shutil

    import longpeft

    recipe = load_recipe(
        "tiny-cpu",
        [
            f"data.source={chat_jsonl}",
            "data.max_length=256",
            f"output_dir={tmp_path / 'run'}",
            "train.max_steps=1",
            "train.global_batch_size=1",
            "train.per_device_batch_size=1",
            "lora.r=2",
        ],
    )
    run(recipe)
    spec = json.loads((tmp_path / "run" / "adapter" / "longpeft.json").read_text())
    assert spec["base_model"] == "../base"
    shutil.move(tmp_path / "run", tmp_path / "moved")
    model = longpeft.load(None, tmp_path / "moved" / "adapter")
    assert model.config.rope_parameters["rope_theta"] == 1e6


def test_sharded_checkpoints_count_as_complete(tmp_path):
    """FSDP (accelerate's DCP folders) and DeepSpeed checkpoints are found by --resume like one-process ones; a
    DCP folder without its .metadata (written last) is a torn checkpoint."""
    from accelerate.utils.constants import FSDP_MODEL_NAME, OPTIMIZER_NAME

    from longpeft.recipes.checkpoints import latest_checkpoint

    def checkpoint(step, *paths):
        folder = tmp_path / "checkpoints" / f"checkpoint-{step}"
        for path in paths:
            (folder / path).parent.mkdir(parents=True, exist_ok=True)
            (folder / path).write_text("x")
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        return folder

    fsdp = checkpoint(2, f"{FSDP_MODEL_NAME}_0/.metadata", f"{OPTIMIZER_NAME}_0/.metadata")
    assert latest_checkpoint(tmp_path) == fsdp
    zero3 = checkpoint(4, "adapter_model.safetensors", "global_step4/mp_rank_00_model_states.pt")
    assert latest_checkpoint(tmp_path) == zero3
    checkpoint(6, f"{FSDP_MODEL_NAME}_0/__0_0.distcp", f"{OPTIMIZER_NAME}_0/.metadata")  # weights torn
    report: list[str] = []
    assert latest_checkpoint(tmp_path, report) == zero3 and "checkpoint-6 is incomplete" in report[0]


# The real shapes of the 8B recipes' bases (config.json values), for the checks made before any weight loads.
REAL_BASES = {
    "meta-llama/Meta-Llama-3-8B-Instruct": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        bos_token_id=128000,
        eos_token_id=128009,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    ),
    "meta-llama/Llama-2-7b-hf": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
}
CPU_RECIPES = ["tiny-cpu", "tiny-harpe-cpu", "tiny-beacon-cpu", "toy-extend-cpu"]


@pytest.mark.parametrize("name", recipes.bundled_recipes())
def test_bundled_recipes_pass_the_checks_against_their_base(name, tmp_path):
    """What `longpeft train NAME` checks before any weight loads (positions spanned, token ids), as shipped, on the
    recipe's own base: the CPU recipes' tiny and toy bases, the 8B recipes' bases by their real config values."""
    from transformers import AutoConfig, LlamaConfig

    from longpeft.recipes.base import base_location
    from longpeft.recipes.validate import build_spec, check_against_base

    # HARPE's peak-valley search at 128K (34 s on CPU) is tested in test_harpe_selection; the positions are not its.
    faster = ["harpe.selection=uniform"] if name == "llama2-7b-harpe-128k" else []
    recipe = load_recipe(name, [f"output_dir={tmp_path}", *faster])
    base_id = recipe.model.name_or_path
    if base_id in REAL_BASES:
        config = LlamaConfig(**REAL_BASES[base_id])
    else:
        base_id = base_location(recipe, tmp_path)
        config = AutoConfig.from_pretrained(base_id)
    check_against_base(recipe, build_spec(recipe, config, base_id))
    assert set(REAL_BASES) | {"tiny:llama", "longpeft:toy-base"} >= {recipe.model.name_or_path}
    assert name in CPU_RECIPES or recipe.model.name_or_path in REAL_BASES


@pytest.mark.parametrize("name", CPU_RECIPES)
def test_cpu_recipes_train_as_shipped(name, tmp_path):
    """`longpeft train NAME` (README) runs: the shipped recipe, one optimizer step."""
    result = run(load_recipe(name, [f"output_dir={tmp_path / 'run'}", "train.max_steps=1"]))
    assert (result.adapter_dir / "longpeft.json").is_file() and result.metrics["steps"] == 1


def test_truncation_that_leaves_no_scored_token_says_what_to_do(tiny_base_dirs, chat_jsonl, tmp_path):
    """data.truncate cuts every conversation before its assistant turn: TRL drops them all; the run stops with
    longpeft's message, not torch's "num_samples=0"."""
    base = tiny_base_dirs("llama")
    recipe = load_recipe(
        "tiny-cpu",
        [
            f"model.name_or_path={base}",
            f"data.source={chat_jsonl}",
            "data.max_length=32",
            "data.truncate=true",
            f"output_dir={tmp_path / 'run'}",
            "lora.r=2",
        ],
    )
    with pytest.raises(ValueError, match="no training sample has a scored token within data.max_length=32"):
        prepare(recipe)
    kept = prepare(tiny_recipe(base, chat_jsonl, tmp_path / "run2")).data_stats
    assert kept["kept"] == 8 and kept["dropped_without_scored_tokens"] == 0


def test_min_length_drops_short_samples_and_says_when_none_is_left(tiny_base_dirs, chat_jsonl, tmp_path):
    """data.min_length (the beacon authors' 7200): samples shorter than it are dropped and counted; a value above
    every sample stops with what to do; one above data.max_length is refused before anything loads."""
    from longpeft.recipes.schema import RecipeError

    base = tiny_base_dirs("llama")
    every = prepare(tiny_recipe(base, chat_jsonl, tmp_path / "every"))
    lengths = sorted(len(ids) for ids in every.trainer.train_dataset["input_ids"])
    middle = lengths[len(lengths) // 2]
    recipe = tiny_recipe(base, chat_jsonl, tmp_path / "long")
    recipe = recipe.model_copy(update={"data": recipe.data.model_copy(update={"min_length": middle})})
    kept = prepare(recipe)
    assert kept.data_stats["dropped_short"] == sum(n < middle for n in lengths) > 0
    assert kept.data_stats["kept"] == sum(n >= middle for n in lengths) == len(kept.trainer.train_dataset)
    assert min(len(ids) for ids in kept.trainer.train_dataset["input_ids"]) >= middle
    recipe = recipe.model_copy(update={"data": recipe.data.model_copy(update={"min_length": lengths[-1] + 1})})
    with pytest.raises(ValueError, match=f"every sample is shorter than data.min_length={lengths[-1] + 1} tokens"):
        prepare(recipe)
    with pytest.raises(RecipeError, match=r"data.min_length \(300\) is above data.max_length \(256\)"):
        load_recipe("tiny-cpu", ["data.max_length=256", "data.min_length=300"])


def test_a_bf16_full_fine_tune_trains_float32_weights_and_saves_bf16(tmp_path):
    """A bf16 full fine-tune trained its bf16 weights themselves: at lr 2e-5 AdamW's updates rounded away (74 % of
    the weights never moved in 3 steps). Now every weight trains in float32 under bf16 autocast, and the saved
    model is bf16 again (the recipe's dtype)."""
    from safetensors import safe_open

    from longpeft.recipes.runner import prepare
    from longpeft.recipes.saving import save_adapter

    recipe = load_recipe(
        "tiny-harpe-cpu",
        [
            "finetune=full",
            "model.dtype=bfloat16",
            f"output_dir={tmp_path / 'run'}",
            "train.max_steps=3",
            "train.global_batch_size=2",
            "train.per_device_batch_size=1",
            "train.learning_rate=2e-5",
            "data.demo.n_conversations=8",
        ],
    )
    prepared = prepare(recipe)
    trainer = prepared.trainer
    assert trainer.args.bf16 and {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.dim() == 2}
    trainer.train()
    moved = sum((p.detach() != before[n]).sum().item() for n, p in trainer.model.named_parameters() if n in before)
    assert moved / sum(t.numel() for t in before.values()) > 0.8
    save_adapter(
        trainer.model, prepared.tokenizer, prepared.spec, tmp_path / "model", finetune="full", dtype=torch.bfloat16
    )
    with safe_open(str(tmp_path / "model" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}


def test_rotary_frequencies_cast_by_a_wrapper_are_given_back_float32(tiny_base_dirs, chat_jsonl, tmp_path):
    """DeepSpeed casts a model's buffers with its weights (DeepSpeed#5812): inv_freq in bf16 turns positions near
    100K by hundreds of radians. Simulated here by a cast after prepare, where the Trainer's wrapping happens."""
    from longpeft.recipes.runner import prepare
    from longpeft.rope import rotary_modules

    prepared = prepare(tiny_recipe(tiny_base_dirs("llama"), chat_jsonl, tmp_path / "run", max_steps=1))
    rotary = [module for _, _, module in rotary_modules(prepared.trainer.model)]
    exact = [(m.inv_freq.clone(), m.original_inv_freq.clone()) for m in rotary]
    for module in rotary:  # what DeepSpeed's module.bfloat16() does to buffers
        module.inv_freq, module.original_inv_freq = module.inv_freq.bfloat16(), module.original_inv_freq.bfloat16()
    assert not torch.equal(rotary[0].inv_freq.float(), exact[0][0])
    with pytest.warns(
        UserWarning, match="cast 2 rotary frequency buffers to torch.bfloat16; longpeft put their float32"
    ):
        prepared.trainer.train()
    for module, (inv_freq, original) in zip(rotary, exact):
        assert module.inv_freq.dtype == torch.float32 and torch.equal(module.inv_freq, inv_freq)
        assert torch.equal(module.original_inv_freq, original) and "inv_freq" in module._buffers
