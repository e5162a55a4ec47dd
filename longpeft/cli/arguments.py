"""Arguments several commands take, each declared once: the recipe with its ``--set`` overrides (train, plan), and
the argparse type of a bounded number."""

from __future__ import annotations

import argparse
import math


def add_recipe_arguments(parser: argparse.ArgumentParser, optional: bool = False) -> None:
    """The ``recipe`` positional (``optional``: plan's, which ``--list`` does without) and repeatable ``--set``
    overrides, read into ``args.recipe`` and ``args.overrides``."""
    what = "recipe YAML path or bundled recipe name"
    parser.add_argument(
        "recipe", nargs="?" if optional else None, help=what if optional else f"{what} (see `longpeft plan --list`)"
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a recipe key, e.g. --set train.max_steps=10 (repeatable)",
    )


def number(kind: type, low: float, high: float | None = None, inclusive: bool = True):
    """An argparse type: a ``kind`` number >= ``low`` (> with ``inclusive=False``) and <= ``high``."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number")
        if value < low or (value == low and not inclusive) or (high is not None and value > high):
            bound = f"{'>=' if inclusive else '>'} {low:g}" + (f" and <= {high:g}" if high is not None else "")
            raise argparse.ArgumentTypeError(f"{text} is out of range: must be {bound}")
        return value

    return parse
