"""Timelines: summaries, JSON round-trip, Chrome trace, Gantt PNG, thread-safe recording."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from fastpipe.schedule import build, simulate
from fastpipe.trace.timeline import Timeline, TimelineEvent


def test_summaries_on_a_hand_made_timeline() -> None:
    t = Timeline(2)
    t.record(0, "0F0", 0.0, 1.0)
    t.record(1, "1F0", 1.0, 2.0)
    t.record(1, "1BW0", 2.0, 4.0)
    t.record(0, "0BW0", 4.0, 6.0)
    t.record(0, "0SEND_F0", 1.0, 1.0)
    assert t.makespan == pytest.approx(6.0)
    assert t.bubble_fraction == pytest.approx(1 - 6.0 / 12.0)
    assert t.peak_activations == [1, 1]
    assert [e.action for e in t.events][:2] == ["0F0", "0SEND_F0"]


def test_split_backward_frees_at_b() -> None:
    t = Timeline(
        1,
        [
            TimelineEvent(0, "0F0", 0, 1),
            TimelineEvent(0, "0B0", 1, 2),
            TimelineEvent(0, "0F1", 2, 3),
            TimelineEvent(0, "0W0", 3, 4),
        ],
    )
    assert t.peak_activations == [1]


def test_dict_round_trip() -> None:
    t = simulate(build("1f1b", 3, 4))
    back = Timeline.from_dict(json.loads(json.dumps(t.to_dict())))
    assert back.events == t.events and back.num_workers == 3


def test_chrome_trace_has_one_event_per_action(tmp_path: Path) -> None:
    s = build("zb-h1", 2, 4)
    t = simulate(s)
    path = tmp_path / "trace.json"
    t.to_chrome_trace(path)
    data = json.loads(path.read_text())
    complete = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == sum(len(w) for w in s.workers)
    assert {e["tid"] for e in complete} == {0, 1} and all(e["pid"] == 0 for e in complete)
    first = min(complete, key=lambda e: e["ts"])
    assert first["name"] == "0F0" and first["dur"] == pytest.approx(1e6)


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "gantt.png"
    simulate(build("1f1b", 4, 8).with_communication(), comm=0.2).plot(path, title="1f1b")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def _drawn_xaxis(monkeypatch: pytest.MonkeyPatch, timeline: Timeline, path: Path, **kwargs: str) -> tuple:
    """The x-axis label and limits of the chart ``timeline.plot`` saves."""
    from matplotlib.figure import Figure

    seen: list[tuple] = []
    save = Figure.savefig

    def spy(fig: Figure, *args: object, **kw: object) -> None:
        ax = fig.axes[0]
        seen.append((ax.get_xlabel(), ax.get_xlim()))
        save(fig, *args, **kw)

    monkeypatch.setattr(Figure, "savefig", spy)
    timeline.plot(path, **kwargs)
    return seen[0]


@pytest.mark.parametrize(
    "span, label, right", [(0.25, "time (ms)", 250.0), (4e-4, "time (µs)", 400.0), (30.0, "time (s)", 30.0)]
)
def test_plot_labels_the_time_axis_with_its_unit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, span: float, label: str, right: float
) -> None:
    pytest.importorskip("matplotlib")
    start, half = 10.0, span / 2  # seconds, as a runtime records them
    measured = Timeline(
        2, [TimelineEvent(0, "0F0", start, start + half), TimelineEvent(1, "1F0", start + half, start + span)]
    )
    xlabel, xlim = _drawn_xaxis(monkeypatch, measured, tmp_path / "measured.png")
    assert xlabel == label and xlim == pytest.approx((0.0, right))


def test_plot_of_a_simulated_timeline_says_cost_units(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    simulated = simulate(build("gpipe", 2, 2))
    assert simulated.unit == "cost units" and Timeline.from_dict(simulated.to_dict()).unit == "cost units"
    # The timeline knows its unit: no argument needed, and an explicit one still wins.
    assert _drawn_xaxis(monkeypatch, simulated, tmp_path / "sim.png")[0] == "time (cost units)"
    assert _drawn_xaxis(monkeypatch, simulated, tmp_path / "sim.png", unit="s")[0] != "time (cost units)"


def test_record_is_thread_safe() -> None:
    t = Timeline(4)

    def work(w: int) -> None:
        for i in range(500):
            t.record(w, f"{w}F{i}", float(i), float(i) + 1)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(t.events) == 2000


def test_empty_timeline() -> None:
    t = Timeline(2)
    assert t.makespan == 0.0 and t.bubble_fraction == 0.0 and t.peak_activations == [0, 0]
