"""Nothing deleted or overwritten that longpeft did not write; resume is exact after any kill; a
diverging run stops; bad input ends in one message and exit status 2."""

from __future__ import annotations

import errno
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import yaml
from huggingface_hub.errors import HFValidationError
from safetensors import SafetensorError
from safetensors.torch import load_file

from longpeft import hub
from longpeft.cli import main
from longpeft.demo import DEMO_MARKER, prepare_demo_folder
from longpeft.errors import ConfigError, DataError, LongpeftError, ModelSourceError, OutputFolderError
from longpeft.recipes.checkpoints import STAGING
from longpeft.recipes.runner import run
from longpeft.recipes.schema import load_recipe
from longpeft.recipes.trainer import StopOnNonFinite, TrainingDiverged

from run_helpers import assert_resumed_as_uninterrupted, undo_after_checkpoint


def _recipe(base, data, out, *extra):
    return load_recipe(
        "tiny-cpu",
        [
            f"model.name_or_path={base}",
            f"data.source={data}",
            "data.max_length=256",
            f"output_dir={out}",
            "train.max_steps=2",
            "train.save_steps=1",
            "train.global_batch_size=1",
            "train.per_device_batch_size=1",
            "lora.r=2",
            "lora.embeddings=none",
            *extra,
        ],
    )


def _adapter_tensors(folder: Path) -> dict:
    return load_file(folder / "adapter_model.safetensors")


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


# ---- data loss --------------------------------------------------------------------------------


def test_demo_never_deletes_a_folder_it_did_not_write(tmp_path):
    mine = tmp_path / "my-runs"
    mine.mkdir()
    (mine / "notes.txt").write_text("precious")
    (mine / "adapter").mkdir()
    with pytest.raises(FileExistsError, match="was not written by `longpeft demo`"):
        prepare_demo_folder(mine)
    assert (mine / "notes.txt").read_text() == "precious" and (mine / "adapter").is_dir()


def test_demo_replaces_only_its_own_outputs(tmp_path):
    demo = tmp_path / "demo"
    prepare_demo_folder(demo)
    (demo / "adapter").mkdir()
    (demo / "metrics.json").write_text("{}")
    (demo / "my-notes.md").write_text("keep me")
    prepare_demo_folder(demo)
    assert not (demo / "adapter").exists() and not (demo / "metrics.json").exists()
    assert (demo / "my-notes.md").read_text() == "keep me" and (demo / DEMO_MARKER).is_file()


@pytest.fixture(scope="module")
def finished_run(tiny_base_dirs, tmp_path_factory):
    from conftest import write_chat_jsonl

    root = tmp_path_factory.mktemp("finished")
    data = write_chat_jsonl(root / "train.jsonl")
    result = run(_recipe(tiny_base_dirs("llama"), data, root / "run"))
    return root, data, result


@pytest.mark.parametrize("target", ["adapter", "base", "nonempty", "file"])
def test_merge_refuses_an_output_that_would_overwrite_something(finished_run, tiny_base_dirs, target, tmp_path):
    _, _, result = finished_run
    before = {p: p.stat().st_mtime_ns for p in tiny_base_dirs("llama").iterdir()}
    out = {
        "adapter": result.adapter_dir,
        "base": tiny_base_dirs("llama"),
        "nonempty": tmp_path,
        "file": tmp_path / "f",
    }[target]
    (tmp_path / "something").write_text("x")
    (tmp_path / "f").write_text("x")
    with pytest.raises((FileExistsError, NotADirectoryError), match="--out"):
        hub.merge(result.adapter_dir, out)
    assert {p: p.stat().st_mtime_ns for p in tiny_base_dirs("llama").iterdir()} == before
    assert (result.adapter_dir / "adapter_model.safetensors").is_file()


# ---- resume -----------------------------------------------------------------------------------


