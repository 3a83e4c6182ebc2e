"""How the planner judges one combination: its peak per device, its offload, its simulated time."""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Sequence

from fastpipe.balance.device_need import compose
from fastpipe.balance.planner import BalanceError, plan
from fastpipe.memory.limit import MARGIN, over_limit
from fastpipe.memory.model import DeviceMemory, OptimizerSpec, StageBytes, optimizer_factor, predict_memory
from fastpipe.memory.offload_bytes import copy_costs
from fastpipe.memory.planner_types import Combination, PlanProfile
from fastpipe.memory.receive_buffers import buffered_stages, receive_buffer_bytes
from fastpipe.memory.sizes import format_bytes
from fastpipe.model.skip_memory import SkipSpan
from fastpipe.schedule import build
from fastpipe.schedule.ir import Action, Schedule
from fastpipe.schedule.prefetch import with_prefetch, worth_prefetching
from fastpipe.schedule.search import Candidate, StageCosts
from fastpipe.schedule.simulate import simulate_times
from fastpipe.step.recompute_policy import Recompute, stage_mode

__all__ = ["Judge", "bounds", "makespan", "propose_balances", "refuse_floors", "stage_bytes", "stage_costs"]

_OFFLOAD_STEPS = 8  # offload fractions in eighths, as offload="auto" tries them
_TIGHTER = (1.0, 0.95, 0.9)  # the shares of the limit the memory-planned cuts are planned under
# The simulations each memory-planned cut may take. It is only a proposal that the model then
# judges, and it is planned for every recompute setting and share: with the time-planned cut's
# 200,000 each, a 100-block model spent over 10 minutes proposing cuts.
_PROPOSAL_EVALUATIONS = 20_000


class Judge:
    """Judges combinations for :func:`~fastpipe.memory.planner.plan_memory`.

    ``judge(balance, candidate, costs, setting, layers, added)`` predicts a combination's peak per
    device, chooses its offload where the devices allow one, and simulates its step.

    Args:
        profile: the plan's profile.
        limit: bytes per device (None: everything fits).
        optimizer: the optimizer whose state a device holds.
        wgrad_batch: micro-batches per batched ``W``.
        input_grad: whether the pipe's input needs a gradient.
        transport: how values reach the stages (:data:`~fastpipe.memory.receive_buffers.TRANSPORTS`),
            whose receive buffers a device holds too.
    """

    def __init__(
        self,
        profile: PlanProfile,
        limit: int | None,
        optimizer: OptimizerSpec,
        wgrad_batch: int,
        input_grad: bool,
        transport: str = "local",
    ) -> None:
        self.profile, self.limit, self.transport = profile, limit, transport
        self.kw = {"optimizer": optimizer, "wgrad_batch": wgrad_batch, "input_grad": input_grad}
        # By the schedule's identity (hashing a schedule walks all its actions), the schedule kept alive.
        self._built: dict[tuple[int, frozenset[int]], tuple[Schedule, Schedule]] = {}
        self._times: dict[int, tuple[Schedule, dict[Action, tuple[int, float, float]]]] = {}

    def __call__(
        self,
        balance: tuple[int, ...],
        candidate: Candidate,
        costs: StageCosts,
        setting: str | Recompute,
        layers: Sequence[StageBytes],
        added: Sequence[float],
    ) -> Combination:
        schedule = candidate.schedule
        assert schedule is not None
        held = stage_bytes(layers, balance, self.profile.spans)
        fractions = [0.0] * len(balance)
        devices = self._predict(schedule, held, fractions, setting)
        fits = self._fits(devices)
        if not fits and self.profile.bandwidth is not None:
            fractions = self._offload(schedule, held, setting)
            if any(fractions):
                devices = self._predict(schedule, held, fractions, setting)
                fits = self._fits(devices)
        built = self._prefetched(schedule, fractions)
        time = makespan(built, costs, added, self._copies(held, fractions))
        return Combination(
            balance,
            candidate.label,
            candidate.name,
            candidate.virtual_stages,
            setting,
            tuple(fractions),
            time,
            tuple(devices),
            fits,
            built,
        )

    def _fits(self, devices: Sequence[DeviceMemory]) -> bool:
        return self.limit is None or over_limit(devices, self.limit) is None

    def _predict(
        self, schedule: Schedule, stages: list[StageBytes], fractions: Sequence[float], setting: str | Recompute
    ) -> list[DeviceMemory]:
        taken = [
            dataclasses.replace(st, offloaded=math.floor(f * _offloadable(stages, s))) if f else st
            for s, (st, f) in enumerate(zip(stages, fractions))
        ]
        mode = stage_mode(setting)
        built = self._prefetched(schedule, fractions)
        if id(built) not in self._times:  # unit costs, and a U that takes time, as the step's guard predicts
            self._times[id(built)] = (built, simulate_times(built, update=1.0))
        times = self._times[id(built)][1]
        buffers = receive_buffer_bytes(built, taken, self.transport)
        taken = buffered_stages(built, taken, self.transport)
        return predict_memory(
            built,
            taken,
            times=times,
            checkpoint=mode,
            receive_buffers=buffers,
            **self.kw,  # type: ignore[arg-type]
        )

    def _offload(self, schedule: Schedule, stages: list[StageBytes], setting: str | Recompute) -> list[float]:
        """Per device the least eighth whose prediction fits (all stages at that share), or none if the
        whole of it does not fit: offload is then no help to this recompute."""
        n = len(stages)
        if not self._fits(self._predict(schedule, stages, [1.0] * n, setting)):
            return [0.0] * n
        least: dict[int, float] = {}
        for step in range(1, _OFFLOAD_STEPS + 1):
            share = step / _OFFLOAD_STEPS
            for d in self._predict(schedule, stages, [share] * n, setting):
                if d.worker not in least and (self.limit is None or over_limit([d], self.limit) is None):
                    least[d.worker] = share
            if len(least) == schedule.num_workers:
                break
        base = self._predict(schedule, stages, [0.0] * n, setting)
        needs = {d.worker for d in base if not self._fits([d])}
        return [least.get(schedule.worker_of(s), 1.0) if schedule.worker_of(s) in needs else 0.0 for s in range(n)]

    def _prefetched(self, schedule: Schedule, fractions: Sequence[float]) -> Schedule:
        key = (id(schedule), frozenset(s for s, f in enumerate(fractions) if f))
        if key not in self._built:
            pairs = [(s, m) for s in sorted(key[1]) for m in range(schedule.num_microbatches)]
            built = with_prefetch(schedule, worth_prefetching(schedule, pairs)) if pairs else schedule
            self._built[key] = (schedule, built)
        return self._built[key][1]

    def _copies(self, stages: list[StageBytes], fractions: Sequence[float]) -> tuple[list[float], list[float]]:
        bandwidth = self.profile.bandwidth
        if bandwidth is None or not any(fractions):
            return [0.0] * len(stages), [0.0] * len(stages)
        taken = [math.floor(f * _offloadable(stages, s)) for s, f in enumerate(fractions)]
        return copy_costs(taken, bandwidth)


