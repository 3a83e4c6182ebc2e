"""The largest GPT that each system trains one step of within a fixed per-device budget.

GPipe's claim is about size: partitioning plus re-materialization trains models that do not
fit one device. This benchmark measures it. A GPT of the family ``[Embedding, Block x N, Head]``
(:mod:`fastpipe.bench.largest_model`: pre-norm blocks of width ``d``, SDPA causal attention, a 4x
GELU MLP; fixed vocabulary, sequence length and batch) is trained for one step (forward,
backward, Adam) by each system, on K ranks of one device each:

* plain PyTorch on one device, the whole model within one device's budget, full batch, with
  and without ``torch.utils.checkpoint`` per block;
* ``torch.distributed.pipelining`` (PL) ``Schedule1F1B`` (K stages) and ``ScheduleZBVZeroBubble``
  (2K stages in a V), with and without checkpointing per block;
* fastpipe ``DistributedPipe``, schedules ``1f1b``, ``zb-h1``, ``zb-v`` with checkpoint modes
  ``never``, ``except_last``, ``always`` (a stage's forward recomputed per micro-batch) and
  ``blocks`` (``checkpoint="never"`` with every block under ``torch.utils.checkpoint``, as PL gets):
  one row per schedule, its configuration that fits the largest model (the faster one at a tie).
  The first configuration of a schedule is searched over every size, each later one only from one
  size above the best so far (all it could add) and at the best size (for the tie);
* fastpipe's planner (:mod:`fastpipe.distributed.plan`): ``DistributedPipe(model, "auto",
  schedule="auto", checkpoint="auto", memory_limit=budget)``, with Adam on the device and under
  the host optimizer. A size whose every plan it predicts over the budget is refused before any
  step, and counts as not fitting;
* torchgpipe, noted: its partitions are threads of one process, so on CPU no device's bytes
  can be told apart; it needs one GPU per partition.

A size fits when every rank's measured peak (everything the step holds above what the rank held
before the model was built: parameters, gradients, Adam's moments, activations, buffers) is
within the budget. The largest size is found by doubling then bisection
(:mod:`fastpipe.bench.largest_search`), along the blocks N at a fixed width and along the width at
fixed N. Then, at PL's largest N, each fastpipe schedule is timed with the least recomputation
that fits, against PL's step at that N.

Each system runs in its own set of ranks (:func:`fastpipe.bench.ranks.start_ranks`). On CPU a rank
is a gloo process with one thread whose CPU bytes, counted exactly, are its device's. With fewer
GPUs than ranks (NCCL refuses two ranks on one GPU) the ranks run on CPU on a GPU host too, and
the notes say so.

``predicted`` is, for fastpipe, each rank's peak as ``DistributedPipe(memory_limit=)``'s memory
model predicts it at the step's start (:mod:`fastpipe.distributed.memory_limit`, under a limit no
step reaches); for the other systems it comes from :func:`predict`, a hook that answers None
(printed ``n/a``): no model of their memory is built.
"""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from fastpipe.bench.largest_ranks import rank_main, stage_layers
from fastpipe.bench.largest_systems import Config, System, fastpipe_configs, peer_systems, predict, shipped_pl
from fastpipe.bench.ranks import RanksTimedOut, join_within, start_ranks
from fastpipe.bench.steps import free_port

__all__ = ["PRESETS", "Config", "System", "fastpipe_configs", "peer_systems", "predict", "run_largest", "shipped_pl"]

_MIB = 2**20

PRESETS: dict[str, dict[str, Any]] = {
    # Tests: toy sizes on 2 ranks, one system of each kind, in seconds; the figures mean nothing.
    "tiny": {
        "shape": {"vocab": 64, "seq": 16, "heads": 2, "width": 32, "batch": 8, "chunks": 4},
        "ranks": 2,
        "budget": 2 * _MIB,
        "start": 4,
        "cap": 64,
        "width_layers": 4,
        "width_unit": 16,
        "dims": ("layers",),
        "peers": (("plain", "", "never"), ("pipelining", "1F1B", "never")),
        "fastpipe": (
            ("fastpipe", "1f1b", "always"),
            ("fastpipe", "1f1b", "never"),
            ("fastpipe", "1f1b", "always+blocks", "host"),
        ),
    },
    "quick": {
        "shape": {"vocab": 256, "seq": 64, "heads": 4, "width": 128, "batch": 8, "chunks": 8},
        "ranks": 4,
        "budget": 24 * _MIB,
        "start": 8,
        "cap": 256,
        "width_layers": 8,
        "width_unit": 32,
        "dims": ("layers",),
    },
    "full": {
        "shape": {"vocab": 256, "seq": 64, "heads": 4, "width": 128, "batch": 16, "chunks": 8},
        "ranks": 4,
        "budget": 48 * _MIB,
        "start": 8,
        "cap": 256,
        "width_layers": 16,
        "width_unit": 32,
    },
}


