"""`longpeft synth`: build synthetic long-context training data.

Examples::

    # offline, exact QA over generated documents (no LLM, no network)
    longpeft synth --out runs/synth/demo --tokenizer tiny --contexts 4 --min-tokens 4096 --max-tokens 6144

    # the 80K recipe's data (bundled config llama3-80k): GPT-4-class QA over your books, mixed with plain text
    # and instructions as in the paper
    export OPENAI_API_KEY=...
    longpeft synth --config llama3-80k --source books/ --plain-text redpajama.jsonl \\
        --instructions longalpaca.jsonl --out runs/synth/llama3-80k --concurrency 16

    # what that build will ask of the LLM (requests, tokens, time at 16 in flight and a rate limit), sending nothing
    longpeft synth --config llama3-80k --source books/ --plain-text redpajama.jsonl \\
        --instructions longalpaca.jsonl --out runs/synth/llama3-80k --concurrency 16 --plan --tokens-per-minute 2000000

    # a local server (vLLM, SGLang, llama.cpp): its first request and a probe, within 30 s: is response_format enforced
    export OPENAI_API_KEY=local
    longpeft synth --check-endpoint --llm-base-url http://127.0.0.1:8080/v1 --llm-model local --concurrency 1

Rerunning the same command after a kill resumes from ``<out>/llm_cache`` without repeating answered
calls; requests rejected for good (malformed or gated output, an HTTP 4xx, a prompt longer than the endpoint's
context) are not asked again unless ``--retry-rejected``. Every LLM-written item passes the quality gates
(``quality:`` in the config; longpeft/synth_data/quality.py). Flags override the config file;
``--set key.sub=value`` reaches any config field.
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
from .qa import SYNTH_TASKS


def add_synth_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the `synth` options on ``parser`` (a sub-parser of the `longpeft` command)."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description, _, parser.epilog = (__doc__ or "").partition("\n\n")
    parser.add_argument(
        "--config",
        help="YAML or JSON file with SynthConfig fields (see "
        "longpeft.synth_data.SynthConfig), or a bundled config: "
        f"{', '.join(bundled_names(BUNDLED))}",
    )
    parser.add_argument(
        "--out",
        help="output folder (train.jsonl, dataset/, stats.json, length_hist.png); required "
        "except with --check-endpoint",
    )
    parser.add_argument("--tokenizer", help="Hub id or folder of the training tokenizer, or 'tiny' (default: tiny)")
    parser.add_argument("--answerer", choices=["procedural", "llm"], help="exact offline QA (default) or an LLM")
    parser.add_argument(
        "--source",
        nargs="+",
        metavar="PATH",
        help="your documents (.txt, .jsonl with 'text', or folders) instead of generated ones",
    )
    parser.add_argument(
        "--tasks", help=f"comma-separated tasks to build (of {','.join(SYNTH_TASKS)}); the others are off"
    )
    parser.add_argument(
        "--contexts", type=int, help="conversations per task (the tasks of --tasks, else those the config leaves on)"
    )
    parser.add_argument("--min-tokens", type=int, help="shortest conversation (default 65536)")
    parser.add_argument("--max-tokens", type=int, help="longest conversation (default 81920)")
    parser.add_argument(
        "--chunk-tokens", type=int, help="largest chunk a single-detail question is about (default 4096)"
    )
    parser.add_argument("--questions-per-chunk", type=int, help="single-detail questions per chunk (default 3)")
    parser.add_argument("--seed", type=int)
    llm = parser.add_argument_group("LLM (with --answerer llm; the key is read from the environment only)")
    llm.add_argument("--llm-base-url", help="OpenAI-compatible endpoint (default https://api.openai.com/v1)")
    llm.add_argument("--llm-model", help="model name (default gpt-4o)")
    llm.add_argument("--api-key-env", help="environment variable holding the key (default OPENAI_API_KEY)")
    llm.add_argument(
        "--concurrency",
        type=int,
        help="requests in flight (default 8; 1 for a one-slot server such as llama.cpp's default)",
    )
    llm.add_argument(
        "--check-endpoint",
        action="store_true",
        help="send the run's first request to the endpoint, as the run sends it, and a probe of structured output; "
        "print the model, latency, whether response_format is enforced, ignored or refused, whether the answer "
        "parses, the context length; exit 0 when usable as configured, 1 when not, 2 when the endpoint does not "
        "answer in time or answers something else",
    )
    llm.add_argument(
        "--check-timeout",
        type=float,
        metavar="SECONDS",
        help="deadline of the whole --check-endpoint (default 30; llm.check_timeout)",
    )
    llm.add_argument(
        "--retry-rejected",
        action="store_true",
        help="ask again the requests an earlier run into --out rejected (malformed or gated output, HTTP "
        "4xx, a prompt too long for the endpoint); by default a rerun skips them and says how many",
    )
    extra = parser.add_argument_group("mixing (ratios are fractions of the final dataset)")
    extra.add_argument("--plain-text", help="plain text: .jsonl with 'text', .txt, or a folder")
    extra.add_argument("--plain-ratio", type=float)
    extra.add_argument(
        "--instructions",
        help="instruction data: .jsonl/.json with 'messages', 'conversations' or instruction/input/output",
    )
    extra.add_argument("--instruction-ratio", type=float)
    extra.add_argument(
        "--summaries",
        help="summarisation data: .jsonl/.json with a text and its summary (BookSum's "
        "'chapter' and 'summary_text'; see mix.summary_text_field)",
    )
    extra.add_argument("--summary-ratio", type=float)
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any config field, e.g. --set heterogeneous.docs_per_context=6 (repeatable)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    plan = parser.add_argument_group("--plan: the LLM build's requests, tokens and time, before any call")
    plan.add_argument(
        "--plan",
        action="store_true",
        help="count the requests and their tokens, estimate the time, "
        "call nothing and write nothing (see longpeft/synth_data/build_plan.py)",
    )
    plan.add_argument(
        "--output-tokens",
        type=int,
        metavar="N",
        help="completion tokens you expect per request (default: llm.max_tokens, an upper bound)",
    )
    plan.add_argument(
        "--output-tokens-per-second",
        type=float,
        metavar="R",
        help="decoding speed of one request (default 50, assumed)",
    )
    plan.add_argument("--tokens-per-minute", type=float, metavar="TPM", help="your endpoint's token rate limit")
    plan.add_argument("--requests-per-minute", type=float, metavar="RPM", help="your endpoint's request rate limit")


BUNDLED = Path(__file__).parent / "configs"  # synth configs shipped with longpeft (``--config NAME``)


def _assign(config: dict[str, Any], dotted: str, value: Any) -> None:
    assign(config, dotted, value, "longpeft synth")


def resolve_config(args: argparse.Namespace):
    """The SynthConfig from ``--config`` plus flags (flags win); invalid or unknown keys raise naming the key."""
    from .pipeline import SynthConfig

    config: dict[str, Any] = {}
    source = "longpeft synth"
    if args.config:
        source = str(file_or_bundled(args.config, BUNDLED, "synth config"))
        config = read_yaml(source) or {}
        if not isinstance(config, dict):
            raise ConfigError(f"{source}: expected a mapping of config fields")
    flags = {
        "tokenizer": args.tokenizer,
        "answerer": args.answerer,
        "seed": args.seed,
        "length.min_tokens": args.min_tokens,
        "length.max_tokens": args.max_tokens,
        "length.chunk_tokens": args.chunk_tokens,
        "single_detail.questions_per_chunk": args.questions_per_chunk,
        "llm.base_url": args.llm_base_url,
        "llm.model": args.llm_model,
        "llm.api_key_env": args.api_key_env,
        "llm.max_concurrency": args.concurrency,
        "llm.check_timeout": args.check_timeout,
        "mix.plain_text": args.plain_text,
        "mix.plain_ratio": args.plain_ratio,
        "mix.instructions": args.instructions,
        "mix.instruction_ratio": args.instruction_ratio,
        "mix.summaries": args.summaries,
        "mix.summary_ratio": args.summary_ratio,
    }
    for key, value in flags.items():
        if value is not None:
            _assign(config, key, value)
    if args.source:
        _assign(config, "source.kind", "files")
        _assign(config, "source.paths", list(args.source))
    chosen = [task for task in SYNTH_TASKS if (config.get(task) or {}).get("contexts") != 0]  # the config's tasks
    if args.tasks:
        chosen = [t.strip() for t in args.tasks.split(",") if t.strip()]
        unknown = sorted(set(chosen) - set(SYNTH_TASKS))
        if unknown:
            raise ConfigError(f"--tasks: unknown task(s) {unknown}; choose from {','.join(SYNTH_TASKS)}")
        for task in SYNTH_TASKS:
            if task not in chosen:
                _assign(config, f"{task}.contexts", 0)
    if args.contexts is not None:
        for task in chosen:
            _assign(config, f"{task}.contexts", args.contexts)
    if args.no_progress:
        config["progress"] = False
    apply_overrides(config, args.overrides, source)
    return validate(SynthConfig, config, source)


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
    if args.plan:
        return print_build_plan(config, args)
    rates = ("--output-tokens", "--output-tokens-per-second", "--tokens-per-minute", "--requests-per-minute")
    given = [flag for flag in rates if getattr(args, flag[2:].replace("-", "_")) is not None]
    if given:
        raise ConfigError(f"{', '.join(given)} {'goes' if len(given) == 1 else 'go'} with --plan")
    check_writable_folder(args.out, "--out")  # a file there, or no write access, fails before any work
    dataset, stats = synthesize(config, args.out, retry_rejected=args.retry_rejected)
    print(f"\nlongpeft synth -> {args.out}  ({len(dataset)} conversations)")
    for task, count in stats["counts"].items():
        tokens = stats["tokens_per_task"].get(task, {})
        print(f"  {task:<14} {count:>6}  tokens {tokens.get('min', 0)}..{tokens.get('max', 0)}")
    skipped = {t: r for t, r in stats["build"]["skipped"].items() if r}
    if skipped:
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


def print_build_plan(config, args: argparse.Namespace) -> int:
    """``synth --plan``: print what the build would ask of the LLM (:mod:`.build_plan`)."""
    from .build_plan import OUTPUT_TOKENS_PER_SECOND, plan_build

    for flag in ("output_tokens", "output_tokens_per_second", "tokens_per_minute", "requests_per_minute"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be positive, got {value:g}")
    plan = plan_build(config, args.out, output_tokens=args.output_tokens)
    print(
        plan.report(
            args.output_tokens_per_second or OUTPUT_TOKENS_PER_SECOND, args.tokens_per_minute, args.requests_per_minute
        )
    )
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``synth`` subcommand."""
    synth = subparsers.add_parser(
        "synth", help="build synthetic long-context training data (LLM or offline procedural)"
    )
    add_synth_arguments(synth)
    synth.set_defaults(func=cmd_synth)
