"""PoSE position ids and collator, including a tiny-model forward across the skip."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from longpeft.adapters.pose import PoseCollator, pose_position_ids
from longpeft.tiny import tiny_model


def chunks_of(positions):
    """Split positions where they jump (a jump > 1 starts a new chunk)."""
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    return np.split(positions, breaks)


def test_positions_are_contiguous_in_chunks_with_nondecreasing_skips():
    rng = np.random.default_rng(0)
    for n_chunks in (1, 2, 3):
        for _ in range(200):
            positions = pose_position_ids(32, 128, n_chunks, rng)
            assert positions.shape == (32,) and positions[0] >= 0 and positions[-1] <= 127
            diffs = np.diff(positions)
            assert (diffs >= 1).all()  # strictly increasing: no overlap between chunks
            assert (diffs > 1).sum() <= n_chunks - 1  # at most N - 1 skips
            for chunk in chunks_of(positions):
                assert np.array_equal(chunk, np.arange(chunk[0], chunk[0] + len(chunk)))
            assert positions[0] == 0  # u_0 = 0


def test_relative_distances_cover_up_to_target_minus_one():
    length, target = 16, 64
    rng = np.random.default_rng(1)
    covered = set()
    for _ in range(3000):
        positions = pose_position_ids(length, target, 2, rng)
        covered |= set((positions[:, None] - positions[None, :]).ravel().tolist())
    assert set(range(1, target)) <= covered
    assert max(covered) == target - 1


def test_position_ids_are_seeded_and_validated():
    assert np.array_equal(pose_position_ids(50, 500, 2, 7), pose_position_ids(50, 500, 2, 7))
    with pytest.raises(ValueError, match="target_length"):
        pose_position_ids(100, 50)
    with pytest.raises(ValueError, match="n_chunks"):
        pose_position_ids(3, 50, n_chunks=4)


def test_collator_keeps_positions_and_passes_an_all_ones_mask():
    collator = PoseCollator(target_length=256, pad_token_id=0, seed=0)
    features = [
        {"input_ids": list(range(10, 30)), "assistant_masks": [0] * 15 + [1] * 5},
        {"input_ids": list(range(10, 22)), "position_ids": list(range(6)) + list(range(100, 106))},
    ]
    batch = collator(features)
    assert batch["input_ids"].shape == batch["position_ids"].shape == batch["attention_mask"].shape == (2, 20)
    assert torch.equal(batch["attention_mask"], torch.ones(2, 20, dtype=torch.long))
    assert batch["labels"][0, :15].eq(-100).all() and torch.equal(batch["labels"][0, 15:], torch.arange(25, 30))
    assert batch["position_ids"][1, :12].tolist() == list(range(6)) + list(range(100, 106))  # kept as given
    # padding repeats the last position (it used to count on, past target_length - 1 for long pads)
    assert batch["position_ids"][1, 12:].tolist() == [105] * 8 and batch["labels"][1, 12:].eq(-100).all()
    assert batch["input_ids"][1, 12:].eq(0).all()
    assert (batch["position_ids"][0] <= 255).all()
    truncating = PoseCollator(target_length=256, pad_token_id=0, max_length=8)
    assert truncating([{"input_ids": list(range(20))}])["input_ids"].shape == (1, 8)


def test_second_chunk_attends_to_the_first_with_pose_ids():
    """With the collator's explicit mask, chunk 2 sees chunk 1 across the skip; without a mask,
    transformers would treat the jump as a new packed sequence and cut attention (the pitfall)."""
    torch.manual_seed(0)
    model = tiny_model("llama", seed=0, vocab_size=128)
    length, target = 24, 200
    positions = pose_position_ids(length, target, 2, np.random.default_rng(3))
    [first, second] = chunks_of(positions)
    assert second[0] - first[-1] > 1  # there is a real skip
    ids = torch.randint(5, 128, (length,))
    changed = ids.clone()
    changed[len(first) // 2] = (ids[len(first) // 2] + 1) % 128  # a token inside chunk 1
    collator = PoseCollator(target_length=target, pad_token_id=0)
    batch = collator([{"input_ids": ids.tolist(), "position_ids": positions.tolist()},
                      {"input_ids": changed.tolist(), "position_ids": positions.tolist()}])
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                       attention_mask=batch["attention_mask"], use_cache=False).logits
        unmasked = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    in_second = slice(len(first), length)
    assert (logits[0, in_second] - logits[1, in_second]).abs().max() > 1e-4  # chunk 2 sees chunk 1
    assert torch.allclose(unmasked[0, in_second], unmasked[1, in_second], atol=1e-6)  # the pitfall
    # and the positions matter: the same ids with plain positions give other logits
    with torch.no_grad():
        plain = model(input_ids=batch["input_ids"][:1], attention_mask=batch["attention_mask"][:1], use_cache=False).logits
    assert (plain[0, in_second] - logits[0, in_second]).abs().max() > 1e-4


def test_method_pose_in_a_recipe_trains_with_skip_wise_positions(tiny_base_dirs, chat_jsonl, tmp_path):
    """`method: pose`: PoSE's collator (explicit all-ones mask, skip-wise ids) feeds the trainer."""
    import torch

    from longpeft.adapters.pose import PoseCollator
    from longpeft.recipes.runner import prepare, run
    from longpeft.recipes.schema import load_recipe
    from longpeft.spec import ContextSpec

    recipe = load_recipe(
        "tiny-cpu",
        [f"model.name_or_path={tiny_base_dirs('llama')}", f"data.source={chat_jsonl}", "data.max_length=256",
         "method=pose", "pose.n_chunks=2", "target_length=2048", "rope.max_position_embeddings=2048",
         f"output_dir={tmp_path / 'run'}", "train.max_steps=1", "train.global_batch_size=2",
         "train.per_device_batch_size=2", "lora.r=2", "lora.embeddings=none"],
    )
    prepared = prepare(recipe)
    collator = prepared.trainer.data_collator
    assert isinstance(collator, PoseCollator) and collator.target_length == 2048
    batch = next(iter(prepared.trainer.get_train_dataloader()))
    assert torch.equal(batch["attention_mask"], torch.ones_like(batch["attention_mask"]))
    positions, real = batch["position_ids"], batch["input_ids"] != prepared.tokenizer.pad_token_id
    steps = positions.diff(dim=1)
    assert (steps[real[:, 1:]] >= 1).all() and (steps[~real[:, 1:]] == 0).all() and positions.max() < 2048
    assert (steps > 1).any()  # at least one skip between chunks

    result = run(recipe.model_copy(update={"output_dir": str(tmp_path / "run2")}))
    spec = ContextSpec.load(result.adapter_dir)
    assert spec.method == "pose" and spec.methods["pose"] == {"n_chunks": 2, "target_length": 2048}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rope.max_position_embeddings=512"], r"spans 2048 positions with pose, beyond the adapted model's 512"),
        (["target_length=256"], r"pose.target_length \(256\) must be set and longer than the training length"),
    ],
)
def test_pose_positions_must_fit_the_model_and_reach_past_the_window(tiny_base_dirs, overrides, message):
    """PoSE trains positions up to its target: a model left at fewer positions (its spec said 512 for a model
    trained to 2047) or a target no longer than the window (every skip 0: plain training) is refused."""
    from longpeft.recipes.runner import build_spec, check_against_base
    from longpeft.recipes.schema import load_recipe
    from longpeft.tiny import tiny_config

    recipe = load_recipe("tiny-cpu", ["data.max_length=256", "method=pose", "target_length=2048",
                                      "rope.max_position_embeddings=2048", *overrides])
    with pytest.raises(ValueError, match=message):
        check_against_base(recipe, build_spec(recipe, tiny_config("llama"), "tiny"))


