"""``longpeft demo``: the whole path on a tiny model on CPU (:func:`longpeft.demo.run_demo`)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``demo`` subcommand."""
    demo = subparsers.add_parser("demo", help="the whole path on a tiny model on CPU: data, train, eval, merge, card")
    demo.add_argument("--out", default="runs/demo")
    demo.add_argument("--max-steps", type=int, default=None, help="cap the training steps (quick checks)")
    demo.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    from ..demo import run_demo  # torch and transformers: `longpeft --help` and plan do without

    run_demo(args.out, max_steps=args.max_steps)
    return 0
