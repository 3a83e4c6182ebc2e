"""``Pipe(..., balance="auto")``: profile one micro-batch where the stages will run, then plan.

:func:`auto_balance` ties the profiler (:mod:`fastpipe.balance.profile`) to the planner
(:mod:`fastpipe.balance.planner`): it counts the stages from ``devices``, cuts one micro-batch (and its side
inputs) from the sample, and plans with the profile's noise as the planner's tolerance. With a
``memory_limit`` in device bytes, a stage fits where its device's predicted peak does
(:mod:`fastpipe.balance.device_need`: parameters, gradients, optimizer state, activations in flight
and W records, by the memory model ``Pipe(memory_limit=)`` checks each step with). Tied layers (a layer
used twice, a shared weight) are planned like any others: ``Pipe`` gives a reader stage its own copy of
the tied weight.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn

from fastpipe.balance._untouched import state_kept
from fastpipe.balance.device_need import StageNeed, layer_bytes
from fastpipe.balance.planner import BalanceError, plan
from fastpipe.balance.profile import MEASURED_TOLERANCE, Timer, profile_layers
from fastpipe.memory.limit import MARGIN, over_limit, refusal
from fastpipe.memory.model import OptimizerSpec
from fastpipe.memory.sizes import parse_bytes
from fastpipe.model.partition import resolve_devices
from fastpipe.model.side_inputs import broadcast, check_side_inputs, split_side_inputs
from fastpipe.model.skip_memory import measure_skips
from fastpipe.model.skips import has_skips
from fastpipe.runtime.wgrad import default_wgrad_batch
from fastpipe.schedule import Schedule, ScheduleError, build
from fastpipe.step.microbatch import Value, batch_size, check_value, replace_tensors, tensors_of

__all__ = ["auto_balance", "plan_within", "resolve_balance"]

# Re-plans of a worker of several stages whose whole device is over the limit.
_SHRINKS = 5


def auto_balance(
    module: nn.Sequential,
    devices: Sequence[object] | None,
    sample: object,
    *,
    chunks: int,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    memory_limit: int | float | str | None = None,
    checkpoint: object = "never",
    optimizer: OptimizerSpec = "adam",
    wgrad_batch: int | None = None,
    repeats: int = 5,
    side_inputs: Mapping[str, Any] | None = None,
    tolerance: float = MEASURED_TOLERANCE,
    timer: Timer | None = None,
) -> list[int]:
    """The balance behind ``Pipe(..., balance="auto")``.

    Profiles one micro-batch of ``sample`` (its first ``ceil(batch / chunks)`` rows, and the side inputs
    split to match, as ``Pipe`` splits them) and returns :func:`plan`'s balance for ``schedule``, with one
    stage per entry of ``devices`` (``None``: one per visible GPU). Plans whose simulated time is within
    ``tolerance`` of the fastest tie, and the most even of them wins, so reruns give the same plan.

    With ``memory_limit`` (bytes per device), the layers are also measured for memory on the micro-batch
    (:func:`~fastpipe.balance.device_need.layer_bytes`), and only balances whose every device's predicted
    peak, plus the 5% margin the pipe keeps, fits are planned (:class:`~fastpipe.balance.device_need.StageNeed`).

    Args:
        module: the model.
        devices: one entry per stage.
        sample: a mini-batch like the real ones: a tensor, or a tuple whose tensors share dim 0.
        chunks: micro-batches per mini-batch.
        schedule: the schedule to plan for.
        virtual_stages: stages per worker (``interleaved``).
        memory_limit: bytes per device, an int or a size such as ``"24GiB"``.
        checkpoint: the pipe's checkpoint mode, which the memory model counts.
        optimizer: the optimizer whose state a device holds (Adam's two moments by default).
        wgrad_batch: micro-batches per batched ``W``, the pipe's (None: the default of the stages' device).
        repeats: timed profiling passes (each layer's time is its fastest).
        side_inputs: the side inputs of ``sample``'s mini-batch, by name, as ``pipe(x, **side_inputs)``
            takes them.
        tolerance: the relative margin of simulated time within which plans tie.
        timer: the profiler's clock, in seconds (``None``: the wall clock; see :func:`profile_layers`).

    Raises:
        BalanceError: when the stage count is unknown, or no partition fits (naming the stage that
            needs the most at its least, and what it holds).
        TypeError: when ``sample`` is neither a tensor nor a tuple holding one.
        ValueError: a ``memory_limit`` that is not a size.
    """
    if sample is None:
        raise BalanceError('balance="auto" needs sample=<a mini-batch like the real ones> to profile on')
    limit = None if memory_limit is None else parse_bytes(memory_limit)
    stages = _stage_count(devices)
    if len(module) < stages:
        raise BalanceError(
            f"{len(module)} layers cannot fill {stages} stages (each holds at least one layer); use at most "
            f"{len(module)} devices, or split the model into more layers"
        )
    if stages % virtual_stages:
        raise BalanceError(
            f"{stages} stages do not split into workers of virtual_stages={virtual_stages}; give a number of "
            f"devices that is a multiple of {virtual_stages}"
        )
    check_value(sample, "sample")
    value = cast(Value, sample)
    side = side_inputs or {}
    check_side_inputs(module, side, grad=True)  # names first: a wrong name is the likelier mistake
    micro, micro_side = _one_microbatch(value, chunks, side)
    # Measured where the stages will run (the first stage's device; the planner takes the
    # stages as alike), not wherever the layers sit before the Pipe moves them.
    target = resolve_devices(cast(Any, devices), stages)[0]
    profile = profile_layers(module, micro, repeats=repeats, on=target, side_inputs=micro_side, timer=timer)
    workers = stages // virtual_stages
    if limit is None:
        return plan(
            profile.forward,
            profile.backward,
            workers,
            microbatches=chunks,
            schedule=schedule,
            virtual_stages=virtual_stages,
            tolerance=tolerance,
        )
    spans = []
    if has_skips(module):
        with state_kept(module, None):  # its training-mode forward must leave no trace either
            spans = measure_skips(module, micro, **micro_side)
    need = StageNeed(
        layer_bytes(module, micro, micro_side),
        _schedule(schedule, workers, chunks, virtual_stages),
        checkpoint=checkpoint,
        optimizer=optimizer,
        wgrad_batch=wgrad_batch if wgrad_batch is not None else default_wgrad_batch(target),
        spans=spans,
    )
    return plan_within(profile.forward, profile.backward, need, limit, schedule=schedule, tolerance=tolerance)


def plan_within(
    costs_fwd: Sequence[float],
    costs_bwd: Sequence[float],
    need: StageNeed,
    limit: int,
    *,
    schedule: str,
    tolerance: float = 0.0,
) -> list[int]:
    """:func:`plan`'s balance among those whose every device's predicted peak fits ``limit`` bytes.

    Each stage is planned by its own need; a worker that holds several stages (interleaved, a V) is
    then checked whole, and while one is over, every stage's budget shrinks by its excess.

    Args:
        costs_fwd: forward cost of each layer for one micro-batch.
        costs_bwd: backward cost of each layer.
        need: the stages' device bytes (its schedule is the one planned for, named ``schedule``).
        limit: bytes per device.
        schedule: the schedule's name.
        tolerance: as for :func:`plan`.

    Raises:
        BalanceError: no balance fits, naming the stage that needs the most at its least and what it holds.
    """
    sched = need.schedule
    virtual = sched.num_stages // sched.num_workers
    budget = float(limit)
    closest = None
    for _ in range(_SHRINKS):
        try:
            balance = plan(
                costs_fwd,
                costs_bwd,
                sched.num_workers,
                microbatches=sched.num_microbatches,
                schedule=schedule,
                memory_limit=budget,
                stage_memory=need,
                virtual_stages=virtual,
                tolerance=tolerance,
            )
        except BalanceError:
            if closest is None:
                raise need.refusal(limit) from None
            break
        closest = over_limit(need.devices(balance), limit)
        if closest is None:
            return balance
        budget *= limit / (closest.total * (1 + MARGIN))
    assert closest is not None
    raise BalanceError(
        f"no balance keeps every device of {sched.num_workers} workers with {virtual} stages each within "
        f"memory_limit; the closest: {refusal(closest, limit).removeprefix('fastpipe: ')}"
    )


def _one_microbatch(sample: Value, chunks: int, side: Mapping[str, Any]) -> tuple[Value, dict[str, Any]]:
    """The first micro-batch of ``sample`` and its side inputs, as ``Pipe`` would cut them."""
    if isinstance(sample, torch.Tensor) and sample.dim() == 0:
        return sample, {k: broadcast(v) for k, v in split_side_inputs(side, 1, 1, 1)[0].items()}
    batch = batch_size(sample, "sample")
    rows = max(1, math.ceil(batch / chunks))
    micro = replace_tensors(sample, [t[:rows] for t in tensors_of(sample)])
    first = split_side_inputs(side, batch, chunks, math.ceil(batch / rows))[0]
    # Already one micro-batch's: the profiler hands them whole to every layer.
    return micro, {k: broadcast(v) for k, v in first.items()}


def _stage_count(devices: Sequence[object] | None) -> int:
    """One stage per entry of ``devices``; ``None``: one per visible GPU."""
    if devices is not None:
        return len(devices)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise BalanceError(
            "balance=\"auto\" on a host without GPUs needs devices=['cpu'] * K to say how many stages to plan"
        )
    return count


def _schedule(schedule: str, workers: int, chunks: int, virtual_stages: int) -> Schedule:
    try:
        return build(schedule, workers, chunks, virtual_stages=virtual_stages)
    except ScheduleError as exc:
        raise BalanceError(str(exc)) from exc


def resolve_balance(
    module: nn.Sequential,
    balance: object,
    devices: Sequence[object] | None,
    *,
    sample: object,
    memory_limit: int | float | str | None,
    chunks: int,
    schedule: str,
    virtual_stages: int,
    side_inputs: Mapping[str, Any] | None = None,
    checkpoint: object = "never",
    wgrad_batch: int | None = None,
    optimizer: OptimizerSpec = "adam",
) -> object:
    """What ``Pipe``'s ``balance=`` asks for: a list as given (``check_balance`` checks it) or the one "auto" plans.

    ``side_inputs`` are the sample's side inputs (``Pipe``'s ``sample_side_inputs=``), by name, for the
    layers that declare them; ``checkpoint``, ``wgrad_batch`` and ``optimizer`` the pipe's, which its
    memory counts under ``memory_limit``.

    Raises:
        TypeError: ``balance`` is missing or another string, or ``sample``/``memory_limit``/
            ``sample_side_inputs`` come without ``balance="auto"``, which they are for.
    """
    if balance is None:
        raise TypeError(
            f"fastpipe: Pipe needs balance=, the number of layers per stage summing to len(module) = "
            f"{len(module)} (e.g. balance=[{(len(module) + 1) // 2}, {len(module) // 2}] for two stages), "
            "or balance='auto' to plan it from a sample mini-batch (sample=x)"
        )
    if not isinstance(balance, str):
        given = (("sample", sample), ("memory_limit", memory_limit), ("sample_side_inputs", side_inputs))
        unused = [k for k, v in given if v is not None]
        if unused:
            raise TypeError(
                f"fastpipe: {' and '.join(unused)} only apply to balance='auto' (they plan the "
                "balance); drop them, or pass balance='auto'"
            )
        return balance
    if balance != "auto":
        raise TypeError(f"fastpipe: balance must be a list of layer counts or 'auto', got {balance!r}")
    return auto_balance(
        module,
        devices,
        sample,
        chunks=chunks,
        schedule=schedule,
        virtual_stages=virtual_stages,
        memory_limit=memory_limit,
        side_inputs=side_inputs,
        checkpoint=checkpoint,
        wgrad_batch=wgrad_batch,
        optimizer=optimizer,
    )
