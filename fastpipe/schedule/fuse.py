"""Fusing split backwards back into one: a B directly followed by its own W on the same worker.

A split backward (B first, W in a bubble) lets the input gradient leave early and fills
bubbles with W. Where a worker runs W right after its own B anyway, the split buys little: the
gradient leaves one W earlier, at the price of the split's own cost (a graph walk and hooks,
measured at 6-10% of a combined backward on the CPU reference stages; see
:mod:`fastpipe.runtime.split_backward`). :func:`fuse_backward` runs each such pair as one
``BW``. The simulator counts B + W = BW, so it only shows what the fusion costs (the later
gradient); a measured step shows what it saves.
"""

from __future__ import annotations

import dataclasses

from fastpipe.schedule.ir import Action, Schedule

__all__ = ["fuse_backward"]


def fuse_backward(schedule: Schedule) -> Schedule:
    """``schedule`` with every ``B(s, m)`` that its worker follows directly by ``W(s, m)`` run as ``BW(s, m)``.

    Communication actions are dropped first (see :meth:`Schedule.without_communication`); the
    result is validated and named ``<name>+fused``.

    Raises:
        ScheduleError: ``schedule`` itself is invalid.
    """
    base = schedule.without_communication()
    workers = []
    for actions in base.workers:
        out: list[Action] = []
        for a in actions:
            prev = out[-1] if out else None
            if (
                a.kind == "W"
                and prev is not None
                and prev.kind == "B"
                and (prev.stage, prev.microbatch)
                == (
                    a.stage,
                    a.microbatch,
                )
            ):
                out[-1] = Action("BW", a.stage, a.microbatch)
            else:
                out.append(a)
        workers.append(tuple(out))
    fused = dataclasses.replace(base, name=f"{base.name}+fused", workers=tuple(workers))
    fused.validate()
    return fused
