"""The hand-offs of one traced ``longpeft`` command: each call from the CLI or the runner into another file of
longpeft, and each return to a file the run had already left.

A hand-off is a call whose caller is a function of an orchestrating file (the CLI, ``longpeft/cli.py`` or the
modules of ``longpeft/cli/``, and ``longpeft/recipes/runner.py``; ``--orchestrator`` names others) and whose callee
is a function of another file of longpeft. Frames of the standard library between the two (``contextlib``'s
decorators, ``functools``) are looked through; a caller's module-level code (its imports) is not counted, nor is
a generator resumed (a context manager's exit: its entry counted), nor any call that longpeft's callbacks receive
from transformers' training loop (their caller is transformers). A return is a hand-off into a file that an
earlier hand-off went to, when the one just before went elsewhere: the run left that file's concern and came back
to it.

    python scripts/trace_handoffs.py -- train toy-extend-cpu --set output_dir=/tmp/trace-run

prints the sequence (caller file -> callee file: function), then the counts per target file, and, last, one JSON
line: ``handoffs``, ``files``, ``returns``. The command runs for real (a training command trains and writes its
output folder); the count does not depend on the number of steps, which ``--set train.max_steps=N`` bounds.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import sys
import sysconfig
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "longpeft"
ORCHESTRATORS = ("longpeft/cli.py", "longpeft/cli/", "longpeft/recipes/runner.py")
PATHS = sysconfig.get_paths()
STDLIB = str(Path(PATHS["stdlib"]).resolve())
INSTALLED = tuple({str(Path(PATHS[key]).resolve()) for key in ("purelib", "platlib")})  # may lie under STDLIB
GENERATOR_FLAGS = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


@dataclass
class HandoffTrace:
    """The hand-offs seen so far: ``sequence`` holds ``(caller file, callee file, callee function)``, files relative
    to the repository root. ``orchestrators``: repository-relative files, or folders ending in ``/``."""

    orchestrators: tuple[str, ...]
    sequence: list[tuple[str, str, str]] = field(default_factory=list)
    _names: dict[str, str | None] = field(default_factory=dict)
    _generators: list[Any] = field(default_factory=list)  # frames of the generators entered (context managers)

    def relative(self, filename: str) -> str | None:
        """``filename`` relative to the repository root when it is a file of longpeft, else None (cached)."""
        if filename not in self._names:
            path = Path(filename).resolve()
            self._names[filename] = str(path.relative_to(ROOT)) if path.is_relative_to(PACKAGE) else None
        return self._names[filename]

    def orchestrates(self, name: str) -> bool:
        return any(name == o or (o.endswith("/") and name.startswith(o)) for o in self.orchestrators)

    def profile(self, frame, event: str, arg) -> None:
        """``sys.setprofile``'s hook: record a Python call from an orchestrating function into another file."""
        if event != "call":
            return
        callee = self.relative(frame.f_code.co_filename)
        if callee is None:
            return
        caller = frame.f_back
        while caller is not None and is_stdlib(caller.f_code.co_filename):
            caller = caller.f_back
        if caller is None or caller.f_code.co_name == "<module>":
            return
        source = self.relative(caller.f_code.co_filename)
        if source is None or source == callee or not self.orchestrates(source):
            return
        if frame.f_code.co_flags & GENERATOR_FLAGS:
            if any(frame is entered for entered in self._generators):
                return  # a generator resumed (a ``with`` block's exit): the same hand-off
            self._generators.append(frame)
        self.sequence.append((source, callee, getattr(frame.f_code, "co_qualname", frame.f_code.co_name)))

    def returns(self) -> list[int]:
        """Indices in ``sequence`` of the hand-offs into a file already left."""
        seen: set[str] = set()
        found = []
        for index, (_, callee, _) in enumerate(self.sequence):
            if callee in seen and self.sequence[index - 1][1] != callee:
                found.append(index)
            seen.add(callee)
        return found


@functools.cache
def is_stdlib(filename: str) -> bool:
    """Whether ``filename`` is a module of the standard library (not an installed package)."""
    path = str(Path(filename).resolve())
    return path.startswith(STDLIB) and not path.startswith(INSTALLED)


def trace(run: Callable[[], Any], orchestrators: tuple[str, ...]) -> tuple[HandoffTrace, Any]:
    """Call ``run()`` in this process under the trace; returns the trace and what ``run`` returned."""
    handoffs = HandoffTrace(orchestrators)
    sys.setprofile(handoffs.profile)
    try:
        result = run()
    finally:
        sys.setprofile(None)
    return handoffs, result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--orchestrator",
        action="append",
        help=f"a repository-relative file (or folder, ending in /) whose calls count (default: {ORCHESTRATORS})",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the longpeft command, after --")
    args = parser.parse_args(argv)
    args.command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not args.command:
        parser.error("give the longpeft command after --, e.g. -- train toy-extend-cpu")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from longpeft.cli import main as longpeft_main

    handoffs, status = trace(lambda: longpeft_main(args.command), tuple(args.orchestrator or ORCHESTRATORS))
    returns = set(handoffs.returns())
    for index, (caller, callee, function) in enumerate(handoffs.sequence):
        mark = "  (return)" if index in returns else ""
        print(f"{index + 1:3d} {caller} -> {callee}: {function}{mark}")
    counts = Counter(callee for _, callee, _ in handoffs.sequence)
    back = Counter(handoffs.sequence[index][1] for index in returns)
    print(f"\n{'file':48s} {'hand-offs':>9s} {'returns':>7s}")
    for name, count in counts.most_common():
        print(f"{name:48s} {count:9d} {back[name]:7d}")
    summary = {"command": args.command, "handoffs": len(handoffs.sequence), "files": len(counts)}
    print(json.dumps({**summary, "returns": len(returns), "exit_status": status}))
    return status


if __name__ == "__main__":
    sys.exit(main())
