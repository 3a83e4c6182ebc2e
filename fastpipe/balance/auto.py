"""``Pipe(..., balance="auto")``: profile one micro-batch where the stages will run, then plan.

:func:`auto_balance` ties the profiler (:mod:`fastpipe.balance.profile`) to the planner
(:mod:`fastpipe.balance.planner`): it counts the stages from ``devices``, cuts one micro-batch (and its side
inputs) from the sample, turns activation bytes into per-layer memory for the schedule's in-flight
micro-batches, and plans with the profile's noise as the planner's tolerance. Tied layers (a layer used
twice, a shared weight) are planned like any others: ``Pipe`` gives a reader stage its own copy of the
tied weight.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn

from fastpipe.balance._untouched import state_kept
from fastpipe.balance.planner import BalanceError, plan
from fastpipe.balance.profile import MEASURED_TOLERANCE, LayerProfile, Timer, profile_layers
from fastpipe.model.partition import resolve_devices
from fastpipe.model.side_inputs import broadcast, check_side_inputs, split_side_inputs
from fastpipe.model.skip_memory import measure_skips
from fastpipe.model.skips import has_skips
from fastpipe.schedule import ScheduleError, build, simulate
from fastpipe.step.microbatch import Value, batch_size, check_value, replace_tensors, tensors_of

__all__ = ["auto_balance", "resolve_balance"]


def auto_balance(
    module: nn.Sequential,
    devices: Sequence[object] | None,
    sample: object,
    *,
    chunks: int,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    memory_limit: float | None = None,
    param_scale: float = 4.0,
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

    With ``memory_limit``, a layer needs ``activation_bytes x in_flight + param_scale x parameter_bytes``,
    where ``in_flight`` is the schedule's largest number of (stage, micro-batch) activations alive on one
    worker (a safe upper bound for any one stage) and ``param_scale`` counts parameter, gradient and
    optimizer state (4 for Adam).

    Args:
        module: the model.
        devices: one entry per stage.
        sample: a mini-batch like the real ones: a tensor, or a tuple whose tensors share dim 0.
        chunks: micro-batches per mini-batch.
        schedule: the schedule to plan for.
        virtual_stages: stages per worker (``interleaved``).
        memory_limit: the most bytes one stage may need.
        param_scale: parameter, gradient and optimizer copies per parameter byte.
        repeats: timed profiling passes (each layer's time is its fastest).
        side_inputs: the side inputs of ``sample``'s mini-batch, by name, as ``pipe(x, **side_inputs)``
            takes them.
        tolerance: the relative margin of simulated time within which plans tie.
        timer: the profiler's clock, in seconds (``None``: the wall clock; see :func:`profile_layers`).

    Raises:
        BalanceError: when the stage count is unknown, or no partition fits.
        TypeError: when ``sample`` is neither a tensor nor a tuple holding one.
    """
    if sample is None:
        raise BalanceError('balance="auto" needs sample=<a mini-batch like the real ones> to profile on')
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
    memory = None
    if memory_limit is not None:
        memory = _layer_memory(profile, schedule, workers, chunks, virtual_stages, param_scale)
        if has_skips(module):  # a skip is held by its stash's and its pop's stage, per micro-batch in flight
            in_flight = _in_flight(schedule, workers, chunks, virtual_stages)
            with state_kept(module, None):  # its training-mode forward must leave no trace either
                spans = measure_skips(module, micro, **micro_side)
            for span in spans:
                for layer in {span.producer, span.consumer}:
                    memory[layer] += span.nbytes * in_flight
    return plan(
        profile.forward,
        profile.backward,
        workers,
        microbatches=chunks,
        schedule=schedule,
        memory=memory,
        memory_limit=memory_limit,
        virtual_stages=virtual_stages,
        tolerance=tolerance,
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


def _in_flight(schedule: str, workers: int, chunks: int, virtual_stages: int) -> int:
    """The schedule's largest number of (stage, micro-batch) activations alive on one worker."""
    try:
        sched = build(schedule, workers, chunks, virtual_stages=virtual_stages)
    except ScheduleError as exc:
        raise BalanceError(str(exc)) from exc
    return int(max(simulate(sched).peak_activations))


def _layer_memory(
    profile: LayerProfile, schedule: str, workers: int, chunks: int, virtual_stages: int, param_scale: float
) -> list[float]:
    """Bytes each layer needs: its activations for the schedule's in-flight micro-batches, plus its state."""
    in_flight = _in_flight(schedule, workers, chunks, virtual_stages)
    return [a * in_flight + param_scale * p for a, p in zip(profile.activation_bytes, profile.parameter_bytes)]


def resolve_balance(
    module: nn.Sequential,
    balance: object,
    devices: Sequence[object] | None,
    *,
    sample: object,
    memory_limit: float | None,
    chunks: int,
    schedule: str,
    virtual_stages: int,
    side_inputs: Mapping[str, Any] | None = None,
) -> object:
    """What ``Pipe``'s ``balance=`` asks for: a list as given (``check_balance`` checks it) or the one "auto" plans.

    ``side_inputs`` are the sample's side inputs (``Pipe``'s ``sample_side_inputs=``), by name, for the
    layers that declare them.

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
    )
