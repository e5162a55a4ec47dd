"""PoSE position ids and collator, including a tiny-model forward across the skip."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from longpeft.adapters.pose import PoseCollator, pose_position_ids, pose_sample
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


def eq5_reference(x, window, target, n_chunks, content_skip, seed):
    """The paper's Eq. 5 by slicing: chunk i holds x[v_i + st_i : v_i + st_i + l_i] at positions u_i + st_i ...,
    with the draws made in pose_sample's documented order (cut points, then the u_i, then the v_i) from ``seed``."""
    rng = np.random.default_rng(seed)
    length = min(window, len(x))
    cuts = sorted(rng.choice(np.arange(1, length), size=n_chunks - 1, replace=False).tolist()) if n_chunks > 1 else []
    starts, ends = [0, *cuts], [*cuts, length]

    def draw(most):
        skips = [0]
        for _ in range(n_chunks - 1):
            skips.append(int(rng.integers(skips[-1], most + 1)))
        return skips

    if content_skip == "none":
        u, v = draw(target - length), [0] * n_chunks
    elif content_skip == "aligned":
        u = v = draw(min(len(x), target) - length)
    else:
        u = draw(target - length)
        v = draw(len(x) - length)
    tokens, positions = [], []
    for st, end, ui, vi in zip(starts, ends, u, v):
        tokens += list(x[vi + st : vi + end])
        positions += list(range(ui + st, ui + end))
    return tokens, positions


@pytest.mark.parametrize("content_skip", ["none", "uniform", "aligned"])
def test_pose_sample_equals_eq5_by_slicing(content_skip):
    """Every draw: the tokens pose_sample picks are the Eq. 5 chunks of the text, at the Eq. 5 positions."""
    draws = np.random.default_rng(5)
    for trial in range(300):
        source = int(draws.integers(1, 400))
        window, target = int(draws.integers(1, 64)), 400
        n_chunks = int(draws.integers(1, min(window, source) + 1))
        x = draws.integers(0, 1000, source)
        index, positions = pose_sample(source, window, target, n_chunks, content_skip, rng=trial)
        tokens, expected_positions = eq5_reference(x, window, target, n_chunks, content_skip, trial)
        assert x[index].tolist() == tokens and positions.tolist() == expected_positions
        assert index[-1] < source and positions[-1] < target and (np.diff(positions) >= 1).all()
        if content_skip == "aligned":
            assert np.array_equal(index, positions)  # each token at its own position in the text


def test_pose_sample_without_content_skip_draws_the_plain_position_ids():
    """``none`` is the sample's first L_c tokens with what pose_position_ids draws (runs before content_skip existed
    draw the same positions)."""
    index, positions = pose_sample(300, 100, 1000, 2, "none", rng=3)
    assert np.array_equal(index, np.arange(100)) and np.array_equal(positions, pose_position_ids(100, 1000, 2, 3))


def test_content_skip_reaches_every_token_and_aligned_every_distance():
    """Uniform offsets draw the window from anywhere in the text (first and last token included); aligned positions
    cover every distance up to min(L_x, L_t) - 1, and no further."""
    rng = np.random.default_rng(0)
    seen, distances = set(), set()
    for _ in range(2000):
        index, _ = pose_sample(200, 16, 1000, 2, "uniform", rng)
        seen |= set(index.tolist())
        index, positions = pose_sample(200, 16, 150, 2, "aligned", rng)
        distances |= set((positions[:, None] - positions[None, :]).ravel().tolist())
    assert seen == set(range(200))
    assert set(range(150)) == {d for d in distances if d >= 0}


