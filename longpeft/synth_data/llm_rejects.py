"""The rejects file (``rejects.jsonl``): what a synthetic-data run could not use, one JSON line per record key.

Two kinds of records: a request the client rejected for good (``"kind": "request"``, written by
:class:`.llm_client.LLMClient`: the cache ``key`` of its last attempt (of its first for a prompt never sent),
``task``, ``meta``, ``reason`` in :data:`REJECT_REASONS`, ``error``, ``attempts``, every raw answer in ``outputs``,
and the ``mark`` of its outcome in the cache when it is marked rejected), and an item dropped by the quality gates
(``"kind": "item"``, written by :class:`.qa.LLMAnswerer`). A request answered by a later ``retry_rejected`` round
leaves the file (:meth:`RejectsLog.answered`), so the file lists what is still rejected."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..files import write_text_atomically

REJECT_REASONS = ("malformed", "quality", "http_refused", "prompt_too_long", "gave_up")
"""Why a request was rejected for good (``reason`` in the rejects file, ``rejected_reasons`` in the usage):
``malformed`` output or output failing the ``quality`` gates in every attempt, ``http_refused`` by the endpoint
with HTTP 4xx (the error holds the server's reason), a prompt longer than the endpoint's context
(``prompt_too_long``, never sent), ``gave_up`` after transient failures. All but ``gave_up`` are marked in the
cache (a rerun skips them unless ``retry_rejected``). A refusal of structured output that makes ``auto`` fall
back to the prompt is not a rejection."""


class RejectsLog:
    """JSONL of requests that ended without a usable answer (one line per request key), appended to as they fail; a
    request answered by a later ``retry_rejected`` round leaves it (:meth:`answered`), so the file lists what is still
    rejected."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self._seen: set[str] = set()
        if self.path.is_file():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    self._seen.add(json.loads(line)["key"])
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue

    def add(self, record: dict[str, Any]) -> None:
        if record["key"] in self._seen:
            return
        self._seen.add(record["key"])
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")

    def answered(self, mark: str) -> None:
        """Drop the records of the request whose outcome mark is ``mark`` (their ``mark`` field): it is answered."""
        if not self.path.is_file():
            return
        kept, dropped = [], set()
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                kept.append(line)
                continue
            if isinstance(record, dict) and record.get("mark") == mark:
                dropped.add(record.get("key"))
            else:
                kept.append(line)
        if dropped:
            write_text_atomically(self.path, "".join(line + "\n" for line in kept))
            self._seen -= dropped
