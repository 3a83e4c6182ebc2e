"""Pipeline x FSDP2 on a 2 x 2 mesh: replicated stages, fastpipe's sharded stages and torchtitan's composition.

``fastpipe bench --only fsdp`` (or ``python -m fastpipe.bench.fsdp``) spawns 4 ranks, 2 pipeline
stages x 2 replicas (gloo on CPU; NCCL with 4 or more GPUs) and trains, side by side in the same
processes (:mod:`fastpipe.bench.fsdp_ranks`):

* ``fastpipe replicate``: ``DistributedPipe`` with whole stages on every replica;
* ``fastpipe fsdp``: ``DistributedPipe(dp_shard="fsdp")``, stages sharded over their replicas;
* ``pipelining fsdp``: ``torch.distributed.pipelining``'s ``PipelineStage`` over ``fully_shard``-ed
  stages with ``Schedule1F1B``, as torchtitan composes them.

It reports, per method, the largest per-rank bytes of parameters + gradients + Adam state, the
median and fastest step (zero_grad, the 1F1B schedule and Adam's step), the collectives among the
replicas per step, and the losses against one process on the whole batch; the ratios the targets
are about, each a median of per-round ratios, so that both sides of a ratio ran under the same
load; and where each stage's step spends its time (its gathers and reductions, Adam).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from typing import Any

import torch

from fastpipe.bench.fsdp_ranks import METHODS, PHASES, SIZES, rank_main
from fastpipe.bench.ranks import join_within, start_ranks
from fastpipe.bench.report import write_json
from fastpipe.bench.steps import free_port
from fastpipe.bench.tables import table

__all__ = ["ROUNDS_SHARE", "TARGETS", "fsdp_markdown", "loss_tolerance", "main", "run_fsdp"]

ROUNDS_SHARE = 0.7  # of the part's time, what the timed rounds may take
# ratio -> (numerator, denominator, at most)
TARGETS: dict[str, tuple[str, str, float]] = {
    "bytes fsdp / replicate": ("fastpipe fsdp", "fastpipe replicate", 0.55),
    "step fsdp / replicate": ("fastpipe fsdp", "fastpipe replicate", 1.15),
    "step fsdp / pipelining fsdp": ("fastpipe fsdp", "pipelining fsdp", 1.0),
}


def loss_tolerance(w: dict[str, int], steps: int) -> float:
    """Relative tolerance for a loss of the same math rounded in another order (tests/fp_tolerance.py's rule).

    ``8 * eps * sqrt(k)``, ``k`` the reductions on the path to the loss: per block LayerNorm's
    ``hidden`` and the two GEMMs' ``hidden + ffn``, the loss's ``batch * hidden``, and, from the
    second step on, the rows each gradient sums over, once per step the weights have taken.
    """
    k = w["blocks"] * (2 * w["hidden"] + w["ffn"]) + w["batch"] * w["hidden"] + (steps - 1) * w["batch"]
    return 8.0 * torch.finfo(torch.float32).eps * math.sqrt(k)


def _losses(name: str, ranks: list[dict[str, Any]]) -> list[float]:
    """The global batch's loss per step: fastpipe's from rank 0; pipelining's, the mean of its last stage's replicas."""
    if name.startswith("fastpipe"):
        return [float(v) for v in ranks[0]["losses"][name]]
    last = max(r["pp"] for r in ranks)
    per_replica = [r["losses"][name] for r in ranks if r["pp"] == last]
    return [statistics.fmean(step) for step in zip(*per_replica)]


def _summarise(data: dict[str, Any], w: dict[str, int]) -> dict[str, Any]:
    ranks: list[dict[str, Any]] = data["ranks"]
    times: dict[str, list[float]] = data["times"]
    reference: list[float] = data["one_process"]
    rows: list[dict[str, Any]] = []
    for name in METHODS:
        if name in data["errors"]:
            rows.append({"method": name, "error": data["errors"][name]})
            continue
        held = [r["held"][name] for r in ranks]
        losses = _losses(name, ranks)
        rel = [abs(a - b) / abs(b) for a, b in zip(losses, reference)]
        tolerance = [loss_tolerance(w, i + 1) for i in range(len(rel))]
        rows.append(
            {
                "method": name,
                "state_bytes": max(sum(h.values()) for h in held),
                "parameters": max(h["parameters"] for h in held),
                "gradients": max(h["gradients"] for h in held),
                "optimizer": max(h["optimizer"] for h in held),
                "median_s": statistics.median(times[name]),
                "min_s": min(times[name]),
                "times_s": times[name],
                "collectives": ranks[0]["collectives"][name],
                "losses": losses,
                "first_loss_rel_diff": rel[0],
                "max_loss_rel_diff": max(rel),
                "losses_within_tolerance": all(r <= t for r, t in zip(rel, tolerance)),
            }
        )
    by_name = {r["method"]: r for r in rows if "error" not in r}
    ratios: list[dict[str, Any]] = []
    for what, (top, bottom, most) in TARGETS.items():
        entry: dict[str, Any] = {"ratio": what, "target": f"<= {most:g}"}
        missing = [n for n in (top, bottom) if n not in by_name]
        if missing:
            entry["value"] = f"not measured: {missing[0]} failed ({data['errors'][missing[0]]})"
        elif what.startswith("bytes"):
            entry["value"] = by_name[top]["state_bytes"] / by_name[bottom]["state_bytes"]
        else:
            entry["value"] = statistics.median(a / b for a, b in zip(times[top], times[bottom]))
        if isinstance(entry["value"], float):
            entry["met"] = "yes" if entry["value"] <= most else "no (missed)"
        ratios.append(entry)
    phases = [
        {"method": name, "stage": r["pp"], **{k: statistics.median(v) for k, v in _by_phase(r["phases"][name]).items()}}
        for name in METHODS
        if name in by_name
        for r in sorted(ranks, key=lambda r: r["pp"])
        if r["dp"] == 0
    ]
    return {
        "workload": {k: w[k] for k in ("blocks", "hidden", "ffn", "batch", "chunks")},
        "rounds": data["rounds"],
        "warmup": w["warmup"],
        "backend": data["backend"],
        "device": data["device"],
        "one_process_losses": reference,
        "rows": rows,
        "ratios": ratios,
        "phases": phases,
    }


def _by_phase(steps: list[dict[str, float]]) -> dict[str, list[float]]:
    return {k: [step[k] for step in steps] for k in PHASES if steps and k in steps[0]}


def run_fsdp(timeout: float, size: str = "full") -> dict[str, Any]:
    """The figures of the 3 methods on 4 spawned ranks (see the module doc), with a markdown table.

    Args:
        timeout: seconds before the ranks are stopped; once 3 rounds were timed, no round starts
            past :data:`ROUNDS_SHARE` of it.
        size: ``"full"`` (the reference workload, up to 15 timed rounds), ``"quick"`` (3 rounds) or
            ``"tiny"`` (toy sizes for tests: the times mean nothing).

    Raises:
        ValueError: an unknown ``size``.
        RuntimeError: a rank failed, or the ranks ran past ``timeout`` (they are stopped).
    """
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(SIZES)}, got {size!r}")
    w = SIZES[size]
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "fsdp.json")
        # The last part of the time is left to the one-process reference and the ranks' exit.
        rounds_by = time.time() + ROUNDS_SHARE * timeout
        join_within(start_ranks(rank_main, (free_port(), w, out, rounds_by), 4), timeout, "the fsdp ranks")
        with open(out) as f:
            data = json.load(f)
    result = _summarise(data, w)
    result["load_average"] = {"before": load_before, "after": os.getloadavg()[0]}
    gpus = torch.cuda.device_count()
    if 0 < gpus < 4:
        result["notes"] = [f"the ranks ran on the CPU: one rank per GPU needs 4 GPUs, this host has {gpus}"]
    result["markdown"] = fsdp_markdown(result)
    return result


def _cell(value: Any) -> Any:
    return f"{value:.3f}" if isinstance(value, float) else value


def fsdp_markdown(res: dict[str, Any]) -> str:
    """The part's tables: per method, then the target ratios."""
    w, load = res["workload"], res["load_average"]
    head = (
        f"4 {res['backend']} ranks ({res['device']}), 2 stages x 2 replicas, 1F1B; {w['blocks']} residual MLP "
        f"blocks {w['hidden']}/{w['ffn']}, global batch {w['batch']} (half per replica), {w['chunks']} "
        f"micro-batches per replica, Adam; medians of {res['rounds']} rounds after {res['warmup']} warm-up, "
        f"load average {load['before']:.1f} -> {load['after']:.1f}"
    )
    rows = []
    for r in res["rows"]:
        if "error" in r:
            rows.append({"method": r["method"], "mib": f"failed: {r['error']}"})
            continue
        rows.append(
            {
                **r,
                "mib": r["state_bytes"] / 2**20,
                "ms": r["median_s"] * 1e3,
                "min_ms": r["min_s"] * 1e3,
                "first": f"{r['first_loss_rel_diff']:.1e}",
                "max": f"{r['max_loss_rel_diff']:.1e}",
                "ok": "yes" if r["losses_within_tolerance"] else "no",
                "coll": ", ".join(f"{n} {k.replace('_', '-')}" for k, n in r["collectives"].items()) or "not counted",
            }
        )
    methods = table(
        rows,
        [
            ("method", "method"),
            ("mib", "per-rank params + grads + Adam MiB"),
            ("ms", "median step ms"),
            ("min_ms", "fastest step ms"),
            ("coll", "collectives per step, rank 0"),
            ("first", "loss vs 1 process, step 1 (rel.)"),
            ("max", "worst step (rel.)"),
            ("ok", "within fp tolerance"),
        ],
    )
    ratios = table(
        [{**r, "value": _cell(r["value"])} for r in res["ratios"]],
        [("ratio", "ratio (one run)"), ("value", "median"), ("target", "target"), ("met", "met")],
    )
    phases = table(
        [{**r, **{k: f"{r[k] * 1e3:.1f}" for k in PHASES if k in r}} for r in res["phases"]],
        [("method", "where a step's time goes, ms (median)"), ("stage", "stage (replica 0)")]
        + [(k, "Adam step" if k == "optimizer" else k) for k in PHASES],
    )
    return f"{head}\n\n{methods}\n\n{ratios}\n\n{phases}"


def main(argv: list[str] | None = None) -> None:
    """``python -m fastpipe.bench.fsdp``: prints the tables, optionally writes the figures as JSON."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=list(SIZES), default="full")
    parser.add_argument("--timeout", type=float, default=1800.0, help="stop the ranks after this many seconds")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    res = run_fsdp(args.timeout, args.size)
    print(res["markdown"])
    write_json(res, args.json)


if __name__ == "__main__":
    main()
