"""The built-in eval tasks, one record each, registered at import (``longpeft.eval`` imports this module)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from ..errors import ConfigError, OutputFolderError
from ..files import check_writable_folder, write_text_atomically
from ..synth_data.probes import Probe, ProbeBuilder
from . import registry
from .cli import load_model_and_tokenizer, spec_folder
from .flags import HARNESS_FLAGS, NEEDLE_FLAGS, PERPLEXITY_FLAGS, PROBE_FLAGS
from .registry import EvalTask, ProbeTask


@dataclass(frozen=True)
class SuiteTask(EvalTask):
    """Probe tasks (``parts``) run on one grid, each written as it finishes, and their mean score."""

    parts: tuple[str, ...]

    def run(self, model: Any, tokenizer: Any, save: Any, **options: Any) -> dict[str, Any]:
        from .tasks import run_suite  # torch: the CLI reads this module to build its parser

        return run_suite(self.name, self.parts, model, tokenizer, save, **options)


@dataclass(frozen=True)
class PerplexityTask(EvalTask):
    """Sliding-window perplexity of a text file (:func:`longpeft.eval.perplexity.sliding_window_perplexity`)."""

    def run(
        self, model: Any, tokenizer: Any, save: Any, text: str | Path | None = None, **options: Any
    ) -> dict[str, Any]:
        if text is None:
            raise ConfigError("the perplexity task needs a text file (text=... / --text FILE)")
        from .perplexity import perplexity_of_file  # torch: as SuiteTask.run

        return {"task": self.name, **perplexity_of_file(model, tokenizer, text, **options)}


@dataclass(frozen=True)
class HarnessTask(EvalTask):
    """lm-evaluation-harness tasks on the model: a command of its own, which writes lm-eval's results to one file."""

    def command(self, args: argparse.Namespace) -> int:
        """``eval harness``: lm-eval tasks on the model, with its extended length as HFLM's max_length; prints
        lm-eval's table and writes its results to ``--out FILE``."""
        from .harness import extended_length, import_lm_eval, run_harness

        out = Path(args.out)
        if out.is_dir():
            raise OutputFolderError(
                f"--out {out} is a folder; eval harness writes one JSON file: give its name, e.g. "
                f"{out / 'harness.json'}"
            )
        check_writable_folder(out.parent, "--out")
        example = """'{"max_seq_lengths": [8192, 16384]}'"""
        try:
            metadata = json.loads(args.metadata) if args.metadata else {}
        except json.JSONDecodeError as error:
            raise ConfigError(f"--metadata is not JSON ({error.msg}): give an object, e.g. {example}") from None
        if not isinstance(metadata, dict):
            raise ConfigError(f"--metadata must be a JSON object, e.g. {example}")
        tasks = [task.strip() for task in args.tasks.split(",") if task.strip()]
        import_lm_eval()  # before the model loads
        model, tokenizer = load_model_and_tokenizer(args)
        max_length = args.max_length or extended_length(spec_folder(args))
        metadata.setdefault("tokenizer", tokenizer.name_or_path)  # prompts built by a task (RULER) size with it
        read_here = ("tasks", "max_length", "metadata")  # the other flags are run_harness's keywords
        options = {flag.dest: getattr(args, flag.dest) for flag in HARNESS_FLAGS if flag.dest not in read_here}
        results = run_harness(model, tokenizer, tasks, max_length=max_length, metadata=metadata, **options)
        from lm_eval.utils import handle_non_serializable, make_table  # lm-eval's table; JSON for its values' types

        print(make_table(results) + ("\n" + make_table(results, "groups") if results.get("groups") else ""))
        out.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(out, json.dumps(results, indent=2, default=handle_non_serializable) + "\n")
        print(f"max_length {results['longpeft']['max_length'] or 'from the model config'}; wrote {out}")
        return 0


def niah(**counts: int) -> Callable[..., Probe]:
    """:meth:`ProbeBuilder.niah` with other needle counts (``n_keys``, ``n_values``, ``n_queries``) by default."""
    return partial(ProbeBuilder.niah, **counts)


RULER = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "variable_tracking", "common_words")
# ProbeTask(name, help, flags, probe builder, decode budget in tokens)
BUILTIN_TASKS = (
    ProbeTask("passkey", "a pass key in filler text", NEEDLE_FLAGS, ProbeBuilder.passkey, 12),
    ProbeTask("niah_single", "one needle", NEEDLE_FLAGS, ProbeBuilder.niah, 16, aliases=("niah",)),
    ProbeTask("niah_multikey", "one of 4 keys asked", NEEDLE_FLAGS, niah(n_keys=4), 16),
    ProbeTask("niah_multivalue", "the 4 values of one key", NEEDLE_FLAGS, niah(n_values=4), 64),
    ProbeTask("niah_multiquery", "2 of 4 keys asked", NEEDLE_FLAGS, niah(n_keys=4, n_queries=2), 48),
    ProbeTask("variable_tracking", "a chain of assignments", PROBE_FLAGS, ProbeBuilder.variable_tracking, 40),
    ProbeTask("common_words", "the 10 most common words of a list", PROBE_FLAGS, ProbeBuilder.common_words, 96),
    ProbeTask("topic_retrieval", "the first of 5 topics", PROBE_FLAGS, ProbeBuilder.topic_retrieval, 16),
    SuiteTask("ruler", "the six RULER-lite tasks and their mean", NEEDLE_FLAGS, parts=RULER),
    PerplexityTask("perplexity", "sliding-window perplexity of --text", PERPLEXITY_FLAGS),
    HarnessTask("harness", "lm-evaluation-harness tasks (--tasks)", HARNESS_FLAGS),
)
for builtin_task in BUILTIN_TASKS:
    registry.register(builtin_task)
