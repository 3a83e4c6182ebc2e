"""The benchmark charts: every series visible and named, no legend over the data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

matplotlib = pytest.importorskip("matplotlib")
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from fastpipe.bench.charts import ratio_chart  # noqa: E402
from fastpipe.bench.memory import plot_memory  # noqa: E402
from fastpipe.bench.scaling import plot_e2e  # noqa: E402
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


def _drawn(fig: Figure) -> Any:
    """A renderer after drawing ``fig`` as its PNG was drawn (the same layout, the same dpi)."""
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return canvas.get_renderer()


@pytest.mark.parametrize("workers", [(4,), (4, 8)])
def test_schedules_legend_shows_every_name_whole_beside_the_panels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: tuple[int, ...]
) -> None:
    figures = _saved_figure(monkeypatch)
    rows = run_schedules(workers=workers, microbatches=(4, 8, 16))
    names = list(dict.fromkeys(r["schedule"] for r in rows))
    assert {"gpipe", "1f1b", "dualpipev (v=2)"} <= set(names)
    plot_schedules(rows, str(tmp_path / "schedules.png"))
    (fig,) = figures
    renderer = _drawn(fig)
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == names
    box = legend.get_window_extent(renderer)
    assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1 and fig.bbox.y0 <= box.y0 and box.y1 <= fig.bbox.y1
    for text in legend.get_texts():  # each name inside the PNG, none cut at its edge
        extent = text.get_window_extent(renderer)
        assert fig.bbox.x0 <= extent.x0 and extent.x1 <= fig.bbox.x1
    assert not any(ax.get_window_extent(renderer).overlaps(box) for ax in fig.axes)


def _e2e_result(speedups: dict[str, float]) -> dict[str, Any]:
    rows = [
        {"method": m, "median_s": 1.0, "speedup_over_1_device": s, "fraction_of_limit": s} for m, s in speedups.items()
    ]
    return {"rows": rows, "ideal_speedup": 1.6, "k": 2, "m": 4}


def test_e2e_chart_draws_and_labels_every_bar_clear_of_the_legend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    figures = _saved_figure(monkeypatch)
    speedups = {
        "plain, 1 device, full batch": 2.33,
        "gradient accumulation, 1 device (T_mb)": 1.0,
        "fastpipe train_step 1f1b": 1.52,
        "torchgpipe": 0.004,  # far shorter than the others: its label still says what it is
        "torch.distributed.pipelining 1f1b (2 gloo ranks)": 1.41,
    }
    plot_e2e(_e2e_result(speedups), str(tmp_path / "e2e.png"))
    (fig,) = figures
    (ax,) = fig.axes
    renderer = _drawn(fig)
    bars = list(ax.patches)
    assert [b.get_width() for b in bars] == list(speedups.values())
    assert [t.get_text() for t in ax.get_yticklabels()] == list(speedups)
    assert [t.get_text() for t in ax.texts] == [f"{v:.2f}x" for v in speedups.values()]
    colours = {m: b.get_facecolor() for m, b in zip(speedups, bars)}
    assert colours["fastpipe train_step 1f1b"] != colours["torchgpipe"] != colours["plain, 1 device, full batch"]
    (legend_artist,) = fig.legends
    legend = legend_artist.get_window_extent(renderer)
    assert fig.bbox.x0 <= legend.x0 and legend.x1 <= fig.bbox.x1 and legend.y1 <= fig.bbox.y1
    for artist in [*bars, *ax.texts]:
        assert not artist.get_window_extent(renderer).overlaps(legend)
    axes = ax.get_window_extent(renderer)
    for label in ax.texts:  # right of its bar, inside the axes
        box = label.get_window_extent(renderer)
        assert axes.x0 <= box.x0 and box.x1 <= axes.x1


def test_ratio_chart_keeps_a_missing_figures_row_and_refuses_mismatched_input(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    figures = _saved_figure(monkeypatch)
    path = str(tmp_path / "ratios.png")
    ratio_chart(path, ["plain", "fastpipe"], [float("nan"), 1.08], reference=1.0, reference_label="limit", xlabel="x")
    (fig,) = figures
    assert [t.get_text() for t in fig.axes[0].texts] == ["n/a", "1.08x"]
    with pytest.raises(ValueError, match="2 methods but 1 values"):
        ratio_chart(path, ["a", "b"], [1.0], reference=1.0, reference_label="limit", xlabel="x")