def _offloadable(stages: Sequence[StageBytes], s: int) -> int:
    """What of a stage's activation offload can take: its saved tensors, not its output (the next one's input)."""
    out = stages[s + 1].input if s + 1 < len(stages) else 0
    return max(0, stages[s].activation - out)


def bounds(balance: Sequence[int]) -> list[tuple[int, int]]:
    ends = [sum(balance[: i + 1]) for i in range(len(balance))]
    return [(end - size, end) for end, size in zip(ends, balance)]


def stage_costs(profile: PlanProfile, balance: Sequence[int]) -> StageCosts:
    tick = 1e-9  # a stage too fast for the clock still costs something: the search needs F, B > 0
    fwd = [max(sum(profile.forward[a:b]), tick) for a, b in bounds(balance)]
    bwd = [max(sum(profile.backward[a:b]), tick) for a, b in bounds(balance)]
    return StageCosts.from_measured(fwd, bwd, [1.0] * len(balance), profile.weight_share, profile.comm)


def stage_bytes(layers: Sequence[StageBytes], balance: Sequence[int], spans: Sequence[SkipSpan]) -> list[StageBytes]:
    return [compose(layers, a, b, spans) for a, b in bounds(balance)]


def makespan(
    schedule: Schedule, costs: StageCosts, added: Sequence[float], copies: tuple[list[float], list[float]] | None = None
) -> float:
    backward = [b + e for b, e in zip(costs.backward, added)]
    prefetch, offload = copies if copies is not None else (0.0, 0.0)
    times = simulate_times(
        schedule, costs.forward, backward, costs.weight, costs.comm, prefetch=prefetch, offload=offload
    )
    return max((end for _, _, end in times.values()), default=0.0)


