"""The beacon memory: a ``transformers.Cache`` that the caller owns and passes, never state on the model.

Per layer it holds the **memory** (sink, then the K/V that every committed window left behind, at
positions ``0 .. M-1``) and the **current window**'s K/V (raw tokens and beacons, at positions
``M + offset``). The sequence-level bookkeeping (which window, its ratio and layout, how many slots
and raw tokens it holds, which entries are padding) lives in :class:`SequenceState`, shared by all layers.

Writes are idempotent, so gradient checkpointing can replay a layer: a step (:class:`BeaconStep`)
names its window's memory length and its first slot, ``update`` overwrites the window's slots from
there on and reads only the first ``M`` memory entries, which later commits never change (memory is
append-only). Commits run between windows, outside any checkpointed layer. A step of several full windows
(:class:`WindowGroup`, a prefill's parallel windows) commits all but its last inside ``update``, as
memory[:M] plus the group's entries: idempotent too.

transformers 5 hands the cache post-RoPE keys. Beacon keys are created at their offsets in the
window but live in memory at ``M + j`` (and so do sink keys when beacons sit between them), so
``update`` also receives the pre-RoPE keys and the commit rotates each key whose position changes
once, with the model's own rotary module, at its memory position.

This module imports only torch and transformers: it is part of the exported modeling file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

# longpeft-inline-begin
from .layout import WindowLayout, padding_keep

# longpeft-inline-end


@dataclasses.dataclass(frozen=True)
class WindowGroup:
    """``windows`` consecutive full windows of one layout computed in one step (the step's rows are batch-major:
    row ``b * windows + p`` is window ``p`` of sequence ``b``).

    Windows ``0 .. windows-2`` of the group are committed by the step: their memory entries (:func:`committed_slots`,
    ``G`` in all, in memory order) follow the memory, and window ``p`` reads those of the windows before it, so it
    reads what it would read run alone. The last window stays open.

    Attributes:
        windows: ``P``, windows in the group.
        entry_window / entry_slot: ``[G]`` long, the group window and the slot each new memory entry comes from.
        entry_positions: ``[G]`` long, their memory positions.
        entry_rotate: ``[G]`` bool, which keys are rotated again at their memory position (it differs from the
            one they were computed at).
        rotate: ``rotate(pre_rope_keys [b, h, n, d], positions [n]) -> keys``.
    """

    windows: int
    entry_window: torch.Tensor
    entry_slot: torch.Tensor
    entry_positions: torch.Tensor
    entry_rotate: torch.Tensor
    rotate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class BeaconStep:
    """One forward of the decoder stack over slots ``[start, end)`` of window ``window_index``.

    Attributes:
        window_index: index of the window (memory before it holds ``memory_length`` entries).
        memory_length: ``M``, memory entries the window reads.
        start, end: the window's slots fed in this step.
        beacon_rows: ``[n]`` long indices (into this step's slots) of the beacons, or None.
        group: the windows computed together when the step holds several full windows (then ``start`` is 0 and
            ``end`` the slots of one window), or None.
    """

    window_index: int
    memory_length: int
    start: int
    end: int
    beacon_rows: torch.Tensor | None
    group: WindowGroup | None = None


@dataclasses.dataclass
class SequenceState:
    """Sequence-level bookkeeping of a :class:`BeaconCache`.

    Attributes:
        raw_seen: raw tokens consumed so far (what ``get_seq_length`` reports to ``generate``).
        window_index: index of the current window.
        memory_length: ``M``, entries in memory.
        layout: the current window's layout (None before its first token).
        window_raw: raw tokens in the current window.
        window_slots: slots (raw and beacon) of the current window fed so far.
        chosen_ratio: the ratio chosen once per sequence (instance-random, adapt-N).
        ratio_cycle: the ratios the ``sequence`` mix cycles through, one per window (fixed at the first window).
        zero_ratio_used: a window of this sequence took ratio 0 (the authors' training rule allows one).
        ratio_deferred: the current window's layout holds no beacons yet, its ratio to be chosen when it fills
            (appended beacons under the authors' rule: ``scheduler._layout_at``).
        memory_keep / window_keep: ``[batch, M]`` / ``[batch, window_slots]`` bool, False at padding
            (None while there is no padding).
    """

    raw_seen: int = 0
    window_index: int = 0
    memory_length: int = 0
    layout: WindowLayout | None = None
    window_raw: int = 0
    window_slots: int = 0
    chosen_ratio: int | None = None
    ratio_cycle: tuple[int, ...] | None = None
    zero_ratio_used: bool = False
    ratio_deferred: bool = False
    memory_keep: torch.Tensor | None = None
    window_keep: torch.Tensor | None = None


def _cat(first: torch.Tensor | None, second: torch.Tensor, dim: int = -2) -> torch.Tensor:
    return second if first is None else torch.cat([first, second], dim=dim)


def committed_slots(
    layout: WindowLayout, window_slots: int, window_index: int, sink: int, rule: str = "longpeft"
) -> torch.Tensor:
    """``[n]`` long: the slots of a full window (its first ``window_slots``) that join the memory, in memory order:
    at ratio 0 all of them, else the window's beacons; window 0 puts its sink first. The sink is the first ``sink``
    raw tokens (``rule`` longpeft; none again at ratio 0, where they are in memory anyway) or, as the authors' code
    does (``rule`` authors), the first ``sink`` slots, beacons included, and again at ratio 0 (then held twice)."""
    slots = torch.arange(window_slots)
    is_beacon = layout.is_beacon[:window_slots]
    sink = sink if window_index == 0 else 0
    if rule == "authors":
        return torch.cat([slots[:sink], slots if layout.ratio == 0 else slots[is_beacon]])
    if layout.ratio == 0:
        return slots
    return torch.cat([slots[~is_beacon][:sink], slots[is_beacon]])


class BeaconLayer(CacheLayerMixin):
    """One layer's memory and current window, each ``[batch, kv_heads, length, head_dim]``."""

    is_sliding = False

    def __init__(self) -> None:
        super().__init__()
        self.memory_keys: torch.Tensor | None = None
        self.memory_values: torch.Tensor | None = None
        self.window_keys: torch.Tensor | None = None
        self.window_values: torch.Tensor | None = None
        self.window_pre_rope_keys: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        *args,
        beacon_step: BeaconStep | None = None,
        pre_rope_keys: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the step's K/V into window slots ``[start, end)``; return memory[:M] + window[:end].

        Args:
            key_states, value_states: ``[batch, kv_heads, end - start, head_dim]`` (keys post-RoPE).
            beacon_step: which window and slots these are (required).
            pre_rope_keys: the same keys before RoPE (rotated again when beacons are committed).
        """
        if beacon_step is None:
            raise ValueError("a BeaconCache is written by the beacon forward only; call the model, not the layers")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if beacon_step.group is not None:
            return self._update_group(key_states, value_states, pre_rope_keys, beacon_step)
        start = beacon_step.start
        keep = (lambda t: None) if start == 0 else (lambda t: t[:, :, :start])
        self.window_keys = _cat(keep(self.window_keys), key_states)
        self.window_values = _cat(keep(self.window_values), value_states)
        self.window_pre_rope_keys = _cat(keep(self.window_pre_rope_keys), pre_rope_keys)
        m = beacon_step.memory_length
        if m == 0:
            return self.window_keys, self.window_values
        return (
            torch.cat([self.memory_keys[:, :, :m], self.window_keys], dim=-2),
            torch.cat([self.memory_values[:, :, :m], self.window_values], dim=-2),
        )

    def _update_group(
        self, key_states: torch.Tensor, value_states: torch.Tensor, pre_rope_keys: torch.Tensor, step: BeaconStep
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A :class:`WindowGroup` step: ``[batch * P, kv_heads, L, head_dim]`` in; the memory becomes memory[:M]
        plus the group's entries, the window the group's last one; returns, per row, the memory, the group's
        entries and the row's own window (``[batch * P, kv_heads, M + G + L, head_dim]``)."""
        group = step.group
        windows = group.windows
        rows, heads, length, dim = key_states.shape
        batch = rows // windows
        keys, values, pre = (
            t.view(batch, windows, heads, length, dim) for t in (key_states, value_states, pre_rope_keys)
        )
        index = (group.entry_window * length + group.entry_slot).to(keys.device)  # [G] into the group's P * L slots

        def entries(t: torch.Tensor, which: torch.Tensor) -> torch.Tensor:  # [batch, heads, n, dim]
            return t.transpose(1, 2).reshape(batch, heads, windows * length, dim).index_select(2, which)

        entry_keys = entries(keys, index)
        if bool(group.entry_rotate.any()):
            moved = group.entry_rotate.nonzero().flatten().to(keys.device)
            fresh = group.rotate(
                entries(pre, index.index_select(0, moved)),
                group.entry_positions.to(keys.device).index_select(0, moved),
            )
            entry_keys = entry_keys.index_copy(2, moved, fresh.to(entry_keys.dtype))
        m = step.memory_length
        before = (lambda t: None) if m == 0 else (lambda t: t[:, :, :m])
        self.memory_keys = _cat(before(self.memory_keys), entry_keys)
        self.memory_values = _cat(before(self.memory_values), entries(values, index))
        # copies: views would keep every window of the group alive
        self.window_keys, self.window_values = keys[:, -1].clone(), values[:, -1].clone()
        self.window_pre_rope_keys = pre[:, -1].clone()

        def per_row(memory: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
            shared = memory[:, None].expand(batch, windows, heads, memory.shape[2], dim)
            return torch.cat([shared, own], dim=3).reshape(rows, heads, memory.shape[2] + length, dim)

        return per_row(self.memory_keys, keys), per_row(self.memory_values, values)

    def commit(
        self,
        slots: torch.Tensor,
        rotate_slots: torch.Tensor,
        positions: torch.Tensor,
        rotate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> None:
        """Append window slots to memory and drop the window.

        Args:
            slots: ``[n]`` window slots that stay, in memory order.
            rotate_slots: ``[n]`` bool, which of them are re-rotated (their memory position differs from the
                one they were computed at) rather than kept as they are.
            positions: ``[n]`` memory positions of the kept slots.
            rotate: ``rotate(pre_rope_keys [b, h, n, d], positions [n]) -> keys``.
        """
        slots = slots.to(self.window_keys.device)
        keys = self.window_keys.index_select(2, slots)
        if bool(rotate_slots.any()):
            which = rotate_slots.nonzero().flatten().to(keys.device)
            fresh = rotate(
                self.window_pre_rope_keys.index_select(2, slots.index_select(0, which)),
                positions.to(keys.device).index_select(0, which),
            )
            keys = keys.index_copy(2, which, fresh.to(keys.dtype))
        self.memory_keys = _cat(self.memory_keys, keys)
        self.memory_values = _cat(self.memory_values, self.window_values.index_select(2, slots))
        self.window_keys = self.window_values = self.window_pre_rope_keys = None

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        """Entries held: the memory's and the open window's."""
        return sum(0 if keys is None else keys.shape[-2] for keys in (self.memory_keys, self.window_keys))

    def get_max_length(self) -> int:
        return -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("Activation Beacon's memory cannot be reordered (beam search is not supported)")


class BeaconCache(Cache):
    """Activation Beacon's memory for one batch of sequences that share a beacon layout.

    Create one per request (``generate`` does it by itself); pass it as ``cache`` (``past_key_values`` before
    transformers 5.24) to keep a conversation's memory across calls. The model reads its settings from
    ``config.beacon``; the cache holds only this request's state, so two requests never see each other's tokens.
    """

    def __init__(self) -> None:
        super().__init__(layer_class_to_replicate=BeaconLayer)
        self.state = SequenceState()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Raw tokens consumed so far (``generate`` slices its inputs with it)."""
        return self.state.raw_seen

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.state.memory_length + self.state.window_slots + query_length, 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("Activation Beacon's memory cannot be reordered (beam search is not supported)")

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("Activation Beacon's memory cannot be cropped (assisted decoding is not supported)")

    def commit(
        self, rotate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], sink: int, rule: str = "longpeft"
    ) -> None:
        """Close the current (full) window: its beacons (or, at ratio 0, its raw tokens) join the memory, its raw
        K/V are dropped. The first window also leaves its sink, first in memory: its first ``sink`` raw tokens
        (``rule`` longpeft, not again at ratio 0), or, as the authors' code does (``rule`` authors), its first
        ``sink`` slots, the beacons among them included, and again at ratio 0 (their memory holds those entries
        twice)."""
        state = self.state
        layout = state.layout
        kept = committed_slots(layout, state.window_slots, state.window_index, sink, rule)
        positions = state.memory_length + torch.arange(kept.numel())
        rotated = state.memory_length + layout.offsets[kept] != positions  # beacons, and sink keys behind a beacon
        for layer in self.layers:
            layer.commit(kept, rotated, positions, rotate)
        window_keep = None if state.window_keep is None else state.window_keep[:, kept]
        state.memory_keep = padding_keep((state.memory_keep, state.memory_length), (window_keep, kept.numel()))
        state.memory_length += kept.numel()
        state.window_index += 1
        state.layout, state.window_raw, state.window_slots, state.window_keep = None, 0, 0, None
