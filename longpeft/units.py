"""How longpeft writes quantities for people: durations in the unit that keeps them readable. Torch-free."""

from __future__ import annotations


def format_duration(seconds: float) -> str:
    """``"42.0 s"`` under a minute, ``"12.5 min"`` under an hour, ``"3.2 h"`` from an hour on (one decimal each),
    so a short run never reads as ``0.0 h``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
