"""Asynchronous (XPipe) against synchronous 1F1B: the simulated table and a paired CPU measurement.

1. Simulated steady-state time per mini-batch of a 1F1B stream without a flush against the
   same stream flushed every mini-batch (sync 1F1B), for K = 2, 4, 8 stages and M = 1, 4, 8
   micro-batches (F = 1, B = 2 per stage and micro-batch). The limit of the gain is
   (M + K - 1) / M. ``Pipe.fit`` drains every ``window`` mini-batches; the table gives the
   gain with that drain too.
2. Measured on CPU, K = 2 stages (one thread each), M = 4: time per mini-batch of
   ``train_step`` (1F1B) + ``optimizer.step()``, of ``fit(consistency="sync")`` and of
   ``fit`` with each asynchronous policy, timed in alternating rounds in one run. Reported:
   the median over rounds of each method's time per mini-batch divided by the same round's
   sync 1F1B time (so drift between rounds cancels). ``--workload mlp`` trains residual MLP
   blocks (fastpipe.bench.workload); ``--workload sleep`` gives every stage fixed costs
   (F = 10 ms, B = 20 ms per micro-batch, sleeping: no CPU used), which measures the schedule
   and the runtime apart from CPU contention on a shared machine.

3. The cost of one weight prediction on the measured workload's stage 0 (Adam state, fp32):
   the direction followed by the subtraction (how it was computed before), against
   :func:`fastpipe.asynchronous.predict_weights` into a reused buffer (one pass in
   ``fastpipe._C`` here).

Usage::

    python bench/xpipe.py --rounds 5 --json bench/out/xpipe.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from fastpipe import Pipe  # noqa: E402
from fastpipe.bench.report import write_json  # noqa: E402
from fastpipe.bench.workload import HIDDEN, make_model  # noqa: E402
from fastpipe.schedule.multistep import steady_state_time  # noqa: E402

LOSS = nn.MSELoss()


def simulated(window: int) -> list[dict[str, Any]]:
    """Steady-state time per mini-batch, sync 1F1B vs stream, and the gain with a drain per window."""
    rows = []
    for k in (2, 4, 8):
        for m in (1, 4, 8):
            sync = steady_state_time(k, m, flush=True)
            stream = steady_state_time(k, m, flush=False)
            per_window = window * m + k - 1  # a window of N mini-batches pays one fill and drain
            rows.append(
                {
                    "K": k,
                    "M": m,
                    "sync_1f1b": sync,
                    "async": stream,
                    "gain": sync / stream,
                    "limit": (m + k - 1) / m,
                    f"gain_window_{window}": window * (m + k - 1) / per_window,
                }
            )
    return rows


def _print_simulated(rows: list[dict[str, Any]], window: int) -> None:
    print(f"simulated steady state, time per mini-batch (F=1, B=2): window = {window}")
    print(f"{'K':>2} {'M':>2} {'sync 1F1B':>10} {'async':>7} {'gain':>6} {'(M+K-1)/M':>10} {'with drain':>11}")
    for r in rows:
        print(
            f"{r['K']:>2} {r['M']:>2} {r['sync_1f1b']:>10.1f} {r['async']:>7.1f} {r['gain']:>6.3f} "
            f"{r['limit']:>10.3f} {r[f'gain_window_{window}']:>11.3f}"
        )


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        time.sleep(0.010)
        return x * w

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(0.020)
        return grad, torch.zeros(grad.shape[-1])


class SleepStage(nn.Module):
    """A layer with fixed costs: F = 10 ms, B = 20 ms per call, spent sleeping."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x, self.weight)


