"""Broken files, full disks and the errors of the libraries underneath: each ends in one line naming the file or
folder and what to do (exit status 2), never in a library's traceback, and a full disk leaves nothing that a rerun
would take for complete.

Three classes: reading (``longpeft.reading``: weights, torch files, JSON and YAML; a file missing in a local folder),
writing (``longpeft.files.writing_to``: ENOSPC / EACCES from safetensors, ``torch.save``, json, matplotlib,
simulated with each library's own error type and message), and the command line's boundary
(``longpeft.cli.error_message``).
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from longpeft.cli import error_message, main
from longpeft.errors import DataError, ModelSourceError, OutputWriteError
from longpeft.files import is_local, write_failure, write_text_atomically, writing_to
from longpeft.reading import (
    REFUSED_FOR_SAFETY,
    check_lora_adapter,
    read_json,
    read_safetensors,
    read_torch_file,
    safetensors_header,
)
from longpeft.recipes.runner import run
from longpeft.recipes.schema import load_recipe

ENOSPC = OSError(errno.ENOSPC, "No space left on device")
# what each library raises on a full disk (their real types and messages)
FULL_DISK = {
    "safetensors": SafetensorError(
        'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
    ),
    "torch.save": RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0"),
    "torch.save stream": RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed"),
    "json / open": OSError(errno.ENOSPC, "No space left on device"),
    "matplotlib": OSError(errno.ENOSPC, "No space left on device", "loss.png"),
}


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


@pytest.fixture(scope="module")
def trained(tiny_base_dirs, tmp_path_factory):
    """(data, a finished run of 2 steps with a checkpoint at each)."""
    from conftest import write_chat_jsonl

    root = tmp_path_factory.mktemp("trained")
    data = write_chat_jsonl(root / "train.jsonl", n=4, filler_words=10)
    return data, run(_recipe(tiny_base_dirs("llama"), data, root / "run"))


@pytest.fixture
def adapter(trained, tmp_path):
    """A copy of the trained adapter to damage."""
    copy = tmp_path / "ad" / "adapter"
    shutil.copytree(trained[1].adapter_dir, copy)
    return copy


def _one_line(argv, capsys, code=2) -> str:
    assert main([str(a) for a in argv]) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()  # progress lines may come first
    assert lines[-1] == "(run with --debug for the traceback)" and ": error: " in lines[-2], err
    return lines[-2]


# ---- reading --------------------------------------------------------------------------------------


def test_the_header_reader_agrees_with_safetensors(tmp_path):
    """Reference: safetensors' own reader, on a file of several dtypes and shapes."""
    from safetensors import safe_open

    tensors = {
        "a": torch.zeros(3, 5),
        "b": torch.ones(2, dtype=torch.bfloat16),
        "c": torch.arange(7),
        "d": torch.zeros(0, 4, dtype=torch.float16),
        "e": torch.tensor(True),
    }
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path))
    header = safetensors_header(path)
    with safe_open(str(path), framework="pt") as f:
        assert set(header) == set(f.keys())
        assert {k: header[k]["shape"] for k in header} == {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
        assert {k: header[k]["dtype"] for k in header} == {k: f.get_slice(k).get_dtype() for k in f.keys()}


def test_every_truncation_of_a_weights_file_is_named(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.randn(4, 4), "b": torch.randn(3)}, str(path))
    whole = path.read_bytes()
    for cut in range(len(whole)):
        path.write_bytes(whole[:cut])
        with pytest.raises(DataError, match=f"{path}: .*re-create w.safetensors"):
            read_safetensors(path)
    path.write_bytes(whole)
    assert set(read_safetensors(path)) == {"a", "b"}


@pytest.mark.parametrize(
    "content",
    [
        b"garbage" * 10,
        struct.pack("<Q", 10**12) + b"{}",
        struct.pack("<Q", 2) + b"[]",
        struct.pack("<Q", 7) + b'{"a": 1}',
    ],
)
def test_a_foreign_weights_file_is_named(content, tmp_path):
    path = tmp_path / "w.safetensors"
    path.write_bytes(content)
    with pytest.raises(DataError, match="not a safetensors file|tensor 'a'"):
        safetensors_header(path)


