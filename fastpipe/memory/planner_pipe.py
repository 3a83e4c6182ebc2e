"""How ``Pipe`` resolves ``balance``, ``schedule``, ``checkpoint`` and ``offload``: one planner, or each alone.

With ``memory_limit=``, ``balance="auto"`` (and its ``sample=``) and at least one more of
``schedule``, ``checkpoint`` and ``offload`` left to ``"auto"``, the model is measured once on a
micro-batch of the sample (:func:`~fastpipe.memory.planner_profile.measure_plan_profile`) and
:func:`~fastpipe.memory.planner.plan_memory` chooses the "auto"s together, the settings given
held fixed; the pipe then runs the choice (``pipe.plan``). The planner considers the named
schedules only, which build for any number of micro-batches. Otherwise each "auto" resolves
alone, as before: ``balance`` here, the others at the first ``train_step``.

``checkpoint`` defaults to ``"auto"``: the least recompute that fits ``memory_limit``, or the
stage devices' capacity without one (:mod:`fastpipe.memory.recompute`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from torch import nn

from fastpipe.balance.auto import _one_microbatch, _stage_count, resolve_balance
from fastpipe.balance.planner import BalanceError
from fastpipe.memory.offload import OffloadSpec
from fastpipe.memory.optimizer import OptimizerSpec, optimizer_factor
from fastpipe.memory.planner import Plan, plan_memory
from fastpipe.memory.planner_profile import measure_plan_profile
from fastpipe.memory.sizes import parse_bytes
from fastpipe.model.partition import resolve_devices
from fastpipe.model.side_inputs import check_side_inputs
from fastpipe.runtime.wgrad import default_wgrad_batch
from fastpipe.schedule import SCHEDULES
from fastpipe.step.auto_schedule import AutoSchedule, is_auto
from fastpipe.step.microbatch import Value, check_value, tensors_of
from fastpipe.step.recompute_policy import Recompute, checkpoint_setting

__all__ = ["DEFAULT_CHECKPOINT", "PipeSettings", "resolve_settings"]


#: ``Pipe``'s ``checkpoint`` default: the least recompute that fits (:mod:`fastpipe.memory.recompute`).
DEFAULT_CHECKPOINT = "auto"


@dataclass(frozen=True)
class PipeSettings:
    """What a pipe runs: its settings with every "auto" the planner chose resolved.

    Attributes:
        balance: layers per stage.
        schedule: the schedule's name, or ``"auto"``/an :class:`AutoSchedule` left to the first step.
        virtual_stages: stages per worker.
        checkpoint: the recompute setting (``"auto"``: chosen at the first step).
        offload: the offload setting.
        plan: the planner's :class:`~fastpipe.memory.planner.Plan`; None where it did not plan.
    """

    balance: object
    schedule: str | AutoSchedule
    virtual_stages: int
    checkpoint: str | Recompute
    offload: OffloadSpec
    plan: Plan | None


def resolve_settings(
    module: nn.Sequential,
    balance: object,
    schedule: str | AutoSchedule,
    checkpoint: object,
    offload: OffloadSpec,
    *,
    devices: Sequence[Any] | None,
    sample: Value | None,
    memory_limit: int | float | str | None,
    chunks: int,
    virtual_stages: int,
    side_inputs: Mapping[str, Any] | None,
    wgrad_batch: int | None,
    optimizer: OptimizerSpec = "adam",
) -> PipeSettings:
    """``Pipe``'s settings resolved: by the planner (see the module), or the balance alone.

    ``optimizer`` is the state the planner counts per device (:func:`~fastpipe.memory.optimizer.optimizer_factor`).

    Raises:
        ValueError: a bad setting, or nothing fits the limit (naming the device and the least it needs).
        TypeError: ``balance`` or ``sample`` as :func:`~fastpipe.balance.auto.resolve_balance` refuses them.
        fastpipe.balance.BalanceError: the stage count is unknown, or there are fewer layers than stages.
    """
    optimizer_factor(optimizer)  # a bad one is refused whether or not a limit reads it
    setting = checkpoint_setting(checkpoint)
    auto_offload = isinstance(offload, str) and offload == "auto"
    autos = [is_auto(schedule), setting == "auto", auto_offload]
    if memory_limit is None or not (isinstance(balance, str) and balance == "auto") or not any(autos):
        resolved = resolve_balance(
            module,
            balance,
            devices,
            sample=sample,
            memory_limit=None if memory_limit is None or balance != "auto" else parse_bytes(memory_limit),
            side_inputs=side_inputs,
            chunks=chunks,
            schedule="zb-h1" if is_auto(schedule) else str(schedule),  # "auto" then searches on this balance
            virtual_stages=virtual_stages,
            checkpoint=setting,
            wgrad_batch=wgrad_batch,
            optimizer=optimizer,
        )
        return PipeSettings(resolved, schedule, virtual_stages, setting, offload, None)
    if sample is None:
        raise BalanceError('balance="auto" needs sample=<a mini-batch like the real ones> to profile on')
    check_value(sample, "sample")
    side = dict(side_inputs or {})
    check_side_inputs(module, side, grad=True)
    stages = _stage_count(devices)
    micro, micro_side = _one_microbatch(sample, chunks, side)
    target = resolve_devices(cast(Any, devices), stages)[0]
    fixed = setting if setting != "auto" else None
    profile = measure_plan_profile(
        module,
        micro,
        micro_side,
        device=target,
        policies=None if fixed is None else [fixed] if isinstance(fixed, Recompute) else [],
        offload=auto_offload,
    )
    found = plan_memory(
        profile,
        stages,
        chunks,
        parse_bytes(memory_limit),
        wgrad_batch=wgrad_batch if wgrad_batch is not None else default_wgrad_batch(target),
        input_grad=any(t.requires_grad for t in tensors_of(micro)),
        greedy=False,  # a named schedule builds for a short last batch too
        schedules=SCHEDULES if is_auto(schedule) else [str(schedule).lower().replace("_", "-")],
        virtual_stages=None if is_auto(schedule) else virtual_stages,
        checkpoints=None if fixed is None else [fixed],
        optimizer=optimizer,
    )
    c = found.chosen
    return PipeSettings(
        list(c.balance),
        c.name if is_auto(schedule) else schedule,
        c.virtual_stages if is_auto(schedule) else virtual_stages,
        c.checkpoint,
        (list(c.offload) if any(c.offload) else None) if auto_offload else offload,
        found,
    )