def test_pose_with_beacon_is_refused():
    from longpeft.recipes.schema import RecipeError, load_recipe

    with pytest.raises(RecipeError, match="pose and beacon cannot be combined: Activation Beacon sets the positions"):
        load_recipe("tiny-beacon-cpu", ["pose.n_chunks=2", "pose.target_length=4096"])


def test_a_killed_pose_run_resumes_to_the_uninterrupted_adapter(tiny_base_dirs, chat_jsonl, tmp_path):
    """Each sample's skips are seeded by its tokens, not by a generator the checkpoint does not keep: the draws
    after a resume are those of the uninterrupted run."""
    from safetensors.torch import load_file

    from longpeft.recipes.runner import run
    from longpeft.recipes.schema import load_recipe
    from test_recipes import KillAtStep

    def recipe(out):
        return load_recipe("tiny-cpu", [
            f"model.name_or_path={tiny_base_dirs('llama')}", f"data.source={chat_jsonl}", "data.max_length=256",
            "method=pose", "target_length=2048", "rope.max_position_embeddings=2048", f"output_dir={out}",
            "train.max_steps=4", "train.save_steps=2", "train.global_batch_size=2", "train.per_device_batch_size=1",
            "lora.r=4", "lora.embeddings=none"])

    straight = run(recipe(tmp_path / "straight"))
    with pytest.raises(KeyboardInterrupt):
        run(recipe(tmp_path / "killed"), callbacks=[KillAtStep(3)])
    resumed = run(recipe(tmp_path / "killed"), resume=True)
    a = load_file(straight.adapter_dir / "adapter_model.safetensors")
    b = load_file(resumed.adapter_dir / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
