"""The demo's training set: retrieval QA over procedural contexts, built offline in well under a second."""

from __future__ import annotations

import random

from datasets import Dataset
from transformers import PreTrainedTokenizerBase

from .builders import LengthConfig, LongContextBuilder, procedural_document
from .qa import ProceduralAnswerer

DEMO_CONVERSATIONS = 64  # conversations in the demo set unless data.demo.n_conversations says otherwise


def build_demo_dataset(
    tokenizer: PreTrainedTokenizerBase,
    n_conversations: int = DEMO_CONVERSATIONS,
    context_tokens: int = 600,
    seed: int = 0,
    questions_per_conversation: int = 4,
) -> Dataset:
    """The demo's training set, deterministic given ``seed``: conversations of ``context_tokens`` to
    ``context_tokens + 48 * questions_per_conversation + 64`` tokens (chat template included), each a procedural
    context with numbered objects scattered through it ("The grey oar at the pier is marked with the number 38006.")
    and ``questions_per_conversation`` turns asking for those numbers: exact, pure retrieval."""
    reserve = 48 * questions_per_conversation + 64
    longest = context_tokens + reserve
    length = LengthConfig(
        min_tokens=context_tokens, max_tokens=longest, chunk_tokens=longest, qa_reserve_tokens=reserve
    )
    builder = LongContextBuilder(tokenizer, ProceduralAnswerer(), length, seed=seed)
    rng = random.Random(f"{seed}/demo")
    options = {"fact_kinds": ("code",), "fact_rate": 0.25, "n_characters": 0}  # numbered objects only
    documents = [
        procedural_document(builder.counter, longest + 64, seed=rng.randrange(2**31), doc_id=f"demo-{i}", **options)
        for i in range(n_conversations)
    ]
    settings = dict(contexts=n_conversations, chunks_per_context=1, questions_per_chunk=questions_per_conversation)
    return Dataset.from_list(builder.build(builder.plan("single_detail", documents, **settings)))
