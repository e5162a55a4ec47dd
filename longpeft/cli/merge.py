"""``longpeft merge ADAPTER --out DIR`` and ``longpeft export ADAPTER --out DIR``: one parser, one handler; export
also casts and writes the model card (:func:`longpeft.hub.merge`, :func:`longpeft.hub.export`)."""

from __future__ import annotations

import argparse
import json

from ..config import DTYPE_NAMES

COMMANDS = {  # name -> default --dtype, help
    "merge": ("float32", "merge an adapter into its base (plain from_pretrained loads the result)"),
    "export": ("bfloat16", "merge, cast and write a shareable safetensors folder with its model card"),
}


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``merge`` and ``export`` subcommands."""
    for name, (default_dtype, text) in COMMANDS.items():
        command = subparsers.add_parser(name, help=text)
        command.add_argument("adapter", help="adapter folder (with longpeft.json) or Hub id")
        command.add_argument("--out", required=True, help="output folder")
        command.add_argument("--base", help="base model (default: the one named in longpeft.json)")
        command.add_argument("--dtype", default=default_dtype, choices=DTYPE_NAMES)
        command.add_argument("--no-verify", action="store_true", help="skip the logits check against base + adapter")
        command.add_argument(
            "--without",
            action="append",
            default=[],
            metavar="METHOD",
            help="leave out an inference-time method (string), so the merged model loads without its "
            "modeling file (trust_remote_code); repeatable",
        )
        command.add_argument(
            "--base-id",
            help="the base model's Hub id (owner/name), recorded in longpeft.json and "
            "the card when the adapter names its base by a local path (the card leaves a path out)",
        )
        command.set_defaults(func=cmd_merge)


def cmd_merge(args: argparse.Namespace) -> int:
    from ..hub import export, merge, serving_note  # torch: `longpeft --help` and plan do without

    action = export if args.command == "export" else merge
    options = dict(base=args.base, dtype=args.dtype, verify=not args.no_verify, without=tuple(args.without))
    result = action(args.adapter, args.out, **options, base_id=args.base_id)
    print(json.dumps(result, indent=2))
    if result.get("max_abs_logit_diff") is not None:
        print(
            f"merged model vs base + adapter on a fixed 32-token probe: max |logit diff| = "
            f"{result['max_abs_logit_diff']:.3g} ({args.dtype} merged model against the adapter run in {args.dtype}; "
            "bfloat16 rounding alone gives differences of order 0.1-1, float32 of order 1e-5)"
        )
    print(serving_note(result["out_dir"]))
    return 0
