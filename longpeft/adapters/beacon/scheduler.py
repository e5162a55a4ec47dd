"""The window scheduler: the decoder stack's forward with Activation Beacon.

:func:`beacon_backbone_forward` replaces the forward of the decoder stack (``model.model``): it cuts the new raw
tokens into windows, inserts the beacon embeddings, runs the stock decoder stack once per window (or part of one, or
up to ``parallel_windows`` full windows of one layout in a prefill: :func:`_run_group`) with an explicit mask,
explicit positions and the :class:`~.cache.BeaconCache`, and returns the raw tokens' hidden states only. Training
runs all windows in one forward, the memory in the autograd graph; inference commits a full window when the next raw
token arrives, so decoding inserts the beacons where one prefill would. Rows of a batch share one layout: a row whose
tokens follow padding is refused unless every ratio is 0; padding after a row's tokens is masked.

This module imports only torch and transformers: it is part of the exported modeling file."""

from __future__ import annotations

import dataclasses

import torch
from transformers.generation.configuration_utils import GenerationMode
from transformers.modeling_outputs import BaseModelOutputWithPast

# longpeft-inline-begin
from ...family import cache_keyword, pop_cache
from ...rope import apply_rotary
from .cache import BeaconCache, BeaconStep, WindowGroup, committed_slots
from .layout import (
    BeaconSettings,
    WindowLayout,
    attention_mask_for,
    choose_ratio,
    fitting_ratios,
    key_keep,
    padding_keep,
    step_visibility,
    training_ratios,
    window_keep,
    window_layout,
)

# longpeft-inline-end


def _keep_new(attention_mask: torch.Tensor | None, n_new: int, state, ratios: tuple[int, ...]) -> torch.Tensor | None:
    """``[batch, n_new]`` bool on the CPU, False at the new tokens' padding (None: none), from the forward's 2-D
    ``attention_mask``. Refuses a batch in which a row's token follows padding (``state``: the cache's, of what came
    before), unless every ratio in use is 0 (no beacon is inserted): windows start at the same index in every row,
    so such a row's windows would differ from those of its prompt alone."""
    keep_new = None
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask[:, -n_new:].all()):
        keep_new = attention_mask[:, -n_new:].bool().cpu()
    padded = [~keep for keep in (state.memory_keep, state.window_keep) if keep is not None]
    if not any(ratios) or (keep_new is None and not padded):
        return keep_new
    # [batch]: the rows with padding so far, then those with a token after padding
    follows = torch.cat(padded, dim=1).any(dim=1) if padded else torch.zeros(keep_new.shape[0], dtype=torch.bool)
    if keep_new is not None:
        follows = (keep_new & (follows[:, None] | (~keep_new).cumsum(dim=1).bool())).any(dim=1)
    if bool(follows.any()):
        row = int(follows.nonzero()[0])
        raise ValueError(
            f"Activation Beacon: row {row} of the batch has tokens after padding (left padding); beacon windows "
            "start at the same index in every row, so its windows would differ from its prompt alone and give other "
            "logits: batch prompts of one length, or give one prompt at a time"
        )
    return keep_new


def _check_cache(cache) -> None:
    """Refuse a cache other than a :class:`BeaconCache` (None is fine: a new request)."""
    if cache is not None and not isinstance(cache, BeaconCache):
        name = cache_keyword()
        raise ValueError(
            f"Activation Beacon keeps its memory in a BeaconCache, got a {type(cache).__name__}: pass "
            f"{name}=BeaconCache() or None (a new request) and continue with the returned outputs.{name}"
        )


