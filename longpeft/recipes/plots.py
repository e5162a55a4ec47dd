"""Loss-curve PNG (matplotlib's Figure API: no pyplot state, no backend or display needed)."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure


def plot_loss(points: list[tuple[int, float]], path: Path, title: str) -> Path:
    """Plot ``(step, loss)`` points to a PNG; returns its path."""
    fig = Figure(figsize=(6, 3.5), dpi=100)
    ax = fig.subplots()
    if points:
        steps, losses = zip(*points)
        ax.plot(steps, losses, marker="o", markersize=2, linewidth=1.2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    return path
