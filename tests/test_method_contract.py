"""The method contract (``longpeft/adapters/registry.py``), checked on every registered method in peft's TEST_CASES
style: each method gives one set of settings in :data:`CASES`, and the same checks run on all of them.

- its folder has the contract's files, its config module needs no torch, every hook it overrides is a named function
  of its folder with the base hook's arguments;
- ``apply`` changes the logits and ``remove`` restores them exactly, with ``is_applied`` following both;
- its config round-trips through ``longpeft.json`` and, applied from there, gives the same model;
- its own weights (``weights``) save and load back exactly;
- its ``export`` of a saved model loads in a fresh process without longpeft, with the same logits.

A method registered later (a plug-in) is one folder and one ``register`` line:
:func:`test_a_new_method_is_one_folder_and_one_register_line` writes one (with a data collator and an exclusion) into a
temporary folder, registers it, and trains it through the runner. The last test keeps method names out of every
condition outside the method folders.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from longpeft.adapters import METHODS, Method, ResolveContext, apply_spec, config_of, registered
from longpeft.adapters.registry import COLLATOR, RUN_FEATURES, MethodConflict, find_conflicts, register
from longpeft.spec import ContextSpec
from longpeft.tiny import tiny_config, tiny_model

from export_helpers import run_without_longpeft  # tests/export_helpers.py

# compat: also run by `make test-compat` (transformers 5.17, trl 1.15, datasets 4)
pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.compat]

PACKAGE = Path(__file__).resolve().parents[1] / "longpeft"
HEAVY = ("torch", "transformers", "peft", "trl", "safetensors", "accelerate", "bitsandbytes")
TRAINED_LENGTH, TARGET_LENGTH = 256, 1024
IDS = torch.randint(3, 500, (1, 48), generator=torch.Generator().manual_seed(5))

# One case per registered method: settings that change a tiny Llama (RoPE base 1e4, 2 KV heads, 256 positions)
# within IDS's 48 tokens.
CASES: dict[str, dict] = {
    "rope": {"rope_theta": 1e6, "max_position_embeddings": TARGET_LENGTH},
    "harpe": {"selection": "uniform", "b_min": 1e4, "b_max": 1e6},
    "pose": {"target_length": TARGET_LENGTH},
    "string": {"shift": 24, "local_window": 8},
    "beacon": {"window": 16, "ratios": [4], "params": ["q", "k", "v", "o"]},
}


def case_config(method: Method):
    """The method's case, resolved against the tiny Llama as a recipe would resolve it."""
    if method.name not in CASES:
        pytest.fail(f"method {method.name} has no contract case: add its settings to CASES in {Path(__file__).name}")
    context = ResolveContext(tiny_config("llama"), TRAINED_LENGTH, TARGET_LENGTH, {})
    return method.resolve(method.config(**CASES[method.name]), context)


def base_model():
    return tiny_model("llama", attn_implementation="sdpa")


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


# ---- the checks (run on every registered method, and on the plug-in of the last tests) --------------------------


def method_folder(method: Method) -> tuple[str, Path]:
    """The method's package and folder: where its config class lives (``<package>.config``)."""
    package = method.config.__module__.rpartition(".")[0]
    return package, Path(sys.modules[package].__file__).parent


def check_folder(method: Method) -> None:
    package, folder = method_folder(method)
    assert method.config.__module__ == f"{package}.config", "the config class lives in the method's config.py"
    modules = {path.name for path in folder.glob("*.py")}
    assert {"__init__.py", "config.py"} <= modules
    assert modules - {"__init__.py", "config.py", "export.py", "remote_classes.py"}, "its torch code has a module"
    assert (folder / "export.py").is_file() == method.overrides("export"), "export.py where (only where) it exports"
    assert "remote_classes.py" not in modules or method.remote_code, "remote_classes.py only for a modeling file"
    assert importlib.import_module(package).METHOD is method, "__init__.py's METHOD is the registered method"


# The hooks of the contract: the base's methods (``overrides`` and the properties are what callers ask of them).
HOOKS = [name for name, value in vars(Method).items() if inspect.isfunction(value) and name[0] != "_"]
HOOKS.remove("overrides")
TRAINING_HOOKS = ("collator", "long_samples", "training_span", "training_labels")


