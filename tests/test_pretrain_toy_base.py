"""scripts/pretrain_toy_base.py: seeded (two runs give the same weights) and resumable (a run killed
after a checkpoint and resumed gives the uninterrupted run's weights), on a very small model."""

from __future__ import annotations

import importlib.util
import itertools
import json
import types
from pathlib import Path

import pytest
from safetensors.torch import load_file

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "pretrain_toy_base.py"
spec = importlib.util.spec_from_file_location("pretrain_toy_base", SCRIPT)
pretrain = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pretrain)

SMALL = [
    "--steps",
    "4",
    "--hidden",
    "32",
    "--layers",
    "1",
    "--heads",
    "2",
    "--kv-heads",
    "1",
    "--intermediate",
    "64",
    "--tokens-per-step",
    "512",
    "--eval-every",
    "100",
    "--save-every",
    "2",
    "--warmup",
    "2",
]


class Killed(Exception):
    pass


def weights(folder: Path) -> dict:
    return load_file(folder / "model.safetensors")


def test_pretraining_is_seeded_and_resumes_exactly(tmp_path, monkeypatch):
    assert pretrain.main(["--out", str(tmp_path / "a"), *SMALL]) == 0
    assert pretrain.main(["--out", str(tmp_path / "b"), *SMALL]) == 0
    a, b = weights(tmp_path / "a"), weights(tmp_path / "b")
    assert all((a[k] == b[k]).all() for k in a)

    real_step_batch = pretrain.step_batch

    def dies_at_step_3(step, args, tokenizer):  # after the checkpoint written at step 2
        if step == 3:
            raise Killed
        return real_step_batch(step, args, tokenizer)

    clock = itertools.count(0, 100)  # every reading of the clock is 100 s after the previous one
    monkeypatch.setattr(pretrain, "time", types.SimpleNamespace(time=lambda: next(clock)))
    monkeypatch.setattr(pretrain, "step_batch", dies_at_step_3)
    with pytest.raises(Killed):
        pretrain.main(["--out", str(tmp_path / "c"), *SMALL])
    monkeypatch.setattr(pretrain, "step_batch", real_step_batch)
    assert pretrain.main(["--out", str(tmp_path / "c"), *SMALL, "--resume"]) == 0
    # reported training time: 100 s up to the killed run's checkpoint, plus the resumed run's 200 s
    # (clock read at its start, at its checkpoint, at its end); the resumed run alone would say 200
    assert json.loads((tmp_path / "c" / "scores.json").read_text())["train_seconds"] == 100 + 200
    c = weights(tmp_path / "c")
    assert all((a[k] == c[k]).all() for k in a)
    log = [json.loads(line)["step"] for line in (tmp_path / "c" / "training_log.jsonl").read_text().splitlines()]
    assert log == [0, 1, 2, 3]  # no step logged twice
    scores = json.loads((tmp_path / "a" / "scores.json").read_text())["scores"]
    assert set(scores) == {"passkey", "niah_single"} and set(scores["passkey"]) == {"256", "512", "1024"}
    assert "| passkey |" in (tmp_path / "a" / "README.md").read_text()


def test_pretraining_arguments_are_checked():
    with pytest.raises(SystemExit):
        pretrain.parse_args(["--heads", "3", "--kv-heads", "2"])
    assert (
        pretrain.step_length(0, pretrain.parse_args([])) == 64
        and pretrain.step_length(10**6, pretrain.parse_args([])) == 256
    )
