"""Untie the Knots on token ids: survival, reassembly, label masking, seeding."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from longpeft.synth_data.corpus import corpus_texts
from longpeft.synth_data.utk import IGNORE_INDEX, UtkAugmenter, UtkTokens, add_utk_tokens, chunk_labels_needed
from longpeft.tiny import sample_text, train_tokenizer


def untie(input_ids: list[int] | np.ndarray, tokens: UtkTokens) -> list[list[int]]:
    """Reassemble every split document of a UtK sequence from its labels, knots and backtrace: the inverse of
    :class:`UtkAugmenter`'s transform, which the tests check the augmenter's output against.

    Returns the documents' original token ids, in the order their backtraces appear. Raises
    ``ValueError`` when the knots do not tie up (a head knot that does not follow its tail knot's cut).
    """
    ids = np.asarray(input_ids).tolist()
    heads = {t: j for j, t in enumerate(tokens.head_knots) if t >= 0}
    tails = {t: j for j, t in enumerate(tokens.tail_knots) if t >= 0}
    chunks: dict[tuple[int, ...], tuple[int, list[int], bool]] = {}  # label -> (chunk index, tokens, ends in a tail)
    traces: list[list[tuple[int, ...]]] = []
    i = 0
    while i < len(ids):
        if ids[i] != tokens.label_open:
            i += 1
            continue
        head = heads.get(ids[i - 1], 0) if i > 0 else 0
        close = ids.index(tokens.label_close, i)
        label = tuple(ids[i + 1 : close])
        end = close + 1
        while end < len(ids) and ids[end] not in tails and ids[end] != tokens.trace_open:
            end += 1
        ends_in_tail = end < len(ids) and ids[end] in tails
        if ends_in_tail and tails[ids[end]] != head:
            raise ValueError(
                f"chunk {label} starts as chunk {head} but ends with the tail knot of chunk {tails[ids[end]]}"
            )
        chunks[label] = (head, ids[close + 1 : end], ends_in_tail)
        if end < len(ids) and ids[end] == tokens.trace_open:
            finish = ids.index(tokens.trace_close, end)
            labels, current = [], []
            for token in ids[end + 1 : finish]:
                if token == tokens.trace_sep:
                    labels.append(tuple(current))
                    current = []
                else:
                    current.append(token)
            traces.append([*labels, tuple(current)])
            end = finish + 1
        i = end
    documents = []
    for labels in traces:  # resolved after the scan: without preserve_order a chunk may follow its trace
        document: list[int] = []
        for j, label in enumerate(labels):
            head, content, ends_in_tail = chunks[label]
            if head != j or ends_in_tail != (j < len(labels) - 1):
                raise ValueError(f"chunk {label} is tied as chunk {head}, but the backtrace lists it as chunk {j}")
            document += content
        documents.append(document)
    return documents


@pytest.fixture(scope="module")
def setup():
    tokenizer = train_tokenizer(corpus_texts(n=20, seed=0) + sample_text())
    base_vocab = len(tokenizer)
    tokens = add_utk_tokens(tokenizer, max_chunks=4)
    texts = corpus_texts(n=10, seed=5, n_sentences=40)
    docs = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    docs += [docs[0][:30], docs[1][:10]]  # short documents: never split (min_split_tokens=64)
    return tokenizer, base_vocab, tokens, docs


def test_tokens_are_added_once_and_are_special(setup):
    tokenizer, base_vocab, tokens, _ = setup
    assert len(tokenizer) == base_vocab + len(tokens.special_ids) == base_vocab + 3 + 3 + 5
    assert set(tokens.special_ids) == set(range(base_vocab, len(tokenizer)))
    again = add_utk_tokens(tokenizer, max_chunks=4)
    assert again == tokens and len(tokenizer) == base_vocab + 11
    assert tokenizer.decode([tokens.head_knots[1]]) == "<|utk_head_2|>"
    assert len(tokens.letters) == 26


@pytest.mark.parametrize("preserve_order", [True, False])
def test_every_original_token_survives_exactly_once(setup, preserve_order):
    _, _, tokens, docs = setup
    flat = np.concatenate([np.asarray(d) for d in docs])
    augmenter = UtkAugmenter(tokens, probability=1.0, chunk_counts={2: 1, 3: 1, 4: 1}, preserve_order=preserve_order)
    for seed in range(5):
        sample = augmenter(docs, seed=seed, return_origin=True)
        assert sample.augmented
        kept = sample.origin[sample.origin >= 0]
        assert np.array_equal(np.sort(kept), np.arange(len(flat)))
        assert np.array_equal(sample.input_ids[sample.origin >= 0], flat[kept])
        inserted = sample.input_ids[sample.origin < 0]
        assert np.isin(inserted, tokens.special_ids + list(tokens.letters)).all()


@pytest.mark.parametrize("preserve_order", [True, False])
def test_split_documents_reassemble_from_the_knots(setup, preserve_order):
    _, _, tokens, docs = setup
    augmenter = UtkAugmenter(tokens, probability=1.0, chunk_counts={2: 1, 3: 2, 4: 1}, preserve_order=preserve_order)
    long_docs = sorted(tuple(d) for d in docs if len(d) >= 64)
    for seed in range(5):
        sample = augmenter(docs, seed=seed)
        assert sorted(tuple(d) for d in untie(sample.input_ids, tokens)) == long_docs
    in_order = [chunks_in_trace_order(augmenter(docs, seed=seed).input_ids, tokens) for seed in range(5)]
    if preserve_order:
        assert all(all(flags) for flags in in_order)
    else:
        assert not all(all(flags) for flags in in_order)  # some document's chunks came out of order


def chunks_in_trace_order(input_ids, tokens):
    """For each backtrace: do its documents' chunks appear in the sequence in the traced order?"""
    ids = input_ids.tolist()
    where, flags, i = {}, [], 0
    for i, token in enumerate(ids):
        if token == tokens.label_open:
            where[tuple(ids[i + 1 : ids.index(tokens.label_close, i)])] = i
    for i, token in enumerate(ids):
        if token == tokens.trace_open:
            inner = ids[i + 1 : ids.index(tokens.trace_close, i)]
            labels, current = [], []
            for t in inner + [tokens.trace_sep]:
                if t == tokens.trace_sep:
                    labels.append(tuple(current))
                    current = []
                else:
                    current.append(t)
            positions = [where[label] for label in labels]
            flags.append(positions == sorted(positions))
    return flags


def test_untie_rejects_mismatched_knots(setup):
    _, _, tokens, docs = setup
    sample = UtkAugmenter(tokens, probability=1.0, chunk_counts={3: 1})(docs[:2], seed=0)
    ids = sample.input_ids.copy()
    first_tail = int(np.flatnonzero(ids == tokens.tail_knots[0])[0])
    ids[first_tail] = tokens.tail_knots[1]  # chunk 1 now ends with chunk 2's tail knot
    with pytest.raises(ValueError, match="tail knot"):
        untie(ids, tokens)


def expected_labels(input_ids, tokens):
    """Independent reference: -100 on knots, on labels shown as input (with delimiters), on sentinels."""
    special = set(tokens.special_ids)
    labels, inside_label = [], False
    for token in input_ids.tolist():
        if token == tokens.label_open:
            inside_label = True
        masked = token in special or inside_label
        if token == tokens.label_close:
            inside_label = False
        labels.append(IGNORE_INDEX if masked else token)
    return np.asarray(labels)


def test_labels_are_masked_exactly_on_knots_labels_and_sentinels(setup):
    _, _, tokens, docs = setup
    augmenter = UtkAugmenter(tokens, probability=1.0, chunk_counts={2: 1, 3: 1})
    for seed in range(5):
        sample = augmenter(docs, seed=seed, return_origin=True)
        assert np.array_equal(sample.labels, expected_labels(sample.input_ids, tokens))
        # the backtrace target (label letters between <trace> and </trace>) is trained
        trace_open = np.flatnonzero(sample.input_ids == tokens.trace_open)
        trace_close = np.flatnonzero(sample.input_ids == tokens.trace_close)
        assert len(trace_open) == len(trace_close) > 0
        for start, end in zip(trace_open, trace_close):
            inner = slice(start + 1, end)
            letters = np.isin(sample.input_ids[inner], tokens.letters)
            assert letters.sum() > 0
            assert np.array_equal(sample.labels[inner][letters], sample.input_ids[inner][letters])
        assert np.array_equal(sample.labels[sample.origin >= 0], sample.input_ids[sample.origin >= 0])


def test_same_seed_same_output_and_probability(setup):
    _, _, tokens, docs = setup
    a = UtkAugmenter(tokens, probability=0.5, seed=3)
    b = UtkAugmenter(tokens, probability=0.5, seed=3)
    outputs_a = [a(docs) for _ in range(20)]
    outputs_b = [b(docs) for _ in range(20)]
    for x, y in zip(outputs_a, outputs_b):
        assert x.augmented == y.augmented
        assert np.array_equal(x.input_ids, y.input_ids) and np.array_equal(x.labels, y.labels)
    assert 3 <= sum(x.augmented for x in outputs_a) <= 17
    assert not np.array_equal(outputs_a[0].input_ids, a(docs, seed=99).input_ids) or not outputs_a[0].augmented
    flat = np.concatenate([np.asarray(d) for d in docs])
    plain = UtkAugmenter(tokens, probability=0.0)(docs)
    assert not plain.augmented and np.array_equal(plain.input_ids, flat) and np.array_equal(plain.labels, flat)


def test_chunk_count_distribution_and_short_documents(setup):
    _, _, tokens, docs = setup
    sample = UtkAugmenter(tokens, probability=1.0, chunk_counts={3: 1.0}, min_split_tokens=64)(docs, seed=1)
    assert (sample.input_ids == tokens.trace_open).sum() == sum(len(d) >= 64 for d in docs)
    assert (sample.input_ids == tokens.label_open).sum() == 3 * sum(len(d) >= 64 for d in docs)
    with pytest.raises(ValueError, match="chunk_counts"):
        UtkAugmenter(tokens, chunk_counts={5: 1.0})
    with pytest.raises(ValueError, match="already contain"):
        UtkAugmenter(tokens, probability=1.0)([sample.input_ids])


def test_every_label_of_the_alphabet_can_be_used_and_no_more(setup):
    """A sequence needing exactly len(letters) ** label_length labels gets them all (random draws alone
    would keep colliding on the last free ones); one more chunk is refused, naming label_length."""
    _, _, tokens, _ = setup
    four_letters = dataclasses.replace(tokens, letters=tokens.letters[:4])
    augmenter = UtkAugmenter(four_letters, probability=1.0, chunk_counts={2: 1.0}, min_split_tokens=2, label_length=5)
    docs = [[5, 6]] * 512
    assert chunk_labels_needed([2] * 512, max_chunks=2, min_split_tokens=2) == 1024 == 4**5
    sample = augmenter(docs, seed=0)
    assert (sample.input_ids == tokens.label_open).sum() == 1024 and len(untie(sample.input_ids, four_letters)) == 512
    with pytest.raises(ValueError, match="raise label_length"):
        augmenter(docs + [[5, 6]], seed=0)


def test_pack_for_utk_refuses_too_short_labels_and_cuts_long_documents():
    from datasets import Dataset

    from longpeft.recipes.data import pack_for_utk
    from longpeft.recipes.schema import UtkSection
    from longpeft.synth_data.utk import utk_overhead

    assert chunk_labels_needed([64, 63, 100, 1], max_chunks=3, min_split_tokens=64) == 6
    assert chunk_labels_needed([64, 100], max_chunks=1, min_split_tokens=64) == 0  # {1: ...} never splits
    documents = Dataset.from_dict({"input_ids": [[50 + i] * 64 for i in range(10)]})  # one sequence, 30 chunks
    utk = UtkSection(chunk_counts={2: 0.5, 3: 0.5}, min_split_tokens=64, label_length=1)
    with pytest.raises(
        ValueError,
        match=r"data.utk.label_length=1 spells 26\*\*1 = 26 distinct chunk labels, but a "
        r"packed sequence of up to data.max_length=1024 tokens can need 30 .* at "
        r"least 2",
    ):
        pack_for_utk(documents, 1024, utk, n_letters=26)
    packed = pack_for_utk(documents, 1024, utk.model_copy(update={"label_length": 2}), n_letters=26)
    assert packed["doc_lengths"] == [[64] * 10]
    assert len(pack_for_utk(documents, 1024, utk, n_letters=26 * 2)) == 1  # 52 letters: 52 labels are enough
    long = pack_for_utk(Dataset.from_dict({"input_ids": [[7] * 2000, [8] * 10]}), 512, utk, n_letters=26)
    room = 512 - utk_overhead(1, 3, 1)
    assert long["doc_lengths"] == [[room], [10]]  # the long document is cut to the room left by UtK


def test_data_utk_in_a_recipe_packs_augments_and_trains(tiny_base_dirs, tmp_path):
    """`data.utk`: documents packed to max_length, augmented on the fly, UtK tokens added and trained."""
    import json

    import torch

    import longpeft
    from longpeft.recipes.runner import prepare, run
    from longpeft.recipes.schema import load_recipe
    from longpeft.spec import ContextSpec
    from longpeft.synth_data.utk import UtkCollator, utk_token_strings

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": text}) + "\n" for text in corpus_texts(n=12, seed=3, n_sentences=16)))
    recipe = load_recipe(
        "tiny-cpu",
        [
            f"model.name_or_path={tiny_base_dirs('llama')}",
            f"data.source={data}",
            "data.format=text",
            "data.max_length=256",
            "data.truncate=true",
            "data.utk.probability=1.0",
            "data.utk.min_split_tokens=16",
            f"output_dir={tmp_path / 'run'}",
            "train.max_steps=1",
            "train.global_batch_size=2",
            "train.per_device_batch_size=2",
            "lora.r=2",
        ],
    )
    prepared = prepare(recipe)
    assert isinstance(prepared.trainer.data_collator, UtkCollator)
    tokenizer = prepared.tokenizer
    head_two = tokenizer.convert_tokens_to_ids(utk_token_strings(3)["head_knots"][0])
    batch = next(iter(prepared.trainer.get_train_dataloader()))
    assert batch["input_ids"].shape[1] <= 256 and (batch["input_ids"] == head_two).any()  # split and knotted
    assert (batch["labels"][batch["input_ids"] == head_two] == IGNORE_INDEX).all()  # knots are never targets
    assert prepared.spec.vocab_size == len(tokenizer) > 512
    # Documents are counted as documents. These are longer than a sequence's room: data.truncate cuts them; without
    # it they are dropped (they used to be cut silently, losing their ends) and an all-too-long source is refused.
    stats = prepared.data_stats
    assert stats["kept"] == stats["truncated"] == 12 and stats["dropped"] == 0
    assert stats["packed_sequences"] == len(prepared.trainer.train_dataset)
    keep_whole = recipe.model_copy(update={"data": recipe.data.model_copy(update={"truncate": False})})
    with pytest.raises(ValueError, match=r"every sample is longer than data.max_length=256 minus UtK's insertions"):
        prepare(keep_whole)
    with data.open("a") as handle:
        handle.write(json.dumps({"text": "A short document that fits whole. It has two sentences."}) + "\n")
    assert {k: prepare(keep_whole).data_stats[k] for k in ("kept", "dropped", "packed_sequences")} == {
        "kept": 1,
        "dropped": 12,
        "packed_sequences": 1,
    }

    result = run(recipe.model_copy(update={"output_dir": str(tmp_path / "run2")}))
    assert ContextSpec.load(result.adapter_dir).vocab_size == len(tokenizer)
    model = longpeft.load(None, result.adapter_dir)  # resizes the stock base to the adapter's vocabulary
    assert model.get_input_embeddings().num_embeddings == len(tokenizer)
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[head_two, 5, 6]])).logits).all()


def test_data_utk_refuses_conversations_and_untrained_embeddings():
    from longpeft.recipes.schema import RecipeError, load_recipe

    with pytest.raises(RecipeError, match="data.utk augments plain text"):
        load_recipe("tiny-cpu", ["data.utk.probability=0.5"])
    with pytest.raises(RecipeError, match="lora.embeddings: full"):
        load_recipe(
            "tiny-cpu", ["data.format=text", "data.source=x.jsonl", "data.utk.probability=0.5", "lora.embeddings=none"]
        )
