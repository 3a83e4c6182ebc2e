"""Built-in schedules: GPipe, 1F1B (PipeDream-Flush), interleaved 1F1B (Megatron), ZB-H1, ZB-H2, ZB-V and DualPipeV.

Micro-batch ``i`` enters stage ``j`` at clock ``i + j`` in GPipe; the other schedules bound the number of
micro-batches in flight. Pictures for K=3 workers, M=4 micro-batches (one column per unit of time, unit
costs F=1, B=W=1)::

    gpipe   w0: F0 F1 F2 F3 .  .  .  .  BW3   BW2   BW1   BW0
    1f1b    w0: F0 F1 .  .  F2 .  BW0   F3 BW1 ...  (at most K in flight on w0)
    zb-h1   1f1b order of F and B (backward split into B then W); worker w lags its W by w

``zb-h2``, ``zb-v`` and ``dualpipev`` live in :mod:`fastpipe.schedule.zero_bubble`; the last two place
2K stages on K workers in a V (:func:`fastpipe.schedule.placement.v_shape`).
"""

from __future__ import annotations

import functools

from fastpipe.schedule.ir import Action, Schedule, ScheduleError
from fastpipe.schedule.placement import round_robin, v_shape
from fastpipe.schedule.zero_bubble import dualpipev, zb_h2, zb_v

__all__ = ["build_for", "SCHEDULES", "STAGES_PER_WORKER", "build", "placement_for"]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-v", "dualpipev")

#: Schedules with a fixed number of stages per worker other than one (V shapes: two).
STAGES_PER_WORKER = {"zb-v": 2, "dualpipev": 2}


def build(name: str, stages: int, microbatches: int, virtual_stages: int | None = None) -> Schedule:
    """Builds a named schedule.

    Args:
        name: one of :data:`SCHEDULES`: ``"gpipe"``, ``"1f1b"``, ``"interleaved"``, ``"zb-h1"``,
            ``"zb-h2"``, ``"zb-v"``, ``"dualpipev"``.
        stages: physical pipeline workers K. The model has ``stages * virtual_stages`` stages:
            ``interleaved`` takes any ``virtual_stages``; ``zb-v`` and ``dualpipev`` hold 2 per worker
            in a V; the others one.
        microbatches: micro-batches per step M.
        virtual_stages: stages per worker v; default the schedule's own (1, or 2 for the V schedules).

    Returns:
        A schedule that passes :meth:`Schedule.validate`.

    Raises:
        ScheduleError: on an unknown name or arguments that break the schedule's constraints.
    """
    key = name.lower().replace("_", "-")
    if key not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; valid schedules: {', '.join(SCHEDULES)}")
    if not isinstance(stages, int) or stages < 1:
        raise ScheduleError(f"stages must be an integer >= 1, got {stages!r}")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ScheduleError(f"microbatches must be an integer >= 1, got {microbatches!r}")
    own = STAGES_PER_WORKER.get(key, 1)
    if virtual_stages is None:
        virtual_stages = own
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise ScheduleError(f"virtual_stages must be an integer >= 1, got {virtual_stages!r}")
    if key in STAGES_PER_WORKER and virtual_stages != own:
        raise ScheduleError(
            f"{key} places {own} stages on each worker in a V (stages w and 2K-1-w on worker w); "
            f"got virtual_stages={virtual_stages}"
        )
    if key not in STAGES_PER_WORKER and key != "interleaved" and virtual_stages != 1:
        raise ScheduleError(f"virtual_stages={virtual_stages} needs the 'interleaved' schedule, not {name!r}")
    if key == "gpipe":
        workers = _gpipe(stages, microbatches)
    elif key == "1f1b":
        workers = _one_f_one_b(stages, microbatches)
    elif key == "interleaved":
        if microbatches % stages != 0:
            raise ScheduleError(
                f"interleaved needs microbatches % stages == 0 (Megatron's constraint), "
                f"got microbatches={microbatches}, stages={stages}"
            )
        workers = _interleaved(stages, microbatches, virtual_stages)
    elif key == "zb-h1":
        workers = _zb_h1(stages, microbatches)
    elif key == "zb-h2":
        workers = zb_h2(stages, microbatches)
    elif key == "zb-v":
        workers = zb_v(stages, microbatches)
    else:
        workers = dualpipev(stages, microbatches)
    num_stages = stages * virtual_stages
    placement = v_shape(stages) if key in STAGES_PER_WORKER else round_robin(num_stages, stages)
    schedule = Schedule(key, num_stages, microbatches, stages, tuple(tuple(w) for w in workers), placement=placement)
    schedule.validate()
    return schedule


def _gpipe(k: int, m: int, split_drain: bool = True) -> list[list[Action]]:
    """Fill-drain; worker ``w`` splits its first ``w`` backwards and runs their W last.

    In a plain drain worker ``w - 1`` waits a whole ``BW`` of worker ``w`` before its first
    backward; sending the input gradient after ``B`` alone cuts that wait to ``B``. Worker
    ``w`` must then stay ahead of worker ``w - 1``, which needs ``w`` early ``B`` s (worker 1
    one, worker 2 two, ...): the drain then takes (K-1)(F+B) + M(F+B+W), the zero-bubble
    bound for this forward, with K(K-1)/2 splits in all. Worker 0 sends no gradient upstream
    and keeps combined backwards. Deferred W's hold no more memory than the drain's start,
    when every micro-batch's graph is alive::

        w0:  F0 F1 F2 F3 .  .  .  BW3 BW2 BW1 BW0
        w1:  .  F0 F1 F2 F3 .  B3 BW2 BW1 BW0 W3
    """
    drain = list(reversed(range(m)))
    workers = []
    for w in range(k):
        early = min(w, m) if split_drain else 0
        actions = [Action("F", w, i) for i in range(m)]
        actions += [Action("B", w, i) for i in drain[:early]] + [Action("BW", w, i) for i in drain[early:]]
        actions += [Action("W", w, i) for i in drain[:early]]
        workers.append(actions)
    return workers


