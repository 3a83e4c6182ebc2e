"""Event-driven simulation of a :class:`~fastpipe.schedule.ir.Schedule`.

Each worker runs its actions in order. An action starts at the latest of: its worker being free, and each
dependency's end (plus the link delay ``comm`` when the dependency ran on another worker). This is list
scheduling with a fixed per-worker order, so the result does not depend on the order the simulator visits
workers in.

A prefetch ``P(s, m)`` (:mod:`fastpipe.schedule.prefetch`) is a copy, not work: its worker issues it and
goes on. Each worker has two copy lanes, one out of its device (the offload that ``F(s, m)`` starts when
it ends, ``offload`` long) and one into it (the prefetches, ``prefetch`` long), each running one copy at
a time in order. A ``P`` lasts from its issue until its copy arrives: the copy starts once its lane is free
and the offload it brings back is done, and the backward that needs it waits for its end.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from fastpipe.schedule.fuse import weight_batches
from fastpipe.schedule.ir import COMM_KINDS, COPY_KINDS, Action, Schedule, ScheduleError
from fastpipe.trace.timeline import Timeline

__all__ = [
    "CompiledSimulation",
    "Cost",
    "peak_memory",
    "simulate",
    "simulate_times",
    "span_bubble_fraction",
    "sweep_peak",
    "weight_release",
]

Cost = float | Sequence[float]


def _per_stage(value: Cost, n: int, what: str) -> list[float]:
    if isinstance(value, (int, float)):
        return [float(value)] * n
    values = [float(v) for v in value]
    if len(values) != n:
        raise ScheduleError(f"{what} has {len(values)} entries; expected {n}")
    return values


def simulate_times(
    schedule: Schedule,
    forward: Cost = 1.0,
    backward: Cost = 1.0,
    weight: Cost = 1.0,
    comm: Cost = 0.0,
    combined: Cost | None = None,
    update: Cost = 0.0,
    prefetch: Cost = 0.0,
    offload: Cost = 0.0,
) -> dict[Action, tuple[int, float, float]]:
    """Simulates ``schedule`` and returns ``{action: (worker, start, end)}``.

    See :func:`simulate` for the arguments.

    Raises:
        ScheduleError: on a cost list of the wrong length, or if the schedule deadlocks.
    """
    n = schedule.num_stages
    fwd = _per_stage(forward, n, "forward")
    bwd = _per_stage(backward, n, "backward")
    wgt = _per_stage(weight, n, "weight")
    link = _per_stage(comm, max(n - 1, 0), "comm (one per stage boundary)")
    both = [b + w for b, w in zip(bwd, wgt)] if combined is None else _per_stage(combined, n, "combined")
    cost = {"F": fwd, "B": bwd, "W": wgt, "BW": both, "U": _per_stage(update, n, "update")}
    copy_in, copy_out = _per_stage(prefetch, n, "prefetch"), _per_stage(offload, n, "offload")
    lanes_in, lanes_out = [0.0] * schedule.num_workers, [0.0] * schedule.num_workers
    offloaded: dict[tuple[int, int], float] = {}  # when each prefetched pair's offload is done

    def delay(dep: Action, action: Action, dep_worker: int, worker: int) -> float:
        if dep_worker == worker or action.kind in ("SEND_F", "SEND_B"):
            return 0.0
        return link[min(dep.stage, action.stage)]

    result: dict[Action, tuple[int, float, float]] = {}
    free = [0.0] * schedule.num_workers
    pos = [0] * schedule.num_workers
    remaining = sum(len(actions) for actions in schedule.workers)
    while remaining:
        progress = False
        for w, actions in enumerate(schedule.workers):
            while pos[w] < len(actions):
                action = actions[pos[w]]
                deps = schedule.dependencies(action)
                if any(d not in result for d in deps):
                    break
                ready = free[w]
                for d in deps:
                    dw, _, dend = result[d]
                    ready = max(ready, dend + delay(d, action, dw, w))
                if action.kind in ("RECV_F", "RECV_B"):
                    # The worker posts the receive when free and blocks until the data arrives.
                    start, end = free[w], ready
                elif action.is_comm:
                    start = end = ready
                elif action.kind == "P":
                    start = ready
                    copy = max(ready, lanes_in[w], offloaded.get((action.stage, action.microbatch), ready))
                    end = lanes_in[w] = copy + copy_in[action.stage]
                else:
                    start = ready
                    end = start + cost[action.kind][action.stage]
                result[action] = (w, start, end)
                free[w] = start if action.kind == "P" else end
                if action.kind == "F" and (action.stage, action.microbatch) in schedule.prefetched:
                    lanes_out[w] = max(end, lanes_out[w]) + copy_out[action.stage]
                    offloaded[(action.stage, action.microbatch)] = lanes_out[w]
                pos[w] += 1
                remaining -= 1
                progress = True
        if not progress:
            schedule.validate()  # raises with a description of the deadlock or missing action
            raise ScheduleError("schedule cannot be simulated")
    return result


def simulate(
    schedule: Schedule,
    forward: Cost = 1.0,
    backward: Cost = 1.0,
    weight: Cost = 1.0,
    comm: Cost = 0.0,
    combined: Cost | None = None,
    update: Cost = 0.0,
    prefetch: Cost = 0.0,
    offload: Cost = 0.0,
) -> Timeline:
    """Simulates one step of ``schedule`` and returns its :class:`~fastpipe.trace.timeline.Timeline`.

    Args:
        schedule: the schedule to run.
        forward: cost of ``F``, a scalar or one value per stage.
        backward: cost of ``B`` (input grad), scalar or per stage.
        weight: cost of ``W`` (weight grad), scalar or per stage.
        comm: delay between a producer and a consumer on different workers (activation or gradient), a
            scalar or one value per stage boundary (``num_stages - 1`` entries; entry ``i`` is the link
            between stages ``i`` and ``i + 1``).
        combined: cost of ``BW``, scalar or per stage; default ``backward + weight``. A
            measured combined backward can differ from B + W: the split walks the graph,
            and only a combined one sums Linear weight gradients in the GEMM.
        update: cost of a weight update ``U`` (streams of mini-batches), scalar or per stage.
        prefetch: the copy of one micro-batch's offloaded activations back to the device (a ``P``),
            scalar or per stage; :func:`fastpipe.memory.offload.copy_costs` prices it from bandwidth.
        offload: the copy out to the host that a prefetched micro-batch's ``F`` starts, scalar or per stage.

    Returns:
        The timeline, in the same units as the costs.
    """
    times = simulate_times(schedule, forward, backward, weight, comm, combined, update, prefetch, offload)
    timeline = Timeline(schedule.num_workers, unit="cost units")
    for action, (w, start, end) in times.items():
        timeline.record(w, str(action), start, end)
    return timeline


def span_bubble_fraction(timeline: Timeline) -> float:
    """The idle share inside the workers' spans: ``1 - busy / (K * longest span)``.

    A worker's span runs from the start of its first action to the end of its last. This is the
    bubble of the zero-bubble papers' parallelogram (ZB-H2, ZB-V): each worker is busy without a gap
    over its span, while the spans are staggered by one forward per worker. The staggered start and
    end are left out here; :attr:`~fastpipe.trace.timeline.Timeline.bubble_fraction` counts them, so for one
    isolated step it cannot fall below about ``(K - 1) F / makespan``, since worker ``K - 1`` cannot
    start before ``K - 1`` forwards have run. Communication and copy (``P``) events count neither as busy
    nor towards a span.
    """
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    for e in timeline.events:
        if e.kind in COMM_KINDS or e.kind in COPY_KINDS:
            continue
        first[e.worker] = min(first.get(e.worker, e.start), e.start)
        last[e.worker] = max(last.get(e.worker, e.end), e.end)
    span = max((last[w] - first[w] for w in first), default=0.0)
    if span <= 0:
        return 0.0
    return 1.0 - sum(timeline.busy) / (timeline.num_workers * span)


def weight_release(
    schedule: Schedule, wgrad_batch: int = 1, unsplit: Collection[tuple[int, int]] = ()
) -> dict[tuple[int, int], Action]:
    """For each split ``(stage, mb)``, the ``W`` at whose end the work its ``B`` left behind is freed.

    That is its own ``W``, or with ``wgrad_batch`` > 1 the last ``W`` of its batch
    (:func:`~fastpipe.schedule.fuse.weight_batches`, the grouping the runtime runs). The pairs in
    ``unsplit`` run their ``B`` as a combined backward and leave nothing for ``W``.

    Raises:
        ScheduleError: ``wgrad_batch`` below 1.
    """
    skip = frozenset(unsplit)
    carry = weight_batches(schedule, wgrad_batch, skip)
    return {key: Action("W", *carry.get(key, key)) for key in sorted(schedule.split_pairs) if key not in skip}


def sweep_peak(points: Sequence[tuple[float, float, str]]) -> tuple[float, dict[str, float]]:
    """The most bytes alive at once in ``(time, delta, part)`` events, and each part's bytes at that moment.

    At equal times a free (negative delta) comes before an allocation: an action that ends
    when the next one starts has released what it frees.
    """
    alive: dict[str, float] = {}
    total = peak = 0.0
    at_peak: dict[str, float] = {}
    for _, delta, part in sorted(points, key=lambda p: (p[0], p[1])):
        alive[part] = alive.get(part, 0.0) + delta
        total += delta
        if total > peak:
            peak, at_peak = total, dict(alive)
    return peak, at_peak


def peak_memory(
    schedule: Schedule,
    activation: Cost,
    skips: Sequence[tuple[int, int, float]] = (),
    times: dict[Action, tuple[int, float, float]] | None = None,
    *,
    w_records: Cost | None = None,
    wgrad_batch: int = 1,
    unsplit: Collection[tuple[int, int]] = (),
) -> list[float]:
    """Per worker, the most activation bytes alive at once over one simulated step, skips included.

    The activation of ``(stage, mb)`` is alive from the start of its ``F`` to the end of the
    backward that frees the stage input (``BW``, or ``B`` when split), as in
    :attr:`~fastpipe.trace.timeline.Timeline.peak_activations`. A skip ``(producer, consumer, bytes)``
    (:mod:`fastpipe.model.skips`, the edges :func:`fastpipe.model.skip_memory.stage_skip_edges` gives)
    adds its bytes to the producer's ``(producer, mb)`` and to the consumer's
    ``(consumer, mb)``, each held until that stage's backward, and to no stage between.

    A split backward's ``B`` leaves work for ``W``: each deferred Linear's input and output
    gradient (:class:`~fastpipe.runtime.wgrad.DeferringLinear`), or the whole graph where a
    parameter is left for ``W`` (:mod:`fastpipe.runtime.split_backward`). ``w_records`` counts
    those bytes from the end of ``B`` to the end of the ``W`` that consumes them (see
    :func:`weight_release`); without it they count 0, as in the zero-bubble paper.

    Args:
        schedule: the schedule.
        activation: bytes of one micro-batch's activation per stage (a scalar or one per stage).
        skips: the skips that cross stages.
        times: a result of :func:`simulate_times` for ``schedule`` (default: unit costs).
        w_records: bytes one micro-batch's ``B`` keeps until its ``W`` (a scalar or one per stage).
        wgrad_batch: micro-batches whose deferred work one ``W`` runs together, as the
            runtime's ``wgrad_batch``: their records live until the batch's last ``W``.
        unsplit: ``(stage, mb)`` pairs whose ``B`` the runtime runs as a combined backward.
    """
    held = _per_stage(activation, schedule.num_stages, "activation")
    for producer, consumer, nbytes in skips:
        for stage in {producer, consumer}:
            held[stage] += float(nbytes)
    records = None if w_records is None else _per_stage(w_records, schedule.num_stages, "w_records")
    release = weight_release(schedule, wgrad_batch, unsplit) if records is not None else {}
    points: list[list[tuple[float, float, str]]] = [[] for _ in range(schedule.num_workers)]
    frees: list[tuple[Action, int, float]] = []
    timed = simulate_times(schedule) if times is None else times
    for action, (w, start, end) in timed.items():
        s, key = action.stage, (action.stage, action.microbatch)
        if action.kind == "F":
            points[w].append((start, held[s], ""))
        elif action.kind in ("B", "BW"):
            points[w].append((end, -held[s], ""))
            if records is not None and key in release:
                points[w].append((end, records[s], ""))
                frees.append((release[key], w, records[s]))
    for action, w, nbytes in frees:
        if action not in timed:
            raise ScheduleError(f"times has no entry for {action}, which frees weight records; simulate the schedule")
        points[w].append((timed[action][2], -nbytes, ""))
    return [sweep_peak(pts)[0] for pts in points]


class CompiledSimulation:
    """The makespan of one schedule as a fast function of per-stage costs (no Timeline, no Action objects).

    It replays :func:`simulate_times`'s recurrence (start = max(worker free, dependency end + link delay))
    in a topological order fixed once, so it returns the same makespan; the planner calls it many times.
    It only adds and takes maxima of costs, so it is monotone: raising a cost never lowers the result.

    Args:
        schedule: the schedule.
        comm: link delay, as in :func:`simulate`.
    """

    def __init__(self, schedule: Schedule, comm: Cost = 0.0) -> None:
        order = list(simulate_times(schedule, comm=comm))  # insertion order is a topological order
        index = {a: i for i, a in enumerate(order)}
        link = _per_stage(comm, max(schedule.num_stages - 1, 0), "comm (one per stage boundary)")
        previous: dict[int, int] = {}
        self.num_stages = schedule.num_stages
        self.steps: list[tuple[str, int, list[tuple[int, float]]]] = []
        for action in order:
            w = schedule.worker_of(action.stage)
            deps = [(previous[w], 0.0)] if w in previous else []
            for d in schedule.dependencies(action):
                remote = schedule.worker_of(d.stage) != w and action.kind not in ("SEND_F", "SEND_B")
                deps.append((index[d], link[min(d.stage, action.stage)] if remote else 0.0))
            previous[w] = index[action]
            self.steps.append((action.kind, action.stage, deps))

    def __call__(self, forward: Sequence[float], backward: Sequence[float], weight: Sequence[float]) -> float:
        """Makespan for per-stage costs (lists of length ``num_stages``); BW costs backward + weight."""
        costs = {"F": forward, "B": backward, "W": weight}
        end = [0.0] * len(self.steps)
        for i, (kind, stage, deps) in enumerate(self.steps):
            ready = 0.0
            for j, delay in deps:
                if end[j] + delay > ready:
                    ready = end[j] + delay
            if kind == "BW":
                end[i] = ready + backward[stage] + weight[stage]
            elif kind in costs:
                end[i] = ready + costs[kind][stage]
            else:
                end[i] = ready
        return max(end, default=0.0)
