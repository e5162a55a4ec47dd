"""PNG plots of evaluation results (matplotlib's Figure API: no pyplot state, no backend or display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure


def _save(fig: Figure, ax: Axes, title: str, ylabel: str, path: str | Path) -> Path:
    """Label ``ax`` (x: context length), lay out ``fig`` and write it to ``path``."""
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return Path(path)


def depth_length_heatmap(
    scores: dict[tuple[int, float], float],
    path: str | Path,
    title: str,
    lengths: Sequence[int],
    depths: Sequence[float],
) -> Path:
    """The papers' needle-in-a-haystack picture of ``scores`` (``(length, depth) -> score in [0, 1]``): depth (rows,
    0% at the top) x length (columns)."""
    grid = [[scores[(length, depth)] for length in lengths] for depth in depths]
    fig = Figure(figsize=(1.2 + 0.9 * len(lengths), 1.0 + 0.5 * len(depths)))
    ax = fig.subplots()
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(length) for length in lengths])
    ax.set_yticks(range(len(depths)), [f"{100 * d:.0f}%" for d in depths])
    for row, depth_scores in enumerate(grid):
        for col, value in enumerate(depth_scores):
            ax.text(col, row, f"{value:.2f}", ha="center", va="center", fontsize=8)
    fig.colorbar(image, ax=ax, label="score")
    return _save(fig, ax, title, "needle depth", path)


def score_by_length(scores: dict[int, float], path: str | Path, title: str) -> Path:
    """Line plot of a task's score against context length."""
    lengths = sorted(scores)
    fig = Figure(figsize=(5, 3))
    ax = fig.subplots()
    ax.plot(lengths, [scores[length] for length in lengths], marker="o")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    return _save(fig, ax, title, "score", path)
