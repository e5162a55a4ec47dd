"""Choosing HARPE's per-head RoPE bases: uniform spacing, or the greedy peak-valley search.

Definitions used by the peak-valley search (the paper gives the algorithm, not these details):

- **Waveform.** For base ``b`` and relative distance ``m`` (tokens), ``f_b(m) = sum_j cos(m * theta_j)``
  over the ``head_dim / 2`` rotary frequencies ``theta_j = b ** (-2j / head_dim)`` (the float32
  frequencies the model uses, the angles in float64). ``f_b`` is the attention score of a query and
  key whose every rotary pair is the same unit vector: RoPE's distance profile for that base.
- **Distance range.** ``m = 0, 1, ..., target_length - 1``: every distance the model must handle.
- **Peaks and valleys.** ``m`` is a peak when ``f_b(m)`` is the maximum of ``f_b`` over the window
  ``[m - r, m + r]`` and the whole window lies inside the range (a valley likewise with the
  minimum), with ``r = max(1, round(window_fraction * target_length))``. The fastest rotary pairs
  make ``f_b`` ripple every few tokens; a fixed window tuned for 4K distances returns thousands of
  those ripples at 128K and the search then matches noise. A window proportional to the target
  length keeps the same number of features (at most ``1 / (2 * window_fraction)``, 32 by default)
  at any length, so the search compares the shape of the waveforms, not their ripple.
- **Score.** For a candidate ``b`` with peaks ``P_b`` and valleys ``V_b``, and the peaks ``P_s`` and
  valleys ``V_s`` of all bases chosen so far:
  ``d(b) = sum_{p in P_b} min_{v in V_s} |p - v| + sum_{v in V_b} min_{p in P_s} |v - p|``.
  The paper pairs the i-th peak with the i-th valley, which is undefined when the chosen sets grow
  with every pick; nearest-neighbour matching is the well-defined version of "peaks fall on the
  chosen valleys and valleys on the chosen peaks". The sum (not the mean) is the paper's.
- **Greedy.** Start from ``{b_min}``; repeatedly add the not-yet-chosen candidate of
  ``{b_min + i * stride, i = 1 .. floor((b_max - b_min) / stride)}`` with the smallest ``d``
  (ties: the smaller base), until ``n`` bases are chosen.
"""

from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm

from ...errors import ConfigError
from ...rope import per_head_inv_freq

SELECTIONS = ("uniform", "peak_valley")
DEFAULT_WINDOW_FRACTION = 1 / 64


def _check_range(b_min: float, b_max: float, n: int) -> None:
    if not (math.isfinite(b_min) and math.isfinite(b_max)) or b_min <= 1:
        raise ValueError(f"b_min must be a finite RoPE base > 1, got {b_min}")
    if b_max < b_min:
        raise ValueError(f"b_max ({b_max}) must be >= b_min ({b_min})")
    if int(n) != n or n < 1:
        raise ValueError(f"n (the number of bases, one per KV head) must be a positive integer, got {n}")


def uniform_bases(b_min: float, b_max: float, n: int, descending: bool = False) -> list[float]:
    """``n`` bases evenly spaced over ``[b_min, b_max]`` (the paper's Eq. 9).

    ``b_h = b_min + h * (b_max - b_min) / (n - 1)`` for ``h = 0 .. n-1`` (``[b_min]`` when ``n == 1``),
    in ascending head order, or descending when ``descending``.
    """
    _check_range(b_min, b_max, n)
    if n == 1:
        return [float(b_min)]
    step = (b_max - b_min) / (n - 1)
    bases = [float(b_min + h * step) for h in range(n)]
    return bases[::-1] if descending else bases


def candidate_grid(b_min: float, b_max: float, stride: float) -> list[float]:
    """The search's candidates ``b_min + i * stride`` for ``i = 1 .. floor((b_max - b_min) / stride)`` (Eq. 10)."""
    if stride is None or not math.isfinite(stride) or stride <= 0:
        raise ValueError(f"stride must be a positive number of base units, got {stride}")
    count = int(math.floor((b_max - b_min) / stride + 1e-9))
    return [float(b_min + i * stride) for i in range(1, count + 1)]


def waveform(bases: list[float], head_dim: int, target_length: int) -> torch.Tensor:
    """``f_b(m) = sum_j cos(m * theta_j)`` for each base and ``m = 0 .. target_length - 1``.

    Returns:
        float64 ``[len(bases), target_length]``.
    """
    theta = per_head_inv_freq(bases, head_dim).double()  # [N, D/2], the model's float32 frequencies
    distances = torch.arange(target_length, dtype=torch.float64)
    return torch.stack([torch.cos(distances[:, None] * row[None, :]).sum(dim=1) for row in theta])


def window_max(x: torch.Tensor, width: int) -> torch.Tensor:
    """``out[i] = max(x[i : i + width])`` for ``i = 0 .. len(x) - width``, in O(len(x)).

    Van Herk / Gil-Werman: cut ``x`` into blocks of ``width``; a window spans at most two blocks, so
    its maximum is the max of the suffix-maximum in the first block and the prefix-maximum in the
    second.
    """
    length = x.numel()
    padded = torch.cat((x, x.new_full((-length % width,), -math.inf))).view(-1, width)
    prefix = padded.cummax(dim=1).values.flatten()
    suffix = padded.flip(1).cummax(dim=1).values.flip(1).flatten()
    starts = torch.arange(length - width + 1)
    return torch.maximum(suffix[starts], prefix[starts + width - 1])


