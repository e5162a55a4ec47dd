"""Untie the Knots (UtK): chunk, knot, shuffle and backtrace augmentation on token ids, on the fly and seeded.

With probability ``p``, the documents of a sequence are cut into random chunks, each labelled with random letters
and knotted to the next (``<tail_j>`` and ``<head_{j+1}>`` mark one cut), and shuffled; a document's last chunk ends
with its labels in order (the backtrace). Chunk ``j`` of ``h``:
``[<head_j>] <label> L.. </label> tokens.. [<tail_j>] [<trace> L.. <sep> L.. </trace>]``. Labels are -100 on the knots,
on the chunk labels as input and on the trace sentinels. Attention stays causal across documents: the model must
search the sequence for the matching knot."""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from transformers import PreTrainedTokenizerBase

from ..errors import ConfigError, DataError
from ..family import IGNORE_INDEX


@dataclass(frozen=True)
class UtkTokens:
    """Ids of the UtK special tokens and of the letters chunk labels are spelled with. ``head_knots[j]`` /
    ``tail_knots[j]`` are the knots of chunk ``j`` (0-based); ``head_knots[0]`` and ``tail_knots[-1]`` are -1."""

    head_knots: tuple[int, ...]
    tail_knots: tuple[int, ...]
    label_open: int
    label_close: int
    trace_open: int
    trace_sep: int
    trace_close: int
    letters: tuple[int, ...]

    @property
    def max_chunks(self) -> int:
        return len(self.head_knots)

    @property
    def special_ids(self) -> list[int]:
        knots = [i for i in self.head_knots + self.tail_knots if i >= 0]
        return knots + [self.label_open, self.label_close, self.trace_open, self.trace_sep, self.trace_close]


def utk_token_strings(max_chunks: int) -> dict[str, list[str] | str]:
    """The special-token strings for up to ``max_chunks`` chunks per document."""
    return {
        "head_knots": [f"<|utk_head_{j}|>" for j in range(2, max_chunks + 1)],
        "tail_knots": [f"<|utk_tail_{j}|>" for j in range(1, max_chunks)],
        "label_open": "<|utk_label|>",
        "label_close": "<|/utk_label|>",
        "trace_open": "<|utk_trace|>",
        "trace_sep": "<|utk_sep|>",
        "trace_close": "<|/utk_trace|>",
    }


def add_utk_tokens(
    tokenizer: PreTrainedTokenizerBase, max_chunks: int = 3, alphabet: str = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
) -> UtkTokens:
    """Add the knot, label and trace special tokens to ``tokenizer`` (idempotent) and return their ids; chunk
    labels are spelled with the letters of ``alphabet`` it encodes as one token. The model's embeddings must then be
    resized to ``len(tokenizer)`` and trained (e.g. ``trainable_token_indices``)."""
    if max_chunks < 2:
        raise ConfigError(f"max_chunks must be at least 2, got {max_chunks}")
    strings = utk_token_strings(max_chunks)
    flat = strings["head_knots"] + strings["tail_knots"] + [v for k, v in strings.items() if isinstance(v, str)]
    tokenizer.add_tokens(flat, special_tokens=True)
    ids = {s: tokenizer.convert_tokens_to_ids(s) for s in flat}
    encoded = [tokenizer.encode(letter, add_special_tokens=False) for letter in dict.fromkeys(alphabet)]
    letters = [e[0] for e in encoded if len(e) == 1]
    if len(letters) < 2:
        raise ConfigError(
            f"fewer than two letters of {alphabet!r} are single tokens for this tokenizer; pass another alphabet"
        )
    return UtkTokens(
        head_knots=(-1, *(ids[s] for s in strings["head_knots"])),
        tail_knots=(*(ids[s] for s in strings["tail_knots"]), -1),
        letters=tuple(letters),
        **{key: ids[value] for key, value in strings.items() if isinstance(value, str)},
    )


