"""fastpipe's V schedules against torch.distributed.pipelining's, paired rounds in the same 2 processes.

Two gloo ranks with one intra-op thread each run the reference workload (8 residual MLP blocks
512/2048, batch 256, 8 micro-batches, :mod:`fastpipe.bench.workload`) under:

* fastpipe ``DistributedPipe`` ``zb-v`` and ``dualpipev`` (4 stages of 2 blocks in a V: rank 0 holds
  stages 0 and 3, rank 1 stages 1 and 2) and ``1f1b`` (2 stages of 4 blocks), checkpoint never;
* ``torch.distributed.pipelining``'s ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` on the same
  4 stages, placed the same way.

Every method is built once per process; each round runs one step of every method, in an order that
rotates from round to round, each step timed between two barriers on rank 0. Per round, each
fastpipe step is divided by its peer's step of the same round (paired), which cancels the drift
between rounds; the medians over rounds are reported. Then a few traced steps of each fastpipe
schedule give the measured bubble (both ranks' rows merged on one clock) beside the simulator's,
priced with the per-action costs measured in those steps (:func:`fastpipe.trace.timing.simulate_measured`).

``fastpipe bench --only zero-bubble`` runs it within the part's budget; by hand::

    python -m fastpipe.bench.zero_bubble --rounds 9 --json bench/results/zero_bubble_peers.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fastpipe.bench.ranks import join_within, start_ranks
from fastpipe.bench.report import write_json
from fastpipe.bench.steps import LOSS, free_port
from fastpipe.bench.workload import BATCH, BLOCKS, CHUNKS, FFN, HIDDEN, make_batch, make_model

__all__ = ["PAIRS", "run_zero_bubble", "v_peers_refused_on_gloo", "main"]

K = 2  # ranks
PAIRS = {"fastpipe zb-v": "pipelining ZBVZeroBubble", "fastpipe dualpipev": "pipelining DualPipeV"}
# Toy sizes for --tiny (tests): the figures mean nothing, every path runs in seconds.
_TINY = {"blocks": BLOCKS, "hidden": 32, "ffn": 64, "batch": 16, "chunks": CHUNKS}
_FULL = {"blocks": BLOCKS, "hidden": HIDDEN, "ffn": FFN, "batch": BATCH, "chunks": CHUNKS}


def _model(w: dict[str, int]) -> nn.Sequential:
    return make_model(w["blocks"], hidden=w["hidden"], ffn=w["ffn"])


def _fastpipe(schedule: str, w: dict[str, int], x: torch.Tensor, y: torch.Tensor) -> Callable[..., Any]:
    from fastpipe.distributed_pipe import DistributedPipe

    half, quarter = w["blocks"] // 2, w["blocks"] // 4
    balance = [half, w["blocks"] - half] if schedule == "1f1b" else [quarter] * 3 + [w["blocks"] - 3 * quarter]
    pipe = DistributedPipe(_model(w), balance, chunks=w["chunks"], schedule=schedule, checkpoint="never")

    def step(trace: bool = False) -> Any:
        pipe.zero_grad(set_to_none=True)
        pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, LOSS, trace=trace)
        return pipe.last_timeline

    return step


def _pipelining(rank: int, name: str, w: dict[str, int], x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV, ScheduleZBVZeroBubble

    blocks = list(_model(w))
    per = len(blocks) // (2 * K)
    held = (rank, 2 * K - 1 - rank)  # the V: stages r and 2K-1-r on rank r
    parts = [nn.Sequential(*blocks[per * s : per * (s + 1) if s < 2 * K - 1 else len(blocks)]) for s in held]
    stages: list[Any] = [
        PipelineStage(p, stage_index=s, num_stages=2 * K, device=torch.device("cpu")) for p, s in zip(parts, held)
    ]
    cls = ScheduleZBVZeroBubble if name == "ZBVZeroBubble" else ScheduleDualPipeV
    sched = cls(stages, n_microbatches=w["chunks"], loss_fn=LOSS)

    def step() -> None:
        for p in parts:
            p.zero_grad(set_to_none=True)
        if rank == 0:  # stage 0 reads the input, stage 2K-1 (the loss) the target: both on rank 0
            sched.step(x, target=y, losses=[])
        else:
            sched.step()

    return step


def v_peers_refused_on_gloo() -> str | None:
    """Why this torch's ``torch.distributed.pipelining`` V schedules cannot start on gloo, or None if they can.

    A V places two adjacent stages on one rank (here stages 1 and 2 on rank 1). Releases whose
    stages lack the start-up vote (torch 2.11 among them) open a schedule with a dummy send from each
    stage to its neighbours through the process group, the same-rank neighbour included, and gloo
    has no connection from a rank to itself ("Pair is not connected"): that rank raises, and the
    whole part with it. Only that start-up is recognised; any other release runs.
    """
    from torch.distributed.pipelining.stage import PipelineStage

    if hasattr(PipelineStage, "_warmup_forward_vote") or not hasattr(PipelineStage, "_get_init_p2p_neighbors_ops"):
        return None
    return (
        f"torch {torch.__version__}'s pipelining V schedules send from a rank to itself when they start, "
        "which gloo refuses (torch 2.13 starts them without that send): run this part on torch >= 2.13"
    )


def _bubbles(methods: dict[str, Callable[..., Any]], steps: int, chunks: int) -> dict[str, dict[str, float]]:
    """Measured bubble of traced fastpipe steps, and the simulator's from the costs measured in them.

    Each rank records its own row; perf_counter is one monotonic clock for the processes of a host,
    so the rows merge into one timeline per step. The figures are medians over ``steps``.
    """
    from fastpipe.trace.timeline import Timeline
    from fastpipe.trace.timing import simulate_measured

    out: dict[str, dict[str, float]] = {}
    for name in ("fastpipe zb-v", "fastpipe dualpipev", "fastpipe 1f1b"):
        measured, simulated = [], []
        for _ in range(steps):
            dist.barrier()
            events = methods[name](trace=True).events
            rows: list[Any] = [None] * K
            dist.all_gather_object(rows, events)
            merged = Timeline(K, [e for row in rows for e in row])
            schedule = name.split()[1]
            v = 1 if schedule == "1f1b" else 2
            measured.append(merged.bubble_fraction)
            simulated.append(simulate_measured(merged, schedule, K, chunks, virtual_stages=v).bubble_fraction)
        out[name] = {"measured": statistics.median(measured), "simulated": statistics.median(simulated)}
    return out


def _worker(rank: int, port: int, w: dict[str, int], warmup: int, rounds: int, out: str) -> None:
    torch.set_num_threads(1)
    # Checked here rather than in the parent, where the import alone would add seconds to the part.
    try:
        from torch.distributed.pipelining import ScheduleDualPipeV, ScheduleZBVZeroBubble  # noqa: F401
    except ImportError as exc:
        why: str | None = f"torch.distributed.pipelining has no V schedules here ({exc})"
    else:
        why = v_peers_refused_on_gloo()
    if why is not None:
        if rank == 0:
            with open(out, "w") as f:
                json.dump({"skipped": why}, f)
        return
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=K)
    x, y = make_batch(w["batch"], hidden=w["hidden"])
    methods = {
        "fastpipe zb-v": _fastpipe("zb-v", w, x, y),
        "pipelining ZBVZeroBubble": _pipelining(rank, "ZBVZeroBubble", w, x, y),
        "fastpipe dualpipev": _fastpipe("dualpipev", w, x, y),
        "pipelining DualPipeV": _pipelining(rank, "DualPipeV", w, x, y),
        "fastpipe 1f1b": _fastpipe("1f1b", w, x, y),
    }
    names = list(methods)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            methods[name]()
            dist.barrier()
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
    bubbles = _bubbles(methods, max(3, rounds // 3), w["chunks"])
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "bubbles": bubbles}, f)
    dist.destroy_process_group()


def run_zero_bubble(timeout: float, rounds: int = 9, warmup: int = 2, tiny: bool = False) -> dict[str, Any]:
    """Paired step times and bubbles of the five methods on 2 spawned gloo ranks (see the module doc).

    Returns ``{"skipped": why}`` instead where this torch's ``torch.distributed.pipelining`` has no V schedules,
    or has V schedules that cannot start on gloo (:func:`v_peers_refused_on_gloo`).

    Raises:
        RuntimeError: a rank failed, or the ranks ran past ``timeout`` seconds (they are stopped).
    """
    w = _TINY if tiny else _FULL
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        ctx = start_ranks(_worker, (free_port(), w, warmup, rounds, out), K)
        join_within(ctx, timeout, "the zero-bubble ranks")
        with open(out) as f:
            data = json.load(f)
    if "skipped" in data:
        return {"skipped": data["skipped"]}
    times: dict[str, list[float]] = data["times"]
    paired = {
        f"{ours} / {peer}": statistics.median(a / b for a, b in zip(times[ours], times[peer]))
        for ours, peer in PAIRS.items()
    }
    for ours in PAIRS:
        paired[f"{ours} / fastpipe 1f1b"] = statistics.median(
            a / b for a, b in zip(times[ours], times["fastpipe 1f1b"])
        )
    return {
        "workload": {**w, "ranks": K, "threads_per_rank": 1},
        "rounds": rounds,
        "median_s": {n: statistics.median(ts) for n, ts in times.items()},
        "paired_ratio": paired,
        "bubble": data["bubbles"],
        "load_average": {"before": load_before[0], "after": os.getloadavg()[0]},
    }


def main() -> None:
    """``python -m fastpipe.bench.zero_bubble``: prints the figures, optionally writes them as JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800.0, help="stop the ranks after this many seconds")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    res = run_zero_bubble(args.timeout, args.rounds, args.warmup)
    if "skipped" in res:
        raise SystemExit(f"skipped: {res['skipped']}")
    w, load = res["workload"], res["load_average"]
    print(
        f"\nworkload: {w['blocks']} residual MLP blocks {w['hidden']}/{w['ffn']}, batch {w['batch']}, "
        f"{w['chunks']} micro-batches, {K} gloo ranks x 1 thread; median of {args.rounds} paired rounds; "
        f"load average {load['before']:.2f} -> {load['after']:.2f}"
    )
    for name, t in res["median_s"].items():
        print(f"{name:30s} {t * 1e3:8.0f} ms")
    for name, ratio in res["paired_ratio"].items():
        print(f"{name:50s} {ratio:6.3f}")
    print("\nbubble of traced steps: measured, and simulated from the costs measured in the same steps")
    for name, b in res["bubble"].items():
        print(f"{name:30s} measured {b['measured']:6.1%}  simulated {b['simulated']:6.1%}")
    write_json(res, args.json)


if __name__ == "__main__":
    main()
