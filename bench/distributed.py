"""Distributed pipeline step time on the reference workload, side by side in one run.

Two gloo processes with one intra-op thread each run the foundation workload (8 residual
MLP blocks 512/2048, batch 256, 8 micro-batches, split [4, 4]) with:

* fastpipe's ``DistributedPipe`` (1F1B, GPipe and ZB-H1, checkpoint never; with
  ``--ordered`` also 1F1B over the order-matched transport that NCCL groups use);
* ``torch.distributed.pipelining`` (Schedule1F1B and ScheduleGPipe, the same split and
  micro-batches);

and every figure is a ratio to the limit T_mb/2 × 9/8, where T_mb is one thread doing the
same 8 micro-batches one after another (gradient accumulation), measured in the same run
(between the distributed runs; the median of all its rounds). Each distributed
step is timed between two barriers on rank 0; the median over rounds is reported. Column
``paired``: before every step rank 0 also times T_mb while the other rank waits, and the
median over steps of each step over its own limit is reported, which cancels the drift
between separately timed phases.

Usage::

    python bench/distributed.py --rounds 7 --repeats 2 --json bench/out/distributed.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from fastpipe.bench.report import write_json  # noqa: E402
from fastpipe.bench.steps import LOSS, accumulation_step, timed_rounds  # noqa: E402
from fastpipe.bench.steps import pippy_worker as _pippy_worker  # noqa: E402
from fastpipe.bench.workload import BATCH, CHUNKS, make_batch, make_model  # noqa: E402
from fastpipe.runtime.host_alloc import tune_host_allocator  # noqa: E402

K = 2


def _fastpipe_worker(
    rank: int, schedule: str, warmup: int, steps: int, port: int, out: str, paired: bool = True
) -> None:
    from fastpipe.distributed_pipe import DistributedPipe

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    schedule, _, transport = schedule.partition("+")
    if transport:  # "ordered": the order-matched transport NCCL runs, here over gloo
        os.environ["FASTPIPE_P2P"] = transport
    dist.init_process_group("gloo", rank=rank, world_size=K)
    pipe = DistributedPipe(make_model(), [4, 4], chunks=CHUNKS, schedule=schedule, checkpoint="never")
    x, y = make_batch()

    def step() -> None:
        pipe.zero_grad(set_to_none=True)
        pipe.train_step(x if rank == 0 else None, y if rank == K - 1 else None, LOSS)

    timed_rounds(rank, step, warmup, steps, out, paired)
    pipe.close()
    dist.destroy_process_group()


def _spawn(worker: object, name: str, warmup: int, steps: int) -> tuple[list[float], list[float]]:
    """Step times, and T_mb timed on rank 0 just before each step."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
        port = store.port  # a free port; released just before the ranks bind it
        del store
        mp.start_processes(worker, args=(name, warmup, steps, port, out, True), nprocs=K, start_method="spawn")
        with open(out) as f:
            result = json.load(f)
        return list(result["steps"]), list(result["t_mb"])


def _t_mb(rounds: int) -> list[float]:
    torch.set_num_threads(1)
    x, y = make_batch()
    step = accumulation_step(make_model(), x, y, CHUNKS)
    step()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="passes over all methods (alternating)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--skip-pipelining", action="store_true")
    parser.add_argument(
        "--ordered",
        action="store_true",
        help="also run fastpipe 1F1B over the order-matched transport NCCL uses (on gloo)",
    )
    args = parser.parse_args()

    # T_mb runs under the same allocator settings as fastpipe's ranks (see
    # fastpipe.runtime.host_alloc), so the limit is not inflated by page faults that
    # fastpipe itself avoids. torch.distributed.pipelining's ranks keep glibc's defaults.
    tune_host_allocator()
    load_before = os.getloadavg()
    runs = [(f"fastpipe {s} (2 gloo ranks)", _fastpipe_worker, s) for s in ("1f1b", "gpipe", "zb-h1")]
    if args.ordered:
        runs += [(f"fastpipe {s}, NCCL's ordered transport", _fastpipe_worker, f"{s}+ordered") for s in ("1f1b",)]
    if not args.skip_pipelining:
        runs += [(f"pipelining {s} (2 gloo ranks)", _pippy_worker, s) for s in ("1f1b", "gpipe")]
    times: dict[str, list[float]] = {}
    paired: dict[str, list[float]] = {}
    scale = (CHUNKS + K - 1) / (CHUNKS * K)
    t_mb_times: list[float] = []
    for _ in range(args.repeats):  # T_mb is measured between the runs, so it sees the same load
        for name, worker, sched in runs:
            t_mb_times += _t_mb(max(1, args.rounds // 2))
            try:
                steps, t_mbs = _spawn(worker, sched, args.warmup, args.rounds)
            except Exception as exc:  # noqa: BLE001 - report and go on without it
                print(f"{name} failed: {exc}", file=sys.stderr)
                continue
            times.setdefault(name, []).extend(steps)
            paired.setdefault(name, []).extend(t / (tm * scale) for t, tm in zip(steps, t_mbs))
    t_mb_times += _t_mb(max(1, args.rounds // 2))
    load_after = os.getloadavg()

    t_mb = statistics.median(t_mb_times)
    limit = t_mb * scale
    med = {name: statistics.median(ts) for name, ts in times.items()}
    paired_med = {name: statistics.median(rs) for name, rs in paired.items()}
    print(
        f"\nworkload: 8 residual MLP blocks 512/2048, batch {BATCH}, {CHUNKS} micro-batches, {K} gloo ranks x "
        f"1 thread; median of {args.repeats} x {args.rounds} steps; load average {load_before[0]:.2f} -> "
        f"{load_after[0]:.2f}"
    )
    print(f"limit T_mb/K x (M+K-1)/M = {limit * 1e3:.0f} ms  (T_mb = {t_mb * 1e3:.0f} ms)\n")
    print(f"{'method':40s} {'ms':>8s} {'x limit':>8s} {'paired':>8s}")
    for name, t in med.items():
        print(f"{name:40s} {t * 1e3:8.0f} {t / limit:8.2f} {paired_med[name]:8.2f}")
    result = {
        "limit_s": limit,
        "t_mb_s": t_mb,
        "rounds": args.rounds,
        "repeats": args.repeats,
        "median_s": med,
        "ratio_to_limit": {n: t / limit for n, t in med.items()},
        "paired_ratio_to_limit": paired_med,
        "load_average": {"before": load_before, "after": load_after},
    }
    print(json.dumps(result))
    write_json(result, args.json)


if __name__ == "__main__":
    main()
