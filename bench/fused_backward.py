"""zb-v with its adjacent B/W pairs fused (``fastpipe.schedule.fuse.fuse_backward``), against zb-v, dualpipev and 1F1B.

One process, a ``Pipe`` with 2 worker threads (one intra-op thread each), the reference workload
(8 residual MLP blocks 512/2048, batch 256, 8 micro-batches), checkpoint never: zb-v, its fused
form and dualpipev on 4 stages of 2 blocks in a V, 1F1B on 2 stages of 4 blocks. Each round runs
one step of each, in an order that rotates per round; ratios are medians over the rounds of the
two steps of one round (paired).

Usage::

    python bench/fused_backward.py --rounds 15
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

import fastpipe  # noqa: E402
from fastpipe.bench.steps import LOSS  # noqa: E402
from fastpipe.bench.workload import CHUNKS, make_batch, make_model  # noqa: E402
from fastpipe.schedule import build, simulate  # noqa: E402
from fastpipe.schedule.fuse import fuse_backward  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    x, y = make_batch()

    def v_shaped(schedule: str) -> fastpipe.Pipe:  # 4 stages of 2 blocks on 2 worker threads
        return fastpipe.Pipe(
            make_model(),
            [2, 2, 2, 2],
            devices=["cpu"] * 2,
            chunks=CHUNKS,
            schedule=schedule,
            virtual_stages=2,
            checkpoint="never",
        )

    v, d = v_shaped("zb-v"), v_shaped("dualpipev")
    one = fastpipe.Pipe(make_model(), [4, 4], chunks=CHUNKS, schedule="1f1b", checkpoint="never")
    fused = fuse_backward(build("zb-v", 2, CHUNKS))
    methods = {
        "zb-v": lambda: v.train_step(x, y, LOSS),
        "zb-v+fused": lambda: v.train_step(x, y, LOSS, schedule=fused),
        "dualpipev": lambda: d.train_step(x, y, LOSS),
        "1f1b": lambda: one.train_step(x, y, LOSS),
    }
    pipes = {"zb-v": v, "zb-v+fused": v, "dualpipev": d, "1f1b": one}
    names = list(methods)
    times: dict[str, list[float]] = {n: [] for n in names}
    load = os.getloadavg()[0]
    for r in range(args.warmup + args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            pipes[name].zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            methods[name]()
            if r >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    print(f"median of {args.rounds} paired rounds; load average {load:.2f} -> {os.getloadavg()[0]:.2f}")
    for name in names:
        print(f"{name:12s} {statistics.median(times[name]) * 1e3:7.0f} ms")
    for a, b in (("zb-v+fused", "zb-v"), ("zb-v+fused", "1f1b"), ("zb-v", "1f1b"), ("dualpipev", "1f1b")):
        print(f"{a} / {b}: {statistics.median(p / q for p, q in zip(times[a], times[b])):.3f}")
    unit = [0.5] * 4  # a V stage: half a 1F1B stage's work, at F = B = W = 1 per 1F1B stage
    for name, s in (("zb-v", build("zb-v", 2, CHUNKS)), ("zb-v+fused", fused)):
        print(f"simulated makespan {name}: {simulate(s, unit, unit, unit).makespan:.1f}")
    print(
        f"simulated makespan 1f1b: {simulate(build('1f1b', 2, CHUNKS), [1.0] * 2, [1.0] * 2, [1.0] * 2).makespan:.1f}"
    )


if __name__ == "__main__":
    main()