@dataclass
class UtkSample:
    """Output of :class:`UtkAugmenter`: the sequence's ``input_ids`` and ``labels`` (int64, -100 where no loss is
    taken), whether it was ``augmented``, and with ``return_origin`` the ``origin`` of each position (int64: the index
    of the original token in the concatenated documents, -1 for inserted tokens)."""

    input_ids: np.ndarray
    labels: np.ndarray
    origin: np.ndarray | None
    augmented: bool


class UtkAugmenter:
    """Applies UtK, with ``tokens`` of :func:`add_utk_tokens`, to sequences of documents given as token ids: with
    ``probability`` (the paper: 0.3 low, 0.8 high), documents of ``min_split_tokens`` or more are cut into ``h`` chunks
    drawn from ``chunk_counts`` (``{h: weight}``, ``h`` <= ``tokens.max_chunks``; 1 keeps it whole), labelled with
    ``label_length`` letters; with ``preserve_order`` each document's chunks keep their order when shuffled. ``seed``
    seeds the generator calls consume in order; a call's own ``seed=`` makes it independent of the others."""

    def __init__(
        self,
        tokens: UtkTokens,
        probability: float = 0.8,
        chunk_counts: Mapping[int, float] | None = None,
        min_split_tokens: int = 64,
        preserve_order: bool = True,
        label_length: int = 4,
        seed: int = 0,
    ):
        chunk_counts = dict(chunk_counts or {2: 0.5, 3: 0.5})
        if not 0.0 <= probability <= 1.0:
            raise ConfigError(f"probability must be in [0, 1], got {probability}")
        if not chunk_counts or min(chunk_counts) < 1 or max(chunk_counts) > tokens.max_chunks:
            raise ConfigError(
                f"chunk_counts keys must be in 1..{tokens.max_chunks} (tokens made for {tokens.max_chunks} chunks), "
                f"got {sorted(chunk_counts)}"
            )
        weights = np.asarray([chunk_counts[h] for h in sorted(chunk_counts)], dtype=float)
        if (weights < 0).any() or weights.sum() <= 0:
            raise ConfigError(f"chunk_counts weights must be >= 0 with a positive sum, got {chunk_counts}")
        if min_split_tokens < 2:
            raise ConfigError("min_split_tokens must be at least 2")
        self.tokens = tokens
        self.probability = probability
        self.counts = np.asarray(sorted(chunk_counts))
        self._cumulative = np.cumsum(weights / weights.sum())
        self.min_split_tokens = min_split_tokens
        self.preserve_order = preserve_order
        self.label_length = label_length
        self.rng = np.random.default_rng(seed)
        self._special = np.asarray(tokens.special_ids, dtype=np.int64)
        self._letters = np.asarray(tokens.letters, dtype=np.int64)

    def __call__(
        self, documents: Sequence[Sequence[int] | np.ndarray], seed: int | None = None, return_origin: bool = False
    ) -> UtkSample:
        """Augment one sequence made of ``documents`` (token id lists, in sequence order)."""
        rng = np.random.default_rng(seed) if seed is not None else self.rng
        docs = [np.asarray(d, dtype=np.int64) for d in documents]
        starts = np.cumsum([0] + [len(d) for d in docs])
        flat = np.concatenate(docs) if docs else np.zeros(0, dtype=np.int64)
        if flat.size and flat.max() >= self._special.min() and np.isin(flat, self._special).any():
            raise DataError("the documents already contain UtK special tokens; augment raw documents only once")
        if rng.random() >= self.probability:
            origin = np.arange(len(flat)) if return_origin else None
            return UtkSample(flat.copy(), flat.copy(), origin, augmented=False)

        # One piece per chunk (a whole document counts as one chunk); a piece is a list of segments
        # (ids, labels, origin of its first token or -1 for inserted tokens).
        pieces: list[list[tuple[np.ndarray, np.ndarray, int]]] = []
        pieces_per_doc: list[int] = []
        used_labels: set[tuple[int, ...]] = set()
        draws = self.counts[
            np.minimum(np.searchsorted(self._cumulative, rng.random(len(docs)), side="right"), len(self.counts) - 1)
        ]
        for doc, start, drawn in zip(docs, starts.tolist(), draws.tolist()):
            h = min(drawn, len(doc)) if len(doc) >= self.min_split_tokens else 1
            pieces_per_doc.append(h)
            if h == 1:
                pieces.append([(doc, doc, start)])
                continue
            bounds = [0, *self._cuts(rng, len(doc), h), len(doc)]
            labels = self._new_labels(rng, h, used_labels)
            for j in range(h):
                head = [self._marker([self.tokens.head_knots[j]])] if j else []
                label = self._marker([self.tokens.label_open, *labels[j], self.tokens.label_close])
                content = doc[bounds[j] : bounds[j + 1]]
                tail = [self._marker([self.tokens.tail_knots[j]])] if j < h - 1 else self._backtrace(labels)
                pieces.append([*head, label, (content, content, start + bounds[j]), *tail])

        ids, labels, firsts = zip(*(segment for i in self._shuffle(pieces_per_doc, rng) for segment in pieces[i]))
        origin = None
        if return_origin:
            origin = np.concatenate(
                [np.arange(o, o + len(part)) if o >= 0 else np.full(len(part), -1) for part, o in zip(ids, firsts)]
            )
        return UtkSample(np.concatenate(ids), np.concatenate(labels), origin, augmented=True)

    @staticmethod
    def _cuts(rng: np.random.Generator, length: int, h: int) -> list[int]:
        """``h - 1`` distinct sorted cut points in ``1 .. length - 1`` (so every chunk is non-empty)."""
        while True:
            cuts = np.unique(rng.integers(1, length, size=h - 1))
            if len(cuts) == h - 1:
                return cuts.tolist()

    def _new_labels(self, rng: np.random.Generator, h: int, used: set[tuple[int, ...]]) -> list[list[int]]:
        """``h`` chunk labels (letter token ids), unique within the sequence; fails only when fewer than
        ``h`` of the ``len(letters) ** label_length`` labels are left (see :func:`chunk_labels_needed`)."""
        labels: list[list[int]] = []
        for _ in range(100 * h):
            label = tuple(self._letters[rng.integers(0, len(self._letters), size=self.label_length)].tolist())
            if label not in used:
                used.add(label)
                labels.append(list(label))
                if len(labels) == h:
                    return labels
        # Random draws keep colliding only when nearly every label is taken: pick among the free ones.
        free = [
            label for label in itertools.product(self._letters.tolist(), repeat=self.label_length) if label not in used
        ]
        if len(free) < h - len(labels):
            raise ConfigError(
                f"this sequence needs more than the {len(self._letters)}**{self.label_length} distinct chunk labels; "
                "raise label_length (chunk_labels_needed gives a sequence's worst case)"
            )
        for index in rng.choice(len(free), size=h - len(labels), replace=False):
            used.add(free[index])
            labels.append(list(free[index]))
        return labels

    @staticmethod
    def _marker(ids: list[int]) -> tuple[np.ndarray, np.ndarray, int]:
        """Inserted tokens that are never trained as targets."""
        return np.asarray(ids, dtype=np.int64), np.full(len(ids), IGNORE_INDEX, dtype=np.int64), -1

    def _backtrace(self, labels: list[list[int]]) -> list[tuple[np.ndarray, np.ndarray, int]]:
        """``<trace> L1 <sep> L2 ... </trace>``: the label ids are trained, the sentinels are not."""
        segments = [self._marker([self.tokens.trace_open])]
        for j, label in enumerate(labels):
            if j:
                segments.append(self._marker([self.tokens.trace_sep]))
            ids = np.asarray(label, dtype=np.int64)
            segments.append((ids, ids, -1))
        segments.append(self._marker([self.tokens.trace_close]))
        return segments

    def _shuffle(self, pieces_per_doc: list[int], rng: np.random.Generator) -> np.ndarray:
        """Order of all pieces; with ``preserve_order`` each document's pieces keep their relative order."""
        slots = rng.permutation(sum(pieces_per_doc))
        if not self.preserve_order:
            return slots
        order, start = np.empty_like(slots), 0
        for count in pieces_per_doc:
            # The document's pieces (flat indices start..start+count) take its slots in sorted order.
            order[np.sort(slots[start : start + count])] = np.arange(start, start + count)
            start += count
        return order