def test_collator_draws_the_window_from_longer_samples_with_content_skip():
    """With content_skip the collator keeps a long sample whole until it draws the window (seeded by the whole
    sample), takes the labels with the tokens, and leaves the first token after a skipped stretch unscored."""
    x = np.arange(1000, 1600)  # 600 distinct tokens: a token's id tells its place in the text
    collator = PoseCollator(target_length=1024, pad_token_id=0, max_length=64, seed=2, content_skip="aligned")
    short = list(range(2000, 2040))
    batch = collator([{"input_ids": x.tolist()}, {"input_ids": short}])
    ids, labels, positions = (
        batch["input_ids"][0].numpy(),
        batch["labels"][0].numpy(),
        batch["position_ids"][0].numpy(),
    )
    assert ids.shape == (64,) and np.array_equal(ids, x[positions])  # aligned: every token at its real position
    jumps = np.flatnonzero(np.diff(positions) > 1) + 1
    assert len(jumps) == 1, "seed 2 skips once; pick another seed if the draw changes"
    unscored = np.flatnonzero(labels == -100)
    assert unscored.tolist() == jumps.tolist() and np.array_equal(np.delete(labels, jumps), np.delete(ids, jumps))
    # a sample no longer than the window is not skipped within: its tokens as they are, PoSE positions
    assert batch["input_ids"][1, :40].tolist() == short and batch["labels"][1, :40].tolist() == short
    assert batch["labels"][1, 40:].eq(-100).all()
    again = collator([{"input_ids": x.tolist()}])
    assert torch.equal(again["position_ids"][0], batch["position_ids"][0])  # seeded by the sample itself
    uniform = PoseCollator(target_length=1024, pad_token_id=0, max_length=64, seed=2, content_skip="uniform")
    drawn = uniform([{"input_ids": x.tolist()}])["input_ids"][0].numpy()
    assert set(drawn.tolist()) <= set(x.tolist()) and (np.diff(drawn) >= 1).all()
    with pytest.raises(ValueError, match="content_skip='aligned' draws a window from each sample: set max_length"):
        PoseCollator(target_length=1024, pad_token_id=0, content_skip="aligned")
    with pytest.raises(ValueError, match="content_skip must be none, uniform or aligned"):
        PoseCollator(target_length=1024, pad_token_id=0, max_length=64, content_skip="random")


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
    batch = collator(
        [
            {"input_ids": ids.tolist(), "position_ids": positions.tolist()},
            {"input_ids": changed.tolist(), "position_ids": positions.tolist()},
        ]
    )
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            attention_mask=batch["attention_mask"],
            use_cache=False,
        ).logits
        unmasked = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    in_second = slice(len(first), length)
    assert (logits[0, in_second] - logits[1, in_second]).abs().max() > 1e-4  # chunk 2 sees chunk 1
    assert torch.allclose(unmasked[0, in_second], unmasked[1, in_second], atol=1e-6)  # the pitfall
    # and the positions matter: the same ids with plain positions give other logits
    with torch.no_grad():
        plain = model(
            input_ids=batch["input_ids"][:1], attention_mask=batch["attention_mask"][:1], use_cache=False
        ).logits
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
        [
            f"model.name_or_path={tiny_base_dirs('llama')}",
            f"data.source={chat_jsonl}",
            "data.max_length=256",
            "method=pose",
            "pose.n_chunks=2",
            "target_length=2048",
            "rope.max_position_embeddings=2048",
            f"output_dir={tmp_path / 'run'}",
            "train.max_steps=1",
            "train.global_batch_size=2",
            "train.per_device_batch_size=2",
            "lora.r=2",
            "lora.embeddings=none",
        ],
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
    assert spec.method == "pose" and spec.methods["pose"] == {
        "n_chunks": 2,
        "target_length": 2048,
        "content_skip": "none",
    }


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
    from longpeft.recipes.schema import load_recipe
    from longpeft.recipes.validate import build_spec, check_against_base
    from longpeft.tiny import tiny_config

    recipe = load_recipe(
        "tiny-cpu",
        ["data.max_length=256", "method=pose", "target_length=2048", "rope.max_position_embeddings=2048", *overrides],
    )
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
        return load_recipe(
            "tiny-cpu",
            [
                f"model.name_or_path={tiny_base_dirs('llama')}",
                f"data.source={chat_jsonl}",
                "data.max_length=256",
                "method=pose",
                "target_length=2048",
                "rope.max_position_embeddings=2048",
                f"output_dir={out}",
                "train.max_steps=4",
                "train.save_steps=2",
                "train.global_batch_size=2",
                "train.per_device_batch_size=1",
                "lora.r=4",
                "lora.embeddings=none",
            ],
        )

    straight = run(recipe(tmp_path / "straight"))
    with pytest.raises(KeyboardInterrupt):
        run(recipe(tmp_path / "killed"), callbacks=[KillAtStep(3)])
    resumed = run(recipe(tmp_path / "killed"), resume=True)
    a = load_file(straight.adapter_dir / "adapter_model.safetensors")
    b = load_file(resumed.adapter_dir / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def write_text_jsonl(path, lengths, seed=0):
    """Plain-text documents of roughly ``lengths`` words each."""
    import json
    import random

    rng = random.Random(seed)
    words = "the river city report market north south garden harbor station amber cedar dune".split()
    path.write_text(
        "".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(n))}) + "\n" for n in lengths)
    )
    return path


