"""The response cache of :class:`.llm_client.LLMClient`, what a killed or rerun ``longpeft synth`` replays instead of
paying for a call again: one JSON file per entry under ``root/<key[:2]>/<key>.json``, written atomically. An answer,
under :func:`request_key` of what was sent: ``{"key", "task", "text", "finish_reason", "usage": {"prompt_tokens",
"completion_tokens"}, "created"}`` (an empty answer is never cached). An outcome mark, under :func:`outcome_key`:
``{"key", "task", "outcome", "end"}``, ``outcome`` being ``answered`` (by attempt ``end - 1`` of a
``retry_rejected`` round) or ``rejected`` (after attempts ``0 .. end - 1``, with its ``reason`` in
:data:`.llm_rejects.REJECT_REASONS` and its ``error`` text). A file of any other shape (not JSON, cut short, another
program's) reads as absent and is counted (:attr:`ResponseCache.foreign`): its request is asked again and the file
replaced.
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
from .llm_request import LLMRequest, is_count

MAX_MARKED_ATTEMPTS = 10_000  # the largest ``end`` of a mark longpeft writes (each retry round adds a few)


def request_key(base_url: str, model: str, request: LLMRequest, sampling: dict[str, Any], attempt: int) -> str:
    """SHA-256 of the endpoint and the request: base URL (without trailing slashes), model, messages, sampling and
    extra params (``response_format`` included), attempt number."""
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
    """Cache key of a request's outcome mark, from the key of its first attempt without ``response_format``."""
    return hashlib.sha256(f"{first_key}/outcome".encode()).hexdigest()


def is_answer(entry: Any, key: str) -> bool:
    """Whether ``entry`` is an answer as :class:`ResponseCache` writes it under ``key``: a non-empty ``text``, a
    ``finish_reason`` that is a string or null, token counts."""
    return (
        isinstance(entry, dict)
        and entry.get("key") == key
        and isinstance(entry.get("text"), str)
        and bool(entry["text"].strip())
        and isinstance(entry.get("finish_reason"), (str, type(None)))
        and isinstance(entry.get("usage"), dict)
        and is_count(entry["usage"].get("prompt_tokens"))
        and is_count(entry["usage"].get("completion_tokens"))
    )


def is_outcome(entry: Any, key: str) -> bool:
    """Whether ``entry`` is an outcome mark as :meth:`ResponseCache.mark` writes it under ``key``: ``answered``, or
    ``rejected`` with a known ``reason`` and an ``error`` text, after 1 to :data:`MAX_MARKED_ATTEMPTS` attempts
    (0 for a prompt never sent)."""
    if not isinstance(entry, dict) or entry.get("key") != key:
        return False
    if not is_count(end := entry.get("end")) or end > MAX_MARKED_ATTEMPTS:
        return False
    if entry.get("outcome") == "answered":
        return end >= 1
    return (
        entry.get("outcome") == "rejected"
        and entry.get("reason") in REJECT_REASONS
        and isinstance(entry.get("error"), str)
    )


class ResponseCache:
    """The cache under ``root`` (see the module docstring). ``foreign``: files read since it opened that were not
    entries of their expected shape; ``foreign_keys``: their keys, until :meth:`put` replaces them."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root)
        self.foreign = 0
        self.foreign_keys: set[str] = set()

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.json"

    def _entry(self, key: str, valid: Callable[[Any, str], bool]) -> dict[str, Any] | None:
        """The entry filed under ``key`` when ``valid``, else ``None`` (no file, or a foreign one: counted)."""
        try:
            value = json.loads(self._path(key).read_bytes().decode("utf-8"))
        except FileNotFoundError:
            return None
        except (ValueError, IsADirectoryError):  # JSONDecodeError, UnicodeDecodeError; a folder in its place
            value = None  # valid for no kind of entry
        if not valid(value, key):
            self.foreign += 1
            self.foreign_keys.add(key)
            return None
        return value

    def answer(self, key: str) -> dict[str, Any] | None:
        """The answer filed under ``key`` (:func:`is_answer`), else ``None``."""
        return self._entry(key, is_answer)

    def outcome(self, key: str) -> dict[str, Any] | None:
        """The outcome mark filed under ``key`` (:func:`is_outcome`), else ``None``."""
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
