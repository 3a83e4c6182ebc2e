"""``DistributedPipe(balance="auto")``: the memory planner, run once on the pipeline's first rank and shared.

Every rank is handed the whole model; the first rank of the pipeline group measures it on one
micro-batch of ``sample`` on its own device
(:func:`~fastpipe.memory.planner_profile.measure_plan_profile`) and
:func:`~fastpipe.memory.planner.plan_memory` chooses the balance, and the schedule and the
whole-stage recompute where those are ``"auto"``, the fastest that fits ``memory_limit`` on every
rank. One stage per rank and two per rank are planned apart (a DistributedPipe has one worker
per rank, so ``K`` ranks run ``K`` stages, or ``2K`` under ``interleaved``, ``zb-v`` and
``dualpipev``), and the faster of the two plans wins. The others receive the choice; with data
parallelism every replica then takes the first replica's, so the ranks build one pipeline.

Timings differ from rank to rank, so a plan made on each would differ too: that is why one rank
plans. A failure there (nothing fits, a bad sample) is raised on every rank with its message.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fastpipe.balance.auto import _one_microbatch
from fastpipe.balance.planner import BalanceError
from fastpipe.distributed.ranks import gather_objects
from fastpipe.memory.optimizer import OptimizerSpec
from fastpipe.memory.planner import Plan, plan_memory
from fastpipe.memory.planner_profile import measure_plan_profile
from fastpipe.memory.planner_types import Combination
from fastpipe.memory.sizes import parse_bytes
from fastpipe.model.side_inputs import check_side_inputs
from fastpipe.schedule import SCHEDULES
from fastpipe.schedule.builders import STAGES_PER_WORKER
from fastpipe.step.microbatch import Value, check_value, tensors_of
from fastpipe.step.recompute_policy import Recompute

__all__ = ["RankPlan", "check_balance_given", "plan_for_ranks"]

#: The whole-stage recompute modes a DistributedPipe runs, least recompute first.
WHOLE_STAGE = ("never", "except_last", "always")


@dataclass(frozen=True)
class RankPlan:
    """What every rank builds: the planned settings, and the planner's table.

    Attributes:
        balance: layers per stage (``K`` or ``2K`` stages for ``K`` ranks).
        schedule: the schedule's name.
        checkpoint: the recompute: a whole-stage mode, or a per-layer policy (``checkpoint="auto"``'s
            candidates are named parts and every other layer, which travel to every rank; a policy
            given stays each rank's own).
        offload: each stage's offloaded share, under ``offload="auto"`` where the planner chose some; else None.
        plan: the planner's :class:`~fastpipe.memory.planner.Plan` (``plan.table()`` shows the candidates).
    """

    balance: list[int]
    schedule: str
    checkpoint: str | Recompute
    plan: Plan
    offload: list[float] | None = None


def plan_for_ranks(
    module: nn.Sequential,
    schedule: str,
    checkpoint: str | Recompute,
    *,
    sample: Value | None,
    side_inputs: Mapping[str, Any] | None,
    memory_limit: int | float | str | None,
    chunks: int,
    device: torch.device,
    wgrad_batch: int,
    group: Any,
    dp_group: Any,
    timeout: float,
    optimizer: OptimizerSpec = "adam",
    transport: str = "tags",
    offload: bool = False,
) -> RankPlan:
    """The plan every rank of ``group`` (and of ``dp_group``) builds; see the module.

    Args:
        module: the whole model, on every rank.
        schedule: a name of :data:`fastpipe.schedule.SCHEDULES`, or ``"auto"`` (the planner's choice).
        checkpoint: a whole-stage mode or a per-layer policy, held fixed; or ``"auto"``: the fastest
            recompute that fits, whole-stage or per-layer (:func:`~fastpipe.step.recompute_policy.auto_candidates`).
        sample: a mini-batch like the real ones, read on the pipeline's first rank.
        side_inputs: the sample's side inputs, by name.
        memory_limit: bytes per rank (or ``"24GiB"``); None: the fastest, nothing recomputed.
        chunks: micro-batches per mini-batch.
        device: where this rank's stages run (the first rank measures there).
        wgrad_batch: micro-batches per batched ``W`` on ``device``.
        group: the pipeline group; its first rank plans.
        dp_group: the data-parallel group, or None.
        timeout: how long a rank waits for a peer that never arrives (gloo groups).
        optimizer: the optimizer state a device holds (:func:`~fastpipe.memory.optimizer.optimizer_factor`).
        transport: ``"tags"`` or ``"ordered"``, the pipe's, whose receive buffers the planner counts.
        offload: whether offload is on offer (``offload="auto"``); priced from the first rank's measured
            copy bandwidth, so nothing is offloaded where that rank is a CPU.

    Raises:
        ValueError: nothing fits the limit (the planner's message: the fullest device and what it holds),
            or ``schedule``/``checkpoint`` is not one the planner can take.
        fastpipe.balance.BalanceError: no ``sample`` on the first rank, or fewer layers than stages.
    """
    ranks = dist.get_world_size(group)
    outcome: tuple[str, Any] = ("none", None)
    failure: Exception | None = None
    if dist.get_rank(group) == 0:
        try:
            args = (module, schedule, checkpoint, sample, side_inputs, memory_limit, chunks, ranks, device)
            outcome = ("plan", _plan(*args, wgrad_batch, optimizer, transport, offload))
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it, or the others would wait
            failure = exc
            # The class travels only where it is one the other ranks can rebuild from a message.
            kind = type(exc) if type(exc) in (ValueError, TypeError, BalanceError) else RuntimeError
            outcome = ("error", (kind, f"{type(exc).__name__} on the planning rank: {exc}"))
    outcome = gather_objects(outcome, group, "sharing the pipeline's plan", timeout)[0]
    if dp_group is not None:  # every replica builds the first replica's pipeline
        outcome = gather_objects(outcome, dp_group, "sharing the pipeline's plan over the replicas", timeout)[0]
    what, found = outcome
    if failure is not None:
        raise failure
    if what == "error":
        kind, message = found
        raise kind(message)
    assert isinstance(found, RankPlan)
    return found


def _plan(
    module: nn.Sequential,
    schedule: str,
    checkpoint: str | Recompute,
    sample: Value | None,
    side_inputs: Mapping[str, Any] | None,
    memory_limit: int | float | str | None,
    chunks: int,
    ranks: int,
    device: torch.device,
    wgrad_batch: int,
    optimizer: OptimizerSpec,
    transport: str,
    offload: bool,
) -> RankPlan:
    if sample is None:
        raise BalanceError(
            'fastpipe: DistributedPipe(balance="auto") needs sample=<a mini-batch like the real ones> on the '
            "pipeline's first rank, to measure the model on"
        )
    if schedule != "auto" and schedule not in SCHEDULES:
        raise ValueError(f"fastpipe: schedule={schedule!r} is not one of {SCHEDULES} or 'auto'")
    if not isinstance(checkpoint, Recompute) and checkpoint != "auto" and checkpoint not in WHOLE_STAGE:
        raise ValueError(f"fastpipe: checkpoint={checkpoint!r} is not one of {WHOLE_STAGE}, 'auto' or a policy")
    check_value(sample, "sample")
    side = dict(side_inputs or {})
    check_side_inputs(module, side, grad=True)
    micro, micro_side = _one_microbatch(sample, chunks, side)
    policies = None if checkpoint == "auto" else [checkpoint] if isinstance(checkpoint, Recompute) else []
    profile = measure_plan_profile(module, micro, micro_side, device=device, policies=policies, offload=offload)
    limit = None if memory_limit is None else parse_bytes(memory_limit)
    plans: list[Plan] = []
    refusals: list[Exception] = []
    for per_rank, names in _shapes(schedule).items():
        try:
            plans.append(
                plan_memory(
                    profile,
                    ranks * per_rank,
                    chunks,
                    limit,
                    wgrad_batch=wgrad_batch,
                    optimizer=optimizer,
                    input_grad=any(t.requires_grad for t in tensors_of(micro)),
                    greedy=False,  # a DistributedPipe runs named schedules
                    schedules=names,
                    virtual_stages=per_rank,
                    checkpoints=None if checkpoint == "auto" else [checkpoint],
                    transport=transport,
                )
            )
        except (ValueError, BalanceError) as exc:
            refusals.append(exc)
    if not plans:
        raise refusals[0]
    best = min(plans, key=lambda p: p.chosen.time)
    c = best.chosen
    shares = list(c.offload) if any(c.offload) else None
    if isinstance(checkpoint, Recompute):  # the caller's own policy, which may not pickle: each rank keeps its own
        best = _named(best)
        c = best.chosen
    return RankPlan(list(c.balance), c.name, c.checkpoint, best, shares)


def _named(plan: Plan) -> Plan:
    """``plan`` with each per-layer policy replaced by its name, for the table."""

    def named(c: Combination) -> Combination:
        return dataclasses.replace(c, checkpoint=str(c.checkpoint)) if isinstance(c.checkpoint, Recompute) else c

    return dataclasses.replace(plan, chosen=named(plan.chosen), considered=tuple(named(c) for c in plan.considered))


def _shapes(schedule: str) -> dict[int, list[str]]:
    """The schedules to plan, by stages per rank: ``schedule`` alone, or every named one for ``"auto"``."""
    names = list(SCHEDULES) if schedule == "auto" else [schedule]
    shapes: dict[int, list[str]] = {}
    for name in names:
        shapes.setdefault(STAGES_PER_WORKER.get(name, 2 if name == "interleaved" else 1), []).append(name)
    return shapes


def check_balance_given(balance: Sequence[int] | str | None, module: nn.Sequential | None) -> None:
    """A DistributedPipe's ``balance``: layers per stage, or ``"auto"`` with the whole model.

    Raises:
        TypeError: no balance, or a string other than ``"auto"``, or ``"auto"`` without the whole model.
    """
    if balance is None or (isinstance(balance, str) and balance != "auto"):
        raise TypeError(
            f"fastpipe: DistributedPipe needs balance=, the number of layers per stage (one stage per pipeline "
            f"rank, a multiple of the ranks with schedule='interleaved', twice with 'zb-v'), or 'auto' with "
            f"sample=; got {balance!r}"
        )
    if balance == "auto" and module is None:
        raise TypeError(
            'fastpipe: balance="auto" plans on the whole model, which from_stage_builder does not have: pass '
            "DistributedPipe(model, balance='auto', sample=...) or a balance of layers per stage"
        )
