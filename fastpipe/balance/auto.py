"""``Pipe(..., balance="auto")``: profile one micro-batch where the stages will run, then plan.

:func:`auto_balance` ties the profiler (:mod:`fastpipe.balance.profile`) to the planner
(:mod:`fastpipe.balance.planner`): it counts the stages from ``devices``, keeps tied layers in one block,
turns activation bytes into per-layer memory for the schedule's in-flight micro-batches, and maps the
planned blocks back to layers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn

from fastpipe.balance.planner import BalanceError, plan
from fastpipe.balance.profile import LayerProfile, profile_layers
from fastpipe.partition import resolve_devices, tied_blocks, widest_tie
from fastpipe.schedule import ScheduleError, build, simulate

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
    repeats: int = 3,
) -> list[int]:
    """The balance behind ``Pipe(..., balance="auto")``.

    Profiles one micro-batch of ``sample`` (its first ``ceil(batch / chunks)`` rows) and returns
    :func:`plan`'s balance for ``schedule``, with one stage per entry of ``devices`` (``None``: one per
    visible GPU).

    With ``memory_limit``, a layer needs ``activation_bytes x in_flight + param_scale x parameter_bytes``,
    where ``in_flight`` is the schedule's largest number of (stage, micro-batch) activations alive on one
    worker (a safe upper bound for any one stage) and ``param_scale`` counts parameter, gradient and
    optimizer state (4 for Adam).

    Raises:
        BalanceError: when the stage count is unknown, or no partition fits.
        TypeError: when ``sample`` is not a tensor.
    """
    if sample is None:
        raise BalanceError('balance="auto" needs sample=<a mini-batch like the real ones> to profile on')
    stages = _stage_count(devices)
    # Tied layers (a layer used twice, shared parameters) are planned as one block, so the
    # balance never splits them across stages (which Pipe refuses).
    blocks = tied_blocks(module)
    if len(blocks) < stages:
        tie = widest_tie(module)
        if len(blocks) == len(module) or tie is None:
            raise BalanceError(f"{len(module)} layers cannot fill {stages} stages; use at most {len(module)} devices")
        name, first, last = tie
        raise BalanceError(
            f"{len(module)} layers cannot fill {stages} stages: '{name}' is used by layers {first} and {last} (a "
            f"tied weight), and stages are contiguous, so layers {first}..{last} must share one stage, which leaves "
            f"{len(blocks)} blocks to place. Use at most {len(blocks)} devices, or untie the weight (give each use "
            "its own copy)"
        )
    if stages % virtual_stages:
        raise BalanceError(f"{stages} stages do not split into workers of virtual_stages={virtual_stages}")
    if not isinstance(sample, torch.Tensor):
        raise TypeError(f'balance="auto" needs sample= as a Tensor (a mini-batch), got {type(sample).__name__}')
    rows = max(1, math.ceil(sample.shape[0] / chunks)) if sample.dim() else 1
    # Measured where the stages will run (the first stage's device; the planner takes the
    # stages as alike), not wherever the layers sit before the Pipe moves them.
    target = resolve_devices(cast(Any, devices), stages)[0]
    profile = profile_layers(module, sample[:rows] if sample.dim() else sample, repeats=repeats, on=target)
    workers = stages // virtual_stages
    memory = None
    if memory_limit is not None:
        memory = _layer_memory(profile, schedule, workers, chunks, virtual_stages, param_scale)
    bounds = [0]
    for size in blocks:
        bounds.append(bounds[-1] + size)

    def per_block(values: Sequence[float]) -> list[float]:
        return [float(sum(values[a:b])) for a, b in zip(bounds, bounds[1:])]

    balance = plan(
        per_block(profile.forward),
        per_block(profile.backward),
        workers,
        microbatches=chunks,
        schedule=schedule,
        memory=None if memory is None else per_block(memory),
        memory_limit=memory_limit,
        virtual_stages=virtual_stages,
    )
    out, block = [], 0
    for count in balance:  # blocks per stage back to layers per stage
        out.append(sum(blocks[block : block + count]))
        block += count
    return out


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


def _layer_memory(
    profile: LayerProfile, schedule: str, workers: int, chunks: int, virtual_stages: int, param_scale: float
) -> list[float]:
    """Bytes each layer needs: its activations for the schedule's in-flight micro-batches, plus its state."""
    try:
        sched = build(schedule, workers, chunks, virtual_stages=virtual_stages)
    except ScheduleError as exc:
        raise BalanceError(str(exc)) from exc
    in_flight = max(simulate(sched).peak_activations)
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
) -> object:
    """What ``Pipe``'s ``balance=`` asks for: a list as given (``check_balance`` checks it) or the one "auto" plans.

    Raises:
        TypeError: ``balance`` is missing or another string, or ``sample``/``memory_limit`` come
            without ``balance="auto"``, which they are for.
    """
    if balance is None:
        raise TypeError(
            f"fastpipe: Pipe needs balance=, the number of layers per stage summing to len(module) = "
            f"{len(module)} (e.g. balance=[{(len(module) + 1) // 2}, {len(module) // 2}] for two stages), "
            "or balance='auto' to plan it from a sample mini-batch (sample=x)"
        )
    if not isinstance(balance, str):
        unused = [k for k, v in (("sample", sample), ("memory_limit", memory_limit)) if v is not None]
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
    )
