"""The flags of ``longpeft eval`` tasks: each declared once, with its help, argparse type and default. The parser
declares every registered task's flags with the default None, so a flag given to a task that does not take it is
refused by name; the task's own defaults are filled in after parsing."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class Flag:
    """One flag of ``longpeft eval``; its dest is the flag without dashes, ``-`` read as ``_``."""

    flag: str  # as typed: --lengths
    help: str
    default: Any = None  # the value a task that takes the flag gets when it is not given
    argparse: Mapping[str, Any] = field(default_factory=dict)  # more add_argument keywords (type, nargs, action)
    keyword: str | None = ""  # the option of the task's run it sets ("": its dest); None: the command reads it
    needs: str = ""  # for a flag the task cannot run without, what to give: FILE (the UTF-8 text to score)
    unused: str = ""  # why a task without this flag has no use for it, when it is given alone (the refusal's reason)
    longest: str = ""  # what the flag's largest value bounds (longest prompt), for the STRING shift check

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def option(self) -> str | None:
        """The keyword of the task's run this flag sets, or None."""
        return self.dest if self.keyword == "" else self.keyword


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum`` (argparse names the flag in its error)."""

    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = "int"  # argparse says "invalid int value: 'x'" for non-numbers
    return parse


def count_or_fraction(text: str) -> int | float:
    """An argparse type for --limit: a count (an integer >= 1) or a fraction in (0, 1)."""
    value = float(text)
    if not (0 < value < 1 or (value >= 1 and value.is_integer())):
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 or a fraction in (0, 1), got {text}")
    return int(value) if value >= 1 else value


count_or_fraction.__name__ = "number"  # argparse says "invalid number value: 'x'"
SWITCH, POSITIVE = {"action": "store_true"}, {"type": at_least(1)}

STRING_FLAGS = (
    Flag("--string", "switch STRING on (S = trained length / 3, W = 128)", False, SWITCH, keyword=None),
    Flag("--string-shift", "STRING shift S (default trained length // 3)", None, POSITIVE, keyword=None),
    Flag("--string-window", "STRING local window W (default 128)", None, POSITIVE, keyword=None),
    Flag(
        "--string-trained-length",
        "trained length L for STRING's default S (default: the trained length in the longpeft.json of the "
        "adapter or of the --model folder, the same for a merged model; else max_position_embeddings)",
        None,
        {"type": at_least(2)},
        keyword=None,
    ),
)
LENGTHS = Flag(
    "--lengths",
    "prompt lengths in tokens (default 1024 2048 4096)",
    (1024, 2048, 4096),
    {**POSITIVE, "nargs": "+"},
    longest="longest prompt",
)
DEPTHS = Flag(
    "--depths",
    "needle depths in [0, 1] (default 0 .25 .5 .75 1)",
    (0.0, 0.25, 0.5, 0.75, 1.0),
    {"type": float, "nargs": "+"},
    unused="its prompts have no needle depth",
)
BATCH_SIZE = Flag(
    "--batch-size",
    "prompts per forward, all of one length (default 4; harness: requests per forward, default 1)",
    4,
    POSITIVE,
)
SEED = Flag("--seed", "seed of the probes' random content (default 0; harness: lm-eval's seeds)", 0, {"type": int})
CHAT = Flag(
    "--chat",
    "wrap prompts in the tokenizer's chat template (the answer may appear anywhere in the reply)",
    False,
    SWITCH,
)
SAMPLES = Flag("--samples", "probes per (length, depth) cell (default 10)", 10, POSITIVE, keyword="n_samples")
# Samples per cell, batching and decoding of a probe grid.
GRID_FLAGS = (
    SAMPLES,
    BATCH_SIZE,
    SEED,
    Flag("--max-new-tokens", "continuation budget (default per task, +32 with --chat)", None, POSITIVE),
    CHAT,
    Flag("--save-prompts", "keep every prompt's text in <task>.json (large)", False, SWITCH),
)
PROBE_FLAGS = (*STRING_FLAGS, LENGTHS, *GRID_FLAGS)  # tasks whose prompts have no needle depth
NEEDLE_FLAGS = (*STRING_FLAGS, LENGTHS, DEPTHS, *GRID_FLAGS)  # tasks whose needles sit at a depth
WINDOW = Flag(
    "--window",
    "perplexity: tokens per window (default 4096)",
    4096,
    {"type": at_least(2)},
    longest="perplexity window",
)
PERPLEXITY_FLAGS = (
    *STRING_FLAGS,
    Flag("--text", "perplexity: UTF-8 text file", needs="FILE (the UTF-8 text to score)"),
    WINDOW,
    Flag("--stride", "perplexity: step between windows (default window // 2)", None, POSITIVE),
)
HARNESS_FLAGS = (
    Flag(
        "--tasks",
        "lm-eval tasks, groups or tags, comma-separated (e.g. ruler, longbench, or tasks of --include-path)",
        needs="T1,T2 (lm-eval task or group names, e.g. ruler)",
    ),
    Flag("--include-path", "folder of your own lm-eval task YAML files"),
    Flag("--limit", "at most N documents per task (a number < 1: that fraction)", None, {"type": count_or_fraction}),
    Flag(
        "--max-length",
        "tokens a request may hold (default: the extended length in longpeft.json, else the model config's)",
        None,
        POSITIVE,
    ),
    Flag("--num-fewshot", "few-shot examples per prompt (default: each task's)", None, {"type": at_least(0)}),
    Flag(
        "--metadata",
        """JSON object passed to the tasks, e.g. '{"max_seq_lengths": [8192, 16384]}' for ruler (its tokenizer is """
        "the model's)",
    ),
    Flag("--log-samples", "keep every request and the model's answers in the JSON (large)", False, SWITCH),
    replace(BATCH_SIZE, default=1),
    CHAT,
    SEED,
)
