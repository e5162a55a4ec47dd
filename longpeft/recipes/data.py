"""Training data for recipes: conversations (``messages``) or plain text, from files, the Hub, or the
demo generator."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from datasets import Dataset, load_dataset
from transformers import PreTrainedTokenizerBase

from .schema import DataSection

ROLES = {"system", "user", "assistant"}


def load_training_data(data: DataSection, tokenizer: PreTrainedTokenizerBase) -> Dataset:
    """Load the recipe's data as a Dataset with one ``messages`` (or ``text``) column.

    ``data.source``: a .jsonl/.json file or a folder of them, a Hub dataset id, or ``demo``.
    """
    if data.source == "demo":
        from ..synth_data import build_demo_dataset

        dataset = build_demo_dataset(tokenizer, **data.demo)
    else:
        path = Path(data.source)
        if path.is_dir():
            files = sorted(str(p) for p in path.glob("*.json*"))
            if not files:
                raise FileNotFoundError(f"data.source {path} is a folder without .json/.jsonl files")
            dataset = load_dataset("json", data_files=files, split="train")
        elif path.suffix in (".json", ".jsonl"):
            if not path.is_file():
                raise FileNotFoundError(
                    f"data.source {path} does not exist; generate it with `longpeft synth` or point the recipe at your data"
                )
            dataset = load_dataset("json", data_files=str(path), split="train")
        else:
            dataset = load_dataset(data.source, split=data.split)
    field, column, setting = (
        (data.messages_field, "messages", "messages_field")
        if data.format == "messages"
        else (data.text_field, "text", "text_field")
    )
    if field not in dataset.column_names:
        raise ValueError(
            f"data.source {data.source}: no {field!r} column (columns: {dataset.column_names}); set data.{setting}"
        )
    if field != column:
        dataset = dataset.rename_column(field, column)
    dataset = dataset.select_columns([column])
    for index, row in enumerate(dataset.select(range(min(len(dataset), 100)))):
        where = f"{data.source} row {index}"
        if column == "messages":
            check_conversation(row["messages"], where)
        elif not isinstance(row["text"], str) or not row["text"]:
            raise ValueError(f"{where}: text must be a non-empty string")
    if data.max_samples:
        dataset = dataset.select(range(min(data.max_samples, len(dataset))))
    return dataset


def check_conversation(messages: Any, where: str) -> None:
    """Fail clearly on a malformed conversation (list of {role, content} with an assistant turn)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: messages must be a non-empty list of {{role, content}}")
    for turn in messages:
        if not isinstance(turn, dict) or turn.get("role") not in ROLES or not isinstance(turn.get("content"), str):
            raise ValueError(f"{where}: bad turn {str(turn)[:80]!r}; each turn needs role in {sorted(ROLES)} and content")
    if not any(turn["role"] == "assistant" for turn in messages):
        raise ValueError(f"{where}: no assistant turn, so nothing would be trained")


def filter_by_length(
    dataset: Dataset, tokenizer: PreTrainedTokenizerBase, max_length: int, truncate: bool
) -> tuple[Dataset, dict[str, int]]:
    """Drop samples longer than ``max_length`` tokens (or keep them for truncation).

    Returns the dataset and counts ``{"kept", "dropped", "longest"}``.
    """
    if "messages" in dataset.column_names:
        lengths = [
            len(tokenizer.apply_chat_template(m, tokenize=True, return_dict=True)["input_ids"])
            for m in dataset["messages"]
        ]
    else:
        lengths = [len(ids) for ids in tokenizer(list(dataset["text"]))["input_ids"]]
    keep = [i for i, n in enumerate(lengths) if truncate or n <= max_length]
    stats = {"kept": len(keep), "dropped": len(lengths) - len(keep), "longest": max(lengths, default=0)}
    if not keep:
        raise ValueError(
            f"every sample is longer than data.max_length={max_length} tokens (longest {stats['longest']}); "
            "raise max_length or set data.truncate: true"
        )
    return dataset.select(keep), stats
