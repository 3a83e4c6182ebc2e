"""The Gantt chart explains itself: its legend says what F, B, W, BW, U and the grey boxes are."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fastpipe.schedule import build, simulate
from fastpipe.trace.timeline import Timeline, TimelineEvent

pytest.importorskip("matplotlib")


def _saved(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    from matplotlib.figure import Figure

    figures: list[Any] = []
    save = Figure.savefig

    def spy(fig: Figure, *args: Any, **kwargs: Any) -> None:
        save(fig, *args, **kwargs)
        figures.append(fig)

    monkeypatch.setattr(Figure, "savefig", spy)
    return figures


def _legend_inside(fig: Any) -> tuple[list[str], bool]:
    """The legend's entries, and whether all of it lies inside the PNG and off the chart."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    (ax,) = fig.axes
    legend = ax.get_legend()
    box = legend.get_window_extent(renderer)
    inside = fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1 and fig.bbox.y0 <= box.y0 and box.y1 <= fig.bbox.y1
    return [t.get_text() for t in legend.get_texts()], inside and not ax.bbox.overlaps(box)


def test_legend_spells_out_every_kind_even_on_a_one_worker_chart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    figures = _saved(monkeypatch)
    kinds = ["0F0", "0B0", "0W0", "0BW1", "0U0", "0SEND_F1"]
    Timeline(1, [TimelineEvent(0, a, i, i + 1) for i, a in enumerate(kinds)], unit="cost units").plot(
        tmp_path / "t.png"
    )
    entries, inside = _legend_inside(figures[0])
    assert entries == [
        "F: forward",
        "B: backward, input gradient",
        "W: backward, weight gradient",
        "BW: backward, both (B + W)",
        "U: optimizer update",
        "send / receive",
    ]
    assert inside


def test_legend_lists_only_the_kinds_the_step_ran(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    figures = _saved(monkeypatch)
    simulate(build("zb-h1", 4, 8)).plot(tmp_path / "zb.png")
    entries, inside = _legend_inside(figures[0])
    assert entries == ["F: forward", "B: backward, input gradient", "W: backward, weight gradient"]
    assert inside