def propose_balances(
    profile: PlanProfile,
    stages: int,
    chunks: int,
    limit: int | None,
    shapes: Sequence[tuple[str, int]],
    optimizer: OptimizerSpec,
) -> list[tuple[int, ...]]:
    """The balances planned for time and, under a limit, for memory, for each ``(schedule, virtual stages)``.

    The memory-planned ones only propose cuts (each combination is then judged by the memory
    model), so a stage's need is estimated in closed form: its state, and 1F1B's ``K - s``
    micro-batches in flight, whole (``"never"``) or as each per-layer policy of the profile keeps
    them (each with a split backward's W records and without), or as their inputs
    (``"always"``). A policy's own cut matters where the time-planned cut fits only under more
    recompute: the first stages hold the most micro-batches, so moving layers off them can let
    a lighter policy fit.
    """
    fwd, bwd = list(profile.forward), list(profile.backward)
    found: list[tuple[int, ...]] = []

    def add(cut: Sequence[int]) -> None:
        if tuple(cut) not in found:
            found.append(tuple(cut))

    for name, virtual in shapes:
        workers = stages // virtual
        add(plan(fwd, bwd, workers, microbatches=chunks, schedule=name, virtual_stages=virtual, comm=profile.comm))
    if limit is None:
        return found
    factor = optimizer_factor(optimizer)
    # (layers' bytes, kept whole: with a split backward's W records, or as 1F1B's whole backward keeps them; or
    # as their inputs ("always")).
    # A policy inside stage recompute keeps its stages' inputs ("nested"): its rebuild holds the
    # regions' inputs and one region's working set. Policies over the same regions share layers.
    kept: dict[tuple[int, str], tuple[Sequence[StageBytes], str]] = {}
    for measured, policy in ((profile.layers, None), *((p.layers, p.setting) for p in profile.policies)):
        for held in ("nested",) if policy is not None and policy.stage == "always" else ("split", "whole"):
            kept[(id(measured), held)] = (measured, held)
    kept[(id(profile.layers), "inputs")] = (profile.layers, "inputs")
    composed: dict[tuple[int, int, int], StageBytes] = {}  # by layers and cut, for every stage index

    def stage_of(layers: Sequence[StageBytes], a: int, b: int) -> StageBytes:
        key = (id(layers), a, b)
        if key not in composed:
            composed[key] = compose(layers, a, b, profile.spans)
        return composed[key]

    for layers, held in kept.values():
        memo: dict[tuple[int, int, int], float] = {}

        def need(
            a: int,
            b: int,
            s: int,
            held: str = held,
            layers: Sequence[StageBytes] = layers,
            memo: dict[tuple[int, int, int], float] = memo,
        ) -> float:
            if (a, b, s) not in memo:
                st = stage_of(layers, a, b)
                state = st.parameters + st.trainable + factor * st.stepped
                each = st.input if held in ("inputs", "nested") else st.input + st.activation
                each += st.w_records + st.w_kept if held == "split" else 0
                # The backward's working set: a recomputed stage rebuilds a whole micro-batch's activation
                # ("inputs"), or its regions' inputs and then one region ("nested").
                working = max(st.b_transient, st.bw_transient)
                if held != "whole" and held != "split":
                    working = st.activation + (working if held == "nested" else 0)
                memo[(a, b, s)] = (state + min(stages - s, chunks) * each + working) * (1 + MARGIN)
            return memo[(a, b, s)]

        for share in _TIGHTER:  # the estimate leaves out what the model adds (buffers, stashes): cuts below it too
            try:
                with warnings.catch_warnings():  # a search cut short still proposes the best cut it found
                    warnings.filterwarnings("ignore", message="balance.plan stopped after")
                    add(plan(fwd, bwd, stages, microbatches=chunks, schedule="1f1b", memory_limit=limit * share,
                             stage_memory=need, comm=profile.comm, max_evaluations=_PROPOSAL_EVALUATIONS))  # fmt: skip
            except BalanceError:
                break
    return found


def refuse_floors(
    profile: PlanProfile, stages: int, chunks: int, limit: int, optimizer: OptimizerSpec, wgrad_batch: int, mode: str
) -> None:
    """Raise if some stage cannot fit even at its smallest (one layer; the first and last keep the ends).

    Each stage is predicted alone under 1F1B and ``mode``, the other stages holding nothing.

    Raises:
        fastpipe.balance.BalanceError: naming the stage, the least it needs and its parts.
    """
    schedule = build("1f1b", stages, chunks)
    times = simulate_times(schedule, update=1.0)
    empty = StageBytes(parameters=0, activation=0)
    n = len(profile.layers)
    for s in range(stages):
        starts = [0] if s == 0 else [n - 1] if s == stages - 1 else range(s, n - stages + s + 1)
        floors = []
        for a in starts:
            held = [empty] * stages
            held[s] = compose(profile.layers, a, a + 1, profile.spans)
            found = predict_memory(
                schedule, held, times=times, checkpoint=mode, optimizer=optimizer, wgrad_batch=wgrad_batch
            )
            floors.append((found[schedule.worker_of(s)], a))
        least, layer = min(floors, key=lambda f: f[0].total)
        if least.total * (1 + MARGIN) > limit:
            parts = ", ".join(f"{name} {format_bytes(v)}" for name, v in least.parts.items() if v)
            raise BalanceError(
                f"no balance into {stages} stages fits memory_limit={format_bytes(limit)} per device: stage {s} "
                f"needs at least {format_bytes(least.total)} (layer {layer} alone), plus {MARGIN:.0%} kept for the "
                f"prediction's error: {parts}. Raise the limit, use smaller micro-batches (more chunks), or plan "
                "more stages"
            )