def hook_function(method: Method, hook: str) -> tuple[object, list[str]]:
    """The function a method's class gives for ``hook``, and its arguments after ``self``: a method's, or a static
    method's (for one bound by ``imported_on_call``, the function it imports when called)."""
    value = inspect.getattr_static(type(method), hook)
    if not isinstance(value, staticmethod):
        return value, list(inspect.signature(value).parameters)[1:]
    function = value.__func__
    if list(inspect.signature(function).parameters) == ["args", "kwargs"]:  # imported_on_call's hook
        function = getattr(importlib.import_module(function.__module__), function.__name__)
    return function, list(inspect.signature(function).parameters)


def check_hooks(method: Method) -> None:
    """Every hook the method overrides is a named function of its folder taking the base hook's arguments."""
    package, _ = method_folder(method)
    for hook in HOOKS:
        if not method.overrides(hook):
            continue
        function, arguments = hook_function(method, hook)
        assert function.__name__ != "<lambda>", f"{method.name}.{hook} is a lambda: tracebacks would say <lambda>"
        assert function.__module__.startswith(package), (
            f"{method.name}.{hook} is {function.__module__}.{function.__name__}, outside the method's folder"
        )
        expected = list(inspect.signature(getattr(Method, hook)).parameters)[1:]
        assert arguments == expected, f"{method.name}.{hook} takes {arguments}; the contract's hook takes {expected}"


def executed_statements(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements that run when a module is imported: its top level, into ``if``/``try`` blocks, but not into
    functions, classes or ``if TYPE_CHECKING:``."""
    statements = []
    for node in body:
        statements.append(node)
        if isinstance(node, ast.If) and not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
            statements += executed_statements(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            statements += executed_statements(
                node.body + node.orelse + node.finalbody + [s for handler in node.handlers for s in handler.body]
            )
    return statements


def module_level_imports(path: Path, module: str) -> set[str]:
    """Modules a file imports when it is imported (:func:`executed_statements`), relative imports resolved against
    ``module``; ``from a import b`` gives ``a.b``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in executed_statements(ast.parse(path.read_text()).body):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            names |= {f"{base}.{alias.name}" for alias in node.names}
    return names


def source_of(name: str) -> tuple[str, Path] | None:
    """The deepest module of a dotted import name that has a source file (``a.b.C`` -> module ``a.b``)."""
    while name:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):  # a name inside a module, not a module
            spec = None
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            return name, Path(spec.origin)
        name = name.rpartition(".")[0]
    return None


def check_config_needs_no_torch(method: Method) -> None:
    """The config module, and every module it imports in turn (package ``__init__`` files aside), imports none of
    :data:`HEAVY` when it is imported."""
    module = method.config.__module__
    seen, todo = set(), [(module, Path(sys.modules[module].__file__))]
    while todo:
        name, path = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for imported in module_level_imports(path, name):
            top = imported.split(".")[0]
            assert top not in HEAVY, f"{name} imports {imported} (via {module}): the config module must need no torch"
            found = source_of(imported) if top == "longpeft" or top == module.split(".")[0] else None
            if found is not None and found[1].name != "__init__.py":
                todo.append(found)


def check_apply_and_remove(method: Method, config) -> None:
    model = base_model()
    before, state = logits(model), {k: v.clone() for k, v in model.state_dict().items()}
    assert not method.is_applied(model)
    method.apply(model, config)
    assert method.is_applied(model)
    assert not torch.equal(logits(model), before), f"{method.name}'s case changes nothing within {IDS.shape[1]} tokens"
    method.remove(model)
    assert not method.is_applied(model)
    assert torch.equal(logits(model), before)
    assert model.state_dict().keys() == state.keys() and all(
        torch.equal(model.state_dict()[k], v) for k, v in state.items()
    )


def check_spec_round_trip(method: Method, config, folder: Path) -> None:
    ContextSpec.from_base(tiny_config("llama"), method.name, methods={method.name: config.model_dump()}).save(folder)
    loaded = ContextSpec.load(folder)
    assert config_of(method.name, loaded.methods[method.name]) == config
    if method.changes_model:  # the recorded section is all the method needs
        direct, from_spec = base_model(), base_model()
        method.apply(direct, config)
        apply_spec(from_spec, loaded)
        assert torch.equal(logits(from_spec), logits(direct))