def test_a_pickle_payload_is_refused_for_safety(tmp_path):
    path = tmp_path / "optimizer.pt"
    torch.save({"state": torch.zeros(2), "hook": print}, path)  # a function: not a plain tensor file
    with pytest.raises(DataError, match=f"{path}: {REFUSED_FOR_SAFETY}"):
        read_torch_file(path)
    torch.save({"state": torch.zeros(2)}, path)
    assert torch.equal(read_torch_file(path)["state"], torch.zeros(2))


@pytest.mark.parametrize("text, where", [('{\n  "r": 2,\n  oops\n}', ":3:3:"), ("", ":1:1:"), ("[1,", ":1:4:")])
def test_a_json_syntax_error_names_file_line_and_column(text, where, tmp_path):
    path = tmp_path / "adapter_config.json"
    path.write_text(text)
    with pytest.raises(DataError, match=f"{path}{where} not valid JSON"):
        read_json(path)


def test_a_yaml_syntax_error_names_file_and_line(tmp_path, capsys):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("name: x\ntrain:\n  max_steps: [1\n")
    assert f"{recipe}:4: not valid YAML" in _one_line(["plan", recipe], capsys)


def test_lying_lora_shapes_are_named_before_loading(adapter):
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "r": 4}))
    with pytest.raises(DataError, match=r"lora_A.* has shape \[2, .*adapter_config.json \(r=4\) gives \[4, "):
        check_lora_adapter(adapter)


@pytest.mark.parametrize("command", ["merge", "export"])
@pytest.mark.parametrize(
    "damage, expected",
    [
        ("garbage", "adapter_model.safetensors: not a safetensors file"),
        ("truncated", "adapter_model.safetensors: "),
        ("lying rank", "adapter_config.json (r=4)"),
        ("pickle", f"adapter_model.bin: {REFUSED_FOR_SAFETY}"),
        ("config garbage", "adapter_config.json:1:2: not valid JSON"),
    ],
)
def test_merge_of_a_broken_adapter_is_one_line_naming_the_file(command, damage, expected, adapter, tmp_path, capsys):
    weights = adapter / "adapter_model.safetensors"
    if damage == "garbage":
        weights.write_bytes(b"garbage" * 10)
    elif damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:-7])
    elif damage == "lying rank":
        config = json.loads((adapter / "adapter_config.json").read_text())
        (adapter / "adapter_config.json").write_text(json.dumps({**config, "r": 4}))
    elif damage == "pickle":
        torch.save({k: v for k, v in load_file(weights).items()} | {"x": print}, adapter / "adapter_model.bin")
        weights.unlink()
    else:
        (adapter / "adapter_config.json").write_text("{oops")
    line = _one_line([command, adapter, "--out", tmp_path / "merged"], capsys)
    assert expected in line and str(adapter) in line
    assert not (tmp_path / "merged").exists()


def test_a_missing_weights_file_in_a_local_folder_is_named_not_looked_up_on_the_hub(adapter, monkeypatch, capsys):
    """``ad/adapter`` (a relative path of the form owner/name) lacking its weights: named as missing."""
    monkeypatch.chdir(adapter.parent.parent)
    (adapter / "adapter_model.safetensors").unlink()
    line = _one_line(["merge", "ad/adapter", "--out", "merged"], capsys)
    assert "adapter_model.safetensors is missing in adapter ad/adapter" in line


def test_a_local_path_that_is_partly_there_is_named_as_missing(adapter, monkeypatch, capsys):
    monkeypatch.chdir(adapter.parent.parent)
    assert is_local("ad/does_not_exist") and not is_local("owner/model")
    line = _one_line(["merge", "ad/does_not_exist", "--out", "merged"], capsys)
    assert "ad/does_not_exist: no such folder" in line


def test_eval_adapter_with_broken_weights_is_one_line(adapter, trained, tmp_path, capsys):
    (adapter / "adapter_model.safetensors").write_bytes(b"\x00" * 5)
    line = _one_line(
        [
            "eval",
            "passkey",
            "--model",
            _base_of(trained[1]),
            "--adapter",
            adapter,
            "--lengths",
            "128",
            "--out",
            tmp_path / "e",
        ],
        capsys,
    )
    assert f"{adapter / 'adapter_model.safetensors'}: not a safetensors file" in line


