"""The ``fastpipe`` console command.

Console-script entry point: ``fastpipe = fastpipe.cli:main``. Examples::

    fastpipe plan --costs "1,2,3,4" --stages 2 --chunks 8 --schedule zb-h1
    fastpipe plan --model mymodels:build --sample-shape 256,512 --stages 4 --chunks 8
    fastpipe plan --costs "1,2,3,4" --stages 2 --chunks 8 --schedule auto --memory-limit 2
    fastpipe train --schedule zb-v --steps 300
    torchrun --nproc-per-node 2 -m fastpipe train --save ckpt --resume auto   # one process per stage
    fastpipe bench --quick --only e2e,schedules --out bench-out

``plan`` and ``train`` share the vocabulary of ``Pipe``: ``--stages`` pipeline workers,
``--chunks`` micro-batches per step, ``--schedule`` (1f1b by default) with ``--virtual-stages``
(stages per worker). ``--partitions`` and ``--microbatches`` are ``plan``'s other spellings of
the first two.

With ``--model`` (a ``module:callable`` returning an ``nn.Sequential``, or a module-level
``nn.Sequential``; the module is looked up in the current directory first, as ``python -m``
does) each layer is profiled on one micro-batch of a random sample; the plan's times are then
seconds (else in the unit of ``--costs``) and it also shows each stage's peak memory: its
activations for the micro-batches its worker keeps alive at once, plus parameters, gradients
and optimizer state.

``--schedule auto`` balances the layers for ZB-H1, then prints every schedule the search
(:mod:`fastpipe.schedule.search`) considered on the stages' costs, with its simulated time,
bubble (the idle share of the ``--stages`` workers, of which a candidate with several stages
per worker uses fewer) and peak activation memory, and the one it chose. There
``--memory-limit`` caps the activations one worker holds at once: in bytes of saved tensors
with ``--model``, in the units of ``--memory`` (one micro-batch's, per layer) with it, else in
micro-batches alive.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from fastpipe.balance import MEASURED_TOLERANCE, BalanceError, plan, predict
from fastpipe.schedule import SCHEDULES, ScheduleError, build

__all__ = ["build_parser", "main"]

_PLAN_USAGE = (
    "fastpipe plan (--costs C1,C2,... | --model MODULE:CALLABLE --sample-shape N,...) --stages K --chunks M [options]"
)
_PLAN_EXAMPLE = "fastpipe plan --costs 1,2,3,4 --stages 2 --chunks 8"
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


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each option's default, except where there is none to show.

    A default of None means "decided at run time" (the help says how) and False is an off flag;
    "(default: None)" or "(default: False)" would only add noise.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from exc


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc


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


def _profile(args: argparse.Namespace) -> tuple[list[float], list[float], list[float], list[float]]:
    """Per-layer forward s, backward s, activation bytes and parameter bytes of one micro-batch."""
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
    return (
        list(prof.forward),
        list(prof.backward),
        [float(a) for a in prof.activation_bytes],
        [float(b) for b in prof.parameter_bytes],
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``fastpipe`` argument parser: subcommands ``plan``, ``train`` and ``bench``."""
    from fastpipe._version import __version__

    parser = argparse.ArgumentParser(prog="fastpipe", description="fastpipe: pipeline-parallel training tools")
    parser.add_argument("--version", action="version", version=f"fastpipe {__version__}")
    # Not required=True: without a command, main prints this help instead of argparse's one-line error.
    sub = parser.add_subparsers(dest="command", metavar="{plan,train,bench}")
    p = sub.add_parser(
        "plan",
        help="balance per-layer costs over stages and predict the schedule",
        description="Balance layers over pipeline stages (the balance: layers per stage) and "
        "predict the schedule's step; --schedule auto lists the schedules a search simulated on the costs "
        f"and the fastest that fits --memory-limit. Example: {_PLAN_EXAMPLE}",
        usage=_PLAN_USAGE,
        formatter_class=_HelpFormatter,
    )
    # The costs, --stages and --chunks are checked in _plan, which says what each one is.
    source = p.add_mutually_exclusive_group()
    source.add_argument("--costs", type=_floats, help="forward cost per layer, e.g. '1,2,3,4' (this or --model)")
    source.add_argument(
        "--model",
        help="'module:callable' returning an nn.Sequential, profiled on --sample-shape; "
        "the module may sit in the current directory (this or --costs)",
    )
    p.add_argument("--sample-shape", type=_ints, default=None, help="mini-batch shape for --model, e.g. '256,512'")
    p.add_argument("--sample-dtype", default="float32", help="float32 | bfloat16 | int64 (token ids)")
    p.add_argument("--vocab", type=int, default=1000, help="upper bound of random token ids (int64 samples)")
    p.add_argument(
        "--state-factor",
        type=float,
        default=4.0,
        help="bytes kept per parameter byte: parameter, gradient, optimizer state (4 for Adam)",
    )
    p.add_argument("--bwd-costs", type=_floats, default=None, help="backward cost per layer (default 2x forward)")
    p.add_argument("--stages", type=int, help="pipeline workers K the layers are balanced over (required)")
    p.add_argument("--chunks", type=int, help="micro-batches per step M (required)")
    # torchgpipe's words for the same two numbers.
    p.add_argument("--partitions", type=int, dest="stages", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.add_argument("--microbatches", type=int, dest="chunks", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.add_argument(
        "--schedule",
        default="1f1b",
        choices=(*SCHEDULES, "auto"),
        help="pipeline schedule the plan is for, as fastpipe train and Pipe take it",
    )
    p.add_argument(
        "--virtual-stages",
        type=int,
        default=None,
        metavar="V",
        help="stages per worker (K x V stages in all): any V with --schedule interleaved (default 2); "
        "zb-v and dualpipev take 2; the others 1",
    )
    p.add_argument("--memory", type=_floats, default=None, help="bytes per layer")
    p.add_argument(
        "--memory-limit",
        type=float,
        default=None,
        help="most bytes one stage may hold; with --schedule auto: most activation memory one worker holds at once "
        "(bytes with --model, --memory's units with it, else micro-batches alive)",
    )
    p.add_argument("--comm", type=float, default=0.0, help="link delay between stages, cost units")
    p.add_argument(
        "--weight-share", type=float, default=0.5, help="--schedule auto: W's part of each backward (the rest is B)"
    )
    t = sub.add_parser(
        "train",
        help="train a character-level GPT on the standard library's sources through Pipe",
        description="Train a character-level GPT on Python's standard library through fastpipe.Pipe; "
        "under torchrun, one DistributedPipe stage per process.",
        formatter_class=_HelpFormatter,
    )
    from fastpipe.train import add_arguments as add_train_arguments

    add_train_arguments(t)
    b = sub.add_parser(
        "bench",
        help="the benchmark suite: JSON, PNG charts and a markdown table",
        description="The benchmark suite: writes bench.json, PNG charts and results.md to --out.",
        formatter_class=_HelpFormatter,
    )
    from fastpipe.bench.suite import add_arguments as add_bench_arguments

    add_bench_arguments(b)
    return parser


def _check_plan(args: argparse.Namespace) -> None:
    """Says what is missing in words a first run understands, with a command that works."""
    missing = []
    if args.costs is None and args.model is None:
        missing.append("the layers' costs (--costs 1,2,3,4, or --model module:callable to profile them)")
    if args.stages is None:
        missing.append("--stages K (the pipeline workers to balance the layers over)")
    if args.chunks is None:
        missing.append("--chunks M (the micro-batches per step)")
    if missing:
        raise ValueError(f"fastpipe plan needs {'; '.join(missing)}. Example: {_PLAN_EXAMPLE}")


def _plan(args: argparse.Namespace) -> int:
    from fastpipe.train.options import virtual_stages

    _check_plan(args)
    acts: list[float] | None = None
    params: list[float] | None = None
    if args.model is not None:
        fwd, bwd, acts, params = _profile(args)
    else:
        fwd = args.costs
        bwd = args.bwd_costs if args.bwd_costs is not None else [2 * c for c in fwd]
    virtual = virtual_stages(args.schedule, args.virtual_stages)
    if args.schedule == "auto":
        return _plan_auto(args, fwd, bwd, acts)
    schedule = build(args.schedule, args.stages, args.chunks, virtual_stages=virtual)
    step: dict[str, Any] = {"microbatches": args.chunks, "schedule": args.schedule, "virtual_stages": virtual}
    memory = args.memory
    if memory is None and acts is not None and params is not None:
        ones = [1.0] * schedule.num_stages
        in_flight = max(predict([1] * schedule.num_stages, ones, ones, **step).peak_activations)
        memory = [a * in_flight + args.state_factor * p for a, p in zip(acts, params)]
    balance = plan(
        fwd,
        bwd,
        args.stages,
        memory=memory,
        memory_limit=args.memory_limit,
        comm=args.comm,
        tolerance=MEASURED_TOLERANCE if args.model is not None else 0.0,  # profiled costs are noisy
        **step,
    )
    timeline = predict(balance, fwd, bwd, comm=args.comm, **step)
    peaks = timeline.peak_activations
    # Profiled costs are seconds; given ones keep the unit they were given in.
    time = _seconds if args.model is not None else (lambda t: f"{t:.4g}")
    unit = "" if args.model is not None else _COST_UNITS
    print(f"balance: {balance}")
    start = 0
    for stage, size in enumerate(balance):
        line = (
            f"  stage {stage} (worker {schedule.worker_of(stage)}): layers {start}..{start + size - 1}, "
            f"fwd {time(sum(fwd[start : start + size]))}, bwd {time(sum(bwd[start : start + size]))}"
        )
        if acts is not None and params is not None:
            alive = peaks[schedule.worker_of(stage)]
            peak = alive * sum(acts[start : start + size]) + args.state_factor * sum(params[start : start + size])
            line += f", peak memory {peak / 2**20:.1f} MiB ({alive} micro-batches alive on its worker)"
        elif args.memory is not None:
            line += f", memory {sum(args.memory[start : start + size]):.4g}"
        print(line)
        start += size
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


def _plan_auto(args: argparse.Namespace, fwd: list[float], bwd: list[float], acts: list[float] | None) -> int:
    """``--schedule auto``: the balance for ZB-H1, then the search's table on its stages and the choice."""
    from fastpipe.schedule.search import StageCosts, search

    profiled = args.model is not None
    balance = plan(
        fwd,
        bwd,
        args.stages,
        microbatches=args.chunks,
        schedule="zb-h1",
        comm=args.comm,
        tolerance=MEASURED_TOLERANCE if profiled else 0.0,
    )
    ends = [sum(balance[: i + 1]) for i in range(len(balance))]

    def per_stage(values: Sequence[float]) -> list[float]:
        return [float(sum(values[end - size : end])) for end, size in zip(ends, balance)]

    # Activation memory of one micro-batch per stage: profiled bytes (shown in MiB), given, or 1 (counts them).
    scale, unit = (2**-20, " MiB") if acts is not None else (1.0, "")
    given = acts if acts is not None else args.memory
    activation = per_stage(given) if given is not None else [1.0] * len(balance)
    costs = StageCosts.from_measured(
        per_stage(fwd), per_stage(bwd), activation, weight_share=args.weight_share, comm=args.comm
    )
    choice = search(costs, len(balance), args.chunks, args.memory_limit)
    # Profiled costs are seconds, shown in the unit of the chosen step; given ones keep theirs.
    time_scale, time_unit = _time_unit(choice.chosen.time) if profiled else (1.0, _COST_UNITS.strip())
    t = (lambda v: f"{v * time_scale:.4g} {time_unit}") if profiled else (lambda v: f"{v:.4g}")
    print(f"balance: {balance} (planned for zb-h1)")
    for stage, (f, b, w) in enumerate(zip(costs.forward, costs.backward, costs.weight)):
        memory = f", activation {costs.activation[stage] * scale:.4g}{unit}" if given is not None else ""
        print(f"  stage {stage}: F {t(f)}, B {t(b)}, W {t(w)}{memory}")
    if given is None:
        print("  (no --memory or --model: peak memory counts the micro-batches alive)")
    print()
    print(
        f"schedules considered for {args.chunks} micro-batches on {args.stages} workers (time in {time_unit} and "
        "bubble simulated, peak per worker):"
    )
    print(choice.table(unit, scale, time_scale=time_scale))
    print()
    print(choice.schedule)
    print()
    shown = _seconds(choice.chosen.time) if profiled else f"{choice.chosen.time:.4g}{_COST_UNITS}"
    print(f"predicted step: {shown}, bubble {choice.chosen.bubble:.1%}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        if args.command == "plan":
            return _plan(args)
        if args.command == "train":
            from fastpipe.train import run

            run(args)
            return 0
        if args.command == "bench":
            from fastpipe.bench.suite import run as run_bench

            return run_bench(args)
    except (BalanceError, ScheduleError, ValueError, ImportError, AttributeError, FileNotFoundError) as exc:
        print(f"fastpipe: error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
