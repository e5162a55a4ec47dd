"""Facts of the installed transformers read from its source files, without importing it (which imports torch); each
reader falls back to importing the object when the source has a layout it does not know.
"""

from __future__ import annotations

import ast
import importlib.util
from functools import lru_cache
from pathlib import Path


def _source(relative: str) -> ast.Module | None:
    """The parsed source of ``transformers/<relative>``, or None when it is not there."""
    spec = importlib.util.find_spec("transformers")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / relative
    return ast.parse(path.read_text()) if path.is_file() else None


@lru_cache(maxsize=1)
def optimizer_names() -> tuple[str, ...]:
    """The optimizer names transformers' Trainer accepts (``training_args.OptimizerNames``)."""
    tree = _source("training_args.py")
    for node in tree.body if tree is not None else ():
        if isinstance(node, ast.ClassDef) and node.name == "OptimizerNames":
            names = tuple(
                statement.value.value
                for statement in node.body
                if isinstance(statement, ast.Assign)
                and isinstance(statement.value, ast.Constant)
                and isinstance(statement.value.value, str)
            )
            if names:
                return names
    from transformers.training_args import OptimizerNames

    return tuple(name.value for name in OptimizerNames)


@lru_cache(maxsize=1)
def model_types() -> frozenset[str]:
    """Every ``model_type`` transformers has a config class for (the keys of ``CONFIG_MAPPING_NAMES``), read from
    ``models/auto/auto_mappings.py`` and ``models/auto/configuration_auto.py``."""
    found: set[str] = set()
    for relative in ("models/auto/auto_mappings.py", "models/auto/configuration_auto.py"):
        tree = _source(relative)
        for node in ast.walk(tree) if tree is not None else ():
            mentions = isinstance(node, (ast.Assign, ast.Expr)) and "CONFIG_MAPPING_NAMES" in ast.unparse(
                node.targets[0] if isinstance(node, ast.Assign) else getattr(node.value, "func", node.value)
            )
            if mentions:
                found |= _string_keys(node.value)
    if found:
        return frozenset(found)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return frozenset(CONFIG_MAPPING_NAMES)


def _string_keys(node: ast.AST) -> set[str]:
    """The first strings of the ``(str, str)`` pairs and the string keys of the dicts inside ``node``."""
    keys = set()
    for inner in ast.walk(node):
        if isinstance(inner, ast.Tuple) and len(inner.elts) == 2 and _is_string(inner.elts[0]):
            keys.add(inner.elts[0].value)
        elif isinstance(inner, ast.Dict):
            keys |= {key.value for key in inner.keys if key is not None and _is_string(key)}
    return keys


def _is_string(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)
