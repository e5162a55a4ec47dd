"""Every Hub access of train, synth --tokenizer and plan --build goes through the bounded pre-check, and the
downloads after it are bounded too: a Hub on 127.0.0.1 (tests/fake_hub.py) that never answers, or that answers the
repo's info and then stalls its files (their metadata, or the bytes of a download), ends the command within
``LONGPEFT_HUB_TIMEOUT`` (2 s here) in one line naming the endpoint, the repo and the file. A local path that does
not exist is named as missing and never asked of the Hub. No network: the Hub is a local server."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_hub import FakeHub, pointed_at, silent_hub

import longpeft.recipes.runner  # noqa: F401 - imported before the timed commands
import longpeft.synth_data.pipeline  # noqa: F401
from longpeft import files
from longpeft.cli import main
from longpeft.errors import ConfigError, HubTimeoutError

WAIT = 2  # LONGPEFT_HUB_TIMEOUT in these tests, seconds (the fake Hub's own answers must come within it)
# A command bounded by WAIT ends in a few seconds here. Still waiting after ENDED (room for a loaded machine), it was
# not bounded: unbounded, huggingface_hub's retries of one file's metadata alone take 10 s + 6 x 60 s + 23 s.
ENDED = 90


def _argv(command: str, source: str, out) -> list[str]:
    """``command`` with ``source`` as its model (train, plan --build) or tokenizer (synth)."""
    if command == "synth --tokenizer":
        return [
            "synth",
            "--out",
            str(out),
            "--tokenizer",
            source,
            "--contexts",
            "1",
            "--min-tokens",
            "512",
            "--max-tokens",
            "1024",
            "--no-progress",
        ]
    build = ["--build"] if command == "plan --build" else []
    return [
        command.split()[0],
        "tiny-cpu",
        *build,
        "--set",
        f"model.name_or_path={source}",
        "--set",
        f"output_dir={out}",
    ]


COMMANDS = ["train", "synth --tokenizer", "plan --build"]


@pytest.fixture(autouse=True)
def _short_wait(monkeypatch):
    monkeypatch.setenv(files.HUB_TIMEOUT_VARIABLE, str(WAIT))


@contextlib.contextmanager
def _hub(kind: str) -> Iterator[str]:
    """A misbehaving Hub of ``kind`` (``silent``, or a :class:`FakeHub` mode) that this process asks."""
    if kind == "silent":
        with silent_hub() as endpoint, pointed_at(endpoint):
            yield endpoint
    else:
        with FakeHub(kind) as hub, pointed_at(hub.endpoint):
            yield hub.endpoint


def _main_within(argv: list[str], seconds: float) -> int:
    """``main(argv)``'s exit status; fails the test, instead of hanging it, when the command has not ended within
    ``seconds``."""
    import threading

    result: dict[str, int] = {}
    thread = threading.Thread(target=lambda: result.setdefault("code", main(argv)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{argv[0]} still waits on the Hub after {seconds} s"
    return result["code"]


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if ": error: " in line]


@pytest.mark.parametrize("kind", ["silent", "stall", "stall_body"])
@pytest.mark.parametrize("command", COMMANDS)
def test_a_silent_or_stalling_hub_ends_the_command_in_one_line(command, kind, tmp_path, capsys):
    with _hub(kind) as endpoint:
        code = _main_within(_argv(command, "owner/name", tmp_path / "out"), ENDED)
    err = capsys.readouterr().err
    lines = _error_lines(err)
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert endpoint in lines[0] and "owner/name" in lines[0] and "LONGPEFT_HUB_TIMEOUT" in lines[0]
    if kind == "silent":  # the pre-check: the repo's info never comes
        assert f"did not answer within {WAIT} s" in lines[0]
    else:  # the pre-check passed; the first file the loader asks for stalls
        assert f"sent nothing for {WAIT} s while downloading config.json of owner/name" in lines[0]


def test_a_hub_dataset_that_never_answers_ends_train_in_one_line(tmp_path, capsys):
    with _hub("silent") as endpoint:
        argv = ["train", "tiny-cpu", "--set", "data.source=owner/data", "--set", f"output_dir={tmp_path}"]
        code = _main_within(argv, ENDED)
    lines = _error_lines(capsys.readouterr().err)
    assert code == 2 and len(lines) == 1 and "data.source owner/data" in lines[0] and endpoint in lines[0]


@pytest.mark.parametrize("command", COMMANDS)
def test_a_missing_local_path_is_named_as_missing_never_asked_of_the_hub(command, tmp_path, capsys, monkeypatch):
    (tmp_path / "models").mkdir()
    monkeypatch.chdir(tmp_path)
    with FakeHub("stall") as hub, pointed_at(hub.endpoint):
        # absolute; relative and shaped like owner/name, but its first folder is here
        for missing in (str(tmp_path / "no-model"), "models/no-model"):
            code = main(_argv(command, missing, tmp_path / "out"))
            lines = _error_lines(capsys.readouterr().err)
            assert code == 2 and len(lines) == 1 and f"{missing}: no such folder" in lines[0]
        assert hub.requests == []
    assert not (tmp_path / "out").exists() or command != "synth --tokenizer"  # synth wrote nothing


def test_a_missing_local_data_source_is_named_as_missing(tmp_path, capsys, monkeypatch):
    (tmp_path / "data").mkdir()
    monkeypatch.chdir(tmp_path)
    with FakeHub("stall") as hub, pointed_at(hub.endpoint):
        code = main(["train", "tiny-cpu", "--set", "data.source=data/chats", "--set", f"output_dir={tmp_path / 'o'}"])
        assert hub.requests == []
    lines = _error_lines(capsys.readouterr().err)
    assert code == 2 and "data.source data/chats does not exist" in lines[0]


def test_the_hub_is_asked_again_after_a_new_check(monkeypatch):
    """A silence refuses every later download at once, until the next pre-check finds the Hub answering."""
    with FakeHub("stall") as hub, pointed_at(hub.endpoint):
        files.hub_preflight("owner/name", "model")
        from huggingface_hub import hf_hub_download

        with pytest.raises(HubTimeoutError, match="config.json of owner/name"):
            hf_hub_download("owner/name", "config.json")
        asked = len(hub.requests)
        start = time.monotonic()
        with pytest.raises(HubTimeoutError):
            hf_hub_download("owner/name", "tokenizer.json")
        assert time.monotonic() - start < WAIT and len(hub.requests) == asked  # refused without asking
        files.hub_preflight("owner/name", "model")  # answered: the Hub is asked again
        assert hub.requests[asked:] == ["GET /api/models/owner/name"]


def test_a_download_that_keeps_sending_is_not_cut():
    """The bound is on silence, not on the length of a download: a body that trickles in over more than the wait,
    a byte at a time, arrives whole."""
    from huggingface_hub import hf_hub_download

    with FakeHub("trickle") as hub, pointed_at(hub.endpoint):
        files.hub_preflight("owner/name", "model")
        start = time.monotonic()
        path = Path(hf_hub_download("owner/name", "config.json"))
        assert path.read_bytes() == FakeHub.TRICKLED
    assert time.monotonic() - start > WAIT  # it did take longer than the wait


@pytest.mark.parametrize("value", ["0", "-2", "nan", "inf", "soon"])
def test_the_wait_must_be_a_positive_number(value, monkeypatch):
    monkeypatch.setenv(files.HUB_TIMEOUT_VARIABLE, value)
    with pytest.raises(ConfigError, match=f"LONGPEFT_HUB_TIMEOUT={value!r}"):
        files.hub_timeout()


def test_the_silent_hub_message_names_repo_file_and_endpoint():
    message = files._silent_hub_message("http://hub.test/datasets/owner/data/resolve/main/data%2Ftrain.jsonl", 30)
    assert message.startswith(
        "the Hub at http://hub.test sent nothing for 30 s while downloading data/train.jsonl of dataset owner/data;"
    )
    assert "listing the files of owner/name" in files._silent_hub_message(
        "http://hub.test/api/models/owner/name/tree/main", 30
    )
