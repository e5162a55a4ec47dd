"""The package's layers: no import cycle, and no layer imports one above it (CONTRIBUTING.md, "Where things
live": rope/files <- adapters <- recipes <- cli). Imports are read from the source, those inside functions included,
so a lazy import that would close a cycle counts too. Below them all, ``longpeft.errors`` (the exception classes)
imports nothing, and every layer may import it: the torch-free file rules raise its errors too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "longpeft"

FLOOR = "errors"  # the exception classes: every layer may import them
# layer -> the layers it must not import ("*": all but the floor)
FORBIDDEN = {
    "errors": {"*"},
    "files": {"*"},  # torch-free and at the bottom: nothing of longpeft but its errors
    "units": {"*"},  # how quantities are written: torch-free, imports nothing of longpeft
    # the one reader of weights, checkpoints and JSON: the file rules and errors only (torch imported lazily)
    "reading": {
        "rope",
        "spec",
        "config",
        "adapters",
        "recipes",
        "cli",
        "hub",
        "loading",
        "eval",
        "scale",
        "launch",
        "synth_data",
        "tiny",
        "family",
    },
    # peft glue for adapter weight files (peft's format; a tied embedding once in checkpoints): below loading, recipes
    "adapter_weights": {
        "rope",
        "spec",
        "adapters",
        "recipes",
        "cli",
        "hub",
        "loading",
        "eval",
        "scale",
        "launch",
        "synth_data",
        "tiny",
    },
    "rope": {"adapters", "recipes", "cli", "hub", "loading", "eval", "scale", "launch", "synth_data"},
    # a base's config read without weights or torch: below the recipes' validation, loading and merging
    "base_config": {
        "rope",
        "spec",
        "adapters",
        "recipes",
        "cli",
        "hub",
        "loading",
        "eval",
        "scale",
        "launch",
        "synth_data",
    },
    "adapters": {"hub", "loading", "recipes", "eval", "cli", "scale", "launch", "synth_data"},
    "synth_data": {"adapters", "recipes", "hub", "loading", "eval", "cli"},
    "eval": {"recipes", "cli"},
    "scale": {"recipes", "cli", "hub"},
    "launch": {"recipes", "scale", "cli", "hub"},
    "hub": {"recipes", "cli"},
    "loading": {"recipes", "cli", "hub"},
    "recipes": {"cli"},
}
BESIDE: dict[str, set[str]] = {}  # layer -> the "*" layers beside it that it may import
# The LLM client's parts in synth_data -> the modules of synth_data each may import: the cache, the rejects file and
# the HTTP call know nothing of each other nor of the client that joins them.
LLM_CLIENT_PARTS = {
    "llm_request": set(),
    "llm_cache": {"llm_request", "llm_rejects"},
    "llm_rejects": set(),
    "llm_http": {"llm_request"},
    "answer_schema": {"llm_http", "llm_request"},
    "endpoint": {"llm_http", "llm_request"},
    "llm_client": {"answer_schema", "llm_request", "llm_cache", "llm_rejects", "llm_http", "endpoint"},
}
# The recipe runner's parts (CONTRIBUTING.md, "Where things live") -> the modules of recipes/ each may import. The
# steps, in the order data flows: validate, resume, base, data, peft_setup, trainer (with recipe_trainer, the Trainer
# class), saving. A step never imports a later one, and none imports the runner, which joins them.
RECIPE_PARTS = {
    "schema": set(),
    "validate": {"schema"},
    "checkpoints": set(),
    "resume": {"schema", "checkpoints"},
    "base": {"schema", "validate"},
    "unsloth_backend": {"schema", "base", "peft_setup"},
    "data": {"schema"},
    "init_from": {"schema"},
    "peft_setup": {"schema"},
    "recipe_trainer": {"checkpoints"},
    "trainer": {"schema", "data", "init_from", "peft_setup", "recipe_trainer"},
    "memory": {"schema"},
    "saving": {"schema", "checkpoints"},
    # the planner's sample lengths, by the data step's rules, and its longest-context search
    "plan_data": {"schema", "data", "validate"},
}
HEAVY = ("torch", "transformers", "peft", "trl", "safetensors")  # what a torch-free module must not import


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def imports(name: str) -> tuple[set[str], set[str]]:
    """The longpeft modules ``name`` imports (the deepest existing module of each ``from ... import``), and the
    top-level names of the other packages it imports."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    ours, others = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] or [base]
        else:
            continue
        for target in targets:
            if not target.startswith("longpeft"):
                others.add(target.split(".")[0])
                continue
            while target not in MODULES and "." in target:
                target = target.rpartition(".")[0]
            if target in MODULES and target != name:
                ours.add(target)
    return ours, others


GRAPH = {name: imports(name)[0] for name in MODULES}


