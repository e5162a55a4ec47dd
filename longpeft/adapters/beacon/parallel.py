"""Parallel windows: several full windows of a prefill in one forward of the decoder stack, with the logits of
running them one after another (docs/beacon.md says why this is exact).

The ``P`` windows, of one layout, are ``P`` rows of one batch (:class:`~.cache.WindowGroup`): row ``p`` reads the
memory, the new entries of windows ``0 .. p-1`` and its own window; the cache ends as after ``P`` sequential steps.

This module imports only torch: it is part of the exported modeling file.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

# longpeft-inline-begin
from .cache import BeaconStep, Rotate, SequenceState, WindowGroup, committed_slots
from .layout import WindowLayout, padding_keep, step_visibility, window_keep

# longpeft-inline-end


def plan_group(
    first: WindowLayout, next_layout: Callable[[int], WindowLayout], start: int, window: int, remaining: int, most: int
) -> tuple[int, WindowLayout | None]:
    """``(windows, pending)``: how many windows, up to ``most`` (``parallel_windows``; 1: ``first`` alone), run in the
    group that begins with ``first`` at raw token ``start``, with ``remaining`` new raw tokens from there (only full
    windows of ``window`` tokens join), and the layout chosen for the window after the group when it could not join
    (another ratio or size), else None. ``next_layout(start)`` lays out (draws the ratio of) the window beginning at
    raw token ``start``: it is called once per window, in order."""
    if most < 2 or remaining < first.window:
        return 1, None
    count, used = 1, first.window
    while count < most and remaining - used >= window:
        layout = next_layout(start + used)
        if (layout.ratio, layout.window) != (first.ratio, first.window):
            return count, layout
        count, used = count + 1, used + window
    return count, None


class GroupInputs(NamedTuple):
    """What the decoder stack takes for a group of ``P`` windows of ``L`` slots, ``B`` sequences (``K = M + G + L``
    keys: the memory, the group's new entries, a window)."""

    step: BeaconStep  # with its WindowGroup
    positions: torch.Tensor  # [B * P, L] long: window p starts after the memory it reads
    visible: torch.Tensor  # [B * P, 1, L, K] bool: what each slot attends to
    keys: torch.Tensor  # [B * P, K] bool: the keys each row may read (padding and later windows' entries hidden)
    window_keeps: list[torch.Tensor | None]  # per window [B, L] bool, False at padding, or None
    entry_keep: torch.Tensor | None  # [B, G] bool of the group's new memory entries, False at padding, or None


def group_inputs(
    layout: WindowLayout,
    windows: int,
    state: SequenceState,
    sink: int,
    rule: str,
    batch: int,
    keep_raw: torch.Tensor | None,
    rotate: Rotate,
) -> GroupInputs:
    """Positions, masks and step of ``windows`` (``P >= 2``) full windows of ``layout`` that begin after ``state`` (at
    a window border), for ``batch`` (``B``) sequences whose raw tokens' ``keep_raw [B, P * W]`` is False at padding
    (None: none). ``sink`` and ``rule`` lay out window 0's sink (:func:`~.cache.committed_slots`); ``rotate`` is the
    model's rotation of pre-RoPE keys."""
    slots, memory = len(layout.is_beacon), state.memory_length
    raw_rows = (~layout.is_beacon).nonzero().flatten()
    kept = [committed_slots(layout, slots, state.window_index + p, sink, rule) for p in range(windows - 1)]
    starts = [memory]  # memory length before each window
    for entries in kept:
        starts.append(starts[-1] + entries.numel())
    entry_window = torch.cat([torch.full((entries.numel(),), p) for p, entries in enumerate(kept)])
    entry_slot = torch.cat(kept)
    entry_positions = torch.arange(memory, starts[-1])
    computed_at = torch.cat([start + layout.offsets[entries] for start, entries in zip(starts, kept)])
    group = WindowGroup(windows, entry_window, entry_slot, entry_positions, computed_at != entry_positions, rotate)

    raw_keeps = [None] * windows if keep_raw is None else keep_raw.split(layout.window, dim=1)  # per window
    window_keeps = [
        None if keep is None else window_keep(layout, None, 0, slots, keep, raw_rows) for keep in raw_keeps
    ]
    entry_keep = padding_keep(
        *[(None if keep is None else keep[:, entries], entries.numel()) for keep, entries in zip(window_keeps, kept)]
    )
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
    positions = (torch.tensor(starts)[:, None] + layout.offsets[None]).repeat(batch, 1)
    step = BeaconStep(state.window_index, memory, 0, slots, layout.is_beacon.nonzero().flatten(), group)
    return GroupInputs(step, positions, visible, keys, window_keeps, entry_keep)


def close_group(state: SequenceState, layout: WindowLayout, inputs: GroupInputs) -> None:
    """The state after the group's step: windows ``0 .. P-2`` committed, the last one open and full."""
    windows, added = len(inputs.window_keeps), inputs.step.group.entry_slot.numel()
    state.memory_keep = padding_keep((state.memory_keep, state.memory_length), (inputs.entry_keep, added))
    state.memory_length += added
    state.window_index += windows - 1
    state.layout, state.window_raw, state.window_slots = layout, layout.window, len(layout.is_beacon)
    state.window_keep = inputs.window_keeps[-1]
    state.raw_seen += windows * layout.window
