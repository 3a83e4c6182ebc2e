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

:func:`weight_batches` groups a stage's W actions, in its worker's order, into batches of a
given width: the runtime runs the weight GEMMs of a batch at its last W, over the stacked
rows of its micro-batches (see :class:`fastpipe.runtime.wgrad.CarriedRecords`).
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Mapping

from fastpipe.schedule.ir import Action, Schedule, ScheduleError

__all__ = ["adjacent_pairs", "fuse_backward", "weight_batches"]


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


@functools.lru_cache(maxsize=64)  # asked once a step, of the same few schedules
def weight_batches(
    schedule: Schedule, width: int, skip: frozenset[tuple[int, int]] = frozenset()
) -> Mapping[tuple[int, int], tuple[int, int]]:
    """Each ``W(s, m)`` that hands its weight work on, mapped to the later ``W(s, m')`` that runs it.

    A stage's W actions, in its worker's order, form batches of ``width``; every W of a batch
    maps to its last. A ``U`` of the stage (a weight update) closes the batch, since the work
    must reach the sum that the update reads. The pairs in ``skip`` (W actions that do no
    weight work of their own) are left out.

    Raises:
        ScheduleError: ``width`` below 1.
    """
    if width < 1:
        raise ScheduleError(f"a weight batch holds at least 1 micro-batch, got width={width}")
    carry: dict[tuple[int, int], tuple[int, int]] = {}

    def close(batch: list[tuple[int, int]]) -> None:
        for key in batch[:-1]:
            carry[key] = batch[-1]
        batch.clear()

    for actions in schedule.workers:
        batches: dict[int, list[tuple[int, int]]] = {}
        for a in actions:
            batch = batches.setdefault(a.stage, [])
            if a.kind == "U":
                close(batch)
            elif a.kind == "W" and (a.stage, a.microbatch) not in skip:
                batch.append((a.stage, a.microbatch))
                if len(batch) == width:
                    close(batch)
        for batch in batches.values():  # a short last batch runs at its own last W
            close(batch)
    return types.MappingProxyType(carry)
