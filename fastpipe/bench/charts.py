"""Bar charts of one figure per method, each bar labelled with its value (``e2e.png``).

Bars are coloured by what a method is, so fastpipe's rows stand out from the baselines and the
peers; the legend sits above the axes, where it cannot cover a bar, and the x-axis reaches past
the longest bar so that every value label is inside the chart. A method whose figure is missing
(NaN) keeps its row and reads "n/a".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from fastpipe.trace.plotting import pyplot

__all__ = ["FAMILIES", "family", "ratio_chart"]

# family -> (colour, legend label); the order is the legend's.
FAMILIES: dict[str, tuple[str, str]] = {
    "baseline": ("#8c8c8c", "one device (plain, gradient accumulation)"),
    "fastpipe": ("#4c72b0", "fastpipe"),
    "peer": ("#dd8452", "torchgpipe, torch.distributed.pipelining"),
}


def family(method: str) -> str:
    """``"fastpipe"``, ``"peer"`` (torchgpipe, ``torch.distributed.pipelining``) or ``"baseline"``."""
    name = method.lower()
    if name.startswith("fastpipe"):
        return "fastpipe"
    if "torchgpipe" in name or "pipelining" in name:
        return "peer"
    return "baseline"


def ratio_chart(
    path: str,
    methods: Sequence[str],
    values: Sequence[float],
    *,
    reference: float,
    reference_label: str,
    xlabel: str,
    dpi: int = 100,
) -> None:
    """Writes a PNG of one labelled horizontal bar per method, top to bottom in the given order.

    Args:
        path: where the PNG goes.
        methods: the row labels.
        values: one figure per method (``NaN``: no figure, the row reads "n/a").
        reference: where the dashed reference line goes (the limit, or 1.0).
        reference_label: its legend entry.
        xlabel: the x-axis label, with the figure's unit and direction ("lower is better").
        dpi: the PNG's resolution.

    Raises:
        ValueError: ``methods`` and ``values`` differ in length, or a value is negative.
        ImportError: matplotlib is not installed (``pip install matplotlib``).
    """
    if len(methods) != len(values):
        raise ValueError(f"ratio_chart: {len(methods)} methods but {len(values)} values; give one value per method")
    if any(v < 0 for v in values):
        raise ValueError(f"ratio_chart: values must be >= 0 (ratios), got {list(values)}")
    plt = pyplot()
    from matplotlib.patches import Patch

    # Constrained layout makes room above the axes for the legend, which spans the whole figure
    # (the method names take the left part of it).
    fig, ax = plt.subplots(figsize=(9, 0.4 * len(methods) + 1.8), layout="constrained")
    rows = list(range(len(methods)))
    shown = [0.0 if math.isnan(v) else v for v in values]
    bars = ax.barh(rows, shown, color=[FAMILIES[family(m)][0] for m in methods], edgecolor="black", linewidth=0.4)
    ax.bar_label(bars, labels=["n/a" if math.isnan(v) else f"{v:.2f}x" for v in values], padding=3, fontsize=8)
    ax.set_yticks(rows, list(methods))
    ax.invert_yaxis()  # the first method on top
    ax.axvline(reference, color="black", linestyle="--", linewidth=1)
    ax.set_xlim(0, 1.18 * max([reference, *shown]))  # room right of the longest bar for its label
    ax.set_xlabel(xlabel)
    present = [f for f in FAMILIES if any(family(m) == f for m in methods)]
    handles: list[Any] = [Patch(facecolor=FAMILIES[f][0], edgecolor="black", label=FAMILIES[f][1]) for f in present]
    (line,) = ax.plot([], [], color="black", linestyle="--", linewidth=1, label=reference_label)
    fig.legend(handles=[*handles, line], loc="outside upper center", ncols=2, fontsize=8, frameon=False)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
