"""The planner: balance, schedule, recompute and offload chosen together, the fastest that fits.

Each "auto" alone fixes the others first: ``balance="auto"`` plans for one schedule,
``schedule="auto"`` searches on one balance, ``checkpoint="auto"`` and ``offload="auto"`` take
the least that fits one schedule. :func:`plan_memory` searches their product instead, from one
measured profile (:class:`PlanProfile`: per-layer seconds and bytes)::

    balances (for time; for memory)  x  schedules (the search's)  x  recompute  x  offload
         │ per (balance, schedule): the simulated step time, a lower bound, fastest first
         ▼
    recompute: never ─▶ per-layer policies ─▶ except_last ─▶ always ─▶ regions inside always
         │ the first whose predicted peak fits ends the pair: more only costs time
         ▼ (a device still over, with a copy bandwidth) offload: per device the least eighth that fits

A combination's time is the simulator's on the measured costs, its recompute added to each
recomputed backward and its copies priced from the measured bandwidth
(:func:`~fastpipe.memory.offload_bytes.copy_costs`); its peak is
:func:`~fastpipe.memory.model.predict_memory`'s on unit costs, as the step's guard predicts it, so a
combination fits when every device's prediction plus :data:`~fastpipe.memory.limit.MARGIN` is
within the limit. Recompute and offload only add time, so a pair whose bare time is no faster than
the best fitting combination found is not evaluated (counted in :attr:`Plan.pruned`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from fastpipe.memory.limit import refusal
from fastpipe.memory.model import OptimizerSpec, StageBytes
from fastpipe.memory.planner_judge import (
    Judge,
    bounds,
    makespan,
    propose_balances,
    refuse_floors,
    stage_bytes,
    stage_costs,
)
from fastpipe.memory.planner_types import Combination, Plan, PlanProfile, RecomputeOption
from fastpipe.schedule import SCHEDULES
from fastpipe.schedule.search import Candidate, StageCosts, search
from fastpipe.step.recompute_policy import Recompute

__all__ = ["Combination", "Plan", "PlanProfile", "RecomputeOption", "plan_memory"]

_REL_TOL = 1e-9
# The schedules whose time- and memory-planned balances the planner starts from.
_SHAPES = (("zb-h1", 1), ("1f1b", 1))


def plan_memory(
    profile: PlanProfile,
    stages: int,
    chunks: int,
    memory_limit: int | None,
    *,
    optimizer: OptimizerSpec = "adam",
    wgrad_batch: int = 1,
    input_grad: bool = False,
    greedy: bool = True,
    balances: Sequence[Sequence[int]] | None = None,
    schedules: Sequence[str] = SCHEDULES,
    virtual_stages: int | None = None,
    checkpoints: Sequence[str | Recompute] | None = None,
    transport: str = "local",
) -> Plan:
    """The fastest combination of balance, schedule, recompute and offload whose every device fits.

    Args:
        profile: the layers' measured (or given) costs and bytes.
        stages: pipeline stages K (a schedule of ``v`` stages per worker runs them on K/v devices).
        chunks: micro-batches per step.
        memory_limit: bytes per device; None: every combination fits (the fastest, with nothing recomputed).
        optimizer: the optimizer whose state a device holds (:func:`~fastpipe.memory.model.optimizer_factor`).
        wgrad_batch: micro-batches per batched ``W``, the pipe's.
        input_grad: whether the pipe's input needs a gradient.
        greedy: also consider the greedy zero-bubble scheduler (a schedule built for these costs only).
        balances: the balances to consider; None: those planned for time (for ``zb-h1`` and ``1f1b``, or the
            one schedule given) and, under a limit, for memory (every stage within it, estimated under
            ``"never"`` and under ``"always"``).
        schedules: the named schedules to consider.
        virtual_stages: consider only schedules of this many stages per worker; None: every number.
        checkpoints: the recompute settings to consider (whole-stage modes, and policies of
            ``profile.policies``); None: all of them.
        transport: how values reach the stages (:data:`~fastpipe.memory.receive_buffers.TRANSPORTS`):
            ``"local"`` for a :class:`~fastpipe.Pipe`; a ``DistributedPipe``'s receive buffers count too.

    Raises:
        ValueError: nothing fits; names the fullest device of the leanest combination, its stages and
            what it holds, by part.
        fastpipe.balance.BalanceError: a stage cannot fit even at one layer (naming the stage and the least
            it needs), or fewer layers than stages.
    """
    if stages < 1 or chunks < 1:
        raise ValueError(f"fastpipe: the planner needs stages >= 1 and chunks >= 1, got {stages}, {chunks}")
    shapes = [(schedules[0], virtual_stages)] if len(schedules) == 1 and virtual_stages else _SHAPES
    cuts = (
        [tuple(b) for b in balances]
        if balances is not None
        else propose_balances(profile, stages, chunks, memory_limit, shapes, optimizer)
    )
    options = _options(profile, chunks)
    if checkpoints is not None:
        unknown = [c for c in checkpoints if all(c != o[0] for o in options)]
        if unknown:
            offered = ", ".join(str(o[0]) for o in options)
            raise ValueError(f"fastpipe: the profile does not price checkpoint {unknown}; it offers {offered}")
        options = [o for o in options if o[0] in checkpoints]
    pairs: list[tuple[float, tuple[int, ...], Candidate, StageCosts]] = []
    for balance in cuts:
        costs, never = stage_costs(profile, balance), stage_bytes(profile.layers, balance, profile.spans)
        records = [float(st.w_records + st.w_kept) for st in never]
        found = search(
            costs, stages, chunks, None, schedules=schedules, greedy=greedy, w_records=records, wgrad_batch=wgrad_batch
        )
        ran = [c for c in found.candidates if c.schedule is not None]
        if virtual_stages is not None:
            ran = [c for c in ran if c.virtual_stages == virtual_stages]
        pairs += [(c.time, balance, c, costs) for c in ran]
    pairs.sort(key=lambda p: p[0])
    judge = Judge(profile, memory_limit, optimizer, wgrad_batch, input_grad, transport)
    considered: list[Combination] = []
    best, pruned = math.inf, 0
    for bare, balance, candidate, costs in pairs:
        if bare > best * (1 + _REL_TOL):
            pruned += len(options)
            continue
        for setting, layers, extra in options:
            added = [sum(extra[a:b]) for a, b in bounds(balance)]
            time = makespan(candidate.schedule, costs, added)  # type: ignore[arg-type]
            if time > best * (1 + _REL_TOL):
                pruned += 1
                continue
            found_one = judge(balance, candidate, costs, setting, layers, added)
            considered.append(found_one)
            if found_one.fits:
                best = min(best, found_one.time)
                break
    if memory_limit is not None and not any(c.fits for c in considered):
        leanest = next((o[0] for o in reversed(options) if isinstance(o[0], str)), "never")
        refuse_floors(profile, stages, chunks, memory_limit, optimizer, wgrad_batch, str(leanest))
    return _choose(considered, pruned, memory_limit, [o[0] for o in options])


def _options(profile: PlanProfile, chunks: int) -> list[tuple[str | Recompute, tuple[StageBytes, ...], list[float]]]:
    """The recompute settings, least time added first, with each layer's bytes and recompute seconds per micro-batch.

    ``"except_last"`` recomputes all micro-batches but the last: the simulator takes one cost per
    stage, so its backward carries the forward's ``(M - 1) / M`` share. A policy's layers are
    measured with its regions recomputed (the bytes a micro-batch keeps, and what a backward
    rebuilds); one inside stage recompute keeps only the stage's input, as ``"always"``.
    """
    forward = list(profile.forward)
    found: list[tuple[str | Recompute, tuple[StageBytes, ...], list[float]]] = [
        ("never", profile.layers, [0.0] * len(forward))
    ]
    for p in profile.policies:  # one inside stage recompute runs the whole forward again first
        again = forward if p.setting.stage == "always" else [0.0] * len(forward)
        found.append((p.setting, p.layers, [a + b for a, b in zip(again, p.seconds)]))
    found.append(("except_last", profile.layers, [f * (chunks - 1) / chunks for f in forward]))
    found.append(("always", profile.layers, forward))
    # The first that fits ends a (balance, schedule), so they go by the time they add (a stable sort).
    return sorted(found, key=lambda o: sum(o[2]))


def _choose(considered: list[Combination], pruned: int, limit: int | None, settings: Sequence[str | Recompute]) -> Plan:
    """The fastest that fits; ties go to less recompute, less offload, then the lower peak."""
    considered.sort(key=lambda c: c.time)
    fitting = [c for c in considered if c.fits]
    if not fitting:
        leanest = min(considered, key=lambda c: c.peak)
        worst = max(leanest.devices, key=lambda d: d.total)
        assert limit is not None
        raise ValueError(
            f"{refusal(worst, limit)}. The planner tried {len(considered)} combinations of balance, schedule, "
            f"recompute and offload; the leanest is balance {list(leanest.balance)}, {leanest.schedule}, "
            f"checkpoint={leanest.checkpoint}, offload {_shown(leanest.offload)}"
        )
    fastest = fitting[0].time
    tied = [c for c in fitting if c.time <= fastest * (1 + _REL_TOL)]
    chosen = min(tied, key=lambda c: (list(settings).index(c.checkpoint), sum(c.offload), c.peak))
    return Plan(chosen, tuple(considered), pruned, limit)


def _shown(fractions: Sequence[float]) -> str:
    return "none" if not any(fractions) else ", ".join(f"{f:g}" for f in fractions)