def _run_job(job: dict[str, Any], world: int, timeout: float) -> dict[str, Any]:
    """One set of ranks for one job; what they measured, with the error that stopped them if one did."""
    record: dict[str, Any] = {"runs": [], "at": [], "stopped": None}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "points.json")
        ctx = start_ranks(rank_main, (world, free_port(), job, out), world)
        error = None
        try:
            join_within(ctx, timeout, "the ranks")
        except RanksTimedOut as exc:
            error = str(exc)
        except Exception as exc:  # noqa: BLE001 - the points measured before the failure still count
            lines = [line for line in str(exc).splitlines() if line.strip()]
            error = f"the ranks failed: {lines[-1] if lines else type(exc).__name__}"
        if os.path.exists(out):
            with open(out) as f:
                record = json.load(f)
    if error is not None:
        record["stopped"] = {"phase": "at" if record["at"] else "search", "why": error}
    return record


@dataclass
class _Runner:
    preset: dict[str, Any]
    deadline: float
    weight_left: float  # the jobs still to run: a peer counts 1, fastpipe 2 per schedule plus 1
    predict: Callable[[Config], list[int] | None]
    notes: list[str] = field(default_factory=list)

    def world(self, system: System) -> int:
        return 1 if system.kind == "plain" else int(self.preset["ranks"])

    def shape(self, dim: str, n: int) -> dict[str, int]:
        p = self.preset
        shape = dict(p["shape"], layers=p["width_layers"])
        if dim == "layers":
            shape["layers"] = n
        else:
            shape["width"] = n * p["width_unit"]
        return shape

    def job(
        self, groups: list[list[System]], dim: str, *, start: int, at: dict[str, Any] | None, weight: float
    ) -> dict[str, Any]:
        p = self.preset
        systems = [s for g in groups for s in g]
        world = self.world(systems[0])
        # The fewest blocks that give every stage a layer (the embedding and the head are layers too).
        floor = max(1, world * max(s.stages_per_rank for s in systems) - 2) if dim == "layers" else 1
        cap = max(p["cap"] if dim == "layers" else p["cap"] // 8, start, floor)
        left = self.deadline - time.monotonic()
        share = min(left * weight / max(self.weight_left, weight), 1e7)
        self.weight_left -= weight
        if share <= 0:
            return {"runs": [], "at": [], "stopped": {"phase": "search", "why": "time budget spent before it started"}}
        job = {
            "shape": self.shape(dim, p["width_layers"]),
            "dim": dim,
            "width_unit": p["width_unit"],
            "budget": p["budget"],
            "start_by": time.time() + share,
            "search": {
                "groups": [[asdict(s) for s in g] for g in groups],
                "start": max(start, floor),
                "floor": floor,
                "cap": cap,
            },
            "at": at,
        }
        return _run_job(job, world, share + 120.0)  # the size in progress may finish past its share

    def stopped(self, record: dict[str, Any], what: str, dim: str) -> str | None:
        """Why the search stopped before its end (noted), or None where it ran to its end."""
        stop = record.get("stopped")
        if not stop:
            return None
        self.notes.append(f"{what} ({dim}): stopped in the {stop['phase']}, {stop['why']}")
        return str(stop["why"]) if stop["phase"] == "search" else None

    def row(self, system: System, dim: str, run: dict[str, Any], stopped: str | None) -> dict[str, Any]:
        points = run["points"]
        fitting = [q for q in points if q["fits"]]
        best = max(fitting, key=lambda q: q["n"]) if fitting else None
        row: dict[str, Any] = {"system": system.name, "config": asdict(system), "points": points, "stopped": stopped}
        row.update(largest=None, peaks=[], step_s=None, predicted=None)
        if best is not None:
            n, world = best["n"], self.world(system)
            shape = self.shape(dim, n)
            balance = stage_layers(shape["layers"], world * system.stages_per_rank)
            row.update(largest=n, peaks=best["peaks"], step_s=best["seconds"])
            # A fastpipe rank predicts its own peak (``memory_limit``'s model); the hook answers for the others.
            own = best.get("predicted")
            row["predicted"] = own or self.predict(Config(system, shape, world, balance, self.preset["budget"]))
        return row

    def peer(self, system: System, dim: str, start: int) -> dict[str, Any]:
        record = self.job([[system]], dim, start=start, at=None, weight=1.0)
        run = record["runs"][0] if record["runs"] else {"points": []}
        return self.row(system, dim, run, self.stopped(record, system.name, dim))

    def fastpipe(self, configs: list[System], dim: str, start: int, pl_n: int | None) -> dict[str, Any]:
        """Per schedule, the row of its best configuration; every configuration's outcome; the steps at PL's N."""
        # The planner's rows stand apart: it chooses its own recompute.
        kinds = list(dict.fromkeys((c.schedule, c.optimizer, c.checkpoint == "auto") for c in configs))
        groups = [[c for c in configs if (c.schedule, c.optimizer, c.checkpoint == "auto") == k] for k in kinds]
        at = None
        if pl_n is not None:
            # The least recomputation first: the fastest step.
            least_first = ("auto", "never", "except_last", "always", "blocks", "always+blocks")
            at = {
                "n": pl_n,
                "groups": [[asdict(c) for m in least_first for c in g if c.checkpoint == m] for g in groups],
            }
        record = self.job(groups, dim, start=start, at=at, weight=2.0 * len(groups) + 1.0)
        stopped = self.stopped(record, "fastpipe", dim)
        rows, tried = [], []
        for g, (schedule, optimizer, planned) in enumerate(kinds):
            runs = [run for run in record["runs"] if run["group"] == g]
            mine = [self.row(System(**run["system"]), dim, run, stopped) for run in runs]
            tried += [{"config": r["system"], "largest": r["largest"], "step_s": r["step_s"]} for r in mine]
            fitted = [r for r in mine if r["largest"] is not None]
            if not mine:
                mine = [self.row(groups[g][0], dim, {"points": []}, stopped)]
            best = max(fitted, key=lambda r: (r["largest"], -(r["step_s"] or float("inf")))) if fitted else mine[0]
            how = System(**best["config"]).recompute
            # The chart draws the configuration searched from the start; the others measured only near its edge.
            curve = {"system": mine[0]["system"], "points": mine[0]["points"]}
            where = " + host optimizer" if optimizer == "host" else ""
            named = groups[g][0].name if planned else f"fastpipe {schedule}{where} (best of {len(runs)}: {how})"
            rows.append(dict(best, system=named, curve=curve))
        timed = [{"config": System(**a["system"]).name, **a["point"]} for a in record.get("at", [])]
        return {"rows": rows, "tried": tried, "at_pl_size": timed}


def run_largest(
    preset: str | dict[str, Any] = "full",
    *,
    deadline: float | None = None,
    dims: Sequence[str] | None = None,
    systems: Sequence[System] | None = None,
    fastpipe: Sequence[System] | None = None,
    predict: Callable[[Config], list[int] | None] = predict,
) -> dict[str, Any]:
    """The largest model per system under the preset's per-device budget (see the module doc).

    Args:
        preset: a name in :data:`PRESETS`, or a dict with the same keys.
        deadline: a ``time.monotonic()`` after which no size starts (each system gets a share of
            what is left); none by default.
        dims: ``"layers"`` (blocks at the preset's width) and/or ``"width"`` (at ``width_layers`` blocks,
            in steps of ``width_unit``); default the preset's ``dims``, else both.
        systems: the peers; default the preset's ``peers`` (``(kind, schedule, checkpoint)``), else
            :func:`peer_systems`.
        fastpipe: fastpipe's configurations (empty for none); default the preset's ``fastpipe``, else
            :func:`fastpipe_configs`.
        predict: each rank's predicted peak of a :class:`Config`, or None.

    Raises:
        ValueError: an unknown preset or dimension, or a budget that is not a positive int of bytes.
    """
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
        preset = PRESETS[preset]
    budget = preset["budget"]
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
        raise ValueError(f"the preset's budget must be a positive int (bytes per device), got {budget!r}")
    dims = tuple(preset.get("dims", ("layers", "width"))) if dims is None else tuple(dims)
    if not dims or any(d not in ("layers", "width") for d in dims):
        raise ValueError(f"dims must name 'layers' and/or 'width', got {list(dims)!r}")
    given = preset.get("peers")
    peers = list(systems) if systems is not None else [System(*t) for t in given] if given else peer_systems()
    given = preset.get("fastpipe")
    ours = list(fastpipe) if fastpipe is not None else [System(*t) for t in given] if given else fastpipe_configs()
    weight = len(dims) * (len(peers) + (2.0 * len({c.schedule for c in ours}) + 1.0 if ours else 0.0))
    runner = _Runner(preset, deadline if deadline is not None else float("inf"), weight, predict)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if torch.cuda.is_available():
        runner.notes.append(
            f"ranks on CPU: one rank per GPU needs {preset['ranks']} GPUs, this host has {torch.cuda.device_count()}"
        )
    installed = importlib.util.find_spec("torchgpipe") is not None
    runner.notes.append(
        "torchgpipe: not measured; its partitions are threads of one process, so no device's bytes are apart on CPU"
        if installed
        else "torchgpipe: not installed here (pip install torchgpipe), not measured"
    )
    out: dict[str, Any] = {"budget_bytes": budget, "shape": preset["shape"], "ranks": preset["ranks"]}
    out.update(width_layers=preset["width_layers"], width_unit=preset["width_unit"], dims={}, fastpipe={})
    for dim in dims:
        start = preset["start"] if dim == "layers" else 2
        rows = [runner.peer(s, dim, start) for s in peers]
        pl = [r["largest"] for r in rows if shipped_pl(r) and r["largest"]]
        if ours:
            found = runner.fastpipe(ours, dim, start, max(pl) if pl and dim == "layers" else None)
            rows += found.pop("rows")
            out["fastpipe"][dim] = found
        for r in rows:
            r["ratio_to_pl"] = r["largest"] / max(pl) if pl and r["largest"] else None
        out["dims"][dim] = rows
    out["notes"] = runner.notes
    return out