def utk_overhead(n_documents: int, max_chunks: int, label_length: int) -> int:
    """The most tokens UtK can insert into a sequence of ``n_documents`` (knots, labels, backtraces)."""
    per_chunk = 2 + label_length + 2  # head/tail knots + <label> L.. </label>
    per_trace = 2 + max_chunks * label_length + (max_chunks - 1)  # <trace> L.. <sep> .. </trace>
    return n_documents * (max_chunks * per_chunk + per_trace)


def chunk_labels_needed(doc_lengths: Sequence[int], max_chunks: int, min_split_tokens: int) -> int:
    """The most chunk labels :class:`UtkAugmenter` can draw for one sequence of documents of these
    lengths: every document of at least ``min_split_tokens`` tokens split into ``max_chunks`` chunks
    (at most one per token). They must fit in ``len(tokens.letters) ** label_length``."""
    chunks = [min(max_chunks, n) for n in doc_lengths if n >= min_split_tokens]
    return sum(h for h in chunks if h > 1)


def pack_documents(
    documents: Sequence[Sequence[int]], max_length: int, max_chunks: int, label_length: int
) -> list[list[int]]:
    """Indices of consecutive documents (token id lists) grouped so that each group plus UtK's insertions fits
    ``max_length``. A document too long even alone gets a group of its own (cut documents to ``max_length -
    utk_overhead(1, ...)`` tokens first, as ``longpeft.recipes.data.pack_for_utk`` does)."""
    groups: list[list[int]] = []
    current: list[int] = []
    used = 0
    for index, doc in enumerate(documents):
        fits = used + len(doc) + utk_overhead(len(current) + 1, max_chunks, label_length) <= max_length
        if current and not fits:
            groups.append(current)
            current, used = [], 0
        current.append(index)
        used += len(doc)
    if current:
        groups.append(current)
    return groups


