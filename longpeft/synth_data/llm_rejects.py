"""The rejects file (``rejects.jsonl``): what a synthetic-data run could not use, and why.

The file lists what is still rejected, once: its records are grouped by the request they belong to (``request``:
the request's outcome key, :func:`.llm_cache.outcome_key`, which names its outcome mark in the cache), and each time
a request is settled again (answered, rejected, or skipped as rejected in an earlier run) its group is replaced by
what this settling found. Two kinds of records:

- ``"kind": "request"``: a request that got no usable answer (written by :class:`.llm_client.LLMClient`): ``key``
  (the cache key of its last attempt; of its first for a prompt never sent), ``task``, ``meta``, ``reason`` in
  :data:`REJECT_REASONS` (the last attempt's), ``error``, ``marked`` (a rerun skips it unless ``retry_rejected``)
  and ``attempts``: every attempt, replayed ones included, with its own ``reason``, ``error`` and the raw ``text``
  when there was an answer;
- ``"kind": "item"``: a part of an answer that a ``check`` function dropped (an item failing the quality gates,
  :mod:`.quality`): ``attempt``, ``reason``, ``detail`` and the item's fields. Items of every attempt are listed,
  whether the request was answered by a later attempt or rejected.

A request answered now leaves no request record; a request asked again replaces its old records; a request an earlier
run rejected and this run skipped keeps them (:meth:`RejectsLog.keep`). :meth:`RejectsLog.finish`, at the end of a
build, drops the groups of requests the build no longer holds, so the file is that build's state, and
:meth:`RejectsLog.counts` is what its summary reports. Lines that are not records of this shape (cut short by a
kill, edited, another program's) are counted in :attr:`RejectsLog.foreign` and left out when the file is rewritten.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

from ..files import write_text_atomically

REJECT_REASONS = ("malformed", "truncated", "quality", "http_refused", "prompt_too_long", "gave_up")
"""Why a request was rejected for good (``reason`` in the rejects file, ``rejected_reasons`` in the usage):
``malformed`` output, output cut off at ``llm.max_tokens`` (``truncated``, finish_reason ``length``) or output failing
the ``quality`` gates, in the last of its attempts (each attempt's own reason is in the record); ``http_refused`` by
the endpoint with HTTP 4xx (the error holds the server's reason), a prompt longer than the endpoint's context
(``prompt_too_long``, never sent), ``gave_up`` after transient failures. All but ``gave_up`` are marked in the
cache (a rerun skips them unless ``retry_rejected``). A refusal of structured output that makes ``auto`` fall
back to the prompt is not a rejection."""

KINDS = ("request", "item")


def _is_record(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and value.get("kind") in KINDS
        and isinstance(value.get("request"), str)
        and isinstance(value.get("reason"), str)
        and (value["kind"] == "item" or isinstance(value.get("attempts"), list))
    )


def _plain(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``records`` as JSON reads them back (tuples become lists), so a group found again compares equal."""
    return json.loads(json.dumps(records, ensure_ascii=False))


class RejectsLog:
    """``rejects.jsonl`` as groups of records, one group per request (see the module docstring).

    Writes are immediate: a new group is appended, a changed one rewrites the file atomically, an unchanged one
    writes nothing (a rerun from the cache rewrites nothing).

    Attributes:
        groups: records by request, in file order.
        touched: requests settled since the log opened; ``carried``: those kept from an earlier run.
        foreign: lines of the file that are not records (left out at the next rewrite); ``unread``: how many there
        were when the log opened.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.groups: dict[str, list[dict[str, Any]]] = {}
        self.touched: set[str] = set()
        self.carried: set[str] = set()
        self.foreign = 0
        self._tidy = True  # the file is only whole record lines (else the next write rewrites it)
        if self.path.is_file():
            content = self.path.read_bytes()
            self._tidy = not content or content.endswith(b"\n")
            for line in content.splitlines():
                if not line.strip():
                    self._tidy = False
                    continue
                try:
                    record = json.loads(line.decode("utf-8"))
                except ValueError:  # not UTF-8, not JSON (a line cut short by a kill)
                    record = None
                if _is_record(record):
                    self.groups.setdefault(record["request"], []).append(record)
                else:
                    self.foreign += 1
        self.unread = self.foreign

    def replace(self, request: str, records: list[dict[str, Any]]) -> None:
        """Make ``records`` (each with ``"request": request``) the group of ``request``; an empty list removes it."""
        self.touched.add(request)
        records = _plain(records)
        old = self.groups.get(request, [])
        if old == records:
            return
        if records:
            self.groups[request] = records
        else:
            del self.groups[request]
        if old or self.foreign or not self._tidy:
            self._rewrite()
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8") as handle:
                handle.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))

    def keep(self, request: str, fallback: dict[str, Any]) -> None:
        """A request rejected in an earlier run and not asked again: its group stays; without its request record
        (lost with an older or edited file) ``fallback``, that record rebuilt from the cache's mark, joins it."""
        self.carried.add(request)
        group = self.groups.get(request, [])
        if any(record["kind"] == "request" for record in group):
            self.touched.add(request)
        else:
            self.replace(request, [fallback, *group])

    def finish(self) -> int:
        """End of a build: drop the groups of requests not settled since the log opened (and foreign lines); the
        file is then the build's state (an empty file: nothing rejected). Returns the number of groups dropped."""
        stale = [request for request in self.groups if request not in self.touched]
        for request in stale:
            del self.groups[request]
        if stale or self.foreign or not self._tidy or not self.path.is_file():
            self._rewrite()
        return len(stale)

    def records(self) -> list[dict[str, Any]]:
        return [record for group in self.groups.values() for record in group]

    def counts(self) -> dict[str, Any]:
        """What the file lists, for the summary: ``requests`` rejected per reason (:data:`REJECT_REASONS` order),
        their ``attempts`` per reason, ``items`` dropped per reason, and how many rejected requests were kept from an
        earlier run (``earlier``: not asked again)."""
        return rejects_counts(self.records(), self.carried)

    def _rewrite(self) -> None:
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in self.records())
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(self.path, text)
        self.foreign, self._tidy = 0, True


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
