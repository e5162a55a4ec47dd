"""Retrieval documents (the toy base's pretraining data, ``data.source: retrieval``): token sequences whose next
tokens can only be predicted by looking them up earlier, of exact lengths, deterministic given the seed. Three kinds,
mixed by weight: ``passkey`` and ``niah`` probes followed by their answer, and ``induction`` (recurring word spans)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from ..errors import ConfigError
from .probes import ProbeBuilder

KINDS = ("passkey", "niah", "induction")
DEFAULT_MIX = {"passkey": 0.3, "niah": 0.3, "induction": 0.4}
_SPAN_WORDS = (
    "amber basalt cedar dune ember fjord glacier harbor iris juniper kelp lagoon meadow nectar orchid pebble "
    "quartz raven saffron tundra umber violet willow yarrow zephyr river city market north south east west "
    "garden station village engineer doctor teacher captain farmer writer merchant painter sailor pilot baker "
    "red blue green silver golden quiet bright ancient modern small large early late key value number code"
).split()


class RetrievalDocuments:
    """Builds retrieval documents of a requested token length for one ``tokenizer``, deterministic given ``seed`` and
    the call order; ``mix``: kind (:data:`KINDS`) -> weight, default :data:`DEFAULT_MIX`."""

    def __init__(self, tokenizer: Any, seed: int = 0, mix: dict[str, float] | None = None):
        mix = dict(DEFAULT_MIX if mix is None else mix)
        unknown = set(mix) - set(KINDS)
        if unknown or not mix or any(w < 0 for w in mix.values()) or not sum(mix.values()):
            raise ConfigError(f"mix maps kinds {KINDS} to non-negative weights with a positive sum, got {mix}")
        self.tokenizer = tokenizer
        self.rng = random.Random(f"retrieval/{seed}")
        self.probes = ProbeBuilder(tokenizer, chat=False, seed=seed)
        self.kinds = list(mix)
        self.weights = [mix[k] for k in self.kinds]
        self.span_tokens = [self.probes.encode(" " + w) for w in _SPAN_WORDS]

    def document(self, n_tokens: int, kind: str | None = None) -> list[int]:
        """One document of exactly ``n_tokens`` token ids; ``kind=None`` draws one from the mix (a drawn probe kind
        whose instruction, needles and question do not fit ``n_tokens`` gives an ``induction`` document instead)."""
        drawn = kind is None
        kind = kind or self.rng.choices(self.kinds, self.weights)[0]
        if kind == "induction":
            return self.induction(n_tokens)
        for _ in range(20):  # a draw whose haystack cannot be made of whole sentences is drawn again
            try:
                return self.answered_probe(n_tokens, kind)
            except ValueError as exc:
                error = exc
        if drawn:  # a probe's fixed text does not fit this short a document
            return self.induction(n_tokens)
        raise ConfigError(f"cannot build a {kind} document of {n_tokens} tokens: {error}")

    def answered_probe(self, n_tokens: int, kind: str) -> list[int]:
        """A ``passkey`` or ``niah`` probe followed by its answer and a full stop, ``n_tokens`` ids in all."""
        depth = self.rng.random()
        if kind not in ("passkey", "niah"):
            raise ConfigError(f"unknown retrieval document kind {kind!r}; choose one of {KINDS}")
        digits = self.rng.randint(3 if kind == "passkey" else 4, 7)
        answer_len = len(self.probes.encode(" " + "1" * digits + "."))
        if kind == "passkey":
            probe = self.probes.passkey(n_tokens - answer_len, depth, digits=digits)
        else:
            n_keys = self.rng.randint(1, max(1, min(4, (n_tokens - 100) // 20)))
            probe = self.probes.niah(n_tokens - answer_len, depth, n_keys=n_keys, digits=digits)
        return probe.input_ids + self.probes.encode(" " + probe.answers[0] + ".")

    def induction(self, n_tokens: int) -> list[int]:
        """``n_tokens`` ids of random word spans (3-12 words), half of them repeats of an earlier span."""
        ids: list[int] = []
        spans: list[list[int]] = []
        while len(ids) < n_tokens:
            if spans and self.rng.random() < 0.5:
                span = self.rng.choice(spans)
            else:
                span = [t for _ in range(self.rng.randint(3, 12)) for t in self.rng.choice(self.span_tokens)]
                spans.append(span)
            ids.extend(span + self.probes.encode("."))
        return ids[:n_tokens]

    def documents(self, n_documents: int, lengths: Sequence[int]) -> list[list[int]]:
        """``n_documents`` documents, lengths drawn uniformly from ``lengths``."""
        return [self.document(self.rng.choice(list(lengths))) for _ in range(n_documents)]


def build_retrieval_dataset(
    tokenizer: Any,
    n_documents: int = 256,
    min_tokens: int = 512,
    max_tokens: int = 1024,
    seed: int = 0,
    mix: dict[str, float] | None = None,
) -> Any:
    """A ``datasets.Dataset`` with one ``text`` column of retrieval documents whose lengths are drawn uniformly in
    ``[min_tokens, max_tokens]`` tokens, counting the special prefix (e.g. BOS) that tokenizing the text for training
    adds back: probes are built with it and lose it here, induction documents lose their last tokens instead."""
    from datasets import Dataset

    if not 0 < min_tokens <= max_tokens:
        raise ConfigError(f"need 0 < min_tokens <= max_tokens, got {min_tokens} and {max_tokens}")
    builder = RetrievalDocuments(tokenizer, seed=seed, mix=mix)
    docs = builder.documents(n_documents, range(min_tokens, max_tokens + 1))
    prefix = builder.probes.special_prefix()
    cut = len(prefix)
    texts = [tokenizer.decode(ids[cut:] if ids[:cut] == prefix else ids[: len(ids) - cut]) for ids in docs]
    return Dataset.from_dict({"text": texts})
