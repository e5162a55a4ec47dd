"""The response cache of :class:`.llm_client.LLMClient`: what a killed or rerun ``longpeft synth`` replays
instead of paying for a call again.

Two kinds of entries, one JSON file each under ``root/<key[:2]>/<key>.json``, written atomically:

- an answer, under :func:`request_key` of what was sent (endpoint, model, messages, sampling, ``response_format``,
  attempt number): ``{"key", "task", "text", "finish_reason", "usage": {"prompt_tokens", "completion_tokens"},
  "created"}``. An empty answer is never cached;
- an outcome mark (:meth:`ResponseCache.mark`), under :func:`outcome_key` of the request's first attempt keyed
  without ``response_format``: ``{"key", "task", "outcome", "end"}`` where ``outcome`` is ``answered`` (by attempt
  ``end - 1`` of a ``retry_rejected`` round: a rerun replays attempts up to there) or ``rejected`` (for good, after
  attempts ``0 .. end - 1``, with its ``reason`` in :data:`.llm_rejects.REJECT_REASONS` and its ``error`` text: a
  rerun skips it unless ``retry_rejected``, which asks again from attempt ``end``).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Literal

from ..files import write_text_atomically
from .llm_request import LLMRequest


def request_key(base_url: str, model: str, request: LLMRequest, sampling: dict[str, Any], attempt: int) -> str:
    """SHA-256 of the endpoint and the request content: base URL (without trailing slashes), model,
    messages, sampling and extra params, attempt number."""
    payload = {
        "base_url": base_url.rstrip("/"),
        "model": model,
        "messages": request.messages,
        "params": {**sampling, **request.params},
        "attempt": attempt,
    }
    blob = json.dumps(payload, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def outcome_key(first_key: str) -> str:
    """Cache key of a request's outcome mark, from the key of its first attempt."""
    return hashlib.sha256(f"{first_key}/outcome".encode()).hexdigest()


class ResponseCache:
    """One JSON file per answered request (and per outcome mark, :func:`outcome_key`) under
    ``root/<key[:2]>/<key>.json``, written atomically."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root)

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.json"

    def get(self, key: str) -> dict[str, Any] | None:
        path = self._path(key)
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except json.JSONDecodeError:  # never written by us (writes are atomic); treat as missing
            return None

    def put(self, key: str, entry: dict[str, Any]) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(path, json.dumps(entry, ensure_ascii=False))

    def mark(self, key: str, task: str, outcome: Literal["answered", "rejected"], end: int, **why: str) -> None:
        """Write the outcome mark ``key`` (:func:`outcome_key`) of a request of ``task``: ``answered``, or
        ``rejected`` with ``why`` (its ``reason`` and ``error``); ``end``: the attempts a rerun replays."""
        self.put(key, {"key": key, "task": task, "outcome": outcome, **why, "end": end})

    def __len__(self) -> int:
        return sum(1 for _ in self.root.glob("*/*.json")) if self.root.is_dir() else 0
