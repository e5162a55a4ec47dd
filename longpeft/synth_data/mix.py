"""Mixing the synthetic conversations with plain text (the assistant turn after a fixed request), instructions and
summaries (the answer to a request to summarise their text), each by its ratio of the final dataset, after a length
filter."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from ..config import StrictModel
from ..errors import DataError, DataNotFoundError
from .builders import TokenCounter, exchange

DEFAULT_PLAIN_PROMPT = "Write a passage of text."
DEFAULT_SUMMARY_PROMPT = "Summarize the following text.\n\n{text}"
RECORD_FILES = {".jsonl": "one JSON record per line", ".json": "a JSON list of records, or one record per line"}
Conversation = list[dict[str, str]]  # role/content turns
# The task of each source's rows (in mixing order) -> its path's config key, and the prefix of its other fields.
SOURCES = {
    "plain_text": ("plain_text", "plain"),
    "instruction": ("instructions", "instruction"),
    "summary": ("summaries", "summary"),
}


class MixConfig(StrictModel):
    """Extra data and its share of the final dataset (ratios are fractions of the total); each source keeps the
    records whose conversation has ``*_min_tokens`` to ``*_max_tokens`` tokens."""

    plain_text: str | None = Field(None, description=".jsonl (field 'text') or .txt file, or a folder of them")
    plain_ratio: float = Field(0.0, ge=0, lt=1, description="fraction of the final dataset that is plain text")
    plain_min_tokens: int = Field(0, ge=0)
    plain_max_tokens: int | None = Field(None, ge=1)
    plain_truncate: bool = Field(
        False, description="cut a plain text longer than plain_max_tokens to fit instead of leaving it out"
    )
    plain_prompt: str = Field(DEFAULT_PLAIN_PROMPT, description="user turn before a plain text")
    instructions: str | None = Field(
        None,
        description=".jsonl or .json records with 'messages' or 'conversations' (role/content turns) or "
        "'instruction'/'input'/'output' (Alpaca, LongAlpaca), or a folder of them",
    )
    instruction_ratio: float = Field(0.0, ge=0, lt=1, description="fraction of the final dataset that is instructions")
    instruction_min_tokens: int = Field(0, ge=0)
    instruction_max_tokens: int | None = Field(None, ge=1)
    summaries: str | None = Field(
        None,
        description=".jsonl or .json records holding a text and its summary (summary_text_field, summary_field; "
        "BookSum's 'chapter' and 'summary_text') or a ready conversation ('messages' or 'conversations'), or a folder",
    )
    summary_ratio: float = Field(0.0, ge=0, lt=1, description="fraction of the final dataset that is summaries")
    summary_min_tokens: int = Field(0, ge=0)
    summary_max_tokens: int | None = Field(None, ge=1)
    summary_prompt: str = Field(DEFAULT_SUMMARY_PROMPT, description="the request for a summary ({text}: the text)")
    summary_text_field: str = Field("chapter", description="field of a summarisation record holding the text")
    summary_field: str = Field("summary_text", description="field of a summarisation record holding the summary")

    @model_validator(mode="after")
    def _consistent(self) -> MixConfig:
        if self.plain_ratio + self.instruction_ratio + self.summary_ratio >= 1:
            raise ValueError(
                "plain_ratio + instruction_ratio + summary_ratio must stay below 1 (the rest is synthetic data)"
            )
        for task, (key, prefix) in SOURCES.items():
            ratio, path = self.share(task)[0], getattr(self, key)
            if ratio > 0 and not path:
                raise ValueError(f"{prefix}_ratio > 0 needs mix.{key} (a file or folder; {source_flag(key)} PATH)")
            if path and not ratio:
                raise ValueError(
                    f"mix.{key} is set but its ratio is 0, so the file would not be read: give its share of the final "
                    f"dataset (--{prefix}-ratio), or leave mix.{key} out"
                )
        if self.plain_truncate and self.plain_max_tokens is None:
            raise ValueError("plain_truncate needs plain_max_tokens (the length a plain text is cut to)")
        if "{text}" not in self.summary_prompt:
            raise ValueError("summary_prompt needs {text} (where the text to summarise goes)")
        return self

    def share(self, task: str) -> tuple[float, int, int | None]:
        """``(ratio, min_tokens, max_tokens)`` of the source whose rows are ``task`` (a key of :data:`SOURCES`)."""
        return tuple(getattr(self, f"{SOURCES[task][1]}_{name}") for name in ("ratio", "min_tokens", "max_tokens"))


def source_flag(key: str) -> str:
    """The flag of a source's path: ``--plain-text`` for ``mix.plain_text``."""
    return "--" + key.replace("_", "-")


