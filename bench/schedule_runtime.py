"""Measured vs simulated step time of every schedule, and predicted speed-ups.

Part 1 (measured, CPU): the foundation workload (8 residual MLP blocks 512/2048, batch
256, 8 micro-batches) runs ``Pipe.train_step`` under each schedule on 2 CPU workers, 1
intra-op thread each. Per-action costs (F and combined BW per stage from GPipe steps, B
and W from ZB-H1 steps) come from a profile: traced steps of the same pipes.
``fastpipe.schedule.simulate`` predicts each schedule's step from those costs; the table
gives measured / simulated, and measured / the physical limit T_mb/K × (M+K−1)/M with T_mb
the 1-thread gradient accumulation over the same 8 micro-batches, measured in the same run.

Part 2 (predicted): speed-up over one device for K = 4 and 8 at M = 32, with per-layer
costs profiled from the workload's block (micro-batch of 32 rows, 1 thread), 8·K blocks,
balanced by the planner, and a stated link bandwidth for the activations.

Usage::

    python bench/schedule_runtime.py --rounds 5 --json bench/out/sched.json --png bench/out/sched.png
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from fastpipe import Pipe  # noqa: E402
from fastpipe.balance import plan, profile_layers  # noqa: E402
from fastpipe.bench.report import write_json  # noqa: E402
from fastpipe.bench.workload import HIDDEN, ResidualMLP, make_batch, make_model  # noqa: E402
from fastpipe.schedule import build, simulate  # noqa: E402
from fastpipe.trace.timeline import Timeline  # noqa: E402
from fastpipe.trace.timing import action_costs  # noqa: E402

LOSS = nn.MSELoss()
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)]


def measured_part(rounds: int) -> dict:
    torch.set_num_threads(1)
    x, y = make_batch()
    m, k = 8, 2
    plain = make_model()
    xs, ys = x.chunk(m), y.chunk(m)

    def t_mb_step() -> None:
        plain.zero_grad(set_to_none=True)
        for xc, yc in zip(xs, ys):
            (LOSS(plain(xc), yc) / m).backward()

    pipes = {
        name: Pipe(make_model(), balance=[4, 4] if v == 1 else [2, 2, 2, 2], chunks=m, checkpoint="never")
        for name, v in SCHEDULES
    }

    def step(name: str, v: int, trace: bool = False) -> None:
        pipe = pipes[name]
        pipe.zero_grad(set_to_none=True)
        pipe.train_step(x, y, LOSS, schedule=name, virtual_stages=v, trace=trace)

    t_mb_step()
    for name, v in SCHEDULES:
        step(name, v)
    times: dict[str, list[float]] = defaultdict(list)
    traces: dict[str, list[Timeline]] = defaultdict(list)
    from tqdm import tqdm

    # Every timed step is traced (a callback per action, well under 1%), so the profile
    # comes from the same steps as the times and machine drift cannot come between them.
    for _ in tqdm(range(rounds), desc="rounds", file=sys.stderr):
        t0 = time.perf_counter()
        t_mb_step()
        times["T_mb"].append(time.perf_counter() - t0)
        for name, v in SCHEDULES:
            t0 = time.perf_counter()
            step(name, v, trace=True)
            times[name].append(time.perf_counter() - t0)
            traces[name].append(pipes[name].last_timeline)  # type: ignore[arg-type]
    t_mb = statistics.median(times["T_mb"])
    limit = t_mb / k * (m + k - 1) / m

    # The profile: costs per action (gpipe for F and BW, zb-h1 for B and W: a combined
    # backward is cheaper than B + W, see RESULTS.md).
    profiles = {}
    for name, _ in SCHEDULES:
        runs = traces[name]
        merged = Timeline(runs[0].num_workers, [e for t in runs for e in t.events])
        profiles[name] = action_costs(merged, len(pipes[name].balance))
    f2, bw2, split = profiles["gpipe"]["F"], profiles["gpipe"]["BW"], profiles["zb-h1"]
    rows = []
    for name, v in SCHEDULES:
        if name == "interleaved":
            costs = profiles[name]
            sim = simulate(
                build(name, stages=k, microbatches=m, virtual_stages=v),
                forward=costs["F"],
                backward=costs["BW"],
                weight=0.0,
            )
        else:
            sim = simulate(
                build(name, stages=k, microbatches=m), forward=f2, backward=split["B"], weight=split["W"], combined=bw2
            )
        measured = statistics.median(times[name])
        rows.append(
            {
                "schedule": name,
                "measured_s": measured,
                "simulated_s": sim.makespan,
                "measured_over_simulated": measured / sim.makespan,
                "measured_over_limit": measured / limit,
                "simulated_bubble": sim.bubble_fraction,
            }
        )
    return {"t_mb_s": t_mb, "limit_s": limit, "rounds": rounds, "rows": rows, "profile": profiles}


def predicted_part(bandwidth_gbs: float, microbatches: int = 32, rows_per_mb: int = 32) -> list[dict]:
    torch.set_num_threads(1)
    block = nn.Sequential(*[ResidualMLP() for _ in range(2)])
    prof = profile_layers(block, torch.randn(rows_per_mb, HIDDEN), repeats=5)
    f_block, b_block = statistics.median(prof.forward), statistics.median(prof.backward)
    comm = rows_per_mb * HIDDEN * 4 / (bandwidth_gbs * 1e9)
    out = []
    for k in (4, 8):
        layers = 8 * k
        fwd, bwd = [f_block] * layers, [b_block] * layers
        single = microbatches * layers * (f_block + b_block)
        for name in ("gpipe", "1f1b", "zb-h1"):
            balance = plan(fwd, bwd, k, microbatches=microbatches, schedule=name, comm=comm)
            per_stage_f = [f_block * n for n in balance]
            per_stage_b = [b_block * n for n in balance]
            if name == "zb-h1":  # B and W each about half of a Linear-dominated backward
                sim = simulate(
                    build(name, stages=k, microbatches=microbatches),
                    forward=per_stage_f,
                    backward=[b / 2 for b in per_stage_b],
                    weight=[b / 2 for b in per_stage_b],
                    comm=comm,
                )
            else:
                sim = simulate(
                    build(name, stages=k, microbatches=microbatches),
                    forward=per_stage_f,
                    backward=per_stage_b,
                    weight=0.0,
                    comm=comm,
                )
            out.append(
                {
                    "K": k,
                    "M": microbatches,
                    "schedule": name,
                    "balance": balance,
                    "speedup": single / sim.makespan,
                    "bubble": sim.bubble_fraction,
                }
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bandwidth-gbs", type=float, default=25.0, help="link bandwidth for part 2")
    parser.add_argument("--json", default=None)
    parser.add_argument("--png", default=None, help="measured vs simulated bar chart")
    args = parser.parse_args()

    meas = measured_part(args.rounds)
    print(
        f"\nmeasured on CPU, 2 workers x 1 thread, 8 micro-batches, median of {args.rounds}; "
        f"T_mb = {meas['t_mb_s'] * 1e3:.0f} ms, limit = {meas['limit_s'] * 1e3:.0f} ms"
    )
    print(f"{'schedule':12s} {'measured ms':>12s} {'simulated ms':>13s} {'meas/sim':>9s} {'meas/limit':>11s}")
    for r in meas["rows"]:
        print(
            f"{r['schedule']:12s} {r['measured_s'] * 1e3:12.0f} {r['simulated_s'] * 1e3:13.0f} "
            f"{r['measured_over_simulated']:9.3f} {r['measured_over_limit']:11.3f}"
        )
    pred = predicted_part(args.bandwidth_gbs)
    print(f"\npredicted speed-up over one device, M=32, link {args.bandwidth_gbs} GB/s, costs profiled on CPU")
    print(f"{'K':>2s} {'schedule':10s} {'speed-up':>9s} {'bubble':>7s}")
    for r in pred:
        print(f"{r['K']:2d} {r['schedule']:10s} {r['speedup']:9.2f} {r['bubble']:7.3f}")
    result = {"measured": meas, "predicted": pred, "bandwidth_gbs": args.bandwidth_gbs}
    print("JSON " + json.dumps({"measured": meas["rows"], "predicted": pred}))
    write_json(result, args.json)
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = [r["schedule"] for r in meas["rows"]]
        fig, ax = plt.subplots(figsize=(7, 3.5))
        xs = range(len(names))
        ax.bar([i - 0.2 for i in xs], [r["measured_s"] * 1e3 for r in meas["rows"]], 0.4, label="measured")
        ax.bar([i + 0.2 for i in xs], [r["simulated_s"] * 1e3 for r in meas["rows"]], 0.4, label="simulated")
        ax.axhline(meas["limit_s"] * 1e3, color="k", linestyle="--", label="limit")
        ax.set_xticks(list(xs), names)
        ax.set_ylabel("step ms (CPU, 2 workers)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)


if __name__ == "__main__":
    main()
