"""Each schedule's counted peak bytes per device at K ranks: the README's schedule table, measured.

One gloo rank per pipeline worker (two stages per rank for the V schedules), each a process
whose CPU bytes are that device's, counted exactly by :mod:`fastpipe.memory._cpu_counter`.
Every rank runs every schedule in turn on the same MLP (``2K`` blocks of width ``hidden`` and
``4 hidden``), one untimed step, then one step under a :class:`~fastpipe.memory.accounting.PeakMeter`.
The meter counts above what is alive at the step's start (the parameters, the batch), so a
rank's figure is what the step adds: activations, W records, gradients, receive buffers.
No recompute, W batches as ``wgrad_batch`` says.

Run it as ``python -m fastpipe.bench.schedule_peaks --ranks 8 --chunks 32``; it prints, per
schedule, the fullest rank's bytes, its ratio to 1F1B's, and the memory model's prediction of
that rank (:func:`fastpipe.memory.model.predict_memory`).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from fastpipe.bench.ranks import join_within, start_ranks
from fastpipe.bench.steps import free_port

__all__ = ["SCHEDULES", "SchedulePeak", "count_peaks", "main", "predict_peaks", "table"]

#: The schedules of the README's table, and whether each runs two stages per rank (a V).
SCHEDULES: dict[str, bool] = {
    "gpipe": False,
    "1f1b": False,
    "interleaved": True,
    "zb-h1": False,
    "zb-h2": False,
    "zb-v": True,
    "dualpipev": True,
}


@dataclass
class SchedulePeak:
    """One schedule's counted and predicted peak bytes per rank."""

    schedule: str
    counted: list[int]
    predicted: list[int]

    @property
    def fullest(self) -> int:
        """The rank that holds the most."""
        return max(range(len(self.counted)), key=self.counted.__getitem__)


class _ProductLoss(nn.Module):
    reduction = "mean"  # a mean over samples: no per-micro-batch weighting to warn about

    def forward(self, out: Tensor, target: Tensor) -> Tensor:
        return (out * target).mean()


def _model(blocks: int, hidden: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden)) for _ in range(blocks)]
    )


def _balance(ranks: int, v: bool) -> list[int]:
    return [1] * (2 * ranks) if v else [2] * ranks


def _rank(rank: int, ranks: int, schedules: Sequence[str], spec: dict[str, int], port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    import fastpipe
    from fastpipe.memory._cpu_counter import install
    from fastpipe.memory.accounting import PeakMeter

    m, rows, hidden = spec["chunks"], spec["rows"], spec["hidden"]
    x, y = torch.randn(m * rows, hidden), torch.randn(m * rows, hidden)
    install()
    peaks: dict[str, int] = {}
    for schedule in schedules:
        pipe = fastpipe.DistributedPipe(
            _model(2 * ranks, hidden),
            _balance(ranks, SCHEDULES[schedule]),
            chunks=m,
            schedule=schedule,
            checkpoint="never",
            wgrad_batch=spec["wgrad_batch"],
        )
        pipe.train_step(x, y, _ProductLoss())  # builds what later steps reuse (receive buffers)
        pipe.zero_grad(set_to_none=True)
        gc.collect()
        with PeakMeter("cpu") as meter:
            pipe.train_step(x, y, _ProductLoss())
        peaks[schedule] = meter.result.peak
        del pipe
        gc.collect()
    gathered: list[Any] = [None] * ranks
    dist.all_gather_object(gathered, peaks)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.barrier()
    dist.destroy_process_group()


def count_peaks(
    ranks: int,
    chunks: int,
    schedules: Sequence[str],
    *,
    hidden: int = 64,
    rows: int = 32,
    wgrad_batch: int = 2,
    timeout: float = 600.0,
) -> dict[str, list[int]]:
    """Each schedule's counted peak bytes per rank, from ``ranks`` spawned gloo ranks."""
    unknown = [s for s in schedules if s not in SCHEDULES]
    if unknown:
        raise ValueError(f"fastpipe: unknown schedules {unknown}; choose from {list(SCHEDULES)}")
    spec = {"chunks": chunks, "rows": rows, "hidden": hidden, "wgrad_batch": wgrad_batch}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "peaks.json")
        ctx = start_ranks(_rank, (ranks, list(schedules), spec, free_port(), out), ranks)
        join_within(ctx, timeout, "the schedule-peak ranks")
        with open(out) as f:
            gathered = json.load(f)
    return {s: [int(g[s]) for g in gathered] for s in schedules}


def predict_peaks(
    ranks: int, chunks: int, schedule: str, *, hidden: int = 64, rows: int = 32, wgrad_batch: int = 2
) -> list[int]:
    """The memory model's bytes per rank above the parameters, for the run :func:`count_peaks` makes."""
    from fastpipe.memory.model import predict_memory
    from fastpipe.memory.receive_buffers import buffered_stages
    from fastpipe.memory.stage_bytes import measure_stages
    from fastpipe.schedule.builders import build

    v = SCHEDULES[schedule]
    x, y = torch.randn(rows, hidden), torch.randn(rows, hidden)
    stages = measure_stages(_model(2 * ranks, hidden), _balance(ranks, v), x, loss_fn=_ProductLoss(), target=y)
    built = build(schedule, ranks, chunks, **({"virtual_stages": 2} if v else {}))
    # The gloo transport's receive buffers exist before the counted step: a received input lives in one.
    devices = predict_memory(built, buffered_stages(built, stages, "tags"), checkpoint="never", wgrad_batch=wgrad_batch)
    return [d.total - d.parameters for d in devices]


def table(peaks: Sequence[SchedulePeak]) -> str:
    """A Markdown table: each schedule's fullest rank, its ratio to 1F1B's, and the model's figure."""
    base = next((p for p in peaks if p.schedule == "1f1b"), None)
    lines = [
        "| schedule | fullest rank | counted (MiB) | vs 1F1B | predicted (MiB) | error |",
        "|---|---|---|---|---|---|",
    ]
    for p in peaks:
        r = p.fullest
        got, want = p.counted[r], p.predicted[r]
        ratio = f"{got / max(base.counted):.2f}x" if base is not None else "n/a"
        lines.append(
            f"| `{p.schedule}` | {r} | {got / 2**20:.2f} | {ratio} | {want / 2**20:.2f} | {want / got - 1:+.1%} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """Count and print every schedule's peak per rank (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m fastpipe.bench.schedule_peaks", description=__doc__)
    parser.add_argument("--ranks", type=int, default=8, help="pipeline workers, one gloo rank each (default 8)")
    parser.add_argument("--chunks", type=int, default=32, help="micro-batches per step (default 32)")
    parser.add_argument("--hidden", type=int, default=64, help="the MLP's width; its blocks are 4x wider (default 64)")
    parser.add_argument("--wgrad-batch", type=int, default=2, help="W batch width of the split schedules (default 2)")
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated (default: all)")
    args = parser.parse_args(argv)
    schedules = [s for s in args.schedules.split(",") if s]
    counted = count_peaks(args.ranks, args.chunks, schedules, hidden=args.hidden, wgrad_batch=args.wgrad_batch)
    peaks = [
        SchedulePeak(
            s, counted[s], predict_peaks(args.ranks, args.chunks, s, hidden=args.hidden, wgrad_batch=args.wgrad_batch)
        )
        for s in schedules
    ]
    print(f"K={args.ranks} ranks, M={args.chunks}, hidden {args.hidden}, W batch {args.wgrad_batch}, no recompute")
    print(table(peaks))


if __name__ == "__main__":
    main()
