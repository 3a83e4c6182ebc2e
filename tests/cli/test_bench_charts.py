"""The benchmark charts: every series visible and named, no legend over the data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

matplotlib = pytest.importorskip("matplotlib")
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from fastpipe.bench.memory import plot_memory  # noqa: E402
from fastpipe.bench.schedules import plot as plot_schedules  # noqa: E402
from fastpipe.bench.schedules import run as run_schedules  # noqa: E402


def _saved_figure(monkeypatch: pytest.MonkeyPatch) -> list[Figure]:
    """Collects each figure as it is saved (the plot functions close their figures afterwards)."""
    figures: list[Figure] = []
    save = Figure.savefig

    def spy(fig: Figure, *args: Any, **kwargs: Any) -> None:
        save(fig, *args, **kwargs)
        figures.append(fig)

    monkeypatch.setattr(Figure, "savefig", spy)
    return figures


def test_schedules_chart_shows_and_names_every_schedule(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    figures = _saved_figure(monkeypatch)
    rows = run_schedules(workers=(4,), microbatches=(4, 8, 16))
    names = list(dict.fromkeys(r["schedule"] for r in rows))
    plot_schedules(rows, str(tmp_path / "schedules.png"))
    (fig,) = figures
    assert [t.get_text() for t in fig.legends[0].get_texts()] == names
    for ax in fig.axes:
        lines = ax.get_lines()
        assert [line.get_label() for line in lines] == names
        # 1f1b and zb-h1 keep the same activations: where series coincide, each must still show.
        assert len({(line.get_marker(), str(line.get_linestyle())) for line in lines}) == len(lines)
        sizes = [line.get_markersize() for line in lines]
        assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)  # later ones sit inside
        assert all(line.get_markerfacecolor() == "none" for line in lines)


def test_memory_legend_leaves_the_bars_uncovered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    figures = _saved_figure(monkeypatch)
    # Shaped like a CPU run: at the small batch every mode nearly fills the axes.
    blocks = {32: [54251, 58867, 62368, 62368], 512: [16240, 26010, 43127, 43128]}
    modes = ("plain", "fused", "recompute", "recompute + fused")
    rows = [
        {"batch": b, "mode": m, "largest_blocks": n, "ratio_to_plain": n / counts[0]}
        for b, counts in blocks.items()
        for m, n in zip(modes, counts)
    ]
    plot_memory({"rows": rows, "batches": list(blocks), "budget_bytes": 16 * 2**30}, str(tmp_path / "memory.png"))
    (fig,) = figures
    (ax,) = fig.axes
    canvas = FigureCanvasAgg(fig)  # the same pixels as the PNG, at its dpi
    canvas.draw()
    renderer = canvas.get_renderer()
    legend = ax.get_legend().get_window_extent(renderer)
    assert fig.bbox.x0 <= legend.x0 and legend.x1 <= fig.bbox.x1 + 1  # inside the PNG, not cut off
    covered = [p for p in ax.patches if p.get_window_extent(renderer).overlaps(legend)]
    assert covered == []
    labels = [t.get_window_extent(renderer) for t in ax.texts]
    assert all(box.y1 <= ax.bbox.y1 for box in labels)  # the ratio labels fit under the top of the axes