def peaks_and_valleys(wave: torch.Tensor, radius: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Windowed extrema of a 1-D waveform.

    ``m`` is a peak (valley) when ``wave[m]`` is the maximum (minimum) over ``[m - radius, m + radius]``
    and that window lies inside the waveform.

    Args:
        wave: ``[T]``.
        radius: half-width of the window, in samples.

    Returns:
        ``(peaks, valleys)``: float64 positions, ascending.
    """
    centre = wave[radius : wave.numel() - radius]  # positions whose window lies inside
    peaks = torch.nonzero(centre == window_max(wave, 2 * radius + 1)).flatten() + radius
    valleys = torch.nonzero(centre == -window_max(-wave, 2 * radius + 1)).flatten() + radius
    return peaks.double(), valleys.double()


def _nearest_distance_sum(points: torch.Tensor, targets: torch.Tensor) -> float:
    """``sum_{x in points} min_{t in targets} |x - t|`` (inf when ``targets`` is empty)."""
    if points.numel() == 0:
        return 0.0
    if targets.numel() == 0:
        return math.inf
    return float((points[:, None] - targets[None, :]).abs().min(dim=1).values.sum())


def peak_valley_bases(
    b_min: float,
    b_max: float,
    n: int,
    stride: float,
    head_dim: int,
    target_length: int,
    window_fraction: float = DEFAULT_WINDOW_FRACTION,
    show_progress: bool = True,
) -> list[float]:
    """HARPE's peak-valley search (the paper's Algorithm 1; definitions in the module docstring).

    Greedy: start from ``b_min``; each step adds the candidate on the stride grid whose waveform
    peaks lie nearest the valleys chosen so far and whose valleys lie nearest the chosen peaks.

    Args:
        b_min, b_max: range of bases; ``b_min`` is always chosen.
        n: number of bases (one per KV head).
        stride: step of the candidate grid, in base units (e.g. 30_000).
        head_dim: attention head size (sets the rotary frequencies).
        target_length: longest distance (tokens) the model must handle; sets the distance range and
            the peak/valley window.
        window_fraction: peak/valley window half-width as a fraction of ``target_length``.
        show_progress: tqdm bar over the candidates' waveforms.

    Returns:
        ``n`` bases in ascending order (head ``g`` gets the g-th smallest, as in the paper's Table 2).
    """
    _check_range(b_min, b_max, n)
    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even number, got {head_dim}")
    if not 0 < window_fraction < 0.5:
        raise ValueError(f"window_fraction must be in (0, 0.5), got {window_fraction}")
    radius = max(1, round(window_fraction * target_length))
    if target_length < 4 * radius + 1:
        raise ConfigError(f"target_length={target_length} is too short for the peak/valley window (radius {radius})")
    candidates = candidate_grid(b_min, b_max, stride)
    if len(candidates) < n - 1:
        raise ConfigError(
            f"the stride grid over [{b_min}, {b_max}] with stride {stride} has {len(candidates)} candidates, "
            f"fewer than the {n - 1} bases to add; lower the stride or widen the range"
        )
    all_bases = [float(b_min), *candidates]
    extrema = []
    for base in tqdm(all_bases, desc="HARPE waveforms", unit="base", disable=not show_progress):
        extrema.append(peaks_and_valleys(waveform([base], head_dim, target_length)[0], radius))
    chosen_peaks, chosen_valleys = extrema[0]
    if chosen_peaks.numel() == 0 or chosen_valleys.numel() == 0:
        raise ConfigError(
            f"the waveform of b_min={b_min} has no peak or valley within {target_length} tokens at window "
            f"radius {radius}; raise target_length or lower window_fraction"
        )
    chosen = [0]
    while len(chosen) < n:
        best_index, best_score = None, math.inf
        for index in range(1, len(all_bases)):
            if index in chosen:
                continue
            peaks, valleys = extrema[index]
            if peaks.numel() == 0 and valleys.numel() == 0:
                continue  # a waveform without features cannot complement anything
            score = _nearest_distance_sum(peaks, chosen_valleys) + _nearest_distance_sum(valleys, chosen_peaks)
            if score < best_score:
                best_index, best_score = index, score
        if best_index is None:
            raise ConfigError(
                f"only {len(chosen)} of the candidate waveforms have peaks or valleys within {target_length} tokens; "
                "raise target_length, lower window_fraction or widen the base range"
            )
        chosen.append(best_index)
        chosen_peaks = torch.cat((chosen_peaks, extrema[best_index][0]))
        chosen_valleys = torch.cat((chosen_valleys, extrema[best_index][1]))
    return sorted(all_bases[i] for i in chosen)


def select_bases(
    selection: str,
    b_min: float,
    b_max: float,
    n: int,
    stride: float | None = None,
    head_dim: int | None = None,
    target_length: int | None = None,
    descending: bool = False,
) -> list[float]:
    """One RoPE base per KV head by the named selection.

    Args:
        selection: ``"uniform"`` (Eq. 9; ``stride``, ``head_dim``, ``target_length`` unused) or
            ``"peak_valley"`` (needs ``stride``, ``head_dim`` and ``target_length``).
        descending: assign the bases to heads from the largest down (both selections).
    """
    if selection == "uniform":
        return uniform_bases(b_min, b_max, n, descending=descending)
    if selection == "peak_valley":
        missing = [
            name
            for name, v in (("stride", stride), ("head_dim", head_dim), ("target_length", target_length))
            if v is None
        ]
        if missing:
            raise ValueError(f"selection 'peak_valley' needs {missing}")
        bases = peak_valley_bases(b_min, b_max, n, stride, head_dim, target_length)
        return bases[::-1] if descending else bases
    raise ValueError(f"unknown HARPE base selection {selection!r}; choose one of {SELECTIONS}")
