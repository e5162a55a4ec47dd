"""The ``longpeft`` command: train | plan | merge | export | push | convert-beacon | synth | eval | demo, each a
module with its ``register(subparsers)`` and handler (eval's and synth's in their packages); :func:`main` is the one
error boundary of every command."""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import traceback

import pydantic
import yaml

from ..errors import HubTimeoutError, LongpeftError
from ..eval import cli as eval_cli
from ..files import HUB_CLIENT_PACKAGES, raised_in, write_failure
from ..reading import REFUSED_FOR_SAFETY
from ..synth_data import cli as synth_cli
from . import convert_beacon, demo, merge, plan, push, train

COMMANDS = (train, plan, merge, push, convert_beacon, synth_cli, eval_cli, demo)  # in the order --help lists them


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="longpeft", description="Parameter-efficient context extension.")
    parser.add_argument(
        "--debug", action="store_true", help="show the full traceback of an error (or set LONGPEFT_DEBUG=1)"
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.register(subparsers)
    return parser


def error_message(exc: BaseException) -> str | None:
    """The one line the command line prints for an expected error, or None for a bug (which keeps its traceback).

    Expected: a :class:`~longpeft.errors.LongpeftError`, a failed write, and what libraries raise for bad files or a
    failing environment (corrupt safetensors, a pickle ``torch.load`` refuses, the Hub or network, pydantic, YAML,
    JSON, UTF-8, any other ``OSError``, a missing package). A ``KeyError``, ``TypeError`` or ``AttributeError`` is a
    bug unless raised inside a Hub or HTTP client reading a server's answer; so is any other exception.
    """
    # the Hub client and safetensors are imported when an error comes: `longpeft --help` and plan do without them
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError
    from safetensors import SafetensorError

    text = " ".join(str(exc).split())
    detail = f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__
    if isinstance(exc, LongpeftError):  # longpeft's own messages are written to be read as they are
        return str(exc).strip() or type(exc).__name__
    if (silent_hub := _cause_of_kind(exc, HubTimeoutError)) is not None:
        return str(silent_hub)  # a library turned a silent Hub into its own error
    if isinstance(exc, (KeyError, TypeError, AttributeError)):
        if raised_in(exc, HUB_CLIENT_PACKAGES):
            what = f"KeyError {exc.args[0]!r}" if isinstance(exc, KeyError) and exc.args else detail
            return (
                f"a server gave an answer of an unexpected shape ({what}); check HF_ENDPOINT (a Hub mirror or "
                "proxy?), or give a local folder"
            )
        return None
    if (problem := write_failure(exc)) is not None:
        return f"a write failed: {problem} ({detail}); free space or choose a writable folder, and run again"
    if isinstance(exc, SafetensorError):
        return f"a safetensors file could not be read ({detail}); re-create or download it again"
    if isinstance(exc, pickle.UnpicklingError):
        return f"torch.load: {REFUSED_FOR_SAFETY} ({detail}); use .safetensors files or files longpeft wrote"
    if isinstance(exc, pydantic.ValidationError):
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in exc.errors()[:5])
        return f"invalid settings ({exc.title}): {problems}"
    if isinstance(exc, yaml.YAMLError):
        mark = getattr(exc, "problem_mark", None)
        where = f" at {mark.name}:{mark.line + 1}" if mark is not None else ""
        return f"not valid YAML{where} ({getattr(exc, 'problem', None) or text})"
    if isinstance(exc, json.JSONDecodeError):
        return f"not valid JSON at line {exc.lineno} column {exc.colno} ({exc.msg})"
    if isinstance(exc, HFValidationError):
        return f"not a local folder nor a Hub repo id ({text}); give an existing folder or a Hub id owner/name"
    if isinstance(exc, HfHubHTTPError) or _is_network_error(exc):
        return (
            f"the Hugging Face Hub or the network failed ({detail}); check the network, HF_ENDPOINT and the "
            "repo id, or give a local folder"
        )
    if isinstance(exc, (OSError, ImportError, UnicodeDecodeError)):
        return text or type(exc).__name__
    return None


def _cause_of_kind(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    """The first error of ``kind`` among the errors ``exc`` was raised from or while handling, else None."""
    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:
        if isinstance(error, kind):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


# The HTTP clients huggingface_hub may use (1: httpx, 2: httpx2; requests) -> their errors, no OSError subclasses.
NETWORK_ERRORS = {**dict.fromkeys(("httpx", "httpx2"), ("HTTPError", "InvalidURL")), "requests": ("RequestException",)}


def _is_network_error(exc: BaseException) -> bool:
    """An error of one of the HTTP clients in ``NETWORK_ERRORS`` (read from its classes: none is imported)."""
    return any(kind.__name__ in NETWORK_ERRORS.get(kind.__module__.split(".")[0], ()) for kind in type(exc).__mro__)


UNEXPECTED_EXIT = 1  # an error nobody anticipated (a bug), after its traceback; bad input exits 2


def main(argv: list[str] | None = None) -> int:
    """Run one ``longpeft`` command; returns its exit status: 2 after ``longpeft COMMAND: error: MESSAGE`` for an
    expected error (:func:`error_message`), 130 on an interrupt, 1 after the traceback of any other (a bug).
    ``--debug`` (or ``LONGPEFT_DEBUG=1``) lets every error propagate with its traceback."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"longpeft {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if args.debug or os.environ.get("LONGPEFT_DEBUG"):
            raise
        if (message := error_message(exc)) is None:
            traceback.print_exc()
            print(
                f"longpeft {args.command}: unexpected error ({type(exc).__name__}), a bug in longpeft or a library it "
                "calls rather than a problem with your input: run with --debug and report the traceback",
                file=sys.stderr,
            )
            return UNEXPECTED_EXIT
        print(f"longpeft {args.command}: error: {message}\n(run with --debug for the traceback)", file=sys.stderr)
        return 2