def measured(rounds: int, window: int, blocks: int, batch: int, chunks: int, workload: str) -> dict[str, Any]:
    """Paired time per mini-batch on 2 CPU stages; see the module docstring."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    width = HIDDEN if workload == "mlp" else 4
    data = [(torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)) for _ in range(window)]
    if workload == "sleep":
        blocks = 2

    def build() -> nn.Sequential:
        return make_model(blocks) if workload == "mlp" else nn.Sequential(SleepStage(width), SleepStage(width))

    half = blocks // 2
    pipes: dict[str, Pipe] = {}
    opts: dict[str, torch.optim.Optimizer] = {}
    methods: dict[str, Callable[[], None]] = {}

    def add(name: str, consistency: str | None) -> None:
        pipe = Pipe(build(), balance=[half, blocks - half], chunks=chunks, checkpoint="never")
        opt = torch.optim.Adam(pipe.parameters(), lr=1e-5)
        pipes[name], opts[name] = pipe, opt

        def run() -> None:
            if consistency is None:
                for x, y in data:
                    opt.zero_grad(set_to_none=True)
                    pipe.train_step(x, y, LOSS, schedule="1f1b")
                    opt.step()
            else:
                for _ in pipe.fit(data, LOSS, opt, consistency=consistency, window=window):
                    pass

        methods[name] = run

    add("sync 1F1B (train_step + step)", None)
    for policy in ("sync", "stale", "stash", "predict"):
        add(f"fit {policy}", policy)
    for run in methods.values():  # warm-up: allocator, threads
        run()
    times: dict[str, list[float]] = {name: [] for name in methods}
    for r in range(rounds):
        order = list(methods) if r % 2 == 0 else list(reversed(methods))  # alternate who goes first
        for name in order:
            start = time.perf_counter()
            methods[name]()
            times[name].append((time.perf_counter() - start) / window)
    base = times["sync 1F1B (train_step + step)"]
    result = {}
    for name, ts in times.items():
        ratio = statistics.median(b / t for b, t in zip(base, ts))
        result[name] = {
            "median_s_per_minibatch": statistics.median(ts),
            "speedup_vs_sync_1f1b": ratio,
            "per_round_s": ts,
        }
    for pipe in pipes.values():
        pipe.close()
    return {
        "workload": workload,
        "K": 2,
        "M": chunks,
        "window": window,
        "blocks": blocks,
        "batch": batch,
        "rounds": rounds,
        "limit": (chunks + 1) / chunks,
        "limit_with_drain": window * (chunks + 1) / (window * chunks + 1),
        "methods": result,
    }


def prediction_cost(blocks: int, repeats: int = 20) -> dict[str, float]:
    """Milliseconds per prediction of stage 0's weights (half of ``blocks``) under Adam."""
    from fastpipe.asynchronous import predict_weights, update_direction

    torch.set_num_threads(1)
    params = list(make_model(blocks)[: blocks // 2].parameters())
    opt = torch.optim.Adam(params, lr=1e-5)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    out = [torch.empty_like(p) for p in params]
    totals = [3e-5] * len(params)

    def before() -> None:
        directions = update_direction(opt, params)
        [p.detach() - 3e-5 * d for p, d in zip(params, directions) if d is not None]

    def now() -> None:
        predict_weights(opt, params, totals, out)

    result = {"stage_mib": sum(p.numel() * p.element_size() for p in params) / 2**20}
    for name, fn in (("direction_then_subtract_ms", before), ("predict_weights_ms", now)):
        for _ in range(3):
            fn()
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        result[name] = statistics.median(samples) * 1e3
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--window", type=int, default=16, help="mini-batches per drain in fit (and per round)")
    parser.add_argument("--workload", choices=("mlp", "sleep"), default="mlp")
    parser.add_argument("--blocks", type=int, default=4, help="residual MLP blocks (fastpipe.bench.workload)")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--skip-measure", action="store_true", help="only the simulated table")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rows = simulated(args.window)
    _print_simulated(rows, args.window)
    out: dict[str, Any] = {"simulated": rows}
    if not args.skip_measure:
        m = measured(args.rounds, args.window, args.blocks, args.batch, args.chunks, args.workload)
        out["measured"] = m
        print(
            f"\nmeasured ({m['workload']}), K=2 CPU stages, M={m['M']}, window={m['window']}, {m['rounds']} rounds "
            f"(limit {m['limit']:.3f}x, {m['limit_with_drain']:.3f}x with one drain per window)"
        )
        for name, r in m["methods"].items():
            print(
                f"  {name:<32} {r['median_s_per_minibatch'] * 1e3:8.1f} ms/mini-batch   "
                f"{r['speedup_vs_sync_1f1b']:.3f}x vs sync 1F1B (paired)"
            )
    cost = prediction_cost(args.blocks)
    out["prediction_cost"] = cost
    print(
        f"\none prediction of stage 0 ({cost['stage_mib']:.1f} MiB, Adam): "
        f"{cost['direction_then_subtract_ms']:.1f} ms as direction then subtraction, "
        f"{cost['predict_weights_ms']:.1f} ms with predict_weights (median of 20)"
    )
    write_json(out, args.json)


if __name__ == "__main__":
    main()
