"""The eval-task contract (``longpeft/eval/registry.py``), checked on every registered task:

- ``longpeft eval NAME`` parses each of its flags, fills its defaults, and refuses every other task's flags by name;
- a probe task builds probes of exact lengths holding their answers; its decode budget fits them (a model that
  answers every probe right scores 1 and one that answers a known fraction scores that fraction, counted here from
  the answers, not by the task's scorer); it decodes and scores on a tiny model through ``evaluate``;
- every other task runs its :data:`CASES` case on a tiny model (or is a command of its own);
- no module of ``longpeft/eval`` or ``longpeft/cli/`` but the registrations names a task in a condition.

A task registered later (a plug-in) is one ``register`` line: :func:`test_a_plug_in_task_is_one_register_line`
defines one here, with a flag of its own, and runs ``longpeft eval`` on it end to end.
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

import pytest
import torch

from longpeft.errors import ConfigError
from longpeft.eval import TASKS, evaluate, registered
from longpeft.eval.cli import check_task_flags
from longpeft.eval.cli import register as register_eval
from longpeft.eval.flags import PROBE_FLAGS, Flag
from longpeft.eval.registry import ALIASES, EvalTask, ProbeTask, make_probes, register, unregister
from longpeft.synth_data.probes import Probe, ProbeBuilder
from longpeft.tiny import sample_text, tiny_model

PACKAGE = Path(__file__).resolve().parents[1] / "longpeft"
LENGTH = 700  # long enough for every built-in probe task (common_words needs the most)
GRID = {"lengths": [LENGTH], "depths": [0.0, 1.0], "n_samples": 2, "seed": 3}


def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "text.txt"
    path.write_text(" ".join(sample_text(15, seed=1)))
    return path


# The case of each registered task that is not a probe task: its options on a tiny model (None: a command of its
# own, run by its own tests).
CASES = {
    "ruler": lambda tmp_path: {"lengths": [LENGTH], "depths": [0.5], "n_samples": 1, "max_new_tokens": 2},
    "perplexity": lambda tmp_path: {"text": text_file(tmp_path), "window": 64, "stride": 32},
    "harness": None,  # tests/test_eval_harness.py
}


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    register_eval(parser.add_subparsers())
    return parser


def given(flag: Flag) -> list[str]:
    """``flag`` on a command line, with a value every flag's type accepts."""
    return [flag.flag] if flag.argparse.get("action") == "store_true" else [flag.flag, "2"]


def parse(name: str, *argv: str) -> argparse.Namespace:
    return parser().parse_args(["eval", name, "--model", "m", "--out", "o", *argv])


@pytest.mark.parametrize("name", list(TASKS))
def test_the_cli_parses_its_flags_and_refuses_the_others(name):
    task = TASKS[name]
    needed = [arg for flag in task.flags if flag.needs for arg in given(flag)]
    for flag in (flag for flag in task.flags if flag.needs):
        with pytest.raises(ConfigError, match=f"longpeft eval {name} needs {flag.flag}"):
            check_task_flags(parse(name, *[a for a in needed if a not in given(flag)]), task)
    args = parse(name, *needed)
    check_task_flags(args, task)
    assert all(getattr(args, f.dest) == f.default for f in task.flags if not f.needs)
    for flag in task.flags:  # each one reaches its dest
        args = parse(name, *needed, *([] if flag.needs else given(flag)))
        check_task_flags(args, task)
        assert getattr(args, flag.dest) not in (None, flag.default)
    own = {flag.flag for flag in task.flags}
    for other in {f.flag: f for t in TASKS.values() for f in t.flags if f.flag not in own}.values():
        with pytest.raises(ConfigError, match=f"^{other.flag}: not used by eval {name} "):
            check_task_flags(parse(name, *needed, *given(other)), task)


PROBE_TASKS = [name for name, task in TASKS.items() if isinstance(task, ProbeTask)]


@pytest.mark.parametrize("name", PROBE_TASKS)
def test_a_probe_task_builds_probes_of_exact_length_holding_their_answers(name, tokenizer):
    task = TASKS[name]
    probes = make_probes(name, tokenizer, **GRID)
    assert len(probes) == 2 * (2 if task.depths else 1)
    for probe in probes:
        assert probe.task == name and len(probe.input_ids) == probe.length == LENGTH
        assert (probe.depth is not None) == task.depths
        assert probe.answers and all(answer in tokenizer.decode(probe.input_ids) for answer in probe.answers)


class Answering:
    """A stand-in for a causal LM whose ``generate`` continues each known prompt with the first ``share`` of its
    answers (``", "``-joined), cut to the decode budget."""

    def __init__(self, tokenizer, probes: list[Probe], share: float):
        self.tokenizer, self.share = tokenizer, share
        self.answers = {tuple(p.input_ids): p.answers[: round(share * len(p.answers))] for p in probes}
        self.device = torch.device("cpu")

    def generate(self, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id, **kwargs):
        rows = []
        for ids, mask in zip(input_ids, attention_mask):
            reply = " " + ", ".join(self.answers[tuple(ids[mask.bool()].tolist())]) + "."
            new = self.tokenizer.encode(reply, add_special_tokens=False) + [eos_token_id[0]]
            rows.append(torch.cat([ids, torch.tensor((new + [pad_token_id] * max_new_tokens)[:max_new_tokens])]))
        return torch.stack(rows)


