"""Paired step times at one size of the largest-model bench: PL and fastpipe alternating in the same ranks.

``fastpipe bench --only memory`` times each system in its own job, one after the other, so its
step times are unpaired. This script builds PL 1F1B and fastpipe 1f1b (fused weight gradients on
and off) for the same GPT in the same 4 gloo ranks and alternates their steps, so every round
compares steps taken under the same load::

    OMP_NUM_THREADS=1 python bench/largest_paired.py --layers 54 --rounds 6
    OMP_NUM_THREADS=1 python bench/largest_paired.py --layers 26 --rounds 6 --no-per-block

The first round is a warm-up (fastpipe's first step also measures its stages). Each step's CPU
time per rank (``time.process_time``: every thread of the process) is reported too: 4 ranks on 2
cores are CPU-bound, so CPU spent beside the arithmetic shows in the step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SHAPE = {"vocab": 256, "seq": 64, "heads": 4, "width": 128, "batch": 16, "chunks": 8}


def _fastpipe(shape: dict[str, Any], world: int, per_block: bool, fused: bool) -> Any:
    from fastpipe.bench import largest_ranks as lr
    from fastpipe.distributed_pipe import DistributedPipe

    balance = lr.stage_layers(shape["layers"], world)

    def builder(s: int) -> torch.nn.Sequential:
        return lr._sequential(range(sum(balance[:s]), sum(balance[: s + 1])), shape, per_block)

    pipe = DistributedPipe.from_stage_builder(
        builder, balance, chunks=shape["chunks"], schedule="1f1b", checkpoint="never", device="cpu", fused_wgrad=fused
    )
    opt = lr._adam(pipe.parameters(), {})
    ids, target = lr._batch(shape)
    loss = lr.TokenLoss()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        pipe.train_step(ids if pipe.is_first else None, target if pipe.is_last else None, loss)
        opt.step()

    return step, pipe.close


def _rank(rank: int, world: int, port: int, layers: int, rounds: int, per_block: bool, out: str) -> None:
    from fastpipe.bench import largest_ranks as lr

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    shape = dict(SHAPE, layers=layers)
    pl = {"kind": "pipelining", "schedule": "1F1B", "checkpoint": "blocks" if per_block else "never"}
    step, _, _ = lr._build(pl, shape, rank, world)
    systems = {"PL 1F1B": (step, lambda: None)}
    systems["fastpipe 1f1b"] = _fastpipe(shape, world, per_block, True)
    systems["fastpipe 1f1b, fused_wgrad=False"] = _fastpipe(shape, world, per_block, False)
    times: dict[str, list[float]] = {k: [] for k in systems}
    cpu: dict[str, list[float]] = {k: [] for k in systems}  # this process's CPU seconds, all its threads
    for _ in range(rounds):
        for name, (run, _) in systems.items():
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            run()
            cpu[name].append(time.process_time() - c0)
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
    every: list[Any] = [None] * world
    dist.all_gather_object(every, cpu)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "cpu": every}, f)
    for _, close in systems.values():
        close()
    dist.destroy_process_group()


def main() -> None:
    from fastpipe.bench.steps import free_port

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=54)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--no-per-block", action="store_true", help="no torch.utils.checkpoint around each block")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        mp.start_processes(
            _rank,
            args=(4, free_port(), args.layers, args.rounds, not args.no_per_block, out),
            nprocs=4,
            start_method="spawn",
        )
        with open(out) as f:
            found = json.load(f)
    times = found["times"]
    base = times["PL 1F1B"][1:]
    for name, values in times.items():
        ms = [f"{v * 1e3:.0f}" for v in values]
        ratios = [f"{a / b:.2f}" for a, b in zip(values[1:], base)]
        median = statistics.median(values[1:]) * 1e3
        per_rank = [statistics.median(c[name][1:]) * 1e3 for c in found["cpu"]]
        print(f"{name}: ms {ms}, median after warm-up {median:.0f}, x PL per round {ratios}")
        print(f"  CPU ms per rank, median: {[round(c) for c in per_rank]}, all ranks {sum(per_rank):.0f}")


if __name__ == "__main__":
    main()
