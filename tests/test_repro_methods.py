"""scripts/repro_methods.py: every variant of the methods table gives a recipe that validates, at 4W and 8W, and
trains on the same number of tokens as the others (the table's equal budget)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "repro_methods.py"
spec = importlib.util.spec_from_file_location("repro_methods", SCRIPT)
repro = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = repro  # its dataclasses look their module up while they are built
spec.loader.exec_module(repro)


def _planned_tokens(recipe) -> float:
    """Tokens trained on: the documents' count times their mean length, or with PoSE's content skip (documents
    longer than the window) times the mean tokens a document gives the window."""
    retrieval, window = recipe.data.retrieval, recipe.data.max_length
    if recipe.method == "pose" and recipe.pose.content_skip != "none":
        return (
            retrieval.n_documents
            * sum(min(n, window) for n in range(retrieval.min_tokens, retrieval.max_tokens + 1))
            / (retrieval.max_tokens + 1 - retrieval.min_tokens)
        )
    assert retrieval.max_tokens < window
    return retrieval.n_documents * (retrieval.min_tokens + retrieval.max_tokens) / 2


@pytest.mark.parametrize("target", [4, 8])
def test_every_variant_validates_with_an_equal_budget(target, tmp_path):
    recipes = {
        v.name: repro.variant_recipe(v, target, 0, 160_000, tmp_path / v.name) for v in repro.VARIANTS if v.trained
    }
    budget = 160_000 * target
    for name, recipe in recipes.items():
        assert _planned_tokens(recipe) == pytest.approx(budget, rel=0.01), name
    for skip in ("uniform", "aligned"):
        recipe = recipes[f"pose+{skip}"]
        assert recipe.pose.content_skip == skip and recipe.data.max_length == repro.W
        assert recipe.data.retrieval.max_tokens == target * repro.W - 1  # documents up to the target
    step, full = recipes["beacon-step"].beacon, recipes["beacon"].beacon
    assert (step.attn, step.attend_prev, full.attn) == ("step-expansion", False, "full-coverage")
    assert step.model_dump(exclude={"attn", "attend_prev"}) == full.model_dump(exclude={"attn", "attend_prev"})
