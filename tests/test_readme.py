"""Every command in README.md runs as written: cheap ones are run for real, expensive ones (training,
GPU, downloads) are parsed by the real argument parser, so a missing or renamed flag fails here."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from longpeft.cli import build_parser

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_commands() -> list[str]:
    """Shell commands of the README's ```bash blocks (comments dropped, continuation lines joined)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            command = line.split("  #")[0].split(" # ")[0].strip()
            if command and not command.startswith("#"):
                commands.append(command)
    return commands


COMMANDS = readme_commands()
LONGPEFT = [c for c in COMMANDS if c.startswith(("longpeft ", "accelerate launch"))]
# Run for real: validation, listing and offline data generation take seconds.
CHEAP = re.compile(r"^longpeft (--help|plan (?!.*--build)|synth --out)")


def longpeft_argv(command: str) -> list[str]:
    words = shlex.split(command)
    if words[0] == "accelerate":
        return words[words.index("longpeft.cli") + 1 :]
    return words[1:]


def test_readme_has_the_commands_it_should():
    assert COMMANDS[:2] == ["make demo", "make test"]
    assert any(CHEAP.match(c) for c in LONGPEFT) and len(LONGPEFT) >= 8


@pytest.mark.parametrize("command", LONGPEFT)
def test_every_longpeft_command_parses(command):
    argv = longpeft_argv(command)
    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"README command does not parse ({exc.code}): {command}")


@pytest.mark.parametrize("command", [c for c in LONGPEFT if CHEAP.match(c)])
def test_cheap_commands_run(command, tmp_path):
    argv = [sys.executable, "-m", "longpeft.cli", *longpeft_argv(command)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, f"{command}\n{proc.stderr[-2000:]}"


SCRIPTS = [c for c in COMMANDS if c.startswith("python scripts/")]


@pytest.mark.parametrize("command", SCRIPTS)
def test_every_script_command_parses(command):
    """`python scripts/NAME.py ARGS` in the README: the script exists and its own parser accepts ARGS."""
    import importlib.util

    words = shlex.split(command)
    name = "readme_" + Path(words[1]).stem
    spec = importlib.util.spec_from_file_location(name, README.parent / words[1])
    module = sys.modules[name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
    spec.loader.exec_module(module)
    try:
        module.parse_args(words[2:])
    except SystemExit as exc:
        pytest.fail(f"README command does not parse ({exc.code}): {command}")


def test_readme_paths_exist():
    root = README.parent
    for path in re.findall(r"`(longpeft/[\w/.\-]+|recipes/[\w.\-]+\.yaml|scripts/[\w.\-]+\.py)`", README.read_text()):
        candidate = root / path if not path.startswith("recipes/") else root / "longpeft" / path
        assert candidate.exists(), f"README names {path}, which does not exist"
