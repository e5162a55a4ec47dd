"""The training samples' token counts for the planner (``longpeft plan --gpus N``), by the runner's own rules and
functions (:func:`.data.build_dataset`), without loading the model and without downloading anything: the tokenizer
only when it is on this machine (else the lengths are estimated at :data:`CHARS_PER_TOKEN` characters per token),
the data only when it is here or generated (a Hub dataset: the planner assumes ``data.max_length`` tokens per sample).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm
from transformers import AutoTokenizer

from ..base_config import TINY_PREFIX, model_location
from ..errors import DataError
from ..files import is_local
from ..scale.lengths import SampleLengths
from ..synth_data.utk import add_utk_tokens
from ..tiny import demo_tokenizer
from .data import (
    GENERATED_SOURCES,
    load_training_data,
    longest_sample,
    select_for_training,
    synth_output_file,
    token_lengths,
    tokenize_dataset,
    utk_document_room,
    utk_groups,
)
from .schema import Recipe

# Characters per token of English text with today's BPE vocabularies (a rule of thumb that errs long for Llama-3's).
CHARS_PER_TOKEN = 4.0


def local_tokenizer(recipe: Recipe) -> tuple[Any | None, str]:
    """The recipe's tokenizer as the runner sets it up (UtK's tokens added), only from this machine; else None and
    why. Never downloads."""
    name = recipe.model.name_or_path
    if name.startswith(TINY_PREFIX):
        tokenizer = demo_tokenizer()  # the one materialize_tiny_base saves beside a tiny: model
    else:
        location = model_location(name)
        try:
            tokenizer = AutoTokenizer.from_pretrained(
                location,
                revision=recipe.model.revision,
                trust_remote_code=recipe.model.trust_remote_code,
                local_files_only=True,
            )
        except (OSError, ValueError) as error:
            if is_local(location):
                return (
                    None,
                    f"the tokenizer of {name} does not load from its folder ({str(error).splitlines()[0][:160]})",
                )
            return None, f"the tokenizer of {name} is not in the Hugging Face cache (the planner downloads nothing)"
    if recipe.data.utk is not None:
        add_utk_tokens(tokenizer, max(recipe.data.utk.chunk_counts))
    return tokenizer, ""


def count_sample_lengths(recipe: Recipe, progress: bool = True) -> SampleLengths:
    """The tokens of every sample the recipe trains on, after its length filters, truncation and packing;
    :meth:`SampleLengths.not_known` with the reason when the data is not on this machine. Raises what the runner
    raises for the same data."""
    source = recipe.data.source
    generated = source in GENERATED_SOURCES
    if not generated and not Path(source).exists():
        return SampleLengths.not_known(
            f"data.source {source} is not on this machine, and the planner downloads no data set"
        )
    tokenizer, why = local_tokenizer(recipe)
    if tokenizer is None and generated:
        return SampleLengths.not_known(f"data.source {source} is generated with the tokenizer, and {why}")
    dataset = load_training_data(recipe.data, tokenizer)
    scored = None
    if tokenizer is not None:
        tokenized = tokenize_dataset(dataset, tokenizer, recipe.train.assistant_only_loss)
        lengths, scored = token_counts(tokenized, longest_sample(recipe)[0])
        how = "its chat template" if recipe.data.format == "messages" else "an end-of-text token per text"
        counted_with = f"the tokenizer of {recipe.model.name_or_path} ({how})"
    else:
        lengths = estimated_lengths(dataset, progress)
        counted_with = f"an estimate of {CHARS_PER_TOKEN:g} characters per token, {why}" + (
            "; the chat template's own tokens not counted" if recipe.data.format == "messages" else ""
        )
    kept, filtered = trained_lengths(recipe, lengths, scored)
    described = f"the {source} set" if generated else str(synth_output_file(source) or source)  # as the time line says
    return SampleLengths(lengths=tuple(kept), source=described, counted_with=counted_with, filtered=filtered)


def token_counts(tokenized: Any, limit: int) -> tuple[list[int], list[bool] | None]:
    """Tokens of each row of a tokenized training set (:func:`~.data.tokenize_dataset`), and with assistant masks
    whether a scored token lies within its first ``limit`` tokens (TRL drops a sample its cut leaves without one).
    Reads the Arrow columns a batch at a time: no row's ids become Python lists."""
    if "assistant_masks" not in tokenized.column_names:
        return token_lengths(tokenized), None
    scored: list[bool] = []
    for table in tokenized.select_columns(["assistant_masks"]).with_format("arrow").iter(batch_size=1024):
        masks = table["assistant_masks"].combine_chunks()
        offsets, values = masks.offsets.to_numpy(), masks.values.to_numpy()
        scored += [
            bool(values[start : min(end, start + limit)].any()) for start, end in zip(offsets[:-1], offsets[1:])
        ]
    return token_lengths(tokenized), scored


def estimated_lengths(dataset: Any, progress: bool = True) -> list[int]:
    """Tokens of each row of a loaded training set (``messages`` or ``text``) at :data:`CHARS_PER_TOKEN`
    characters per token, rounded up: conversations count the characters of their turns' contents."""
    column = "messages" if "messages" in dataset.column_names else "text"
    lengths = []
    with tqdm(total=len(dataset), desc="estimating sample lengths", unit="row", disable=not progress) as bar:
        for chunk in dataset.iter(batch_size=256):  # bounded memory: long-context rows are large
            for value in chunk[column]:
                chars = sum(len(turn["content"]) for turn in value) if column == "messages" else len(value)
                lengths.append(math.ceil(chars / CHARS_PER_TOKEN))
            bar.update(len(chunk[column]))
    return lengths


def trained_lengths(
    recipe: Recipe, lengths: list[int], scored: list[bool] | None = None
) -> tuple[list[int], dict[str, int]]:
    """The tokens training sees of samples of these ``lengths`` by the runner's rules, and the filter's counts: the
    samples :func:`~.data.select_for_training` keeps, less those whose cut leaves no scored token (``scored``, from
    :func:`token_counts`), each at most ``data.max_length`` tokens; with ``data.utk``, the packed sequences' lengths
    (UtK's insertions not counted)."""
    keep, stats = select_for_training(recipe, lengths)
    utk, max_length = recipe.data.utk, recipe.data.max_length
    if utk is None:
        if scored is not None:
            left = [i for i in keep if scored[i]]
            stats["dropped_without_scored_tokens"], keep = len(keep) - len(left), left
            stats.update(kept=len(keep), truncated=sum(lengths[i] > max_length for i in keep))
            if not keep:
                raise DataError(
                    f"recipe {recipe.name}: no training sample has a scored token within {longest_sample(recipe)[1]} "
                    "tokens (the cut removed every assistant turn); raise that limit or use shorter samples"
                )
        return [min(lengths[i], max_length) for i in keep], stats
    room = utk_document_room(max_length, utk)
    documents = [min(lengths[i], room) for i in keep]
    groups = utk_groups(documents, max_length, utk)
    stats["packed_sequences"] = len(groups)
    return [sum(documents[i] for i in group) for group in groups], stats