@pytest.mark.parametrize("name", PROBE_TASKS)
def test_a_probe_task_scores_what_its_answers_say_within_its_decode_budget(name, tokenizer):
    probes = make_probes(name, tokenizer, **GRID)
    assert evaluate(name, Answering(tokenizer, probes, 1.0), tokenizer, **GRID)["score"] == 1.0
    assert evaluate(name, Answering(tokenizer, probes, 0.0), tokenizer, **GRID)["score"] == 0.0
    several = [p for p in probes if len(p.answers) > 1]
    if several:  # recall: the fraction of the answers given
        half = evaluate(name, Answering(tokenizer, probes, 0.5), tokenizer, **GRID)
        expected = [round(0.5 * len(p.answers)) / len(p.answers) for p in probes]
        assert [s["score"] for s in half["samples"]] == pytest.approx(expected)


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_model("llama", vocab_size=len(tokenizer), attn_implementation="sdpa")


@pytest.mark.filterwarnings("ignore:inputs of")  # the prompts are longer than the tiny model's 256 positions
@pytest.mark.parametrize("name", list(TASKS))
def test_it_runs_on_a_tiny_model(name, model, tokenizer, tmp_path):
    task = TASKS[name]
    if isinstance(task, ProbeTask):
        options = {**GRID, "n_samples": 1, "max_new_tokens": 2}  # the decode budget: the test above
    elif name not in CASES:
        pytest.fail(f"eval task {name} has no contract case: add its options to CASES in {Path(__file__).name}")
    elif CASES[name] is None:
        with pytest.raises(ConfigError, match="runs from the command line only"):
            evaluate(name, model, tokenizer)
        return
    else:
        options = CASES[name](tmp_path)
    result = evaluate(name, model, tokenizer, out_dir=tmp_path / "out", **options)
    assert result["task"] == name and (tmp_path / "out" / f"{name}.json").is_file()
    if isinstance(task, ProbeTask):
        assert 0.0 <= result["score"] <= 1.0 and len(result["samples"]) == (2 if task.depths else 1)
        assert all(isinstance(s["prediction"], str) and 0.0 <= s["score"] <= 1.0 for s in result["samples"])


def code_word(builder: ProbeBuilder, length: int, digits: int = 3) -> Probe:
    """A code of ``digits`` digits in the filler, asked back (a plug-in probe builder)."""
    code = builder.number(digits)
    ids, positions = builder.assemble(length, "Remember the code.", [(0.5, f"The code is {code}.")], "The code is")
    return Probe("code_word", ids, [code], builder.single_answer_metric, length, None, positions)


DIGITS = Flag("--digits", "digits of the code (default 3)", 3, {"type": int})
PLUG_IN = ProbeTask("code_word", "a code asked back", (*PROBE_FLAGS, DIGITS), code_word, 8)


def test_a_plug_in_task_is_one_register_line(tiny_base_dirs, tokenizer, tmp_path, capsys):
    base = tiny_base_dirs("llama")
    with registered(PLUG_IN):
        args = parser().parse_args(
            ["eval", "code_word", "--model", str(base), "--lengths", "200", "--samples", "2", "--digits", "4"]
            + ["--out", str(tmp_path)]
        )
        assert args.func(args) == 0
        assert '"task": "code_word"' in capsys.readouterr().out
        saved = json.loads((tmp_path / "code_word.json").read_text())
        assert [len(s["answers"][0]) for s in saved["samples"]] == [4, 4]  # --digits reached the builder
        assert (tmp_path / "code_word_by_length.png").is_file()
        with pytest.raises(ConfigError, match="--digits: not used by eval passkey"):
            check_task_flags(parse("passkey", "--digits", "4"), TASKS["passkey"])
        probes = make_probes("code_word", tokenizer, [200], n_samples=3)
        assert (
            evaluate("code_word", Answering(tokenizer, probes, 1.0), tokenizer, lengths=[200], n_samples=3)["score"]
            == 1.0
        )
    assert "code_word" not in TASKS
    with pytest.raises(SystemExit):
        parse("code_word")


def test_register_refuses_a_taken_name_a_flag_declared_differently_and_no_budget():
    with pytest.raises(ValueError, match="'niah' is already registered"):
        register(ProbeTask("niah", "x", PROBE_FLAGS, code_word, 8))
    lengths = Flag("--lengths", "other help", None, {"type": int})
    with pytest.raises(ValueError, match="--lengths is declared differently by another task"):
        register(ProbeTask("other", "x", (lengths,), code_word, 8))
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        register(ProbeTask("other", "x", PROBE_FLAGS, code_word, 0))
    assert "other" not in TASKS and "other" not in ALIASES
    unregister("other")  # nothing to remove: no error


def test_a_task_without_a_run_of_its_own_says_so(model, tokenizer):
    with registered(EvalTask("bare", "x", ())):
        with pytest.raises(ConfigError, match="eval bare runs from the command line only"):
            evaluate("bare", model, tokenizer)


def test_no_module_but_the_registrations_names_a_task_in_a_condition():
    """``longpeft eval`` and ``evaluate`` ask the registry: outside ``longpeft/eval/builtin.py`` no module of
    ``longpeft/eval`` (nor ``longpeft/cli/``) compares with or tests membership in a task's name."""
    names = set(TASKS) | set(ALIASES)
    problems = []
    for path in [*sorted((PACKAGE / "eval").glob("*.py")), *sorted((PACKAGE / "cli").glob("*.py"))]:
        if path.name == "builtin.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                constants = [n.value for o in operands for n in ast.walk(o) if isinstance(n, ast.Constant)]
                if names & set(constants):
                    problems.append(f"{path.name}:{node.lineno}")
    assert problems == []
