"""The window scheduler: the decoder stack's forward with Activation Beacon.

:func:`beacon_backbone_forward` replaces the forward of the decoder stack (``model.model``): it cuts the new raw
tokens into windows, inserts the beacon embeddings, runs the stock decoder stack once per window (or part of one)
with an explicit mask, explicit positions and the :class:`~.cache.BeaconCache`, and returns the raw tokens' hidden
states only (beacons are never scored).

Training runs all windows in one forward, the memory in the autograd graph. Inference commits a full window when the
next raw token arrives, so decoding inserts the beacons where one prefill would. Rows of a batch share one layout, so
a row whose tokens follow padding is refused unless every ratio is 0; padding after a row's tokens is masked.

This module imports only torch and transformers: it is part of the exported modeling file.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers.generation.configuration_utils import GenerationMode
from transformers.modeling_outputs import BaseModelOutputWithPast

# longpeft-inline-begin
from ...family import cache_keyword, pop_cache
from ...rope import apply_rotary
from .cache import BeaconCache, BeaconStep
from .layout import (
    BeaconSettings,
    attention_mask_for,
    choose_ratio,
    fitting_ratios,
    key_keep,
    step_visibility,
    training_ratios,
    window_keep,
    window_layout,
)
from .parallel import close_group, group_inputs, plan_group

# longpeft-inline-end


def _keep_mask(attention_mask: torch.Tensor | None, n_new: int) -> torch.Tensor | None:
    """``[batch, n_new]`` bool padding mask of the new tokens (None when nothing is padding)."""
    if attention_mask is None or attention_mask.dim() != 2:
        return None
    keep = attention_mask[:, -n_new:].bool()
    return None if bool(keep.all()) else keep.cpu()


def _check_no_padding_before_tokens(keep_new: torch.Tensor | None, state, ratios: tuple[int, ...]) -> None:
    """Refuse a batch in which a row's token follows padding (``keep_new [batch, n]``: the new tokens' padding mask;
    ``state``: the cache's, of what came before), unless every ratio in use is 0 (no beacon is inserted): windows
    start at the same index in every row, so such a row's windows would differ from those of its prompt alone."""
    padded = [~keep for keep in (state.memory_keep, state.window_keep) if keep is not None]
    if not any(ratios) or (keep_new is None and not padded):
        return
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


def _check_cache(cache) -> None:
    """Refuse a cache other than a :class:`BeaconCache` (None is fine: a new request)."""
    if cache is not None and not isinstance(cache, BeaconCache):
        name = cache_keyword()
        raise ValueError(
            f"Activation Beacon keeps its memory in a BeaconCache, got a {type(cache).__name__}: pass "
            f"{name}=BeaconCache() or None (a new request) and continue with the returned outputs.{name}"
        )


