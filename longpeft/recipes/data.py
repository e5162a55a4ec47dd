"""Training data for recipes: conversations (``messages``) or plain text, from files, the Hub, or the
demo generator, tokenized and kept, cut or dropped by the recipe's length rules (:func:`build_dataset`)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
from datasets import Dataset, load_dataset
from datasets.exceptions import DatasetGenerationError
from datasets.fingerprint import Hasher
from transformers import PreTrainedTokenizerBase

from ..errors import ConfigError, DataError, DataNotFoundError
from ..files import hub_preflight, is_local
from ..synth_data import build_demo_dataset
from ..synth_data.mix import read_text_file
from ..synth_data.report import STATS_FILE, TRAIN_FILE
from ..synth_data.retrieval_docs import build_retrieval_dataset
from ..synth_data.utk import add_utk_tokens, chunk_labels_needed, pack_documents, utk_overhead
from .schema import DataSection, Recipe, UtkSection

ROLES = {"system", "user", "assistant"}
GENERATED_SOURCES = ("demo", "retrieval")  # built with the tokenizer when the recipe runs
DATA_SUFFIXES = (".json", ".jsonl", ".txt")


def load_training_data(data: DataSection, tokenizer: PreTrainedTokenizerBase) -> Dataset:
    """Load the recipe's data as a Dataset with one ``messages`` (or ``text``) column, every row checked: from
    .jsonl/.json files, .txt files (one document each), a Hub dataset, ``demo`` or ``retrieval``."""
    if data.source == "demo":
        dataset = build_demo_dataset(tokenizer, **data.demo.model_dump(exclude_none=True))
    elif data.source == "retrieval":
        options = data.retrieval.model_dump() if data.retrieval is not None else {}
        dataset = build_retrieval_dataset(tokenizer, **options)
    else:
        dataset = _load_source(data)
    column, setting = data.format, f"{data.format}_field"  # the column is named as the format
    field = getattr(data, setting)
    if field not in dataset.column_names:
        raise DataError(
            f"data.source {data.source}: no {field!r} column (columns: {dataset.column_names}); set data.{setting}"
        )
    if field != column:
        dataset = dataset.rename_column(field, column)
    dataset = dataset.select_columns([column])
    if data.max_samples:
        dataset = dataset.select(range(min(data.max_samples, len(dataset))))
    if len(dataset) == 0:
        raise DataError(f"data.source {data.source} holds no rows")
    index = 0
    try:
        for chunk in dataset.iter(batch_size=256):  # bounded memory: long-context rows are large
            for value in chunk[column]:  # fail clearly on the first malformed row
                if column == "messages":
                    check_conversation(value, f"{data.source} row {index}")
                elif not isinstance(value, str) or not value:
                    raise DataError(f"{data.source} row {index}: text must be a non-empty string")
                index += 1
    except UnicodeDecodeError as error:
        raise DataError(f"data.source {data.source}: not UTF-8 text after row {index} ({error.reason})") from None
    return dataset


def synth_output_file(source: str) -> Path | None:
    """The training file (``train.jsonl``) of a ``longpeft synth`` output folder; None for any other source."""
    folder = Path(source)
    if folder.is_dir() and (folder / TRAIN_FILE).is_file() and (folder / STATS_FILE).is_file():
        return folder / TRAIN_FILE
    return None


def check_data_source(data: DataSection) -> None:
    """``data.source`` before anything loads: a generated set, a local path, which must exist (never tried as a Hub
    id), or a Hub dataset id, which must answer within ``LONGPEFT_HUB_TIMEOUT``. Raises DataNotFoundError, or
    ModelSourceError / HubTimeoutError for a Hub dataset."""
    if data.source in GENERATED_SOURCES or Path(data.source).exists():
        return
    if is_local(data.source) or Path(data.source).suffix in DATA_SUFFIXES:
        raise DataNotFoundError(
            f"data.source {data.source} does not exist; generate it with `longpeft synth` or "
            "point the recipe at your data (a Hub dataset is named owner/name)"
        )
    hub_preflight(data.source, "data.source", repo_type="dataset")


def _is_empty(path: Path) -> bool:
    """No content but white space (reads at most the first 64 KiB: data files can be gigabytes)."""
    with path.open("rb") as handle:
        head = handle.read(1 << 16)
    return not head.strip() and path.stat().st_size <= len(head)


def _load_source(data: DataSection) -> Dataset:
    """A local file or folder (a ``longpeft synth`` output folder: its train.jsonl), else a Hub dataset id."""
    path = synth_output_file(data.source) or Path(data.source)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in DATA_SUFFIXES)
        if not files:
            raise DataNotFoundError(f"data.source {path} is a folder without .json/.jsonl/.txt files")
    elif path.is_file():
        files = [path]
    else:
        check_data_source(data)  # refuses a local path that does not exist
        return load_dataset(data.source, split=data.split)
    empty = [str(p) for p in files if _is_empty(p)]
    if empty:
        raise DataError(f"data.source: {', '.join(empty)} {'is' if len(empty) == 1 else 'are'} empty")
    if any(p.suffix not in DATA_SUFFIXES for p in files):
        raise DataError(f"data.source {path}: expected .jsonl, .json or .txt files")
    if {p.suffix for p in files} == {".txt"}:
        if data.format != "text":
            raise ConfigError(f"data.source {path}: .txt files are plain text; set data.format: text")
        return Dataset.from_dict({data.text_field: [read_text_file(p) for p in files]})  # the files checked above
    if any(p.suffix == ".txt" for p in files):
        raise DataError(f"data.source {path} mixes .txt and JSON files; keep one kind per source")
    try:
        return load_dataset("json", data_files=[str(p) for p in files], split="train")
    except (DatasetGenerationError, ValueError) as exc:
        cause = exc.__cause__ or exc
        raise DataError(f"data.source {path}: not valid JSON lines ({str(cause).splitlines()[0][:200]})") from None


def check_conversation(messages: Any, where: str) -> None:
    """Fail clearly on a malformed conversation (list of {role, content} with an assistant turn)."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: messages must be a non-empty list of {{role, content}}")
    for turn in messages:
        if not isinstance(turn, dict) or turn.get("role") not in ROLES or not isinstance(turn.get("content"), str):
            raise DataError(
                f"{where}: bad turn {str(turn)[:80]!r}; each turn needs role in {sorted(ROLES)} and content"
            )
    if not any(turn["role"] == "assistant" for turn in messages):
        raise DataError(f"{where}: no assistant turn, so nothing would be trained")


