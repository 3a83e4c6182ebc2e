"""Paired step times at one size of the largest-model bench: PL and fastpipe alternating in the same ranks.

``fastpipe bench --only memory`` times each system in its own job, one after the other, so its
step times are unpaired. This script builds, for the same GPT in the same 4 gloo ranks:

* PL 1F1B with each block under ``torch.utils.checkpoint``: PL's largest configuration, the base;
* fastpipe 1f1b in the same configuration (the same arithmetic);
* with ``--planned``: fastpipe with its planner, ``DistributedPipe(model, "auto",
  checkpoint="auto", memory_limit=--budget-mib, optimizer_state="host")`` and Adam under
  ``HostOptimizer``, and PL's configuration with that optimizer too (what the optimizer alone
  gives PL);

and alternates their steps, so every round compares steps taken under the same load::

    OMP_NUM_THREADS=1 python bench/largest_paired.py --layers 54 --rounds 10 --planned
    OMP_NUM_THREADS=1 python bench/largest_paired.py --layers 26 --rounds 6 --no-per-block

The first round is a warm-up (fastpipe's first step also measures its stages). Each rank's peak
bytes over its first two steps are counted as the bench counts them
(:mod:`fastpipe.bench.largest_ranks`: everything alive above what the rank held before the system
was built; a host optimizer's copies and moments are host bytes). Each step's CPU time per rank
(``time.process_time``: every thread of the process) is reported too: 4 ranks on 2 cores are
CPU-bound, so CPU spent beside the arithmetic shows in the step.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SHAPE = {"vocab": 256, "seq": 64, "heads": 4, "width": 128, "batch": 16, "chunks": 8}
BASE = "PL 1F1B"
Built = tuple[Callable[[], None], Callable[[], None]]


def _stepper(pipe: Any, shape: dict[str, Any], optimizer: str) -> Built:
    from fastpipe.bench import largest_ranks as lr

    opt = lr._adam(pipe.parameters(), {"optimizer": optimizer})
    ids, target = lr._batch(shape)
    loss = lr.TokenLoss()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        pipe.train_step(ids if pipe.is_first else None, target if pipe.is_last else None, loss)
        opt.step()

    return step, pipe.close


def _fastpipe(shape: dict[str, Any], world: int, per_block: bool) -> Built:
    from fastpipe.bench import largest_ranks as lr
    from fastpipe.distributed_pipe import DistributedPipe

    balance = lr.stage_layers(shape["layers"], world)

    def builder(s: int) -> torch.nn.Sequential:
        return lr._sequential(range(sum(balance[:s]), sum(balance[: s + 1])), shape, per_block)

    pipe = DistributedPipe.from_stage_builder(
        builder, balance, chunks=shape["chunks"], schedule="1f1b", checkpoint="never", device="cpu"
    )
    return _stepper(pipe, shape, "device")


def _planned(shape: dict[str, Any], budget: int, plans: list[str]) -> Built:
    from fastpipe.bench import largest_ranks as lr
    from fastpipe.bench.largest_model import layer_count
    from fastpipe.distributed_pipe import DistributedPipe

    model = lr._sequential(range(layer_count(shape["layers"])), shape, False)
    ids, _ = lr._batch(shape)
    pipe = DistributedPipe(model, "auto", chunks=shape["chunks"], schedule="1f1b", checkpoint="auto",
                           memory_limit=budget, sample=ids, optimizer_state="host", device="cpu")  # fmt: skip
    assert pipe.plan is not None
    plans.append(pipe.plan.table())
    return _stepper(pipe, shape, "host")


def _rank(rank: int, world: int, port: int, args: dict[str, Any], out: str) -> None:
    from fastpipe.bench import largest_ranks as lr
    from fastpipe.memory import _cpu_counter
    from fastpipe.memory.accounting import PeakMeter

    torch.set_num_threads(1)
    _cpu_counter.install()  # before the systems' allocations
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    shape = dict(SHAPE, layers=args["layers"])
    per_block = args["per_block"]
    checkpoint = "blocks" if per_block else "never"
    makers: dict[str, Callable[[], Built]] = {
        BASE: lambda: lr._build(
            {"kind": "pipelining", "schedule": "1F1B", "checkpoint": checkpoint}, shape, rank, world
        )[:2],  # fmt: skip
        "fastpipe 1f1b": lambda: _fastpipe(shape, world, per_block),
    }
    plans: list[str] = []
    if args["planned"]:
        host = {"kind": "pipelining", "schedule": "1F1B", "checkpoint": checkpoint, "optimizer": "host"}
        makers["PL 1F1B + host optimizer"] = lambda: lr._build(host, shape, rank, world)[:2]
        makers["fastpipe planned + host optimizer"] = lambda: _planned(shape, args["budget"], plans)
    systems: dict[str, Built] = {}
    peaks: dict[str, int] = {}
    for name, make in makers.items():
        gc.collect()
        base = _cpu_counter.allocated()
        systems[name] = make()
        peak = 0
        for _ in range(2):  # the second step holds Adam's moments throughout
            dist.barrier()
            with PeakMeter("cpu") as meter:
                systems[name][0]()
            dist.barrier()
            peak = max(peak, meter.result.peak_total - base)
        peaks[name] = peak
    times: dict[str, list[float]] = {k: [] for k in systems}
    cpu: dict[str, list[float]] = {k: [] for k in systems}  # this process's CPU seconds, all its threads
    for _ in range(args["rounds"]):
        for name, (run, _) in systems.items():
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            run()
            cpu[name].append(time.process_time() - c0)
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
    every: list[Any] = [None] * world
    dist.all_gather_object(every, {"cpu": cpu, "peaks": peaks})
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "ranks": every, "plans": plans}, f)
    for _, close in systems.values():
        close()
    dist.destroy_process_group()


def main() -> None:
    from fastpipe.bench.steps import free_port

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=54)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--no-per-block", action="store_true", help="no torch.utils.checkpoint around each block")
    p.add_argument("--planned", action="store_true", help="add fastpipe's planner with a host optimizer")
    p.add_argument("--budget-mib", type=float, default=48.0, help="the planner's memory_limit per rank")
    args = p.parse_args()
    if args.rounds < 2:
        p.error("--rounds must be at least 2: the first is a warm-up")
    job = {"layers": args.layers, "rounds": args.rounds, "per_block": not args.no_per_block,
           "planned": args.planned, "budget": int(args.budget_mib * (1 << 20))}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        mp.start_processes(_rank, args=(4, free_port(), job, out), nprocs=4, start_method="spawn")
        with open(out) as f:
            found = json.load(f)
    for table in found["plans"]:
        print(table)
    times = found["times"]
    base = times[BASE][1:]
    for name, values in times.items():
        ms = [f"{v * 1e3:.0f}" for v in values]
        ratios = [a / b for a, b in zip(values[1:], base)]
        median = statistics.median(values[1:]) * 1e3
        shown = ", ".join(f"{r:.2f}" for r in ratios)
        print(f"{name}: ms {ms}, median after warm-up {median:.0f}, x {BASE} per round [{shown}], "
              f"median {statistics.median(ratios):.2f}")  # fmt: skip
        per_rank = [statistics.median(r["cpu"][name][1:]) * 1e3 for r in found["ranks"]]
        peaks = [r["peaks"][name] / (1 << 20) for r in found["ranks"]]
        print(f"  CPU ms per rank, median: {[round(c) for c in per_rank]}, all ranks {sum(per_rank):.0f}")
        print(f"  peak per rank, MiB: {[round(x, 1) for x in peaks]}")


if __name__ == "__main__":
    main()