@dataclass(eq=False)
class UtkCollator:
    """Applies UtK to packed sequences (features: ``input_ids``, its documents concatenated, and ``doc_lengths``),
    seeded by the collator's seed and the sequence's content (a resumed run sees the same augmentation), and
    right-pads the batch: ``input_ids``, ``labels`` (-100 on UtK markers and padding) and ``attention_mask``."""

    augmenter: UtkAugmenter
    pad_token_id: int
    max_length: int
    seed: int = 0

    def __call__(self, features: Sequence[Mapping]) -> dict:
        import torch

        rows = []
        for feature in features:
            ids = np.asarray(feature["input_ids"], dtype=np.int64)
            bounds = np.cumsum([0, *feature["doc_lengths"]])
            if bounds[-1] != len(ids):
                raise ValueError(f"doc_lengths sum to {bounds[-1]} but the sequence has {len(ids)} tokens")
            seed = zlib.crc32(ids.tobytes(), self.seed)
            sample = self.augmenter([ids[a:b] for a, b in zip(bounds[:-1], bounds[1:])], seed=seed)
            rows.append((sample.input_ids[: self.max_length], sample.labels[: self.max_length]))
        width = max(len(r[0]) for r in rows)
        input_ids = np.full((len(rows), width), self.pad_token_id, dtype=np.int64)
        labels = np.full((len(rows), width), IGNORE_INDEX, dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        for b, (ids, row_labels) in enumerate(rows):
            input_ids[b, : len(ids)], labels[b, : len(ids)], mask[b, : len(ids)] = ids, row_labels, 1
        batch = {"input_ids": input_ids, "labels": labels, "attention_mask": mask}
        return {key: torch.from_numpy(array) for key, array in batch.items()}
