"""Timelines: what ran where and when, shared by the simulator and the runtimes.

A :class:`Timeline` is a list of :class:`TimelineEvent` (worker, action text, start, end). The simulator
records events in its own cost units; the runtimes record seconds. Both can be summarised
(:attr:`Timeline.makespan`, :attr:`Timeline.bubble_fraction`, :attr:`Timeline.peak_activations`), written as
a Chrome trace for Perfetto, or drawn as a Gantt chart::

    worker 0 |F0|F1|F2|F3|      |B0|W0|...
    worker 1 |  |F0|F1|F2|F3|B0 |...
              ^^ idle gaps (the bubble) stay blank
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from fastpipe.trace.plotting import pyplot

__all__ = ["Timeline", "TimelineEvent"]

_ACTION_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|BW|F|B|W|U|P)(\d+)$")
_COMM = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
_COPY = ("P",)  # copies on a copy stream: drawn under their worker's row, not busy time
_COLOURS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868", "BW": "#c44e52", "U": "#222222", "P": "#937860"}
_COMM_COLOUR = "#bbbbbb"
# The legend says what each kind is: the letters alone mean nothing to a reader new to split backwards.
_MEANINGS = {
    "F": "F: forward",
    "B": "B: backward, input gradient",
    "W": "W: backward, weight gradient",
    "BW": "BW: backward, both (B + W)",
    "U": "U: optimizer update",
    "P": "P: prefetch of offloaded activations (a copy)",
}


def _time_axis(span: float, unit: str) -> tuple[float, str]:
    """The factor from the timeline's unit to the axis's, and the axis's unit.

    Seconds are drawn in the unit that keeps the span's figures short (a step is usually milliseconds);
    any other unit (the simulator's cost units) is drawn as it is.
    """
    if unit != "s":
        return 1.0, unit
    if span < 1e-3:
        return 1e6, "µs"
    if span < 10:
        return 1e3, "ms"
    return 1.0, "s"


def _parse(action: str) -> tuple[int, str, int] | None:
    match = _ACTION_RE.match(action)
    if match is None:
        return None
    return int(match.group(1)), match.group(2), int(match.group(3))


@dataclass(frozen=True)
class TimelineEvent:
    """One executed action.

    Attributes:
        worker: the worker (pipeline rank) that ran it.
        action: its text form, e.g. ``"1F3"`` (see :class:`fastpipe.schedule.Action`).
        start: start time (seconds for runtimes, cost units for the simulator).
        end: end time, same unit.
    """

    worker: int
    action: str
    start: float
    end: float

    @property
    def kind(self) -> str:
        """The action kind (``"F"``, ``"B"``, ``"W"``, ``"BW"``, a comm kind), or the raw text if unparsable."""
        parsed = _parse(self.action)
        return parsed[1] if parsed else self.action

    @property
    def duration(self) -> float:
        """``end - start``."""
        return self.end - self.start


class Timeline:
    """Events of one (simulated or measured) training step.

    Args:
        num_workers: number of workers (rows).
        events: initial events.
        unit: the unit of the events' times: ``"s"`` for a runtime's timeline, ``"cost units"``
            for a simulated one (the simulator's costs are relative).
    """

    def __init__(self, num_workers: int, events: Iterable[TimelineEvent] = (), unit: str = "s") -> None:
        self.num_workers = num_workers
        self.unit = unit
        self._events: list[TimelineEvent] = list(events)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        events = self.events
        if not events:
            return f"Timeline({self.num_workers} workers, no events)"
        scale, shown = _time_axis(self.makespan, self.unit)
        return (
            f"Timeline({self.num_workers} workers, {len(events)} events, makespan {self.makespan * scale:.4g} "
            f"{shown}, bubble {self.bubble_fraction:.1%})"
        )

    def record(self, worker: int, action: str, start: float, end: float) -> None:
        """Appends an event; safe to call from several threads."""
        event = TimelineEvent(worker, str(action), float(start), float(end))
        with self._lock:
            self._events.append(event)

    @property
    def events(self) -> list[TimelineEvent]:
        """Events sorted by (start, worker, end)."""
        with self._lock:
            return sorted(self._events, key=lambda e: (e.start, e.worker, e.end))

    @property
    def makespan(self) -> float:
        """Max end minus min start (0 without events)."""
        events = self.events
        if not events:
            return 0.0
        return max(e.end for e in events) - min(e.start for e in events)

    @property
    def busy(self) -> list[float]:
        """Per worker, the total duration of its compute events (neither communication nor copies)."""
        busy = [0.0] * self.num_workers
        for e in self.events:
            if e.kind not in _COMM and e.kind not in _COPY:
                busy[e.worker] += e.duration
        return busy

    @property
    def bubble_fraction(self) -> float:
        """``1 - busy / (num_workers * makespan)``; communication and copy events do not count as busy."""
        span = self.makespan
        if span <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (self.num_workers * span)

    @property
    def peak_activations(self) -> list[int]:
        """Per worker, the most (stage, micro-batch) activations alive at once.

        Definition: the activation of ``(stage, mb)`` is alive from the start of its ``F`` until the end of the
        backward that frees the stage input, i.e. its ``BW`` or, with a split backward, its ``B``. (The
        state kept after ``B`` for the deferred ``W``, the weight-side inputs and output grads, is not
        counted, as in the zero-bubble paper's comparison with 1F1B.) With virtual stages one unit is one
        stage chunk's activation for one micro-batch.
        """
        points: list[list[tuple[float, int]]] = [[] for _ in range(self.num_workers)]
        for e in self.events:
            parsed = _parse(e.action)
            if parsed is None:
                continue
            kind = parsed[1]
            if kind == "F":
                points[e.worker].append((e.start, 1))
            elif kind in ("B", "BW"):
                points[e.worker].append((e.end, -1))
        peaks = []
        for pts in points:
            pts.sort()  # at equal times a free (-1) comes before an allocation (+1)
            alive = peak = 0
            for _, delta in pts:
                alive += delta
                peak = max(peak, alive)
            peaks.append(peak)
        return peaks

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict; see :meth:`from_dict`."""
        return {"num_workers": self.num_workers, "unit": self.unit, "events": [asdict(e) for e in self.events]}

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Timeline:
        """Rebuilds a timeline written by :meth:`to_dict`."""
        return Timeline(
            int(data["num_workers"]), (TimelineEvent(**e) for e in data["events"]), unit=str(data.get("unit", "s"))
        )

    def to_chrome_trace(self, path: str | os.PathLike[str]) -> None:
        """Writes Chrome trace JSON (open in https://ui.perfetto.dev or chrome://tracing).

        One complete ("X") event per action, pid 0, tid = worker, timestamps in microseconds.
        """
        trace: list[dict[str, Any]] = [
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": w, "args": {"name": f"worker {w}"}}
            for w in range(self.num_workers)
        ]
        for e in self.events:
            trace.append(
                {
                    "name": e.action,
                    "cat": e.kind,
                    "ph": "X",
                    "pid": 0,
                    "tid": e.worker,
                    "ts": e.start * 1e6,
                    "dur": e.duration * 1e6,
                }
            )
        with open(path, "w") as f:
            json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f)

    def plot(self, path: str | os.PathLike[str], title: str | None = None, *, unit: str | None = None) -> None:
        """Draws a PNG Gantt chart: one row per worker, a colour per kind, micro-batch numbers in the boxes.

        The legend names each kind: F forward, B the input-gradient backward, W the weight-gradient
        backward, BW both backwards combined, U an optimizer update, P a prefetch (a thin bar along the
        bottom of its worker's row, from its issue to the copy's arrival), grey boxes sends and receives.

        Args:
            path: where the PNG goes.
            title: the chart's title (default: the makespan and the bubble).
            unit: the unit of the events' times, for the x-axis label (default: the timeline's
                own ``unit``): ``"s"`` is drawn in ms, or µs or s where those read better; any other
                unit is labelled as given.

        Raises:
            ImportError: if matplotlib is missing (``pip install matplotlib``).
        """
        plt = pyplot()
        from matplotlib.patches import Patch

        events = self.events
        origin = min((e.start for e in events), default=0.0)
        span = self.makespan or 1.0
        scale, shown = _time_axis(span, self.unit if unit is None else unit)
        kinds = [k for k in _MEANINGS if any(e.kind == k for e in events)]
        handles: list[Any] = [Patch(color=_COLOURS[k], label=_MEANINGS[k]) for k in kinds]
        if any(e.kind in _COMM for e in events):
            handles.append(Patch(color=_COMM_COLOUR, label="send / receive"))
        # 2 inches on the right hold the legend; the height fits all its entries even for one worker.
        width = min(4 + len(events) / max(self.num_workers, 1) * 0.35, 40) + 2
        fig, ax = plt.subplots(figsize=(width, max(1 + 0.5 * self.num_workers, 0.6 + 0.2 * len(handles))))
        for e in events:
            parsed = _parse(e.action)
            colour = _COMM_COLOUR if e.kind in _COMM else _COLOURS.get(e.kind, "#8172b2")
            height = 0.4 if e.kind in _COMM else 0.8
            if e.kind in _COPY:  # under the compute boxes, which it overlaps
                ax.broken_barh(
                    [((e.start - origin) * scale, e.duration * scale)], (e.worker + 0.4, 0.1), facecolors=colour
                )
                continue
            if e.kind == "U" and e.duration < span / 200:  # an update too short to see: a tick at its time
                ax.vlines((e.start - origin) * scale, e.worker - 0.45, e.worker + 0.45, colors=colour, linewidth=2)
                continue
            ax.broken_barh(
                [((e.start - origin) * scale, e.duration * scale)],
                (e.worker - height / 2, height),
                facecolors=colour,
                edgecolors="black",
                linewidth=0.3,
            )
            if parsed is not None and e.kind not in _COMM and e.duration > span / 200:
                ax.text(
                    (e.start - origin + e.duration / 2) * scale,
                    e.worker,
                    str(parsed[2]),
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white",
                )
        ax.set_yticks(range(self.num_workers))
        ax.set_yticklabels([f"worker {w}" for w in range(self.num_workers)])
        ax.invert_yaxis()
        ax.set_xlim(0, span * scale)
        ax.set_xlabel(f"time ({shown})")
        if handles:
            ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
        ax.set_title(title or f"makespan {span * scale:.4g} {shown}, bubble {self.bubble_fraction:.1%}")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
