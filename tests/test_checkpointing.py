"""Checkpointing that keeps what memory allows, offloaded layer inputs and the tiled MLP (longpeft/scale/
checkpointing.py, tiling.py): each against plain checkpointing of every layer (the reference), losses and every
gradient; what each keeps or recomputes, counted at the dispatcher; the planner's terms and its auto choice; the
recipe keys and their refusals."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch.utils._python_dispatch import TorchDispatchMode

from longpeft.recipes.schema import load_recipe
from longpeft.scale import estimate, shape_of
from longpeft.scale.checkpointing import CheckpointSettings, apply_checkpointing, decoder_layers, is_attention_kernel
from longpeft.scale.plan import GiB, activation_terms, choose_checkpointing, resolve_checkpointing
from longpeft.scale.tiling import apply_tiled_mlp, is_tiled, remove_tiled_mlp
from longpeft.tiny import tiny_model

LAYERS = 4


class CountOps(TorchDispatchMode):
    """Counts the attention kernels' forward and backward calls."""

    def __init__(self) -> None:
        super().__init__()
        self.forward = self.backward = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if "scaled_dot_product" in name:
            if "backward" in name:
                self.backward += 1
            else:
                self.forward += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def lora_model():
    """A tiny Llama with LoRA on attention and MLP projections (non-zero B, so every LoRA weight gets a gradient)."""
    model = tiny_model("llama", seed=0, attn_implementation="sdpa", num_hidden_layers=LAYERS)
    return get_peft_model(
        model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"], init_lora_weights=False)
    )


def train_step(base, settings=None, tile_tokens=None, seq=48, device="cpu"):
    """One forward and backward of a copy of ``base`` on ``device``: plain checkpointing of every layer
    (transformers'), then ``settings`` and ``tile_tokens`` on top. Returns the loss, every gradient, the attention op
    counts of the backward, and the model."""
    model = copy.deepcopy(base).to(device)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    offloader = apply_checkpointing(model, settings) if settings is not None else None
    if tile_tokens:
        apply_tiled_mlp(model, tile_tokens)
    ids = torch.randint(0, 200, (2, seq), generator=torch.Generator().manual_seed(1)).to(device)
    loss = model(input_ids=ids, labels=ids).loss
    ops = CountOps()
    with ops:
        loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, ops, model, offloader


@pytest.mark.parametrize(
    "settings",
    [
        CheckpointSettings(LAYERS, keep_attention=LAYERS),
        CheckpointSettings(2, keep_attention=1),
        CheckpointSettings(0),
        CheckpointSettings(LAYERS, keep_attention=2, offload=True),
        CheckpointSettings(3, keep_attention=0, offload=True),
    ],
)
def test_each_setting_gives_the_losses_and_gradients_of_plain_checkpointing(lora_model, settings):
    loss, grads, _, _, _ = train_step(lora_model)
    kept_loss, kept_grads, ops, _, offloader = train_step(lora_model, settings)
    assert torch.equal(kept_loss, loss) and kept_grads.keys() == grads.keys() and len(grads) > LAYERS * 4
    for name in grads:
        assert torch.equal(kept_grads[name], grads[name]), name
    # the backward runs the attention forward again only in checkpointed layers that keep no attention output
    assert ops.backward == LAYERS and ops.forward == settings.checkpointed - settings.keep_attention
    if settings.offload:  # every checkpointed input but the last one's, each fetched ahead of its recompute
        assert offloader.offloaded == settings.checkpointed - 1
    else:
        assert offloader is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the offloader's side streams and pinned copies need CUDA")
