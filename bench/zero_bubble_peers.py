"""fastpipe's V schedules against torch.distributed.pipelining's, paired rounds in the same 2 processes.

Two gloo ranks with one intra-op thread each run the reference workload (8 residual MLP blocks 512/2048,
batch 256, 8 micro-batches, ``fastpipe.bench.workload``) under:

* fastpipe ``DistributedPipe`` ``zb-v`` and ``dualpipev`` (4 stages of 2 blocks in a V: rank 0 holds
  stages 0 and 3, rank 1 stages 1 and 2) and ``1f1b`` (2 stages of 4 blocks), checkpoint never;
* ``torch.distributed.pipelining``'s ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` on the same 4
  stages, placed the same way.

Every method is built once per process; each round runs one step of every method, in an order that
rotates from round to round, each step timed between two barriers on rank 0. Per round, each
fastpipe step is divided by its peer's step of the same round (``paired``), which cancels the drift
between rounds; the medians over rounds are reported. Then a few traced steps of each fastpipe
schedule give the measured bubble (both ranks' rows merged on one clock) beside the simulator's,
priced with the per-action costs measured in those steps (``fastpipe.timing.simulate_measured``).

Usage::

    python bench/zero_bubble_peers.py --rounds 9 --json bench/results/zero_bubble_peers.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

from fastpipe.bench.report import write_json  # noqa: E402
from fastpipe.bench.steps import LOSS, free_port  # noqa: E402
from fastpipe.bench.workload import BATCH, CHUNKS, make_batch, make_model  # noqa: E402

K = 2
PAIRS = {"fastpipe zb-v": "pipelining ZBVZeroBubble", "fastpipe dualpipev": "pipelining DualPipeV"}


def _fastpipe(rank: int, schedule: str, x: torch.Tensor, y: torch.Tensor) -> Callable[..., Any]:
    from fastpipe.distributed_pipe import DistributedPipe

    balance = [4, 4] if schedule == "1f1b" else [2, 2, 2, 2]
    pipe = DistributedPipe(make_model(), balance, chunks=CHUNKS, schedule=schedule, checkpoint="never")

    def step(trace: bool = False) -> Any:
        pipe.zero_grad(set_to_none=True)
        pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, LOSS, trace=trace)
        return pipe.last_timeline

    return step


def _bubbles(rank: int, methods: dict[str, Callable[..., Any]], steps: int) -> dict[str, dict[str, float]]:
    """Measured bubble of traced fastpipe steps, and the simulator's from the costs measured in them.

    Each rank records its own row; perf_counter is one monotonic clock for the processes of a host,
    so rank 0 merges the rows into one timeline per step. The figures are medians over ``steps``.
    """
    from fastpipe.timing import simulate_measured
    from fastpipe.trace import Timeline

    out: dict[str, dict[str, float]] = {}
    for name in ("fastpipe zb-v", "fastpipe dualpipev", "fastpipe 1f1b"):
        measured, simulated = [], []
        for _ in range(steps):
            dist.barrier()
            events = methods[name](trace=True).events
            rows: list[Any] = [None] * K
            dist.all_gather_object(rows, events)
            merged = Timeline(K, [e for row in rows for e in row])
            schedule = name.split()[1]
            v = 1 if schedule == "1f1b" else 2
            measured.append(merged.bubble_fraction)
            simulated.append(simulate_measured(merged, schedule, K, CHUNKS, virtual_stages=v).bubble_fraction)
        out[name] = {"measured": statistics.median(measured), "simulated": statistics.median(simulated)}
    return out


def _pipelining(rank: int, name: str, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV, ScheduleZBVZeroBubble

    blocks = list(make_model())
    held = (rank, 2 * K - 1 - rank)  # the V: stages r and 2K-1-r on rank r
    parts = [nn.Sequential(*blocks[2 * s : 2 * s + 2]) for s in held]
    stages = [
        PipelineStage(p, stage_index=s, num_stages=2 * K, device=torch.device("cpu")) for p, s in zip(parts, held)
    ]
    cls = ScheduleZBVZeroBubble if name == "ZBVZeroBubble" else ScheduleDualPipeV
    sched = cls(stages, n_microbatches=CHUNKS, loss_fn=LOSS)

    def step() -> None:
        for p in parts:
            p.zero_grad(set_to_none=True)
        if rank == 0:  # stage 0 reads the input, stage 2K-1 (the loss) the target: both on rank 0
            sched.step(x, target=y, losses=[])
        else:
            sched.step()

    return step


def _worker(rank: int, port: int, warmup: int, rounds: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=K)
    x, y = make_batch()
    methods = {
        "fastpipe zb-v": _fastpipe(rank, "zb-v", x, y),
        "pipelining ZBVZeroBubble": _pipelining(rank, "ZBVZeroBubble", x, y),
        "fastpipe dualpipev": _fastpipe(rank, "dualpipev", x, y),
        "pipelining DualPipeV": _pipelining(rank, "DualPipeV", x, y),
        "fastpipe 1f1b": _fastpipe(rank, "1f1b", x, y),
    }
    names = list(methods)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            methods[name]()
            dist.barrier()
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
    bubbles = _bubbles(rank, methods, max(3, rounds // 3))
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "bubbles": bubbles}, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        mp.start_processes(_worker, args=(free_port(), args.warmup, args.rounds, out), nprocs=K, start_method="spawn")
        with open(out) as f:
            data = json.load(f)
    times: dict[str, list[float]] = data["times"]
    bubbles: dict[str, dict[str, float]] = data["bubbles"]
    load_after = os.getloadavg()
    med = {n: statistics.median(ts) for n, ts in times.items()}
    paired = {
        f"{ours} / {peer}": statistics.median(a / b for a, b in zip(times[ours], times[peer]))
        for ours, peer in PAIRS.items()
    }
    paired.update(
        {
            f"{ours} / fastpipe 1f1b": statistics.median(a / b for a, b in zip(times[ours], times["fastpipe 1f1b"]))
            for ours in PAIRS
        }
    )
    print(
        f"\nworkload: 8 residual MLP blocks 512/2048, batch {BATCH}, {CHUNKS} micro-batches, {K} gloo ranks x "
        f"1 thread; median of {args.rounds} paired rounds; load average {load_before[0]:.2f} -> {load_after[0]:.2f}"
    )
    for name, t in med.items():
        print(f"{name:30s} {t * 1e3:8.0f} ms")
    for name, ratio in paired.items():
        print(f"{name:50s} {ratio:6.3f}")
    print("\nbubble of traced steps: measured, and simulated from the costs measured in the same steps")
    for name, b in bubbles.items():
        print(f"{name:30s} measured {b['measured']:6.1%}  simulated {b['simulated']:6.1%}")
    result = {
        "rounds": args.rounds,
        "median_s": med,
        "paired_ratio": paired,
        "bubble": bubbles,
        "load_average": {"before": load_before, "after": load_after},
    }
    write_json(result, args.json)


if __name__ == "__main__":
    main()
