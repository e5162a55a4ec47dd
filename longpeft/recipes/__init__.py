"""Recipes: a YAML file validated by typed models (:mod:`.schema`), and the runner that trains it
(:mod:`.runner`, imported on first use: it loads torch, transformers and TRL)."""

from __future__ import annotations

import importlib
from typing import Any

from .schema import Recipe, RecipeError, bundled_recipes, load_recipe


def __getattr__(name: str) -> Any:
    if name in ("RunResult", "prepare", "run"):
        return getattr(importlib.import_module(".runner", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Recipe", "RecipeError", "RunResult", "bundled_recipes", "load_recipe", "prepare", "run"]