def _one_f_one_b(k: int, m: int) -> list[list[Action]]:
    workers = []
    for w in range(k):
        warmup = min(k - 1 - w, m)
        actions = [Action("F", w, i) for i in range(warmup)]
        for i in range(m - warmup):
            actions += [Action("F", w, warmup + i), Action("BW", w, i)]
        actions += [Action("BW", w, i) for i in range(m - warmup, m)]
        workers.append(actions)
    return workers


def _interleaved(k: int, m: int, v: int) -> list[list[Action]]:
    """Megatron-LM's interleaved 1F1B: micro-batches go through the chunks in groups of K."""
    if v == 1:
        return _one_f_one_b(k, m)
    total = m * v

    def step(w: int, i: int, forward: bool) -> Action:
        chunk = (i // k) % v
        if not forward:
            chunk = v - 1 - chunk
        mb = (i // (k * v)) * k + i % k
        return Action("F" if forward else "BW", chunk * k + w, mb)

    workers = []
    for w in range(k):
        warmup = total if m == k else min((k - w - 1) * 2 + (v - 1) * k, total)
        actions = [step(w, i, True) for i in range(warmup)]
        for i in range(total - warmup):
            actions += [step(w, warmup + i, True), step(w, i, False)]
        actions += [step(w, i, False) for i in range(total - warmup, total)]
        workers.append(actions)
    return workers


def _zb_h1(k: int, m: int) -> list[list[Action]]:
    """ZB-H1 (Qi et al. 2023): 1F1B's F/B order and activation bound, each W deferred to fill the bubble.

    Worker w keeps 1F1B's order of F and B (warm-up of K-1-w forwards, then F/B pairs, then the remaining
    B's) and runs ``W(w, j - w)`` right after ``B(w, j)``: its weight grads lag ``w`` micro-batches behind.
    Input grads therefore travel down the pipe at B's speed instead of B+W's, and the ``w`` lagging W's fill
    the tail that worker w would otherwise spend waiting. With F = B = W the makespan is 3M + K - 1 for
    M >= K, i.e. a bubble of (K-1)(F+B-W) against 1F1B's (K-1)(F+B+W): a third.
    ::

        K=4, M=8   w0: F0 F1 F2 F3 B0 W0 F4 B1 W1 ...
                   w3: F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 ... B7 W4 W5 W6 W7
    """
    workers = []
    for w, one_f_one_b in enumerate(_one_f_one_b(k, m)):
        # 1F1B's order of F and B, then a W after each B, lagging w micro-batches behind.
        forwards_and_backwards = [a if a.kind == "F" else Action("B", a.stage, a.microbatch) for a in one_f_one_b]
        actions: list[Action] = []
        next_w = 0
        for action in forwards_and_backwards:
            actions.append(action)
            if action.kind == "B" and action.microbatch - w >= 0:
                actions.append(Action("W", w, next_w))
                next_w += 1
        actions += [Action("W", w, j) for j in range(next_w, m)]
        workers.append(actions)
    return workers


@functools.lru_cache(maxsize=128)
def build_for(name: str, num_stages: int, num_workers: int, microbatches: int) -> Schedule:
    """The schedule ``name`` for a model cut into ``num_stages`` stages on ``num_workers`` workers.

    More stages than workers means virtual stages: ``interleaved`` (stage ``s`` on worker
    ``s % num_workers``), or exactly two per worker in a V for ``zb-v`` and ``dualpipev``; the
    schedule's ``placement`` says which. Cached, since runtimes ask for the same schedule every step.

    Raises:
        ScheduleError: the stages do not spread evenly, or the schedule holds another number per worker.
    """
    if num_workers < 1 or num_stages % num_workers:
        raise ScheduleError(
            f"{num_stages} stages do not spread evenly over {num_workers} workers; the number of stages must be "
            "a multiple of the number of workers"
        )
    virtual = num_stages // num_workers
    key = name.lower().replace("_", "-")
    own = STAGES_PER_WORKER.get(key, 1)
    if key in SCHEDULES and key != "interleaved" and virtual != own:
        if own == 1:
            raise ScheduleError(
                f"{num_stages} stages on {num_workers} workers need schedule='interleaved', 'zb-v' or "
                f"'dualpipev' (several stages per worker); got {name!r}"
            )
        raise ScheduleError(
            f"{key} runs 2 stages per worker in a V: {2 * num_workers} stages on {num_workers} workers; "
            f"got {num_stages} stages"
        )
    return build(name, stages=num_workers, microbatches=microbatches, virtual_stages=virtual)


def placement_for(name: str, num_stages: int, num_workers: int) -> tuple[int, ...]:
    """The placement that :func:`build_for` gives ``name`` (a V for ``zb-v``/``dualpipev``, else round robin).

    It needs no micro-batch count, so a rank can learn its stages before it knows the step; the
    arguments are checked when the schedule is built.
    """
    if name.lower().replace("_", "-") in STAGES_PER_WORKER and num_stages == 2 * num_workers:
        return v_shape(num_workers)
    return round_robin(num_stages, num_workers)
