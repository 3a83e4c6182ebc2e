"""The end-of-run report of ``fastpipe train``: printed summary, JSON, loss curve, timeline, trace."""

from __future__ import annotations

import json
import os
from typing import Any

from fastpipe.schedule import Schedule
from fastpipe.trace.plotting import pyplot
from fastpipe.trace.timeline import Timeline
from fastpipe.trace.timing import simulate_measured
from fastpipe.train.state import state_lines

__all__ = ["write_report", "REPORT_KEYS"]

REPORT_KEYS = (
    "settings",
    "steps",
    "start_step",
    "history",
    "val_loss",
    "unigram_entropy",
    "tokens_per_s",
    "bubble",
    "memory",
    "sample",
    "corpus",
    "devices",
    "parameters",
    "torchrun",
    "state",
    "files",
)


def _plot_loss(path: str, history: list[float], start_step: int, val_loss: float, unigram: float) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = range(1, len(history) + 1)
    ax.plot(steps, history, lw=1, label="train loss")
    ax.axhline(unigram, color="grey", ls="--", label=f"unigram entropy {unigram:.3f}")
    ax.scatter([len(history)], [val_loss], color="tab:red", zorder=3, label=f"validation {val_loss:.3f}")
    if start_step:
        ax.axvline(start_step + 0.5, color="k", lw=0.8, ls=":", label=f"resumed after step {start_step}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / char)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(
    out: str,
    *,
    settings: dict[str, Any],
    history: list[float],
    start_step: int,
    val_loss: float,
    unigram: float,
    tokens_per_s: float | None,
    timeline: Timeline,
    traced: str,
    schedule: str | Schedule,
    workers: int,
    microbatches: int,
    virtual: int,
    memory: dict[str, Any],
    sample: str,
    corpus: dict[str, Any],
    devices: list[str],
    parameters: int,
    torchrun: dict[str, int] | None = None,
    state: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Prints the summary and writes ``report.json``, ``loss.png``, ``timeline.png`` and ``trace.json``.

    ``timeline`` is the traced extra step, ``traced`` says in words what it ran, and
    ``schedule`` (a name or a built stream) is what the simulator prices with its costs.
    ``torchrun`` says where a torchrun job ran (world, replicas, restart), None for one process.
    ``state`` holds ``dp_shard``, ``collectives_per`` (step, or window under async) and, under
    ``ranks``, each process's bytes of parameters, gradients and optimizer state and its last
    step's collectives by kind (:func:`fastpipe.train.state.state_table`).

    Returns the report dict (what ``report.json`` holds; :data:`REPORT_KEYS`).
    """
    os.makedirs(out, exist_ok=True)
    files = {name: os.path.join(out, name) for name in ("report.json", "loss.png", "timeline.png", "trace.json")}
    simulated = simulate_measured(timeline, schedule, workers, microbatches, virtual)
    bubble: dict[str, Any] = {
        "timeline": traced,
        "measured": timeline.bubble_fraction,
        "simulated": simulated.bubble_fraction,
        "measured_step_s": timeline.makespan,
        "simulated_step_s": simulated.makespan,
    }
    report = {
        "settings": settings,
        "steps": len(history),
        "start_step": start_step,  # the saved step a resumed run continued from; 0: from scratch
        "history": history,
        "val_loss": val_loss,
        "unigram_entropy": unigram,
        "tokens_per_s": tokens_per_s,
        "bubble": bubble,
        "memory": memory,
        "sample": sample,
        "corpus": corpus,
        "devices": devices,
        "parameters": parameters,
        "torchrun": torchrun,
        "state": state,
        "files": files,
    }
    timeline.to_chrome_trace(files["trace.json"])
    try:
        timeline.plot(
            files["timeline.png"],
            title=f"fastpipe train: {traced}, {workers} workers (measured bubble {bubble['measured']:.1%})",
        )
        _plot_loss(files["loss.png"], history, start_step, val_loss, unigram)
    except ImportError:
        files = {k: v for k, v in files.items() if not k.endswith(".png")}
        report["files"] = files
        print("(pip install matplotlib for the loss and timeline plots)")
    with open(files["report.json"], "w") as f:
        json.dump(report, f, indent=1)

    peak = memory["activation_bytes_per_stage"]
    print(f"\nfastpipe train: {parameters / 1e6:.2f}M parameters, {settings['schedule']} on {devices}")
    if tokens_per_s is not None:
        print(f"  throughput         {tokens_per_s:,.0f} tokens/s")
    print(
        f"  bubble             measured {bubble['measured']:.1%}, simulated from the measured costs "
        f"{bubble['simulated']:.1%} ({bubble['measured_step_s'] * 1e3:.0f} ms vs "
        f"{bubble['simulated_step_s'] * 1e3:.0f} ms) over {traced}"
    )
    print("  activations kept   " + ", ".join(f"stage {s}: {b / 2**20:.1f} MiB" for s, b in enumerate(peak)))
    if "weight_copy_bytes_per_stage" in memory:
        print(
            "  weight copies      "
            + ", ".join(f"stage {s}: {b / 2**20:.1f} MiB" for s, b in enumerate(memory["weight_copy_bytes_per_stage"]))
        )
    if state is not None:
        print("\n".join(state_lines(state["ranks"], state["dp_shard"], state["collectives_per"])))
    for device, b in memory.get("max_memory_allocated_per_device", {}).items():
        print(f"  max allocated      {device}: {b / 2**30:.2f} GiB")
    verdict = "below" if val_loss < unigram else "NOT below"
    print(
        f"  validation loss    {val_loss:.3f} nats/char, {verdict} the unigram entropy {unigram:.3f} "
        f"({val_loss / unigram:.0%} of it)"
    )
    print("  sample:\n" + "\n".join("    | " + line for line in sample.splitlines()))
    print(f"  files: {', '.join(files.values())}")
    return report
