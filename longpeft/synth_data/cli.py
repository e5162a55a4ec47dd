"""`longpeft synth`: build synthetic long-context training data.

Examples::

    # offline, exact QA over generated documents (no LLM, no network)
    longpeft synth --out runs/synth/demo --tokenizer tiny --contexts 4 --min-tokens 4096 --max-tokens 6144

    # the 80K recipe's data (bundled config llama3-80k): GPT-4-class QA over your books, plain text, instructions
    export OPENAI_API_KEY=...
    longpeft synth --config llama3-80k --source books/ --plain-text redpajama.jsonl \\
        --instructions longalpaca.jsonl --out runs/synth/llama3-80k --concurrency 16

    # what that build will ask of the LLM (requests, tokens, time at 16 in flight and a rate limit), sending nothing
    longpeft synth --config llama3-80k --source books/ --plain-text redpajama.jsonl \\
        --instructions longalpaca.jsonl --out runs/synth/llama3-80k --concurrency 16 --plan --tokens-per-minute 2000000

    # a local server (vLLM, SGLang, llama.cpp): its first request and a probe, within 30 s: is response_format enforced
    export OPENAI_API_KEY=local
    longpeft synth --check-endpoint --llm-base-url http://127.0.0.1:8080/v1 --llm-model local --concurrency 1

Rerunning the same command after a kill resumes from ``<out>/llm_cache`` without repeating answered calls; requests
rejected for good (malformed or gated output, an HTTP 4xx, a prompt longer than the endpoint's context) are not asked
again unless ``--retry-rejected``. Every LLM-written item passes the quality gates (``quality:`` in the config;
longpeft/synth_data/quality.py). Flags override the config file; ``--set key.sub=value`` reaches any config field.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..config import apply_overrides, assign, bundled_names, file_or_bundled, read_yaml, validate
from ..errors import ConfigError
from ..files import check_writable_folder
from .registry import TASKS, Flag, task_flags

BUNDLED = Path(__file__).parent / "configs"  # synth configs shipped with longpeft (``--config NAME``)

# The flags, each declared once with the config key it sets (None: the command reads it), in --help order: the
# command's options (the tasks' own flags, their records' ``flags``, after --chunk-tokens), then one table per group.
INT, FLAG = {"type": int}, {"action": "store_true"}
SOURCE_FLAGS = (
    Flag(
        "--out",
        "output folder (train.jsonl, dataset/, stats.json, length_hist.png); required except with --check-endpoint",
    ),
    Flag("--tokenizer", "Hub id or folder of the training tokenizer, or 'tiny' (default: tiny)", "tokenizer"),
    Flag("--answerer", "exact offline QA (default) or an LLM", "answerer", {"choices": ["procedural", "llm"]}),
    Flag(
        "--source",
        "your documents (.txt, .jsonl with 'text', or folders) instead of generated ones",
        options={"nargs": "+", "metavar": "PATH"},
    ),
)
LENGTH_FLAGS = (
    Flag("--contexts", "conversations per task (of --tasks, else the config's tasks)", options=INT),
    Flag("--min-tokens", "shortest conversation (default 65536)", "length.min_tokens", INT),
    Flag("--max-tokens", "longest conversation (default 81920)", "length.max_tokens", INT),
    Flag(
        "--chunk-tokens", "largest chunk a single-detail question is about (default 4096)", "length.chunk_tokens", INT
    ),
)
SEED = Flag("--seed", None, "seed", INT)
RUN_FLAGS = (
    Flag(
        "--set",
        "override any config field, e.g. --set heterogeneous.docs_per_context=6 (repeatable)",
        options={"dest": "overrides", "action": "append", "default": [], "metavar": "KEY=VALUE"},
    ),
    Flag("--no-progress", "no progress bars", options=FLAG),
    Flag("--print-config", "print the resolved config and exit", options=FLAG),
)
LLM_FLAGS = (
    Flag("--llm-base-url", "OpenAI-compatible endpoint (default https://api.openai.com/v1)", "llm.base_url"),
    Flag("--llm-model", "model name (default gpt-4o)", "llm.model"),
    Flag("--api-key-env", "environment variable holding the key (default OPENAI_API_KEY)", "llm.api_key_env"),
    Flag("--concurrency", "requests in flight (default 8; 1 for a one-slot server)", "llm.max_concurrency", INT),
    Flag(
        "--check-endpoint",
        "send the run's first request to the endpoint, as the run sends it, and a probe of structured output; "
        "print the model, latency, whether response_format is enforced, ignored or refused, whether the answer "
        "parses, the context length; exit 0 when usable as configured, 1 when not, 2 when the endpoint does not "
        "answer in time or answers something else",
        options=FLAG,
    ),
    Flag(
        "--check-timeout",
        "deadline of the whole --check-endpoint (default 30; llm.check_timeout)",
        "llm.check_timeout",
        {"type": float, "metavar": "SECONDS"},
    ),
    Flag(
        "--retry-rejected",
        "ask again the requests an earlier run into --out rejected (malformed or gated output, HTTP "
        "4xx, a prompt too long for the endpoint); by default a rerun skips them and says how many",
        options=FLAG,
    ),
)
MIX_FLAGS = (
    Flag("--plain-text", "plain text: .jsonl with 'text', .txt, or a folder", "mix.plain_text"),
    Flag("--plain-ratio", None, "mix.plain_ratio", {"type": float}),
    Flag(
        "--instructions",
        "instruction data: .jsonl/.json with 'messages', 'conversations' or instruction/input/output",
        "mix.instructions",
    ),
    Flag("--instruction-ratio", None, "mix.instruction_ratio", {"type": float}),
    Flag(
        "--summaries",
        "summarisation data: .jsonl/.json with a text and its summary (BookSum's "
        "'chapter' and 'summary_text'; see mix.summary_text_field)",
        "mix.summaries",
    ),
    Flag("--summary-ratio", None, "mix.summary_ratio", {"type": float}),
)
PLAN_FLAGS = (
    Flag(
        "--plan",
        "count the requests and their tokens, estimate the time, "
        "call nothing and write nothing (see longpeft/synth_data/build_plan.py)",
        options=FLAG,
    ),
    Flag(
        "--output-tokens",
        "completion tokens you expect per request (default: llm.max_tokens, an upper bound)",
        options={"type": int, "metavar": "N"},
    ),
    Flag(
        "--output-tokens-per-second",
        "decoding speed of one request (default 50, assumed)",
        options={"type": float, "metavar": "R"},
    ),
    Flag("--tokens-per-minute", "your endpoint's token rate limit", options={"type": float, "metavar": "TPM"}),
    Flag("--requests-per-minute", "your endpoint's request rate limit", options={"type": float, "metavar": "RPM"}),
)
GROUPS = (  # (argument group, its flags), in --help order; None: the command's options
    ("LLM (with --answerer llm; the key is read from the environment only)", LLM_FLAGS),
    ("mixing (ratios are fractions of the final dataset)", MIX_FLAGS),
    (None, RUN_FLAGS),
    ("--plan: the LLM build's requests, tokens and time, before any call", PLAN_FLAGS),
)


def add_synth_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the `synth` options on ``parser`` (a sub-parser of the `longpeft` command)."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description, _, parser.epilog = (__doc__ or "").partition("\n\n")
    bundled = ", ".join(bundled_names(BUNDLED))
    config = Flag(
        "--config",
        "YAML or JSON file with SynthConfig fields (see longpeft.synth_data.SynthConfig), or a bundled config: "
        + bundled,
    )
    tasks = Flag("--tasks", f"comma-separated tasks to build (of {','.join(TASKS)}); the others are off")
    for title, flags in ((None, (config, *SOURCE_FLAGS, tasks, *LENGTH_FLAGS, *task_flags(), SEED)), *GROUPS):
        group = parser if title is None else parser.add_argument_group(title)
        for flag in flags:
            group.add_argument(flag.flag, help=flag.help, **flag.options)


def resolve_config(args: argparse.Namespace):
    """The SynthConfig from ``--config`` plus flags (flags win); invalid or unknown keys raise naming the key."""
    from .pipeline import synth_config_model

    config: dict[str, Any] = {}
    source = "longpeft synth"
    if args.config:
        source = str(file_or_bundled(args.config, BUNDLED, "synth config"))
        config = read_yaml(source) or {}
        if not isinstance(config, dict):
            raise ConfigError(f"{source}: expected a mapping of config fields")
    flags = (*SOURCE_FLAGS, *LENGTH_FLAGS, *task_flags(), SEED, *LLM_FLAGS, *MIX_FLAGS)
    # None: a flag not given (or one of a task registered after the parser was built), not assigned
    given = {flag.key: getattr(args, flag.dest, None) for flag in flags if flag.key is not None}
    if args.source:
        given.update({"source.kind": "files", "source.paths": list(args.source)})
    chosen = [task for task in TASKS if (config.get(task) or {}).get("contexts") != 0]  # the config's tasks
    if args.tasks:
        chosen = [t.strip() for t in args.tasks.split(",") if t.strip()]
        if unknown := sorted(set(chosen) - set(TASKS)):
            raise ConfigError(f"--tasks: unknown task(s) {unknown}; choose from {','.join(TASKS)}")
        given.update({f"{task}.contexts": 0 for task in TASKS if task not in chosen})
    if args.contexts is not None:
        given.update({f"{task}.contexts": args.contexts for task in chosen})
    for key, value in given.items():
        if value is not None:
            assign(config, key, value, "longpeft synth")
    if args.no_progress:
        config["progress"] = False
    apply_overrides(config, args.overrides, source)
    return validate(synth_config_model(), config, source)


def cmd_synth(args: argparse.Namespace) -> int:
    """Run `longpeft synth`; prints a summary and returns 0, or 3 when no conversation was built. Bad input raises
    (:class:`~longpeft.errors.LongpeftError`; an endpoint no retry can fix: :class:`~.llm_request.LLMRunAborted`) for
    the command line's one error boundary (:func:`longpeft.cli.main`, exit status 2)."""
    from .pipeline import synthesize
    from .report import rejection_summary

    config = resolve_config(args)
    if args.print_config:
        print(config.model_dump_json(indent=2))
        return 0
    if args.check_endpoint:
        from .check_endpoint import check_endpoint

        result = check_endpoint(config.llm)
        print(result.report())
        return 0 if result.usable else 1
    if not args.out:
        raise ConfigError("--out: give the output folder (required except with --check-endpoint)")
    if args.plan:  # what the build would ask of the LLM (.build_plan)
        from .build_plan import OUTPUT_TOKENS_PER_SECOND, plan_build

        for flag in PLAN_FLAGS[1:]:  # the expectations and rates
            value = getattr(args, flag.dest)
            if value is not None and value <= 0:
                raise ConfigError(f"{flag.flag} must be positive, got {value:g}")
        plan = plan_build(config, args.out, output_tokens=args.output_tokens)
        speed = args.output_tokens_per_second or OUTPUT_TOKENS_PER_SECOND
        print(plan.report(speed, args.tokens_per_minute, args.requests_per_minute))
        return 0
    if given := [flag.flag for flag in PLAN_FLAGS[1:] if getattr(args, flag.dest) is not None]:
        raise ConfigError(f"{', '.join(given)} {'goes' if len(given) == 1 else 'go'} with --plan")
    check_writable_folder(args.out, "--out")  # a file there, or no write access, fails before any work
    dataset, stats = synthesize(config, args.out, retry_rejected=args.retry_rejected)
    print(f"\nlongpeft synth -> {args.out}  ({len(dataset)} conversations)")
    for task, count in stats["counts"].items():
        tokens = stats["tokens_per_task"].get(task, {})
        print(f"  {task:<14} {count:>6}  tokens {tokens.get('min', 0)}..{tokens.get('max', 0)}")
    if skipped := {t: r for t, r in stats["build"]["skipped"].items() if r}:
        print(f"  skipped: {json.dumps(skipped)}")
    if "llm_usage" in stats:
        total = stats["llm_usage"]["total"]
        print(
            f"  LLM: {total['api_calls']} calls, {total['prompt_tokens']} prompt + {total['completion_tokens']} "
            f"completion tokens, {total['cache_hits']} cached"
        )
    for line in rejection_summary(stats):
        print(f"  {line}")
    if not len(dataset):
        print(
            f"longpeft synth: error: no conversation was built (see {args.out}/rejects.jsonl and the counts above); "
            "check the endpoint, the sources and the length range",
            file=sys.stderr,
        )
        return 3
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``synth`` subcommand."""
    synth = subparsers.add_parser(
        "synth", help="build synthetic long-context training data (LLM or offline procedural)"
    )
    add_synth_arguments(synth)
    synth.set_defaults(func=cmd_synth)
