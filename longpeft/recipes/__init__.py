"""Recipes: a YAML file validated by typed models, and the runner that trains it."""

from .runner import RunResult, prepare, run
from .schema import Recipe, RecipeError, bundled_recipes, load_recipe

__all__ = ["Recipe", "RecipeError", "RunResult", "bundled_recipes", "load_recipe", "prepare", "run"]