def test_init_from_an_adapter_without_weights_names_the_file(adapter):
    """model.init_from reads the earlier adapter through the same checks (before any model is touched)."""
    from longpeft.recipes.init_from import _load_lora

    (adapter / "adapter_model.safetensors").unlink()
    with pytest.raises(ModelSourceError, match=f"adapter_model.safetensors is missing in model.init_from {adapter}"):
        _load_lora(None, adapter)


def _base_of(result) -> str:
    return json.loads((result.output_dir / "recipe.resolved.json").read_text())["base_model"]


def test_resume_from_a_checkpoint_with_a_pickle_payload_names_it(trained, tmp_path, capsys):
    data, result = trained
    copy = tmp_path / "run"
    shutil.copytree(result.output_dir, copy)
    shutil.rmtree(copy / "adapter")
    last = copy / "checkpoints" / "checkpoint-2"
    torch.save({"state": {}, "param_groups": [], "hook": print}, last / "optimizer.pt")
    with pytest.raises(DataError, match=f"{last}: a file there is {REFUSED_FOR_SAFETY}"):
        run(_recipe(_base_of(result), data, copy), resume=True)


# ---- writing: a full disk or an unwritable folder ---------------------------------------------------


@pytest.mark.parametrize("library", sorted(FULL_DISK))
def test_each_librarys_full_disk_error_is_one_output_write_error(library, tmp_path):
    with pytest.raises(OutputWriteError, match=f"could not write to {tmp_path}: .*free space there") as caught:
        with writing_to(tmp_path, needed_bytes=3 * 2**20):
            raise FULL_DISK[library]
    assert "it needs about 3.0 MiB" in str(caught.value) and "free" in str(caught.value)


@pytest.mark.parametrize(
    "error",
    [
        PermissionError(errno.EACCES, "Permission denied"),
        OSError(errno.EROFS, "Read-only file system"),
        SafetensorError(
            'Error while serializing: IoError(Os { code: 13, kind: PermissionDenied, message: "Permission denied" })'
        ),
    ],
)
def test_an_unwritable_folder_is_one_output_write_error(error, tmp_path):
    with pytest.raises(OutputWriteError, match="make it writable"):
        with writing_to(tmp_path):
            raise error


@pytest.mark.parametrize(
    "error",
    [
        ValueError("no"),
        OSError(errno.ENOENT, "No such file"),
        RuntimeError("boom"),
        KeyError("x"),
        PermissionError(errno.EACCES, "Permission denied", "/etc/input"),
    ],
)
def test_other_errors_pass_unchanged(error, tmp_path):
    """Not a failed write (an input that cannot be read is named by its own error)."""
    assert write_failure(error) is None or error.filename == "/etc/input"
    with pytest.raises(type(error)):
        with writing_to(tmp_path):
            raise error


def test_a_text_file_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    path = tmp_path / "metrics.json"
    path.write_text("old\n")

    def full(self, *args, **kwargs):
        Path.write_bytes(self, b"ne")  # part of it, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(OutputWriteError, match=str(tmp_path)):
        write_text_atomically(path, "new\n")
    monkeypatch.undo()
    assert path.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]
    write_text_atomically(path, "new\n")
    assert path.read_text() == "new\n"


def test_concurrent_writers_of_one_file_each_rename_a_whole_one(tmp_path):
    """The LLM cache's threads may write one answer twice: each writer has its own temporary name."""
    import threading

    path = tmp_path / "answer.json"
    texts = [f"{n}" * 20_000 for n in range(8)]
    barrier = threading.Barrier(len(texts))

    failures = []

    def write(text):
        barrier.wait()
        try:
            for _ in range(20):
                write_text_atomically(path, text)
        except Exception as error:  # a thread's error would not fail the test by itself
            failures.append(error)

    threads = [threading.Thread(target=write, args=(text,)) for text in texts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures
    assert path.read_text() in texts and sorted(p.name for p in tmp_path.iterdir()) == ["answer.json"]


@pytest.mark.parametrize("command", ["merge", "export"])
def test_merge_on_a_full_disk_leaves_nothing_and_a_rerun_succeeds(command, trained, tmp_path, monkeypatch, capsys):
    """safetensors' own error, raised by the weights write inside save_pretrained."""
    import safetensors.torch
    import transformers.modeling_utils

    real = safetensors.torch.save_file

    def full(tensors, filename, *args, **kwargs):
        Path(filename).write_bytes(b"\x00" * 16)  # a torn file, as a full disk leaves it
        raise FULL_DISK["safetensors"]

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full)
    out = tmp_path / "merged"
    line = _one_line([command, trained[1].adapter_dir, "--out", out], capsys)
    assert f"could not write to {out}: no space left on device (it needs about" in line
    assert not out.exists() and list(tmp_path.iterdir()) == []
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", real)
    assert main([command, str(trained[1].adapter_dir), "--out", str(out)]) == 0
    assert (out / "config.json").is_file() and (command == "merge" or (out / "README.md").is_file())


