"""``fastpipe plan --checkpoint auto`` / ``--offload auto``: the planner's combinations, printed.

The layers are profiled (``--model``: seconds and bytes, and each recompute policy
``checkpoint="auto"`` would try, :func:`~fastpipe.memory.planner_profile.measure_plan_profile`) or
given (``--costs`` with ``--memory``, each layer's activation bytes), and
:func:`~fastpipe.memory.planner.plan_memory` chooses balance, schedule, recompute and offload
together: the fastest combination whose every device's predicted peak plus 5% fits
``--memory-limit``. The table lists the fastest combinations evaluated, fits or not, and marks
the chosen one; the rest are counted. A fixed ``--schedule`` (not ``auto``) or ``--checkpoint``
holds that setting; offload is on offer with ``--offload auto`` where there is a copy bandwidth
(``--copy-bandwidth``; without it offload is not on offer).
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from fastpipe.memory.model import StageBytes
from fastpipe.memory.offload_bytes import CopyBandwidth
from fastpipe.memory.planner import PlanProfile, plan_memory
from fastpipe.memory.sizes import format_bytes, parse_bytes
from fastpipe.schedule import SCHEDULES

__all__ = ["memory_argument", "resolve_memory_alias", "run_plan_memory", "wants_planner"]

_TOP = 10  # combinations shown besides the chosen one
_FLOATS = re.compile(r"^\s*[-+0-9.eE]+(\s*,\s*[-+0-9.eE]+)*\s*$")


class _Size(int):
    """A ``--memory`` value that is a size (``24GiB``): the limit, as the issue's spelling has it."""


def memory_argument(text: str) -> list[float] | int:
    """``--memory``: bytes per layer (``1e6,2e6``), or one size with a unit (``24GiB``), which is the limit.

    Raises:
        argparse.ArgumentTypeError: neither, naming both forms.
    """
    if _FLOATS.match(text):
        return [float(v) for v in text.split(",")]
    try:
        return _Size(parse_bytes(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--memory takes bytes per layer ('1e6,2e6,...') or a device size with a unit ('24GiB'), got {text!r}"
        ) from None


def wants_planner(args: argparse.Namespace) -> bool:
    """Whether ``fastpipe plan`` runs the planner: recompute or offload left to it."""
    return args.checkpoint == "auto" or getattr(args, "offload", "none") == "auto"


def resolve_memory_alias(args: argparse.Namespace) -> None:
    """``--memory 24GiB`` becomes ``--memory-limit 24GiB``; both at once are refused.

    Raises:
        ValueError: a size in ``--memory`` and ``--memory-limit`` together.
    """
    if isinstance(args.memory, _Size):
        if args.memory_limit is not None:
            raise ValueError("--memory SIZE is another spelling of --memory-limit; give one of them")
        args.memory_limit, args.memory = str(int(args.memory)), None


def run_plan_memory(
    args: argparse.Namespace, fwd: list[float], bwd: list[float], prof: Any, limit: int | None, optimizer: float | None
) -> int:
    """Plan with :func:`~fastpipe.memory.planner.plan_memory` and print its table; returns the exit status.

    Args:
        args: the parsed ``fastpipe plan`` arguments.
        fwd: forward seconds (or cost units) per layer.
        bwd: backward seconds (or cost units) per layer.
        prof: the profiled ``--model`` (its ``model`` and one micro-batch ``sample``), or None for ``--costs``.
        limit: ``--memory-limit`` in bytes, or None.
        optimizer: optimizer state per parameter byte.
    """
    offload = getattr(args, "offload", "none") == "auto"
    bandwidth = _bandwidth(args) if offload else None
    if prof is not None:
        from fastpipe.balance._untouched import state_kept
        from fastpipe.memory.planner_profile import measure_plan_profile

        with state_kept(prof.model, None):
            profile = measure_plan_profile(
                prof.model,
                prof.sample,
                bandwidth=bandwidth,
                offload=offload,
                weight_share=args.weight_share,
                comm=args.comm,
            )
    else:
        given = args.memory if args.memory is not None else [1.0] * len(fwd)
        if len(given) != len(fwd):
            raise ValueError(f"--memory has {len(given)} entries for {len(fwd)} layers; give one per layer")
        layers = tuple(StageBytes(parameters=0, activation=int(m)) for m in given)
        profile = PlanProfile(tuple(fwd), tuple(bwd), layers, (), bandwidth, (), args.weight_share, args.comm)
    from fastpipe.train.options import virtual_stages

    virtual = None if args.schedule == "auto" else virtual_stages(args.schedule, args.virtual_stages)
    found = plan_memory(
        profile,
        args.stages * (virtual or 1),
        args.chunks,
        limit,
        optimizer=optimizer,
        greedy=args.schedule == "auto",
        schedules=SCHEDULES if args.schedule == "auto" else [args.schedule],
        virtual_stages=virtual,
        checkpoints=None if args.checkpoint == "auto" else [args.checkpoint],
    )
    scale, unit = _unit(found.chosen.time) if prof is not None else (1.0, "cost units")
    print(
        f"combinations of balance, schedule, recompute and offload for {args.chunks} micro-batches on "
        f"{args.stages * (virtual or 1)} stages (time simulated on the {'measured' if prof else 'given'} costs, "
        "each device's predicted peak):"
    )
    print(found.table(top=_TOP, time_scale=scale, time_unit=unit))
    print()
    print("chosen, each device's predicted peak:")
    for device in found.chosen.devices:
        print(f"  {device}")
    if offload and bandwidth is None:
        print("offload: nothing to offload to on this device (a CPU's activations are host memory already)")
    if limit is not None:
        print(f"memory_limit: {format_bytes(limit)} per device")
    return 0


def _bandwidth(args: argparse.Namespace) -> CopyBandwidth | None:
    rate = getattr(args, "copy_bandwidth", None)
    if rate is None:
        return None
    if not rate > 0:
        raise ValueError(f"--copy-bandwidth is bytes per second (or per cost unit), > 0; got {rate}")
    import torch

    return CopyBandwidth(torch.device("cpu"), float(rate), float(rate), 0)


def _unit(seconds: float) -> tuple[float, str]:
    for scale, unit in ((1.0, "s"), (1e3, "ms"), (1e6, "µs")):
        if abs(seconds) * scale >= 1:
            return scale, unit
    return 1e9, "ns"
