"""The built-in eval tasks, one :func:`~.registry.register` line each (``longpeft.eval`` imports this module)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from functools import partial
from typing import Any

from ..errors import ConfigError
from ..synth_data.probes import ProbeBuilder
from .cli import run_harness_eval
from .flags import HARNESS_FLAGS, NEEDLE_FLAGS, PERPLEXITY_FLAGS, PROBE_FLAGS
from .registry import EvalTask, ProbeTask, register

RULER_TASKS = (
    "niah_single",
    "niah_multikey",
    "niah_multivalue",
    "niah_multiquery",
    "variable_tracking",
    "common_words",
)


@dataclass(frozen=True, kw_only=True)
class SuiteTask(EvalTask):
    """Probe tasks (``parts``) run on one grid, each written as it finishes, and their mean score."""

    parts: tuple[str, ...]

    def run(self, model: Any, tokenizer: Any, save: Any, **options: Any) -> dict[str, Any]:
        from .tasks import run_suite  # torch: the CLI reads this module to build its parser

        return run_suite(self.name, self.parts, model, tokenizer, save, **options)


@dataclass(frozen=True, kw_only=True)
class PerplexityTask(EvalTask):
    """Sliding-window perplexity of a text file (:func:`longpeft.eval.perplexity.sliding_window_perplexity`)."""

    def run(self, model: Any, tokenizer: Any, save: Any, text: Any = None, **options: Any) -> dict[str, Any]:
        if text is None:
            raise ConfigError("the perplexity task needs a text file (text=... / --text FILE)")
        from .perplexity import perplexity_of_file  # torch: as SuiteTask.run

        return {"task": self.name, **perplexity_of_file(model, tokenizer, text, **options)}


@dataclass(frozen=True, kw_only=True)
class HarnessTask(EvalTask):
    """lm-evaluation-harness tasks on the model: a command of its own (it writes lm-eval's results to one file)."""

    def command(self, args: argparse.Namespace) -> int:
        return run_harness_eval(args)


def niah(**counts: int) -> Any:
    """:meth:`ProbeBuilder.niah` with other needle counts by default."""
    return partial(ProbeBuilder.niah, **counts)


register(
    ProbeTask(
        name="passkey",
        help="a pass key in filler text",
        flags=NEEDLE_FLAGS,
        build=ProbeBuilder.passkey,
        max_new_tokens=12,
    )
)
register(
    ProbeTask(
        name="niah_single",
        aliases=("niah",),
        help="one needle (alias niah)",
        flags=NEEDLE_FLAGS,
        build=ProbeBuilder.niah,
        max_new_tokens=16,
    )
)
register(
    ProbeTask(
        name="niah_multikey",
        help="one needle among 4 keys",
        flags=NEEDLE_FLAGS,
        build=niah(n_keys=4),
        max_new_tokens=16,
    )
)
register(
    ProbeTask(
        name="niah_multivalue",
        help="4 values of one key",
        flags=NEEDLE_FLAGS,
        build=niah(n_values=4),
        max_new_tokens=64,
    )
)
register(
    ProbeTask(
        name="niah_multiquery",
        help="2 of 4 keys asked",
        flags=NEEDLE_FLAGS,
        build=niah(n_keys=4, n_queries=2),
        max_new_tokens=48,
    )
)
register(
    ProbeTask(
        name="variable_tracking",
        help="the variables a chain of assignments gives one value",
        flags=PROBE_FLAGS,
        build=ProbeBuilder.variable_tracking,
        max_new_tokens=40,
    )
)
register(
    ProbeTask(
        name="common_words",
        help="the 10 most frequent words of a list",
        flags=PROBE_FLAGS,
        build=ProbeBuilder.common_words,
        max_new_tokens=96,
    )
)
register(
    ProbeTask(
        name="topic_retrieval",
        help="the first of several conversation topics",
        flags=PROBE_FLAGS,
        build=ProbeBuilder.topic_retrieval,
        max_new_tokens=16,
    )
)
register(
    SuiteTask(name="ruler", help="the six RULER-lite tasks and their mean", flags=NEEDLE_FLAGS, parts=RULER_TASKS)
)
register(PerplexityTask(name="perplexity", help="sliding-window perplexity of --text", flags=PERPLEXITY_FLAGS))
register(HarnessTask(name="harness", help="lm-evaluation-harness tasks (--tasks)", flags=HARNESS_FLAGS))
