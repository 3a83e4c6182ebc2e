"""Simulated bubble fraction and peak activations of every schedule.

Unit costs per stage and micro-batch: F = 1, B = 1, W = 1 (BW = 2), no link delay. For ``interleaved``,
``zb-v`` and ``dualpipev`` (v = 2 stages per worker) each stage chunk costs half, so every schedule does
the same work per worker. Peak activations count (stage, micro-batch) pairs alive on a worker (see
``fastpipe.trace.timeline.Timeline.peak_activations``); a chunk of v per worker holds 1/v of a stage's activation, so
its "equivalent micro-batches" (the last column) are peak / v.

Usage::

    python -m fastpipe.bench.schedules --json bench/out/schedules.json --png bench/out/schedules.png
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from fastpipe.schedule import SCHEDULES, build, simulate
from fastpipe.schedule.builders import STAGES_PER_WORKER
from fastpipe.trace.plotting import pyplot

__all__ = ["main", "run", "plot"]

WORKERS = (4, 8)
MICROBATCHES = (4, 8, 16, 32, 64)
VIRTUAL = 2


def run(workers: Sequence[int] = WORKERS, microbatches: Sequence[int] = MICROBATCHES) -> list[dict[str, Any]]:
    """Simulates every schedule for every (K, M); returns one row per combination."""
    rows = []
    for name in SCHEDULES:
        v = VIRTUAL if name == "interleaved" else STAGES_PER_WORKER.get(name, 1)
        for k in workers:
            for m in microbatches:
                if (name == "interleaved" and m % k) or (name == "dualpipev" and m < 2 * k):
                    continue
                t = simulate(build(name, k, m, virtual_stages=v), forward=1 / v, backward=1 / v, weight=1 / v)
                rows.append(
                    {
                        "schedule": name if v == 1 else f"{name} (v={v})",
                        "K": k,
                        "M": m,
                        "makespan": t.makespan,
                        "bubble": t.bubble_fraction,
                        "peak_activations": t.peak_activations,
                        "peak_worker0_equiv": t.peak_activations[0] / v,
                    }
                )
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'schedule':<20} {'K':>2} {'M':>3} {'makespan':>9} {'bubble':>7}  {'peak act. per worker':<28} {'w0 eq.':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        peaks = ",".join(str(p) for p in r["peak_activations"])
        lines.append(
            f"{r['schedule']:<20} {r['K']:>2} {r['M']:>3} {r['makespan']:>9.1f} {r['bubble']:>7.1%}  "
            f"{peaks:<28} {r['peak_worker0_equiv']:>6.1f}"
        )
    return "\n".join(lines)


# Schedules coincide on some panels (1f1b and zb-h1 keep the same activations), so each series
# has its own marker, line style and marker size: hollow markers, largest first, stay visible as
# concentric shapes where points coincide, and a dotted line over a dashed one still shows both.
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
_LINES = ("-", "--", "-.", ":", (0, (5, 1)), (0, (1, 2, 4, 2)), (0, (3, 1, 1, 1)), (0, (8, 2)))


def _style(index: int) -> dict[str, Any]:
    return {
        "marker": _MARKERS[index % len(_MARKERS)],
        "linestyle": _LINES[index % len(_LINES)],
        "markersize": max(12 - 1.25 * index, 3),
        "markerfacecolor": "none",
        "markeredgewidth": 1.5,
        "linewidth": 1.5,
    }


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """Draws bubble and peak activations against M, one column per K (matplotlib).

    Every schedule has its own colour, marker and line style; one legend right of the panels names
    them all, in a column of its own, so that no name is cut off however few panels there are.
    """
    plt = pyplot()

    ks = sorted({r["K"] for r in rows})
    names = list(dict.fromkeys(r["schedule"] for r in rows))
    # Constrained layout sizes the panels around the suptitle and the outside legend.
    fig, axes = plt.subplots(2, len(ks), figsize=(5.5 * len(ks) + 2.2, 7.5), squeeze=False, layout="constrained")
    for col, k in enumerate(ks):
        for i, name in enumerate(names):
            sel = [r for r in rows if r["K"] == k and r["schedule"] == name]
            ms = [r["M"] for r in sel]
            style = _style(i)
            axes[0][col].plot(ms, [r["bubble"] for r in sel], color=f"C{i}", label=name, **style)
            axes[1][col].plot(ms, [r["peak_worker0_equiv"] for r in sel], color=f"C{i}", label=name, **style)
        for row, label in enumerate(("bubble fraction", "peak activations, worker 0 (micro-batches)")):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            ax.set_xlabel("micro-batches M")
            ax.set_ylabel(label)
            ax.set_title(f"K = {k}")
            ax.grid(alpha=0.3)
        axes[1][col].set_yscale("log", base=2)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.suptitle("Simulated schedules, unit costs F = B = W = 1")
    fig.legend(handles, labels, loc="outside right upper", fontsize=9, title="schedule", markerscale=0.8)
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