def source_files(path: str | Path, kinds: dict[str, str], name: str = "source path") -> list[Path]:
    """The files a source path names: itself, or a folder's files (searched recursively) of the ``kinds``
    (``{suffix: what a file of that kind holds}``, used in the error for a named file of another type). ``name``
    says which source the path is in errors (a config key and its flag)."""
    path = Path(path)
    if path.is_dir():
        if not (files := sorted(p for p in path.rglob("*") if p.suffix in kinds)):
            raise DataNotFoundError(f"{name} {path} holds no {'/'.join(kinds)} files")
        return files
    if not path.is_file():
        raise DataNotFoundError(f"{name} {path} does not exist")
    if path.suffix not in kinds:
        use = " or ".join(f"{suffix} ({what})" for suffix, what in kinds.items())
        raise DataError(f"source file {path}: unsupported type {path.suffix or '(no suffix)'!r}; use {use}")
    return [path]


def jsonl_records(path: Path) -> Iterator[tuple[int, Any]]:
    """``(line number, record)`` of a JSON-lines file, blank lines skipped; a bad line (not UTF-8, not JSON) fails as
    ``path:line``."""
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise DataError(f"{path}:{number}: not UTF-8 text ({error.reason} at byte {error.start})") from None
            if line.strip():
                try:
                    yield number, json.loads(line)
                except json.JSONDecodeError as error:
                    raise DataError(f"{path}:{number}: not valid JSON ({error})") from None


def file_records(path: Path) -> Iterator[tuple[str, Any]]:
    """``(where, record)`` of a .jsonl file, or of a .json file holding one JSON list of records or one record per line
    (as ``datasets`` reads both); ``where`` names the line (``path:line``) or the list item (``path[index]``)."""
    if path.suffix == ".json":
        with path.open(encoding="utf-8") as handle:
            first = handle.read(4096).lstrip()[:1]
        if first == "[":
            try:
                records = json.loads(read_text_file(path))
            except json.JSONDecodeError as error:
                raise DataError(f"{path}: not valid JSON ({error})") from None
            yield from ((f"{path}[{index}]", record) for index, record in enumerate(records))
            return
    for number, record in jsonl_records(path):
        yield f"{path}:{number}", record


