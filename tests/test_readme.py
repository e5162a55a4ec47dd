"""Every command in README.md, docs/ and CONTRIBUTING.md runs as written: cheap ones are run for real, expensive
ones (training, GPU, downloads) are parsed by the real argument parser, so a missing or renamed flag fails here.
Every path and relative link they name leads somewhere."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from longpeft.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]


def bash_commands(page: Path) -> list[str]:
    """Shell commands of a page's ```bash blocks (comments dropped, continuation lines joined)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            command = line.split("  #")[0].split(" # ")[0].strip()
            if command and not command.startswith("#"):
                commands.append(command)
    return commands


def is_longpeft(command: str) -> bool:
    """`longpeft ...`, `ENV/bin/longpeft ...` or `accelerate launch ... longpeft.cli ...`."""
    first = command.split()[0]
    return first == "longpeft" or first.endswith("/bin/longpeft") or command.startswith("accelerate launch")


def longpeft_argv(command: str) -> list[str]:
    words = shlex.split(command)
    if words[0] == "accelerate":
        return words[words.index("longpeft.cli") + 1 :]
    return words[1:]


def page_name(page: Path) -> str:
    return str(page.relative_to(ROOT))


COMMANDS = [(page_name(page), command) for page in PAGES for command in bash_commands(page)]
README_COMMANDS = [command for page, command in COMMANDS if page == "README.md"]
LONGPEFT = [(page, command) for page, command in COMMANDS if is_longpeft(command)]
# Run for real: validation, listing and offline data generation take seconds.
CHEAP = re.compile(r"^longpeft (--help|plan (?!.*--build)|synth --out)")


def ids(cases: list[tuple[str, str]]) -> list[str]:
    return [f"{page}: {command[:80]}" for page, command in cases]


def test_readme_has_the_commands_it_should():
    """A newcomer's page: the demo and the tests first, the quick start's commands, at most 150 lines."""
    assert README_COMMANDS[:2] == ["make demo", "make test"]
    longpeft = [c for c in README_COMMANDS if is_longpeft(c)]
    assert any(CHEAP.match(c) for c in longpeft) and len(longpeft) >= 8
    assert len(README.read_text().splitlines()) <= 150


@pytest.mark.parametrize(("page", "command"), LONGPEFT, ids=ids(LONGPEFT))
def test_every_longpeft_command_parses(page, command):
    argv = longpeft_argv(command)
    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{page}: command does not parse ({exc.code}): {command}")


CHEAP_COMMANDS = [(page, command) for page, command in LONGPEFT if CHEAP.match(command)]


@pytest.mark.parametrize(("page", "command"), CHEAP_COMMANDS, ids=ids(CHEAP_COMMANDS))
def test_cheap_commands_run(page, command, tmp_path):
    argv = [sys.executable, "-m", "longpeft.cli", *longpeft_argv(command)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, f"{page}: {command}\n{proc.stderr[-2000:]}"


SCRIPTS = [(page, command) for page, command in COMMANDS if command.startswith("python scripts/")]


@pytest.mark.parametrize(("page", "command"), SCRIPTS, ids=ids(SCRIPTS))
def test_every_script_command_parses(page, command):
    """`python scripts/NAME.py ARGS` in a page: the script exists and its own parser accepts ARGS."""
    import importlib.util

    words = shlex.split(command)
    name = "readme_" + Path(words[1]).stem
    spec = importlib.util.spec_from_file_location(name, ROOT / words[1])
    module = sys.modules[name] = importlib.util.module_from_spec(spec)  # dataclasses look their module up
    spec.loader.exec_module(module)
    try:
        module.parse_args(words[2:])
    except SystemExit as exc:
        pytest.fail(f"{page}: command does not parse ({exc.code}): {command}")


@pytest.mark.parametrize("page", PAGES, ids=page_name)
def test_named_paths_exist(page):
    named = r"`(longpeft/[\w/.\-]+|recipes/[\w.\-]+\.yaml|scripts/[\w.\-]+\.py|tests/[\w.\-]+\.py)`"
    for path in re.findall(named, page.read_text()):
        candidate = ROOT / path if not path.startswith("recipes/") else ROOT / "longpeft" / path
        assert candidate.exists(), f"{page_name(page)} names {path}, which does not exist"


def anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def heading_anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a '#' comment in a code block is no heading
    return {anchor(heading) for heading in re.findall(r"^#{1,6} +(.+)$", text, flags=re.M)}


def test_anchors_are_githubs():
    assert anchor("The older stack (transformers 5.17, trl 1.15, datasets 4)") == (
        "the-older-stack-transformers-517-trl-115-datasets-4"
    )
    assert anchor("Why `longpeft.json`") == "why-longpeftjson"
    assert anchor("Parity with the authors' code (2026-11-24)") == "parity-with-the-authors-code-2026-11-24"
    assert anchor("RoPE-base expansion and QLoRA") == "rope-base-expansion-and-qlora"


@pytest.mark.parametrize("page", PAGES, ids=page_name)
def test_relative_links_lead_somewhere(page):
    """Every relative link of a page names a file that exists, and a heading of it when it has an anchor."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page_name(page)} links {target}: no such file"
        if anchor:
            assert anchor in heading_anchors(linked), f"{page_name(page)} links {target}: no such heading"
