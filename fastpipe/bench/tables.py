"""Markdown tables of a ``fastpipe bench`` report, to paste into ``bench/RESULTS.md``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["markdown", "table"]


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, list):
        return ",".join(_fmt(v) for v in value)
    return str(value)


def table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    """A markdown table of ``rows``; ``columns`` are (key, header) pairs."""
    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(r.get(k, "")) for k, _ in columns) + " |" for r in rows]
    return "\n".join(lines)


def _e2e(res: dict[str, Any]) -> str:
    w = res["workload"]
    head = (
        f"K = {res['k']} ({', '.join(w['devices'])}), M = {res['m']}, {w['blocks']} residual MLP blocks "
        f"{w['hidden']}/{w['ffn']}, batch {w['batch']}; T_mb = {res['t_mb_s'] * 1e3:.1f} ms, limit "
        f"{res['limit_s'] * 1e3:.1f} ms (at most {res['ideal_speedup']:.2f}x over 1 device; "
        f"{res['reference']})"
    )
    rows = [{**r, "ms": r["median_s"] * 1e3} for r in res["rows"]]
    return (
        head
        + "\n\n"
        + table(
            rows,
            [
                ("method", "method"),
                ("ms", "median ms"),
                ("speedup_over_1_device", "speed-up over 1 device"),
                ("fraction_of_limit", "fraction of limit"),
            ],
        )
    )


def _schedules(res: dict[str, Any]) -> str:
    return "Simulated, unit costs F = B = W = 1\n\n" + table(
        res["rows"],
        [
            ("schedule", "schedule"),
            ("K", "K"),
            ("M", "M"),
            ("bubble", "bubble"),
            ("peak_activations", "peak activations per worker"),
        ],
    )


def _memory(res: dict[str, Any]) -> str:
    rows = [{**r, "kept_kib": r["kept_bytes"] / 1024, "state_mib": r["state_bytes"] / 2**20} for r in res["rows"]]
    cols = [
        ("batch", "batch"),
        ("mode", "mode"),
        ("kept_kib", "kept per block KiB"),
        ("state_mib", "state per block MiB"),
        ("largest_blocks", "largest model (blocks)"),
        ("ratio_to_plain", "x plain"),
    ]
    if rows and "measured_peak_bytes" in rows[0]:
        cols.append(("measured_peak_bytes", "measured peak bytes (check)"))
        cols.append(("predicted_peak_bytes", "predicted peak bytes"))
    kernels = (
        f"{res['device']}, budget {res['budget']}, hidden {res['hidden']}/{res['ffn']} "
        f"({res['reference']})\n\n" + table(rows, cols)
    )
    largest = res.get("largest", {}).get("markdown")  # fastpipe.bench.largest_report writes it
    return kernels if largest is None else f"{largest}\n\nOne device, the fused kernels: {kernels}"


def _copy(res: dict[str, Any]) -> str:
    return f"{res['what']}\n\n" + table(
        [res],
        [
            ("t_compute_ms", "compute ms"),
            ("t_copy_ms", "copies ms"),
            ("t_both_ms", "both ms"),
            ("efficiency", "overlap efficiency"),
        ],
    )


def _kernels(res: dict[str, Any]) -> str:
    out = [f"{res.get('device')} ({res.get('path')} path)"]
    if res.get("timings"):
        out.append(
            table(
                res["timings"],
                [
                    ("op", "op"),
                    ("fused_ms", "fused ms"),
                    ("eager_ms", "eager ms"),
                    ("speedup_vs_eager", "x eager"),
                    ("pct_of_copy_bw", "% of copy BW"),
                ],
            )
        )
    if res.get("saved_bytes"):
        keys = list(dict.fromkeys(k for r in res["saved_bytes"] for k in r))
        out.append(table(res["saved_bytes"], [(k, k) for k in keys]))
    return "\n\n".join(out)


def _zero_bubble(res: dict[str, Any]) -> str:
    w = res["workload"]
    head = (
        f"{w['ranks']} gloo ranks x {w['threads_per_rank']} thread, {w['blocks']} residual MLP blocks "
        f"{w['hidden']}/{w['ffn']}, batch {w['batch']}, M = {w['chunks']}; medians of {res['rounds']} paired "
        f"rounds, load average {res['load_average']['before']:.1f} -> {res['load_average']['after']:.1f}"
    )
    ratios = [{"pair": k, "ratio": v} for k, v in res["paired_ratio"].items()]
    bubbles = [{"schedule": k, **v} for k, v in res["bubble"].items()]
    return "\n\n".join(
        [
            head,
            table(ratios, [("pair", "paired step-time ratio"), ("ratio", "median")]),
            table(bubbles, [("schedule", "schedule"), ("measured", "bubble, traced"), ("simulated", "simulated")]),
        ]
    )


def _prewritten(res: dict[str, Any]) -> str:
    """A part that writes its own tables (:mod:`fastpipe.bench.fsdp`)."""
    return str(res["markdown"])


_FORMATS = {
    "e2e": _e2e,
    "distributed": _e2e,
    "schedules": _schedules,
    "memory": _memory,
    "copy": _copy,
    "kernels": _kernels,
    "zero-bubble": _zero_bubble,
    "fsdp": _prewritten,
}


def markdown(report: dict[str, Any]) -> str:
    """Every part's table, with the host and date."""
    host = report["host"]
    gpus = ", ".join(host["gpus"]) or "no GPU"
    out = [
        f"## fastpipe bench ({host['date']}; {gpus}; {host['cpus']} CPUs; torch {host['torch']}"
        f"{'; --quick' if report['quick'] else ''}{'; --tiny' if report['tiny'] else ''})"
    ]
    for name, entry in report["parts"].items():
        out.append(f"### {name} ({entry['seconds']:.0f} s)")
        if entry["status"] != "ok":
            out.append(f"failed: {entry['error']}")
            continue
        res = entry["result"]
        if "skipped" in res:
            out.append(f"skipped: {res['skipped']}")
            continue
        try:
            out.append(_FORMATS[name](res))
        except (KeyError, TypeError) as exc:
            out.append(f"(no table: {exc!r})")
        out += [f"- {note}" for note in res.get("notes", [])]
    return "\n\n".join(out) + "\n"
