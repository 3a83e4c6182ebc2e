"""``schedule="auto"``: the fastest schedule for measured costs, under a memory limit.

:func:`search` simulates every candidate on the same per-stage costs and keeps the fastest one
that fits:

* every named schedule of :data:`~fastpipe.schedule.builders.SCHEDULES`, at every number of
  stages per worker that divides the stage count (1F1B on K workers, interleaved with two stages
  per worker on K/2, ...); a schedule whose constraints the arguments break (its
  :class:`~fastpipe.schedule.ir.ScheduleError`) is listed as skipped, with the reason;
* the Zero Bubble paper's greedy scheduler (:mod:`fastpipe.schedule.greedy`) for these costs and
  this memory limit, one stage per worker: the fastest of its variants (no bound on the W's a
  worker defers, or a bound of 1 to K), listed as one candidate with its variant.

Ties (within a relative 1e-9) go to the lower peak memory, then to a named schedule before the
greedy one, then to the order of ``SCHEDULES``. Memory is counted as
:func:`~fastpipe.schedule.simulate.peak_memory` counts it: per worker, the most activation
memory alive at once, a stage's activation held from the start of its F to the end of the
backward that frees its input (its BW, or its B when split), and with ``w_records`` what a split
B keeps from there to its W. With ``activation`` left at 1 the unit is one stage's activation for
one micro-batch, as in :attr:`~fastpipe.trace.timeline.Timeline.peak_activations`.

Example::

    costs = StageCosts.uniform(8, forward=1.0, backward=1.2, weight=0.8, comm=0.1)
    choice = search(costs, stages=8, microbatches=32, memory_limit=8)
    print(choice.table())
    choice.schedule        # a Schedule that any runtime runs
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fastpipe.schedule.builders import SCHEDULES, build_for
from fastpipe.schedule.greedy import GREEDY, checked_costs, greedy_schedule
from fastpipe.schedule.ir import Schedule, ScheduleError
from fastpipe.schedule.simulate import peak_memory, simulate_times
from fastpipe.trace.timeline import Timeline

__all__ = ["Candidate", "Choice", "StageCosts", "search"]

_REL_TOL = 1e-9


@dataclass(frozen=True)
class StageCosts:
    """Per-stage costs of one micro-batch, in one unit of time (seconds, or relative units).

    Attributes:
        forward: F of each stage, > 0.
        backward: B (input gradient) of each stage, > 0.
        weight: W (weight gradient) of each stage, >= 0; a combined BW costs ``backward + weight``.
        comm: delay of an activation or gradient between stages ``i`` and ``i + 1`` when they sit on
            different workers, one per boundary (``len(forward) - 1`` entries).
        activation: memory one micro-batch's activation holds on each stage (bytes, or 1 to count
            activations), the unit of ``memory_limit`` in :func:`search`.
    """

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    weight: tuple[float, ...]
    comm: tuple[float, ...]
    activation: tuple[float, ...]

    def __post_init__(self) -> None:
        n = len(self.forward)
        if n < 1:
            raise ScheduleError("StageCosts needs at least one stage")
        checked_costs(self.forward, n, "forward", positive=True)
        checked_costs(self.backward, n, "backward", positive=True)
        checked_costs(self.weight, n, "weight")
        checked_costs(self.comm, n - 1, "comm (one per stage boundary)")
        checked_costs(self.activation, n, "activation")

    @property
    def num_stages(self) -> int:
        """The number of stages the costs are for."""
        return len(self.forward)

    @staticmethod
    def uniform(
        stages: int,
        forward: float | Sequence[float] = 1.0,
        backward: float | Sequence[float] = 1.0,
        weight: float | Sequence[float] = 1.0,
        comm: float | Sequence[float] = 0.0,
        activation: float | Sequence[float] = 1.0,
    ) -> StageCosts:
        """Costs of ``stages`` stages; each argument a scalar (every stage alike) or one value per stage.

        Raises:
            ScheduleError: ``stages`` < 1, a list of the wrong length, or a cost out of range.
        """
        if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
            raise ScheduleError(f"stages must be an integer >= 1, got {stages!r}")
        return StageCosts(
            checked_costs(forward, stages, "forward", positive=True),
            checked_costs(backward, stages, "backward", positive=True),
            checked_costs(weight, stages, "weight"),
            checked_costs(comm, stages - 1, "comm (one per stage boundary)"),
            checked_costs(activation, stages, "activation"),
        )

    @staticmethod
    def from_measured(
        forward: Sequence[float],
        backward: Sequence[float],
        activation: Sequence[float],
        weight_share: float = 0.5,
        comm: float | Sequence[float] = 0.0,
    ) -> StageCosts:
        """Costs from measured per-stage forward and combined backward times.

        A profiler that times one backward (input and weight gradients together, as
        :func:`fastpipe.balance.profile_layers` does) gives no split of it; the split is an
        assumption: ``W = weight_share * backward`` and ``B`` the rest. One half each is the
        split the balance planner takes too (:func:`fastpipe.balance.predict`), and close to a
        Linear layer's: two GEMMs of one shape, one for each gradient.

        Raises:
            ScheduleError: ``weight_share`` outside [0, 1) or a cost out of range.
        """
        if not 0.0 <= weight_share < 1.0:
            raise ScheduleError(f"weight_share must be in [0, 1) (W's part of the backward), got {weight_share}")
        n = len(forward)
        bwd = checked_costs(backward, n, "backward", positive=True)
        return StageCosts(
            checked_costs(forward, n, "forward", positive=True),
            tuple(b * (1.0 - weight_share) for b in bwd),
            tuple(b * weight_share for b in bwd),
            checked_costs(comm, n - 1, "comm (one per stage boundary)"),
            checked_costs(activation, n, "activation"),
        )


@dataclass(frozen=True)
class Candidate:
    """One schedule the search considered.

    Attributes:
        name: the schedule's name (``"1f1b"``, ``"interleaved"``, ``"greedy"``, ...).
        virtual_stages: stages per worker.
        schedule: the built schedule; None when it does not apply (see ``skipped``).
        time: its simulated step time (``inf`` when skipped).
        bubble: its simulated idle share of one worker per stage: with ``v`` stages per worker the
            schedule runs on ``1/v`` of them and leaves the others idle, so a V of 2 stages on one
            worker, no faster than running them in sequence, is half idle.
        peak_memory: per worker, the most activation memory alive at once.
        fits: whether every worker's peak is within the memory limit.
        skipped: why it does not apply (a :class:`ScheduleError`'s message), else ``""``.
        variant: which of its variants ran, where the search tried several (the greedy one's backlog).
    """

    name: str
    virtual_stages: int
    schedule: Schedule | None
    time: float = math.inf
    bubble: float = math.nan
    peak_memory: tuple[float, ...] = ()
    fits: bool = False
    skipped: str = ""
    variant: str = ""

    @property
    def label(self) -> str:
        """The name, with the stages per worker when there are several (``"interleaved v=2"``) and the
        variant of the greedy scheduler (``"greedy backlog=2"``)."""
        label = self.name if self.virtual_stages == 1 else f"{self.name} v={self.virtual_stages}"
        return f"{label} {self.variant}" if self.variant else label


@dataclass(frozen=True)
class Choice:
    """What :func:`search` chose, and every candidate it considered.

    Attributes:
        chosen: the fastest candidate that fits.
        candidates: every candidate: those that ran, fastest first, then those skipped.
        memory_limit: the limit searched under (None: none).
    """

    chosen: Candidate
    candidates: tuple[Candidate, ...]
    memory_limit: float | None

    @property
    def schedule(self) -> Schedule:
        """The chosen schedule."""
        assert self.chosen.schedule is not None  # a chosen candidate always ran
        return self.chosen.schedule

    def table(self, memory_unit: str = "", memory_scale: float = 1.0, *, time_scale: float = 1.0) -> str:
        """The candidates as a text table, the chosen one marked with ``*``.

        Args:
            memory_unit: a suffix for the peak-memory figures (e.g. ``" MiB"``).
            memory_scale: the factor from the costs' memory unit to that one (``2**-20`` from bytes to MiB).
            time_scale: the factor from the costs' time unit to the one shown (``1e3`` from seconds to ms).
        """
        rows = [("", "schedule", "time", "bubble", "peak memory (max worker)", "")]
        for c in self.candidates:
            mark = "*" if c is self.chosen else ""
            if c.skipped:
                rows.append((mark, c.label, "-", "-", "-", f"skipped: {c.skipped}"))
                continue
            note = "" if c.fits else "over memory_limit"
            peak = f"{max(c.peak_memory) * memory_scale:.4g}{memory_unit}"
            rows.append((mark, c.label, f"{c.time * time_scale:.4g}", f"{100 * c.bubble:.1f}%", peak, note))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = [
            "  ".join(cell.ljust(width) for cell, width in zip(r, widths)) + ("  " + r[5] if r[5] else "") for r in rows
        ]
        limit = "none" if self.memory_limit is None else f"{self.memory_limit * memory_scale:.4g}{memory_unit}"
        lines.append(f"chosen: {self.chosen.label} (memory_limit: {limit})")
        return "\n".join(line.rstrip() for line in lines)


@dataclass(frozen=True)
class _Held:
    """What a split backward keeps from B to W (see :func:`~fastpipe.schedule.simulate.peak_memory`)."""

    records: tuple[float, ...] | None = None
    wgrad_batch: int = 1


def _run(
    name: str, virtual: int, schedule: Schedule, costs: StageCosts, limit: float | None, held: _Held = _Held()
) -> Candidate:
    times = simulate_times(schedule, costs.forward, costs.backward, costs.weight, costs.comm)
    timeline = Timeline(schedule.num_workers, unit="cost units")
    for action, (w, start, end) in times.items():
        timeline.record(w, str(action), start, end)
    peaks = tuple(
        peak_memory(schedule, costs.activation, times=times, w_records=held.records, wgrad_batch=held.wgrad_batch)
    )
    fits = limit is None or max(peaks) <= limit * (1 + _REL_TOL)
    # Over a worker per stage, as the candidates with one stage per worker use: the fewer
    # workers of virtual stages would otherwise hide the ones they leave idle.
    span = timeline.makespan
    bubble = 1.0 - sum(timeline.busy) / (costs.num_stages * span) if span > 0 else 0.0
    return Candidate(name, virtual, schedule, span, bubble, peaks, fits)


def _named(
    costs: StageCosts, microbatches: int, names: Iterable[str], limit: float | None, held: _Held
) -> list[Candidate]:
    """Every named schedule at every number of stages per worker that it builds for; one skipped entry
    (the reason at one stage per worker) for a schedule that builds at none. A schedule whose actions
    equal an earlier candidate's (interleaved with one stage per worker is 1F1B) is left out."""
    n = costs.num_stages
    found: list[Candidate] = []
    seen: set[tuple[tuple[object, ...], ...]] = set()
    for name in names:
        reason = ""
        built = False
        for virtual in (v for v in range(1, n + 1) if n % v == 0):
            try:
                schedule = build_for(name, n, n // virtual, microbatches)
            except ScheduleError as exc:
                reason = reason or str(exc)
                continue
            built = True
            if schedule.workers not in seen:
                seen.add(schedule.workers)
                found.append(_run(name, virtual, schedule, costs, limit, held))
        if not built:
            found.append(Candidate(name, 1, None, skipped=reason))
    return found


def _greedy(costs: StageCosts, microbatches: int, limit: float | None, held: _Held) -> Candidate:
    """The fastest of the greedy scheduler's variants that fits: W's only in gaps, or at most 1, 2, ...,
    K of them deferred per worker (a bound that keeps a slow stage from ending on a run of W's)."""
    k = costs.num_stages
    found = []
    for backlog in (None, *range(1, k + 1)):
        try:
            schedule = greedy_schedule(
                k,
                microbatches,
                costs.forward,
                costs.backward,
                costs.weight,
                costs.comm,
                costs.activation,
                limit,
                backlog,
                w_records=held.records,
                wgrad_batch=held.wgrad_batch,
            )
        except ScheduleError as exc:
            return Candidate(GREEDY, 1, None, skipped=str(exc))  # the limit, which no backlog changes
        found.append(
            dataclasses.replace(_run(GREEDY, 1, schedule, costs, limit, held), variant=f"backlog={backlog or 'none'}")
        )
    return min(found, key=lambda c: (not c.fits, c.time, max(c.peak_memory)))


def search(
    costs: StageCosts,
    stages: int,
    microbatches: int,
    memory_limit: float | None = None,
    *,
    schedules: Sequence[str] = SCHEDULES,
    greedy: bool = True,
    w_records: float | Sequence[float] | None = None,
    wgrad_batch: int = 1,
) -> Choice:
    """The fastest schedule for ``costs`` whose peak memory on every worker fits ``memory_limit``.

    Args:
        costs: per-stage costs of one micro-batch (:class:`StageCosts`).
        stages: the model's pipeline stages (must equal ``costs.num_stages``); each candidate spreads
            them over workers its own way (one per worker, or ``v`` per worker).
        microbatches: micro-batches per step M.
        memory_limit: the most activation memory one worker may hold at once, in the units of
            ``costs.activation``; None: no limit.
        schedules: the named schedules to consider (default: all of them).
        greedy: also consider the greedy zero-bubble scheduler (:func:`greedy_schedule`).
        w_records: what one micro-batch's B keeps until its W on each stage (a scalar or one per
            stage), in the units of ``costs.activation``; None: nothing (as the zero-bubble paper counts).
        wgrad_batch: W's that run their deferred work together, as the runtime's ``wgrad_batch``.

    Returns:
        A :class:`Choice`: the chosen candidate and the table of all of them.

    Raises:
        ScheduleError: bad arguments, or no candidate fits the memory limit (the message names
            the least peak any candidate needs).
    """
    if not isinstance(costs, StageCosts):
        raise ScheduleError(f"costs must be a StageCosts, got {type(costs).__name__}; e.g. StageCosts.uniform(4)")
    if isinstance(stages, bool) or not isinstance(stages, int) or stages != costs.num_stages:
        raise ScheduleError(f"stages={stages!r} does not match the costs, which are for {costs.num_stages} stages")
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ScheduleError(f"microbatches must be an integer >= 1, got {microbatches!r}")
    if memory_limit is not None and not (isinstance(memory_limit, (int, float)) and memory_limit > 0):
        raise ScheduleError(f"memory_limit must be a number > 0 (or None for no limit), got {memory_limit!r}")
    unknown = [s for s in schedules if s not in SCHEDULES]
    if unknown:
        raise ScheduleError(f"unknown schedules {unknown}; valid: {', '.join(SCHEDULES)}")
    records = None if w_records is None else checked_costs(w_records, stages, "w_records")
    if isinstance(wgrad_batch, bool) or not isinstance(wgrad_batch, int) or wgrad_batch < 1:
        raise ScheduleError(f"wgrad_batch must be an integer >= 1 (1: each W its own), got {wgrad_batch!r}")
    held = _Held(records, wgrad_batch)
    candidates = _named(costs, microbatches, schedules, memory_limit, held)
    if greedy:
        candidates.append(_greedy(costs, microbatches, memory_limit, held))
    ran = [c for c in candidates if not c.skipped]
    rank = {id(c): i for i, c in enumerate(ran)}
    ran.sort(key=lambda c: (c.time, rank[id(c)]))
    fitting = [c for c in ran if c.fits]
    if not fitting:
        if not ran:
            raise ScheduleError(f"no schedule applies to {stages} stages and {microbatches} micro-batches")
        least = min(ran, key=lambda c: max(c.peak_memory))
        raise ScheduleError(
            f"no schedule fits memory_limit={memory_limit}: the least peak per worker is "
            f"{max(least.peak_memory):.4g} ({least.label}) among those that ran; raise the limit, or cut the "
            "activations (checkpointing, smaller micro-batches)"
            + "".join(f"; {c.skipped}" for c in candidates if c.skipped)
        )
    fastest = fitting[0].time
    tied = [c for c in fitting if c.time <= fastest * (1 + _REL_TOL)]
    chosen = min(tied, key=lambda c: (max(c.peak_memory), c.name == GREEDY, rank[id(c)]))
    skipped = [c for c in candidates if c.skipped]
    return Choice(chosen, (*ran, *skipped), memory_limit)