def test_train_on_a_full_disk_names_the_folder_and_resume_then_finishes(trained, tmp_path, monkeypatch):
    """torch.save's RuntimeError in the checkpoint write, then safetensors' in the adapter save: each one error,
    no adapter folder that looks complete; a rerun with --resume after space is freed finishes the run."""
    import safetensors.torch

    import longpeft.recipes.runner as runner

    data, result = trained
    base = _base_of(result)
    out = tmp_path / "run"
    real_save = torch.save
    calls = {"n": 0}

    def full_on_the_second_checkpoint(obj, f, *args, **kwargs):
        if "checkpoint-2" in str(f):
            raise FULL_DISK["torch.save"]
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_on_the_second_checkpoint)
    with pytest.raises(OutputWriteError, match=f"could not write to {out / 'checkpoints'}: the file could not"):
        run(_recipe(base, data, out))
    monkeypatch.setattr(torch, "save", real_save)
    assert not (out / "adapter").exists()

    def full(tensors, filename, *args, **kwargs):  # the checkpoints fit, the adapter does not
        if ".adapter.partial" not in str(filename):
            return safetensors.torch.save_file(tensors, filename, *args, **kwargs)
        calls["n"] += 1
        Path(filename).write_bytes(b"\x00" * 16)
        raise FULL_DISK["safetensors"]

    import peft.peft_model

    monkeypatch.setattr(peft.peft_model, "safe_save_file", full)
    with pytest.raises(OutputWriteError, match=f"could not write to {out / 'adapter'}: no space left"):
        run(_recipe(base, data, out), resume=True)
    assert calls["n"] >= 1 and not (out / "adapter").exists()
    assert not any(p.name.endswith(".partial") for p in out.iterdir())
    monkeypatch.setattr(peft.peft_model, "safe_save_file", safetensors.torch.save_file)
    finished = runner.run(_recipe(base, data, out), resume=True)
    assert finished.metrics["steps"] == 2 and (out / "adapter" / "adapter_model.safetensors").is_file()


def test_synth_on_a_full_disk_is_one_line_naming_the_folder(tmp_path, monkeypatch, capsys):
    import datasets

    def full(self, path, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(datasets.Dataset, "save_to_disk", full)
    out = tmp_path / "synth"
    line = _one_line(["synth", "--out", out, "--contexts", "1", "--min-tokens", "512", "--max-tokens", "1024"], capsys)
    assert f"could not write to {out}: no space left on device" in line


def test_eval_report_on_a_full_disk_is_one_output_write_error(tmp_path, monkeypatch):
    """matplotlib's savefig raising the OSError of a full disk."""
    import matplotlib.figure

    from longpeft.eval.tasks import write_outputs

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full)
    result = {
        "task": "passkey",
        "lengths": [128],
        "depths": [0.5],
        "cells": [{"length": 128, "depth": 0.5, "score": 1.0}],
    }
    with pytest.raises(OutputWriteError, match=f"could not write to {tmp_path / 'e'}: no space left"):
        write_outputs(result, tmp_path / "e")
    assert not (tmp_path / "e" / "passkey.json").exists()


# ---- the command line's boundary ---------------------------------------------------------------------


def _raised_in_a_library(error: BaseException, package: str) -> BaseException:
    """``error`` with a traceback whose innermost frame is in a file under ``package`` (as a library raises it)."""
    code = compile("def fail(error):\n    raise error\n", os.path.join("site-packages", package, "_parse.py"), "exec")
    namespace: dict = {}
    exec(code, namespace)  # noqa: S102 - a frame with that file name
    try:
        namespace["fail"](error)
    except BaseException as raised:  # noqa: BLE001
        return raised
    raise AssertionError("unreachable")


