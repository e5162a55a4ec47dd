"""scripts/repro_harpe_table2.py's --cited search: its feature points and cover counts against brute force."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "repro_harpe_table2.py"
spec = importlib.util.spec_from_file_location("repro_harpe_table2", SCRIPT)
repro = importlib.util.module_from_spec(spec)
spec.loader.exec_module(repro)


def test_local_maxima_against_a_loop():
    values = torch.randn(500, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    expected = [i for i in range(1, 499) if values[i - 1] < values[i] > values[i + 1]]
    assert repro.local_maxima(values) == expected


def test_envelope_peaks_walk_the_upper_envelope():
    # A ripple under a slow hump: local maxima every 10 samples; the envelope's tallest point is at 300.
    x = torch.arange(1000, dtype=torch.float64)
    values = torch.cos(2 * torch.pi * x / 10) + 5 * torch.exp(-(((x - 300) / 200) ** 2))
    # Right of 300 the envelope falls, so each span's highest sample is the next crest, 10 samples on: the walk
    # matches every crest and keeps those more than `gap` = 50 past the last kept one.
    assert repro.envelope_peaks(values, count=4, gap=50, span=500) == [300, 360, 420, 480]
    # Valleys: the same walk on the negated waveform finds its troughs, which lie between the crests.
    assert all(v % 10 == 5 for v in repro.envelope_peaks(-values, count=4, gap=50, span=500))


def test_covered_counts_pairs_within_the_radius():
    n, squares = repro.covered([10.0, 20.0, 30.0], [11.0, 23.0, 50.0], radius=3)
    assert (n, squares) == (2, 1.0 + 9.0)
    assert repro.covered([], [1.0], 3) == (0, 0.0)


def test_cited_search_returns_the_heads_bases_from_the_grid():
    bases = repro.cited_search(1000, 4090, count=6, radius=3)
    grid = {repro.B_MIN, *repro.candidate_grid(repro.B_MIN, repro.B_MAX, repro.STRIDE)}
    assert bases is not None and len(bases) == repro.HEADS == len(set(bases))
    assert bases[0] == repro.B_MIN and set(bases) <= grid and bases == sorted(bases)
