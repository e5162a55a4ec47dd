"""Helpers shared by the benchmarks in scripts/: wall time and peak tensor memory of one call."""

from __future__ import annotations

import time

import torch
from torch.profiler import ProfilerActivity, profile


def timed(fn) -> float:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        fn()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def peak_bytes(fn, cuda: bool, grad: bool = False) -> int:
    """Peak tensor memory allocated while ``fn()`` runs (without autograd, unless ``grad``: a forward and backward),
    above what was allocated before it."""
    context = torch.enable_grad if grad else torch.no_grad
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with context():
            fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with context():
            fn()
    # Allocations are attributed to the op that made them (self memory), frees to "[memory]" events.
    held = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        held += event.self_cpu_memory_usage
        peak = max(peak, held)
    return peak