def _network_error() -> BaseException:
    """What the Hub client of this environment raises for an unknown host (httpx, or requests before it)."""
    try:
        import httpx

        return httpx.ConnectError("[Errno -2] Name or service not known")
    except ImportError:
        import requests

        return requests.ConnectionError("Failed to resolve 'hub.invalid' ([Errno -2] Name or service not known)")


def _library_errors():
    import pydantic
    import yaml
    from huggingface_hub.errors import HFValidationError

    class Settings(pydantic.BaseModel):
        rank: int

    try:
        Settings(rank="x")
    except pydantic.ValidationError as error:
        validation = error
    try:
        yaml.safe_load("a: [1\n")
    except yaml.YAMLError as error:
        bad_yaml = error
    try:
        json.loads('{"a": 1,\n}')
    except json.JSONDecodeError as error:
        bad_json = error
    return {
        "safetensors": (
            SafetensorError("Error while deserializing header: header too large\nmore"),
            "a safetensors file could not be read",
        ),
        "huggingface_hub": (HFValidationError("Repo id must be in the form 'repo_name'"), "nor a Hub repo id"),
        "httpx or requests": (_network_error(), "the network failed"),
        "torch.load": (
            pickle.UnpicklingError("Weights only load failed.\n\nUnsupported global: builtins.print"),
            REFUSED_FOR_SAFETY,
        ),
        "pydantic": (validation, "invalid settings (Settings): rank: Input should be a valid integer"),
        "yaml": (bad_yaml, "not valid YAML at <unicode string>:2"),
        "json": (bad_json, "not valid JSON at line 2 column 1"),
        "torch.save full disk": (FULL_DISK["torch.save"], "a write failed"),
        "wrong-shape hub answer": (
            _raised_in_a_library(TypeError("string indices must be integers"), "huggingface_hub"),
            "an answer of an unexpected shape",
        ),
        "missing key in a hub answer": (
            _raised_in_a_library(KeyError("siblings"), "huggingface_hub"),
            "KeyError 'siblings'",
        ),
    }


@pytest.mark.parametrize("library", sorted(_library_errors()))
def test_each_librarys_error_is_one_line_and_debug_shows_its_traceback(library, monkeypatch, capsys):
    import longpeft.cli.plan

    error, expected = _library_errors()[library]

    def command(args):
        raise error

    monkeypatch.setattr(longpeft.cli.plan, "cmd_plan", command)
    line = _one_line(["plan", "tiny-cpu"], capsys)
    assert line.startswith("longpeft plan: error: ") and expected in line
    with pytest.raises(type(error)):
        main(["--debug", "plan", "tiny-cpu"])


@pytest.mark.parametrize(
    "error",
    [
        KeyError("factor"),
        KeyError("usage"),
        TypeError("unexpected keyword"),
        AttributeError("'NoneType' object has no attribute 'x'"),
    ],
)
def test_a_bug_in_our_code_keeps_its_traceback_and_a_key_never_prints_alone(error, monkeypatch, capsys):
    """An error nobody anticipated prints its traceback, then one line saying it is a bug and how to report it, and
    exits 1 (bad input exits 2); --debug lets it propagate."""
    import longpeft.cli.plan

    def command(args):
        raise error

    monkeypatch.setattr(longpeft.cli.plan, "cmd_plan", command)
    assert error_message(error) is None
    assert main(["plan", "tiny-cpu"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and "error: factor" not in err
    assert err.splitlines()[-1] == (
        f"longpeft plan: unexpected error ({type(error).__name__}), a bug in longpeft or a library it calls rather "
        "than a problem with your input: run with --debug and report the traceback"
    )
    with pytest.raises(type(error)):
        main(["--debug", "plan", "tiny-cpu"])


def test_a_long_or_multi_line_library_message_is_one_line():
    message = error_message(SafetensorError("line one\nline two\n" + "x" * 1000))
    assert "\n" not in message and len(message) < 500


@pytest.mark.slow
def test_the_probe_finds_every_bad_input_clear():
    """scripts/probe_bad_inputs.py, run as a test (about 1-3 minutes): every case ends in one clear message (exit 2
    or 3), and no simulated full disk leaves an output behind."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "probe", Path(__file__).parents[1] / "scripts" / "probe_bad_inputs.py"
    )
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    counts, failures = probe.run_all()
    assert failures == [] and counts["clear"] == counts["cases"] >= 230, (counts, failures)
