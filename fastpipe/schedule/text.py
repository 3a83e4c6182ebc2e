"""The printed form of a :class:`~fastpipe.schedule.ir.Schedule`: a head line, then one row per worker.

::

    1f1b: 2 workers, 2 stages, 3 micro-batches
    slot         0    1    2    3    4    5
    worker 0   0F0  0F1 0BW0  0F2 0BW1 0BW2
    worker 1   1F0 1BW0  1F1 1BW1  1F2 1BW2
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastpipe.schedule.placement import describe_placement, round_robin

if TYPE_CHECKING:
    from fastpipe.schedule.ir import Schedule

__all__ = ["schedule_text"]


def schedule_text(schedule: Schedule) -> str:
    """``schedule`` as text: what it is, its placement when not round robin, and each worker's actions in order."""
    cells = [[str(a) for a in actions] for actions in schedule.workers]
    width = max([len(c) for row in cells for c in row] + [2])
    slots = max([len(row) for row in cells] + [0])
    head = (
        f"{schedule.name}: {schedule.num_workers} workers, {schedule.num_stages} stages, "
        f"{schedule.num_microbatches} micro-batches"
    )
    if schedule.minibatch_size:
        head += (
            f" in {schedule.num_minibatches} mini-batches of {schedule.minibatch_size}, "
            f"{'flushed' if schedule.flush else 'no flush'}"
        )
    if schedule.skips:
        head += ", skips " + ", ".join(f"{p}->{c}" for p, c in schedule.skips)
    lines = [head]
    if schedule.placement != round_robin(schedule.num_stages, schedule.num_workers):
        held = ", ".join(
            f"worker {w}: {'+'.join(map(str, schedule.stages_of(w)))}" for w in range(schedule.num_workers)
        )
        lines.append(f"placement ({describe_placement(schedule.placement, schedule.num_workers)}): {held}")
    lines.append("slot      " + " ".join(f"{i:>{width}}" for i in range(slots)))
    for w, row in enumerate(cells):
        lines.append(f"worker {w:<2} " + " ".join(f"{c:>{width}}" for c in row))
    return "\n".join(lines)
