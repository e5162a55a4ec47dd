"""Activation Beacon's runtime settings, one window's layout, its masks and positions, and the condensing ratio.

A window holds ``W`` raw tokens and, at ratio ``r > 0``, ``W / r`` beacons: one after every ``r`` raw tokens
(``interleave``) or all after the last one (``append``). Beacon ``j`` condenses the raw tokens ``[lo_j, (j + 1) r)``:
``lo_j = 0``, or ``j r`` for ``segmentation``. Everything in the window also sees the memory (sink, earlier windows'
beacons, raw tokens kept at ratio 0), at positions ``0 .. M-1``; the window's slots follow at ``M + offset``:

==================  ==================================  ===============================  ==========================
scheme, mode        raw token i sees (in the window)    beacon j sees                    beacon j's offset
==================  ==================================  ===============================  ==========================
full-coverage       every earlier slot (plain causal, incl. earlier beacons)             its slot index
step-expansion,     raw 0..i                            raw 0..(j+1)r-1; beacons 0..j    (j+1)r + j
append                                                  (attend_prev) or itself          (attend_prev) or (j+1)r
step-expansion,     raw 0..i, never this window's       raw 0..(j+1)r-1 and itself       (j+1)r: the next raw's;
interleave          beacons                                                              raw offsets stay i
segmentation,       raw 0..i                            raw jr..(j+1)r-1; beacons 0..j   as step-expansion, append
append                                                  (attend_prev) or itself
==================  ==================================  ===============================  ==========================

This module imports only torch: it is part of the exported modeling file."""

from __future__ import annotations

import dataclasses
import functools
import math

import torch


