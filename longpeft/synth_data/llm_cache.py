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

Reading is defensive: :meth:`ResponseCache.answer` and :meth:`ResponseCache.outcome` return an entry only when it
has the shape above (and the key it is filed under); a file that is not JSON, is cut short, or holds anything else
(another program's file, a hand edit) counts in :attr:`ResponseCache.foreign` and reads as absent, so the request
is asked again and its new answer replaces the file.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from ..files import write_text_atomically
from .llm_rejects import REJECT_REASONS
from .llm_request import LLMRequest

_NOT_JSON = object()
MAX_MARKED_ATTEMPTS = 10_000
"""The largest ``end`` an outcome mark may hold: each ``retry_rejected`` round adds ``llm.max_parse_attempts``, so a
larger number was not written by longpeft (and replaying it would take hours of lookups)."""


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


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def is_answer(entry: Any, key: str) -> bool:
    """Whether ``entry`` is an answer as :class:`ResponseCache` writes it under ``key``: a non-empty ``text``, a
    ``finish_reason`` that is a string or null, token counts that are non-negative integers."""
    return (
        isinstance(entry, dict)
        and entry.get("key") == key
        and isinstance(entry.get("text"), str)
        and bool(entry["text"].strip())
        and isinstance(entry.get("finish_reason"), (str, type(None)))
        and isinstance(entry.get("usage"), dict)
        and _count(entry["usage"].get("prompt_tokens"))
        and _count(entry["usage"].get("completion_tokens"))
    )


def is_outcome(entry: Any, key: str) -> bool:
    """Whether ``entry`` is an outcome mark as :meth:`ResponseCache.mark` writes it under ``key``: ``answered``, or
    ``rejected`` with a known ``reason`` and an ``error`` text, after 1 to :data:`MAX_MARKED_ATTEMPTS` attempts
    (0 for a prompt never sent)."""
    if not isinstance(entry, dict) or entry.get("key") != key:
        return False
    end = entry.get("end")
    if not _count(end) or end > MAX_MARKED_ATTEMPTS:
        return False
    if entry.get("outcome") == "answered":
        return end >= 1
    return (
        entry.get("outcome") == "rejected"
        and entry.get("reason") in REJECT_REASONS
        and isinstance(entry.get("error"), str)
    )


class ResponseCache:
    """One JSON file per answered request (and per outcome mark, :func:`outcome_key`) under
    ``root/<key[:2]>/<key>.json``, written atomically.

    Attributes:
        foreign: files read that were not an entry of the expected shape (read as absent), since the cache opened;
        ``foreign_keys``: their keys (a writer replaces them: :meth:`put`).
    """

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root)
        self.foreign = 0
        self.foreign_keys: set[str] = set()

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.json"

    def _entry(self, key: str, valid: Callable[[Any, str], bool]) -> dict[str, Any] | None:
        """The entry filed under ``key`` when ``valid``; ``None`` when there is no file, or (counted in
        :attr:`foreign`) when it is not UTF-8 JSON (cut short, another program's) or not ``valid``."""
        try:
            value = json.loads(self._path(key).read_bytes().decode("utf-8"))
        except FileNotFoundError:
            return None
        except (ValueError, IsADirectoryError):  # JSONDecodeError, UnicodeDecodeError; a folder in its place
            value = _NOT_JSON
        if value is _NOT_JSON or not valid(value, key):
            self.foreign += 1
            self.foreign_keys.add(key)
            return None
        return value

    def answer(self, key: str) -> dict[str, Any] | None:
        """The answer filed under ``key`` (:func:`is_answer`), else ``None`` (none, or a foreign file: ask again)."""
        return self._entry(key, is_answer)

    def outcome(self, key: str) -> dict[str, Any] | None:
        """The outcome mark filed under ``key`` (:func:`is_outcome`), else ``None`` (none, or a foreign file: the
        request is asked as if it had none, its cached answers replayed)."""
        return self._entry(key, is_outcome)

    def put(self, key: str, entry: dict[str, Any]) -> None:
        self.foreign_keys.discard(key)
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(path, json.dumps(entry, ensure_ascii=False))

    def mark(self, key: str, task: str, outcome: Literal["answered", "rejected"], end: int, **why: str) -> None:
        """Write the outcome mark ``key`` (:func:`outcome_key`) of a request of ``task``: ``answered``, or
        ``rejected`` with ``why`` (its ``reason`` and ``error``); ``end``: the attempts a rerun replays."""
        self.put(key, {"key": key, "task": task, "outcome": outcome, **why, "end": end})

    def __len__(self) -> int:
        return sum(1 for _ in self.root.glob("*/*.json")) if self.root.is_dir() else 0
