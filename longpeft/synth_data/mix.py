"""Mixing the synthetic long-context conversations with plain text and instruction data.

The 80K recipe adds plain pretraining text (RedPajama) against forgetting and instruction data
(LongAlpaca) to its ~3.5K synthetic conversations. Here both are added by ratio of the final dataset,
after length filters measured with the training tokenizer and chat template.

Plain text becomes a two-turn conversation (a fixed request, then the text as the assistant turn),
so that assistant-only loss trains on the text itself.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from ..config import StrictModel
from ..errors import DataError, DataNotFoundError
from .builders import TokenCounter

DEFAULT_PLAIN_PROMPT = "Write a passage of text."


class MixConfig(StrictModel):
    """Extra data and its share of the final dataset (ratios are fractions of the total)."""

    plain_text: str | None = Field(None, description=".jsonl (field 'text') or .txt file, or a folder of them")
    plain_ratio: float = Field(0.0, ge=0, lt=1, description="fraction of the final dataset that is plain text")
    plain_min_tokens: int = Field(0, ge=0)
    plain_max_tokens: int | None = Field(None, ge=1)
    plain_prompt: str = Field(DEFAULT_PLAIN_PROMPT, description="user turn before a plain text")
    instructions: str | None = Field(
        None, description=".jsonl with 'messages' or 'instruction'/'input'/'output' (Alpaca, LongAlpaca), or a folder"
    )
    instruction_ratio: float = Field(0.0, ge=0, lt=1, description="fraction of the final dataset that is instructions")
    instruction_min_tokens: int = Field(0, ge=0)
    instruction_max_tokens: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _consistent(self) -> MixConfig:
        if self.plain_ratio + self.instruction_ratio >= 1:
            raise ValueError("plain_ratio + instruction_ratio must stay below 1 (the rest is synthetic data)")
        if self.plain_ratio > 0 and not self.plain_text:
            raise ValueError("plain_ratio > 0 needs mix.plain_text (a file or folder; --plain-text PATH)")
        if self.instruction_ratio > 0 and not self.instructions:
            raise ValueError("instruction_ratio > 0 needs mix.instructions (a file or folder; --instructions PATH)")
        return self


def source_files(path: str | Path, kinds: dict[str, str]) -> list[Path]:
    """The files a source path names: itself, or a folder's files (searched recursively) of the ``kinds``
    (``{suffix: what a file of that kind holds}``, used in the error for a named file of another type)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in kinds)
        if not files:
            raise DataNotFoundError(f"{path} holds no {'/'.join(kinds)} files")
        return files
    if not path.is_file():
        raise DataNotFoundError(f"source path {path} does not exist")
    if path.suffix not in kinds:
        use = " or ".join(f"{suffix} ({what})" for suffix, what in kinds.items())
        raise DataError(f"source file {path}: unsupported type {path.suffix or '(no suffix)'!r}; use {use}")
    return [path]


def jsonl_records(path: Path):
    """``(line number, record)`` of a JSON-lines file, blank lines skipped; a bad line fails as ``path:line``."""
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if line.strip():
                try:
                    yield number, json.loads(line)
                except json.JSONDecodeError as error:
                    raise DataError(f"{path}:{number}: not valid JSON ({error})") from None


def read_text_file(path: Path) -> str:
    """A UTF-8 text file's content; other encodings fail naming the file and the byte."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise DataError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from None


def load_plain_texts(path: str | Path) -> list[str]:
    """Texts from .txt files (one text per file) and .jsonl files (field ``text``)."""
    texts = []
    for file in source_files(path, {".txt": "one text per file", ".jsonl": "a string field 'text' per line"}):
        if file.suffix == ".txt":
            texts.append(read_text_file(file))
            continue
        for number, record in jsonl_records(file):
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise DataError(f"{file}:{number}: plain-text records need a string field 'text'")
            texts.append(record["text"])
    return texts


def to_messages(record: Any, where: str) -> list[dict[str, str]]:
    """A conversation from ``messages`` or Alpaca-style ``instruction``/``input``/``output`` fields."""
    if isinstance(record, dict) and isinstance(record.get("messages"), list):
        return [{"role": m["role"], "content": m["content"]} for m in record["messages"]]
    if (isinstance(record, dict) and isinstance(record.get("instruction"), str)
            and isinstance(record.get("output"), str)):
        prompt = record["instruction"]
        if record.get("input"):
            prompt = f"{prompt}\n\n{record['input']}"
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": record["output"]}]
    raise DataError(f"{where}: an instruction record needs 'messages' or 'instruction' and 'output'")


def load_instructions(path: str | Path) -> list[list[dict[str, str]]]:
    """Conversations from .jsonl files (see :func:`to_messages`)."""
    return [
        to_messages(record, f"{file}:{number}")
        for file in source_files(path, {".jsonl": "one conversation per line"})
        for number, record in jsonl_records(file)
    ]


def _take(
    candidates: list[list[dict[str, str]]],
    wanted: int,
    counter: TokenCounter,
    min_tokens: int,
    max_tokens: int | None,
    task: str,
    rng: random.Random,
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Up to ``wanted`` rows drawn at random from ``candidates`` that pass the length filter."""
    order = list(range(len(candidates)))
    rng.shuffle(order)
    rows, rejected = [], 0
    for index in order:
        if len(rows) == wanted:
            break
        tokens = counter.conversation(candidates[index])
        if tokens < min_tokens or (max_tokens is not None and tokens > max_tokens):
            rejected += 1
            continue
        rows.append({"id": f"{task}-{index:06d}", "task": task, "messages": candidates[index], "num_tokens": tokens,
                     "sources": [f"{task}:{index}"], "meta": "{}"})
    return rows, {"wanted": wanted, "taken": len(rows), "available": len(candidates), "filtered_out": rejected}


def mix(
    synthetic: Sequence[dict[str, Any]],
    counter: TokenCounter,
    config: MixConfig,
    seed: int = 0,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Add plain text and instructions to ``synthetic`` rows by ratio; returns shuffled rows and counts.

    With ``S`` synthetic rows and ratios ``p`` (plain) and ``i`` (instructions) the target is
    ``round(S * p / (1 - p - i))`` plain rows and ``round(S * i / (1 - p - i))`` instruction rows; a
    source with too few rows passing its length filter gives all it has (``taken < wanted``).
    """
    rng = random.Random(f"{seed}/mix")
    rows = list(synthetic)
    stats: dict[str, Any] = {}
    synthetic_share = 1 - config.plain_ratio - config.instruction_ratio
    if (config.plain_ratio or config.instruction_ratio) and not rows:
        raise DataError("mixing ratios are relative to the synthetic conversations, and none were built")
    if config.plain_ratio:
        wanted = round(len(synthetic) * config.plain_ratio / synthetic_share)
        texts = load_plain_texts(config.plain_text)
        candidates = [[{"role": "user", "content": config.plain_prompt}, {"role": "assistant", "content": t}]
                      for t in texts]
        taken, stats["plain_text"] = _take(candidates, wanted, counter, config.plain_min_tokens,
                                           config.plain_max_tokens, "plain_text", rng)
        rows += taken
    if config.instruction_ratio:
        wanted = round(len(synthetic) * config.instruction_ratio / synthetic_share)
        candidates = load_instructions(config.instructions)
        taken, stats["instruction"] = _take(candidates, wanted, counter, config.instruction_min_tokens,
                                            config.instruction_max_tokens, "instruction", rng)
        rows += taken
    rng.shuffle(rows)
    return rows, stats
