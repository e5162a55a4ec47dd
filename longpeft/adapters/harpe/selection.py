"""Choosing HARPE's per-head RoPE bases: uniform spacing, or the greedy peak-valley search, whose details the paper
leaves open and which is defined here (why: docs/methods.md, HARPE):

- **Waveform.** ``f_b(m) = sum_j cos(m * theta_j)`` over the ``head_dim / 2`` rotary frequencies
  ``theta_j = b ** (-2j / head_dim)`` of base ``b`` (the model's float32 frequencies, the angles in float64), for
  the distances ``m = 0 .. target_length - 1``: RoPE's distance profile for that base.
- **Peaks and valleys.** ``m`` is a peak (valley) when ``f_b(m)`` is the maximum (minimum) of ``f_b`` over
  ``[m - r, m + r]`` and that window lies inside the range, with ``r = max(1, round(window_fraction * L))``
  (``L``: ``target_length``), so at most ``1 / (2 * window_fraction)`` features (32 by default) at any length.
- **Score.** With ``P_b``, ``V_b`` a candidate's peaks and valleys and ``P_s``, ``V_s`` those of the bases chosen so
  far: ``d(b) = sum_{p in P_b} min_{v in V_s} |p - v| + sum_{v in V_b} min_{p in P_s} |v - p|``.
- **Greedy.** Start from ``{b_min}``; add the not-yet-chosen candidate ``b_min + i * stride``
  (``i = 1 .. floor((b_max - b_min) / stride)``) with the smallest ``d`` (ties: the smaller) until ``n`` are chosen."""

from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm

from ...errors import ConfigError
from ...rope import per_head_inv_freq

DEFAULT_WINDOW_FRACTION = 1 / 64


def _check_range(b_min: float, b_max: float, n: int) -> None:
    if not (math.isfinite(b_min) and math.isfinite(b_max)) or b_min <= 1:
        raise ValueError(f"b_min must be a finite RoPE base > 1, got {b_min}")
    if b_max < b_min:
        raise ValueError(f"b_max ({b_max}) must be >= b_min ({b_min})")
    if int(n) != n or n < 1:
        raise ValueError(f"n (the number of bases, one per KV head) must be a positive integer, got {n}")


def uniform_bases(b_min: float, b_max: float, n: int, descending: bool = False) -> list[float]:
    """``n`` bases evenly spaced over ``[b_min, b_max]`` (Eq. 9: ``b_h = b_min + h * (b_max - b_min) / (n - 1)``;
    ``[b_min]`` when ``n == 1``), in ascending head order, or descending when ``descending``."""
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
    """``f_b(m)`` for each base and ``m = 0 .. target_length - 1``: float64 ``[len(bases), target_length]``."""
    theta = per_head_inv_freq(bases, head_dim).double()  # [N, D/2], the model's float32 frequencies
    distances = torch.arange(target_length, dtype=torch.float64)
    return torch.stack([torch.cos(distances[:, None] * row[None, :]).sum(dim=1) for row in theta])


def window_max(x: torch.Tensor, width: int) -> torch.Tensor:
    """``out[i] = max(x[i : i + width])`` for ``i = 0 .. len(x) - width``, in O(len(x)) (Van Herk / Gil-Werman: a
    window spans at most two blocks of ``width``, so its maximum is a suffix maximum's and a prefix maximum's)."""
    length = x.numel()
    padded = torch.cat((x, x.new_full((-length % width,), -math.inf))).view(-1, width)
    prefix = padded.cummax(dim=1).values.flatten()
    suffix = padded.flip(1).cummax(dim=1).values.flip(1).flatten()
    starts = torch.arange(length - width + 1)
    return torch.maximum(suffix[starts], prefix[starts + width - 1])


def peaks_and_valleys(wave: torch.Tensor, radius: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(peaks, valleys)`` of a waveform ``wave`` ``[T]``, float64 positions, ascending: ``m`` where ``wave[m]`` is
    the maximum (minimum) over ``[m - radius, m + radius]`` and that window lies inside the waveform."""
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
    """HARPE's peak-valley search (the paper's Algorithm 1, defined in the module docstring): ``n`` bases, one per KV
    head, from ``b_min`` (always chosen) and a grid of ``stride`` base units up to ``b_max``, for heads of ``head_dim``
    and distances up to ``target_length`` tokens (window half-width ``window_fraction * target_length``; a tqdm bar
    when ``show_progress``), ascending: head ``g`` gets the g-th smallest, as in the paper's Table 2."""
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
    waveforms = tqdm(all_bases, desc="HARPE waveforms", unit="base", disable=not show_progress)
    extrema = [peaks_and_valleys(waveform([base], head_dim, target_length)[0], radius) for base in waveforms]
    chosen_peaks, chosen_valleys = extrema[0]
    if chosen_peaks.numel() == 0 or chosen_valleys.numel() == 0:
        raise ConfigError(
            f"the waveform of b_min={b_min} has no peak or valley within {target_length} tokens at window "
            f"radius {radius}; raise target_length or lower window_fraction"
        )
    chosen = [0]
    while len(chosen) < n:
        scores = {  # a waveform without features cannot complement anything
            index: _nearest_distance_sum(peaks, chosen_valleys) + _nearest_distance_sum(valleys, chosen_peaks)
            for index, (peaks, valleys) in enumerate(extrema)
            if index not in chosen and (peaks.numel() or valleys.numel())
        }
        if not scores:
            raise ConfigError(
                f"only {len(chosen)} of the candidate waveforms have peaks or valleys within {target_length} tokens; "
                "raise target_length, lower window_fraction or widen the base range"
            )
        best_index = min(scores, key=scores.get)  # ties: the smaller base
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
    """One RoPE base per KV head by ``selection``: ``"uniform"`` (Eq. 9) or ``"peak_valley"`` (which needs
    ``stride``, ``head_dim`` and ``target_length``); ``descending`` gives the heads the bases from the largest down."""
    if selection == "uniform":
        return uniform_bases(b_min, b_max, n, descending=descending)
    if selection == "peak_valley":
        needed = {"stride": stride, "head_dim": head_dim, "target_length": target_length}
        missing = [name for name, value in needed.items() if value is None]
        if missing:
            raise ValueError(f"selection 'peak_valley' needs {missing}")
        bases = peak_valley_bases(b_min, b_max, n, stride, head_dim, target_length)
        return bases[::-1] if descending else bases
    raise ValueError(f"unknown HARPE base selection {selection!r}; choose one of ('uniform', 'peak_valley')")
