"""How fast is each core when both work? A probe of what the pipelining limit leaves out.

The limit T_mb/K x (M+K-1)/M assumes each of the K cores runs its stage as fast as one core
runs alone. This probe measures that assumption on the reference workload, no pipeline
involved:

* ``alone cpuN``: the gradient accumulation over the 8 micro-batches of one half of the
  model (4 blocks), pinned to core N, the other core idle;
* ``together``: both halves at once, one thread pinned to each core, no dependencies between
  them. Its per-core time over ``alone`` is the slowdown from sharing the machine.

Usage: ``python bench/corun.py --rounds 7 [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from fastpipe.bench.report import write_json  # noqa: E402
from fastpipe.bench.steps import accumulation_step  # noqa: E402
from fastpipe.bench.workload import CHUNKS, make_batch, make_model  # noqa: E402
from fastpipe.runtime.host_alloc import tune_host_allocator  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))[:2]
    if len(cpus) < 2:
        raise SystemExit("needs two cores")
    tune_host_allocator()
    torch.set_num_threads(1)
    x, y = make_batch()
    halves = [accumulation_step(make_model(4, seed=s), x, y, CHUNKS) for s in (0, 1)]
    times: dict[str, list[float]] = {f"alone cpu{c}": [] for c in cpus}
    times.update({f"together cpu{c}": [] for c in cpus})

    def timed(step: object, cpu: int, key: str) -> None:
        os.sched_setaffinity(0, {cpu})  # this thread only (Linux: 0 is the calling thread)
        t0 = time.perf_counter()
        step()  # type: ignore[operator]
        times[key].append(time.perf_counter() - t0)

    for h in halves:
        h()
    for _ in range(args.rounds):
        for c, h in zip(cpus, halves):
            threading.Thread(target=timed, args=(h, c, f"alone cpu{c}")).run()  # in this thread, pinned
        threads = [threading.Thread(target=timed, args=(h, c, f"together cpu{c}")) for c, h in zip(cpus, halves)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        os.sched_setaffinity(0, set(cpus))
    med = {k: statistics.median(v) for k, v in times.items()}
    slowdown = {f"cpu{c}": med[f"together cpu{c}"] / med[f"alone cpu{c}"] for c in cpus}
    print(f"half the reference model, 8 micro-batches, 1 thread; median of {args.rounds} rounds")
    for k, v in med.items():
        print(f"{k:16s} {v * 1e3:7.0f} ms")
    print("slowdown from both cores working: " + ", ".join(f"{k} {v:.3f}" for k, v in slowdown.items()))
    result = {"median_s": med, "slowdown": slowdown, "rounds": args.rounds}
    print("JSON " + json.dumps(result))
    write_json(result, args.json)


if __name__ == "__main__":
    main()
