"""``fastpipe plan``: the balance, the schedule, and each device's predicted bytes, printed.

With ``--model`` every layer is profiled on one micro-batch of a random sample (times in
seconds) and measured for memory (:func:`fastpipe.balance.device_need.layer_bytes`); each device's
peak is then predicted in bytes by the model ``Pipe(memory_limit=)`` checks each step with:
parameters, gradients, optimizer state (``--state-factor``), activations in flight and W
records, under ``--checkpoint``. ``--memory-limit`` is a size in device bytes (``24GiB``): the
balance planned, or with ``--schedule auto`` the schedule chosen, is one whose every device's
prediction plus 5% fits.

``--checkpoint auto`` or ``--offload auto`` hands balance, schedule (``--schedule auto``), recompute
and offload to one planner and prints its combinations (:mod:`fastpipe.cli_plan_memory`);
``--memory 24GiB`` (a size with a unit) spells ``--memory-limit``.

With ``--costs`` the times are in the unit given, and bytes are known only from ``--memory``
(each layer's bytes): a stage needs the sum of its layers' (``--schedule auto``: its
activations per micro-batch, counted over the micro-batches each device keeps alive). Without
``--memory`` the auto table counts micro-batches alive, and a ``--memory-limit`` is refused.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from fastpipe.balance import MEASURED_TOLERANCE, plan, predict
from fastpipe.cli_plan_memory import resolve_memory_alias, run_plan_memory, wants_planner
from fastpipe.memory.limit import MARGIN
from fastpipe.memory.sizes import format_bytes, parse_bytes
from fastpipe.schedule import build

__all__ = ["PLAN_EXAMPLE", "run_plan"]

PLAN_EXAMPLE = "fastpipe plan --costs 1,2,3,4 --stages 2 --chunks 8"
_COST_UNITS = " cost units"  # --costs are in any unit of time; the plan keeps it


def _time_unit(seconds: float) -> tuple[float, str]:
    """The factor and unit to show ``seconds`` in: s, ms, µs or ns, whichever gives 1 to 999."""
    for scale, unit in ((1.0, "s"), (1e3, "ms"), (1e6, "µs")):
        if abs(seconds) * scale >= 1:
            return scale, unit
    return 1e9, "ns"


def _seconds(value: float) -> str:
    """A time in seconds as people read it: ``4.51 ms``, ``1.2 s``, ``850 µs``."""
    scale, unit = _time_unit(value)
    return f"{value * scale:.3g} {unit}"


@contextlib.contextmanager
def _cwd_importable() -> Iterator[None]:
    """The current directory first on ``sys.path`` for the block, as ``python -m`` puts it.

    A console script's ``sys.path[0]`` is the script's own folder, so without this ``--model
    mymodels:build`` could not import ``./mymodels.py``.
    """
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def _load_model(spec: str) -> Any:
    import importlib

    from torch import nn

    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"--model takes 'module:callable', got {spec!r}")
    with _cwd_importable():  # the builder may import its siblings too
        obj = getattr(importlib.import_module(module_name), attr)
        model = obj if isinstance(obj, nn.Module) else obj()
    if not isinstance(model, nn.Sequential):
        raise ValueError(f"--model {spec} gave {type(model).__name__}, not an nn.Sequential")
    return model


@dataclass
class _Profiled:
    """A ``--model`` profiled on one micro-batch: the model, the micro-batch, per-layer seconds and bytes."""

    model: Any
    sample: Any
    forward: list[float]
    backward: list[float]
    activation: list[float]


def _profile(args: argparse.Namespace) -> _Profiled:
    import torch

    from fastpipe.balance import profile_layers

    if args.sample_shape is None:
        raise ValueError("--model needs --sample-shape (the mini-batch shape, e.g. 256,512)")
    model = _load_model(args.model)
    shape = list(args.sample_shape)
    shape[0] = max(1, math.ceil(shape[0] / args.chunks))
    dtype = getattr(torch, args.sample_dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"--sample-dtype {args.sample_dtype!r} is not a torch dtype")
    sample = torch.randint(0, args.vocab, shape) if not dtype.is_floating_point else torch.randn(shape, dtype=dtype)
    prof = profile_layers(model, sample)
    return _Profiled(model, sample, list(prof.forward), list(prof.backward), [float(a) for a in prof.activation_bytes])


def _check_plan(args: argparse.Namespace) -> int | None:
    """Says what is missing in words a first run understands, with a command that works; the limit in bytes."""
    missing = []
    if args.costs is None and args.model is None:
        missing.append("the layers' costs (--costs 1,2,3,4, or --model module:callable to profile them)")
    if args.stages is None:
        missing.append("--stages K (the pipeline workers to balance the layers over)")
    if args.chunks is None:
        missing.append("--chunks M (the micro-batches per step)")
    if missing:
        raise ValueError(f"fastpipe plan needs {'; '.join(missing)}. Example: {PLAN_EXAMPLE}")
    resolve_memory_alias(args)
    if args.memory_limit is None:
        return None
    limit = parse_bytes(args.memory_limit)
    if args.model is None and args.memory is None:
        raise ValueError(
            "--memory-limit is in device bytes, which plan knows only from --model (measured) or "
            "--memory (bytes per layer); give one, or drop the limit"
        )
    return limit


def _optimizer(args: argparse.Namespace) -> float:
    """Optimizer state per parameter byte: ``--state-factor`` counts the parameter and its gradient too."""
    if not args.state_factor >= 2:
        raise ValueError(
            f"--state-factor counts the parameter, its gradient and their state: >= 2, got {args.state_factor}"
        )
    return float(args.state_factor) - 2.0


def run_plan(args: argparse.Namespace) -> int:
    """``fastpipe plan``: prints the plan; returns the exit status."""
    from fastpipe.balance.auto import plan_within
    from fastpipe.balance.device_need import StageNeed, layer_bytes
    from fastpipe.train.options import virtual_stages

    limit = _check_plan(args)
    prof = _profile(args) if args.model is not None else None
    if prof is not None:
        fwd, bwd = prof.forward, prof.backward
    else:
        fwd = args.costs
        bwd = args.bwd_costs if args.bwd_costs is not None else [2 * c for c in fwd]
    virtual = virtual_stages(args.schedule, args.virtual_stages)
    if wants_planner(args):
        return run_plan_memory(args, fwd, bwd, prof, limit, _optimizer(args) if prof is not None else None)
    if args.schedule == "auto":
        return _plan_auto(args, fwd, bwd, prof, limit)
    schedule = build(args.schedule, args.stages, args.chunks, virtual_stages=virtual)
    step: dict[str, Any] = {"microbatches": args.chunks, "schedule": args.schedule, "virtual_stages": virtual}
    tolerance = MEASURED_TOLERANCE if prof is not None else 0.0  # profiled costs are noisy
    need = None
    if prof is not None:
        layers = layer_bytes(prof.model, prof.sample, {})
        need = StageNeed(
            layers, schedule, checkpoint=args.checkpoint, optimizer=_optimizer(args), wgrad_batch=_wgrad_batch(prof)
        )
    if need is not None and limit is not None:
        balance = plan_within(fwd, bwd, need, limit, schedule=args.schedule, tolerance=tolerance)
    else:
        memory = args.memory if prof is None else None
        balance = plan(
            fwd, bwd, args.stages, memory=memory, memory_limit=limit, comm=args.comm, tolerance=tolerance, **step
        )
    timeline = predict(balance, fwd, bwd, comm=args.comm, **step)
    # Profiled costs are seconds; given ones keep the unit they were given in.
    time = _seconds if prof is not None else (lambda t: f"{t:.4g}")
    unit = "" if prof is not None else _COST_UNITS
    print(f"balance: {balance}")
    start = 0
    for stage, size in enumerate(balance):
        line = (
            f"  stage {stage} (worker {schedule.worker_of(stage)}): layers {start}..{start + size - 1}, "
            f"fwd {time(sum(fwd[start : start + size]))}, bwd {time(sum(bwd[start : start + size]))}"
        )
        if need is None and args.memory is not None:
            line += f", memory {sum(args.memory[start : start + size]):.4g}"
        print(line)
        start += size
    if need is not None:
        shown = "none" if limit is None else f"{format_bytes(limit)} per device, {MARGIN:.0%} of each prediction kept"
        print(f"peak memory per device, predicted (memory_limit: {shown}):")
        for device in need.devices(balance):
            print(f"  {device}")
    print()
    print(schedule)
    print()
    busy = (sum(fwd) + sum(bwd)) * args.chunks
    print(
        f"predicted step: {time(timeline.makespan)}{unit} (sequential {time(busy)}{unit}, "
        f"speed-up {busy / timeline.makespan:.3g}x)"
    )
    print(f"predicted bubble: {timeline.bubble_fraction:.1%}")
    print("peak activations (micro-batches alive) per worker: " + ", ".join(str(p) for p in timeline.peak_activations))
    return 0


def _wgrad_batch(prof: _Profiled) -> int:
    """The pipe's default micro-batches per batched ``W`` where the model was profiled."""
    from fastpipe.runtime.wgrad import default_wgrad_batch

    return default_wgrad_batch(prof.sample.device)


