"""Schedules as data: build, validate, print and simulate pipeline schedules.

Example::

    from fastpipe import schedule
    s = schedule.build("1f1b", stages=4, microbatches=8)
    print(s)
    t = schedule.simulate(s, forward=1.0, backward=1.0, weight=1.0)
    t.makespan, t.bubble_fraction, t.peak_activations

The fastest schedule for given costs (what ``schedule="auto"`` runs)::

    from fastpipe.schedule.search import StageCosts, search
    choice = search(StageCosts.uniform(4, backward=1.2, weight=0.8, comm=0.1), stages=4, microbatches=8)
    print(choice.table())
"""

from fastpipe.schedule.builders import SCHEDULES, build
from fastpipe.schedule.greedy import greedy_schedule
from fastpipe.schedule.ir import Action, ActionKind, Schedule, ScheduleError
from fastpipe.schedule.multistep import build_multistep, update_lag, weight_versions
from fastpipe.schedule.search import Candidate, Choice, StageCosts
from fastpipe.schedule.simulate import simulate, simulate_times, span_bubble_fraction
from fastpipe.trace.timeline import Timeline, TimelineEvent

__all__ = [
    "SCHEDULES",
    "Action",
    "ActionKind",
    "Candidate",
    "Choice",
    "Schedule",
    "ScheduleError",
    "StageCosts",
    "Timeline",
    "TimelineEvent",
    "build",
    "build_multistep",
    "greedy_schedule",
    "simulate",
    "simulate_times",
    "span_bubble_fraction",
    "update_lag",
    "weight_versions",
]
