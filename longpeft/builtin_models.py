"""Models shipped inside the package, by the name recipes and commands accept for them (light: no
torch import, so the planner and the CLI can resolve them)."""

from __future__ import annotations

from pathlib import Path

TOY_BASE = "longpeft:toy-base"
BUILTIN_MODELS = {TOY_BASE: Path(__file__).parent / "toy_base"}


def model_location(name: str | Path) -> str:
    """Where to load ``name`` from: the packaged folder for a built-in model (``longpeft:toy-base``, the
    short-window base of the demo, see ``longpeft/toy_base/README.md``), else ``name`` as given."""
    return str(BUILTIN_MODELS.get(str(name), name))
