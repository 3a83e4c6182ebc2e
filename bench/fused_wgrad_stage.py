"""One GPT stage's step with every Linear's weight gradient summed in its GEMM, against autograd's.

The fused path (:class:`fastpipe.runtime.wgrad.AccumulatingLinear`) saves a weight-sized add per
micro-batch and costs a Python autograd Function per call; this measures which wins at each
width, on the largest-model bench's blocks, alternating the two in one process::

    OMP_NUM_THREADS=1 python bench/fused_wgrad_stage.py --widths 128 256 512 --rounds 10

Reported: the median step in ms of each, and fused / autograd per round. The bound that
:func:`fastpipe.runtime.wgrad.default_fuse_min` sets on CPU comes from these figures.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from fastpipe.bench import largest_ranks as lr
from fastpipe.runtime.wgrad import accumulating_linears, fusable_linears


def _stage(width: int, blocks: int, per_block: bool) -> torch.nn.Sequential:
    torch.manual_seed(0)
    shape = {"vocab": 256, "seq": 64, "heads": 4, "width": width, "batch": 16, "chunks": 8, "layers": 54}
    return lr._sequential(range(1, blocks + 1), shape, per_block)


def measure(width: int, blocks: int, rounds: int, per_block: bool) -> dict[str, list[float]]:
    stage = _stage(width, blocks, per_block)
    linears = fusable_linears(stage, list(stage.parameters()))
    inputs = [torch.randn(2, 64, width, requires_grad=True) for _ in range(8)]

    def step(fused: bool) -> float:
        for p in stage.parameters():
            p.grad = None
        start = time.perf_counter()
        for x in inputs:
            with accumulating_linears(linears) if fused else contextlib.nullcontext():
                stage(x).sum().backward()
        return time.perf_counter() - start

    times: dict[str, list[float]] = {"fused": [], "autograd": []}
    for _ in range(rounds + 1):
        times["fused"].append(step(True))
        times["autograd"].append(step(False))
    return {k: v[1:] for k, v in times.items()}  # the first round warms up


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", type=int, nargs="+", default=[128, 256, 512])
    p.add_argument("--blocks", type=int, default=0, help="blocks per stage (0: about 1.8 M weights' worth)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--per-block", action="store_true", help="torch.utils.checkpoint around each block")
    args = p.parse_args()
    torch.set_num_threads(1)
    for width in args.widths:
        blocks = args.blocks or max(2, 14 * 128 // width)
        t = measure(width, blocks, args.rounds, args.per_block)
        ratios = sorted(a / b for a, b in zip(t["fused"], t["autograd"]))
        print(
            f"width {width}, {blocks} blocks: fused {statistics.median(t['fused']) * 1e3:.0f} ms, "
            f"autograd {statistics.median(t['autograd']) * 1e3:.0f} ms, fused / autograd per round "
            f"{ratios[0]:.2f}-{ratios[-1]:.2f} (median {statistics.median(ratios):.2f})"
        )


if __name__ == "__main__":
    main()
