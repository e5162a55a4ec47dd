"""The training samples' token counts for the planner (``longpeft plan --gpus N``), by the runner's own rules and
functions (:func:`.data.build_dataset`), without loading the model and without downloading anything: the tokenizer
only when it is on this machine (else the lengths are estimated at :data:`CHARS_PER_TOKEN` characters per token),
the data only when it is here or generated (a Hub dataset: the planner assumes ``data.max_length`` tokens per sample);
and the longest sample a recipe can train (``longpeft plan --longest``): the shorter of the memory bound (the
planner's peak per GPU) and the positions bound (the adapted model's, :func:`.validate.check_against_base`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm
from transformers import AutoTokenizer

from ..base_config import TINY_PREFIX, BaseNotHere, model_location, read_base
from ..errors import DataError
from ..files import is_local
from ..scale.lengths import SampleLengths
from ..scale.plan import Plan, longest_fitting, plan_at_length, shape_of
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
from .validate import build_spec, positions_spanned

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
            reason = str(error).splitlines()[0][:160]
            if is_local(location):
                return None, f"the tokenizer of {name} does not load from its folder ({reason})"
            return None, f"the tokenizer of {name} is not in the Hugging Face cache (the planner downloads nothing)"
    if recipe.data.utk is not None:
        add_utk_tokens(tokenizer, max(recipe.data.utk.chunk_counts))
    return tokenizer, ""


def count_sample_lengths(recipe: Recipe, progress: bool = True) -> SampleLengths:
    """The tokens of every sample the recipe trains on, after its length filters, truncation and packing;
    :meth:`SampleLengths.not_known` with the reason when the data is not on this machine. Raises what the runner
    raises for the same data."""
    source, generated = recipe.data.source, recipe.data.source in GENERATED_SOURCES
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
        scored += [bool(values[start : min(end, start + limit)].any()) for start, end in pairwise(offsets)]
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


LIMIT = 1 << 24  # tokens: the longest sample searched


@dataclass
class LongestSample:
    """The longest sample and its bounds, in tokens: ``tokens`` the smaller bound (0: not even ``step``), ``memory``
    (a multiple of ``step``), ``positions`` (None: not known here, with ``positions_source`` saying why; ``LIMIT``:
    none below it) under the adapted model's ``max_positions``; the recipe's ``max_length`` and ``target_length``;
    the memory search's ``gpu_memory_gib`` and ``step``; the ``plan`` at ``tokens`` (at ``step`` when nothing fits).
    """

    tokens: int
    memory: int
    positions: int | None
    max_positions: int | None
    positions_source: str
    max_length: int
    target_length: int | None
    gpu_memory_gib: float
    step: int
    plan: Plan

    def lines(self) -> list[str]:
        """What ``plan --longest`` prints before the plan's table."""
        per_gpu = f"fit in {self.gpu_memory_gib:g} GiB per GPU"
        memory = f"not even {self.step:,} tokens {per_gpu}"
        if self.memory:
            memory = f"up to {self.memory:,} tokens {per_gpu} (multiples of {self.step:,})"
        inside = f"inside the adapted model's {self.max_positions:,} positions" if self.max_positions else ""
        if self.positions is None:
            positions = f"not checked ({self.positions_source})"
        elif self.positions >= LIMIT:
            positions = f"no bound below {LIMIT:,} tokens (the method keeps an input {inside} at any length)"
        else:
            positions = f"up to {self.positions:,} tokens stay {inside} (train refuses a longer data.max_length)"
        target = f", for target_length {self.target_length:,}" if self.target_length else ""
        fits = "fits" if self.max_length <= self.tokens else "does not fit"
        if self.positions is None or self.memory < self.positions:  # what bounds tokens: memory, positions or both
            bound = "memory" + (" (positions not checked)" if self.positions is None else "")
        else:
            bound = "positions" if self.positions < self.memory else "memory and positions"
        return [
            f"longest sample: {self.tokens:,} tokens per GPU sample, bounded by {bound}",
            f"  memory: {memory}",
            f"  positions: {positions}",
            f"  recipe: data.max_length={self.max_length:,}{target}; it {fits}",
        ]


def positions_bound(recipe: Recipe) -> tuple[int | None, int | None, str]:
    """``(longest, max_positions, source)``: the longest ``data.max_length`` (up to ``LIMIT``) whose input stays
    inside the adapted model's positions (:func:`.validate.positions_spanned`), those positions, and where the base's
    config came from; ``(None, None, why)`` without the base's config on this machine."""
    try:
        base = read_base(recipe.model.name_or_path, recipe.model.revision)
    except BaseNotHere as missing:
        return None, None, str(missing)
    spec, source = build_spec(recipe, base.config, recipe.model.name_or_path), base.source
    max_positions = spec.max_position_embeddings
    low, high = 0, LIMIT  # low fits (or is 0), high + 1 does not
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if positions_spanned(spec, middle) <= max_positions else (low, middle - 1)
    return low, max_positions, source


def longest_trainable_sample(
    recipe: Recipe,
    gpus: int = 1,
    gpu_memory_gib: float = 80.0,
    gpu: str = "h100",
    launch: str | None = None,
    step: int = 1024,
) -> LongestSample:
    """The longest sample ``recipe`` trains within ``gpu_memory_gib`` per GPU and the adapted model's positions."""
    shape = shape_of(recipe.model.name_or_path)
    memory, plan = longest_fitting(recipe, gpus, gpu_memory_gib, gpu, shape, launch, step, LIMIT)
    positions, max_positions, source = positions_bound(recipe)
    tokens = memory if positions is None else min(memory, positions)
    if tokens not in (memory, 0):
        plan = plan_at_length(recipe, tokens, gpus, gpu_memory_gib, gpu, shape, launch)
    recipe_lengths = recipe.data.max_length, recipe.target_length
    return LongestSample(tokens, memory, positions, max_positions, source, *recipe_lengths, gpu_memory_gib, step, plan)
