"""HARPE base selection: uniform (Eq. 9) and the peak-valley search against a slow loop reference."""

from __future__ import annotations

import math

import pytest
import torch

from longpeft.adapters.harpe import peak_valley_bases, select_bases, uniform_bases
from longpeft.adapters.harpe.selection import candidate_grid, peaks_and_valleys, waveform


def test_uniform_bases_follow_eq9():
    assert uniform_bases(1e6, 5e6, 5) == [1e6, 2e6, 3e6, 4e6, 5e6]
    assert uniform_bases(1e6, 5e6, 5, descending=True) == [5e6, 4e6, 3e6, 2e6, 1e6]
    assert uniform_bases(1e6, 5e6, 1) == [1e6]
    bases = uniform_bases(1e4, 2e4, 32)
    assert len(bases) == 32 and bases[0] == 1e4 and math.isclose(bases[-1], 2e4)


@pytest.mark.parametrize(
    "args,match", [((0.5, 10.0, 2), "b_min"), ((100.0, 10.0, 2), "b_max"), ((10.0, 100.0, 0), "positive integer")]
)
def test_uniform_bases_reject_bad_ranges(args, match):
    with pytest.raises(ValueError, match=match):
        uniform_bases(*args)


# ---- slow reference of the peak-valley search: plain Python loops --------------------------------


def _reference_search(b_min, b_max, n, stride, head_dim, target_length, window_fraction=1 / 64):
    radius = max(1, round(window_fraction * target_length))
    count = int((b_max - b_min) / stride + 1e-9)
    bases = [b_min] + [b_min + i * stride for i in range(1, count + 1)]

    def extrema(base):
        thetas = [base ** (-2 * j / head_dim) for j in range(head_dim // 2)]
        f = [sum(math.cos(m * t) for t in thetas) for m in range(target_length)]
        peaks, valleys = [], []
        for m in range(radius, target_length - radius):
            window = f[m - radius : m + radius + 1]
            if f[m] == max(window):
                peaks.append(m)
            if f[m] == min(window):
                valleys.append(m)
        return peaks, valleys

    def nearest_sum(points, targets):
        return sum(min(abs(p - t) for t in targets) for p in points)

    all_extrema = [extrema(b) for b in bases]
    chosen = [0]
    chosen_peaks, chosen_valleys = list(all_extrema[0][0]), list(all_extrema[0][1])
    while len(chosen) < n:
        scores = {
            i: nearest_sum(all_extrema[i][0], chosen_valleys) + nearest_sum(all_extrema[i][1], chosen_peaks)
            for i in range(1, len(bases))
            if i not in chosen
        }
        best = min(scores, key=lambda i: (scores[i], i))
        chosen.append(best)
        chosen_peaks += all_extrema[best][0]
        chosen_valleys += all_extrema[best][1]
    return sorted(bases[i] for i in chosen)


@pytest.mark.parametrize("n,stride,target_length", [(4, 2000.0, 640), (6, 1000.0, 384)])
def test_peak_valley_matches_loop_reference(n, stride, target_length):
    args = (1e4, 4e4, n, stride, 16, target_length)
    assert peak_valley_bases(*args, show_progress=False) == _reference_search(*args)


def test_peak_valley_output_properties():
    bases = peak_valley_bases(1e4, 5e4, 8, 1000.0, 16, 512, show_progress=False)
    grid = set(candidate_grid(1e4, 5e4, 1000.0))
    assert len(bases) == len(set(bases)) == 8
    assert bases == sorted(bases) and bases[0] == 1e4
    assert all(b in grid for b in bases[1:])
    assert bases == peak_valley_bases(1e4, 5e4, 8, 1000.0, 16, 512, show_progress=False)


def test_peak_valley_window_scales_with_target_length():
    """The finder keeps a bounded number of features at any length (a fixed window would not)."""
    for target_length in (4096, 65536):
        wave = waveform([5e5], 128, target_length)[0]
        peaks, valleys = peaks_and_valleys(wave, round(target_length / 64))
        assert 4 <= len(peaks) <= 32 and 4 <= len(valleys) <= 32
    fixed_window_peaks, _ = peaks_and_valleys(waveform([5e5], 128, 65536)[0], round(4096 / 64))
    assert len(fixed_window_peaks) > 200


def test_waveform_is_the_cosine_sum():
    wave = waveform([1e4], 8, 50)[0]
    thetas = [1e4 ** (-2 * j / 8) for j in range(4)]
    expected = torch.tensor([sum(math.cos(m * t) for t in thetas) for m in range(50)], dtype=torch.float64)
    torch.testing.assert_close(wave, expected, atol=1e-5, rtol=0)
    assert wave[0] == 4


def test_peak_valley_errors():
    with pytest.raises(ValueError, match="fewer than"):
        peak_valley_bases(1e4, 2e4, 8, 5000.0, 16, 512, show_progress=False)
    with pytest.raises(ValueError, match="stride"):
        peak_valley_bases(1e4, 2e4, 2, 0.0, 16, 512, show_progress=False)
    with pytest.raises(ValueError, match="head_dim"):
        peak_valley_bases(1e4, 2e4, 2, 1000.0, 15, 512, show_progress=False)
    with pytest.raises(ValueError, match="too short"):
        peak_valley_bases(1e4, 2e4, 2, 1000.0, 16, 3, show_progress=False)


def test_select_bases_dispatches_and_validates():
    assert select_bases("uniform", 1e4, 3e4, 3) == [1e4, 2e4, 3e4]
    assert select_bases("uniform", 1e4, 3e4, 3, descending=True) == [3e4, 2e4, 1e4]
    searched = select_bases("peak_valley", 1e4, 4e4, 4, stride=2000.0, head_dim=16, target_length=640)
    assert searched == peak_valley_bases(1e4, 4e4, 4, 2000.0, 16, 640, show_progress=False)
    assert (
        select_bases("peak_valley", 1e4, 4e4, 4, stride=2000.0, head_dim=16, target_length=640, descending=True)
        == searched[::-1]
    )
    with pytest.raises(ValueError, match="needs \\['stride'\\]"):
        select_bases("peak_valley", 1e4, 4e4, 4, head_dim=16, target_length=640)
    with pytest.raises(ValueError, match="unknown HARPE base selection 'random'"):
        select_bases("random", 1e4, 4e4, 4)
