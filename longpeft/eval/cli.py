"""``longpeft eval TASK --model PATH [--adapter DIR] [--string] [--lengths ...] --out DIR``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..base_config import model_location
from ..config import DTYPE_NAMES, torch_dtype
from ..errors import ConfigError
from ..files import check_model_source, check_writable_folder, local_adapter_dir
from .flags import STRING_FLAGS
from .registry import ALIASES, TASKS, EvalTask, get_task, task_flags


def load_model_and_tokenizer(args: argparse.Namespace) -> tuple[Any, Any]:
    """The model (base, base + longpeft adapter via ``longpeft.load``, or merged) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    optional = {"attn_implementation": args.attn_implementation, "device_map": args.device}
    kwargs: dict[str, Any] = {key: value for key, value in optional.items() if value}
    kwargs["dtype"] = torch_dtype(args.dtype) if args.dtype != "auto" else "auto"
    kwargs["trust_remote_code"] = args.trust_remote_code  # never run a repository's code unasked (nor prompt for it)
    if args.adapter:
        from ..loading import load, load_tokenizer

        model = load(args.model, args.adapter, **kwargs)
        tokenizer = load_tokenizer(args.adapter, args.model, trust_remote_code=args.trust_remote_code)
    else:
        check_model_source(args.model, "--model")
        try:
            model = AutoModelForCausalLM.from_pretrained(args.model, **kwargs)
        except ValueError as error:
            if "trust_remote_code" not in str(error) or args.trust_remote_code:
                raise
            raise ConfigError(
                f"--model {args.model} ships its own modeling code (auto_map: e.g. a merged HARPE, Activation Beacon "
                "or STRING model); pass --trust-remote-code if you trust that folder"
            ) from None
        tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    return model.eval(), tokenizer


def model_and_adapter(model: str, adapter: str | None) -> tuple[str | None, str | None]:
    """``(--model, --adapter)`` to load: a local adapter folder given as ``--model`` (longpeft.json and no
    config.json) becomes the adapter, on the base its longpeft.json names (``longpeft.load``)."""
    from ..spec import SPEC_FILENAME

    folder = Path(model)
    if not (folder.is_dir() and (folder / SPEC_FILENAME).is_file() and not (folder / "config.json").is_file()):
        return model, adapter
    if adapter:
        raise ConfigError(
            f"--model {model} is a longpeft adapter folder (longpeft.json, no config.json) and "
            "--adapter is given too: pass the base model as --model and the adapter as --adapter"
        )
    print(
        f"longpeft eval: --model {model} is an adapter folder: evaluating it on the base its longpeft.json names, "
        "through longpeft.load (as --adapter)",
        file=sys.stderr,
    )
    return None, model


def spec_folder(args: argparse.Namespace) -> Path:
    """The folder whose longpeft.json describes what runs: the adapter's, else ``--model``'s."""
    return local_adapter_dir(args.adapter) if args.adapter else Path(args.model)


def recorded_lengths(args: argparse.Namespace) -> tuple[int | None, int, str]:
    """For STRING's default trained length L, before the model loads: the ``trained_length`` in the longpeft.json of
    :func:`spec_folder` (a merged model's carries its adapter's), the (adapted) model's ``max_position_embeddings``,
    and where the default L comes from, in words; ``--string-trained-length`` when given."""
    if args.string_trained_length is not None:
        return None, args.string_trained_length, "--string-trained-length"
    from .harness import recorded_spec

    spec = recorded_spec(spec_folder(args))
    if spec is not None:
        where = f"the {'adapter' if args.adapter else 'model'}'s longpeft.json"
        if spec.trained_length:
            return spec.trained_length, spec.max_position_embeddings, where
        return None, spec.max_position_embeddings, "the adapted model's max_position_embeddings"
    from transformers import AutoConfig

    check_model_source(args.model, "--model")
    config = AutoConfig.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    return None, config.max_position_embeddings, "the model's max_position_embeddings"


def string_settings_from_args(args: argparse.Namespace, task: EvalTask) -> dict[str, int] | None:
    """``enable_string`` settings from the flags, checked before the model loads; errors name the flags. S defaults
    to L // 3 (L: ``--string-trained-length``, else :func:`recorded_lengths`) and must be shorter than the longest
    input of ``task`` (its flags with ``longest``)."""
    if not args.string:
        given = [flag.flag for flag in STRING_FLAGS[1:] if getattr(args, flag.dest) is not None]
        if given:
            raise ConfigError(f"{', '.join(given)} needs --string (STRING is off without it)")
        return None
    from ..adapters.string import DEFAULT_LOCAL_WINDOW, string_defaults

    recorded, positions, source = recorded_lengths(args)
    shift, trained = string_defaults(args.string_shift, args.string_trained_length, recorded, positions)
    what_shift = f"the STRING shift {shift} = trained length {trained} // 3 (from {source})"
    if args.string_shift:
        what_shift = f"--string-shift {shift}"
    window = DEFAULT_LOCAL_WINDOW if args.string_window is None else args.string_window
    if window > shift:
        raise ConfigError(
            f"--string-window {window}{'' if args.string_window else ' (default)'} must be <= {what_shift}; "
            "pass a smaller --string-window or a larger --string-shift"
        )
    for flag in (flag for flag in task.flags if flag.longest):
        longest = max(getattr(args, flag.dest), default=0) if flag.argparse.get("nargs") else getattr(args, flag.dest)
        if shift >= longest:
            raise ConfigError(
                f"{what_shift} leaves STRING nothing to do: it changes only keys at distance >= the shift, and the "
                f"{flag.longest} ({flag.flag}) has {longest} tokens; pass a smaller --string-shift or longer prompts"
            )
    return {"shift": shift, "local_window": window, "trained_length": trained}


