"""What a deferred weight GEMM costs per micro-batch, one micro-batch at a time or several stacked.

W adds ``dyᵀ x`` into each Linear's running weight gradient with ``addmm_``. For the reference
workload's Linears (2048x512 and 512x2048, 32-row micro-batches) that GEMM reads and writes the
whole running sum for 32 rows of arithmetic. Stacking the rows of several micro-batches into one
GEMM (the pipe's ``wgrad_batch``, :class:`fastpipe.runtime.wgrad.CarriedRecords`) touches the sum once
for all of them. This script times ``addmm_`` into 8 running sums in turn (so that they do not stay
in cache, as in a stage), one thread, per micro-batch, for 1, 2, 4 and 8 micro-batches stacked.

Usage::

    python bench/wgrad_batch.py [--rows 32] [--repeats 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from fastpipe.bench.workload import FFN, HIDDEN  # noqa: E402


def per_microbatch_ms(rows: int, stacked: int, repeats: int, out_features: int, in_features: int) -> float:
    """Median time of one ``addmm_`` over ``stacked`` micro-batches of ``rows``, divided by ``stacked``."""
    sums = [torch.zeros(out_features, in_features) for _ in range(8)]
    dy = torch.randn(rows * stacked, out_features)
    x = torch.randn(rows * stacked, in_features)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for s in sums:
            s.addmm_(dy.t(), x)
        times.append((time.perf_counter() - start) / len(sums))
    return 1e3 * statistics.median(times[2:]) / stacked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32, help="rows of one micro-batch")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"addmm_ into 8 running sums in turn, {args.rows}-row micro-batches, 1 thread: ms per micro-batch")
    print(f"{'weight':>10} " + " ".join(f"{n:>3} stacked" for n in (1, 2, 4, 8)))
    for out_features, in_features in ((FFN, HIDDEN), (HIDDEN, FFN)):
        row = [per_microbatch_ms(args.rows, n, args.repeats, out_features, in_features) for n in (1, 2, 4, 8)]
        print(f"{out_features:>4}x{in_features:<5} " + " ".join(f"{t:>11.2f}" for t in row))


if __name__ == "__main__":
    main()
