"""``longpeft push SOURCE --repo OWNER/NAME``: an adapter, the merged model or a fully fine-tuned model to the Hub
(:func:`longpeft.hub.push`)."""

from __future__ import annotations

import argparse

from ..config import DTYPE_NAMES


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``push`` subcommand."""
    push = subparsers.add_parser(
        "push", help="share an adapter (or the merged model), or a fully fine-tuned model, on the Hugging Face Hub"
    )
    push.add_argument(
        "source",
        help="adapter folder, model folder of a finetune: full run, or run folder (containing adapter/ or model/)",
    )
    push.add_argument("--repo", required=True, help="Hub repo id, owner/name")
    push.add_argument(
        "--merged",
        action="store_true",
        help="upload the merged model instead of the adapter (a whole "
        "model, merged or fully fine-tuned, is uploaded as it is either way)",
    )
    push.add_argument(
        "--dtype",
        default="bfloat16",
        choices=DTYPE_NAMES,
        help="dtype of an uploaded model (--merged, or a fully fine-tuned one; default bfloat16); an "
        "adapter is uploaded as saved",
    )
    push.add_argument(
        "--private",
        action="store_true",
        help="make the repository private (an existing public one too); without it a new repository gets the "
        "account's default visibility and an existing one keeps its own",
    )
    push.add_argument(
        "--base-id",
        help="the base model's Hub id, written into the card and longpeft.json (default: the Hub id recorded in "
        "longpeft.json; a local base is named nowhere in the upload, with a warning)",
    )
    push.add_argument(
        "--base", help="the base model to merge into with --merged (default: the one named in longpeft.json)"
    )
    push.add_argument(
        "--dry-run", metavar="DIR", help="write exactly the folder that would be uploaded, upload nothing"
    )
    push.set_defaults(func=cmd_push)


def cmd_push(args: argparse.Namespace) -> int:
    from ..hub import push  # torch: `longpeft --help` and plan do without

    options = dict(merged=args.merged, dtype=args.dtype, private=args.private, dry_run=args.dry_run)
    print(push(args.source, args.repo, **options, base_id=args.base_id, base=args.base))
    return 0
