"""The rejects file (``rejects.jsonl``, docs/synth.md): what a run could not use, and why, still rejected, once. Its
records are grouped by request (``request``: the outcome key, :func:`.llm_cache.outcome_key`), and a group is
replaced each time its request is settled again. A ``"kind": "request"`` record (no usable answer) holds ``key`` (the
cache key of its last attempt; of its first for a prompt never sent), ``task``, ``meta``, ``reason``
(:data:`REJECT_REASONS`), ``error``, ``marked`` (a rerun skips it unless ``retry_rejected``) and ``attempts`` (each
one's ``reason``, ``error`` and raw ``text``); a ``"kind": "item"`` record (a part of an answer a ``check`` dropped)
holds ``attempt``, ``reason``, ``detail`` and the item's fields.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

from ..files import write_text_atomically

# Why a request was rejected for good (docs/synth.md): its last attempt's output, the endpoint's HTTP 4xx, a prompt
# longer than the endpoint's context, transient failures after the retries. All but gave_up are marked in the cache.
FLUSH_EVERY_S = 10.0  # during a batch, a change this long after the last write writes the file
REJECT_REASONS = ("malformed", "truncated", "quality", "http_refused", "prompt_too_long", "gave_up")


def _is_record(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and value.get("kind") in ("request", "item")
        and isinstance(value.get("request"), str)
        and isinstance(value.get("reason"), str)
        and (value["kind"] == "item" or isinstance(value.get("attempts"), list))
    )


class RejectsLog:
    """``rejects.jsonl`` as groups of records, one group per request (see the module docstring), held in memory and
    written whole by :meth:`flush` when they changed: at the end of each batch, and by a change that comes
    :data:`FLUSH_EVERY_S` or more after the last write. A killed run loses the records changed since the last write;
    the cache marks every rejected request, and a rerun rebuilds its request record from the mark."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.groups: dict[str, list[dict[str, Any]]] = {}  # records by request, in file order
        self.touched: set[str] = set()  # requests settled since the log opened
        self.carried: set[str] = set()  # requests kept from an earlier run
        self._flushed_at = time.monotonic()
        self.foreign = 0  # lines of the file that were not records when it opened (left out when it is written)
        content = self.path.read_bytes() if self.path.is_file() else b""
        self._dirty = bool(content) and not content.endswith(b"\n")  # to write: the file is not whole record lines
        for line in content.splitlines():
            if not line.strip():  # not a record, not counted
                self._dirty = True
                continue
            try:
                record = json.loads(line.decode("utf-8"))
            except ValueError:  # not UTF-8, not JSON (a line cut short by a kill)
                record = None
            if _is_record(record):
                self.groups.setdefault(record["request"], []).append(record)
            else:
                self.foreign += 1
                self._dirty = True

    def replace(self, request: str, records: list[dict[str, Any]]) -> None:
        """Make ``records`` (each with ``"request": request``) the group of ``request``; an empty list removes it."""
        self.touched.add(request)
        records = json.loads(json.dumps(records, ensure_ascii=False))  # as read back (tuples as lists), to compare
        if self.groups.get(request, []) != records:
            self._dirty = True
            if records:
                self.groups[request] = records
            else:
                del self.groups[request]
            if time.monotonic() - self._flushed_at > FLUSH_EVERY_S:
                self.flush()

    def keep(self, request: str, fallback: dict[str, Any]) -> None:
        """A request rejected in an earlier run and not asked again: its group stays; without its request record
        (lost with an older or edited file) ``fallback``, that record rebuilt from the cache's mark, joins it."""
        self.carried.add(request)
        group = self.groups.get(request, [])
        if any(record["kind"] == "request" for record in group):
            self.touched.add(request)
        else:
            self.replace(request, [fallback, *group])

    def flush(self) -> None:
        """Write the file (atomically) when the groups changed, or it held lines that are not records."""
        if self._dirty:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomically(self.path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in self.records()))
            self._dirty = False
        self._flushed_at = time.monotonic()

    def finish(self) -> int:
        """End of a build: drop the groups of requests not settled since the log opened, and write the file, which is
        then the build's state (an empty file: nothing rejected). Returns the number of groups dropped."""
        before = len(self.groups)
        self.groups = {request: group for request, group in self.groups.items() if request in self.touched}
        stale = before - len(self.groups)
        self._dirty = self._dirty or bool(stale) or not self.path.is_file()
        self.flush()
        return stale

    def records(self) -> list[dict[str, Any]]:
        return [record for group in self.groups.values() for record in group]

    def counts(self) -> dict[str, Any]:
        """What the file lists, for the summary: ``requests`` rejected per reason (:data:`REJECT_REASONS` order),
        their ``attempts`` per reason, ``items`` dropped per reason, and how many rejected requests were kept from an
        earlier run (``earlier``: not asked again)."""
        return rejects_counts(self.records(), self.carried)


def rejects_counts(records: list[dict[str, Any]], carried: set[str] = frozenset()) -> dict[str, Any]:
    """The counts of :meth:`RejectsLog.counts` for a list of records (the lines of a rejects file)."""
    requests = [r for r in records if r["kind"] == "request"]
    by_reason = Counter(r["reason"] for r in requests)
    attempts = Counter(a.get("reason") for r in requests for a in r["attempts"] if isinstance(a, dict))
    items = Counter(r["reason"] for r in records if r["kind"] == "item")
    ordered = [*REJECT_REASONS, *sorted({str(r) for r in [*by_reason, *attempts]} - set(REJECT_REASONS))]
    return {
        "requests": {reason: by_reason[reason] for reason in ordered if by_reason[reason]},
        "attempts": {reason: attempts[reason] for reason in ordered if attempts[reason]},
        "items": dict(sorted(items.items())),
        "earlier": sum(1 for r in requests if r["request"] in carried),
    }