def test_resume_after_the_run_finished_trains_no_further(finished_run, tmp_path):
    root, data, result = finished_run
    copy = tmp_path / "run"
    shutil.copytree(result.output_dir, copy)
    first = _adapter_tensors(copy / "adapter")
    again = run(_recipe(_base_of(result), data, copy), resume=True)
    assert again.metrics["steps"] == 2 and _same(_adapter_tensors(copy / "adapter"), first)

    shutil.rmtree(copy / "adapter")  # a kill after the last checkpoint, before the adapter was saved
    resumed = run(_recipe(_base_of(result), data, copy), resume=True)
    assert resumed.metrics["steps"] == 2 and _same(_adapter_tensors(copy / "adapter"), first)


def _base_of(result) -> str:
    return json.loads((result.output_dir / "recipe.resolved.json").read_text())["base_model"]


def test_resume_skips_a_torn_checkpoint_and_damaged_metrics(finished_run, tmp_path, capsys):
    root, data, result = finished_run
    copy = tmp_path / "run"
    shutil.copytree(result.output_dir, copy)
    shutil.rmtree(copy / "adapter")
    (copy / "checkpoints" / "checkpoint-2" / "optimizer.pt").unlink()  # killed while writing it
    (copy / "checkpoints" / "checkpoint-abc").mkdir()  # a stray folder
    with (copy / "metrics.jsonl").open("a") as f:
        f.write('{"step": 2, "lo')  # a torn last line
    resumed = run(_recipe(_base_of(result), data, copy), resume=True)
    assert "checkpoint-2 is incomplete" in capsys.readouterr().err
    assert resumed.metrics["steps"] == 2
    assert _same(_adapter_tensors(copy / "adapter"), _adapter_tensors(result.adapter_dir))  # same as uninterrupted
    lines = (copy / "metrics.jsonl").read_text().splitlines()
    assert all(json.loads(line) for line in lines) and [r["step"] for r in map(json.loads, lines) if "loss" in r] == [
        1,
        2,
    ]


