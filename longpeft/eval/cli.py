"""``longpeft eval TASK --model PATH [--adapter DIR] [--string] [--lengths ...] --out DIR``."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..files import check_writable_folder
from .names import EVAL_TASKS


def load_model_and_tokenizer(args: argparse.Namespace) -> tuple[Any, Any]:
    """The model (base, base + longpeft adapter via ``longpeft.load``, or merged) and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..files import check_model_source

    kwargs: dict[str, Any] = {
        "dtype": getattr(torch, args.dtype) if args.dtype != "auto" else "auto",
        "trust_remote_code": args.trust_remote_code,  # never run a repository's code unasked (nor prompt for it)
    }
    if args.attn_implementation:
        kwargs["attn_implementation"] = args.attn_implementation
    if args.device:
        kwargs["device_map"] = args.device
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
            raise ConfigError(f"--model {args.model} ships its own modeling code (auto_map: e.g. a merged HARPE, "
                              "Activation Beacon or STRING model); pass --trust-remote-code if you trust that "
                              "folder") from None
        tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    return model.eval(), tokenizer


def _at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum`` (argparse names the flag in its error)."""

    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = "int"  # argparse says "invalid int value: 'x'" for non-numbers
    return parse


STRING_FLAGS = {"string_shift": "--string-shift", "string_window": "--string-window",
                "string_trained_length": "--string-trained-length"}


def default_trained_length(args: argparse.Namespace) -> tuple[int, str]:
    """STRING's default trained length L, and where it comes from: the adapter's ``trained_length``
    (longpeft.json), else the (adapted) model's ``max_position_embeddings``."""
    if args.adapter:
        from ..files import local_adapter_dir
        from ..spec import ContextSpec

        spec = ContextSpec.load(local_adapter_dir(args.adapter))
        if spec.trained_length:
            return spec.trained_length, "the adapter's longpeft.json"
        return spec.max_position_embeddings, "the adapted model's max_position_embeddings"
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    return config.max_position_embeddings, "the model's max_position_embeddings"


def string_settings_from_args(args: argparse.Namespace) -> dict[str, int] | None:
    """``enable_string`` settings from the flags, checked before the model loads; errors name the flags.

    S defaults to L // 3 with L from ``--string-trained-length``, else :func:`default_trained_length`.
    """
    if not args.string:
        given = [flag for name, flag in STRING_FLAGS.items() if getattr(args, name) is not None]
        if given:
            raise ConfigError(f"{', '.join(given)} needs --string (STRING is off without it)")
        return None
    from ..adapters.string import DEFAULT_LOCAL_WINDOW

    if args.string_trained_length is not None:
        trained, source = args.string_trained_length, "--string-trained-length"
    else:
        trained, source = default_trained_length(args)
    shift = args.string_shift or trained // 3
    what_shift = (
        f"--string-shift {shift}" if args.string_shift
        else f"the STRING shift {shift} = trained length {trained} // 3 (from {source})"
    )
    window = DEFAULT_LOCAL_WINDOW if args.string_window is None else args.string_window
    if window > shift:
        raise ConfigError(
            f"--string-window {window}{'' if args.string_window else ' (default)'} must be <= {what_shift}; "
            "pass a smaller --string-window or a larger --string-shift"
        )
    longest, what_longest = ((args.window, "perplexity window (--window)") if args.task == "perplexity"
                             else (max(args.lengths), "longest prompt (--lengths)"))
    if shift >= longest:
        raise ConfigError(
            f"{what_shift} leaves STRING nothing to do: it changes only keys at distance >= the shift, and the "
            f"{what_longest} has {longest} tokens; pass a smaller --string-shift or longer prompts"
        )
    return {"shift": shift, "local_window": window, "trained_length": trained}


# Flags of one kind of task: {dest: (flag, default)}. Their parser default is None, so a flag given to a task it
# does not apply to is refused instead of ignored; check_task_flags fills the defaults of the others.
PROBE_FLAGS = {"lengths": ("--lengths", [1024, 2048, 4096]), "depths": ("--depths", None),
               "samples": ("--samples", 10), "batch_size": ("--batch-size", 4), "seed": ("--seed", 0),
               "max_new_tokens": ("--max-new-tokens", None), "chat": ("--chat", False),
               "save_prompts": ("--save-prompts", False)}
PERPLEXITY_FLAGS = {"text": ("--text", None), "window": ("--window", 4096), "stride": ("--stride", None)}


