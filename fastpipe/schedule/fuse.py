"""Fusing split backwards back into one: a B directly followed by its own W on the same worker.

A split backward (B first, W in a bubble) lets the input gradient leave early and fills
bubbles with W. Where a worker runs W right after its own B anyway, the split buys little: the
gradient leaves one W earlier, at the price of the split's own cost (2-9% of a combined
backward on the CPU reference stages, whose Linears defer their weight GEMMs; 50-80% where the
graph walk splits every parameter; see :mod:`fastpipe.runtime.split_backward`).
:func:`fuse_backward` runs each such pair as one ``BW``. The simulator counts B + W = BW, so
it only shows what the fusion costs (the later gradient); a measured step shows what it saves.
:func:`adjacent_pairs` lists the pairs, for a runtime that fuses those whose gradient nobody
waits for.
"""

from __future__ import annotations

import dataclasses
import functools

from fastpipe.schedule.ir import Action, Schedule

__all__ = ["adjacent_pairs", "fuse_backward"]


@functools.lru_cache(maxsize=64)  # asked once a step, of the same few schedules
def adjacent_pairs(schedule: Schedule) -> frozenset[tuple[int, int]]:
    """The ``(stage, micro-batch)`` pairs whose worker runs ``W`` right after their ``B``, communication aside."""
    found = set()
    for actions in schedule.without_communication().workers:
        for prev, a in zip(actions, actions[1:]):
            if a.kind == "W" and prev.kind == "B" and (prev.stage, prev.microbatch) == (a.stage, a.microbatch):
                found.add((a.stage, a.microbatch))
    return frozenset(found)


def fuse_backward(schedule: Schedule) -> Schedule:
    """``schedule`` with every ``B(s, m)`` that its worker follows directly by ``W(s, m)`` run as ``BW(s, m)``.

    Communication actions are dropped first (see :meth:`Schedule.without_communication`); the
    result is validated and named ``<name>+fused``.

    Raises:
        ScheduleError: ``schedule`` itself is invalid.
    """
    base = schedule.without_communication()
    pairs = adjacent_pairs(base)
    workers = []
    for actions in base.workers:
        out: list[Action] = []
        for a in actions:
            if (a.stage, a.microbatch) not in pairs:
                out.append(a)
            elif a.kind == "B":
                out.append(Action("BW", a.stage, a.microbatch))
            elif a.kind != "W":
                out.append(a)
        workers.append(tuple(out))
    fused = dataclasses.replace(base, name=f"{base.name}+fused", workers=tuple(workers))
    fused.validate()
    return fused
