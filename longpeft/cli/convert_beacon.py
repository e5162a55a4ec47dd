"""``longpeft convert-beacon SOURCE --base BASE --out DIR``: an authors' Activation Beacon model as a longpeft
adapter (:func:`longpeft.hub.convert_authors_beacon`)."""

from __future__ import annotations

import argparse
import json


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``convert-beacon`` subcommand."""
    convert = subparsers.add_parser(
        "convert-beacon",
        help="turn an authors' Activation Beacon model (full checkpoint + remote code) into a longpeft adapter",
        description="Reads only the beacon settings and beacon tensors of the authors' released model (no remote "
        "code runs) and writes longpeft.json + beacon_adapter.safetensors for the matching stock base; then "
        "longpeft.load(BASE, OUT) gives the stock base with those beacons.",
    )
    convert.add_argument(
        "source", help="the authors' model: local folder or Hub id (e.g. namespace-Pt/beacon-qwen-2-7b-instruct)"
    )
    convert.add_argument("--base", required=True, help="the stock model it was built on (e.g. Qwen/Qwen2-7B-Instruct)")
    convert.add_argument("--out", required=True, help="new adapter folder")
    convert.set_defaults(func=cmd_convert_beacon)


def cmd_convert_beacon(args: argparse.Namespace) -> int:
    from ..hub import convert_authors_beacon  # torch: `longpeft --help` and plan do without

    print(json.dumps(convert_authors_beacon(args.source, args.out, base=args.base), indent=2))
    return 0
