"""The schedule search's candidates judged in device bytes: the fastest whose every device fits.

:func:`~fastpipe.schedule.search.search` times every candidate schedule on the measured costs.
:func:`device_search` keeps those times and replaces each candidate's memory by the peak of every
device that :func:`~fastpipe.memory.model.predict_memory` predicts from measured stage bytes
(parameters, gradients, optimizer state, activations, W records, skips). A candidate fits when
every device's prediction plus :data:`~fastpipe.memory.limit.MARGIN` is within the limit, the
rule ``Pipe(memory_limit=)`` enforces at the step (:class:`~fastpipe.memory.limit.MemoryGuard`),
so the schedule chosen is never refused there. The prediction uses the simulator's unit costs, as
that check does: on one worker the order of actions, not their lengths, decides what is alive.

The greedy zero-bubble scheduler builds its schedule under a memory limit of its own, in bytes
of activations and W records. Under a device limit it is asked twice: without a limit, and under
the bytes every worker has left once its parameters, gradients and optimizer state are counted
(the least of them, as its limit is one for all workers).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from fastpipe.memory.limit import MARGIN, over_limit, refusal
from fastpipe.memory.model import DeviceMemory, OptimizerSpec, StageBytes, optimizer_factor, predict_memory
from fastpipe.memory.sizes import format_bytes
from fastpipe.schedule.ir import ScheduleError
from fastpipe.schedule.search import Candidate, Choice, StageCosts, search

__all__ = ["DeviceChoice", "device_search", "device_table"]

_REL_TOL = 1e-9
# The shares of a worker's bytes left for activations that the greedy scheduler is given in turn.
_BUDGET_SHARES = (1.0, 0.9, 0.8, 0.7, 0.6)


@dataclass(frozen=True)
class DeviceChoice:
    """The search's choice in device bytes.

    Attributes:
        choice: the :class:`~fastpipe.schedule.search.Choice`; each candidate's ``peak_memory`` holds its
            devices' predicted peaks in bytes, and ``fits`` whether all of them fit with the margin.
        devices: each candidate's prediction per device, by its label.
    """

    choice: Choice
    devices: dict[str, list[DeviceMemory]]


def device_search(
    costs: StageCosts,
    stages: Sequence[StageBytes],
    microbatches: int,
    memory_limit: int | None,
    *,
    checkpoint: str = "never",
    optimizer: OptimizerSpec = "adam",
    wgrad_batch: int = 1,
    input_grad: bool = False,
    skips: Sequence[tuple[int, int, float]] = (),
) -> DeviceChoice:
    """The fastest schedule for ``costs`` whose predicted peak fits ``memory_limit`` bytes on every device.

    Args:
        costs: per-stage times of one micro-batch.
        stages: per-stage bytes of one micro-batch (:func:`~fastpipe.memory.stage_bytes.measure_stages`).
        microbatches: micro-batches per step.
        memory_limit: bytes per device; None: no limit (every candidate fits).
        checkpoint, optimizer, wgrad_batch, input_grad, skips: as for :func:`~fastpipe.memory.model.predict_memory`.

    Raises:
        ValueError: no candidate fits; the message names the leanest candidate, its fullest device
            and what that device holds, by part.
    """
    n = costs.num_stages
    if len(stages) != n:
        raise ValueError(f"fastpipe: {len(stages)} StageBytes for costs of {n} stages; give one per stage")
    records = [float(st.w_records + st.w_kept) for st in stages]
    base = search(costs, n, microbatches, None, w_records=records, wgrad_batch=wgrad_batch)
    found = list(base.candidates)

    def judge(c: Candidate) -> Candidate:
        if c.schedule is None:
            return c
        predicted = predict_memory(
            c.schedule,
            stages,
            checkpoint=checkpoint,
            optimizer=optimizer,
            skips=skips,
            wgrad_batch=wgrad_batch,
            input_grad=input_grad,
        )
        devices[c.label] = predicted
        fits = memory_limit is None or over_limit(predicted, memory_limit) is None
        return dataclasses.replace(c, peak_memory=tuple(float(d.total) for d in predicted), fits=fits)

    devices: dict[str, list[DeviceMemory]] = {}
    judged = [judge(c) for c in found]
    if memory_limit is not None:
        for lean in _greedy_within(costs, stages, microbatches, memory_limit, optimizer, records, wgrad_batch):
            if any(c.schedule == lean.schedule for c in judged):
                continue
            judged.append(judge(lean))
            if judged[-1].fits:
                break
    return DeviceChoice(_choose(judged, memory_limit, devices), devices)


def _greedy_within(
    costs: StageCosts,
    stages: Sequence[StageBytes],
    microbatches: int,
    limit: int,
    optimizer: OptimizerSpec,
    records: Sequence[float],
    wgrad_batch: int,
) -> Iterator[Candidate]:
    """Greedy schedules under the bytes the fullest worker has left for activations and W records,
    then under less: the scheduler counts a stage's input as freed at ``B`` and the device model
    keeps it to ``W``, so its schedule may not fit the device at once."""
    factor = optimizer_factor(optimizer)
    state = [st.parameters + st.trainable + factor * st.stepped for st in stages]
    left = min(limit / (1 + MARGIN) - s for s in state)
    held = dataclasses.replace(costs, activation=tuple(float(st.input + st.activation) for st in stages))
    for share in _BUDGET_SHARES:
        budget = left * share
        if budget <= 0:
            return
        try:
            found = search(
                held, costs.num_stages, microbatches, budget, schedules=(), w_records=records, wgrad_batch=wgrad_batch
            )
        except ScheduleError:  # nothing keeps to it, nor to less
            return
        chosen = found.chosen
        yield dataclasses.replace(chosen, variant=f"{chosen.variant} within {format_bytes(budget)}".strip())


def _choose(candidates: list[Candidate], limit: int | None, devices: dict[str, list[DeviceMemory]]) -> Choice:
    """The fastest candidate that fits; ties go to the lower peak, a named schedule, then the search's order."""
    ran = [c for c in candidates if c.schedule is not None]
    rank = {id(c): i for i, c in enumerate(ran)}
    ran.sort(key=lambda c: (c.time, rank[id(c)]))
    skipped = [c for c in candidates if c.schedule is None]
    fitting = [c for c in ran if c.fits]
    if not fitting:
        if not ran:
            raise ValueError("fastpipe: no schedule applies to these stages and micro-batches")
        leanest = min(ran, key=lambda c: max(c.peak_memory))
        worst = max(devices[leanest.label], key=lambda d: d.total)
        raise ValueError(
            f"fastpipe: no schedule fits memory_limit={format_bytes(limit or 0)} on every device; the leanest, "
            f"{leanest.label}, is refused: {refusal(worst, limit or 0).removeprefix('fastpipe: ')}"
        )
    fastest = fitting[0].time
    tied = [c for c in fitting if c.time <= fastest * (1 + _REL_TOL)]
    chosen = min(tied, key=lambda c: (max(c.peak_memory), c.name == "greedy", rank[id(c)]))
    return Choice(chosen, (*ran, *skipped), limit)


def device_table(found: DeviceChoice, time_unit: str = "", time_scale: float = 1.0) -> str:
    """The candidates as a text table: time, bubble and each device's predicted peak; ``*`` marks the choice."""
    choice = found.choice
    rows = [("", "schedule", f"time{f' ({time_unit})' if time_unit else ''}", "bubble", "peak per device", "")]
    for c in choice.candidates:
        mark = "*" if c is choice.chosen else ""
        if c.schedule is None:
            rows.append((mark, c.label, "-", "-", "-", f"skipped: {c.skipped}"))
            continue
        peaks = ", ".join(format_bytes(d.total) for d in found.devices[c.label])
        note = "" if c.fits else f"over memory_limit (+{MARGIN:.0%} margin)"
        rows.append((mark, c.label, f"{c.time * time_scale:.4g}", f"{100 * c.bubble:.1f}%", peaks, note))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)) + ("  " + r[5] if r[5] else "") for r in rows]
    limit = "none" if choice.memory_limit is None else format_bytes(choice.memory_limit)
    lines.append(f"chosen: {choice.chosen.label} (memory_limit: {limit} per device)")
    return "\n".join(line.rstrip() for line in lines)