# ---- every registered method --------------------------------------------------------------------------------------

BUILT_IN = list(METHODS)


@pytest.mark.parametrize("name", BUILT_IN)
def test_the_method_folder_config_and_hooks_keep_the_contract(name):
    method = METHODS[name]
    check_folder(method)
    check_hooks(method)
    check_config_needs_no_torch(method)
    unknown = set(method.conflicts) - set(METHODS) - set(RUN_FEATURES)
    assert not unknown, f"{name}.conflicts names {unknown}: neither a registered method nor a run feature"


@pytest.mark.parametrize("name", BUILT_IN)
def test_apply_changes_the_logits_and_remove_restores_them_exactly(name):
    method = METHODS[name]
    if not method.changes_model:
        assert any(map(method.overrides, TRAINING_HOOKS)), (
            f"{name} changes no model, so it must change the training inputs"
        )
        pytest.skip(f"{name} changes only the training inputs (no apply/remove)")
    check_apply_and_remove(method, case_config(method))


@pytest.mark.parametrize("name", BUILT_IN)
def test_is_applied_follows_apply_and_remove(name):
    method = METHODS[name]
    if not method.changes_model:
        pytest.skip(f"{name} changes only the training inputs (no apply/remove)")
    model, config = base_model(), case_config(method)
    assert not method.is_applied(model)
    method.apply(model, config)
    assert method.is_applied(model)
    method.apply(model, config)  # applying again replaces the settings
    assert method.is_applied(model)
    method.remove(model)
    assert not method.is_applied(model)


@pytest.mark.parametrize("name", BUILT_IN)
def test_the_config_round_trips_through_longpeft_json(name, tmp_path):
    method = METHODS[name]
    check_spec_round_trip(method, case_config(method), tmp_path)


@pytest.mark.parametrize("name", [name for name, method in METHODS.items() if method.keeps_weights])
def test_method_weights_save_and_load_back_exactly(name, tmp_path):
    method = METHODS[name]
    config = case_config(method)
    trained = base_model()
    method.apply(trained, config)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # as after training: away from their initial values
        for parameter in method.weight_parameters(trained).values():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    method.save_weights(trained, tmp_path, config, None)
    fresh = base_model()
    method.apply(fresh, config)
    assert not torch.equal(logits(fresh), logits(trained))
    method.load_weights(fresh, tmp_path, config)
    saved, loaded = method.weight_parameters(trained), method.weight_parameters(fresh)
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    assert torch.equal(logits(fresh), logits(trained))


LOAD_EXPORTS = r"""
import torch
from transformers import AutoModelForCausalLM

ids = torch.load(sys.argv[1])
for model_dir, out_path, remote_code in zip(*[iter(sys.argv[2:])] * 3):
    if remote_code == "1":
        model = load_exported(model_dir, "sdpa")
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()
    with torch.no_grad():
        torch.save(model(ids).logits, out_path)
    print("LOADED", model_dir, type(model).__name__)
"""