def check_task_flags(args: argparse.Namespace) -> None:
    """Refuse the flags ``args.task`` does not use (naming them), then fill in the defaults of those it does."""
    from ..synth_data.probes import DEPTH_TASKS

    perplexity = args.task == "perplexity"
    foreign = PROBE_FLAGS if perplexity else PERPLEXITY_FLAGS
    given = [flag for dest, (flag, _) in foreign.items() if getattr(args, dest) not in (None, False)]
    if not perplexity and args.depths is not None and args.task not in (*DEPTH_TASKS, "niah", "ruler"):
        given.append("--depths")
    if given:
        own = ", ".join(flag for flag, _ in (PERPLEXITY_FLAGS if perplexity else PROBE_FLAGS).values())
        why = "its prompts have no needle depth" if given == ["--depths"] else f"its own flags are {own}"
        raise ConfigError(f"{', '.join(given)}: not used by eval {args.task} ({why}); remove "
                          f"{'it' if len(given) == 1 else 'them'}")
    for dest, (_, default) in (PERPLEXITY_FLAGS if perplexity else PROBE_FLAGS).items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)
    if perplexity and not args.text:
        raise ConfigError("longpeft eval perplexity needs --text FILE (the UTF-8 text to score)")


def run_eval(args: argparse.Namespace) -> int:
    check_task_flags(args)
    from ..builtin_models import model_location

    args.model = model_location(args.model)  # a built-in name (longpeft:toy-base) -> its packaged folder
    string = string_settings_from_args(args)
    check_writable_folder(Path(args.out), "--out")  # before the model loads and the grid runs
    model, tokenizer = load_model_and_tokenizer(args)
    options: dict[str, Any] = {}
    if args.task not in ("perplexity",):
        options.update(n_samples=args.samples, seed=args.seed, batch_size=args.batch_size, chat=args.chat,
                       max_new_tokens=args.max_new_tokens, save_prompts=args.save_prompts)
        if args.depths:
            options["depths"] = args.depths
    from .tasks import evaluate

    result = evaluate(
        args.task,
        model,
        tokenizer,
        lengths=args.lengths,
        string=string,
        out_dir=args.out,
        text=args.text,
        window=args.window,
        stride=args.stride,
        **options,
    )
    summary = {k: v for k, v in result.items() if k not in ("samples", "cells", "tasks")}
    print(json.dumps(summary, indent=2))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``eval`` subcommand."""
    parser = subparsers.add_parser(
        "eval",
        help="score a model on passkey / NIAH / RULER-lite / topic retrieval / perplexity (JSON + PNG)",
        description=(
            "Evaluate a causal LM (base, base + longpeft adapter, or merged) on long-context probes with "
            "batched greedy generation, optionally with STRING. Writes <task>.json and heatmaps/plots to --out."
        ),
    )
    parser.add_argument("task", choices=EVAL_TASKS,
                        help="what to run ('ruler' = the six RULER-lite tasks, 'niah' = niah_single)")
    parser.add_argument("--model", required=True, help="base or merged model: Hub id, local folder, or "
                        "longpeft:toy-base (the packaged demo base)")
    parser.add_argument("--adapter", help="longpeft adapter folder or Hub id (loaded with longpeft.load)")
    parser.add_argument("--string", action="store_true", help="switch STRING on (S = trained length / 3, W = 128)")
    parser.add_argument("--string-shift", type=_at_least(1), help="STRING shift S (default trained length // 3)")
    parser.add_argument("--string-window", type=_at_least(1), help="STRING local window W (default 128)")
    parser.add_argument(
        "--string-trained-length", type=_at_least(2),
        help="trained length L for STRING's default S (default: the adapter's trained length, else "
             "max_position_embeddings)",
    )
    parser.add_argument("--lengths", type=_at_least(1), nargs="+",
                        help="prompt lengths in tokens (default 1024 2048 4096)")
    parser.add_argument("--depths", type=float, nargs="+", help="needle depths in [0, 1] (default 0 .25 .5 .75 1)")
    parser.add_argument("--samples", type=_at_least(1), help="probes per (length, depth) cell (default 10)")
    parser.add_argument("--batch-size", type=_at_least(1), help="prompts per forward, all of one length (default 4)")
    parser.add_argument("--seed", type=int, help="seed of the probes' random content (default 0)")
    parser.add_argument("--max-new-tokens", type=_at_least(1),
                        help="continuation budget (default per task, +32 with --chat)")
    parser.add_argument("--chat", action="store_true", default=None, help="wrap prompts in the tokenizer's chat "
                        "template (the answer may appear anywhere in the reply)")
    parser.add_argument("--save-prompts", action="store_true", default=None,
                        help="keep every prompt's text in <task>.json (large)")
    parser.add_argument("--text", help="perplexity: UTF-8 text file")
    parser.add_argument("--window", type=_at_least(2), help="perplexity: tokens per window (default 4096)")
    parser.add_argument("--stride", type=_at_least(1), help="perplexity: step between windows (default window // 2)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="torch dtype to load in (default auto: the checkpoint's)")
    parser.add_argument("--attn-implementation", help="eager, sdpa or flash_attention_2")
    parser.add_argument("--device", help="device_map for loading, e.g. cpu, cuda, auto")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="run the modeling file a merged HARPE, Activation Beacon or STRING model ships "
                             "(auto_map); only for folders you trust")
    parser.add_argument("--out", required=True, help="output folder for JSON and PNGs")
    parser.set_defaults(func=run_eval)
