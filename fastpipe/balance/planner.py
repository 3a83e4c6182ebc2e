"""The planner: the contiguous partition of a layer list with the least simulated step time.

Pure (no threads, no processes, no tensors): :func:`plan` searches partitions by branch and bound and scores
each one by simulating the chosen schedule (:func:`fastpipe.schedule.simulate`); :func:`predict` simulates
one given partition.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence

from fastpipe.balance.bottleneck import min_bottleneck
from fastpipe.schedule import Schedule, ScheduleError, build, simulate
from fastpipe.schedule.simulate import CompiledSimulation
from fastpipe.trace.timeline import Timeline

__all__ = ["BalanceError", "plan", "predict"]

# Relative margin by which a partition must beat the incumbent, so that float noise never wins.
_REL_TOL = 1e-9


class BalanceError(ValueError):
    """No partition satisfies the request (too few layers, memory limit too small, bad costs)."""


def _stage_costs(balance: Sequence[int], costs: Sequence[float]) -> list[float]:
    out, i = [], 0
    for size in balance:
        out.append(float(sum(costs[i : i + size])))
        i += size
    return out


def predict(
    balance: Sequence[int],
    costs_fwd: Sequence[float],
    costs_bwd: Sequence[float],
    *,
    microbatches: int,
    schedule: str = "gpipe",
    comm: float | Sequence[float] = 0.0,
    virtual_stages: int = 1,
) -> Timeline:
    """Simulates one step of ``schedule`` on the partition ``balance``.

    ``costs_*`` are per layer and per micro-batch. For split-backward schedules (``zb-h1``) a layer's
    backward cost is split evenly into B (input grad) and W (weight grad).
    """
    fwd = _stage_costs(balance, costs_fwd)
    bwd = _stage_costs(balance, costs_bwd)
    workers = len(balance) // virtual_stages
    sched = build(schedule, workers, microbatches, virtual_stages=virtual_stages)
    if sched.split_backward:
        half = [b / 2 for b in bwd]
        return simulate(sched, forward=fwd, backward=half, weight=half, comm=comm)
    return simulate(sched, forward=fwd, backward=bwd, weight=0.0, comm=comm)


def plan(
    costs_fwd: Sequence[float],
    costs_bwd: Sequence[float],
    partitions: int,
    *,
    microbatches: int,
    schedule: str = "gpipe",
    memory: Sequence[float] | None = None,
    memory_limit: float | None = None,
    comm: float | Sequence[float] = 0.0,
    virtual_stages: int = 1,
    max_evaluations: int = 200_000,
    tolerance: float = 0.0,
    stage_memory: Callable[[int, int, int], float] | None = None,
) -> list[int]:
    """Returns the contiguous partition with the least simulated step time, the most even of those that tie.

    Args:
        costs_fwd: forward cost of each layer for one micro-batch.
        costs_bwd: backward cost of each layer for one micro-batch.
        partitions: number of workers K (the balance has ``K * virtual_stages`` entries).
        microbatches: micro-batches per step M.
        schedule: schedule name (see :func:`fastpipe.schedule.build`).
        memory: bytes each layer needs on its device; a stage needs the sum over its layers.
        memory_limit: the most bytes one stage may need (requires ``memory`` or ``stage_memory``).
        comm: link delay per boundary, as in :func:`fastpipe.schedule.simulate`.
        virtual_stages: stages per worker (``interleaved`` only).
        max_evaluations: simulation budget of the search; if it runs out (a warning says so) the result is
            the best partition found, at least as good as the least-bottleneck one.
        tolerance: the relative margin within which simulated times tie. Of the partitions whose time is
            within ``(1 + tolerance)`` of the least, the result has the most even layer counts (least sum
            of squares), then the least time. With measured costs, noise decides between plans that tie
            within it; layer counts are not noisy, so the same model gets the same plan and a model of
            identical layers an even one. ``0``: only exact ties (within 1e-9).
        stage_memory: ``stage_memory(a, b, s)``, the bytes stage ``s`` needs holding layers ``a:b``, where a
            stage's need is not the sum of its layers' (a device's predicted peak depends on where the stage
            sits in the schedule); it must not fall when a layer is added. With ``memory`` both must fit.

    Returns:
        The balance: layers per stage, summing to ``len(costs_fwd)``.

    Raises:
        BalanceError: on bad input, or when no partition fits the memory limit.

    Why this is optimal (up to a relative 1e-9, within ``max_evaluations``): it is a branch and bound over
    all contiguous partitions, stage by stage, that cuts a subtree only when a valid lower bound on the
    simulated makespan T of every partition in it reaches the incumbent. Two bounds are used:

    * Monotonicity. The simulator's recurrence (start = max(worker free, dependency ends + delay)) with a
      fixed per-worker order only takes sums and maxima of costs, so T never drops when a cost rises.
      Simulating the assigned stages at their real costs and each unassigned stage at the cheapest layer
      it could hold (the last stage at least the last layer) is therefore a lower bound.
    * Per stage. A stage j with layers costing c_j = f_j + b_j per micro-batch, behind layers costing
      F_j (forward) and B_j (backward), has T >= F_j + M c_j + B_j: its first F waits for a forward through
      every earlier stage, its 2M actions run one after another on one worker, and with a combined
      backward its last action is a BW whose input grad still has to flow back through every earlier
      stage (split schedules drop B_j, as their last action may be a W). Whether the unassigned layers can
      be cut so that every remaining stage stays under the incumbent is decided exactly for this
      relaxation by greedy filling: moving a layer l into an earlier stage raises the next stage's prefix
      by f_l + b_l but lowers its M c_j term by M c_l, and leaves the other stages unchanged.

    Every partition not cut is simulated, so the result is the minimum over all partitions that fit the
    memory limit. The incumbent starts from the partition with the least largest stage cost (exact DP),
    so the answer is never worse than that classic "optimal bottleneck" partition. A second search then
    walks the partitions within the tolerance of that minimum, most even first, cutting a subtree once
    its layer counts cannot beat the incumbent's (the counts still to place are at best spread evenly),
    or its time bound passes the tolerance (or the incumbent's time, where the counts can only tie).
    Measured: 40 layers, 8 stages, M=8, 1F1B finishes in about 3 s on one CPU core, with a tolerance
    of 0 or 0.05.
    """
    stages = partitions * virtual_stages
    _check_plan_input(costs_fwd, costs_bwd, partitions, stages, memory, memory_limit, stage_memory is not None)
    if not (tolerance >= 0 and math.isfinite(tolerance)):
        raise BalanceError(f"tolerance must be a finite relative margin >= 0 (e.g. 0.05), got {tolerance}")
    try:
        sched = build(schedule, partitions, microbatches, virtual_stages=virtual_stages)
    except ScheduleError as exc:
        raise BalanceError(str(exc)) from exc
    n = len(costs_fwd)
    mem = [float(x) for x in memory] if memory is not None else [0.0] * n
    limit = math.inf if memory_limit is None else float(memory_limit)
    search = _BranchAndBound(sched, comm, costs_fwd, costs_bwd, mem, limit, stages, microbatches, max_evaluations)
    search.stage_memory = stage_memory
    start = min_bottleneck([f + b for f, b in zip(costs_fwd, costs_bwd)], stages, mem, limit, search.fits_stage)
    if start is None:
        raise BalanceError(_no_fit(mem, stages, limit))  # limit is finite: without one, any cut fits
    cuts = search.run(_bounds(start), tolerance)
    if search.exhausted:
        warnings.warn(
            f"balance.plan stopped after {max_evaluations} simulations; the balance is the best found, not "
            "proven optimal (raise max_evaluations)",
            stacklevel=2,
        )
    return [b - a for a, b in zip(cuts, cuts[1:])]


def _check_plan_input(
    costs_fwd: Sequence[float],
    costs_bwd: Sequence[float],
    partitions: int,
    stages: int,
    memory: Sequence[float] | None,
    memory_limit: float | None,
    stage_memory: bool = False,
) -> None:
    """Raises :class:`BalanceError` on the first argument of :func:`plan` that no partition can satisfy."""
    n = len(costs_fwd)
    if len(costs_bwd) != n:
        raise BalanceError(
            f"costs_fwd has {n} layers but costs_bwd has {len(costs_bwd)}; give one forward and one backward "
            "cost per layer"
        )
    for kind, costs in (("fwd", costs_fwd), ("bwd", costs_bwd)):
        bad = next((i for i, c in enumerate(costs) if c < 0 or not math.isfinite(c)), None)
        if bad is not None:
            raise BalanceError(f"costs must be finite and >= 0; costs_{kind}[{bad}] is {costs[bad]}")
    if partitions < 1:
        raise BalanceError(f"partitions must be >= 1 (the number of workers), got {partitions}")
    if n < stages:
        raise BalanceError(
            f"{n} layers cannot fill {stages} stages (partitions x virtual_stages): each stage holds at least one "
            f"layer; plan at most {n} stages, or split the model into more layers"
        )
    if memory_limit is not None and memory is None and not stage_memory:
        raise BalanceError(
            "memory_limit needs per-layer memory: pass memory=[bytes of each layer] (or stage_memory=), or no limit"
        )
    if memory is not None and len(memory) != n:
        raise BalanceError(f"memory has {len(memory)} entries for {n} layers; give one entry per layer")


def _no_fit(mem: Sequence[float], stages: int, limit: float) -> str:
    """Why no partition fits the memory limit, and what to change."""
    head = f"no partition into {stages} stages fits memory_limit={limit}"
    if not any(mem):
        return f"{head}: no contiguous cut keeps every stage's need within it. Raise memory_limit, or plan more stages"
    big = max(range(len(mem)), key=lambda i: mem[i])
    if mem[big] > limit:
        return (
            f"{head}: layer {big} alone needs {mem[big]:g}. Raise memory_limit, or make the layer need less "
            "(smaller micro-batches: more chunks; fewer optimizer states)"
        )
    return (
        f"{head}: the layers need {sum(mem):g} in all and no contiguous cut keeps every stage within the limit. "
        "Raise memory_limit, or plan more stages"
    )


def _prefix_sums(values: Sequence[float]) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


def _bounds(balance: Sequence[int]) -> list[int]:
    """Stage boundaries (layer indices, from 0 to the layer count) of a balance."""
    out = [0]
    for size in balance:
        out.append(out[-1] + size)
    return out


class _BranchAndBound:
    """The search state of :func:`plan`: prefix sums of the costs, the compiled simulator, the incumbent.

    A partial partition is its list of cuts: ``[0, end of stage 0, end of stage 1, ...]``.
    """

    def __init__(
        self,
        sched: Schedule,
        comm: float | Sequence[float],
        costs_fwd: Sequence[float],
        costs_bwd: Sequence[float],
        mem: Sequence[float],
        limit: float,
        stages: int,
        microbatches: int,
        budget: int,
    ) -> None:
        self.evaluate = CompiledSimulation(sched, comm)
        self.split = sched.split_backward
        self.microbatches = microbatches
        self.stages = stages
        self.n = n = len(costs_fwd)
        self.limit = limit
        self.pf, self.pb, self.pm = _prefix_sums(costs_fwd), _prefix_sums(costs_bwd), _prefix_sums(mem)
        # Per remaining stage, the cheapest single layer it could hold (each stage holds at least one).
        self.min_f = [min(costs_fwd[i:]) for i in range(n)] + [0.0]
        self.min_b = [min(costs_bwd[i:]) for i in range(n)] + [0.0]
        self.last_f, self.last_b = costs_fwd[-1], costs_bwd[-1]
        self.budget = self.max_evaluations = budget  # simulations left (per search)
        self.exhausted = False
        # The fastest cuts first (evenness not weighed, nothing within a tolerance), then the most even.
        self.even = False
        self.within = math.inf
        self.best_squares = 0
        self.best_time = math.inf
        self.best_cuts: list[int] = []
        # A stage's need where it is not the sum of its layers' (see plan's stage_memory).
        self.stage_memory: Callable[[int, int, int], float] | None = None

    def run(self, seed: list[int], tolerance: float) -> list[int]:
        """The most even cuts within ``tolerance`` of the least time, searched from the incumbent ``seed``."""
        self.best_time, self.best_cuts = self.lower_bound(seed), seed
        self.search([0])
        self.exhausted = self.budget <= 0
        # The second search: any cuts simulated within the tolerance of the fastest qualify; the most
        # even qualifying ones win, the faster of equally even ones. The fastest are the incumbent.
        self.budget = self.max_evaluations
        self.even = True
        self.within = self.best_time * (1 + tolerance) * (1 + _REL_TOL)
        self.best_squares = sum((b - a) ** 2 for a, b in zip(self.best_cuts, self.best_cuts[1:]))
        self.search([0])
        return self.best_cuts

    def fits(self, a: int, b: int, s: int) -> bool:
        """Whether layers ``a:b`` fit the memory limit as stage ``s``."""
        return self.pm[b] - self.pm[a] <= self.limit and self.fits_stage(a, b, s)

    def fits_stage(self, a: int, b: int, s: int) -> bool:
        """Whether layers ``a:b`` fit as stage ``s`` by ``stage_memory`` (True without one)."""
        return self.stage_memory is None or self.stage_memory(a, b, s) <= self.limit

    def lower_bound(self, cuts: list[int]) -> float:
        """Simulated makespan with each unassigned stage at the cheapest layer it could hold (exact if complete)."""
        fwd = [self.pf[b] - self.pf[a] for a, b in zip(cuts, cuts[1:])]
        bwd = [self.pb[b] - self.pb[a] for a, b in zip(cuts, cuts[1:])]
        left = self.stages - len(fwd)
        a = cuts[-1]
        fwd += [self.min_f[a]] * left
        bwd += [self.min_b[a]] * left
        if left:
            fwd[-1] = max(fwd[-1], self.last_f)
            bwd[-1] = max(bwd[-1], self.last_b)
        if self.split:
            half = [x / 2 for x in bwd]
            return self.evaluate(fwd, half, half)
        return self.evaluate(fwd, bwd, [0.0] * len(bwd))

    def analytic_ok(self, a: int, left: int, cut: float) -> bool:
        """Whether layers ``a:`` can fill ``left`` stages that each keep the per-stage bound under ``cut``."""
        # Relaxation: every remaining stage j needs F_j + M c_j (+ B_j) < cut; greedy filling is exact for it.
        for i in range(left):
            b = self._greedy_end(a, cut, self.stages - left + i)
            if b == a:
                return False
            a = b
            if a == self.n:
                return True
        return a == self.n

    def _greedy_end(self, a: int, cut: float, s: int) -> int:
        """The furthest end of stage ``s`` from layer ``a`` that fits memory and keeps its bound under ``cut``."""
        pf, pb = self.pf, self.pb
        behind = pf[a] + (0.0 if self.split else pb[a])
        b = a
        while (
            b < self.n
            and self.fits(a, b + 1, s)
            and (behind + self.microbatches * (pf[b + 1] - pf[a] + pb[b + 1] - pb[a]) < cut)
        ):
            b += 1
        return b

    def candidates(self, cuts: list[int]) -> list[int]:
        """Ends of the next stage that fit memory, nearest the even split of the remaining layers first."""
        left = self.stages - len(cuts) + 1
        a, s = cuts[-1], len(cuts) - 1
        if left == 1:
            ends = [self.n] if self.fits(a, self.n, s) else []
        else:
            ends = [b for b in range(a + 1, self.n - left + 2) if self.fits(a, b, s)]
        ideal = a + (self.n - a) / left
        return sorted(ends, key=lambda e: abs(e - ideal))

    def search(self, cuts: list[int], squares: int = 0) -> None:
        """Tries every next stage after ``cuts`` that its bounds do not cut; updates the incumbent.

        Weighing evenness (``self.even``), ``squares`` is the sum of squared layer counts of the stages
        in ``cuts``. The layers still to place, spread as evenly as they can be, bound the subtree's sum
        from below: above the incumbent's, the subtree is cut; equal to it, only a faster partition can
        win, so the incumbent's time is the cut, as it always is when evenness is not weighed.
        """
        left = self.stages - len(cuts) + 1
        a = cuts[-1]
        for b in self.candidates(cuts):
            sq = squares + (b - a) ** 2 if self.even else 0
            least = sq + _even_squares(self.n - b, left - 1) if self.even else 0
            if least > self.best_squares:
                continue
            faster = self.best_time * (1 - _REL_TOL)
            cut = self.within if least < self.best_squares else min(self.within, faster)
            if left > 1 and not self.analytic_ok(b, left - 1, cut):
                continue
            if self.budget <= 0:
                return
            self.budget -= 1
            t = self.lower_bound(cuts + [b])
            if t > cut or (t == cut and cut == faster):
                continue
            if left == 1:
                self.best_squares, self.best_time, self.best_cuts = sq, t, cuts + [b]
            else:
                self.search(cuts + [b], sq)


def _even_squares(layers: int, stages: int) -> int:
    """The least sum of squared layer counts of ``layers`` layers in ``stages`` stages (spread evenly)."""
    if stages == 0:
        return 0 if layers == 0 else 1 << 62
    q, r = divmod(layers, stages)
    return r * (q + 1) ** 2 + (stages - r) * q**2
