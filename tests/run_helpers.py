"""Shared by the training tests: what a run logged, and a kill simulated after one of its checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file


def logged_losses(folder: Path) -> tuple[list[int], list[float]]:
    """The steps and training losses a run wrote to its ``metrics.jsonl``."""
    records = [r for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    return [r["step"] for r in records], [r["loss"] for r in records]


def undo_after_checkpoint(whole: Path, killed: Path, checkpoint: int, last: int) -> None:
    """Copy the finished run ``whole`` to ``killed`` as a kill right after ``checkpoint`` would have left it (the
    later checkpoint ``last``, the adapter and the summary gone)."""
    assert checkpoint < last
    shutil.copytree(whole, killed)
    shutil.rmtree(killed / "adapter")
    shutil.rmtree(killed / "checkpoints" / f"checkpoint-{last}")
    (killed / "metrics.json").unlink()


def assert_same_weights(expected: Path, actual: Path, atol: float, rtol: float) -> None:
    """The safetensors file ``actual`` holds the tensors of ``expected`` (same names, none missing), each within
    ``atol`` + ``rtol``."""
    one, two = load_file(expected), load_file(actual)
    assert one.keys() == two.keys() and one
    for key in one:
        torch.testing.assert_close(two[key].cpu(), one[key].cpu(), atol=atol, rtol=rtol)


def assert_resumed_as_uninterrupted(whole: Path, killed: Path, steps: list[int]) -> None:
    """The resumed run ends with the uninterrupted run's adapter (atol 1e-6) and losses (rel 1e-5) at ``steps``."""
    assert_same_weights(
        *(folder / "adapter" / "adapter_model.safetensors" for folder in (whole, killed)), atol=1e-6, rtol=0
    )
    (resumed_steps, resumed), (expected_steps, expected) = logged_losses(killed), logged_losses(whole)
    assert resumed_steps == expected_steps == steps and resumed == pytest.approx(expected, rel=1e-5)