@dataclasses.dataclass(frozen=True)
class BeaconSettings:
    """The settings a model runs with (``config.beacon``): the fields of ``BeaconConfig`` (``config.py``, where each
    is declared, checked and described) with every implied value written out, lists as tuples
    (``BeaconConfig.settings()``); ``lora_rank`` and ``lora_alpha`` are None with ``projection: full``."""

    window: int
    ratios: tuple[int, ...]
    ratio_mix: str
    zero_ratio_rule: str
    inference_ratios: tuple[int, ...]
    inference_ratio_mix: str
    attn: str
    pos: str
    params: tuple[str, ...]
    sink: int
    attend_prev: bool
    embed_init: str
    projection: str
    lora_rank: int | None
    lora_alpha: float | None
    layout_rule: str
    parallel_windows: int
    keep_start: int
    keep_end: int | None

    @property
    def scheme(self) -> tuple[str, str, bool]:
        """``(attn, pos, attend_prev)``: what lays a window out besides its size and ratio (:func:`window_layout`)."""
        return self.attn, self.pos, self.attend_prev

    def ratio_choice(self, training: bool) -> tuple[tuple[int, ...], str]:
        """``(ratios, mix)`` of training, or of inference."""
        return (self.ratios, self.ratio_mix) if training else (self.inference_ratios, self.inference_ratio_mix)

    @classmethod
    def from_dict(cls, data: dict) -> BeaconSettings:
        """Settings from ``config.beacon`` (lists become tuples; an unknown or a missing key is an error)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown, missing = sorted(set(data) - fields), sorted(fields - set(data))
        if unknown or missing:
            faults = [f"has unknown keys {unknown}" if unknown else "", f"lacks {missing}" if missing else ""]
            raise ValueError(
                f"config.beacon {' and '.join(f for f in faults if f)}; it holds every setting, as "
                "BeaconConfig(...).settings().as_dict() writes them"
            )
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})

    def as_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}


@dataclasses.dataclass(frozen=True)
class WindowLayout:
    """The ``L`` slots of one full window in sequence order (a partial window is a prefix of them)."""

    is_beacon: torch.Tensor  # [L] bool
    trigger: torch.Tensor  # [L] long: a raw slot's raw index, a beacon's that it follows; slots of n raw: trigger < n
    offsets: torch.Tensor  # [L] long: each slot's position minus the memory length M
    visible: torch.Tensor  # [L, L] bool: visible[q, k], slot q attends to slot k of the window
    ratio: int  # the condensing ratio (0: no beacons, the raw K/V become memory)
    window: int  # raw tokens the full window holds

    def slots_for(self, n_raw: int) -> int:
        """Number of leading slots that exist once the window holds ``n_raw`` raw tokens."""
        return int((self.trigger < n_raw).sum())

    def reach(self, n_raw: int) -> int:
        """Positions past the memory that the slots of a window holding ``n_raw`` raw tokens take: their largest
        offset plus one (0 for no token). Fewer than the slots where beacons share positions with raw tokens."""
        slots = self.slots_for(n_raw)
        return int(self.offsets[:slots].max()) + 1 if slots else 0


@functools.lru_cache(maxsize=64)
def window_layout(window: int, ratio: int, attn: str, pos: str, attend_prev: bool) -> WindowLayout:
    """The layout of a full window of ``window`` raw tokens condensed at ``ratio`` (0: none).

    Raises:
        ValueError: ``window`` not a multiple of ``ratio``, or segmentation with interleave.
    """
    if ratio < 0 or (ratio and window % ratio):
        raise ValueError(f"beacon ratio {ratio} must be 0 or divide the window {window}")
    if attn not in ("full-coverage", "step-expansion", "segmentation") or pos not in ("interleave", "append"):
        raise ValueError(f"unknown beacon scheme {attn!r} or position mode {pos!r}")
    if attn == "segmentation" and pos == "interleave" and ratio:
        raise ValueError("beacon attn segmentation with pos interleave is not implemented; use pos: append")
    n_beacons = window // ratio if ratio else 0
    interleaved = torch.arange(1, n_beacons + 1) * ratio - 1  # beacon j comes right after raw (j+1)r - 1
    follows = interleaved if pos == "interleave" else torch.full((n_beacons,), window - 1)  # each beacon's raw index
    trigger = torch.cat([torch.arange(window), follows])
    is_beacon = torch.arange(window + n_beacons) >= window
    order = torch.sort(trigger * 2 + is_beacon.long(), stable=True).indices
    trigger, is_beacon = trigger[order], is_beacon[order]
    raw_index = torch.where(is_beacon, -1, trigger)  # raw index of raw slots
    beacon_index = torch.where(is_beacon, is_beacon.long().cumsum(0) - 1, -1)  # beacon index of beacon slots

    if attn == "full-coverage":
        offsets = torch.arange(window + n_beacons)
        visible = offsets[None, :] <= offsets[:, None]
    else:
        q_beacon, k_beacon = is_beacon[:, None], is_beacon[None, :]
        j, k_raw_index = beacon_index[:, None], raw_index[None, :]
        raw_sees = ~q_beacon & ~k_beacon & (k_raw_index <= raw_index[:, None])
        lo = j * ratio if attn == "segmentation" else 0
        beacon_sees_raw = q_beacon & ~k_beacon & (k_raw_index >= lo) & (k_raw_index < (j + 1) * ratio)
        sees_beacon = beacon_index[None, :] <= j if attend_prev else beacon_index[None, :] == j
        visible = raw_sees | beacon_sees_raw | (q_beacon & k_beacon & sees_beacon)
        last_seen = (beacon_index + 1) * ratio  # offset right after the last raw token a beacon sees
        stacked = pos == "append" and attend_prev  # appended beacons that see each other follow each other
        offsets = torch.where(is_beacon, last_seen + beacon_index if stacked else last_seen, raw_index)
    return WindowLayout(is_beacon, trigger, offsets, visible, ratio, window)


# Masks of one step


def padding_keep(*parts: tuple[torch.Tensor | None, int]) -> torch.Tensor | None:
    """``[batch, sum of lengths]`` bool on the CPU, False at padding: the ``(keep [batch, length] or None, length)``
    parts side by side, a None part all True (no padding there); None when every part is None."""
    present = [keep for keep, _ in parts if keep is not None]
    if not present:
        return None
    batch = present[0].shape[0]
    filled = [
        keep.cpu() if keep is not None else torch.ones(batch, length, dtype=torch.bool) for keep, length in parts
    ]
    return torch.cat(filled, dim=1)


def window_keep(
    layout: WindowLayout, keep: torch.Tensor | None, start: int, end: int, keep_raw: torch.Tensor | None
) -> torch.Tensor | None:
    """``[batch, end]`` bool on the CPU, False at the window's padding slots (None: none), once slots ``[start, end)``
    join the first ``start`` (``keep [batch, start]`` or None). The new raw tokens' ``keep_raw [batch, n_raw]`` (None:
    no padding) marks their slots; a beacon is padding when every raw token it sees is."""
    new = None
    if keep_raw is not None:
        new = torch.ones(keep_raw.shape[0], end - start, dtype=torch.bool)
        new[:, ~layout.is_beacon[start:end]] = keep_raw.cpu()
    keep = padding_keep((keep, start), (new, end - start))  # [batch, end] or None
    if keep is not None:
        beacons = start + layout.is_beacon[start:end].nonzero().flatten()  # [n_beacons] slots
        sees_raw = layout.visible[beacons, :end] & ~layout.is_beacon[:end]  # [n_beacons, end]
        keep[:, beacons] = (sees_raw[None] & keep[:, None, :]).any(dim=-1)  # sees a raw token that is not padding
    return keep


def key_keep(
    memory_length: int, end: int, memory_keep: torch.Tensor | None, window_keep: torch.Tensor | None
) -> torch.Tensor | None:
    """``[batch, M + end]`` bool, False at memory entries and window slots that are padding (None: no padding)."""
    return padding_keep((memory_keep, memory_length), (window_keep, end))


def step_visibility(
    layout: WindowLayout, memory_length: int, start: int, end: int, keys: torch.Tensor | None
) -> torch.Tensor:
    """``[batch or 1, 1, end - start, M + end]`` bool: the keys the slots ``[start, end)`` of a window after
    ``memory_length`` (``M``) memory entries attend to, padding hidden (``keys [batch, M + end]``, False at padding,
    or None: :func:`key_keep`). Every slot sees itself, so no row is empty (a padding query gets an ignored output)."""
    memory = torch.ones(end - start, memory_length, dtype=torch.bool)
    rows = torch.cat([memory, layout.visible[start:end, :end]], dim=1)
    visible = rows[None, None] if keys is None else (rows[None] & keys[:, None, :])[:, None]
    visible[..., torch.arange(end - start), memory_length + torch.arange(start, end)] = True
    return visible


def attention_mask_for(
    visible: torch.Tensor, keys: torch.Tensor | None, implementation: str, dtype: torch.dtype, device
) -> torch.Tensor | None:
    """The mask an attention kernel takes for a step: eager, an additive float ``[b, 1, q, k]`` from ``visible``; sdpa
    and others, the bool ``visible``; flash_attention_2 (full-coverage only: its mask is causal), None without padding,
    else the 2-D key mask ``keys [b, k]``."""
    if "flash" in implementation:
        return None if keys is None or bool(keys.all()) else keys.to(device=device, dtype=torch.long)
    if implementation == "eager":
        mask = torch.zeros(visible.shape, dtype=dtype)
        return mask.masked_fill_(~visible, torch.finfo(dtype).min).to(device)
    return visible.to(device)


# Ratios

DEFAULT_SCHEME = ("full-coverage", "interleave", True)  # BeaconConfig's default window layout


def span_at(
    window: int,
    sink: int,
    ratio: int,
    length: int,
    training: bool,
    rule: str = "longpeft",
    keep: tuple[int, int | None] = (0, None),
    scheme: tuple[str, str, bool] = DEFAULT_SCHEME,
    keys: bool = False,
) -> int:
    """Positions ``length`` tokens occupy (the largest position id the beacon forward gives them, plus one) when every
    window is condensed at ``ratio``: over the windows, the memory before one plus the positions its slots take
    (:meth:`WindowLayout.reach` under ``scheme``, ``(attn, pos, attend_prev)``; with ``training`` the last window has
    no beacons); at ratio 0, ``length`` (plus the sink, stored twice under the authors' ``rule``). ``keep =
    (keep_start, keep_end)``: the first ``keep_start`` tokens stay in memory, and those from ``keep_end`` on follow
    raw. ``keys``: the keys one query reads at most instead. O(1)."""
    start, end = keep
    condensed = length if end is None else min(length, end)  # the tokens of the condensed windows end here
    if not ratio or condensed <= start:  # every window raw
        return length + (sink if rule == "authors" and length > window else 0)
    windows, last_raw = math.ceil((condensed - start) / window), training and condensed == length
    span = 0
    for index in range(max(0, windows - 2), windows):  # each full window reaches further than the one before
        raw = min(window, condensed - start - index * window)
        layout = window_layout(window, 0 if last_raw and index == windows - 1 else ratio, *scheme)
        memory = start + (sink + index * (window // ratio) if index else 0)
        span = max(span, memory + (layout.slots_for(raw) if keys else layout.reach(raw)))
    if condensed < length:  # raw windows from keep_end on follow the memory of the condensed ones
        memory = start + sink + (end - start) // window * (window // ratio)
        span = max(span, memory + length - end)
    return span


def fitting_ratios(
    ratios: tuple[int, ...],
    window: int,
    sink: int,
    max_positions: int,
    length: int,
    training: bool,
    keep: tuple[int, int | None] = (0, None),
    rule: str = "longpeft",
    scheme: tuple[str, str, bool] = DEFAULT_SCHEME,
) -> tuple[int, ...]:
    """The ``ratios`` at which ``length`` tokens stay inside ``max_positions`` (:func:`span_at`; the largest ratio
    when none does): a random mix of them stays inside too. Ratio 0 is left out where a mix with it, which reaches
    ``length + sink + window // r`` (``r`` the smallest other fitting ratio), would pass ``max_positions``."""
    fitting = tuple(
        r for r in ratios if span_at(window, sink, r, length, training, rule, keep, scheme) <= max_positions
    )
    condensed = [r for r in fitting if r]
    if 0 in fitting and condensed and length + sink + window // min(condensed) > max_positions:
        fitting = tuple(condensed)
    return fitting or (max(ratios),)


def training_ratios(ratios: tuple[int, ...], window: int, start: int, length: int, zero_used: bool) -> tuple[int, ...]:
    """The ``ratios`` a training window starting at raw token ``start`` of a ``length``-token input may take under
    ``zero_ratio_rule: authors``: without 0 when an earlier window took it or no full window follows (0 needs
    ``start + 2 window <= length``). A single listed ratio is always allowed, as in the authors' code."""
    if len(ratios) == 1 or 0 not in ratios or not (zero_used or start + 2 * window > length):
        return ratios
    return tuple(ratio for ratio in ratios if ratio)


def choose_ratio(
    ratios: tuple[int, ...],
    mix: str,
    window: int,
    max_positions: int,
    length: int,
    chosen: int | None,
    sink: int = 0,
    training: bool = False,
    rule: str = "longpeft",
    keep: tuple[int, int | None] = (0, None),
    scheme: tuple[str, str, bool] = DEFAULT_SCHEME,
) -> int:
    """The ratio of the next window among ``ratios`` under ``mix`` (step-random, instance-random, adapt-N; the
    ``sequence`` mix cycles through :func:`fitting_ratios` in the scheduler instead), ``length`` the tokens known so
    far: ``chosen`` (the sequence's earlier choice, or None) under instance-random and adapt-N, else a draw among
    :func:`fitting_ratios` or adapt-N's smallest of them for ``length + N`` tokens (the authors' ``rule``:
    :func:`authors_adapt_ratio`). ``sink``, ``training``, ``rule``, ``keep``, ``scheme``: what positions depend on
    besides the ratio (:func:`span_at`)."""
    if len(ratios) == 1:
        return ratios[0]
    if chosen is not None and (mix.startswith("adapt-") or mix == "instance-random"):
        return chosen
    if mix.startswith("adapt-"):
        length += int(mix.split("-", 1)[1])
        if rule == "authors":
            return authors_adapt_ratio(ratios, window, max_positions, length)
    candidates = fitting_ratios(ratios, window, sink, max_positions, length, training, keep, rule, scheme)
    return min(candidates) if mix.startswith("adapt-") else candidates[int(torch.randint(len(candidates), ()).item())]


def authors_adapt_ratio(ratios: tuple[int, ...], window: int, max_positions: int, length: int) -> int:
    """adapt-N as the authors' code chooses it, for ``length`` tokens (the input plus N): ratio ``r`` reaches
    ``(max_positions - window) * r + window`` tokens (ratio 0: ``max_positions``), leaving out the sink and the last
    window's beacons; the shortest reach among those that reach ``length`` wins (the first listed on a tie), the
    largest ratio when none does."""
    reach = {ratio: (max_positions - window) * ratio + window if ratio else max_positions for ratio in ratios}
    reaching = [ratio for ratio in ratios if reach[ratio] >= length]
    return min(reaching, key=lambda ratio: reach[ratio]) if reaching else max(ratios)


def window_span(
    settings: BeaconSettings, length: int, max_positions: int, training: bool = False, keys: bool = False
) -> int:
    """Positions an input of ``length`` tokens occupies at most (:func:`span_at`; with ``keys``, the keys one query
    reads at most) under the training or the inference ratios and mix: at adapt-N's ratio, else at the smallest of
    :func:`fitting_ratios` (a random mix's worst draw)."""
    ratios, mix = settings.ratio_choice(training)
    window, sink, rule, scheme = settings.window, settings.sink, settings.layout_rule, settings.scheme
    keep = (settings.keep_start, settings.keep_end)
    if mix.startswith("adapt-"):
        ratio = choose_ratio(ratios, mix, window, max_positions, length, None, sink, training, rule, keep, scheme)
    else:
        ratio = min(fitting_ratios(ratios, window, sink, max_positions, length, training, keep, rule, scheme))
    return span_at(window, sink, ratio, length, training, rule, keep, scheme, keys)
