"""What splitting a stage's backward into B and W costs, against one combined backward.

One stage of the reference workload (2 residual MLP blocks 512/2048), 8 micro-batches of 32 rows,
one intra-op thread. Each round runs, per method, the 8 forwards and then the 8 backwards the way
the step runner does (``fastpipe.runtime.step``), timing the backwards only:

* ``BW``: one combined backward per micro-batch, Linear weight gradients summed in the GEMM
  (``accumulating_linears``), the running sums in ``.grad``;
* ``B+W deferred``: B then W per micro-batch as the step runner splits it: plain Linears deferred
  (``DeferringLinear``), B computing ``dx`` and the vector parameters' gradients (LayerNorm),
  W adding each ``dyᵀ x`` into the running sum;
* ``B+W walk``: B then W with every parameter left to the graph walk (the path when
  ``fused_wgrad=False``).

Each W runs right after its B here; the order of methods rotates per round, and each ratio is the
median over rounds of two methods' times in the same round (paired).

Usage::

    python bench/split_cost.py --rounds 21
    python bench/split_cost.py --input-grad no    # a first stage: its input needs no gradient
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from fastpipe.bench.workload import make_model  # noqa: E402
from fastpipe.runtime.split_backward import backward_inputs, backward_weights  # noqa: E402
from fastpipe.runtime.step import Stage  # noqa: E402
from fastpipe.runtime.wgrad import Deferred, accumulating_linears  # noqa: E402

MICRO, ROWS = 8, 32


def _methods(stage: nn.Module, xs: list[Tensor], dys: list[Tensor]) -> dict[str, Callable[[], float]]:
    # The step runner's choices: which Linears defer, which parameters B takes (fastpipe.runtime.step).
    runner_stage = Stage(stage, torch.device("cpu"))
    params, linears, early = runner_stage.params, runner_stage.linears, runner_stage.early

    def combined() -> float:
        outs = []
        with accumulating_linears(linears):
            outs = [stage(x) for x in xs]
        for p in params:
            p.grad = None
        started = time.perf_counter()
        for x, out, dy in zip(xs, outs, dys):
            inputs = [*([x] if x.requires_grad else []), *params]
            torch.autograd.backward([out], [dy], inputs=inputs)
        return time.perf_counter() - started

    def split(deferred: bool) -> Callable[[], float]:
        def run() -> float:
            records = [Deferred() for _ in xs]
            outs = []
            for x, rec in zip(xs, records):
                with accumulating_linears(linears, rec) if deferred else torch.enable_grad():
                    outs.append(stage(x))
            sums: list[Tensor | None] = [None] * len(params)
            started = time.perf_counter()
            for x, out, dy, rec in zip(xs, outs, dys, records):
                leaves = [x] if x.requires_grad else []
                if deferred:
                    _, work = backward_inputs([out], [dy], leaves, params, early=early, records=rec)
                else:
                    _, work = backward_inputs([out], [dy], leaves, params)
                backward_weights(work, sums)
            return time.perf_counter() - started

        return run

    return {"BW": combined, "B+W deferred": split(True), "B+W walk": split(False)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--input-grad", choices=["yes", "no"], default="yes")
    args = parser.parse_args()
    torch.set_num_threads(1)
    stage = nn.Sequential(*list(make_model())[:2])
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(ROWS, 512, generator=g).requires_grad_(args.input_grad == "yes") for _ in range(MICRO)]
    dys = [torch.randn(ROWS, 512, generator=g) for _ in range(MICRO)]
    methods = _methods(stage, xs, dys)
    names = list(methods)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.warmup + args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        got = {n: methods[n]() for n in order}
        if r >= args.warmup:
            for n in names:
                times[n].append(got[n])
    print(
        f"one stage of 2 blocks 512/2048, {MICRO} micro-batches of {ROWS} rows, 1 thread, "
        f"input gradient {args.input_grad}; median of {args.rounds} rounds"
    )
    for n in names:
        print(f"{n:<14} {1e3 * statistics.median(times[n]):7.2f} ms for {MICRO} backwards")
    for n in names[1:]:
        ratio = statistics.median(a / b for a, b in zip(times[n], times["BW"]))
        print(f"{n} / BW (paired)  {ratio:.3f}")


if __name__ == "__main__":
    main()
