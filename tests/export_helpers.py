"""Shared by the export tests: what an exported modeling file imports, and running a script in a fresh
Python process (``-I``) where importing longpeft fails, to prove an export does not need it (the script
can call ``load_exported(model_dir, attn_implementation)``)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

BLOCK_LONGPEFT = r"""
import sys

class BlockLongpeft:
    def find_spec(self, name, path=None, target=None):
        if name == "longpeft" or name.startswith("longpeft."):
            raise ModuleNotFoundError(f"{name} is blocked: the export must not need longpeft")
        return None

sys.meta_path.insert(0, BlockLongpeft())
try:
    import longpeft
except ModuleNotFoundError:
    pass
else:
    raise SystemExit("longpeft was importable; the test would prove nothing")


def load_exported(model_dir, attn_implementation):
    # the exported model; loading it without trust_remote_code must fail (not drop the method silently)
    from transformers import AutoModelForCausalLM

    try:
        AutoModelForCausalLM.from_pretrained(model_dir)
    except ValueError as error:
        assert "trust_remote_code" in str(error), error
    else:
        raise SystemExit("loaded without trust_remote_code: the method would be silently dropped")
    return AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True,
                                                attn_implementation=attn_implementation).eval()
"""


def imported_modules(path: Path) -> set[str]:
    """Top-level package names a Python file imports (relative imports count as ``"."``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add("." if node.level else node.module.split(".")[0])
    return names


def run_without_longpeft(script: str, args: list[str], workdir: Path) -> subprocess.CompletedProcess:
    """Run ``script`` (after :data:`BLOCK_LONGPEFT`) with ``args`` in a fresh isolated interpreter, offline."""
    env = {
        **os.environ,
        "HF_MODULES_CACHE": str(workdir / "hf_modules"),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
    }
    return subprocess.run(
        [sys.executable, "-I", "-c", BLOCK_LONGPEFT + script, *args],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
