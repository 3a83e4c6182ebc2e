"""Schedules as data: build, validate, print and simulate pipeline schedules.

Example::

    from fastpipe import schedule
    s = schedule.build("1f1b", stages=4, microbatches=8)
    print(s)
    t = schedule.simulate(s, forward=1.0, backward=1.0, weight=1.0)
    t.makespan, t.bubble_fraction, t.peak_activations
"""

from fastpipe.schedule.builders import SCHEDULES, build
from fastpipe.schedule.ir import Action, ActionKind, Schedule, ScheduleError
from fastpipe.schedule.multistep import build_multistep, update_lag, weight_versions
from fastpipe.schedule.simulate import simulate, simulate_times, span_bubble_fraction
from fastpipe.trace import Timeline, TimelineEvent

__all__ = [
    "SCHEDULES",
    "Action",
    "ActionKind",
    "Schedule",
    "ScheduleError",
    "Timeline",
    "TimelineEvent",
    "build",
    "build_multistep",
    "simulate",
    "simulate_times",
    "span_bubble_fraction",
    "update_lag",
    "weight_versions",
]