def test_content_skip_in_a_recipe_trains_on_windows_drawn_from_long_documents(tiny_base_dirs, tmp_path):
    """`pose.content_skip: aligned` on plain text: documents up to pose.target_length reach the collator whole (TRL
    does not cut them to data.max_length), and every trained token sits at its own position in its document."""
    from longpeft.recipes.runner import prepare, run
    from longpeft.recipes.schema import load_recipe
    from longpeft.spec import ContextSpec

    docs = write_text_jsonl(tmp_path / "docs.jsonl", [10, 300, 400, 500, 1500])
    recipe = load_recipe(
        "tiny-cpu",
        [
            f"model.name_or_path={tiny_base_dirs('llama')}",
            f"data.source={docs}",
            "data.format=text",
            "data.max_length=64",
            "method=pose",
            "pose.content_skip=aligned",
            "target_length=1024",
            "rope.max_position_embeddings=1024",
            f"output_dir={tmp_path / 'run'}",
            "train.max_steps=1",
            "train.global_batch_size=2",
            "train.per_device_batch_size=2",
            "lora.r=2",
            "lora.embeddings=none",
        ],
    )
    prepared = prepare(recipe)
    stats = prepared.data_stats
    assert stats["kept"] == 4 and stats["dropped"] == 1 and stats["longer_than_window"] == 3  # 1500 words > 1024
    documents = [row["input_ids"] for row in prepared.trainer.train_dataset]
    assert sorted(map(len, documents))[-1] > 64  # not cut to the window on the way
    for batch in prepared.trainer.get_train_dataloader():
        for ids, positions, real in zip(batch["input_ids"], batch["position_ids"], batch["input_ids"] != 0):
            ids, positions = ids[real].tolist(), positions[real].tolist()
            assert len(ids) <= 64 and any(
                len(doc) > max(positions) and [doc[p] for p in positions] == ids for doc in documents
            )
    result = run(recipe.model_copy(update={"output_dir": str(tmp_path / "run2")}))
    assert ContextSpec.load(result.adapter_dir).methods["pose"]["content_skip"] == "aligned"


def test_content_skip_is_refused_on_conversations_and_on_documents_that_fit_the_window(
    tiny_base_dirs, chat_jsonl, tmp_path
):
    """A skip would cut a conversation's context from its answer; documents no longer than the window leave
    nothing to skip (the setting would silently change nothing); documents longer than the simulated length are
    dropped, or with data.truncate cut to it."""
    from longpeft.recipes.runner import prepare
    from longpeft.recipes.schema import RecipeError, load_recipe

    pose = [
        "method=pose",
        "pose.content_skip=uniform",
        "target_length=1024",
        "rope.max_position_embeddings=1024",
        f"model.name_or_path={tiny_base_dirs('llama')}",
        f"output_dir={tmp_path / 'run'}",
        "lora.r=2",
    ]
    with pytest.raises(RecipeError, match="pose.content_skip: uniform skips stretches of text.*data.format: text"):
        load_recipe("tiny-cpu", [f"data.source={chat_jsonl}", *pose])
    docs = write_text_jsonl(tmp_path / "short.jsonl", [20, 30])
    recipe = load_recipe("tiny-cpu", [f"data.source={docs}", "data.format=text", "data.max_length=256", *pose])
    with pytest.raises(ValueError, match="no training sample is longer than data.max_length=256 tokens"):
        prepare(recipe)
    docs = write_text_jsonl(tmp_path / "long.jsonl", [1500, 1600])  # longer than the simulated 1024 tokens
    recipe = load_recipe("tiny-cpu", [f"data.source={docs}", "data.format=text", "data.max_length=256", *pose])
    with pytest.raises(
        ValueError,
        match=r"longer than pose.target_length=1024 \(PoSE's content skip\) tokens "
        r"\(longest \d+\); raise pose.target_length or set data.truncate: true",
    ):
        prepare(recipe)
    cut = prepare(recipe.model_copy(update={"data": recipe.data.model_copy(update={"truncate": True})}))
    assert cut.data_stats["truncated"] == 2 and cut.data_stats["longer_than_window"] == 2
    assert [len(row["input_ids"]) for row in cut.trainer.train_dataset] == [1024, 1024]  # cut to the simulated length


def test_model_card_names_the_content_skip():
    from longpeft.adapters.pose import METHOD, PoseConfig

    [plain] = METHOD.describe(PoseConfig(target_length=4096))
    [aligned] = METHOD.describe(PoseConfig(target_length=4096, content_skip="aligned"))
    assert plain == "Trained with PoSE: 2 chunks with skip-wise position ids simulating 4096 tokens."
    assert aligned.endswith(
        "simulating 4096 tokens, each chunk's text taken at its position ids in documents up to that long."
    )
