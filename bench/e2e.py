"""End-to-end step time on the reference workload, side by side in one run.

Compares, on CPU:

* plain ``nn.Sequential``: full batch with 1 and 2 intra-op threads, and T_mb, the same
  M micro-batches one after another (gradient accumulation, 1 thread);
* fastpipe, 2 stages, 1 intra-op thread per stage: ``pipe(x)`` + ``loss.backward()``
  (GPipe; checkpoint never / except_last), ``train_step`` with 1F1B and zero-bubble, and
  one stage (the engine's own overhead against T_mb);
* torchgpipe, 2 stages on CPU, 1 thread;
* ``torch.distributed.pipelining`` (GPipe and 1F1B) with 2 gloo ranks, 1 thread each.

Every figure is reported as a ratio to the physical limit T_mb/K × (M+K−1)/M, measured in
the same run. Timed steps are interleaved round-robin so machine noise hits all methods
alike; the median over rounds is reported, and (column ``paired``) the median over rounds of
each step over the limit from the same round's T_mb, which cancels drift between rounds.

Usage::

    python bench/e2e.py --rounds 7 --json bench/out/e2e.json --png bench/out/e2e.png
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from fastpipe import Pipe  # noqa: E402
from fastpipe.bench.report import write_json  # noqa: E402
from fastpipe.bench.steps import (  # noqa: E402
    LOSS,
    accumulation_step,
    pipe_step,
    pippy_times,
    pippy_worker,
    plain_step,
    timed_rounds,
    train_step,
)
from fastpipe.bench.workload import BATCH, CHUNKS, make_batch, make_model  # noqa: E402

# Kept importable under their former names (other scripts and notes refer to them).
_pippy_worker = pippy_worker
__all__ = ["LOSS", "accumulation_step", "pipe_step", "pippy_times", "plain_step", "timed_rounds", "train_step", "main"]


def plot_ratios(ratio_to_limit: dict[str, float], path: str) -> None:
    """Bars of each method's step time over the limit, labelled, with the limit (1.0) dashed."""
    from fastpipe.bench.charts import ratio_chart

    ratio_chart(
        path,
        list(ratio_to_limit),
        list(ratio_to_limit.values()),
        reference=1.0,
        reference_label="physical limit T_mb/K x (M+K-1)/M",
        xlabel="step time / limit; lower is better",
        dpi=110,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", default=None)
    parser.add_argument("--png", default=None, help="bar chart of the ratios to the limit")
    parser.add_argument("--trace", default=None, help="Chrome trace JSON of one fastpipe step")
    parser.add_argument("--gantt", default=None, help="PNG Gantt chart of one fastpipe step")
    parser.add_argument("--skip-baselines", action="store_true", help="skip torchgpipe and pipelining")
    args = parser.parse_args()

    from tqdm import tqdm

    torch.set_num_threads(1)
    x, y = make_batch()
    k, m = 2, CHUNKS
    methods: dict[str, Callable[[], None]] = {}
    plain = make_model()
    methods["plain 1 thread"] = plain_step(plain, x, y, 1)
    methods["plain 2 threads"] = plain_step(plain, x, y, 2)
    methods["T_mb (accumulate 8 mb)"] = accumulation_step(plain, x, y, m)
    pipes = {
        "fastpipe [4,4] never": Pipe(make_model(), balance=[4, 4], chunks=m, checkpoint="never"),
        "fastpipe [4,4] except_last": Pipe(make_model(), balance=[4, 4], chunks=m, checkpoint="except_last"),
        "fastpipe [8] never": Pipe(make_model(), balance=[8], chunks=m, checkpoint="never"),
    }
    # The same without accumulating Linear weight gradients in the GEMM (runtime/wgrad.py),
    # which plain gradient accumulation, and so T_mb, does not do: shows what pipelining
    # alone achieves against the limit.
    os.environ["FASTPIPE_FUSED_WGRAD"] = "0"
    pipes["fastpipe [4,4] never, unfused"] = Pipe(make_model(), balance=[4, 4], chunks=m, checkpoint="never")
    pipes["fastpipe [8] never, unfused"] = Pipe(make_model(), balance=[8], chunks=m, checkpoint="never")
    del os.environ["FASTPIPE_FUSED_WGRAD"]
    for name, pipe in pipes.items():
        methods[name] = pipe_step(pipe, x, y)
    for sched in ("1f1b", "zb-h1"):
        pipe = Pipe(make_model(), balance=[4, 4], chunks=m, checkpoint="never")
        methods[f"fastpipe train_step {sched}"] = train_step(pipe, x, y, sched)
    if not args.skip_baselines:
        try:
            from torchgpipe import GPipe

            tg = GPipe(make_model(), balance=[4, 4], devices=["cpu", "cpu"], chunks=m, checkpoint="never")
            methods["torchgpipe [4,4] never"] = pipe_step(tg, x, y)
        except Exception as exc:  # noqa: BLE001 - report and go on without it
            print(f"torchgpipe unavailable: {exc}", file=sys.stderr)

    times: dict[str, list[float]] = {name: [] for name in methods}
    for step in methods.values():  # warm-up
        step()
    for _ in tqdm(range(args.rounds), desc="rounds", file=sys.stderr):
        for name, step in methods.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    if not args.skip_baselines:
        for sched in ("gpipe", "1f1b"):
            try:
                times[f"pipelining {sched} (2 gloo ranks)"] = pippy_times(sched, 2, args.rounds)
            except Exception as exc:  # noqa: BLE001
                print(f"torch.distributed.pipelining ({sched}) failed: {exc}", file=sys.stderr)

    med = {name: statistics.median(ts) for name, ts in times.items()}
    t_mb = med["T_mb (accumulate 8 mb)"]
    limit = t_mb / k * (m + k - 1) / m
    rows = [(name, med[name], med[name] / limit) for name in med]
    # Paired: each round's step over the limit from that round's own T_mb, so slow drift of
    # the machine between rounds cancels (the separately timed pipelining runs have none).
    scale = (m + k - 1) / (m * k)
    paired = {
        name: statistics.median(t / (tm * scale) for t, tm in zip(ts, times["T_mb (accumulate 8 mb)"]))
        for name, ts in times.items()
        if len(ts) == len(times["T_mb (accumulate 8 mb)"]) and not name.startswith("pipelining")
    }
    print(
        f"\nworkload: 8 residual MLP blocks 512/2048, batch {BATCH}, {m} micro-batches, {k} stages; "
        f"median of {args.rounds}"
    )
    print(f"limit T_mb/K x (M+K-1)/M = {limit * 1e3:.0f} ms  (T_mb = {t_mb * 1e3:.0f} ms)\n")
    print(f"{'method':34s} {'ms':>8s} {'x limit':>8s} {'paired':>8s}")
    for name, t, r in rows:
        pr = f"{paired[name]:8.2f}" if name in paired else f"{'-':>8s}"
        print(f"{name:34s} {t * 1e3:8.0f} {r:8.2f} {pr}")
    one_stage = med["fastpipe [8] never"] / t_mb
    unfused = med["fastpipe [8] never, unfused"] / t_mb
    print(
        f"\nengine overhead at one stage (fastpipe [8] / T_mb): {one_stage:.3f}; "
        f"without fused weight-gradient accumulation: {unfused:.3f}"
    )
    result = {
        "limit_s": limit,
        "t_mb_s": t_mb,
        "rounds": args.rounds,
        "median_s": med,
        "ratio_to_limit": {n: r for n, _, r in rows},
        "paired_ratio_to_limit": paired,
        "one_stage_overhead": one_stage,
        "one_stage_overhead_unfused": unfused,
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(result))
    write_json(result, args.json)
    if args.png:
        plot_ratios(result["ratio_to_limit"], args.png)
    if args.trace or args.gantt:
        pipe = pipes["fastpipe [4,4] never"]
        pipe.trace = True  # type: ignore[assignment]
        methods["fastpipe [4,4] never"]()
        timeline = pipe.last_timeline  # type: ignore[attr-defined]
        if args.trace:
            timeline.to_chrome_trace(args.trace)
        if args.gantt:
            timeline.plot(args.gantt, title="fastpipe, 2 CPU stages, GPipe, 8 micro-batches")


if __name__ == "__main__":
    main()