def test_offloaded_inputs_on_cuda_give_the_gradients_of_plain_checkpointing_from_the_compute_streams_pool(lora_model):
    """On CUDA the inputs go out and come back on side streams, the copies overlapping the compute (4,096 tokens, so
    that they take time): the loss of plain checkpointing, its gradients (within float32 rounding: SDPA's CUDA
    backward adds in no fixed order), every fetch but the first started ahead, and every segment the step made
    belongs to the compute stream's pool (an input fetched back into a side stream's pool would leave its blocks
    there once freed, where the compute stream cannot use them)."""
    loss, grads, *_ = train_step(lora_model, seq=4096, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = {segment["address"] for segment in torch.cuda.memory_snapshot()}
    kept_loss, kept_grads, _, _, offloader = train_step(
        lora_model, CheckpointSettings(LAYERS, offload=True), seq=4096, device="cuda"
    )
    torch.cuda.synchronize()
    made = [segment for segment in torch.cuda.memory_snapshot() if segment["address"] not in before]
    assert made and {segment["stream"] for segment in made} == {torch.cuda.current_stream().cuda_stream}
    assert (offloader.offloaded, offloader.prefetched) == (LAYERS - 1, LAYERS - 2)
    assert torch.equal(kept_loss, loss) and kept_grads.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(
            kept_grads[name], grads[name], rtol=1e-5, atol=1e-6, msg=lambda text, name=name: f"{name}: {text}"
        )


def test_plain_checkpointing_recomputes_every_attention_forward(lora_model):
    *_, ops, _, _ = train_step(lora_model)
    assert (ops.forward, ops.backward) == (LAYERS, LAYERS)
    assert is_attention_kernel(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)
    assert not is_attention_kernel(torch.ops.aten.mm.default)


def test_apply_checkpointing_sets_each_layer_and_refuses_more_layers_than_the_model_has(lora_model):
    model = copy.deepcopy(lora_model)
    apply_checkpointing(model, CheckpointSettings(3, keep_attention=1))
    assert [layer.gradient_checkpointing for layer in decoder_layers(model)] == [True, True, True, False]
    with pytest.raises(ValueError, match="train.checkpoint_layers=5: the model has 4 decoder layers"):
        apply_checkpointing(model, CheckpointSettings(5))
    with pytest.raises(ValueError, match="keep_attention"):
        CheckpointSettings(2, keep_attention=3)
    assert CheckpointSettings(32, 24, True).describe(32) == (
        "32 of 32 layers checkpointed, attention kept in 24, inputs offloaded to CPU memory"
    )


class MLPCalls:
    """Counts the MLP's down projection forwards (one per MLP run, per tile when tiled)."""

    def __init__(self, model) -> None:
        self.count = 0
        for layer in decoder_layers(model):
            layer.mlp.down_proj.register_forward_hook(self.hook)

    def hook(self, *args) -> None:
        self.count += 1


@pytest.mark.parametrize(
    ("settings", "tile"),
    [
        (None, 16),  # checkpointed layers
        (CheckpointSettings(0), 7),  # no checkpointing: the tiles' backward recomputes each tile
        (CheckpointSettings(LAYERS, keep_attention=LAYERS, offload=True), 13),  # with the other levers
    ],
)
def test_the_tiled_mlp_matches_the_untiled_one(lora_model, settings, tile):
    loss, grads, _, _, _ = train_step(lora_model)
    tiled_loss, tiled_grads, _, model, _ = train_step(lora_model, settings, tile)
    assert is_tiled(model)
    assert torch.allclose(tiled_loss, loss, rtol=1e-6, atol=0) and tiled_grads.keys() == grads.keys()
    for name in grads:  # the parameter gradients are sums over the tiles: equal up to the order of the sums
        torch.testing.assert_close(tiled_grads[name], grads[name], rtol=1e-5, atol=1e-7, msg=name)
    remove_tiled_mlp(model)
    assert not is_tiled(model)


def test_a_checkpointed_recompute_stops_before_the_tiles(lora_model):
    """Checkpointed: the backward runs each tile once (its forward with gradients); the layer's recompute stops
    at the MLP input. Not checkpointed: the same tiles. So the tiled MLP adds no MLP forward to a checkpointed
    layer."""
    seq, tile = 48, 16
    for settings in (None, CheckpointSettings(0)):
        model = copy.deepcopy(lora_model)
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if settings is not None:
            apply_checkpointing(model, settings)
        apply_tiled_mlp(model, tile)
        calls = MLPCalls(model)
        ids = torch.randint(0, 200, (2, seq), generator=torch.Generator().manual_seed(1))
        loss = model(input_ids=ids, labels=ids).loss
        assert calls.count == LAYERS * seq // tile  # the forward: tile by tile
        calls.count = 0
        loss.backward()
        assert calls.count == LAYERS * seq // tile


def test_the_tiled_mlp_runs_untiled_without_gradients_or_when_shorter_than_a_tile(lora_model):
    model = copy.deepcopy(lora_model)
    apply_tiled_mlp(model, 16)
    calls = MLPCalls(model)
    with torch.no_grad():
        model(input_ids=torch.ones(1, 48, dtype=torch.long))
    assert calls.count == LAYERS
    with pytest.raises(ValueError, match="mlp_tile_tokens must be >= 1"):
        apply_tiled_mlp(model, 0)


# --- the planner ---------------------------------------------------------------------------------------------


def test_activation_terms_against_a_direct_count():
    shape = shape_of("meta-llama/Meta-Llama-3-8B-Instruct")
    tokens, b = 81920, 2
    hidden, kv, inter = 4096, 8 * 128, 14336
    layer = tokens * (5 * hidden + 2 * kv + 4 * inter) * b
    full = activation_terms(shape, CheckpointSettings(32), tokens, b)
    assert full == {"checkpointed layer inputs": 32 * tokens * hidden * b, "one layer's recompute": layer}
    kept = activation_terms(shape, CheckpointSettings(30, keep_attention=20, offload=True), tokens, b)
    assert kept == {
        "checkpointed layer inputs": 2 * tokens * hidden * b,
        "kept attention outputs": 20 * tokens * (32 * 128 * b + 32 * 4),
        "layers not checkpointed": 2 * layer,
        "one layer's recompute": layer,
    }
    tiled = activation_terms(shape, CheckpointSettings(32, offload=True), tokens, b, mlp_tile_tokens=4096)
    assert tiled["one layer's recompute"] == tokens * (6 * hidden + 2 * kv) * b + 4096 * 4 * inter * b
    assert activation_terms(shape, CheckpointSettings(0), tokens, b) == {"all layers' activations": 32 * layer}


def test_kept_attention_saves_its_recompute_in_the_planned_time():
    plain = load_recipe("llama3-8b-instruct-80k-qlora", ["train.max_steps=1", "train.global_batch_size=1"])
    shape = shape_of("meta-llama/Meta-Llama-3-8B-Instruct")
    reference = estimate(plain, gpus=1, shape=shape)
    kept = estimate(plain, gpus=1, shape=shape, checkpointing=CheckpointSettings(32, keep_attention=32))
    # attention: forward, two backward kernels, and the recompute, which keeping removes (a quarter)
    assert kept.attention_flops_per_token == pytest.approx(reference.attention_flops_per_token * 3 / 4)
    assert kept.flops_per_token == pytest.approx(reference.flops_per_token - reference.attention_flops_per_token / 4)
    unchecked = estimate(plain, gpus=1, shape=shape, checkpointing=CheckpointSettings(0))
    layer_params = shape.linear_params + plain.lora.r * 32 * sum(
        sum(shape.projection_shape(n)) for n in plain.lora.target_modules
    )
    assert reference.flops_per_token - unchecked.flops_per_token == pytest.approx(
        2 * layer_params + reference.attention_flops_per_token / 4
    )


def test_auto_keeps_attention_first_at_long_lengths_and_stays_within_the_budget():
    recipe = load_recipe(
        "llama3-8b-instruct-80k-qlora",
        [
            "train.keep_attention=auto",
            "train.checkpoint_layers=auto",
            "train.offload_checkpoints=true",
            "train.memory_budget_gib=55",
        ],
    )
    shape = shape_of("meta-llama/Meta-Llama-3-8B-Instruct")
    chosen = resolve_checkpointing(recipe, shape, gpu_memory_gib=80)
    plan = estimate(recipe, gpus=1, shape=shape, checkpointing=chosen)
    assert chosen.checkpointed == 32 and 0 < chosen.keep_attention < 32 and chosen.offload
    assert (
        plan.peak_bytes
        <= 55 * GiB
        < estimate(
            recipe, gpus=1, shape=shape, checkpointing=CheckpointSettings(32, chosen.keep_attention + 1, True)
        ).peak_bytes
    )  # one more kept layer would not fit
    assert estimate(recipe, gpus=1, shape=shape).assumptions["checkpointing"] == {
        "checkpointed": 32,
        "keep_attention": chosen.keep_attention,
        "offload": True,
    }


def test_choose_checkpointing_takes_the_most_time_per_byte():
    """A toy plan of 4 layers: keeping an attention output saves 3 s for 1 byte; an unchecked layer saves 5 s for 4
    bytes (it keeps everything, its attention too: from a layer that kept its attention, 2 s for 3 bytes)."""

    class Toy:
        def __init__(self, settings):
            kept, unchecked = settings.keep_attention, 4 - settings.checkpointed
            self.peak_bytes = 10 + kept + 4 * unchecked
            self.hours, self.tokens = (100 - 3 * kept - 5 * unchecked) / 3600, 1

    def choose(budget, vary_layers=True):
        return choose_checkpointing(Toy, CheckpointSettings(4), budget, vary_layers, vary_attention=True)

    assert choose(12) == CheckpointSettings(4, keep_attention=2)  # attention first: the most time per byte
    assert choose(16) == CheckpointSettings(4, keep_attention=4)  # then an unchecked layer would pass 16 bytes
    assert choose(20) == CheckpointSettings(2, keep_attention=2)
    assert choose(20, vary_layers=False) == CheckpointSettings(4, keep_attention=4)


def test_the_plan_table_says_what_each_layer_keeps(capsys):
    from longpeft.cli import main

    assert (
        main(
            [
                "plan",
                "llama3-8b-instruct-80k-qlora",
                "--gpus",
                "1",
                "--set",
                "train.offload_checkpoints=true",
                "--set",
                "train.keep_attention=auto",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "checkpointing: 32 of 32 layers checkpointed, attention kept in 32, inputs offloaded to CPU memory" in out
    assert "kept attention outputs" in out


# --- recipe keys ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["train.gradient_checkpointing=false", "train.keep_attention=all"],
            "train.keep_attention shapes activation checkpointing",
        ),
        (["train.offload_checkpoints=true", "train.activation_offloading=true"], "use one"),
        (["train.keep_attention=-1"], "must be a number of layers >= 0"),
        (["train.mlp_tile_tokens=0"], "train.mlp_tile_tokens"),
        (["train.memory_budget_gib=nan"], "train.memory_budget_gib"),
        (
            ["train.backend=unsloth", "train.offload_checkpoints=true"],
            "train.offload_checkpoints (unsloth checkpoints",
        ),
    ],
)
def test_bad_memory_settings_are_refused_naming_the_key(overrides, message):
    from longpeft.errors import ConfigError

    with pytest.raises((ConfigError, ValueError), match=message.replace("(", r"\(")):
        load_recipe("tiny-cpu", overrides)


@pytest.mark.parametrize("key", ["checkpoint_layers", "keep_attention"])
def test_layers_beyond_the_model_are_refused(key):
    from longpeft.recipes.validate import validate_recipe

    recipe = load_recipe("tiny-cpu", [f"train.{key}=9"])
    with pytest.raises(ValueError, match=f"train.{key}=9: the model has 2 decoder layers"):
        validate_recipe(recipe)


@pytest.mark.parametrize(
    ("recipe", "overrides", "message"),
    [
        ("tiny-harpe-cpu", [], "train.use_liger_kernel with harpe: its attention forward rotates"),
        ("tiny-cpu", [], "Liger's kernels are Triton kernels for CUDA GPUs"),
    ],
)
def test_liger_is_refused_with_the_reason(recipe, overrides, message):
    from longpeft.recipes.validate import check_here, validate_recipe

    if torch.cuda.is_available() and "CUDA" in message:
        pytest.skip("checks the refusal on a machine without CUDA")
    with pytest.raises(ValueError, match=message):
        check_here(validate_recipe(load_recipe(recipe, ["train.use_liger_kernel=true", *overrides])))


def test_a_run_with_every_lever_trains_as_plain_checkpointing(tmp_path, capsys):
    """The runner end to end on CPU: one checkpointed layer of two that keeps its attention, offloaded inputs and a
    tiled MLP give the losses of the plain run, and the resolved recipe records what each layer kept. Each lever
    says on stderr what it did, and on CPU the offloading says that it saves nothing; the plain run says nothing."""
    from longpeft.recipes.runner import run

    def losses(name, overrides):
        recipe = load_recipe("tiny-cpu", [f"output_dir={tmp_path / name}", "train.max_steps=2", *overrides])
        result = run(recipe)
        rows = (result.output_dir / "metrics.jsonl").read_text().splitlines()
        resolved = json.loads((result.output_dir / "recipe.resolved.json").read_text())
        return [json.loads(row)["loss"] for row in rows if "loss" in json.loads(row)], resolved["checkpointing"]

    plain, none = losses("plain", [])
    plain_log = capsys.readouterr().err
    levers, recorded = losses(
        "levers",
        [
            "train.checkpoint_layers=1",
            "train.keep_attention=all",
            "train.offload_checkpoints=true",
            "train.mlp_tile_tokens=64",
        ],
    )
    log = capsys.readouterr().err
    assert none is None and recorded == {"checkpointed": 1, "keep_attention": 1, "offload": True}
    assert levers == pytest.approx(plain, rel=1e-5)
    assert (
        "longpeft: checkpointing: 1 of 2 layers checkpointed, attention kept in 1, inputs copied to a second CPU "
        "buffer and back (no GPU in this run: the offloading runs its steps but saves no memory)"
    ) in log
    assert "longpeft: MLP tiled: the MLP of 2 decoder layers runs 64 tokens at a time in training" in log
    assert "checkpointing:" not in plain_log and "MLP tiled" not in plain_log


@pytest.mark.parametrize(
    ("settings", "tile", "lines"),
    [
        (None, 32, ["longpeft: MLP tiled: the MLP of 4 decoder layers runs 32 tokens at a time in training"]),
        (CheckpointSettings(1), None, ["longpeft: checkpointing: 1 of 4 layers checkpointed, attention kept in 0"]),
        (
            CheckpointSettings(2, offload=True),
            4096,
            ["longpeft: checkpointing: 2 of 4 layers checkpointed", "longpeft: MLP tiled: the MLP of 4 decoder"],
        ),
    ],
)
def test_each_lever_alone_says_what_it_did(lora_model, capsys, settings, tile, lines):
    """What the runner installs when training begins (``TrainingMemory``) says so on the main process only."""
    from types import SimpleNamespace

    from longpeft.recipes.memory import TrainingMemory

    args = SimpleNamespace(device=torch.device("cpu"))
    for main_process in (True, False):
        memory = TrainingMemory(settings, tile)
        state = SimpleNamespace(is_world_process_zero=main_process)
        memory.on_train_begin(args, state, None, model=copy.deepcopy(lora_model))
        log = capsys.readouterr().err.splitlines()
        assert len(log) == (len(lines) if main_process else 0)
        assert all(line.startswith(start) for line, start in zip(log, lines, strict=False))


def test_offloading_says_on_a_gpu_where_the_inputs_go_and_on_cpu_that_it_saves_nothing():
    settings = CheckpointSettings(4, keep_attention=2, offload=True)
    assert settings.describe(4).endswith("inputs offloaded to CPU memory")
    assert settings.describe(4, on_gpu=False).endswith(
        "(no GPU in this run: the offloading runs its steps but saves no memory)"
    )
    assert CheckpointSettings(4).describe(4, on_gpu=False) == "4 of 4 layers checkpointed, attention kept in 0"


def test_planner_against_the_kept_attention_run_measured_on_an_h100():
    """docs/measurements/h100-2026-11-27: the 80K recipe with kept attention outputs (auto, 57 GiB budget) and
    offloaded inputs. The planner makes the same choice, its step time is within 5 % and its terms without the
    runtime term within 10 % of the allocated peak (the reserved peak is the caching allocator's: not planned)."""
    import importlib.util
    import statistics
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("gpu_check", root / "scripts" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    report = json.loads((root / "docs/measurements/h100-2026-11-27/qlora_kept_offload_81920.json").read_text())
    run = report["runs"]["kept81920"]
    overrides = ["train.keep_attention=auto", "train.offload_checkpoints=true", "train.memory_budget_gib=57"]
    recipe = gpu_check.recipe_for(
        Path("base"), Path("train.jsonl"), Path("out"), "sdpa", run["tokens"], 2, False, overrides
    )
    plan = estimate(
        recipe,
        gpus=1,
        gpu_memory_gib=79.2,
        gpu="h100",
        samples=2,
        shape=shape_of("meta-llama/Meta-Llama-3-8B-Instruct"),
    )
    assert (
        plan.assumptions["checkpointing"]
        == run["checkpointing"]
        == {"checkpointed": 32, "keep_attention": 28, "offload": True}
    )
    step = plan.hours * 3600 / 2
    assert abs(step / statistics.median(run["step_seconds"][1:]) - 1) < 0.05
    terms = plan.peak_bytes - plan.terms["runtime (CUDA context, fragmentation)"]
    assert abs(terms / GiB / run["peak_allocated_gib"] - 1) < 0.10
