"""The ``fastpipe`` console command.

Console-script entry point: ``fastpipe = fastpipe.cli:main``. Example::

    fastpipe plan --costs "1,2,3,4" --partitions 2 --microbatches 8 --schedule 1f1b
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from fastpipe.balance import BalanceError, plan, predict
from fastpipe.schedule import SCHEDULES, ScheduleError, build

__all__ = ["main"]


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from exc


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastpipe", description="fastpipe: pipeline-parallel training tools")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="balance per-layer costs over stages and predict the schedule")
    p.add_argument("--costs", type=_floats, required=True, help="forward cost per layer, e.g. '1,2,3,4'")
    p.add_argument("--bwd-costs", type=_floats, default=None, help="backward cost per layer (default 2x forward)")
    p.add_argument("--partitions", type=int, required=True, help="pipeline workers K")
    p.add_argument("--microbatches", type=int, required=True, help="micro-batches per step M")
    p.add_argument("--schedule", default="gpipe", choices=SCHEDULES)
    p.add_argument("--virtual-stages", type=int, default=1, help="stages per worker (interleaved)")
    p.add_argument("--memory", type=_floats, default=None, help="bytes per layer")
    p.add_argument("--memory-limit", type=float, default=None, help="most bytes one stage may hold")
    p.add_argument("--comm", type=float, default=0.0, help="link delay between stages, cost units")
    return parser


def _plan(args: argparse.Namespace) -> int:
    fwd = args.costs
    bwd = args.bwd_costs if args.bwd_costs is not None else [2 * c for c in fwd]
    balance = plan(fwd, bwd, args.partitions, microbatches=args.microbatches, schedule=args.schedule,
                   memory=args.memory, memory_limit=args.memory_limit, comm=args.comm,
                   virtual_stages=args.virtual_stages)
    timeline = predict(balance, fwd, bwd, microbatches=args.microbatches, schedule=args.schedule,
                       comm=args.comm, virtual_stages=args.virtual_stages)
    schedule = build(args.schedule, args.partitions, args.microbatches, virtual_stages=args.virtual_stages)
    print(f"balance: {balance}")
    start = 0
    for stage, size in enumerate(balance):
        line = (f"  stage {stage} (worker {schedule.worker_of(stage)}): layers {start}..{start + size - 1}, "
                f"fwd {sum(fwd[start:start + size]):.4g}, bwd {sum(bwd[start:start + size]):.4g}")
        if args.memory is not None:
            line += f", memory {sum(args.memory[start:start + size]):.4g}"
        print(line)
        start += size
    print()
    print(schedule)
    print()
    busy = sum(fwd) + sum(bwd)
    print(f"predicted step: {timeline.makespan:.4g} (sequential {busy * args.microbatches:.4g}, "
          f"speed-up {busy * args.microbatches / timeline.makespan:.3g}x)")
    print(f"predicted bubble: {timeline.bubble_fraction:.1%}")
    print("peak activations (micro-batches alive) per worker: "
          + ", ".join(str(p) for p in timeline.peak_activations))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "plan":
            return _plan(args)
    except (BalanceError, ScheduleError) as exc:
        print(f"fastpipe: error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
