"""Synthetic long-context training data.

- :mod:`.corpus`: offline procedural documents with recorded facts (:func:`generate_document`,
  :func:`corpus_texts` for training a tokenizer);
- :mod:`.llm_client`: cached, retried, concurrent client for OpenAI-compatible endpoints, with its parts
  :mod:`.llm_request` (settings, request, result), :mod:`.llm_output` (parse errors), :mod:`.llm_http` (one
  call and its retries), :mod:`.llm_cache` (the response cache) and :mod:`.llm_rejects` (the rejects file);
- :mod:`.registry`: the synth tasks, one record each (the built-in ones, :mod:`.builtin`: single-detail,
  multi-detail (homogeneous and heterogeneous) and biography conversations); :mod:`.builders` plans and assembles
  their conversations, and :mod:`.qa` answers them by an LLM or exactly from procedural facts;
- :mod:`.quality`: the quality gates every LLM-written item passes before its row is written;
- :mod:`.mix`, :mod:`.report`, :mod:`.pipeline`: mixing with plain text and instructions, outputs,
  and the whole `longpeft synth` run;
- :mod:`.demo`: the demo's retrieval training set (:func:`build_demo_dataset`);
- :mod:`.retrieval_docs`: retrieval documents (answered passkey / needle probes, recurring spans) for
  ``data.source: retrieval``; :mod:`.probes`: exact-length evaluation probes;
- :mod:`.utk` (Untie the Knots): a data-side long-context training trick on token ids. (PoSE, the
  other one, lives with the methods: ``longpeft.adapters.pose``.)

This package never imports ``longpeft.adapters``.
"""

from __future__ import annotations

import importlib
from typing import Any

from . import builtin  # noqa: F401  (registers the built-in tasks)
from .registry import TASKS, SynthTask, TaskConfig, get_task, register, registered, unregister

# Public name -> submodule. Imported on first use, so that e.g. the LLM client or the corpus can be
# used without loading transformers/datasets/scikit-learn.
_EXPORTS = {
    "LengthConfig": "builders",
    "LongContextBuilder": "builders",
    "TokenCounter": "builders",
    "cluster_documents": "builders",
    "procedural_document": "builders",
    "Document": "corpus",
    "Fact": "corpus",
    "corpus_texts": "corpus",
    "generate_document": "corpus",
    "build_demo_dataset": "demo",
    "LLMClient": "llm_client",
    "LLMConfig": "llm_request",
    "LLMRequest": "llm_request",
    "LLMResult": "llm_request",
    "MalformedOutput": "llm_output",
    "MixConfig": "mix",
    "mix": "mix",
    "SynthConfig": "pipeline",
    "synthesize": "pipeline",
    "LLMAnswerer": "qa",
    "ProceduralAnswerer": "qa",
    "QualityConfig": "quality",
    "QualityGates": "quality",
    "QAJob": "registry",
    "QAPair": "registry",
    "UtkAugmenter": "utk",
    "UtkTokens": "utk",
    "add_utk_tokens": "utk",
}

__all__ = ["TASKS", "SynthTask", "TaskConfig", "get_task", "register", "registered", "unregister"]
__all__ += list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
