"""Simulated bubble fraction and peak activations of every schedule.

Unit costs per stage and micro-batch: F = 1, B = 1, W = 1 (BW = 2), no link delay. For ``interleaved``
(v = 2 virtual stages per worker) each stage chunk costs half, so every schedule does the same work per
worker. Peak activations count (stage, micro-batch) pairs alive on a worker (see
``fastpipe.trace.Timeline.peak_activations``); an interleaved chunk holds half a stage's activation, so its
"equivalent micro-batches" (the last column) are peak / v.

Usage::

    python -m fastpipe.bench.schedules --json bench/out/schedules.json --png bench/out/schedules.png
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from fastpipe.schedule import SCHEDULES, build, simulate

__all__ = ["main", "run", "plot"]

WORKERS = (4, 8)
MICROBATCHES = (4, 8, 16, 32, 64)
VIRTUAL = 2


def run(workers: Sequence[int] = WORKERS, microbatches: Sequence[int] = MICROBATCHES) -> list[dict[str, Any]]:
    """Simulates every schedule for every (K, M); returns one row per combination."""
    rows = []
    for name in SCHEDULES:
        v = VIRTUAL if name == "interleaved" else 1
        for k in workers:
            for m in microbatches:
                if name == "interleaved" and m % k:
                    continue
                t = simulate(build(name, k, m, virtual_stages=v), forward=1 / v, backward=1 / v, weight=1 / v)
                rows.append({
                    "schedule": name if v == 1 else f"{name} (v={v})",
                    "K": k,
                    "M": m,
                    "makespan": t.makespan,
                    "bubble": t.bubble_fraction,
                    "peak_activations": t.peak_activations,
                    "peak_worker0_equiv": t.peak_activations[0] / v,
                })
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'schedule':<20} {'K':>2} {'M':>3} {'makespan':>9} {'bubble':>7}  "
            f"{'peak act. per worker':<28} {'w0 eq.':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        peaks = ",".join(str(p) for p in r["peak_activations"])
        lines.append(f"{r['schedule']:<20} {r['K']:>2} {r['M']:>3} {r['makespan']:>9.1f} {r['bubble']:>7.1%}  "
                     f"{peaks:<28} {r['peak_worker0_equiv']:>6.1f}")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """Draws bubble and peak activations against M, one column per K (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for col, k in enumerate(sorted({r["K"] for r in rows})):
        for name in dict.fromkeys(r["schedule"] for r in rows):
            sel = [r for r in rows if r["K"] == k and r["schedule"] == name]
            ms = [r["M"] for r in sel]
            axes[0][col].plot(ms, [r["bubble"] for r in sel], marker="o", label=name)
            axes[1][col].plot(ms, [r["peak_worker0_equiv"] for r in sel], marker="o", label=name)
        for row, label in enumerate(("bubble fraction", "peak activations, worker 0 (micro-batches)")):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            ax.set_xlabel("micro-batches M")
            ax.set_ylabel(label)
            ax.set_title(f"K = {k}")
            ax.grid(alpha=0.3)
        axes[1][col].set_yscale("log", base=2)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Simulated schedules, unit costs F = B = W = 1")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """Prints the table; optionally writes JSON and a PNG."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the rows as JSON here")
    parser.add_argument("--png", default=None, help="draw bubble and peak activations here (matplotlib)")
    args = parser.parse_args(argv)
    rows = run()
    print(_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"costs": {"F": 1, "B": 1, "W": 1, "interleaved_v": VIRTUAL}, "rows": rows}, f, indent=1)
    if args.png:
        plot(rows, args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
