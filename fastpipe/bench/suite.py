"""``fastpipe bench``: the benchmark suite in one command, from an installed package.

Parts (``--only`` picks some): ``e2e`` (plain, gradient accumulation, fastpipe, torchgpipe and
``torch.distributed.pipelining`` side by side on every visible GPU, else 2 CPU stages),
``schedules`` (simulated bubble and memory of every schedule), ``distributed`` (one rank per
device: fastpipe ``DistributedPipe`` vs ``torch.distributed.pipelining``, NCCL or gloo),
``zero-bubble`` (2 gloo processes: fastpipe ``zb-v`` and ``dualpipev`` against
``torch.distributed.pipelining``'s ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV``, paired
rounds), ``copy`` (copy/compute overlap of ``fastpipe._C``), ``kernels`` (fused kernels vs eager)
and ``memory`` (the largest GPT that plain PyTorch, ``torch.distributed.pipelining`` and fastpipe
train within one per-device budget on 4 ranks, :mod:`fastpipe.bench.largest`; and, as a section,
the largest model one device trains: plain, recompute, recompute + fused) and ``fsdp`` (4 ranks,
2 stages x 2 replicas: replicated stages, ``dp_shard="fsdp"`` and ``torch.distributed.pipelining``
over FSDP2, :mod:`fastpipe.bench.fsdp`).

Each part has a time budget: it stops adding rounds when its budget is spent, and spawned
ranks are stopped past it. ``--quick`` budgets the suite for under 8 minutes on one H200.
Writes ``bench.json``, one PNG per part that has a chart, and ``results.md`` (tables to paste
into ``bench/RESULTS.md``) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from fastpipe.bench import tables

__all__ = ["PARTS", "add_arguments", "run"]

# part -> (seconds budget with --quick, without)
PARTS: dict[str, tuple[float, float]] = {
    "e2e": (120.0, 600.0),
    "schedules": (20.0, 60.0),
    "distributed": (90.0, 300.0),
    "zero-bubble": (90.0, 400.0),
    "copy": (30.0, 120.0),
    "kernels": (120.0, 600.0),
    "memory": (150.0, 1500.0),
    "fsdp": (90.0, 300.0),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``fastpipe bench`` flags."""
    p.add_argument("--quick", action="store_true", help="fewer rounds and smaller sweeps (under 8 min on one H200)")
    p.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of: {', '.join(PARTS)}")
    p.add_argument("--out", default="fastpipe-bench", help="folder for bench.json, PNG charts and results.md")
    p.add_argument(
        "--tiny",
        action="store_true",
        help="toy sizes for tests: every part in about 20 s on 2 CPU cores (the figures mean nothing)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _parts(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PARTS]
    if unknown or not names:
        raise ValueError(
            f"--only: unknown part(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(PARTS)}"
        )
    return list(dict.fromkeys(names))


def _chart(draw: Callable[[], None], result: dict[str, Any]) -> None:
    """Draws a PNG; without matplotlib the figures still count, with a note instead of the chart."""
    try:
        draw()
    except ImportError:
        result.setdefault("notes", []).append("no chart: matplotlib is not installed (pip install matplotlib)")


def _e2e(args: argparse.Namespace, deadline: float, out: str) -> dict[str, Any]:
    from fastpipe.bench.scaling import plot_e2e, run_e2e

    result = run_e2e(deadline, rounds=3 if args.quick or args.tiny else 7, tiny=args.tiny)
    _chart(lambda: plot_e2e(result, os.path.join(out, "e2e.png")), result)
    return result


def _schedules(args: argparse.Namespace, deadline: float, out: str) -> dict[str, Any]:
    from fastpipe.bench.schedules import plot, run

    if args.tiny or args.quick:
        rows = run(workers=(4,), microbatches=(4, 8, 16)) if args.tiny else run(microbatches=(4, 8, 16, 32))
    else:
        rows = run()
    result: dict[str, Any] = {"costs": {"F": 1, "B": 1, "W": 1}, "rows": rows}
    _chart(lambda: plot(rows, os.path.join(out, "schedules.png")), result)
    return result


def _distributed(args: argparse.Namespace, deadline: float, out: str) -> dict[str, Any]:
    from fastpipe.bench.ranks import spawn_runs
    from fastpipe.bench.scaling import host_workload, summarise

    w = host_workload(args.tiny)
    steps = 3 if args.quick or args.tiny else 7
    t_mb = "gradient accumulation, 1 device (T_mb)"
    times: dict[str, list[float]] = {t_mb: []}
    notes: list[str] = ["T_mb is timed on rank 0 just before each step, while the other ranks wait"]
    if w.cuda and w.k < 2:
        return {
            "skipped": "one rank per GPU needs 2 or more GPUs (NCCL refuses two ranks on one GPU)",
            "notes": ["skipped: one rank per GPU needs 2 or more GPUs"],
        }
    backend = "NCCL" if w.cuda else "gloo"
    runs = [("fastpipe", s) for s in ("1f1b", "gpipe")] + [("pipelining", s) for s in ("1f1b", "gpipe")]
    # A run starts only with 10 s of the budget left; the ranks are stopped at the budget's end.
    measured = spawn_runs(runs, w, warmup=1, steps=steps, timeout=max(deadline - time.monotonic(), 10.0), reserve=10.0)
    for method, sched in runs:
        name = (
            f"{'fastpipe DistributedPipe' if method == 'fastpipe' else 'torch.distributed.pipelining'} "
            f"{sched} ({w.k} {backend} ranks)"
        )
        if (method, sched) in measured.times:
            times[name], paired = measured.times[(method, sched)]
            times[t_mb] += paired
        else:
            notes.append(f"{name}: {measured.missing[(method, sched)]}")
    if not times[t_mb]:
        raise RuntimeError("no multi-process run finished: " + "; ".join(notes[1:]))
    return summarise(times, w, notes)


def _zero_bubble(args: argparse.Namespace, deadline: float, out: str) -> dict[str, Any]:
    from fastpipe.bench.zero_bubble import run_zero_bubble

    rounds = 3 if args.quick or args.tiny else 9
    return run_zero_bubble(max(deadline - time.monotonic(), 10.0), rounds, warmup=1 if args.tiny else 2, tiny=args.tiny)


def _copy(args: argparse.Namespace, deadline: float, out: str) -> dict[str, Any]:
    import fastpipe._C as _C
    from fastpipe.bench.copy_overlap import measure

    cuda = torch.cuda.is_available() and _C.backend_available("cuda")
    runs, target = (2, 20.0) if args.tiny else ((3, 100.0) if args.quick else (5, 200.0))
    return measure("cuda" if cuda else "host", runs, target, 64 if cuda else (1 if args.tiny else 16))


def _kernels(args: argparse.Namespace, deadline: float, out: str) -> dict[str, Any]:
    from fastpipe.bench.kernels import run_kernels
    from fastpipe.bench.report import write_json

    # The suite prints the kernel tables once, in results.md's markdown; run_kernels prints nothing.
    result = run_kernels(use_compile=not (args.quick or args.tiny))
    write_json(result, os.path.join(out, "kernels.json"))
    return result


def _memory(args: argparse.Namespace, deadline: float, out: str) -> dict[str, Any]:
    from fastpipe.bench.largest import run_largest
    from fastpipe.bench.largest_report import largest_markdown, plot_largest
    from fastpipe.bench.memory import plot_memory, run_memory
    from fastpipe.bench.scaling import host_workload

    w = host_workload(args.tiny)
    # The workload's batch, and 16 times it, where activations rather than weights fill the device.
    result = run_memory(w.hidden, w.ffn, [w.batch, 16 * w.batch])
    _chart(lambda: plot_memory(result, os.path.join(out, "memory.png")), result)
    if args.quick and not args.tiny and torch.cuda.is_available():
        # Its ranks run on CPU there too (one per GPU needs 4 GPUs), so --quick leaves it to a CPU host.
        result.setdefault("notes", []).append(
            "largest model per system: not run with --quick on a GPU host; run fastpipe bench --only memory"
        )
        return result
    largest = run_largest("tiny" if args.tiny else "quick" if args.quick else "full", deadline=deadline)
    largest["markdown"] = largest_markdown(largest)
    result["largest"] = largest
    _chart(lambda: plot_largest(largest, os.path.join(out, "largest.png")), result)
    return result


def _fsdp(args: argparse.Namespace, deadline: float, out: str) -> dict[str, Any]:
    from fastpipe.bench.fsdp import run_fsdp

    size = "tiny" if args.tiny else "quick" if args.quick else "full"
    return run_fsdp(max(deadline - time.monotonic(), 10.0), size)


_RUNNERS: dict[str, Callable[[argparse.Namespace, float, str], dict[str, Any]]] = {
    "e2e": _e2e,
    "schedules": _schedules,
    "distributed": _distributed,
    "zero-bubble": _zero_bubble,
    "copy": _copy,
    "kernels": _kernels,
    "memory": _memory,
    "fsdp": _fsdp,
}


# The files each part may write beside bench.json and results.md (a chart needs matplotlib).
_FILES: dict[str, tuple[str, ...]] = {
    "e2e": ("e2e.png",),
    "schedules": ("schedules.png",),
    "kernels": ("kernels.json",),
    "memory": ("memory.png", "largest.png"),
}


def _written(out: str, names: list[str]) -> list[str]:
    """The names of the files this run wrote to ``out``, in the order of its parts."""
    files = ["bench.json", "results.md"] + [f for n in names for f in _FILES.get(n, ())]
    return [f for f in files if os.path.exists(os.path.join(out, f))]


def _host() -> dict[str, Any]:
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "gpus": gpus,
        "loadavg_1m": os.getloadavg()[0],
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def run(args: argparse.Namespace) -> int:
    """Runs the chosen parts; returns 0 if every part succeeded, else 1."""
    from tqdm import tqdm

    names = _parts(args.only)
    os.makedirs(args.out, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    report: dict[str, Any] = {"host": _host(), "quick": args.quick, "tiny": args.tiny, "parts": {}}
    if args.tiny and {"distributed", "zero-bubble", "memory", "fsdp"} & set(names):
        # Its imports (seconds) then overlap the in-process parts; at --tiny no timing is meant to hold.
        from fastpipe.bench.ranks import warm_fork_server

        warm_fork_server()
    bar = tqdm(names, desc="fastpipe bench", unit="part", disable=args.no_progress, file=sys.stderr)
    failed = False
    for name in bar:
        bar.set_postfix(part=name)
        budget = PARTS[name][0 if args.quick or args.tiny else 1]
        t0 = time.monotonic()
        try:
            result = _RUNNERS[name](args, t0 + budget, args.out)
            entry: dict[str, Any] = {"status": "ok", "result": result}
        except Exception as exc:  # noqa: BLE001 - one failing part must not hide the others
            failed = True
            entry = {
                "status": "failed",
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(limit=6),
            }
            print(f"fastpipe bench: {name} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        entry["seconds"] = time.monotonic() - t0
        entry["budget_s"] = budget
        report["parts"][name] = entry
    bar.close()
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    markdown = tables.markdown(report)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(markdown)
    print(markdown)
    print(f"fastpipe bench: wrote {', '.join(_written(args.out, names))} in {os.path.abspath(args.out)}")
    summary = {n: [e["status"], round(e["seconds"], 1)] for n, e in report["parts"].items()}
    print("JSON " + json.dumps(summary))  # one line for bench/gpu_check.sh's summary table
    return 1 if failed else 0
