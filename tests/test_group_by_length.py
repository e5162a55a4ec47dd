"""train.group_by_length: the order (against transformers' own grouping), the sampler, the Trainer drawing in that
order through a kill and a resume, and the planner timing the order the recipe trains in."""

import json

import numpy as np
import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from longpeft.recipes import runner
from longpeft.recipes.recipe_trainer import LengthGroupedSampler, row_lengths
from longpeft.recipes.schema import load_recipe
from longpeft.scale import estimate
from longpeft.scale.lengths import SampleLengths, group_by_length, length_grouped_order, ordered_seconds

pytestmark = pytest.mark.compat  # also run by `make test-compat` (transformers 5.17, trl 1.15, datasets 4)


@pytest.mark.parametrize("rows, step", [(10, 1), (37, 2), (400, 3), (2000, 8), (5, 8)])
def test_grouping_is_the_trainers_for_the_same_permutation(rows, step):
    from transformers.trainer_pt_utils import get_length_grouped_indices

    lengths = torch.randint(1, 30, (rows,), generator=torch.Generator().manual_seed(rows)).tolist()  # many ties
    theirs = get_length_grouped_indices(lengths, step, generator=torch.Generator().manual_seed(7))
    permutation = torch.randperm(rows, generator=torch.Generator().manual_seed(7)).numpy()
    assert group_by_length(permutation, lengths, step).tolist() == theirs


