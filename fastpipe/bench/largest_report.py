"""The tables and the chart of the largest-model benchmark (:func:`fastpipe.bench.largest.run_largest`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastpipe.bench.largest import shipped_pl
from fastpipe.bench.tables import table
from fastpipe.trace.plotting import pyplot

__all__ = ["at_pl_size", "largest_markdown", "plot_largest"]

_MIB = 2**20


def _mib(values: Sequence[int] | None) -> str:
    return "n/a" if not values else " / ".join(f"{v / _MIB:.1f}" for v in values)


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.0f}"


def at_pl_size(result: dict[str, Any]) -> list[dict[str, Any]]:
    """At PL's largest N: PL's step there, and each fastpipe configuration timed there, with the time ratio.

    Empty where blocks were not searched, or no PL run or no fastpipe configuration fitted.
    """
    rows = result["dims"].get("layers", [])
    pl = [r for r in rows if shipped_pl(r) and r["largest"] is not None]
    timed = result.get("fastpipe", {}).get("layers", {}).get("at_pl_size", [])
    if not pl or not timed:
        return []
    n = max(r["largest"] for r in pl)
    at = [r for r in pl if r["largest"] == n and r["step_s"] is not None]
    if not at:
        return []
    peer = min(at, key=lambda r: r["step_s"])
    out = [{"system": peer["system"], "n": n, "fits": "yes", "ms": _ms(peer["step_s"]), "ratio": "1.00"}]
    for t in timed:
        ratio = "n/a" if t["seconds"] is None else f"{t['seconds'] / peer['step_s']:.2f}"
        if t["fits"]:
            fits = "yes"
        else:
            fits = "no (refused: predicted over)" if t.get("refused") else f"no ({max(t['peaks']) / _MIB:.1f} MiB)"
        out.append({"system": t["config"], "n": t["n"], "fits": fits, "ms": _ms(t["seconds"]), "ratio": ratio})
    return out


def _summary(rows: list[dict[str, Any]], unit: int) -> str:
    def top(prefix: str) -> int | None:
        sizes = [r["largest"] for r in rows if r["system"].startswith(prefix) and r["largest"] is not None]
        return max(sizes) if sizes else None

    ours, peer = top("fastpipe"), top("pipelining")
    if ours is None or peer is None:
        return "fastpipe's largest against PL's: n/a (one of them fitted nothing)"
    return f"fastpipe's largest against PL's: {ours * unit} / {peer * unit} = {ours / peer:.2f}x"


def largest_markdown(result: dict[str, Any]) -> str:
    """The tables of :func:`~fastpipe.bench.largest.run_largest`'s result, one per searched dimension."""
    s = result["shape"]
    out = [
        f"Largest GPT whose one training step (forward, backward, Adam) fits {result['budget_bytes'] / _MIB:.0f} MiB "
        f"on every device; {result['ranks']} ranks (gloo processes, 1 thread each); vocab {s['vocab']}, sequence "
        f"{s['seq']}, batch {s['batch']}, {s['chunks']} micro-batches, {s['heads']} heads. Peaks per rank in MiB: "
        "everything alive above what the rank held before the model was built."
    ]
    for dim, rows in result["dims"].items():
        unit = 1 if dim == "layers" else result["width_unit"]
        shown = []
        for r in rows:
            if r["largest"] is None:
                size = "none (stopped: see the notes)" if r.get("stopped") else "none fits"
            else:
                size = str(r["largest"] * unit)
            shown.append(
                {
                    "system": r["system"],
                    "size": f">= {size}" if r.get("stopped") and r["largest"] is not None else size,
                    "ms": _ms(r.get("step_s")),
                    "peaks": _mib(r.get("peaks")),
                    "predicted": _mib(r.get("predicted")),
                    "ratio": "n/a" if r.get("ratio_to_pl") is None else f"{r['ratio_to_pl']:.2f}",
                }
            )
        what = (
            f"blocks N at width {s['width']}"
            if dim == "layers"
            else f"width at {result['width_layers']} blocks (steps of {unit})"
        )
        cols = [
            ("system", "system"),
            ("size", "largest N" if dim == "layers" else "largest width"),
            ("ms", "step ms there"),
            ("peaks", "measured peak per rank"),
            ("predicted", "predicted"),
            ("ratio", "x PL's largest"),
        ]
        out.append(f"Largest {what}:\n\n" + table(shown, cols))
        tried = result.get("fastpipe", {}).get(dim, {}).get("tried", [])
        if tried:
            cells = "; ".join(f"{t['config']}: {'-' if t['largest'] is None else t['largest'] * unit}" for t in tried)
            out.append(f"fastpipe's configurations ('-': none above the best of its schedule before it): {cells}")
        out.append(_summary(rows, unit))
    same = at_pl_size(result)
    if same:
        cols = [("system", "system"), ("n", "N"), ("fits", "fits"), ("ms", "step ms"), ("ratio", "x PL's time")]
        out.append(
            "At PL's largest N, the least recomputation that fits per fastpipe schedule:\n\n" + table(same, cols)
        )
    if result.get("notes"):
        out.append("\n".join(f"- {note}" for note in result["notes"]))
    return "\n\n".join(out)


def plot_largest(result: dict[str, Any], path: str) -> None:
    """Measured peak per rank against the size, one panel per system, with the budget line.

    A size whose first step already ran over the budget has no second step: its peak, drawn
    hollow, is a lower bound. A fastpipe schedule's panel draws its first configuration, the
    one searched over every size (its others were measured only next to the best size).
    """
    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    dim = "layers" if "layers" in result["dims"] else next(iter(result["dims"]))
    rows = result["dims"][dim]
    cols = min(3, len(rows))
    lines = (len(rows) + cols - 1) // cols
    fig, axes = plt.subplots(lines, cols, figsize=(4.4 * cols, 3.1 * lines), squeeze=False, sharey=True)
    budget = result["budget_bytes"] / _MIB
    unit = 1 if dim == "layers" else result["width_unit"]
    for ax, row in zip(axes.flat, rows):
        drawn = row.get("curve") or row  # fastpipe's rows: the configuration searched over every size
        points = sorted((q for q in drawn["points"] if q["peaks"]), key=lambda q: q["n"])  # refused: no step ran
        xs = [q["n"] * unit for q in points]
        for r in range(max((len(q["peaks"]) for q in points), default=0)):
            ys = [q["peaks"][r] / _MIB for q in points]
            (line,) = ax.plot(xs, ys, marker="o", markersize=3, label=f"rank {r}")
            lower = [(x, y) for x, y, q in zip(xs, ys, points) if q["seconds"] is None and not q["fits"]]
            if lower:
                ax.plot(
                    *zip(*lower),
                    linestyle="none",
                    marker="o",
                    markersize=6,
                    markerfacecolor="white",
                    color=line.get_color(),
                    label="_",
                )
        ax.axhline(budget, color="black", linestyle="--", linewidth=1, label=f"budget {budget:.0f} MiB")
        ax.plot([], [], linestyle="none", marker="o", markerfacecolor="white", color="grey", label="first step only")
        ax.set_title(drawn["system"], fontsize=8)
        ax.set_xlabel("blocks N" if dim == "layers" else "width")
        ax.set_ylabel("measured peak (MiB)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=6, loc="upper left")
    for ax in list(axes.flat)[len(rows) :]:
        ax.axis("off")
    fig.suptitle("Peak per rank of one training step (forward, backward, Adam) against model size", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
