"""Property tests (Hypothesis) of the one recipe validation: generated ``--set`` overrides over every key of the
recipe schema (every section, the method sections, nested ones), with values of every type (numbers at and past
their ranges, non-finite floats, nonsense strings, lists, mappings, nulls, text that is not YAML) and keys that do
not exist or nest under a value. The only outcomes allowed: ``plan`` and ``train`` both accept the recipe, or both
refuse it with exit status 2 and a message naming the key.

``train`` does not train here: it stops where its validation ends (``longpeft.recipes.runner.check_here``, the
first thing after :func:`~longpeft.recipes.validate.validate_recipe`, is replaced by a stop); every check before
that point is the one ``plan`` runs, which :func:`test_train_runs_the_validation_plan_runs_before_anything_else`
shows on the runner itself.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import tempfile
import types
import typing
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel

from longpeft.cli import main
from longpeft.recipes.schema import recipe_model

pytestmark = pytest.mark.property

# The bundled CPU recipes (one per method family), each with the overrides every example starts from: HARPE's
# uniform bases (its peak-valley search takes seconds; an example may set it back).
RECIPES = {
    "tiny-cpu": [],
    "tiny-beacon-cpu": [],
    "toy-extend-cpu": [],
    "tiny-harpe-cpu": ["--set", "harpe.selection=uniform"],
}


def _models_in(annotation: typing.Any) -> list[type[BaseModel]]:
    """The settings models an annotation holds (``X | None``, ``Annotated[...]``, ...)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for argument in typing.get_args(annotation) for model in _models_in(argument)]


def schema_keys(model: type[BaseModel], prefix: str = "") -> list[tuple[str, typing.Any]]:
    """``(dotted key, annotation)`` of every field of ``model`` and of the sections it holds."""
    keys = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        keys.append((key, field.annotation))
        for section in _models_in(field.annotation):
            keys += schema_keys(section, f"{key}.")
    return keys


KEYS = schema_keys(recipe_model())


NUMBERS = st.one_of(
    st.integers(min_value=-3, max_value=3),
    st.sampled_from([8, 64, 255, 256, 511, 512, 1024, 4096, 2**28, 2**28 + 1, 2**31, 10**12, -(2**40)]),
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.sampled_from([0.5, 1.0, 1.5, 1e-9, 1e30, 1e300]),
)
WORDS = st.sampled_from(
    ["", "none", "auto", "all", "q_proj", "mlp", "embed_tokens", "nope", "tiny:llama", "tiny:nothing", "owner/name"]
)
SCALARS = st.one_of(NUMBERS, st.booleans(), st.none(), WORDS, st.text(max_size=8))
ANY_VALUE = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(WORDS, inner, max_size=2)),
    max_leaves=4,
)
INTEGERS = st.one_of(
    st.integers(min_value=-2, max_value=12),
    st.sampled_from([16, 64, 255, 256, 257, 511, 512, 600, 1023, 1024, 1025, 2048, 4096, 65536, 2**28, 2**28 + 1]),
)
FLOATS = st.one_of(st.sampled_from([0.0, 0.5, 1.0, 2.0, 4.0, 1e4, 9999.0, 1e6, 1e30]), st.floats(width=32))


def typed_values(annotation: typing.Any) -> st.SearchStrategy:
    """Values of the annotation's own type (what the schema's type check lets through, to reach the checks behind
    it): its literal choices, numbers around the tiny bases' sizes and at the ranges' ends, lists of those."""
    origin, arguments = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return st.sampled_from(arguments)
    if origin in (typing.Union, types.UnionType):
        return st.one_of([typed_values(argument) for argument in arguments])
    if origin is typing.Annotated:
        return typed_values(arguments[0])
    if origin is list:
        return st.lists(typed_values(arguments[0]), max_size=3)
    if origin is dict:
        return st.dictionaries(typed_values(arguments[0]), typed_values(arguments[1]), max_size=2)
    simple = {bool: st.booleans(), int: INTEGERS, float: FLOATS, str: WORDS, type(None): st.none()}
    return simple.get(annotation, ANY_VALUE)  # a section: anything


@st.composite
def overrides(draw: st.DrawFn) -> tuple[str, str]:
    """One ``KEY=VALUE`` override: a schema key (or a key that does not exist, or one nested under a value) and a
    value of the key's own type, or of any type, or text that is not YAML."""
    key, annotation = draw(st.sampled_from(KEYS))
    shape = draw(st.sampled_from(["key"] * 6 + ["unknown", "nested"]))
    if shape == "unknown":
        key = f"{key.rpartition('.')[0] or 'train'}.{draw(st.sampled_from(['bogus', 'x', 'lr']))}"
    elif shape == "nested":
        key = f"{key}.inner"
    value = draw(st.one_of(typed_values(annotation), typed_values(annotation), ANY_VALUE))
    text = draw(st.sampled_from([json.dumps(value)] * 8 + ["[unclosed", "{a: 1"]))
    return key, text


class Validated(BaseException):
    """Raised where train's validation ends (a BaseException: the CLI's boundary does not catch it)."""


