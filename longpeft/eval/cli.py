"""``longpeft eval TASK --model PATH [--adapter DIR] [--string] [--lengths ...] --out DIR``."""

from __future__ import annotations

import argparse
import json
import sys
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
            raise ConfigError(
                f"--model {args.model} ships its own modeling code (auto_map: e.g. a merged HARPE, "
                "Activation Beacon or STRING model); pass --trust-remote-code if you trust that "
                "folder"
            ) from None
        tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    return model.eval(), tokenizer


def model_and_adapter(model: str, adapter: str | None) -> tuple[str | None, str | None]:
    """``(--model, --adapter)`` to load. A local adapter folder given as ``--model`` (longpeft.json and no
    config.json: not a loadable model by itself) becomes the adapter, on the base its longpeft.json names, so its
    RoPE change and methods are applied (``longpeft.load``) instead of silently missing."""
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


def _at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum`` (argparse names the flag in its error)."""

    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = "int"  # argparse says "invalid int value: 'x'" for non-numbers
    return parse


def _limit(text: str) -> int | float:
    """An argparse type for --limit: a count (an integer >= 1) or a fraction in (0, 1)."""
    value = float(text)
    if not (0 < value < 1 or (value >= 1 and value.is_integer())):
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 or a fraction in (0, 1), got {text}")
    return int(value) if value >= 1 else value


_limit.__name__ = "number"  # argparse says "invalid number value: 'x'"

STRING_FLAGS = {
    "string_shift": "--string-shift",
    "string_window": "--string-window",
    "string_trained_length": "--string-trained-length",
}


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

    from ..files import check_model_source

    check_model_source(args.model, "--model")
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
        f"--string-shift {shift}"
        if args.string_shift
        else f"the STRING shift {shift} = trained length {trained} // 3 (from {source})"
    )
    window = DEFAULT_LOCAL_WINDOW if args.string_window is None else args.string_window
    if window > shift:
        raise ConfigError(
            f"--string-window {window}{'' if args.string_window else ' (default)'} must be <= {what_shift}; "
            "pass a smaller --string-window or a larger --string-shift"
        )
    longest, what_longest = (
        (args.window, "perplexity window (--window)")
        if args.task == "perplexity"
        else (max(args.lengths), "longest prompt (--lengths)")
    )
    if shift >= longest:
        raise ConfigError(
            f"{what_shift} leaves STRING nothing to do: it changes only keys at distance >= the shift, and the "
            f"{what_longest} has {longest} tokens; pass a smaller --string-shift or longer prompts"
        )
    return {"shift": shift, "local_window": window, "trained_length": trained}


# Flags of one kind of task: {dest: (flag, default)}. Their parser default is None, so a flag given to a task it
# does not apply to is refused instead of ignored; check_task_flags fills the defaults of the others.
PROBE_FLAGS = {
    "lengths": ("--lengths", [1024, 2048, 4096]),
    "depths": ("--depths", None),
    "samples": ("--samples", 10),
    "batch_size": ("--batch-size", 4),
    "seed": ("--seed", 0),
    "max_new_tokens": ("--max-new-tokens", None),
    "chat": ("--chat", False),
    "save_prompts": ("--save-prompts", False),
}
PERPLEXITY_FLAGS = {"text": ("--text", None), "window": ("--window", 4096), "stride": ("--stride", None)}
HARNESS_FLAGS = {
    "tasks": ("--tasks", None),
    "include_path": ("--include-path", None),
    "limit": ("--limit", None),
    "max_length": ("--max-length", None),
    "num_fewshot": ("--num-fewshot", None),
    "metadata": ("--metadata", None),
    "log_samples": ("--log-samples", False),
    "batch_size": ("--batch-size", 1),
    "chat": ("--chat", False),
    "seed": ("--seed", 0),
}
FLAGS_OF_TASK = {"perplexity": PERPLEXITY_FLAGS, "harness": HARNESS_FLAGS}  # any other task: PROBE_FLAGS


def check_task_flags(args: argparse.Namespace) -> None:
    """Refuse the flags ``args.task`` does not use (naming them), then fill in the defaults of those it does."""
    from ..synth_data.probes import DEPTH_TASKS

    own = FLAGS_OF_TASK.get(args.task, PROBE_FLAGS)
    foreign = {
        dest: flag
        for group in (PROBE_FLAGS, PERPLEXITY_FLAGS, HARNESS_FLAGS)
        if group is not own
        for dest, (flag, _) in group.items()
        if dest not in own
    }
    given = [flag for dest, flag in foreign.items() if getattr(args, dest) not in (None, False)]
    if own is PROBE_FLAGS and args.depths is not None and args.task not in (*DEPTH_TASKS, "niah", "ruler"):
        given.append("--depths")
    if given:
        own_flags = ", ".join(flag for flag, _ in own.values())
        why = "its prompts have no needle depth" if given == ["--depths"] else f"its own flags are {own_flags}"
        raise ConfigError(
            f"{', '.join(given)}: not used by eval {args.task} ({why}); remove {'it' if len(given) == 1 else 'them'}"
        )
    for dest, (_, default) in own.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)
    if args.task == "perplexity" and not args.text:
        raise ConfigError("longpeft eval perplexity needs --text FILE (the UTF-8 text to score)")
    if args.task == "harness" and not args.tasks:
        raise ConfigError("longpeft eval harness needs --tasks T1,T2 (lm-eval task or group names, e.g. ruler)")


def run_harness_eval(args: argparse.Namespace) -> int:
    """``eval harness``: lm-eval tasks on the model (base + adapter through ``longpeft.load``), with the adapter's
    extended context as HFLM's max_length; prints lm-eval's table and writes its results to ``--out FILE``."""
    from ..errors import OutputFolderError
    from ..files import local_adapter_dir
    from .harness import extended_length, import_lm_eval, results_table, run_harness, write_results

    out = Path(args.out)
    if out.is_dir():
        raise OutputFolderError(
            f"--out {out} is a folder; eval harness writes one JSON file: give its name, e.g. {out / 'harness.json'}"
        )
    check_writable_folder(out.parent, "--out")
    try:
        metadata = json.loads(args.metadata) if args.metadata else {}
    except json.JSONDecodeError as error:
        raise ConfigError(
            f"--metadata is not JSON ({error.msg}): give an object, e.g. "
            """'{"max_seq_lengths": [8192, 16384]}'"""
        ) from None
    if not isinstance(metadata, dict):
        raise ConfigError("--metadata must be a JSON object, e.g. '{\"max_seq_lengths\": [8192, 16384]}'")
    tasks = [task.strip() for task in args.tasks.split(",") if task.strip()]
    import_lm_eval()  # before the model loads
    model, tokenizer = load_model_and_tokenizer(args)
    max_length = args.max_length or extended_length(local_adapter_dir(args.adapter) if args.adapter else args.model)
    metadata.setdefault("tokenizer", tokenizer.name_or_path)  # tasks that build their own prompts (RULER) size them
    results = run_harness(
        model,
        tokenizer,
        tasks,
        max_length=max_length,
        include_path=args.include_path,
        limit=args.limit,
        batch_size=args.batch_size,
        num_fewshot=args.num_fewshot,
        chat=args.chat,
        metadata=metadata,
        log_samples=args.log_samples,
        seed=args.seed,
    )
    print(results_table(results))
    length = results["longpeft"]["max_length"] or "from the model config"
    print(f"max_length {length}; wrote {write_results(results, out)}")
    return 0


def run_eval(args: argparse.Namespace) -> int:
    check_task_flags(args)
    from ..builtin_models import model_location

    args.model = model_location(args.model)  # a built-in name (longpeft:toy-base) -> its packaged folder
    args.model, args.adapter = model_and_adapter(args.model, args.adapter)
    if args.task == "harness":
        return run_harness_eval(args)
    string = string_settings_from_args(args)
    check_writable_folder(Path(args.out), "--out")  # before the model loads and the grid runs
    model, tokenizer = load_model_and_tokenizer(args)
    options: dict[str, Any] = {}
    if args.task not in ("perplexity",):
        options.update(
            n_samples=args.samples,
            seed=args.seed,
            batch_size=args.batch_size,
            chat=args.chat,
            max_new_tokens=args.max_new_tokens,
            save_prompts=args.save_prompts,
        )
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
        help="score a model on passkey / NIAH / RULER-lite / topic retrieval / perplexity (JSON + PNG), or on "
        "lm-evaluation-harness tasks (harness)",
        description=(
            "Evaluate a causal LM (base, base + longpeft adapter, or merged) on long-context probes with "
            "batched greedy generation, optionally with STRING. Writes <task>.json and heatmaps/plots to --out. "
            "'harness' runs lm-evaluation-harness tasks (--tasks; pip install 'longpeft[eval]') on the same model "
            "and writes lm-eval's results to --out FILE."
        ),
    )
    parser.add_argument(
        "task",
        choices=(*EVAL_TASKS, "harness"),
        help="what to run ('ruler' = the six RULER-lite tasks, 'niah' = niah_single, 'harness' = "
        "lm-evaluation-harness tasks)",
    )
    parser.add_argument(
        "--model",
        required=True,
        help="base or merged model: Hub id, local folder, or longpeft:toy-base (the packaged demo base)",
    )
    parser.add_argument("--adapter", help="longpeft adapter folder or Hub id (loaded with longpeft.load)")
    parser.add_argument("--string", action="store_true", help="switch STRING on (S = trained length / 3, W = 128)")
    parser.add_argument("--string-shift", type=_at_least(1), help="STRING shift S (default trained length // 3)")
    parser.add_argument("--string-window", type=_at_least(1), help="STRING local window W (default 128)")
    parser.add_argument(
        "--string-trained-length",
        type=_at_least(2),
        help="trained length L for STRING's default S (default: the adapter's trained length, else "
        "max_position_embeddings)",
    )
    parser.add_argument(
        "--lengths", type=_at_least(1), nargs="+", help="prompt lengths in tokens (default 1024 2048 4096)"
    )
    parser.add_argument("--depths", type=float, nargs="+", help="needle depths in [0, 1] (default 0 .25 .5 .75 1)")
    parser.add_argument("--samples", type=_at_least(1), help="probes per (length, depth) cell (default 10)")
    parser.add_argument(
        "--batch-size",
        type=_at_least(1),
        help="prompts per forward, all of one length (default 4; harness: requests per forward, default 1)",
    )
    parser.add_argument(
        "--seed", type=int, help="seed of the probes' random content (default 0; harness: lm-eval's seeds)"
    )
    parser.add_argument(
        "--max-new-tokens", type=_at_least(1), help="continuation budget (default per task, +32 with --chat)"
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        default=None,
        help="wrap prompts in the tokenizer's chat template (the answer may appear anywhere in the reply)",
    )
    parser.add_argument(
        "--save-prompts", action="store_true", default=None, help="keep every prompt's text in <task>.json (large)"
    )
    parser.add_argument("--text", help="perplexity: UTF-8 text file")
    parser.add_argument("--window", type=_at_least(2), help="perplexity: tokens per window (default 4096)")
    parser.add_argument("--stride", type=_at_least(1), help="perplexity: step between windows (default window // 2)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
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
    harness = parser.add_argument_group("harness (lm-evaluation-harness; also --batch-size, --chat, --seed)")
    harness.add_argument(
        "--tasks",
        help="lm-eval tasks, groups or tags, comma-separated (e.g. ruler, longbench, or tasks of --include-path)",
    )
    harness.add_argument("--include-path", help="folder of your own lm-eval task YAML files")
    harness.add_argument("--limit", type=_limit, help="at most N documents per task (a number < 1: that fraction)")
    harness.add_argument(
        "--max-length",
        type=_at_least(1),
        help="tokens a request may hold (default: the extended length in longpeft.json, else the model config's)",
    )
    harness.add_argument(
        "--num-fewshot", type=_at_least(0), help="few-shot examples per prompt (default: each task's)"
    )
    harness.add_argument(
        "--metadata",
        help="JSON object passed to the tasks, e.g. "
        """'{"max_seq_lengths": [8192, 16384]}' for ruler (its tokenizer is the model's)""",
    )
    harness.add_argument(
        "--log-samples",
        action="store_true",
        default=None,
        help="keep every request and the model's answers in the JSON (large)",
    )
    parser.add_argument("--out", required=True, help="output folder for JSON and PNGs (harness: the JSON file)")
    parser.set_defaults(func=run_eval)
