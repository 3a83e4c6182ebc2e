"""What NCCL's ordering discipline costs: the order-matched transport against the tag-matched one.

Both transports run on gloo here (``p2p="ordered"`` forces the one NCCL groups use),
inside the same two rank processes: each rank builds one ``DistributedPipe`` per transport
and alternates their steps, so machine drift hits both alike. Reported per schedule: the
median step time of each and the median of the per-round ratios ordered / tags.

Workload: the reference one of ``bench/distributed.py`` (8 residual MLP blocks 512/2048,
batch 256, 8 micro-batches, split [4, 4], one intra-op thread per rank).

Usage: ``python bench/transports.py --rounds 14 [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from fastpipe.bench.report import write_json  # noqa: E402
from fastpipe.bench.steps import LOSS  # noqa: E402
from fastpipe.bench.workload import CHUNKS, make_batch, make_model  # noqa: E402

SCHEDULES = ("1f1b", "gpipe", "zb-h1")


def _rank(rank: int, rounds: int, port: int, out: str) -> None:
    from fastpipe.distributed_pipe import DistributedPipe
    from fastpipe.runtime.host_alloc import tune_host_allocator

    tune_host_allocator()
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    x, y = make_batch()
    result = {}
    for schedule in SCHEDULES:
        pipes = {}
        for transport in ("tags", "ordered"):
            pipes[transport] = DistributedPipe(
                make_model(), [4, 4], chunks=CHUNKS, schedule=schedule, checkpoint="never", p2p=transport
            )
        times: dict[str, list[float]] = {t: [] for t in pipes}
        for i in range(rounds + 2):
            for transport, pipe in pipes.items():
                dist.barrier()
                t0 = time.perf_counter()
                pipe.zero_grad(set_to_none=True)
                pipe.train_step(x if rank == 0 else None, y if rank == 1 else None, LOSS)
                dist.barrier()
                if i >= 2:  # warm-up
                    times[transport].append(time.perf_counter() - t0)
        for pipe in pipes.values():
            pipe.close()
        ratios = [o / t for o, t in zip(times["ordered"], times["tags"])]
        result[schedule] = {
            "tags_s": statistics.median(times["tags"]),
            "ordered_s": statistics.median(times["ordered"]),
            "paired_ratio": statistics.median(ratios),
        }
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=14)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
        port = store.port  # a free port; released just before the ranks bind it
        del store
        mp.start_processes(_rank, args=(args.rounds, port, out), nprocs=2, start_method="spawn")
        with open(out) as f:
            result = json.load(f)
    print(f"2 gloo ranks x 1 thread, reference workload; median of {args.rounds} alternating rounds")
    print(f"{'schedule':10s} {'tags ms':>8s} {'ordered ms':>11s} {'ordered/tags':>13s}")
    for schedule, r in result.items():
        print(f"{schedule:10s} {r['tags_s'] * 1e3:8.0f} {r['ordered_s'] * 1e3:11.0f} {r['paired_ratio']:13.3f}")
    print("JSON " + json.dumps(result))
    write_json(result, args.json)


if __name__ == "__main__":
    main()
