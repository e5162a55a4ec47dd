"""scripts/trace_handoffs.py: which calls count as hand-offs, and which hand-offs return to a file already left."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "trace_handoffs.py"
spec = importlib.util.spec_from_file_location("trace_handoffs", SCRIPT)
tracer = sys.modules["trace_handoffs"] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
spec.loader.exec_module(tracer)


def test_a_return_is_a_hand_off_into_a_file_left_before():
    trace = tracer.HandoffTrace(("runner.py",))
    trace.sequence = [("runner.py", callee, "f") for callee in ("a.py", "b.py", "a.py", "a.py", "c.py", "b.py")]
    assert trace.returns() == [2, 5]  # a.py after b.py, b.py after c.py; a.py twice in a row is one stay


def test_a_context_manager_counts_once_and_the_callers_own_calls_not_at_all(tmp_path):
    """``train_or_take_last`` enters ``files.writing_to`` through contextlib (looked through) and leaves it (a
    generator resumed: not counted); the trainer it calls is not longpeft's, and what the trainer calls back is not
    the orchestrator's call."""
    from longpeft.files import is_local
    from longpeft.recipes.resume import train_or_take_last

    def train(resume_from_checkpoint):
        assert is_local(str(tmp_path))  # a call into longpeft, from the trainer's code: not a hand-off
        return SimpleNamespace(metrics={"train_loss": 1.0})

    trainer = SimpleNamespace(args=SimpleNamespace(output_dir=str(tmp_path)), train=train)
    trace, metrics = tracer.trace(lambda: train_or_take_last(trainer, None), ("longpeft/recipes/resume.py",))
    assert metrics == {"train_loss": 1.0}
    assert trace.sequence == [("longpeft/recipes/resume.py", "longpeft/files.py", "writing_to")]


def test_the_traced_command_prints_each_hand_off_and_the_counts(capsys):
    """``plan`` without --gpus: every listed call goes from the CLI into another file, the last line counts them."""
    assert tracer.main(["--", "plan", "tiny-cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    summary = json.loads(lines[-1])
    listed = [line for line in lines if " -> " in line]
    assert summary["handoffs"] == len(listed) > 0 and summary["exit_status"] == 0
    assert summary["returns"] == sum(line.endswith("(return)") for line in listed)
    for line in listed:
        caller, callee = line.split(maxsplit=1)[1].split(":")[0].split(" -> ")
        assert tracer.HandoffTrace(tracer.ORCHESTRATORS).orchestrates(caller) and callee != caller
    assert any(line.endswith("longpeft/recipes/validate.py: validate_recipe") for line in listed)