def assistant_spans(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]]
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns (end-of-turn token included).

    Works with any chat template: assistant turn ``i`` spans from the end of ``messages[:i]`` rendered with the
    generation prompt (for a first turn, from where its content starts) to the end of ``messages[:i + 1]``, trailing
    white space excluded. Refuses a template whose rendering of a prefix is not a prefix of the whole rendering.
    """
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, turn in enumerate(messages):
        if turn["role"] != "assistant":
            continue
        through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        prompt = (
            tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
            if i
            else _text_before_content(tokenizer, turn)
        )
        if not (full.startswith(through) and through.startswith(prompt)):
            raise ConfigError(
                "the tokenizer's chat template renders a conversation's first turns differently from the whole "
                "conversation, so assistant turns cannot be located; set train.assistant_only_loss: false "
                "(loss on every token) or use a template whose turns render independently"
            )
        spans.append((len(prompt), len(through.rstrip())))  # the template's separator after the turn is not trained
    return full, spans


_CONTENT_MARK = "\u2063longpeft-content\u2063"  # text no template adds: where a turn's content starts


def _text_before_content(tokenizer: PreTrainedTokenizerBase, turn: dict[str, Any]) -> str:
    """What the template renders before the content of a conversation's first turn (BOS, a system prompt, the role
    header)."""
    rendered = tokenizer.apply_chat_template([{**turn, "content": _CONTENT_MARK}], tokenize=False)
    if _CONTENT_MARK not in rendered:
        raise ConfigError(
            "the tokenizer's chat template does not render a turn's content as given, so assistant "
            "turns cannot be located; set train.assistant_only_loss: false (loss on every token)"
        )
    return rendered[: rendered.index(_CONTENT_MARK)]


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], assistant_only: bool
) -> dict[str, list[int]]:
    """``input_ids`` of a rendered conversation and, with ``assistant_only``, ``assistant_masks``
    (1 on every token that starts inside an assistant turn)."""
    if assistant_only:
        text, spans = assistant_spans(tokenizer, messages)
    else:
        text, spans = tokenizer.apply_chat_template(messages, tokenize=False), []
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=assistant_only)
    row = {"input_ids": encoded["input_ids"]}
    if assistant_only:
        row["assistant_masks"] = [
            int(any(start <= begin < end for start, end in spans)) for begin, _ in encoded["offset_mapping"]
        ]
    return row


TOKENIZING_CODE = Path(__file__)  # the code that turns rows into input_ids and masks: part of the cache key


def tokenize_dataset(dataset: Dataset, tokenizer: PreTrainedTokenizerBase, assistant_only: bool) -> Dataset:
    """Tokenize the recipe's data once: ``input_ids`` (and ``assistant_masks`` for conversations with assistant-only
    loss). Cached by ``datasets`` under a fingerprint of the rows, the tokenizer, the flag and this module's code
    (datasets' own would not see a change of the masking code)."""
    if not tokenizer.is_fast:
        raise ConfigError(
            "longpeft needs a fast tokenizer (offsets locate the assistant turns); load one with use_fast=True"
        )
    fingerprint = Hasher.hash([dataset._fingerprint, TOKENIZING_CODE.read_bytes(), tokenizer, assistant_only])
    conversations = "messages" in dataset.column_names

    def tokenize(row: dict[str, Any]) -> dict[str, list[int]]:
        if conversations:
            return tokenize_conversation(tokenizer, row["messages"], assistant_only)
        ids, eos = tokenizer(row["text"])["input_ids"], tokenizer.eos_token_id  # one eos, unless already there
        return {"input_ids": ids if eos is None or ids[-1:] == [eos] else [*ids, eos]}

    desc = f"tokenizing {'conversations' if conversations else 'text'}"
    return dataset.map(tokenize, remove_columns=dataset.column_names, desc=desc, new_fingerprint=fingerprint)


def select_by_length(
    lengths: list[int], max_length: int, truncate: bool, limit: str, min_length: int, window: int | None = None
) -> tuple[list[int], dict[str, int]]:
    """The indices of the samples (of these token ``lengths``) that training keeps: none longer than ``max_length``
    (unless ``truncate``: training cuts them), none shorter than ``min_length``; and the counts ``{"kept", "dropped"
    (too long), "dropped_short", "truncated" (kept, longer than max_length), "longest"}``, with ``window`` also
    ``"longer_than_window"``. ``limit``: what ``max_length`` is, for the error (``setting=value ...``)."""
    long_enough = [i for i, n in enumerate(lengths) if n >= min_length]
    keep = [i for i in long_enough if truncate or lengths[i] <= max_length]
    stats = {
        "kept": len(keep),
        "dropped": len(long_enough) - len(keep),
        "dropped_short": len(lengths) - len(long_enough),
        "truncated": sum(lengths[i] > max_length for i in keep),
        "longest": max(lengths, default=0),
    }
    if window is not None:
        stats["longer_than_window"] = sum(lengths[i] > window for i in keep)
    if not long_enough:
        raise DataError(
            f"every sample is shorter than data.min_length={min_length} tokens (longest "
            f"{stats['longest']}); lower data.min_length or use longer data"
        )
    if not keep:
        raise DataError(
            f"every sample is longer than {limit} tokens (longest {stats['longest']}); raise {limit.split('=')[0]} or "
            "set data.truncate: true"
        )
    return keep, stats


def utk_document_room(max_length: int, utk: UtkSection) -> int:
    """The longest document a UtK sequence of ``max_length`` tokens holds with its insertions."""
    room = max_length - utk_overhead(1, max(utk.chunk_counts), utk.label_length)
    if room < 2:
        raise ConfigError(f"data.max_length={max_length} leaves no room for a document after UtK's insertions")
    return room


def pack_for_utk(dataset: Dataset, max_length: int, utk: UtkSection, n_letters: int) -> Dataset:
    """Pack tokenized documents into UtK sequences: rows ``{"input_ids", "doc_lengths"}`` whose documents plus UtK's
    insertions fit ``max_length``; a document longer than :func:`utk_document_room` is cut to it.

    Refuses a ``utk.label_length`` whose ``n_letters ** label_length`` chunk labels (``n_letters``: UtK's
    single-token letters) cannot label every chunk of the fullest sequence.
    """
    max_chunks, label_length = max(utk.chunk_counts), utk.label_length
    room = utk_document_room(max_length, utk)
    documents = [ids[:room] for ids in dataset["input_ids"]]
    groups = utk_groups([len(ids) for ids in documents], max_length, utk)
    needed = max(
        (chunk_labels_needed([len(documents[i]) for i in g], max_chunks, utk.min_split_tokens) for g in groups),
        default=0,
    )
    if needed > n_letters**label_length:
        enough = next(n for n in itertools.count(1) if n_letters**n >= needed)
        raise ConfigError(
            f"data.utk.label_length={label_length} spells {n_letters}**{label_length} = {n_letters**label_length} "
            f"distinct chunk labels, but a packed sequence of up to data.max_length={max_length} tokens can need "
            f"{needed} (its documents of >= data.utk.min_split_tokens={utk.min_split_tokens} tokens split into up "
            f"to {max_chunks} chunks each); set data.utk.label_length to at least {enough} (or raise "
            "data.utk.min_split_tokens)"
        )
    input_ids = [[t for i in group for t in documents[i]] for group in groups]
    return Dataset.from_dict({"input_ids": input_ids, "doc_lengths": [[len(documents[i]) for i in g] for g in groups]})


def utk_groups(document_lengths: list[int], max_length: int, utk: UtkSection) -> list[list[int]]:
    """The documents (indices) each UtK sequence packs, from the documents' token counts, each already cut to
    :func:`utk_document_room`: consecutive documents while they and UtK's insertions fit ``max_length``."""
    return pack_documents([range(n) for n in document_lengths], max_length, max(utk.chunk_counts), utk.label_length)


def longest_sample(recipe: Recipe) -> tuple[int, str]:
    """The most tokens a training sample keeps on its way to the collator, and the setting that says so:
    ``data.max_length``, or the longer samples a method's collator draws its window from (``Recipe.long_samples``)."""
    samples = recipe.long_samples()
    if samples is not None:
        return samples.tokens, samples.limit
    return recipe.data.max_length, f"data.max_length={recipe.data.max_length}"


def build_dataset(recipe: Recipe, tokenizer: PreTrainedTokenizerBase) -> tuple[Dataset, dict[str, int]]:
    """The tokenized training rows after the recipe's length rules (:func:`select_for_training`), and their counts
    (``data_stats``); with UtK, the documents kept packed into sequences of ``data.max_length``."""
    data = load_training_data(recipe.data, tokenizer)
    dataset = tokenize_dataset(data, tokenizer, recipe.train.assistant_only_loss)
    keep, data_stats = select_for_training(recipe, token_lengths(dataset))
    dataset, utk = dataset.select(keep), recipe.data.utk
    if utk is not None:
        letters = add_utk_tokens(tokenizer, max(utk.chunk_counts)).letters  # the tokens are in already
        dataset = pack_for_utk(dataset, recipe.data.max_length, utk, len(letters))
        data_stats["packed_sequences"] = len(dataset)
    return dataset, data_stats


def select_for_training(recipe: Recipe, lengths: list[int]) -> tuple[list[int], dict[str, int]]:
    """The samples (of these token ``lengths``) the recipe trains on, and the counts of :func:`select_by_length`:
    each sample kept, cut or dropped against :func:`longest_sample` (with a method that skips content, some sample
    must be longer than ``data.max_length``); with UtK, each document, before packing, against the room UtK's
    insertions leave."""
    data, max_length = recipe.data, recipe.data.max_length
    if data.utk is not None:
        room = utk_document_room(max_length, data.utk)
        limit = f"data.max_length={max_length} minus UtK's insertions ({room})"
        return select_by_length(lengths, room, data.truncate, limit, data.min_length)
    longest, limit = longest_sample(recipe)
    samples = recipe.long_samples() if longest > max_length else None
    window = max_length if samples is not None else None
    keep, stats = select_by_length(lengths, longest, data.truncate, limit, data.min_length, window)
    if samples is not None and not stats["longer_than_window"]:
        raise DataError(
            f"{samples.setting}: no training sample is longer than data.max_length={max_length} tokens, so "
            f"no content would be skipped; use longer documents (up to {samples.tokens} tokens) or {samples.off}"
        )
    return keep, stats


def token_lengths(dataset: Dataset) -> list[int]:
    """Tokens of each row of a tokenized dataset, counted by Arrow (no row's ids read into Python)."""
    return pc.list_value_length(dataset.with_format("arrow")["input_ids"]).to_pylist()