def check_task_flags(args: argparse.Namespace, task: EvalTask) -> None:
    """Refuse other tasks' flags by name and a missing flag ``task`` needs; fill in the defaults of its own."""
    own = {flag.dest for flag in task.flags}
    given = [flag for flag in task_flags().values() if flag.dest not in own and getattr(args, flag.dest) is not None]
    if given:
        why = (len(given) == 1 and given[0].unused) or f"its own flags are {', '.join(f.flag for f in task.flags)}"
        raise ConfigError(
            f"{', '.join(flag.flag for flag in given)}: not used by eval {args.task} ({why}); remove "
            f"{'it' if len(given) == 1 else 'them'}"
        )
    for flag in task.flags:
        if getattr(args, flag.dest) is None:
            setattr(args, flag.dest, flag.default)
        if flag.needs and not getattr(args, flag.dest):
            raise ConfigError(f"longpeft eval {task.name} needs {flag.flag} {flag.needs}")


def run_eval(args: argparse.Namespace) -> int:
    task = get_task(args.task)
    check_task_flags(args, task)
    args.model = model_location(args.model)  # a built-in name (longpeft:toy-base) -> its packaged folder
    args.model, args.adapter = model_and_adapter(args.model, args.adapter)
    status = task.command(args)
    if status is not None:
        return status
    string = string_settings_from_args(args, task)
    check_writable_folder(Path(args.out), "--out")  # before the model loads and the grid runs
    model, tokenizer = load_model_and_tokenizer(args)
    options = {flag.option: getattr(args, flag.dest) for flag in task.flags if flag.option}
    from .tasks import evaluate

    result = evaluate(task.name, model, tokenizer, string=string, out_dir=args.out, **options)
    summary = {k: v for k, v in result.items() if k not in ("samples", "cells", "tasks")}
    print(json.dumps(summary, indent=2))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``eval`` subcommand."""
    parser = subparsers.add_parser(
        "eval",
        help="score a model on passkey / NIAH / RULER-lite / topic retrieval / perplexity (JSON + PNG), or on "
        "lm-evaluation-harness tasks (harness)",
        description="Evaluate a causal LM (base, base + longpeft adapter, or merged) on long-context probes with "
        "batched greedy generation, optionally with STRING. Writes <task>.json and heatmaps/plots to --out. 'harness' "
        "runs lm-evaluation-harness tasks (--tasks; pip install 'longpeft[eval]') on the same model and writes "
        "lm-eval's results to --out FILE.",
    )
    parser.add_argument(
        "task",
        choices=(*TASKS, *ALIASES),
        help="what to run: "
        + "; ".join(f"{t.name} ({t.help}{''.join(f', alias {a}' for a in t.aliases)})" for t in TASKS.values()),
    )
    parser.add_argument(
        "--model",
        required=True,
        help="base or merged model: Hub id, local folder, or longpeft:toy-base (the packaged demo base)",
    )
    parser.add_argument("--adapter", help="longpeft adapter folder or Hub id (loaded with longpeft.load)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *DTYPE_NAMES],
        help="torch dtype to load in (default auto: the checkpoint's)",
    )
    parser.add_argument("--attn-implementation", help="eager, sdpa or flash_attention_2")
    parser.add_argument("--device", help="device_map for loading, e.g. cpu, cuda, auto")
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the modeling file a merged HARPE, Activation Beacon or STRING model ships "
        "(auto_map); only for folders you trust",
    )
    add_task_flags(parser)
    parser.add_argument("--out", required=True, help="output folder for JSON and PNGs (harness: the JSON file)")
    parser.set_defaults(func=run_eval)


def add_task_flags(parser: argparse.ArgumentParser) -> None:
    """Every registered task's flags (default None: :mod:`.flags`), in groups named by the tasks that take them."""
    takers = {name: [t.name for t in TASKS.values() if name in {f.flag for f in t.flags}] for name in task_flags()}
    groups: dict[str, argparse._ArgumentGroup] = {}
    for flag in task_flags().values():
        others = [name for name in TASKS if name not in takers[flag.flag]]
        title = ", ".join(takers[flag.flag])
        if len(others) <= 2:
            title = f"every task but {', '.join(others)}" if others else "every task"
        group = groups.get(title) or groups.setdefault(title, parser.add_argument_group(f"flags of {title}"))
        group.add_argument(flag.flag, help=flag.help, default=None, **flag.argparse)
