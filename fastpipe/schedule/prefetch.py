"""The prefetch pass: a ``P`` action ahead of each offloaded micro-batch's backward.

An offloaded ``(stage, micro-batch)`` keeps part of its saved activations in host memory from
the end of its ``F`` (:mod:`fastpipe.runtime.offload`). ``P(s, m)`` starts copying them back
on the device's host-to-device copy stream; its worker only issues the copy and goes on, and
``B(s, m)`` (or ``BW``) waits for it. A pipeline knows its backward order in advance, so the
pass places each ``P`` ``lookahead`` compute actions before that backward in its worker's
order, where the copy overlaps the compute in between::

    1f1b, worker 0, lookahead 1:   0F0 0F1 0F2 0F3 [0P0] 0F4 0BW0 [0P1] 0F5 0BW1 ...
                                                     └── copy ──┘  (0BW0 waits for it)

A ``P`` never goes before its own ``F``, nor between a ``B`` and the ``W`` that directly
follows it (the runtime fuses such pairs, :func:`fastpipe.schedule.fuse.adjacent_pairs`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from fastpipe.schedule.ir import COMM_KINDS, Action, Schedule, ScheduleError

__all__ = ["with_prefetch", "worth_prefetching"]


def with_prefetch(schedule: Schedule, pairs: Iterable[tuple[int, int]], lookahead: int = 1) -> Schedule:
    """``schedule`` with a ``P(s, m)`` ahead of the backward of each ``(s, m)`` in ``pairs``.

    Pairs that already have their ``P`` keep it where it is, so the pass is idempotent.

    Args:
        schedule: any valid schedule (one step or a stream, with or without SEND/RECV).
        pairs: the ``(stage, micro-batch)`` pairs whose forward offloads.
        lookahead: compute actions of the worker between a ``P`` and its backward (0: right before it).

    Returns:
        The schedule with the ``P`` actions, validated; ``schedule`` itself when none is added.

    Raises:
        ScheduleError: a pair outside the schedule, or a negative ``lookahead``.
    """
    if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 0:
        raise ScheduleError(f"lookahead is a number of actions >= 0, got {lookahead!r}")
    wanted = set(pairs) - schedule.prefetched
    for s, m in sorted(wanted):
        if not (0 <= s < schedule.num_stages and 0 <= m < schedule.num_microbatches):
            raise ScheduleError(
                f"cannot prefetch stage {s}, micro-batch {m}: the schedule has {schedule.num_stages} stages "
                f"and {schedule.num_microbatches} micro-batches"
            )
    if not wanted:
        return schedule
    workers = tuple(_insert(actions, wanted, lookahead) for actions in schedule.workers)
    out = dataclasses.replace(schedule, workers=workers)
    out.validate()
    return out


def worth_prefetching(
    schedule: Schedule, pairs: Iterable[tuple[int, int]], lookahead: int = 1
) -> frozenset[tuple[int, int]]:
    """The ``pairs`` whose worker runs more than ``lookahead`` compute actions between their ``F`` and backward.

    Only those gain from an offload: for the others :func:`with_prefetch` would put the ``P``
    right after the ``F``, and the copies would go out and come back with nothing run between
    (the last stage of 1F1B runs each backward right after its forward).
    """
    position: dict[Action, int] = {}
    for actions in schedule.without_communication().workers:
        compute = [a for a in actions if a.kind != "P"]
        position.update((a, i) for i, a in enumerate(compute))
    found = set()
    for s, m in pairs:
        f, b = position.get(Action("F", s, m)), position.get(schedule.backward_of(s, m))
        if f is not None and b is not None and b - f - 1 > lookahead:
            found.add((s, m))
    return frozenset(found)


def _key(action: Action) -> tuple[int, int]:
    """``(stage, micro-batch)`` of ``action``."""
    return action.stage, action.microbatch


def _insert(actions: tuple[Action, ...], wanted: set[tuple[int, int]], lookahead: int) -> tuple[Action, ...]:
    """One worker's actions with the ``P`` of each wanted pair whose backward it runs."""
    at: dict[int, list[Action]] = {}
    forward = {_key(a): i for i, a in enumerate(actions) if a.kind == "F"}
    for i, a in enumerate(actions):
        key = _key(a)
        if a.kind not in ("B", "BW") or key not in wanted:
            continue
        if key not in forward:
            raise ScheduleError(f"{a} has no {Action('F', *key)} on its worker to prefetch after")
        j, left = i, lookahead
        while left and j > 0:  # step back over `lookahead` compute actions
            j -= 1
            left -= actions[j].kind not in COMM_KINDS and actions[j].kind != "P"
        if actions[j].kind == "W":  # not between a B and its own W (communication aside)
            k = j - 1
            while k >= 0 and actions[k].kind in COMM_KINDS:
                k -= 1
            if k >= 0 and actions[k].kind == "B" and _key(actions[k]) == _key(actions[j]):
                j = k
        at.setdefault(max(j, forward[key] + 1), []).append(Action("P", *key))
    out: list[Action] = []
    for i, a in enumerate(actions):
        out.extend(at.get(i, ()))
        out.append(a)
    return tuple(out)