def layer(name: str) -> str:
    return name.split(".")[1] if "." in name else ""


def test_no_import_cycle():
    """Tarjan's strongly connected components of the import graph: each must be a single module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in GRAPH[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in GRAPH:
        if node not in index:
            visit(node)
    assert cycles == []


@pytest.mark.parametrize("name", sorted(name for name in MODULES if layer(name) in FORBIDDEN))
def test_no_layer_imports_one_above_it(name):
    forbidden = FORBIDDEN[layer(name)]
    above = sorted(
        target
        for target in GRAPH[name]
        if ("*" in forbidden and layer(target) not in {FLOOR, *BESIDE.get(layer(name), ())})
        or layer(target) in forbidden
    )
    assert above == [], f"{name} imports {above}"


@pytest.mark.parametrize("part", sorted(LLM_CLIENT_PARTS))
def test_the_llm_client_parts_import_only_those_below_them(part):
    name = f"longpeft.synth_data.{part}"
    used = {target.rpartition(".")[2] for target in GRAPH[name] if layer(target) == "synth_data"}
    assert used <= LLM_CLIENT_PARTS[part], f"{name} imports {sorted(used - LLM_CLIENT_PARTS[part])}"


CLI_SHARED = {"longpeft.cli.arguments"}  # the arguments several commands take, declared once
COMMAND_MODULES = sorted(
    name for name in MODULES if layer(name) == "cli" and name not in {"longpeft.cli", "longpeft.cli.__main__"}
)


@pytest.mark.parametrize("name", COMMAND_MODULES)
def test_a_command_module_imports_no_other_command(name):
    """Each command is one module holding its parser and its handler: it may share ``cli/arguments.py``, and
    imports no other command's module nor the package that assembles them."""
    others = sorted(target for target in GRAPH[name] if layer(target) == "cli" and target not in CLI_SHARED)
    assert others == [], f"{name} imports {others}"


@pytest.mark.parametrize("name", ["longpeft.files"])
def test_the_file_rules_need_no_torch(name):
    assert not imports(name)[1] & set(HEAVY)


# Modules whose import needs no torch, which they import inside the functions that need it (CONTRIBUTING.md, rules):
# the reader of files, and what validating a recipe imports (the schema, the registry and every method package's
# record, the base's config, the validation).
TORCH_ON_USE = [
    "reading",
    "base_config",
    "tiny",
    "recipes/schema",
    "recipes/validate",
    "adapters/__init__",
    "adapters/registry",
    *(f"adapters/{method}/__init__" for method in ("rope_base", "harpe", "pose", "string", "beacon")),
    # what `longpeft --help` and plan import: the command modules and the launch modules they use
    *(f"cli/{path.stem}" for path in sorted((PACKAGE / "cli").glob("*.py"))),
    *(f"launch/{path.stem}" for path in sorted((PACKAGE / "launch").glob("*.py"))),
]


@pytest.mark.parametrize("module", TORCH_ON_USE)
def test_the_reader_imports_no_torch_at_import_time(module):
    """These modules import torch (and the libraries on it) inside the functions that need it only."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    top = {alias.name.split(".")[0] for node in tree.body if isinstance(node, ast.Import) for alias in node.names}
    top |= {node.module.split(".")[0] for node in tree.body if isinstance(node, ast.ImportFrom) and node.module}
    assert not top & set(HEAVY)


def test_the_errors_import_nothing():
    ours, others = imports(f"longpeft.{FLOOR}")
    assert ours == set() and others <= {"__future__"}


def test_the_graph_reads_lazy_imports():
    """The reader sees imports inside functions (the stage check's lazy import of the Hub's weight reader)."""
    assert "longpeft.hub" in GRAPH["longpeft.recipes.init_from"]
    assert {"longpeft.recipes.base", "longpeft.recipes.trainer", "longpeft.recipes.data"} <= GRAPH[
        "longpeft.recipes.runner"
    ]


@pytest.mark.parametrize("name", sorted(name for name in MODULES if name.startswith("longpeft.recipes.")))
def test_each_recipe_step_imports_only_the_steps_before_it(name):
    """A module of recipes/ imports only those of recipes/ that ``RECIPE_PARTS`` gives it; the runner alone joins
    the steps (and a new module gets its place in the table)."""
    part = name.rpartition(".")[2]
    used = {target.rpartition(".")[2] for target in GRAPH[name] if target.startswith("longpeft.recipes.")}
    if part == "runner":
        assert used <= set(RECIPE_PARTS)
        return
    assert part in RECIPE_PARTS, f"{name} is not in RECIPE_PARTS: give it its place in the runner's steps"
    assert used <= RECIPE_PARTS[part], f"{name} imports {sorted(used - RECIPE_PARTS[part])}"
