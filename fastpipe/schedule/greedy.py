"""A greedy zero-bubble scheduler for given per-stage costs and a memory limit.

The Zero Bubble paper (Qi et al., arXiv 2401.10241, "automatic pipeline scheduling") builds a
schedule from the measured costs of F, B (input grad) and W (weight grad) instead of a fixed
pattern. Its heuristic, as built here for one stage per worker, is an event-driven list
scheduler: the worker that is free first decides what it runs next.

* **B first.** A ready input-gradient pass runs at once: the stage upstream waits for it.
* **Then F.** A ready forward runs when the worker's activations stay within the memory
  limit. Without a limit the warm-up holds as many forwards as fit before the first B
  arrives (ZB-H2's shape); with 1F1B's memory it becomes ZB-H1's.
* **W fills the gaps.** When neither is ready a pending W runs if the gap until the next F or B
  is at least as long as the W, or if waiting would make this worker's idle time the largest
  of all workers' (the paper's rule: a short W that delays the next B a little is worth it
  when this worker is the one the step waits on). Otherwise the worker waits. Once its F and
  B are done, the remaining W's run back to back.
* **A bound on deferred W's** (``backlog``, none by default). Without W records the memory
  counted here is freed at B, so nothing else makes a worker run its W's before its forwards:
  a slow stage can end on a long run of them while the others wait. With ``backlog=n`` a
  worker that has n W's due runs one before its next F. :func:`fastpipe.schedule.search.search` tries no bound and
  1..K, and keeps the fastest.

Memory counts as :func:`fastpipe.schedule.simulate.peak_memory` does: the activation of
``(stage, mb)`` is held from the start of its F to the end of its B, and with ``w_records`` what
B leaves for W from there to the end of the W that frees it (the last W of its batch of
``wgrad_batch``). A forward reserves the larger of its activation and its records, so B never
raises the count; a forward that does not fit runs a due W first, which frees records. On one
worker its actions run in order, so the count follows from the worker's order alone, and the
schedule keeps to the limit under any costs.

What it returns is a :class:`~fastpipe.schedule.ir.Schedule` like any other (every backward
split into B and W): the simulator times it and every runtime runs it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from fastpipe.schedule.ir import Action, Schedule, ScheduleError

__all__ = ["GREEDY", "checked_costs", "greedy_schedule"]

# The name of the schedule this module builds, as Schedule.name and in the search's table.
GREEDY = "greedy"

# Relative slack for comparing times that are sums of float costs.
_EPS = 1e-9


def checked_costs(value: float | Sequence[float], n: int, what: str, positive: bool = False) -> tuple[float, ...]:
    """``value`` as ``n`` floats (a scalar repeated, or ``n`` values), each finite and >= 0 (> 0 if ``positive``).

    Raises:
        ScheduleError: a sequence of another length, or a value out of range, named by ``what``.
    """
    values = [float(value)] * n if isinstance(value, (int, float)) else [float(v) for v in value]
    if len(values) != n:
        raise ScheduleError(f"{what} has {len(values)} entries; expected {n}")
    for v in values:
        if not math.isfinite(v) or v < 0 or (positive and v == 0):
            raise ScheduleError(f"every {what} cost must be finite and {'> 0' if positive else '>= 0'}, got {v}")
    return tuple(values)


def greedy_schedule(
    stages: int,
    microbatches: int,
    forward: float | Sequence[float] = 1.0,
    backward: float | Sequence[float] = 1.0,
    weight: float | Sequence[float] = 1.0,
    comm: float | Sequence[float] = 0.0,
    activation: float | Sequence[float] = 1.0,
    memory_limit: float | None = None,
    backlog: int | Sequence[int] | None = None,
    *,
    w_records: float | Sequence[float] | None = None,
    wgrad_batch: int = 1,
) -> Schedule:
    """The greedy zero-bubble schedule of ``stages`` workers, one stage each (see the module docstring).

    Args:
        stages: pipeline stages K, one per worker.
        microbatches: micro-batches per step M.
        forward: cost of each stage's F (a scalar or one per stage), > 0.
        backward: cost of each stage's B, > 0.
        weight: cost of each stage's W, >= 0.
        comm: link delay between neighbouring stages (a scalar or one per boundary, K - 1), >= 0.
        activation: memory one micro-batch's activation holds on each stage, in the units of
            ``memory_limit`` (:func:`~fastpipe.schedule.simulate.peak_memory`'s units).
        memory_limit: the most activation memory one worker may hold at once; ``None``: no limit.
        backlog: the most W's a worker defers (a scalar or one per worker): with this many due, a W
            runs before a ready F. ``None``: no bound (W's only fill gaps).
        w_records: memory one micro-batch's B keeps until its W on each stage, in the units of
            ``memory_limit``; ``None``: none.
        wgrad_batch: W's that run their deferred work together (the runtime's ``wgrad_batch``):
            their records are freed at the batch's last W.

    Returns:
        A validated schedule named ``"greedy"``.

    Raises:
        ScheduleError: on bad counts or costs, or a limit below what one stage needs to make progress
            (one micro-batch's activation, or its records with a batch of W's still open).
    """
    for what, n in (("stages", stages), ("microbatches", microbatches)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ScheduleError(f"greedy: {what} must be an integer >= 1, got {n!r}")
    f = list(checked_costs(forward, stages, "forward", positive=True))
    b = list(checked_costs(backward, stages, "backward", positive=True))
    w_cost = list(checked_costs(weight, stages, "weight"))
    link = list(checked_costs(comm, stages - 1, "comm (one per stage boundary)"))
    act = list(checked_costs(activation, stages, "activation"))
    rec = list(checked_costs(0.0 if w_records is None else w_records, stages, "w_records"))
    if isinstance(wgrad_batch, bool) or not isinstance(wgrad_batch, int) or wgrad_batch < 1:
        raise ScheduleError(f"greedy: wgrad_batch must be an integer >= 1, got {wgrad_batch!r}")
    limit = math.inf if memory_limit is None else float(memory_limit)
    # The least a worker needs to move on: a batch of W's one short of closing, and one more forward.
    least = [max(a, r) + (wgrad_batch - 1) * r for a, r in zip(act, rec)]
    tight = [s for s in range(stages) if least[s] > limit * (1 + _EPS)]
    if tight:
        s = tight[0]
        if not rec[s]:
            raise ScheduleError(
                f"greedy: memory_limit={memory_limit} is below one micro-batch's activation on stage {s} "
                f"({act[s]}); no forward fits"
            )
        raise ScheduleError(
            f"greedy: memory_limit={memory_limit} is below what stage {s} needs to make progress, {least[s]}: "
            f"{wgrad_batch - 1} micro-batches' W records ({rec[s]} each) held until their batch of "
            f"wgrad_batch={wgrad_batch} closes, and one more micro-batch's activation or records, whichever is "
            "larger; raise the limit or lower wgrad_batch"
        )
    bounds = (
        [math.inf] * stages if backlog is None else [backlog] * stages if isinstance(backlog, int) else list(backlog)
    )
    if len(bounds) != stages or any(
        isinstance(n, bool) or not (n == math.inf or isinstance(n, int) and n >= 1) for n in bounds
    ):
        raise ScheduleError(f"greedy: backlog must be an integer >= 1, one per stage, or None; got {backlog!r}")
    bounds_f = [float(n) for n in bounds]
    return _Greedy(stages, microbatches, f, b, w_cost, link, act, limit, bounds_f, rec, wgrad_batch).run()


class _Greedy:
    """The scheduler's state: per worker its clock, its idle time, its progress and its held memory."""

    def __init__(
        self,
        k: int,
        m: int,
        f: list[float],
        b: list[float],
        w: list[float],
        link: list[float],
        act: list[float],
        limit: float,
        backlog: list[float],
        rec: list[float],
        width: int,
    ) -> None:
        self.k, self.m = k, m
        self.f, self.b, self.w, self.link, self.act, self.limit = f, b, w, link, act, limit
        self.backlog = backlog
        self.free = [0.0] * k
        self.idle = [0.0] * k
        self.forwards = [0] * k  # F's issued (micro-batches in order)
        self.backwards = [0] * k  # B's issued (in the order of the F's)
        self.pending: list[deque[int]] = [deque() for _ in range(k)]  # micro-batches whose W is due
        self.held = [0.0] * k  # reserved: max(activation, records) per micro-batch before its B
        self.rec = rec  # records B leaves for W, per micro-batch
        self.width = width  # W's per batch: their records are freed together
        self.open = [0.0] * k  # records of the W's of the batch not yet closed
        self.done_w = [0] * k
        self.f_end: list[dict[int, float]] = [{} for _ in range(k)]
        self.b_end: list[dict[int, float]] = [{} for _ in range(k)]
        self.order: list[list[Action]] = [[] for _ in range(k)]

    def _left(self, s: int) -> bool:
        return self.forwards[s] < self.m or self.backwards[s] < self.m or bool(self.pending[s])

    def _f_ready(self, s: int) -> tuple[float, bool] | None:
        """When the next F of ``s`` can start: ``(time, known)``; ``known`` False: a lower bound. None: none due."""
        mb = self.forwards[s]
        if mb >= self.m or not self._fits(s):
            return None
        if s == 0:
            return 0.0, True
        if mb in self.f_end[s - 1]:
            return self.f_end[s - 1][mb] + self.link[s - 1], True
        # Not yet issued upstream: it starts no earlier than that worker is free.
        return self.free[s - 1] + self.f[s - 1] + self.link[s - 1], False

    def _b_ready(self, s: int) -> tuple[float, bool] | None:
        mb = self.backwards[s]
        if mb >= self.forwards[s]:
            return None  # its F has not run; the F is the next thing due
        if s == self.k - 1:
            return self.f_end[s][mb], True
        if mb in self.b_end[s + 1]:
            return self.b_end[s + 1][mb] + self.link[s], True
        return self.free[s + 1] + self.b[s + 1] + self.link[s], False

    def _fits(self, s: int) -> bool:
        return self.held[s] + max(self.act[s], self.rec[s]) <= self.limit * (1 + _EPS)

    def _issue(self, s: int, kind: str, mb: int, start: float, cost: float) -> None:
        self.order[s].append(Action(kind, s, mb))
        self.free[s] = start + cost

    def _issue_w(self, s: int, t: float) -> None:
        self._issue(s, "W", self.pending[s].popleft(), t, self.w[s])
        self.done_w[s] += 1
        self.open[s] += self.rec[s]
        if self.done_w[s] % self.width == 0 or self.done_w[s] == self.m:  # the batch's last W frees it
            self.held[s] -= self.open[s]
            self.open[s] = 0.0

    def run(self) -> Schedule:
        while True:
            busy = [s for s in range(self.k) if self._left(s)]
            if not busy:
                break
            s = min(busy, key=lambda i: (self.free[i], i))
            t = self.free[s]
            # Every action that ends by t is issued: any other worker's next one starts at or after t.
            due_b, due_f = self._b_ready(s), self._f_ready(s)
            if due_b is not None and due_b[1] and due_b[0] <= t * (1 + _EPS):
                mb = self.backwards[s]
                self._issue(s, "B", mb, t, self.b[s])
                self.b_end[s][mb] = self.free[s]
                self.backwards[s] += 1
                self.held[s] -= max(self.act[s], self.rec[s]) - self.rec[s]
                self.pending[s].append(mb)
                continue
            # A forward that does not fit waits for records to be freed, which only a W does.
            starved = self.rec[s] > 0 and self.forwards[s] < self.m and not self._fits(s)
            if self.pending[s] and (len(self.pending[s]) >= self.backlog[s] or starved):
                self._issue_w(s, t)
                continue
            if due_f is not None and due_f[1] and due_f[0] <= t * (1 + _EPS):
                mb = self.forwards[s]
                self._issue(s, "F", mb, t, self.f[s])
                self.f_end[s][mb] = self.free[s]
                self.forwards[s] += 1
                self.held[s] += max(self.act[s], self.rec[s])
                continue
            upcoming = min((due[0] for due in (due_b, due_f) if due is not None), default=math.inf)
            gap = max(upcoming - t, 0.0)
            if self.pending[s] and (gap >= self.w[s] * (1 - _EPS) or self.idle[s] + gap > max(self.idle) * (1 + _EPS)):
                self._issue_w(s, t)
                continue
            if math.isinf(upcoming):  # every F and B issued or blocked with no B due: cannot happen
                raise ScheduleError(f"greedy: worker {s} has work left but nothing can become ready")
            # Nothing to run: wait for the next F or B (a lower bound, so the worker decides again then),
            # at least one float step, so that the loop moves on even where costs vanish next to t.
            self.idle[s] += gap
            self.free[s] = max(upcoming, math.nextafter(t, math.inf))
        workers = tuple(tuple(actions) for actions in self.order)
        schedule = Schedule(GREEDY, self.k, self.m, self.k, workers)
        schedule.validate()
        return schedule