def _refuse_unsupported_call(backbone: torch.nn.Module, input_ids, inputs_embeds, given, kwargs: dict) -> None:
    """Refuse both or neither of ``input_ids`` and ``inputs_embeds``, hidden states or attention weights asked for
    (in ``kwargs`` or the config), a cache ``given`` other than a :class:`BeaconCache`, and in training reentrant
    gradient checkpointing and the inference-only kept spans."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("give exactly one of input_ids or inputs_embeds")
    for name in ("output_hidden_states", "output_attentions"):
        if kwargs.get(name, getattr(backbone.config, name, False)):
            raise ValueError(
                f"{name}=True is not supported with Activation Beacon (the decoder stack runs window by "
                "window, over beacons and memory); leave it off, or switch beacons off "
                "(beacons_disabled) to get the stock model's"
            )
    _check_cache(given)
    if not backbone.training:
        return
    for layer in backbone.layers:
        function = getattr(layer, "_gradient_checkpointing_func", None)
        if layer.gradient_checkpointing and getattr(function, "keywords", {}).get("use_reentrant"):
            raise ValueError(
                "Activation Beacon needs non-reentrant gradient checkpointing (the memory is written inside the "
                "checkpointed layers); enable it with gradient_checkpointing_kwargs={'use_reentrant': False}"
            )
    if backbone.beacon_settings.keep_start or backbone.beacon_settings.keep_end is not None:
        raise ValueError(
            "beacon keep_start / keep_end are inference settings (the authors' Qwen2 options to leave the "
            "start or the end of a prompt uncondensed); train without them (keep_start 0, keep_end null) and "
            "set them on the trained model, or switch the model to eval mode"
        )


@dataclasses.dataclass
class _BeaconRun:
    """One call of :func:`beacon_backbone_forward`: what its windows read."""

    backbone: torch.nn.Module  # the decoder stack
    settings: BeaconSettings
    cache: BeaconCache
    complete: bool  # a training forward over a whole input (no cache passed in)
    total: int  # raw tokens the cache has read once this call ends
    beacon_row: torch.Tensor  # ``[hidden]``: the beacon embedding, in the inputs' dtype
    kwargs: dict  # the decoder stack's keyword arguments besides the step's: the cache, and the caller's others

    def rotate(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE ``keys [b, h, n, d]`` rotated at ``positions [n]`` by the model's rotary module."""
        cos, sin = self.backbone.rotary_emb(keys, positions[None].to(keys.device))
        return apply_rotary(keys, cos.unsqueeze(1), sin.unsqueeze(1))

    def layout_at(self, start: int):
        """The layout of the window that begins at raw token ``start`` (its ratio drawn now: call once per window, in
        order), or None when its ratio is chosen in the forward that fills it: appended beacons under ``layout_rule:
        authors`` in a window this call does not fill (their code counts the tokens known when a window is full).
        Ratio 0 for the kept start and from ``keep_end`` on, and in the window that ends a ``complete`` input."""
        settings, state, length, complete = self.settings, self.cache.state, self.total, self.complete
        window, scheme, rule = settings.window, settings.scheme, settings.layout_rule
        if settings.keep_start and start == 0:
            return window_layout(settings.keep_start, 0, *scheme)
        if settings.keep_end is not None and start >= settings.keep_end:
            return window_layout(window, 0, *scheme)
        if rule == "authors" and settings.pos == "append" and not complete and start + window > length:
            return None
        ratios, mix = settings.ratio_choice(self.backbone.training)
        if self.backbone.training and settings.zero_ratio_rule == "authors":
            ratios = training_ratios(ratios, window, start, length, state.zero_ratio_used)
        max_positions, keep = self.backbone.config.max_position_embeddings, (settings.keep_start, settings.keep_end)
        if mix == "sequence":  # the cycle is fixed at the input's first window
            if state.ratio_cycle is None:
                state.ratio_cycle = fitting_ratios(
                    ratios, window, settings.sink, max_positions, length, complete, keep, rule, scheme
                )
            ratio = state.ratio_cycle[(start - settings.keep_start) // window % len(state.ratio_cycle)]
        else:
            chosen = state.chosen_ratio
            ratio = choose_ratio(
                ratios, mix, window, max_positions, length, chosen, settings.sink, complete, rule, keep, scheme
            )
        if mix.startswith("adapt-") or mix == "instance-random":
            state.chosen_ratio = ratio
        state.zero_ratio_used |= ratio == 0
        if complete and start + window >= length:
            ratio = 0  # no beacons in the window that ends a training input
        return window_layout(window, ratio, *scheme)

    def decoder_stack(
        self,
        raw_embeds: torch.Tensor,
        raw_rows: torch.Tensor,
        step: BeaconStep,
        visible: torch.Tensor,
        keys: torch.Tensor | None,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        """The stock decoder stack over the step's slots, ``raw_embeds [rows, n, hidden]`` at ``raw_rows [n]`` and the
        beacon embedding in the others, with the mask of ``visible`` and ``keys`` (:func:`.layout.attention_mask_for`)
        and ``positions [rows or 1, slots]``, reading and writing the beacon cache: the last hidden states of every
        slot, ``[rows, slots, hidden]``."""
        embeds = self.beacon_row.expand(raw_embeds.shape[0], step.end - step.start, -1).clone()
        implementation = self.backbone.config._attn_implementation or "eager"
        mask = attention_mask_for(visible, keys, implementation, raw_embeds.dtype, raw_embeds.device)
        embeds, positions = embeds.index_copy(1, raw_rows, raw_embeds), positions.to(raw_embeds.device)
        inputs = {"inputs_embeds": embeds, "attention_mask": mask, "position_ids": positions, "beacon_step": step}
        return type(self.backbone).forward(self.backbone, **inputs, **self.kwargs).last_hidden_state


def _run_step(run: _BeaconRun, take: int, raw_embeds: torch.Tensor, keep_raw: torch.Tensor | None) -> torch.Tensor:
    """Feed ``take`` more raw tokens of the open window (``raw_embeds [batch, take, hidden]``, padding mask
    ``keep_raw [batch, take]`` or None) with the beacons they bring; returns their ``[batch, take, hidden]``."""
    state, layout, device = run.cache.state, run.cache.state.layout, raw_embeds.device
    start, end = state.window_slots, layout.slots_for(state.window_raw + take)
    is_beacon = layout.is_beacon[start:end]
    raw_rows, beacon_rows = (~is_beacon).nonzero().flatten().to(device), is_beacon.nonzero().flatten().to(device)
    state.window_keep = window_keep(layout, state.window_keep, start, end, keep_raw)
    keys = key_keep(state.memory_length, end, state.memory_keep, state.window_keep)
    visible = step_visibility(layout, state.memory_length, start, end, keys)
    positions = (state.memory_length + layout.offsets[start:end])[None]
    step = BeaconStep(state.window_index, state.memory_length, start, end, beacon_rows)
    hidden = run.decoder_stack(raw_embeds, raw_rows, step, visible, keys, positions)
    state.window_raw, state.window_slots, state.raw_seen = state.window_raw + take, end, state.raw_seen + take
    return hidden.index_select(1, raw_rows)


def _run_group(run: _BeaconRun, take: int, raw_embeds: torch.Tensor, keep_raw: torch.Tensor | None) -> torch.Tensor:
    """Run the ``P = take / W`` full windows of the open window's layout (``raw_embeds [B, take, hidden]``, padding
    mask ``keep_raw [B, take]`` or None) in one forward, as the rows of one batch (:class:`~.cache.WindowGroup`): row
    ``b * P + p`` reads the memory, the new entries of windows ``0 .. p-1`` and its own window. The cache ends as
    after ``P`` steps of one window: windows ``0 .. P-2`` committed, the last open and full. Returns the raw tokens'
    hidden states ``[B, take, hidden]``."""
    state, layout, (batch, _, hidden_size) = run.cache.state, run.cache.state.layout, raw_embeds.shape
    windows, slots, memory = take // layout.window, len(layout.is_beacon), state.memory_length
    sink, rule = run.settings.sink, run.settings.layout_rule
    raw_rows = (~layout.is_beacon).nonzero().flatten().to(raw_embeds.device)
    # the G new memory entries: those each window but the last commits, in memory order
    kept = [committed_slots(layout, slots, state.window_index + p, sink, rule) for p in range(windows - 1)]
    starts = [memory]  # memory length before each window
    for entries in kept:
        starts.append(starts[-1] + entries.numel())
    entry_window = torch.cat([torch.full((entries.numel(),), p) for p, entries in enumerate(kept)])
    entry_positions = torch.arange(memory, starts[-1])
    computed_at = torch.cat([start + layout.offsets[entries] for start, entries in zip(starts, kept)])
    rotate = computed_at != entry_positions
    group = WindowGroup(windows, entry_window, torch.cat(kept), entry_positions, rotate, run.rotate)
    # the keys [B * P, K = M + G + L] each row may read: padding and later windows' entries hidden
    raw_keeps = [None] * windows if keep_raw is None else keep_raw.split(layout.window, dim=1)
    window_keeps = [None if keep is None else window_keep(layout, None, 0, slots, keep) for keep in raw_keeps]
    entry_keep = padding_keep(
        *[(None if keep is None else keep[:, entries], entries.numel()) for keep, entries in zip(window_keeps, kept)]
    )  # [B, G] or None
    read = entry_window[None, :] < torch.arange(windows)[:, None]  # [P, G]: row p reads windows before it
    memory_keep = torch.ones(batch, memory, dtype=torch.bool) if state.memory_keep is None else state.memory_keep
    entries = read[None] if entry_keep is None else read[None] & entry_keep[:, None]  # [B or 1, P, G]
    own = torch.stack(
        [torch.ones(batch, slots, dtype=torch.bool) if keep is None else keep for keep in window_keeps], dim=1
    )  # [B, P, L]
    keys = torch.cat(
        [memory_keep[:, None].expand(batch, windows, memory), entries.expand(batch, windows, -1), own], dim=2
    ).reshape(batch * windows, -1)
    visible = step_visibility(layout, starts[-1], 0, slots, keys)
    positions = (torch.tensor(starts)[:, None] + layout.offsets[None]).repeat(batch, 1)  # window p after its memory
    beacon_rows = layout.is_beacon.nonzero().flatten().to(raw_embeds.device)
    step = BeaconStep(state.window_index, memory, 0, slots, beacon_rows, group)
    rows = raw_embeds.reshape(batch * windows, layout.window, hidden_size)
    hidden = run.decoder_stack(rows, raw_rows, step, visible, keys, positions)
    state.memory_keep = padding_keep((state.memory_keep, memory), (entry_keep, starts[-1] - memory))
    state.memory_length, state.window_index = starts[-1], state.window_index + windows - 1
    state.window_raw, state.window_slots, state.window_keep = layout.window, slots, window_keeps[-1]
    state.raw_seen += take
    return hidden.index_select(1, raw_rows).reshape(batch, take, hidden_size)


def _plan_group(run: _BeaconRun, remaining: int) -> tuple[int, WindowLayout | None]:
    """``(windows, pending)``: how many windows, up to ``parallel_windows`` (in training 1), run in the group that
    begins with the open window, with ``remaining`` new raw tokens from its start (only full windows join), and the
    layout chosen for the window after the group when it could not join (another ratio or size), else None. Lays out
    (draws the ratio of) each window it looks at, in order."""
    first, start, window = run.cache.state.layout, run.cache.state.raw_seen, run.settings.window
    most = 1 if run.backbone.training else run.settings.parallel_windows
    if most < 2 or remaining < first.window:
        return 1, None
    count, used = 1, first.window
    while count < most and remaining - used >= window:
        layout = run.layout_at(start + used)
        if (layout.ratio, layout.window) != (first.ratio, first.window):
            return count, layout
        count, used = count + 1, used + window
    return count, None


def _next_part(run: _BeaconRun, remaining: int, pending: WindowLayout | None) -> tuple[int, int, WindowLayout | None]:
    """``(windows, take, pending)`` of the next step of the window loop, with ``remaining`` new raw tokens to go: the
    windows of the open window's group (:func:`_plan_group`; 1: a step of one window), the raw tokens the step takes,
    and the layout chosen for the window after the group (``pending``: the last one's, or None). Commits the open
    window when it is full, and chooses a deferred ratio when this step fills its window."""
    state, settings = run.cache.state, run.settings
    if state.layout is not None and state.window_raw == state.layout.window:
        run.cache.commit(run.rotate, settings.sink, settings.layout_rule)
    windows = 1
    if state.layout is None:
        layout = pending or run.layout_at(state.raw_seen)
        state.ratio_deferred = layout is None  # laid out without beacons until it fills
        state.layout = layout or window_layout(settings.window, 0, *settings.scheme)
        windows, pending = _plan_group(run, remaining)
    take = windows * state.layout.window if windows > 1 else min(remaining, state.layout.window - state.window_raw)
    if state.ratio_deferred and state.window_raw + take == state.layout.window:  # the authors' ratio, chosen now
        state.layout = run.layout_at(state.raw_seen - state.window_raw)
        state.ratio_deferred = False
    return windows, take, pending


def beacon_backbone_forward(
    self: torch.nn.Module,
    input_ids: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
    use_cache: bool | None = None,
    **kwargs,
) -> BaseModelOutputWithPast:
    """The decoder stack's forward with beacons (bound to ``model.model`` by ``install_beacon``), over ``input_ids
    [batch, n]`` new raw tokens (or ``inputs_embeds [batch, n, hidden]``) with ``attention_mask [batch, seen + n]``
    (or ``[batch, n]``), 1 for tokens and 0 for padding. ``position_ids`` and ``use_cache`` are ignored: positions
    follow the beacon layout, and the memory is always used. In ``kwargs``: ``cache`` (``past_key_values`` before
    transformers 5.24), a :class:`BeaconCache` to continue or None for a new one (any other cache is refused);
    ``beacon_keep_last``, ``k`` to return the last ``k`` raw tokens' hidden states only (the causal LM passes its int
    ``logits_to_keep``); ``output_hidden_states`` or ``output_attentions`` (or the config's) true are refused.
    Returns ``last_hidden_state [batch, n (or k), hidden]`` of the raw tokens and the cache to continue with.
    """
    keep_last, given, cache_name = kwargs.pop("beacon_keep_last", None), pop_cache(kwargs), cache_keyword()
    if not self.beacons_enabled:
        stock = dict(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache
        )
        return type(self).forward(self, inputs_embeds=inputs_embeds, **{cache_name: given}, **stock, **kwargs)
    _refuse_unsupported_call(self, input_ids, inputs_embeds, given, kwargs)
    n_new = (input_ids if input_ids is not None else inputs_embeds).shape[1]
    cache = BeaconCache() if given is None else given
    dtype = inputs_embeds.dtype if inputs_embeds is not None else self.embed_tokens.weight.dtype
    beacon_row, kwargs = self.beacon_embed_tokens.weight[0].to(dtype), {**kwargs, cache_name: cache, "use_cache": True}
    run = _BeaconRun(
        self,
        self.beacon_settings,
        cache,
        self.training and given is None,
        cache.state.raw_seen + n_new,
        beacon_row,
        kwargs,
    )
    keep_new = _keep_new(attention_mask, n_new, cache.state, run.settings.ratio_choice(self.training)[0])
    outputs, done, pending = [], 0, None
    while done < n_new:
        windows, take, pending = _next_part(run, n_new - done, pending)
        # embedded a window (or a group) at a time: a long prompt never holds all its embeddings at once
        part = slice(done, done + take)
        raw_embeds = inputs_embeds[:, part] if inputs_embeds is not None else self.embed_tokens(input_ids[:, part])
        keep_raw = None if keep_new is None else keep_new[:, part]
        outputs.append((_run_group if windows > 1 else _run_step)(run, take, raw_embeds, keep_raw))
        if keep_last is not None:  # only the last k raw tokens' hidden states are returned
            outputs = [torch.cat(outputs, dim=1)[:, -keep_last:]]
        done += take
    return BaseModelOutputWithPast(last_hidden_state=torch.cat(outputs, dim=1), **{cache_name: run.cache})


def beacon_prepare_cache_for_generation(
    self, generation_config, model_kwargs: dict, generation_mode, batch_size: int, max_cache_length: int
) -> None:
    """``generate``'s cache set-up for a beacon model: a new :class:`BeaconCache` per call (or the caller's, which it
    continues); other caches, and decoding methods that would reorder or crop the memory, are refused. With beacons
    switched off, the stock set-up."""
    if not getattr(self, self.base_model_prefix).beacons_enabled:
        return type(self)._prepare_cache_for_generation(
            self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
        )
    if generation_mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        raise ValueError(
            f"Activation Beacon supports greedy and sampling generation, not {generation_mode.value} (its memory "
            "cannot be reordered or rolled back); set num_beams=1 and do not pass an assistant model"
        )
    if generation_config.cache_implementation not in (None, "dynamic"):
        raise ValueError(
            f"Activation Beacon brings its own cache; cache_implementation={generation_config.cache_implementation!r} "
            "cannot be used with it"
        )
    name = cache_keyword()
    _check_cache(model_kwargs.get(name))
    if model_kwargs.get(name) is None and generation_config.use_cache is not False:
        model_kwargs[name] = BeaconCache()
