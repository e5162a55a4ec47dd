"""The built-in eval tasks, one :func:`~.registry.register` line each (``longpeft.eval`` imports this module)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..synth_data.probes import Probe, ProbeBuilder
from .cli import run_harness_eval
from .flags import HARNESS_FLAGS, NEEDLE_FLAGS, PERPLEXITY_FLAGS, PROBE_FLAGS
from .registry import EvalTask, ProbeTask, register


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
        return run_harness_eval(args)


def niah(**counts: int) -> Callable[..., Probe]:
    """:meth:`ProbeBuilder.niah` with other needle counts (``n_keys``, ``n_values``, ``n_queries``) by default."""
    return partial(ProbeBuilder.niah, **counts)


# ProbeTask(name, help, flags, probe builder, decode budget in tokens)
register(ProbeTask("passkey", "a pass key in filler text", NEEDLE_FLAGS, ProbeBuilder.passkey, 12))
register(ProbeTask("niah_single", "one needle", NEEDLE_FLAGS, ProbeBuilder.niah, 16, aliases=("niah",)))
register(ProbeTask("niah_multikey", "one of 4 keys asked", NEEDLE_FLAGS, niah(n_keys=4), 16))
register(ProbeTask("niah_multivalue", "the 4 values of one key", NEEDLE_FLAGS, niah(n_values=4), 64))
register(ProbeTask("niah_multiquery", "2 of 4 keys asked", NEEDLE_FLAGS, niah(n_keys=4, n_queries=2), 48))
register(ProbeTask("variable_tracking", "a chain of assignments", PROBE_FLAGS, ProbeBuilder.variable_tracking, 40))
register(ProbeTask("common_words", "the 10 most common words of a list", PROBE_FLAGS, ProbeBuilder.common_words, 96))
register(ProbeTask("topic_retrieval", "the first of 5 topics", PROBE_FLAGS, ProbeBuilder.topic_retrieval, 16))
RULER = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "variable_tracking", "common_words")
register(SuiteTask("ruler", "the six RULER-lite tasks and their mean", NEEDLE_FLAGS, parts=RULER))
register(PerplexityTask("perplexity", "sliding-window perplexity of --text", PERPLEXITY_FLAGS))
register(HarnessTask("harness", "lm-evaluation-harness tasks (--tasks)", HARNESS_FLAGS))
