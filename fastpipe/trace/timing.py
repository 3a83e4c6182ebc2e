"""From a measured timeline to per-action costs, and the simulator's prediction from them.

A runtime's :class:`~fastpipe.trace.timeline.Timeline` records seconds per action; :func:`action_costs` takes the
median per action kind and stage, and :func:`simulate_measured` prices a schedule with them, so a measured
bubble can be set beside the one the simulator predicts (``fastpipe train``'s report, the benchmarks).
"""

from __future__ import annotations

import statistics
from collections import defaultdict

from fastpipe.schedule import Schedule, build, simulate
from fastpipe.trace.timeline import Timeline

__all__ = ["action_costs", "simulate_measured"]


def _stage_and_kind(action: str) -> tuple[int, str]:
    digits = len(action) - len(action.lstrip("0123456789"))
    return int(action[:digits]), action[digits:].rstrip("0123456789")


def action_costs(timeline: Timeline, num_stages: int) -> dict[str, list[float]]:
    """Median duration of each action kind (``F``, ``B``, ``W``, ``BW``, ``U``) per stage.

    Only kinds measured on every stage are returned.
    """
    samples: dict[tuple[str, int], list[float]] = defaultdict(list)
    for e in timeline.events:
        if not e.action[:1].isdigit():
            continue
        stage, kind = _stage_and_kind(e.action)
        samples[(kind, stage)].append(e.end - e.start)
    return {
        kind: [statistics.median(samples[(kind, s)]) for s in range(num_stages)]
        for kind in ("F", "B", "W", "BW", "U")
        if all((kind, s) in samples for s in range(num_stages))
    }


def simulate_measured(
    timeline: Timeline, schedule: str | Schedule, workers: int, microbatches: int, virtual_stages: int = 1
) -> Timeline:
    """The simulator's timeline of ``schedule`` priced with the costs measured in ``timeline``.

    ``schedule`` is a name for :func:`fastpipe.schedule.build` or a built schedule (a
    stream of mini-batches, whose weight updates ``U`` are priced as measured too).

    Backwards measured only combined (``BW``) are split half and half into B and W where the
    schedule needs them; a measured combined cost prices the schedule's combined backwards.
    """
    num_stages = workers * virtual_stages
    costs = action_costs(timeline, num_stages)
    if "F" not in costs or not ("BW" in costs or ("B" in costs and "W" in costs)):
        raise ValueError("the timeline lacks forward or backward actions on some stage")
    backward = costs.get("B") or [c / 2 for c in costs["BW"]]
    weight = costs.get("W") or [c / 2 for c in costs["BW"]]
    built = (
        build(schedule, workers, microbatches, virtual_stages=virtual_stages) if isinstance(schedule, str) else schedule
    )
    return simulate(
        built,
        forward=costs["F"],
        backward=backward,
        weight=weight,
        combined=costs.get("BW"),
        update=costs.get("U", 0.0),
    )