def read_text_file(path: Path) -> str:
    """A UTF-8 text file's content; other encodings fail naming the file and the byte."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise DataError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from None


def text_records(
    path: str | Path, kinds: dict[str, str], name: str, what: str
) -> Iterator[tuple[Path, int | None, dict[str, Any]]]:
    """``(file, line number, record)`` of every text a source path holds (:func:`source_files`, ``kinds`` .txt and
    .jsonl): a .txt file is one record ``{"text": its content}`` (no line number), a .jsonl line one record, which must
    hold a string field ``text`` (else an error naming the file and line, and ``what`` records they are)."""
    for file in source_files(path, kinds, name):
        if file.suffix == ".txt":
            yield file, None, {"text": read_text_file(file)}
            continue
        for number, record in jsonl_records(file):
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise DataError(f"{file}:{number}: {what} records need a string field 'text'")
            yield file, number, record


def to_messages(record: Any, where: str) -> Conversation:
    """A conversation from ``messages`` or ``conversations`` (role/content turns; the authors of Activation Beacon
    write their files so) or Alpaca-style ``instruction``/``input``/``output`` fields."""
    if isinstance(record, dict):
        for turns in (record.get("messages"), record.get("conversations")):
            if not isinstance(turns, list) or not turns:
                continue
            if not all(
                isinstance(t, dict) and all(isinstance(t.get(k), str) for k in ("role", "content")) for t in turns
            ):
                raise DataError(f"{where}: every turn needs string fields 'role' and 'content'")
            return [{"role": t["role"], "content": t["content"]} for t in turns]
        if isinstance(record.get("instruction"), str) and isinstance(record.get("output"), str):
            prompt = f"{record['instruction']}\n\n{record['input']}" if record.get("input") else record["instruction"]
            return exchange(prompt, record["output"])
    raise DataError(f"{where}: an instruction record needs 'messages', 'conversations', or 'instruction' and 'output'")


def load_instructions(path: str | Path) -> list[Conversation]:
    """Conversations from .jsonl and .json files (see :func:`to_messages`)."""
    return [
        to_messages(record, where)
        for file in source_files(path, RECORD_FILES, "mix.instructions (--instructions)")
        for where, record in file_records(file)
    ]


def load_summaries(config: MixConfig) -> list[Conversation]:
    """Summarisation conversations from the .jsonl and .json files of ``mix.summaries``: a record with string fields
    ``summary_text_field`` and ``summary_field`` becomes ``summary_prompt`` (with its text) answered by its summary; a
    record holding a conversation (``messages`` or ``conversations``) is taken as it is."""
    text_field, summary_field, conversations = config.summary_text_field, config.summary_field, []
    for file in source_files(config.summaries, RECORD_FILES, "mix.summaries (--summaries)"):
        for where, record in file_records(file):
            is_dict = isinstance(record, dict)
            if is_dict and isinstance(record.get(text_field), str) and isinstance(record.get(summary_field), str):
                prompt = config.summary_prompt.replace("{text}", record[text_field])
                conversations.append(exchange(prompt, record[summary_field]))
            elif is_dict and ("messages" in record or "conversations" in record):
                conversations.append(to_messages(record, where))
            else:
                raise DataError(
                    f"{where}: a summarisation record needs string fields {text_field!r} and "
                    f"{summary_field!r} (mix.summary_text_field, mix.summary_field) or 'messages'"
                )
    return conversations


def load_mix_sources(config: MixConfig) -> dict[str, list[Conversation]]:
    """The candidate conversations of every source with a ratio above 0, by task (:data:`SOURCES`). A missing file,
    a bad record or a source without any record fails here, naming the file (and line), so a run can check its
    sources before the long build."""
    sources = {}
    if config.plain_ratio:
        kinds = {".txt": "one text per file", ".jsonl": "a string field 'text' per line"}
        records = text_records(config.plain_text, kinds, "mix.plain_text (--plain-text)", "plain-text")
        sources["plain_text"] = [exchange(config.plain_prompt, record["text"]) for *_, record in records]
    if config.instruction_ratio:
        sources["instruction"] = load_instructions(config.instructions)
    if config.summary_ratio:
        sources["summary"] = load_summaries(config)
    for key in (SOURCES[task][0] for task, conversations in sources.items() if not conversations):
        raise DataError(f"mix.{key} ({source_flag(key)}) {getattr(config, key)} holds no record: nothing to mix in")
    return sources


def cut_to_fit(
    messages: Conversation, tokens: int, max_tokens: int, counter: TokenCounter
) -> tuple[Conversation, int] | None:
    """``messages`` (``tokens`` tokens long) with the last turn's content cut at a token boundary, so that the
    conversation holds at most ``max_tokens`` tokens, and its new length; None when even an empty last turn is longer.
    The cut drops the excess tokens, then a few more where re-tokenising the prefix merges tokens differently."""
    text = messages[-1]["content"]
    offsets = counter.offsets(text)
    keep = len(offsets) - (tokens - max_tokens)
    while keep > 0:
        cut = [*messages[:-1], {**messages[-1], "content": text[: offsets[keep - 1][1]]}]
        tokens = counter.conversation(cut)
        if tokens <= max_tokens:
            return cut, tokens
        keep -= tokens - max_tokens
    return None


def mix(
    synthetic: Sequence[dict[str, Any]],
    counter: TokenCounter,
    config: MixConfig,
    seed: int = 0,
    sources: dict[str, list[Conversation]] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Add plain text, instructions and summaries to ``synthetic`` rows by ratio; returns shuffled rows and counts.
    A source of ratio ``x`` targets ``round(S * x / (1 - sum of the ratios))`` rows (``S`` synthetic rows) and gives
    all it has when fewer pass its length filter; ``sources``: of :func:`load_mix_sources` (None: read them here)."""
    rng = random.Random(f"{seed}/mix")
    rows = list(synthetic)
    stats: dict[str, Any] = {}
    synthetic_share = 1 - config.plain_ratio - config.instruction_ratio - config.summary_ratio
    if synthetic_share < 1 and not rows:
        raise DataError("mixing ratios are relative to the synthetic conversations, and none were built")
    sources = load_mix_sources(config) if sources is None else sources

    def take(task: str, candidates: list[Conversation], wanted: int) -> dict[str, int]:
        """Add up to ``wanted`` rows of ``task`` drawn at random from ``candidates`` that pass its length filter (with
        ``plain_truncate``, a plain text over ``plain_max_tokens`` is cut to fit, :func:`cut_to_fit`, and counted in
        ``truncated``); returns its counts."""
        _, min_tokens, max_tokens = config.share(task)
        truncate = task == "plain_text" and config.plain_truncate
        order = list(range(len(candidates)))
        rng.shuffle(order)
        taken, rejected, truncated = 0, 0, 0
        for index in order:
            if taken == wanted:
                break
            messages = candidates[index]
            tokens = counter.conversation(messages)
            if truncate and max_tokens is not None and tokens > max_tokens:
                if (fitted := cut_to_fit(messages, tokens, max_tokens, counter)) is not None:
                    (messages, tokens), truncated = fitted, truncated + 1
            if tokens < min_tokens or (max_tokens is not None and tokens > max_tokens):
                rejected += 1
                continue
            taken += 1
            row = {"id": f"{task}-{index:06d}", "task": task, "messages": messages, "num_tokens": tokens}
            rows.append({**row, "sources": [f"{task}:{index}"], "meta": "{}"})
        counts = {"wanted": wanted, "taken": taken, "available": len(candidates), "filtered_out": rejected}
        return {**counts, "truncated": truncated} if truncate else counts

    for task in SOURCES:
        if ratio := config.share(task)[0]:
            stats[task] = take(task, sources[task], round(len(synthetic) * ratio / synthetic_share))
    rng.shuffle(rows)
    return rows, stats
