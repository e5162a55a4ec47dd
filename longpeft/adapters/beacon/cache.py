"""The beacon memory: a ``transformers.Cache`` that the caller owns and passes, never state on the model.

Per layer it holds the memory (at positions ``0 .. M-1``) and the current window's K/V (at ``M + offset``). Writes
are idempotent, so gradient checkpointing can replay a layer: a step (:class:`BeaconStep`) overwrites its window's
slots from its first one and reads only memory[:M], which later commits never change. Keys committed at another
position than they were computed at are rotated again from their pre-RoPE keys.

This module imports only torch and transformers: it is part of the exported modeling file."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

# longpeft-inline-begin
from .layout import WindowLayout, padding_keep

# longpeft-inline-end

Rotate = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # rotate(pre_rope_keys [b, h, n, d], positions [n])


@dataclasses.dataclass(frozen=True)
class WindowGroup:
    """``windows`` (``P``) full windows of one layout in one step, row ``b * P + p`` window ``p`` of sequence ``b``.
    The step commits windows ``0 .. P-2``: their ``G`` memory entries (:func:`committed_slots`, in memory order)
    follow memory[:M], and window ``p`` reads those of the windows before it. The last stays open."""

    windows: int
    entry_window: torch.Tensor  # [G] long: the group window each new memory entry comes from
    entry_slot: torch.Tensor  # [G] long: its slot in that window
    entry_positions: torch.Tensor  # [G] long: its memory position
    entry_rotate: torch.Tensor  # [G] bool: its key is rotated again at its memory position
    rotate: Rotate


@dataclasses.dataclass(frozen=True)
class BeaconStep:
    """One forward of the decoder stack over slots ``[start, end)`` of window ``window_index``."""

    window_index: int
    memory_length: int  # M, the memory entries the window reads
    start: int
    end: int
    beacon_rows: torch.Tensor  # [n] long: the beacons' indices into this step's slots (n may be 0)
    group: WindowGroup | None = None  # the windows of a step over several (start 0, end one window's slots)


@dataclasses.dataclass
class SequenceState:
    """Sequence-level bookkeeping of a :class:`BeaconCache`."""

    raw_seen: int = 0  # raw tokens consumed so far (what get_seq_length reports to generate)
    window_index: int = 0  # the current window's
    memory_length: int = 0  # M, the entries in memory
    layout: WindowLayout | None = None  # the current window's (None before its first token)
    window_raw: int = 0  # raw tokens of the current window fed so far
    window_slots: int = 0  # its slots (raw and beacon) fed so far
    chosen_ratio: int | None = None  # the ratio chosen once per sequence (instance-random, adapt-N)
    ratio_cycle: tuple[int, ...] | None = None  # the sequence mix's ratios, one per window (fixed at the first)
    zero_ratio_used: bool = False  # a window took ratio 0 (the authors' training rule allows one)
    ratio_deferred: bool = False  # the current window has no beacons yet, its ratio chosen when it fills
    memory_keep: torch.Tensor | None = None  # [batch, M] bool, False at padding (None: no padding)
    window_keep: torch.Tensor | None = None  # [batch, window_slots] bool, likewise


def _cat(first: torch.Tensor | None, second: torch.Tensor, length: int | None = None) -> torch.Tensor:
    """``second`` after the first ``length`` entries (None: all) of ``first`` (None: none), along the length dim."""
    if first is None or length == 0:
        return second
    return torch.cat([first if length is None else first[:, :, :length], second], dim=-2)


def _rotated(
    keys: torch.Tensor, pre_rope_keys: torch.Tensor, moved: torch.Tensor, positions: torch.Tensor, rotate: Rotate
) -> torch.Tensor:
    """``keys [b, h, n, d]`` with those where ``moved [n]`` is True rotated again from ``pre_rope_keys [b, h, n, d]``
    at ``positions [n]``."""
    if not bool(moved.any()):
        return keys
    which = moved.nonzero().flatten().to(keys.device)
    fresh = rotate(pre_rope_keys.index_select(2, which), positions.to(keys.device).index_select(0, which))
    return keys.index_copy(2, which, fresh.to(keys.dtype))


def committed_slots(layout: WindowLayout, window_slots: int, window_index: int, sink: int, rule: str) -> torch.Tensor:
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
        """Write the step's K/V (``[batch, kv_heads, end - start, head_dim]``, keys post-RoPE, and ``pre_rope_keys``
        before it) into the slots ``[start, end)`` of ``beacon_step``'s window; return memory[:M] + window[:end]."""
        if beacon_step is None:
            raise ValueError("a BeaconCache is written by the beacon forward only; call the model, not the layers")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if beacon_step.group is not None:
            return self._update_group(key_states, value_states, pre_rope_keys, beacon_step)
        start, m = beacon_step.start, beacon_step.memory_length
        self.window_keys = _cat(self.window_keys, key_states, start)
        self.window_values = _cat(self.window_values, value_states, start)
        self.window_pre_rope_keys = _cat(self.window_pre_rope_keys, pre_rope_keys, start)
        return _cat(self.memory_keys, self.window_keys, m), _cat(self.memory_values, self.window_values, m)

    def _update_group(
        self, key_states: torch.Tensor, value_states: torch.Tensor, pre_rope_keys: torch.Tensor, step: BeaconStep
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A :class:`WindowGroup` step: ``[batch * P, kv_heads, L, head_dim]`` in; the memory becomes memory[:M]
        plus the group's entries, the window the group's last one; returns, per row, the memory, the group's
        entries and the row's own window (``[batch * P, kv_heads, M + G + L, head_dim]``)."""
        group, windows = step.group, step.group.windows
        rows, heads, length, dim = key_states.shape
        batch = rows // windows
        keys, values, pre = (
            t.view(batch, windows, heads, length, dim) for t in (key_states, value_states, pre_rope_keys)
        )
        index = (group.entry_window * length + group.entry_slot).to(keys.device)  # [G] into the group's P * L slots

        def entries(t: torch.Tensor) -> torch.Tensor:  # [batch, heads, G, dim]: the group's new memory entries
            return t.transpose(1, 2).reshape(batch, heads, windows * length, dim).index_select(2, index)

        entry_keys = _rotated(entries(keys), entries(pre), group.entry_rotate, group.entry_positions, group.rotate)
        self.memory_keys = _cat(self.memory_keys, entry_keys, step.memory_length)
        self.memory_values = _cat(self.memory_values, entries(values), step.memory_length)
        # copies: views would keep every window of the group alive
        self.window_keys, self.window_values, self.window_pre_rope_keys = (
            t[:, -1].clone() for t in (keys, values, pre)
        )

        def per_row(memory: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
            shared = memory[:, None].expand(batch, windows, heads, memory.shape[2], dim)
            return torch.cat([shared, own], dim=3).reshape(rows, heads, memory.shape[2] + length, dim)

        return per_row(self.memory_keys, keys), per_row(self.memory_values, values)

    def commit(self, slots: torch.Tensor, rotate_slots: torch.Tensor, positions: torch.Tensor, rotate: Rotate) -> None:
        """Append the window slots ``slots [n]`` (in memory order) to memory, at ``positions [n]``, and drop the
        window; the keys where ``rotate_slots [n]`` is True are rotated again there."""
        slots = slots.to(self.window_keys.device)
        pre_rope_keys = self.window_pre_rope_keys.index_select(2, slots)
        keys = _rotated(self.window_keys.index_select(2, slots), pre_rope_keys, rotate_slots, positions, rotate)
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
    """Activation Beacon's memory for one batch of sequences that share a beacon layout: one per request (``generate``
    makes it), passed as ``cache`` (``past_key_values`` before transformers 5.24) to keep a conversation's memory
    across calls. It holds only this request's state (the settings are ``config.beacon``'s)."""

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

    def commit(self, rotate: Rotate, sink: int, rule: str = "longpeft") -> None:
        """Close the current (full) window: its :func:`committed_slots` join the memory, its other K/V are dropped."""
        state, layout = self.state, self.state.layout
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