def _check_checkpointing(backbone: torch.nn.Module) -> None:
    for layer in backbone.layers:
        function = getattr(layer, "_gradient_checkpointing_func", None)
        if layer.gradient_checkpointing and getattr(function, "keywords", {}).get("use_reentrant"):
            raise ValueError(
                "Activation Beacon needs non-reentrant gradient checkpointing (the memory is written inside the "
                "checkpointed layers); enable it with gradient_checkpointing_kwargs={'use_reentrant': False}"
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

    @classmethod
    def start(
        cls,
        backbone: torch.nn.Module,
        given: BeaconCache | None,
        n_new: int,
        inputs_embeds: torch.Tensor | None,
        cache_name: str,
        kwargs: dict,
    ) -> _BeaconRun:
        """A call over ``n_new`` new raw tokens continuing the cache ``given`` (None: a new one), after refusing
        another kind of cache and, in training, reentrant checkpointing and the inference-only kept spans."""
        settings: BeaconSettings = backbone.beacon_settings
        _check_cache(given)
        cache = BeaconCache() if given is None else given
        if backbone.training:
            _check_checkpointing(backbone)
            if settings.keep_start or settings.keep_end is not None:
                raise ValueError(
                    "beacon keep_start / keep_end are inference settings (the authors' Qwen2 options to leave the "
                    "start or the end of a prompt uncondensed); train without them (keep_start 0, keep_end null) and "
                    "set them on the trained model, or switch the model to eval mode"
                )
        dtype = inputs_embeds.dtype if inputs_embeds is not None else backbone.embed_tokens.weight.dtype
        return cls(
            backbone=backbone,
            settings=settings,
            cache=cache,
            complete=backbone.training and given is None,
            total=cache.state.raw_seen + n_new,
            beacon_row=backbone.beacon_embed_tokens.weight[0].to(dtype),
            kwargs={**kwargs, cache_name: cache, "use_cache": True},
        )

    def rotate(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE ``keys [b, h, n, d]`` rotated at ``positions [n]`` by the model's rotary module."""
        cos, sin = self.backbone.rotary_emb(keys, positions[None].to(keys.device))
        return apply_rotary(keys, cos.unsqueeze(1), sin.unsqueeze(1))

    def layout_at(self, start: int):
        """The layout of the window that begins at raw token ``start`` (its ratio drawn now: call once per window, in
        order), or None when its ratio is to be chosen in the forward that fills it: appended beacons under
        ``layout_rule: authors`` in a window that this call does not fill (the authors' code chooses a window's ratio
        when it is full, counting the tokens known then; the raw slots are laid out alike at every ratio).
        ``keep_start``: the first window is the kept start, at ratio 0; ``keep_end``: windows from there on are at
        ratio 0. A training forward over a whole input (``complete``): the window that reaches its end has no beacons.
        """
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
        outputs = type(self.backbone).forward(
            self.backbone,
            inputs_embeds=embeds.index_copy(1, raw_rows, raw_embeds),
            attention_mask=mask,
            position_ids=positions.to(raw_embeds.device),
            beacon_step=step,
            **self.kwargs,
        )
        return outputs.last_hidden_state


def _run_step(
    run: _BeaconRun, layout, take: int, raw_embeds: torch.Tensor, keep_raw: torch.Tensor | None, keep_last: int | None
) -> torch.Tensor:
    """Feed ``take`` more raw tokens of the open window (``raw_embeds [batch, take, hidden]``, padding mask
    ``keep_raw [batch, take]`` or None) with the beacons they bring: their ``[batch, take (or keep_last), hidden]``."""
    state, device = run.cache.state, raw_embeds.device
    start, end = state.window_slots, layout.slots_for(state.window_raw + take)
    is_beacon = layout.is_beacon[start:end]
    raw_rows = (~is_beacon).nonzero().flatten().to(device)
    beacon_rows = is_beacon.nonzero().flatten().to(device)
    state.window_keep = window_keep(layout, state.window_keep, start, end, keep_raw, raw_rows)
    keys = key_keep(state.memory_length, end, state.memory_keep, state.window_keep)
    visible = step_visibility(layout, state.memory_length, start, end, keys)
    positions = (state.memory_length + layout.offsets[start:end])[None]
    step = BeaconStep(state.window_index, state.memory_length, start, end, beacon_rows)
    hidden = run.decoder_stack(raw_embeds, raw_rows, step, visible, keys, positions)
    state.window_raw += take
    state.window_slots = end
    state.raw_seen += take
    return hidden.index_select(1, raw_rows if keep_last is None else raw_rows[-keep_last:])


def _run_group(
    run: _BeaconRun, layout, windows: int, raw_embeds: torch.Tensor, keep_raw: torch.Tensor | None
) -> torch.Tensor:
    """Run ``windows`` full windows of ``layout`` (``raw_embeds [batch, windows * W, hidden]``) in one forward
    (:mod:`.parallel`); returns their raw tokens' hidden states ``[batch, windows * W, hidden]``."""
    batch, _, hidden_size = raw_embeds.shape
    sink, rule = run.settings.sink, run.settings.layout_rule
    inputs = group_inputs(layout, windows, run.cache.state, sink, rule, batch, keep_raw, run.rotate)
    raw_rows = (~layout.is_beacon).nonzero().flatten().to(raw_embeds.device)
    rows = raw_embeds.reshape(batch * windows, layout.window, hidden_size)
    hidden = run.decoder_stack(rows, raw_rows, inputs.step, inputs.visible, inputs.keys, inputs.positions)
    close_group(run.cache.state, layout, inputs)
    return hidden.index_select(1, raw_rows).reshape(batch, windows * layout.window, hidden_size)


def _next_part(run: _BeaconRun, remaining: int, pending):
    """``(layout, windows, take, pending)`` of the next step of the window loop, with ``remaining`` new raw tokens to
    go: the open window's layout, the windows of its group (:func:`.parallel.plan_group`; 1: a step of one window),
    the raw tokens the step takes, and the layout chosen for the window after the group (``pending``: the last one's,
    or None). Commits the open window when it is full, and chooses a deferred ratio when this step fills its window.
    """
    state, settings = run.cache.state, run.settings
    if state.layout is not None and state.window_raw == state.layout.window:
        run.cache.commit(run.rotate, settings.sink, settings.layout_rule)
    windows = 1
    if state.layout is None:
        layout = pending or run.layout_at(state.raw_seen)
        state.ratio_deferred = layout is None  # laid out without beacons until it fills
        state.layout = layout or window_layout(settings.window, 0, *settings.scheme)
        most = 1 if run.backbone.training else settings.parallel_windows
        windows, pending = plan_group(state.layout, run.layout_at, state.raw_seen, settings.window, remaining, most)
    layout = state.layout
    take = windows * layout.window if windows > 1 else min(remaining, layout.window - state.window_raw)
    if state.ratio_deferred and state.window_raw + take == layout.window:  # the authors' ratio, chosen now
        layout = state.layout = run.layout_at(state.raw_seen - state.window_raw)
        state.ratio_deferred = False
    return layout, windows, take, pending


def _refuse_unsupported_call(backbone: torch.nn.Module, input_ids, inputs_embeds, kwargs: dict) -> None:
    """Refuse both or neither of ``input_ids`` and ``inputs_embeds``, and hidden states or attention weights asked
    for (in ``kwargs`` or the config)."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("give exactly one of input_ids or inputs_embeds")
    for name in ("output_hidden_states", "output_attentions"):
        if kwargs.get(name, getattr(backbone.config, name, False)):
            raise ValueError(
                f"{name}=True is not supported with Activation Beacon (the decoder stack runs window by "
                "window, over beacons and memory); leave it off, or switch beacons off "
                "(beacons_disabled) to get the stock model's"
            )


def beacon_backbone_forward(
    self: torch.nn.Module,
    input_ids: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
    use_cache: bool | None = None,
    **kwargs,
) -> BaseModelOutputWithPast:
    """The decoder stack's forward with beacons (bound to ``model.model`` by ``install_beacon``).

    Args:
        input_ids: ``[batch, n]`` new raw tokens (or ``inputs_embeds [batch, n, hidden]``).
        attention_mask: ``[batch, seen + n]`` (or ``[batch, n]``) 1 for tokens, 0 for padding.
        position_ids, use_cache: ignored: positions follow the beacon layout, and the memory is always used.
        cache (in kwargs; ``past_key_values`` before transformers 5.24): a :class:`BeaconCache` to continue, or
            None for a new one (any other cache is refused).
        beacon_keep_last (in kwargs): ``k``, return the last ``k`` raw tokens' hidden states only (the causal LM
            passes its int ``logits_to_keep``).
        output_hidden_states, output_attentions (in kwargs or the config): refused when true.

    Returns:
        ``last_hidden_state [batch, n (or k), hidden]`` of the raw tokens and the cache to continue with (as
        ``cache``, or ``past_key_values`` before transformers 5.24).
    """
    keep_last = kwargs.pop("beacon_keep_last", None)
    given, cache_name = pop_cache(kwargs), cache_keyword()
    if not self.beacons_enabled:
        return type(self).forward(
            self,
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **{cache_name: given},
            **kwargs,
        )
    _refuse_unsupported_call(self, input_ids, inputs_embeds, kwargs)
    n_new = (input_ids if input_ids is not None else inputs_embeds).shape[1]
    run = _BeaconRun.start(self, given, n_new, inputs_embeds, cache_name, kwargs)
    keep_new = _keep_mask(attention_mask, n_new)
    _check_no_padding_before_tokens(keep_new, run.cache.state, run.settings.ratio_choice(self.training)[0])
    outputs, done, pending = [], 0, None
    while done < n_new:
        layout, windows, take, pending = _next_part(run, n_new - done, pending)
        # embedded a window (or a group) at a time: a long prompt never holds all its embeddings at once
        part = slice(done, done + take)
        raw_embeds = inputs_embeds[:, part] if inputs_embeds is not None else self.embed_tokens(input_ids[:, part])
        keep_raw = None if keep_new is None else keep_new[:, part]
        if windows > 1:
            hidden = _run_group(run, layout, windows, raw_embeds, keep_raw)
        else:
            hidden = _run_step(run, layout, take, raw_embeds, keep_raw, keep_last)
        outputs.append(hidden if keep_last is None else hidden[:, -keep_last:])
        if keep_last is not None:
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