def test_every_export_loads_in_a_fresh_process_without_longpeft(tmp_path):
    """A model with the method on, saved and exported as ``hub.merge`` does, loads with transformers alone
    (``trust_remote_code`` where the method ships a modeling file, and only then) and gives the same logits. One
    fresh process loads every method's export (each start costs seconds)."""
    exporting = [method for method in METHODS.values() if method.overrides("export")]
    assert exporting
    expected, arguments = {}, [str(tmp_path / "ids.pt")]
    torch.save(IDS, tmp_path / "ids.pt")
    for method in exporting:
        config = case_config(method)
        model = base_model()
        method.apply(model, config)
        folder = tmp_path / method.name
        model.save_pretrained(folder)
        method.export(model, folder, config)
        expected[method.name] = logits(model)
        arguments += [str(folder), str(tmp_path / f"{method.name}.pt"), "1" if method.remote_code else "0"]
    run = run_without_longpeft(LOAD_EXPORTS, arguments, tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    for method in exporting:
        assert f"LOADED {tmp_path / method.name} " in run.stdout, method.name
        torch.testing.assert_close(
            torch.load(tmp_path / f"{method.name}.pt"),
            expected[method.name],
            atol=1e-5,
            rtol=0,
            msg=lambda text, name=method.name: f"{name}'s export: {text}",
        )


def test_conflicts_are_refused_naming_both_sides_and_the_fix():
    assert [str(c) for c in find_conflicts(["rope", "string", "beacon"])] == [
        f"string and beacon cannot be combined: {METHODS['string'].conflicts['beacon']}; remove one of the two "
        "sections"
    ]
    assert [
        str(c) for c in find_conflicts(["rope", "pose"], {COLLATOR: "data.utk", "split_sequences": "--launch ulysses"})
    ] == [
        f"--launch ulysses with pose: {METHODS['pose'].conflicts['split_sequences']}; use --launch ddp",
        "data.utk and pose cannot be combined: each brings its own data collator; use one of them",
    ]
    assert find_conflicts(["rope"], {"sharded_weights": "--launch fsdp2", COLLATOR: "data.utk"}) == []
    with pytest.raises(ValueError, match="unknown run features \\['fsdp'\\]"):
        find_conflicts(["rope"], {"fsdp": "--launch fsdp2"})


def test_register_refuses_half_a_hook_set_and_a_conflict_without_reason():
    class Half(Method):
        name, config = "half", METHODS["pose"].config
        apply, is_applied = staticmethod(print), staticmethod(callable)

    class HalfWeights(Method):
        name, config, plan_lever = "half_weights", METHODS["pose"].config, "half_weights.size"
        save_weights = staticmethod(print)

    class Unreasoned(Method):
        name, config, conflicts = "unreasoned", METHODS["pose"].config, {"rope": ""}

    with pytest.raises(ValueError, match=r"give apply, remove and is_applied together \(missing \['remove'"):
        register(Half())
    with pytest.raises(ValueError, match=r"give weight_parameters, .* together \(missing \['weight_parameters'"):
        register(HalfWeights())
    with pytest.raises(ValueError, match=r"conflicts \['rope'\] need a reason"):
        register(Unreasoned())
    with pytest.raises(ValueError, match="a Method subclass sets name"):
        register(Method())
    assert not {"half", "half_weights", "unreasoned"} & set(METHODS)


# ---- a new method: one folder and one register line ---------------------------------------------------------------

PLUGIN = {
    "config.py": '''
        """The ``dummy`` section: a test method that scales the final norm and brings its own collator (no torch)."""

        from __future__ import annotations

        from longpeft.config import StrictModel


        class DummyConfig(StrictModel):
            scale: float = 2.0


        def describe(config: DummyConfig) -> list[str]:
            return [f"Dummy method: final norm scaled by {config.scale}."]
        ''',
    "modeling.py": '''
        """The dummy's torch code: the norm change and its collator, which counts what it collates."""

        from __future__ import annotations

        import torch

        CALLS: list[int] = []  # samples per collated batch


        def _norm(model):
            return (model.get_base_model() if hasattr(model, "get_base_model") else model).model.norm


        def apply_dummy(model, config) -> None:
            norm = _norm(model)
            if not hasattr(norm, "dummy_original"):
                norm.dummy_original = norm.weight.detach().clone()
            with torch.no_grad():
                norm.weight.copy_(norm.dummy_original * config.scale)


        def remove_dummy(model) -> None:
            norm = _norm(model)
            with torch.no_grad():
                norm.weight.copy_(norm.dummy_original)
            del norm.dummy_original


        def is_dummy_on(model) -> bool:
            return hasattr(_norm(model), "dummy_original")


        class DummyCollator:
            def __init__(self, pad_token_id: int, max_length: int) -> None:
                self.pad_token_id, self.max_length = pad_token_id, max_length

            def __call__(self, features):
                CALLS.append(len(features))
                rows = [list(f["input_ids"])[: self.max_length] for f in features]
                masks = [list(f.get("assistant_masks") or [1] * len(r))[: len(r)] for f, r in zip(features, rows)]
                width = max(map(len, rows))
                ids = torch.full((len(rows), width), self.pad_token_id)
                labels = torch.full((len(rows), width), -100)
                attention = torch.zeros((len(rows), width), dtype=torch.long)
                for b, (row, mask) in enumerate(zip(rows, masks)):
                    ids[b, : len(row)] = torch.tensor(row)
                    labels[b, : len(row)] = torch.where(torch.tensor(mask, dtype=torch.bool), torch.tensor(row), -100)
                    attention[b, : len(row)] = 1
                return {"input_ids": ids, "labels": labels, "attention_mask": attention}
        ''',
    "__init__.py": '''
        """A test method: one folder, registered with one line."""

        from __future__ import annotations

        from longpeft.adapters import CollatorContext, Method

        from .config import DummyConfig, describe
        from .modeling import DummyCollator, apply_dummy, is_dummy_on, remove_dummy


        class Dummy(Method):
            name = "dummy"
            config = DummyConfig
            conflicts = {"beacon": "the dummy scales the norm whose output Activation Beacon's windows condense"}

            apply = staticmethod(apply_dummy)
            remove = staticmethod(remove_dummy)
            is_applied = staticmethod(is_dummy_on)
            describe = staticmethod(describe)

            def collator(self, config: DummyConfig, context: CollatorContext) -> DummyCollator:
                return DummyCollator(context.pad_token_id, context.max_length)


        METHOD = Dummy()
        ''',
}


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """The dummy method's folder, importable as ``longpeft_dummy`` (not registered)."""
    folder = tmp_path / "plugins" / "longpeft_dummy"
    folder.mkdir(parents=True)
    for name, text in PLUGIN.items():
        (folder / name).write_text(textwrap.dedent(text).lstrip())
    monkeypatch.syspath_prepend(str(folder.parent))
    yield importlib.import_module("longpeft_dummy")
    for name in [name for name in sys.modules if name.startswith("longpeft_dummy")]:
        del sys.modules[name]


def test_a_new_method_is_one_folder_and_one_register_line(plugin, tiny_base_dirs, chat_jsonl, tmp_path):
    """The dummy keeps the contract, trains through the runner with its collator, and its exclusion and its
    collator are refused where they clash, with the declared reasons; nothing else in longpeft knows it."""
    from longpeft.recipes.runner import run
    from longpeft.recipes.schema import RecipeError, load_recipe

    with registered(plugin.METHOD) as method:
        check_folder(method)
        check_hooks(method)
        check_config_needs_no_torch(method)
        config = method.config()
        check_apply_and_remove(method, config)
        check_spec_round_trip(method, config, tmp_path / "spec")

        overrides = [
            f"model.name_or_path={tiny_base_dirs('llama')}",
            f"data.source={chat_jsonl}",
            "data.max_length=256",
            "dummy.scale=1.5",
            f"output_dir={tmp_path / 'run'}",
            "train.max_steps=2",
            "train.global_batch_size=2",
            "train.per_device_batch_size=1",
            "lora.r=2",
            "lora.embeddings=none",
        ]
        result = run(load_recipe("tiny-cpu", overrides))
        calls = sys.modules["longpeft_dummy.modeling"].CALLS
        assert len(calls) >= 4 and set(calls) == {1}  # 2 steps x 2 accumulated batches of 1 sample, at least
        assert ContextSpec.load(result.adapter_dir).methods["dummy"] == {"scale": 1.5}

        with pytest.raises(
            RecipeError,
            match="dummy and beacon cannot be combined: the dummy scales the norm whose "
            "output Activation Beacon's windows condense; remove one of the two",
        ):
            load_recipe("tiny-beacon-cpu", ["dummy.scale=1.5"])
        with pytest.raises(
            RecipeError, match="pose and dummy cannot be combined: each brings its own data collator; use one of them"
        ):
            load_recipe("tiny-cpu", ["dummy.scale=1.5", "pose.target_length=2048"])
        utk = [
            f"data.source={tmp_path / 'docs.jsonl'}",
            "data.format=text",
            "train.assistant_only_loss=false",
            "data.utk.probability=0.5",
        ]
        with pytest.raises(
            RecipeError,
            match="data.utk and dummy cannot be combined: each brings its own data collator; use one of them",
        ):
            load_recipe("tiny-cpu", ["dummy.scale=1.5", *utk])
        model = base_model()
        method.apply(model, config)
        from longpeft.adapters.beacon import BeaconConfig, apply_beacon

        with pytest.raises(MethodConflict, match="this model has dummy on, and beacon cannot be combined with it"):
            apply_beacon(model, BeaconConfig(window=16, ratios=[4]).settings())
    assert "dummy" not in METHODS
    with pytest.raises(RecipeError, match="dummy: unknown key"):
        load_recipe("tiny-cpu", ["dummy.scale=1.5"])


# ---- no module outside the method folders names a method in a condition ------------------------------------------

# (module, function) -> why it may name a method; every other module asks the registry.
EXCEPTIONS = {
    ("longpeft/spec.py", "methods_from_v1"): "the format-1 reader (format-1 fields became method sections); the "
    "issue29-settings branch, which owns spec.py, deletes it",
    ("longpeft/spec.py", "rope_parameters"): "spec.py sits below the registry (adapters import it): every "
    "longpeft.json carries the implied rope section, read back here",
    ("longpeft/spec.py", "max_position_embeddings"): "as rope_parameters",
    ("longpeft/spec.py", "head_bases"): "a ContextSpec accessor below the registry; longpeft itself no longer reads "
    "it (spec.py is left to the issue29-settings branch)",
    ("longpeft/spec.py", "string"): "as head_bases",
    ("longpeft/eval/tasks.py", "write_outputs"): "'string' there is the results' key of the STRING settings an "
    "evaluation ran with (eval switches STRING on by design), not a "
    "method section",
    ("longpeft/eval/tasks.py", "evaluate"): "as write_outputs",
}


def method_name_conditions(path: Path, names: set[str]) -> list[tuple[str, int, str]]:
    """``(function, line, code)`` of each comparison with, membership test in, ``.get``/``.pop`` of, or subscript by
    a method name literal in ``path`` (the function is the innermost one, or the module)."""
    source = path.read_text()
    found = []

    def literal(node) -> bool:
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(literal(element) for element in node.elts)
        return isinstance(node, ast.Constant) and node.value in names

    def visit(node, function: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        hit = (
            (isinstance(node, ast.Compare) and any(literal(operand) for operand in (node.left, *node.comparators)))
            or (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("get", "pop", "setdefault")
                and node.args
                and literal(node.args[0])
            )
            or (isinstance(node, ast.Subscript) and literal(node.slice))
        )
        if hit:
            found.append((function, node.lineno, ast.get_source_segment(source, node)))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(ast.parse(source), "<module>")
    return found


def test_no_module_outside_a_method_folder_names_a_method_in_a_condition():
    """The registry is the only place that knows the methods: outside ``longpeft/adapters/<name>/`` no module
    compares with, tests membership of, or looks up by a method's name (the reasoned exceptions aside)."""
    folders = {method_folder(METHODS[name])[1] for name in BUILT_IN}
    problems, used = [], set()
    for path in sorted(PACKAGE.rglob("*.py")):
        if any(folder in path.parents for folder in folders):
            continue
        relative = path.relative_to(PACKAGE.parent).as_posix()
        for function, line, code in method_name_conditions(path, set(BUILT_IN)):
            if (relative, function) in EXCEPTIONS:
                used.add((relative, function))
            else:
                problems.append(f"{relative}:{line} ({function}): {code}")
    assert problems == [], "ask the registry (a Method hook or attribute) instead:\n" + "\n".join(problems)
    assert used, "the scan found none of the reasoned exceptions: is it reading the package?"


def test_the_condition_scan_sees_each_form(tmp_path):
    """The scan of the test above flags each way of naming a method in a condition, and not a name in plain data."""
    code = textwrap.dedent("""
        def f(recipe, spec, name, m):
            a = name == "pose"
            b = "beacon" in recipe.method_configs()
            c = name in ("harpe", "string")
            d = spec.methods.get("pose")
            e = recipe.configs["rope"]
            return {"rope": 1}, ["pose"], m.name
        """)
    path = tmp_path / "probe.py"
    path.write_text(code)
    assert sorted(line for _, line, _ in method_name_conditions(path, set(BUILT_IN))) == [3, 4, 5, 6, 7]