def test_the_order_is_a_grouped_permutation_fixed_by_seed_and_epoch():
    lengths = np.random.default_rng(0).integers(1, 81_920, 1_000).tolist()
    order = length_grouped_order(lengths, 8, seed=42, epoch=0)
    assert sorted(order.tolist()) == list(range(1_000))
    assert lengths[order[0]] == max(lengths)  # the longest first: a run that cannot fit it fails at once
    assert (order == length_grouped_order(lengths, 8, seed=42, epoch=0)).all()
    assert (order != length_grouped_order(lengths, 8, seed=42, epoch=1)).any()
    assert (order != length_grouped_order(lengths, 8, seed=43, epoch=0)).any()
    block = 8 * min(1_000 // 32, 50)  # blocks of 31 steps here
    for start in range(0, 1_000, block):
        sizes = [lengths[i] for i in order[start : start + block]][1:]  # the first row may be the swapped-in longest
        assert sizes == sorted(sizes, reverse=True)
    # the GPUs of a step get similar lengths: the step's spread is far below random order's
    spread = np.mean([np.ptp([lengths[i] for i in order[s : s + 8]]) for s in range(0, 1_000, 8)])
    shuffled = np.random.default_rng(1).permutation(1_000)
    assert spread < 0.1 * np.mean([np.ptp([lengths[i] for i in shuffled[s : s + 8]]) for s in range(0, 1_000, 8)])


def test_sampler_follows_set_epoch():
    lengths = list(range(1, 41))
    sampler = LengthGroupedSampler(lengths, step_samples=2, seed=3)
    assert len(sampler) == 40
    assert list(sampler) == length_grouped_order(lengths, 2, 3, 0).tolist()
    sampler.set_epoch(2)
    assert list(sampler) == length_grouped_order(lengths, 2, 3, 2).tolist()


def test_trl_cannot_choose_another_order():
    with pytest.raises(Exception, match="trl.train_sampling_strategy is set by longpeft: use train.group_by_length"):
        load_recipe("tiny-cpu", ["trl.train_sampling_strategy=group_by_length"])


@pytest.mark.parametrize("seed", [-1, 2**32])
def test_a_seed_numpy_cannot_take_is_refused_naming_it(seed):
    with pytest.raises(Exception, match="train.seed"):
        load_recipe("tiny-cpu", [f"train.seed={seed}"])


def test_row_lengths_read_the_rows_the_dataset_shows():
    dataset = Dataset.from_dict({"input_ids": [[1] * n for n in (5, 1, 9, 3, 7)], "other": list(range(5))})
    assert row_lengths(dataset) == [5, 1, 9, 3, 7]
    view = dataset.shuffle(seed=0).select([4, 0, 2])  # an indices mapping over the table
    assert row_lengths(view) == [len(row["input_ids"]) for row in view]
    with pytest.raises(Exception, match="input_ids column.*group_by_length: false"):
        row_lengths(Dataset.from_dict({"text": ["a"]}))


def _accelerate_seconds(lengths, seconds, steps, batch, gpus, accumulation, seed):
    """Step by step, as training takes the samples: each epoch accelerate deals the grouped sampler's batches to
    the processes (``BatchSamplerShard`` with even batches; one process reads the batches as they are) and the
    Trainer takes ``accumulation`` of each process's per step, the epoch's last step the rest. A step lasts as
    long as its slowest process's micro-batches, each padded to its longest sample."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler

    from longpeft.recipes.recipe_trainer import LengthGroupedSampler
    from longpeft.scale.lengths import epoch_steps

    sampler = LengthGroupedSampler(lengths, batch * gpus * accumulation, seed)
    total, done, epoch = 0.0, 0, 0
    while done < steps:
        sampler.set_epoch(epoch)
        batches = BatchSampler(sampler, batch, drop_last=False)
        per_gpu = (
            [list(BatchSamplerShard(batches, gpus, rank)) for rank in range(gpus)] if gpus > 1 else [list(batches)]
        )
        micro = len(per_gpu[0])
        assert all(len(own) == micro for own in per_gpu)
        assert -(-micro // accumulation) == epoch_steps(len(lengths), batch, gpus, accumulation)
        for start in range(0, micro, accumulation):
            if done < steps:
                total += max(
                    sum(
                        len(rows) * seconds(max(lengths[i] for i in rows))
                        for rows in own[start : start + accumulation]
                    )
                    for own in per_gpu
                )
                done += 1
        epoch += 1
    return total


@pytest.mark.parametrize(
    "batch, gpus, accumulation, steps", [(1, 8, 1, 120), (2, 4, 2, 60), (1, 2, 3, 150), (2, 1, 3, 100)]
)
def test_time_in_grouped_order_against_accelerates_batches(batch, gpus, accumulation, steps):
    """401 samples: every epoch ends in a short round or step; the steps cross an epoch."""
    lengths = np.random.default_rng(5).integers(100, 5_000, 401).tolist()
    seconds = lambda n: 1e-3 * n + 1e-7 * np.square(n)  # noqa: E731
    expected = _accelerate_seconds(lengths, seconds, steps, batch, gpus, accumulation, seed=11)
    got = ordered_seconds(lengths, seconds, steps, batch, gpus, accumulation, seed=11, grouped=True)
    assert got == pytest.approx(expected, rel=1e-12)
    assert got < ordered_seconds(lengths, seconds, steps, batch, gpus, accumulation, seed=11)


def test_the_time_line_names_the_order_the_recipe_trains_in():
    lengths = SampleLengths(
        tuple(int(n) for n in np.random.default_rng(2).integers(1_000, 81_920, 400)),
        source="mix.jsonl",
        counted_with="a test",
    )
    grouped = estimate(load_recipe("llama3-8b-instruct-80k-qlora"), gpus=8, sample_lengths=lengths)
    random = estimate(
        load_recipe("llama3-8b-instruct-80k-qlora", ["train.group_by_length=false"]), gpus=8, sample_lengths=lengths
    )
    assert grouped.hours == random.hours  # every GPU equally loaded: the order does not change it
    assert grouped.hours < grouped.assumptions["hours_in_order"] < random.assumptions["hours_in_order"]
    assert "in the order the recipe trains them, grouped by length (train.group_by_length)" in grouped.table()
    assert "random (the Trainer's default; train.group_by_length: true groups them)" in random.table()


# ------------------------------------------------------------------------------------------------
# A run


def _varied_chats(path, words=(4, 40, 12, 60, 8, 28, 50, 20, 16)):
    with path.open("w") as handle:
        for i, n in enumerate(words):
            text = " ".join(["river", "north", "garden"][(i + k) % 3] for k in range(n))
            handle.write(
                json.dumps(
                    {
                        "messages": [
                            {"role": "user", "content": f"{text} Which word came first?"},
                            {"role": "assistant", "content": text.split()[0]},
                        ]
                    }
                )
                + "\n"
            )
    return path


class _Spy:
    """Wraps the runner's trainer: records the rows of every micro-batch (of one row) in the order it trains them."""

    def __init__(self, monkeypatch):
        self.rows, self.trainer = [], None
        build = runner.build_trainer

        def spying(*args, **kwargs):
            trainer = self.trainer = build(*args, **kwargs)
            compute_loss = trainer.compute_loss

            def recording(model, inputs, *rest, **options):
                self.rows += [tuple(ids) for ids in inputs["input_ids"].tolist()]
                return compute_loss(model, inputs, *rest, **options)

            trainer.compute_loss = recording
            return trainer

        monkeypatch.setattr(runner, "build_trainer", spying)


class _KillAfterStep4(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 5:  # step 4's checkpoint is written
            raise KeyboardInterrupt("killed at step 5")


def _recipe(base, data, out):
    return load_recipe(
        "tiny-cpu",
        [
            f"model.name_or_path={base}",
            f"data.source={data}",
            "data.max_length=256",
            "rope.max_position_embeddings=512",
            f"output_dir={out}",
            "lora.r=4",
            "train.group_by_length=true",
            "train.max_steps=6",
            "train.save_steps=2",
            "train.per_device_batch_size=1",
            "train.global_batch_size=2",
            "train.seed=5",
        ],
    )


def test_a_run_draws_in_the_grouped_order_and_a_resume_continues_it(tiny_base_dirs, tmp_path, monkeypatch):
    base, data = tiny_base_dirs("llama"), _varied_chats(tmp_path / "train.jsonl")
    spy = _Spy(monkeypatch)
    straight = runner.run(_recipe(base, data, tmp_path / "straight"))
    # the rows as training holds them (tokenized, in the dataset's order), counted without longpeft's code
    rows = [tuple(ids) for ids in spy.trainer.train_dataset["input_ids"]]
    lengths = [len(ids) for ids in rows]
    assert len(set(lengths)) == len(rows) == 9
    # steps of 2 rows: 4 and a last one of 1 make the first epoch, the next epoch begins in its own order
    order = [*length_grouped_order(lengths, 2, 5, 0), *length_grouped_order(lengths, 2, 5, 1)[:2]]
    assert spy.rows == [rows[i] for i in order]
    assert spy.rows[0] == max(rows, key=len)

    spy.rows.clear()
    killed = _recipe(base, data, tmp_path / "killed")
    with pytest.raises(KeyboardInterrupt):
        runner.run(killed, callbacks=[_KillAfterStep4()])
    spy.rows.clear()
    resumed = runner.run(killed, resume=True)
    assert spy.rows == [rows[i] for i in order[8:]]  # steps 5 and 6: the uninterrupted run's rows
    losses = [json.loads(line) for line in (resumed.output_dir / "metrics.jsonl").read_text().splitlines()]
    straight_losses = [json.loads(line) for line in (straight.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in losses if "loss" in r] == pytest.approx(
        [r["loss"] for r in straight_losses if "loss" in r], rel=1e-5
    )


@pytest.mark.launch_matrix  # two processes: make test-slow
def test_two_processes_train_the_rows_of_one_process(tiny_base_dirs, tmp_path):
    """--launch ddp with two CPU processes draws the same grouped order in both (each takes its share of every
    step): losses (rel 1e-4) and adapter (atol 1e-5) equal one process's with the same global batch. Were the
    processes' orders their own, the steps would train other rows."""
    import subprocess
    import sys
    from pathlib import Path

    from longpeft.launch import launch_command

    from run_helpers import assert_same_weights, logged_losses  # tests/run_helpers.py

    base, data = tiny_base_dirs("llama"), _varied_chats(tmp_path / "train.jsonl")
    overrides = [
        f"model.name_or_path={base}",
        f"data.source={data}",
        "data.max_length=256",
        "rope.max_position_embeddings=512",
        "lora.r=4",
        "train.group_by_length=true",
        "train.max_steps=3",
        "train.per_device_batch_size=1",
        "train.global_batch_size=2",
        "train.seed=5",
    ]
    two = tmp_path / "ddp"
    recipe = load_recipe("tiny-cpu", overrides)
    command = launch_command(recipe, "tiny-cpu", "ddp", 2, [*overrides, f"output_dir={two}"])
    command[:2] = [str(Path(sys.executable).parent / "accelerate"), "launch", "--main_process_port", "29561"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    single = runner.run(load_recipe("tiny-cpu", [*overrides, f"output_dir={tmp_path / 'one'}"]))
    assert logged_losses(two)[1] == pytest.approx(logged_losses(single.output_dir)[1], rel=1e-4)
    weights = "adapter_model.safetensors"
    assert_same_weights(single.adapter_dir / weights, two / "adapter" / weights, atol=1e-5, rtol=1e-4)
