"""The ``fastpipe`` console command.

Console-script entry point: ``fastpipe = fastpipe.cli:main``. Examples::

    fastpipe plan --costs "1,2,3,4" --stages 2 --chunks 8 --schedule zb-h1
    fastpipe plan --model mymodels:build --sample-shape 256,512 --stages 4 --chunks 8
    fastpipe plan --model mymodels:build --sample-shape 256,512 --stages 4 --chunks 8 --memory-limit 24GiB
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
seconds (else in the unit of ``--costs``) and it also shows each device's predicted peak in
bytes: parameters, gradients, optimizer state, activations and W records
(:mod:`fastpipe.cli_plan`).

``--schedule auto`` balances the layers for ZB-H1, then prints every schedule the search
(:mod:`fastpipe.schedule.search`) considered on the stages' costs, with its simulated time,
bubble (the idle share of the ``--stages`` workers, of which a candidate with several stages
per worker uses fewer) and each device's predicted peak, and the one it chose.
``--memory-limit`` is in device bytes (``24GiB``): what is planned or chosen fits every device
with 5% of its prediction kept free.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from fastpipe.balance import BalanceError
from fastpipe.cli_plan import PLAN_EXAMPLE, run_plan
from fastpipe.cli_plan_memory import memory_argument
from fastpipe.schedule import SCHEDULES, ScheduleError

__all__ = ["build_parser", "main"]

_PLAN_USAGE = (
    "fastpipe plan (--costs C1,C2,... | --model MODULE:CALLABLE --sample-shape N,...) --stages K --chunks M [options]"
)


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
        f"and the fastest that fits --memory-limit. Example: {PLAN_EXAMPLE}",
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
    p.add_argument(
        "--memory",
        type=memory_argument,
        default=None,
        help="bytes per layer; or one size with a unit (24GiB), another spelling of --memory-limit",
    )
    p.add_argument(
        "--memory-limit",
        default=None,
        metavar="SIZE",
        help="bytes per device, e.g. 24GiB or 500MB: every device's predicted peak plus 5%% must fit (with "
        "--model; with --costs, the sum of --memory over a stage's layers, or its activations in flight with "
        "--schedule auto)",
    )
    p.add_argument(
        "--checkpoint",
        default="except_last",
        choices=("always", "except_last", "never", "auto"),
        help="the recompute the pipe will run, which the memory model counts; auto (Pipe's default): the planner "
        "chooses it with the balance, the schedule (--schedule auto) and the offload, and prints the combinations; "
        "the default here plans a fixed except_last (torchgpipe's)",
    )
    p.add_argument(
        "--offload",
        default="none",
        choices=("none", "auto"),
        help="auto: the planner may offload saved activations to host memory (priced by --copy-bandwidth)",
    )
    p.add_argument(
        "--copy-bandwidth",
        type=float,
        default=None,
        metavar="BYTES_PER_S",
        help="host copy bandwidth each way that prices --offload auto (per cost unit with --costs); "
        "default: none, offload is then not on offer",
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


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        if args.command == "plan":
            return run_plan(args)
        if args.command == "train":
            from fastpipe.train import run

            run(args)
            return 0
        if args.command == "bench":
            from fastpipe.bench.suite import run as run_bench

            return run_bench(args)
    except (BalanceError, ScheduleError, ValueError, ImportError, AttributeError, FileNotFoundError) as exc:
        print(f"fastpipe: error: {str(exc).removeprefix('fastpipe: ')}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
