"""Copy/compute overlap of fastpipe._C.

Measures, in one process and one run:
    t_compute  matmuls alone (torch, caller thread / current CUDA stream)
    t_copy     copies alone (on a fastpipe._C stream)
    t_both     both at once, copies on the runtime stream, compute as above
    efficiency = (t_compute + t_copy - t_both) / min(t_compute, t_copy)
1.0 means the shorter of the two is completely hidden; 0.0 means no overlap.

CPU (host backend): copies are memcpys run by the stream's worker thread, compute is a
torch matmul in the main thread (torch.set_num_threads(1)); a 2-core machine can at best
run both at once. CUDA: pinned H2D + D2H copies on a runtime copy stream, matmuls on the
torch current stream.

Usage: python -m fastpipe.bench.copy_overlap [--backend auto|host|cuda] [--runs 5] [--target-ms 200]
Prints a small table and one JSON line (prefix ``JSON ``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch

import fastpipe._C as _C

__all__ = ["main", "measure"]

Setup = tuple[Callable[[int], None], Callable[[int], None], Callable[[], None], str]


def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _calibrate(run: Callable[[int], None], target_ms: float) -> int:
    """A repeat count whose run takes about target_ms."""
    reps = 1
    while True:
        t0 = time.perf_counter()
        run(reps)
        ms = (time.perf_counter() - t0) * 1e3
        if ms >= target_ms / 4 or reps >= 1 << 16:
            return max(1, round(reps * target_ms / max(ms, 1e-3)))
        reps *= 4


def _host_setup(copy_mb: int) -> Setup:
    torch.set_num_threads(1)
    stream = _C.Stream(-1)
    n = copy_mb << 20
    pool = _C.HostBufferPool(-1)
    src, dst = pool.acquire(n), pool.acquire(n)
    torch.frombuffer(src, dtype=torch.uint8).fill_(1)
    torch.frombuffer(dst, dtype=torch.uint8).fill_(0)  # fault the pages in
    a = torch.randn(256, 256)

    def compute(reps: int) -> None:
        for _ in range(reps):
            torch.mm(a, a)

    def enqueue_copies(reps: int) -> None:
        for _ in range(reps):
            stream.copy(dst.ptr, src.ptr, n, "h2h")

    what = f"host backend (CPU), memcpy {copy_mb} MiB on a _C stream, mm 256x256 fp32 with 1 torch thread"
    return compute, enqueue_copies, stream.synchronize, what


def _cuda_setup(copy_mb: int) -> Setup:
    dev = torch.device("cuda", 0)
    stream = _C.Stream(0)
    n = copy_mb << 20
    pool = _C.HostBufferPool(0)
    h_src, h_dst = pool.acquire(n), pool.acquire(n)
    d_buf = torch.empty(n, dtype=torch.uint8, device=dev)
    a = torch.randn(4096, 4096, device=dev)
    torch.cuda.synchronize()

    def compute(reps: int) -> None:
        for _ in range(reps):
            torch.mm(a, a)
        torch.cuda.synchronize()

    def enqueue_copies(reps: int) -> None:
        for _ in range(reps):
            stream.copy(d_buf.data_ptr(), h_src.ptr, n, "h2d")
            stream.copy(h_dst.ptr, d_buf.data_ptr(), n, "d2h")

    what = f"cuda backend ({torch.cuda.get_device_name(dev)}), pinned H2D+D2H {copy_mb} MiB, mm 4096^2 fp32"
    return compute, enqueue_copies, stream.synchronize, what


def measure(backend: str, runs: int, target_ms: float, copy_mb: int) -> dict[str, object]:
    """Median times of compute alone, copies alone and both overlapped."""
    compute, enqueue_copies, join_copies, what = (_cuda_setup if backend == "cuda" else _host_setup)(copy_mb)

    def copies(reps: int) -> None:
        enqueue_copies(reps)
        join_copies()

    rc = _calibrate(compute, target_ms)
    rk = _calibrate(copies, target_ms)

    def both() -> None:
        enqueue_copies(rk)  # asynchronous: returns at once
        compute(rc)
        join_copies()

    t_c: list[float] = []
    t_k: list[float] = []
    t_b: list[float] = []
    cases: list[tuple[list[float], Callable[[], None]]] = [
        (t_c, lambda: compute(rc)),
        (t_k, lambda: copies(rk)),
        (t_b, both),
    ]
    for i in range(runs):
        for times, fn in cases[i % 3 :] + cases[: i % 3]:  # rotate the order against drift
            times.append(_timed(fn))
    tc, tk, tb = statistics.median(t_c), statistics.median(t_k), statistics.median(t_b)
    return {
        "bench": "copy_overlap",
        "backend": backend,
        "what": what,
        "runs": runs,
        "compute_reps": rc,
        "copy_reps": rk,
        "t_compute_ms": round(tc, 2),
        "t_copy_ms": round(tk, 2),
        "t_both_ms": round(tb, 2),
        "efficiency": round((tc + tk - tb) / min(tc, tk), 3),
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
    }


def main(argv: list[str] | None = None) -> None:
    """Prints the table and a ``JSON`` line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=["auto", "host", "cuda"], default="auto")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--target-ms", type=float, default=200.0)
    parser.add_argument("--copy-mb", type=int, default=0, help="bytes per copy in MiB (0: 16 host, 64 cuda)")
    args = parser.parse_args(argv)
    backend = args.backend
    if backend == "auto":
        backend = "cuda" if torch.cuda.is_available() and _C.backend_available("cuda") else "host"
    copy_mb = args.copy_mb or (64 if backend == "cuda" else 16)
    r = measure(backend, args.runs, args.target_ms, copy_mb)
    print(f"copy/compute overlap: {r['what']}; median of {r['runs']} runs")
    print(f"{'compute alone':>16} {'copies alone':>14} {'overlapped':>12} {'efficiency':>11}")
    tc, tk, tb, eff = r["t_compute_ms"], r["t_copy_ms"], r["t_both_ms"], r["efficiency"]
    print(f"{tc:>13.1f} ms {tk:>11.1f} ms {tb:>9.1f} ms {eff:>11.3f}")
    print(f"(1-min load average {r['loadavg_1m']} on {r['cpus']} CPUs)")
    print("JSON " + json.dumps(r))


if __name__ == "__main__":
    main()