def outcome(argv: list[str]) -> tuple[int | str, str]:
    """``(exit status, or "validated" when train reached the end of its validation; stderr)``."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except Validated:
            status = "validated"
    return status, err.getvalue()


def names_the_key(key: str, message: str) -> bool:
    """Whether ``message`` names ``key``: the key itself, the part of it the schema stops at (``train.bogus`` for
    ``train.bogus.inner``), or a key of its section that the refusal is about (``pose.target_length must be longer
    than ...`` when ``pose.content_skip`` brought a ``pose`` section in; ``beacon and harpe cannot be combined``)."""
    parts = key.split(".")
    if any(".".join(parts[:end]) in message for end in range(len(parts), 1, -1)) or key in message:
        return True
    return re.search(rf"\b{re.escape(parts[0])}\b", message) is not None


@given(recipe=st.sampled_from(sorted(RECIPES)), changes=st.lists(overrides(), min_size=1, max_size=3))
def test_plan_and_train_accept_or_refuse_the_same_overrides(recipe, changes, monkeypatch_module):
    sets = [argument for key, text in changes for argument in ("--set", f"{key}={text}")]
    with tempfile.TemporaryDirectory() as folder:
        common = [recipe, "--set", f"output_dir={Path(folder) / 'run'}", *RECIPES[recipe], *sets]
        plan_status, plan_err = outcome(["plan", *common])
        train_status, train_err = outcome(["train", *common])
        assert not list(Path(folder).iterdir()), "train wrote before its validation ended"
    assert plan_status in (0, 2), plan_err
    if plan_status == 0:
        assert train_status == "validated", f"plan accepted {sets}, train refused:\n{train_err}"
        return
    assert train_status == 2, f"plan refused {sets}, train went on ({train_status}):\n{plan_err}"
    plan_line, train_line = (
        err.split(": error: ", 1)[1].split("\n(run with --debug")[0] for err in (plan_err, train_err)
    )
    assert plan_line == train_line
    assert any(names_the_key(key, plan_line) for key, _ in changes), f"{sets}: {plan_line}"


@pytest.fixture(scope="module")
def monkeypatch_module():
    """train stops where its validation ends (module-scoped: Hypothesis runs every example in one test call)."""
    with pytest.MonkeyPatch.context() as patch:

        def stop(validation):
            raise Validated

        patch.setattr("longpeft.recipes.runner.check_here", stop)
        yield patch


def test_train_runs_the_validation_plan_runs_before_anything_else(monkeypatch, tmp_path):
    """The runner's first step is :func:`validate_recipe` on the recipe train loaded, the function plan calls, and
    nothing is written or loaded before it returns."""
    import longpeft.recipes.runner as runner
    from longpeft.recipes import validate

    seen = []
    monkeypatch.setattr(
        runner, "validate_recipe", lambda recipe: seen.append(recipe) or validate.validate_recipe(recipe)
    )

    def stop(validation):
        raise Validated

    monkeypatch.setattr(runner, "check_here", stop)
    assert outcome(["train", "tiny-cpu", "--set", f"output_dir={tmp_path / 'run'}"])[0] == "validated"
    assert [recipe.name for recipe in seen] == ["tiny-cpu"] and not (tmp_path / "run").exists()


# ---- the Hub's answers of any shape ---------------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
FILE_NAMES = st.sampled_from(["longpeft.json", "config.json", "adapter_config.json", "adapter_model.safetensors"])
# A revision's info as the Hub answers it (id, sha, the listing of its files), each part of any shape, or any JSON.
HUB_ANSWERS = st.one_of(
    JSON,
    st.fixed_dictionaries(
        {"id": st.just("someone/a") | JSON, "sha": st.just("0" * 40) | JSON},
        optional={"siblings": st.lists(st.fixed_dictionaries({"rfilename": FILE_NAMES | JSON}), max_size=3) | JSON},
    ),
)


@given(answer=HUB_ANSWERS, command=st.sampled_from(["merge", "plan"]))
def test_hub_answers_of_any_shape_end_in_one_line_naming_the_repo(answer, command):
    """A Hub (tests/fake_hub.py) that answers the repo's revision and listings with generated JSON: merging the repo
    as an adapter, or planning a recipe with it as the base, ends in exit 2 and one line naming the repo."""
    from fake_hub import FakeHub, pointed_at

    with FakeHub("answer", answer=answer) as hub, pointed_at(hub.endpoint), tempfile.TemporaryDirectory() as folder:
        argv = (
            ["merge", "someone/a", "--out", f"{folder}/out"]
            if command == "merge"
            else ["plan", "tiny-cpu", "--set", "model.name_or_path=someone/a", "--set", f"output_dir={folder}/run"]
        )
        status, err = outcome(argv)
    assert status == 2, err
    lines = err.splitlines()
    assert len(lines) == 2 and lines[1] == "(run with --debug for the traceback)", err
    assert lines[0].startswith(f"longpeft {command}: error: ") and "someone/a" in lines[0], err