def _per_stage(values: Sequence[float], balance: Sequence[int]) -> list[float]:
    """Per-layer ``values`` summed per stage of ``balance``."""
    ends = [sum(balance[: i + 1]) for i in range(len(balance))]
    return [float(sum(values[end - size : end])) for end, size in zip(ends, balance)]


def _plan_auto(
    args: argparse.Namespace, fwd: list[float], bwd: list[float], prof: _Profiled | None, limit: int | None
) -> int:
    """``--schedule auto``: the balance for ZB-H1, then the search's table on its stages and the choice."""
    from fastpipe.memory.candidates import device_search, device_table
    from fastpipe.memory.model import StageBytes
    from fastpipe.schedule.search import StageCosts, search

    balance = plan(
        fwd,
        bwd,
        args.stages,
        microbatches=args.chunks,
        schedule="zb-h1",
        comm=args.comm,
        tolerance=MEASURED_TOLERANCE if prof is not None else 0.0,
    )
    # Activation memory of one micro-batch per stage: profiled bytes (shown in MiB), given, or 1 (counts them).
    scale, unit = (2**-20, " MiB") if prof is not None else (1.0, "")
    given = prof.activation if prof is not None else args.memory
    activation = _per_stage(given, balance) if given is not None else [1.0] * len(balance)
    costs = StageCosts.from_measured(
        _per_stage(fwd, balance), _per_stage(bwd, balance), activation, weight_share=args.weight_share, comm=args.comm
    )
    stage_bytes = None
    if prof is not None:
        from fastpipe.balance._untouched import state_kept
        from fastpipe.memory.stage_bytes import measure_stages

        with state_kept(prof.model, None):
            stage_bytes = measure_stages(prof.model, balance, prof.sample)
    elif args.memory is not None:  # the given bytes are each stage's activations per micro-batch
        stage_bytes = [StageBytes(parameters=0, activation=int(a)) for a in activation]
    found = None
    if stage_bytes is None:
        choice = search(costs, len(balance), args.chunks, None)
    else:
        found = device_search(
            costs,
            stage_bytes,
            args.chunks,
            limit,
            checkpoint=args.checkpoint,
            optimizer=_optimizer(args) if prof is not None else None,
            wgrad_batch=_wgrad_batch(prof) if prof is not None else 1,
        )
        choice = found.choice
    # Profiled costs are seconds, shown in the unit of the chosen step; given ones keep theirs.
    time_scale, time_unit = _time_unit(choice.chosen.time) if prof is not None else (1.0, _COST_UNITS.strip())
    t = (lambda v: f"{v * time_scale:.4g} {time_unit}") if prof is not None else (lambda v: f"{v:.4g}")
    print(f"balance: {balance} (planned for zb-h1)")
    for stage, (f, b, w) in enumerate(zip(costs.forward, costs.backward, costs.weight)):
        memory = f", activation {costs.activation[stage] * scale:.4g}{unit}" if given is not None else ""
        print(f"  stage {stage}: F {t(f)}, B {t(b)}, W {t(w)}{memory}")
    if given is None:
        print("  (no --memory or --model: peak memory counts the micro-batches alive)")
    print()
    what = "peak per worker" if found is None else "each device's predicted peak"
    print(
        f"schedules considered for {args.chunks} micro-batches on {args.stages} workers (time in {time_unit} and "
        f"bubble simulated, {what}):"
    )
    print(choice.table(time_scale=time_scale) if found is None else device_table(found, time_scale=time_scale))
    print()
    print(choice.schedule)
    print()
    shown = _seconds(choice.chosen.time) if prof is not None else f"{choice.chosen.time:.4g}{_COST_UNITS}"
    print(f"predicted step: {shown}, bubble {choice.chosen.bubble:.1%}")
    return 0