def _cut_short(write, name: str, step: int = 2):
    """``write(obj, path, ...)`` that, writing ``name`` into checkpoint ``step``, leaves half of it and is killed."""

    def cut(obj, path, *args, **kwargs):
        write(obj, path, *args, **kwargs)
        path = Path(path)
        if path.name == name and path.parent.name == f"checkpoint-{step}":
            with path.open("r+b") as handle:
                handle.truncate(path.stat().st_size // 2)
            raise KeyboardInterrupt(f"killed while writing {path}")

    return cut


def _killed_before_the_rename(_publish):
    def cut(checkpoints, name):
        raise KeyboardInterrupt(f"killed before {name} took its name")

    return cut


def _killed_while_rotating(rmtree):
    def cut(path, *args, **kwargs):
        if Path(path).name != "checkpoint-1":
            return rmtree(path, *args, **kwargs)
        next(p for p in Path(path).iterdir() if p.is_file()).unlink()  # one file gone, then the kill
        raise KeyboardInterrupt(f"killed while deleting {path}")

    return cut


# Each moment of checkpoint 2's save at which a kill comes: (the writer patched, its replacement given the writer)
SAVE_MOMENTS = {
    "adapter weights": ("peft.peft_model.safe_save_file", lambda f: _cut_short(f, "adapter_model.safetensors")),
    "optimizer": ("torch.save", lambda f: _cut_short(f, "optimizer.pt")),
    "trainer state": (
        "transformers.trainer_callback.TrainerState.save_to_json",
        lambda f: _cut_short(f, "trainer_state.json"),
    ),
    "every file written, not yet renamed": (
        "longpeft.recipes.recipe_trainer.publish_checkpoint",
        _killed_before_the_rename,
    ),
}


def test_a_checkpoint_save_cut_short_at_any_moment_leaves_nothing_a_resume_takes(finished_run, tmp_path, monkeypatch):
    """A kill inside each write of a checkpoint's save (the file half written) or just before it takes its name
    leaves no folder under that name; each rerun resumes from the checkpoint before and is cut short at the next
    moment. A kill while the save rotates an older checkpoint away leaves the new one, complete. The last rerun ends
    with the adapter and losses of the run never cut short."""
    from pkgutil import resolve_name

    from longpeft.recipes.checkpoints import latest_checkpoint

    root, data, result = finished_run
    killed = tmp_path / "run"
    undo_after_checkpoint(result.output_dir, killed, 1, 2)
    checkpoints = killed / "checkpoints"
    for moment, (target, replacement) in SAVE_MOMENTS.items():
        with monkeypatch.context() as patch:
            patch.setattr(target, replacement(resolve_name(target)))
            with pytest.raises(KeyboardInterrupt):
                run(_recipe(_base_of(result), data, killed), resume=True)
        assert not (checkpoints / "checkpoint-2").exists(), moment
        assert latest_checkpoint(killed) == checkpoints / "checkpoint-1", moment

    with monkeypatch.context() as patch:  # the new checkpoint has its name before older ones are deleted
        patch.setattr(shutil, "rmtree", _killed_while_rotating(shutil.rmtree))
        with pytest.raises(KeyboardInterrupt):
            run(_recipe(_base_of(result), data, killed, "train.save_total_limit=1"), resume=True)
    assert latest_checkpoint(killed) == checkpoints / "checkpoint-2"
    assert not (checkpoints / STAGING).exists() or not any((checkpoints / STAGING).iterdir())

    run(_recipe(_base_of(result), data, killed), resume=True)  # takes checkpoint 2: the run's last step
    assert_resumed_as_uninterrupted(result.output_dir, killed, [1, 2])


def test_resume_refuses_a_changed_recipe(finished_run, tmp_path):
    root, data, result = finished_run
    copy = tmp_path / "run"
    shutil.copytree(result.output_dir, copy)
    changed = _recipe(_base_of(result), data, copy, "train.learning_rate=0.01", "rope.rope_theta=50000")
    with pytest.raises(ValueError, match=r"recipe changed .*rope.rope_theta, train.learning_rate"):
        run(changed, resume=True)
    assert run(changed, resume=True, allow_recipe_change=True).metrics["steps"] == 2
    # the allowed recipe is the run's now (flag not needed again)
    assert run(changed, resume=True).metrics["steps"] == 2


def test_resume_of_a_run_started_before_a_key_existed(finished_run, tmp_path):
    """A run started by a longpeft without ``data.min_length`` resumes without --allow-recipe-change while the key
    stays at its default (the old behaviour), and is refused, naming it, when the key is set."""
    root, data, result = finished_run
    copy = tmp_path / "run"
    shutil.copytree(result.output_dir, copy)
    saved = copy / "recipe.training.json"
    older = json.loads(saved.read_text())
    del older["data.min_length"]
    saved.write_text(json.dumps(older))
    with pytest.raises(ValueError, match=r"recipe changed .*\(data\.min_length\)"):
        run(_recipe(_base_of(result), data, copy, "data.min_length=4"), resume=True)
    assert run(_recipe(_base_of(result), data, copy), resume=True).metrics["steps"] == 2


def test_resume_with_more_steps_trains_them(finished_run, tmp_path):
    """A finished 2-step run resumed with train.max_steps=4 (an allowed recipe change) trains steps 3 and 4."""
    root, data, result = finished_run
    copy = tmp_path / "run"
    shutil.copytree(result.output_dir, copy)
    longer = run(_recipe(_base_of(result), data, copy, "train.max_steps=4"), resume=True, allow_recipe_change=True)
    assert longer.metrics["steps"] == 4
    assert not _same(_adapter_tensors(copy / "adapter"), _adapter_tensors(result.adapter_dir))
    logged = [json.loads(line)["step"] for line in (copy / "metrics.jsonl").read_text().splitlines()]
    assert {3, 4} <= set(logged)


def _logged_rates(folder: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["learning_rate"] for r in records if "learning_rate" in r}


def test_a_changed_learning_rate_is_taken_up_by_the_resumed_run(finished_run, tmp_path):
    """--allow-recipe-change with a new learning rate trains with it (the checkpoint's optimizer and scheduler
    state would restore the old one): steps 3 and 4 run at 10x the rates of the same resume without the change."""
    root, data, result = finished_run
    faster_rate = 10 * load_recipe("tiny-cpu").train.learning_rate
    runs = {}
    for name, extra in (("same", ()), ("faster", (f"train.learning_rate={faster_rate}",))):
        copy = tmp_path / name
        shutil.copytree(result.output_dir, copy)
        run(_recipe(_base_of(result), data, copy, "train.max_steps=4", *extra), resume=True, allow_recipe_change=True)
        runs[name] = copy
    same, faster = (_logged_rates(runs[name]) for name in ("same", "faster"))
    assert {3, 4} <= same.keys() and same[3] > 0
    for step in (3, 4):
        assert faster[step] == pytest.approx(10 * same[step], rel=1e-6), step
    assert not _same(_adapter_tensors(runs["same"] / "adapter"), _adapter_tensors(runs["faster"] / "adapter"))


@pytest.mark.parametrize("damage", ["missing", "garbage", "a list"])
def test_a_resume_without_a_readable_recipe_record_is_refused(finished_run, tmp_path, damage):
    root, data, result = finished_run
    copy = tmp_path / "run"
    shutil.copytree(result.output_dir, copy)
    record = copy / "recipe.training.json"
    if damage == "missing":
        record.unlink()
    else:
        record.write_text("{not json" if damage == "garbage" else "[1, 2]")
    changed = _recipe(_base_of(result), data, copy, "rope.rope_theta=50000")
    with pytest.raises(
        ConfigError,
        match=r"recipe.training.json is missing or unreadable, so a changed recipe "
        r"cannot be detected; resume with --allow-recipe-change",
    ):
        run(changed, resume=True)
    assert run(changed, resume=True, allow_recipe_change=True).metrics["steps"] == 2
    assert json.loads(record.read_text())["rope.rope_theta"] == 50000  # written anew: the next resume compares
    run(changed, resume=True)


@pytest.mark.parametrize(
    "change, key",
    [
        ("train.weight_decay=0.1", "train.weight_decay"),
        ("train.optim=adafactor", "train.optim"),
        ("lora.r=4", "lora.r"),
    ],
)
def test_a_resume_refuses_changes_it_cannot_take_up(finished_run, tmp_path, change, key):
    root, data, result = finished_run
    copy = tmp_path / "run"
    shutil.copytree(result.output_dir, copy)
    refused = rf"--resume: {re.escape(key)} \(the checkpoint.*cannot take this change up"
    with pytest.raises(ConfigError, match=refused):
        run(_recipe(_base_of(result), data, copy, change), resume=True, allow_recipe_change=True)


def test_a_finished_run_of_fractional_epochs_is_not_trained_again(tiny_base_dirs, tmp_path):
    """transformers records ceil(num_train_epochs) in the checkpoint, so 0.5 epochs never equalled the recipe's
    and a finished run trained one more step on resume."""
    from conftest import write_chat_jsonl

    data = write_chat_jsonl(tmp_path / "train.jsonl", n=8)
    recipe = _recipe(
        tiny_base_dirs("llama"), data, tmp_path / "run", "train.max_steps=-1", "train.num_train_epochs=0.5"
    )
    first = run(recipe)
    weights = _adapter_tensors(first.adapter_dir)
    again = run(recipe, resume=True)
    assert again.metrics["steps"] == first.metrics["steps"] == 4 and _same(
        _adapter_tensors(again.adapter_dir), weights
    )
    assert not (tmp_path / "run" / "checkpoints" / "checkpoint-5").exists()


# ---- non-finite -------------------------------------------------------------------------------


@pytest.mark.parametrize("logs", [{"loss": math.nan}, {"grad_norm": math.inf}])
def test_a_diverging_run_stops_with_a_message(logs):
    from types import SimpleNamespace

    with pytest.raises(TrainingDiverged, match="training diverged at step 7"):
        StopOnNonFinite().on_log(None, SimpleNamespace(global_step=7), None, logs=logs)
    assert issubclass(TrainingDiverged, LongpeftError)  # the CLI turns it into one message, exit 2


# ---- one message, exit 2 ------------------------------------------------------------------------


def _bad_spec(tmp_path: Path) -> Path:
    folder = tmp_path / "bad-adapter"
    folder.mkdir()
    (folder / "longpeft.json").write_text("[]")
    return folder


@pytest.mark.parametrize(
    "argv, names",
    [
        (["train", "tiny-cpu", "--set", "rope.rope_theta=.inf"], "rope.rope_theta"),
        (["train", "tiny-cpu", "--set", "train.max_steps=[1"], "train.max_steps"),
        (["train", "no-such-recipe"], "no-such-recipe"),
        (["plan", "tiny-cpu", "--set", "trl.bogus=1"], "trl.bogus"),
        (["merge", "{bad}", "--out", "{tmp}/merged"], "longpeft.json"),
        (["merge", "{tmp}/nowhere", "--out", "{tmp}/merged"], "nowhere"),
    ],
)
def test_bad_input_is_one_message_and_exit_2(argv, names, tmp_path, capsys):
    bad = _bad_spec(tmp_path)
    argv = [a.format(bad=bad, tmp=tmp_path) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert names in err and "Traceback" not in err and err.startswith(f"longpeft {argv[0]}: ")


def _raising(error: BaseException):
    def command(args):
        raise error

    return command


@pytest.mark.parametrize(
    "error",
    [
        ConfigError("train.bogus: unknown key"),
        DataError("data.jsonl row 3: no assistant turn"),
        ModelSourceError("base model /no/base: no such folder"),
        OutputFolderError("--out runs/x is not empty"),
        OSError(errno.ENOSPC, "No space left on device"),
        PermissionError("runs/x is not writable"),
        ImportError("flash_attn is not installed"),
        json.JSONDecodeError("Expecting value", "{", 1),
        yaml.YAMLError("mapping values are not allowed here"),
        HFValidationError("Repo id must be in the form 'a/b'"),
        SafetensorError("Error while deserializing header: header too large"),
    ],
)
def test_a_user_error_is_one_line_and_debug_shows_its_traceback(error, monkeypatch, capsys):
    """The one boundary of every command: longpeft's errors and the libraries' bad-input errors print one line and
    exit 2; --debug (or LONGPEFT_DEBUG) lets them through with their traceback."""
    import longpeft.cli.plan

    monkeypatch.setattr(longpeft.cli.plan, "cmd_plan", _raising(error))
    assert main(["plan", "tiny-cpu"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[1] == "(run with --debug for the traceback)"
    if isinstance(error, LongpeftError):  # longpeft's own message as it is; a library's with what it means
        assert lines[0] == f"longpeft plan: error: {error}"
    assert lines[0].startswith("longpeft plan: error: ") and str(error).split(":")[0] in lines[0]
    with pytest.raises(type(error)):
        main(["--debug", "plan", "tiny-cpu"])
    monkeypatch.setenv("LONGPEFT_DEBUG", "1")
    with pytest.raises(type(error)):
        main(["plan", "tiny-cpu"])


@pytest.mark.parametrize(
    "error",
    [
        KeyError("num_attention_heads"),
        TypeError("unsupported operand"),
        AttributeError("'NoneType' object has no attribute 'config'"),
        ValueError("too many values to unpack"),
    ],
)
def test_a_bug_keeps_its_traceback(error, monkeypatch, capsys):
    """A KeyError (or any error longpeft did not raise as a user error) is a bug: it is not dressed as bad input,
    its traceback is printed, and a last line says so and how to report it (exit 1)."""
    import longpeft.cli.plan

    monkeypatch.setattr(longpeft.cli.plan, "cmd_plan", _raising(error))
    assert main(["plan", "tiny-cpu"]) == 1
    err = capsys.readouterr().err
    assert "error:" not in err and f"{type(error).__name__}: {error}" in err
    assert err.splitlines()[-1].endswith("run with --debug and report the traceback")


def test_the_console_prints_a_bugs_traceback(tmp_path):
    """What a user sees: the whole traceback of a KeyError from a bug, one line for bad input."""
    import subprocess
    import sys

    code = (
        "import sys, longpeft.cli as cli, longpeft.cli.plan\n"
        "def broken(args): return {}['num_attention_heads']\n"
        "cli.plan.cmd_plan = broken\n"
        "sys.exit(cli.main(sys.argv[1:]))\n"
    )
    bug = subprocess.run([sys.executable, "-c", code, "plan", "tiny-cpu"], capture_output=True, text=True, timeout=120)
    assert bug.returncode == 1 and "Traceback" in bug.stderr and "KeyError: 'num_attention_heads'" in bug.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "longpeft.cli", "plan", "tiny-cpu", "--set", "train.bogus=1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "train.bogus: unknown key" in bad.stderr


# ---- bounded waits --------------------------------------------------------------------------------


def test_a_hub_that_never_answers_is_a_bounded_wait_naming_the_endpoint(tmp_path):
    """A server on 127.0.0.1 that accepts connections and never answers, named by HF_ENDPOINT as a user would: the
    CLI gives up in seconds (tests/test_hub_access.py: every command, stalled files too)."""
    import subprocess
    import sys

    from fake_hub import hub_env, silent_hub

    code = "from longpeft.cli import main; import sys; sys.exit(main(sys.argv[1:]))\n"
    with silent_hub() as endpoint:
        for argv in (
            ["eval", "passkey", "--model", "owner/name", "--out", str(tmp_path / "e")],
            ["merge", "owner/adapter", "--out", str(tmp_path / "m")],
        ):
            # an unbounded wait would hang until this timeout (TimeoutExpired); a loaded machine may take a minute
            proc = subprocess.run(
                [sys.executable, "-c", code, *argv],
                capture_output=True,
                text=True,
                timeout=180,
                env=hub_env(endpoint, timeout=2),
            )
            assert proc.returncode == 2 and endpoint in proc.stderr and "did not answer" in proc.stderr
            assert "Traceback" not in proc.stderr


def test_a_tokenizer_that_encodes_nothing_is_refused():
    from longpeft.synth_data.probes import ProbeBuilder

    class Silent:
        name_or_path = "silent"

        def encode(self, text, add_special_tokens=True):
            return []

    with pytest.raises(ValueError, match="encodes text to no token ids"):
        ProbeBuilder(Silent())


def test_a_partial_tiny_base_is_rebuilt_not_trusted(tmp_path):
    from transformers import AutoTokenizer

    from longpeft.recipes.base import materialize_tiny_base

    folder = tmp_path / "base"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text("{")  # what a full disk left behind
    materialize_tiny_base("tiny:llama", folder, seed=0)
    assert (folder / "config.json").is_file() and AutoTokenizer.from_pretrained(folder) is not None
    assert [p.name for p in tmp_path.iterdir()] == ["base"]  # no staging folder left over


def test_a_synth_run_that_builds_nothing_exits_non_zero(tmp_path, capsys, monkeypatch):
    """Every LLM answer malformed: no conversation is built, and the exit status says so (it was 0)."""
    from longpeft.synth_data.corpus import generate_document

    from stub_server import StubServer

    monkeypatch.setenv("LONGPEFT_TEST_KEY", "sk-test")
    source = tmp_path / "docs"
    source.mkdir()
    (source / "book.txt").write_text(generate_document(seed=1, n_sentences=60).text.replace(". ", ". [[bad]] "))
    with StubServer() as server:
        code = main(
            [
                "synth",
                "--out",
                str(tmp_path / "out"),
                "--answerer",
                "llm",
                "--source",
                str(source),
                "--tasks",
                "single_detail",
                "--contexts",
                "1",
                "--min-tokens",
                "300",
                "--max-tokens",
                "2000",
                "--chunk-tokens",
                "128",
                "--llm-base-url",
                server.base_url,
                "--llm-model",
                "stub",
                "--api-key-env",
                "LONGPEFT_TEST_KEY",
                "--no-progress",
                "--set",
                "llm.backoff_initial=0.01",
            ]
        )
    assert code == 3 and "no conversation was built" in capsys.readouterr().err


def test_eval_refuses_an_out_that_is_a_file_before_loading(tmp_path, capsys):
    (tmp_path / "results").write_text("x")
    assert main(["eval", "passkey", "--model", str(tmp_path / "no-model"), "--out", str(tmp_path / "results")]) == 2
    assert "--out" in capsys.readouterr().err


def test_txt_sources_are_plain_text_documents(tmp_path, tokenizer):
    from longpeft.recipes.data import load_training_data

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("First document.")
    (docs / "b.txt").write_text("Second document.")
    data = load_recipe("tiny-cpu", [f"data.source={docs}", "data.format=text"]).data
    assert load_training_data(data, tokenizer)["text"] == ["First document.", "Second document."]
    (docs / ".ipynb_checkpoints").mkdir()  # a subfolder's files are not the source's (they were read twice)
    (docs / ".ipynb_checkpoints" / "a.txt").write_text("First document.")
    assert load_training_data(data, tokenizer)["text"] == ["First document.", "Second document."]
    (docs / "b.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match=r"b.txt: not UTF-8 text"):
        load_training_data(data, tokenizer)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl: not UTF-8 text"):
        load_training_data(load_recipe("tiny-cpu", [f"data.source={bad}", "data.format=text"]).data, tokenizer)
    with pytest.raises(ValueError, match="set data.format: text"):
        load_training_data(load_recipe("tiny-cpu", [f"data.source={docs / 'a.txt'}"]).data, tokenizer)


def test_more_bad_inputs_are_one_clear_message(tmp_path, capsys):
    """A key given twice in a recipe silently replaced the first section; a run folder given for an adapter was
    'not written by longpeft'; convert-beacon named a missing folder a bad repo id; plan took --gpus 0 as no plan."""
    from longpeft.recipes import schema

    recipe = tmp_path / "dup.yaml"
    recipe.write_text(
        Path(schema.__file__).with_name("tiny-cpu.yaml").read_text() + "train:\n  learning_rate: 1.0e-3\n"
    )
    run = tmp_path / "run"
    (run / "adapter").mkdir(parents=True)
    (run / "adapter" / "longpeft.json").write_text("{}")
    for argv, message in (
        (["plan", str(recipe)], "key 'train' appears twice"),
        (["merge", str(run), "--out", str(tmp_path / "m")], f"give the folder it wrote, {run / 'adapter'}"),
        (
            ["convert-beacon", str(tmp_path / "nowhere"), "--base", str(tmp_path), "--out", str(tmp_path / "c")],
            "nowhere: no such folder",
        ),
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)
    with pytest.raises(SystemExit):
        main(["plan", "tiny-cpu", "--gpus", "0"])
    assert "--gpus: 0 is out of range" in capsys.readouterr().err


def test_a_checkpoint_of_other_shapes_is_named_not_a_traceback(finished_run, tmp_path, monkeypatch):
    """Weights whose shapes a recipe change altered (here a LoRA rank, let through) end in a DataError naming the
    checkpoint, not torch's size-mismatch traceback."""
    from longpeft.recipes import checkpoints

    root, data, result = finished_run
    copy = tmp_path / "run"
    shutil.copytree(result.output_dir, copy)
    monkeypatch.setattr(checkpoints, "FIXED_FOR_THE_RUN", {})
    with pytest.raises(
        DataError,
        match=r"checkpoint-2: its weights have other shapes than this recipe's model "
        r"\(size mismatch for .*lora",
    ):
        run(
            _recipe(_base_of(result), data, copy, "lora.r=4", "train.max_steps=4"),
            resume=True,
            allow_recipe_change=True,
        )
