"""The planner's combinations as a text table: the fastest few and the chosen one, the rest counted."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastpipe.memory.limit import MARGIN
from fastpipe.memory.sizes import format_bytes

if TYPE_CHECKING:
    from fastpipe.memory.planner import Combination, Plan

__all__ = ["plan_table"]

_HEAD = ("", "balance", "schedule", "checkpoint", "offload", "time", "peak per device", "fits")


def plan_table(plan: Plan, top: int = 10, time_scale: float = 1.0, time_unit: str = "s") -> str:
    """The ``top`` fastest combinations of ``plan`` and its choice, one row each; ``*`` marks the choice.

    Args:
        plan: a :class:`~fastpipe.memory.planner.Plan`.
        top: rows of the fastest combinations evaluated (the chosen one is shown besides, if slower).
        time_scale: the factor from the plan's time unit to the one shown (``1e3``: seconds to ms).
        time_unit: the unit shown.
    """
    shown = list(plan.considered[: max(top, 0)])
    if plan.chosen not in shown:
        shown.append(plan.chosen)
    head = (*_HEAD[:5], f"time ({time_unit})" if time_unit else "time", *_HEAD[6:])
    rows = [head, *(_row(c, c is plan.chosen, time_scale) for c in shown)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    rest = len(plan.considered) - len(shown)
    limit = "none" if plan.memory_limit is None else format_bytes(plan.memory_limit)
    lines.append(
        f"{len(plan.considered)} combinations evaluated ({rest} more not shown), {plan.pruned} pruned "
        f"(no faster than the chosen before recompute or offload); memory_limit {limit} per device, "
        f"{MARGIN:.0%} of each prediction kept"
    )
    c = plan.chosen
    lines.append(
        f"chosen: balance {list(c.balance)}, {c.schedule}, checkpoint={c.checkpoint}, offload {_offload(c)}, "
        f"step {c.time * time_scale:.4g} {time_unit}".rstrip()
    )
    return "\n".join(lines)


def _row(c: Combination, chosen: bool, time_scale: float) -> tuple[str, ...]:
    peaks = ", ".join(format_bytes(d.total) for d in c.devices)
    return (
        "*" if chosen else "",
        ",".join(map(str, c.balance)),
        c.schedule,
        str(c.checkpoint),
        _offload(c),
        f"{c.time * time_scale:.4g}",
        peaks,
        "yes" if c.fits else "no",
    )


def _offload(c: Combination) -> str:
    if not any(c.offload):
        return "0"
    if len(set(c.offload)) == 1:
        return f"{c.offload[0]:g}"
    return "/".join(f"{f:g}" for f in c.offload)
