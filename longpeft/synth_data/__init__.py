"""Synthetic long-context training data: the procedural corpus, the synth tasks (:mod:`.registry`) with their
builders, answerers and quality gates, mixing and the whole `longpeft synth` run (:mod:`.pipeline`), the demo's and
the retrieval training sets, evaluation probes, and UtK. This package never imports ``longpeft.adapters``."""

from __future__ import annotations

import importlib
from typing import Any

from . import builtin  # noqa: F401  (registers the built-in tasks)
from .registry import TASKS, SynthTask, TaskConfig, get_task, register, registered, unregister

# Submodule -> the public names it serves, imported on first use, so that e.g. the LLM client or the corpus can be
# used without loading transformers/datasets/scikit-learn.
_SUBMODULES = {
    "builders": "LengthConfig LongContextBuilder TokenCounter cluster_documents procedural_document",
    "corpus": "Document Fact corpus_texts generate_document",
    "demo": "build_demo_dataset",
    "llm_client": "LLMClient",
    "llm_request": "LLMConfig LLMRequest LLMResult",
    "answer_schema": "MalformedOutput",
    "mix": "MixConfig mix",
    "pipeline": "SynthConfig synthesize",
    "qa": "LLMAnswerer ProceduralAnswerer",
    "quality": "QualityConfig QualityGates",
    "registry": "QAJob QAPair",
    "utk": "UtkAugmenter UtkTokens add_utk_tokens",
}
_EXPORTS = {name: module for module, names in _SUBMODULES.items() for name in names.split()}

__all__ = ["TASKS", "SynthTask", "TaskConfig", "get_task", "register", "registered", "unregister", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
