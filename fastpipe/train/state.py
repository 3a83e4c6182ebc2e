"""What each rank of ``fastpipe train`` holds of the model state, and the collectives of its step.

:func:`state_table` gives one row per process, in rank order, on rank 0 (every rank calls it):
its bytes of parameters, gradients and AdamW state (a DTensor shard counts its local part, so
with ``--dp-shard fsdp`` a rank holds about 1/D of a replicated rank's), and the collectives
its data-parallel replicas launched in the last step, by kind: ``all_reduce`` (buckets of
replicated gradients), or ``all_gather`` and ``reduce_scatter`` (one per FSDP2 unit, per dtype).
:func:`state_lines` prints the table.
"""

from __future__ import annotations

from typing import Any

from fastpipe.distributed.fsdp import state_bytes
from fastpipe.distributed.fsdp_step import StageShards
from fastpipe.train.job import Job

__all__ = ["STATE_KINDS", "collectives_unit", "measure_bytes", "state_lines", "state_table"]

STATE_KINDS = ("parameters", "gradients", "optimizer")


def measure_bytes(job: Job) -> dict[str, int]:
    """This process's bytes of parameters, gradients and optimizer state, by :data:`STATE_KINDS`.

    Call it after the last training step, while its gradients are still held.
    """
    if job.ranks is not None:
        return dict(job.pipe.state_bytes(job.opt))
    return state_bytes(job.pipe.parameters(), job.opt)


def collectives_unit(job: Job) -> str:
    """What the collective counts are per: a step, or under ``--schedule async`` a window of ``fit``."""
    return "step" if job.runner is not None else "window"


def _collectives(job: Job) -> dict[str, int]:
    """The last step's (window's) collectives over the replicas, by kind ({} without replicas).

    Replicated stages under ``--schedule async`` all-reduce at each update inside ``fit``,
    which counts nothing.
    """
    if job.ranks is None:
        return {}
    sync = job.pipe.runtime.replicas
    if job.runner is None and not isinstance(sync, StageShards):
        return {}
    return dict(getattr(sync, "collectives", None) or {})


def state_table(job: Job, held: dict[str, int]) -> list[dict[str, Any]] | None:
    """Every process's row, in rank order, on rank 0; None on the other ranks.

    Args:
        job: the run.
        held: this process's :func:`measure_bytes`.
    """
    row: dict[str, Any] = {**held, "collectives": _collectives(job)}
    ranks = job.ranks
    if ranks is None:
        return [{"rank": 0, "stages": list(range(len(job.devices))), "replica": 0, **row}]
    row.update(rank=ranks.rank, stages=sorted(job.pipe.stages), replica=ranks.replica)
    return ranks.gather(row)


def state_lines(table: list[dict[str, Any]], dp_shard: str, per: str = "step") -> list[str]:
    """The report's lines for ``table`` (:func:`state_table`), under ``dp_shard``'s name; the
    collectives are counted per ``per`` (:func:`collectives_unit`)."""
    kinds = sorted({k for row in table for k in row["collectives"]})
    columns = ["rank", "stages", "replica", *STATE_KINDS, "total", *(k.replace("_", "-") for k in kinds)]
    lines = [
        f"  model state        {dp_shard}: MiB held by each rank"
        + (f", collectives over the replicas per {per}" if kinds else ""),
        "    " + "  ".join(columns),
    ]
    for row in table:
        mib = [row[k] / 2**20 for k in STATE_KINDS]
        cells = [
            str(row["rank"]),
            ",".join(map(str, row["stages"])),
            str(row["replica"]),
            *(f"{v:.3f}" for v in (*mib, sum(mib))),
            *(str(row["collectives"].get(k, 0)) for k in kinds),
        ]
        lines.append("    " + "  ".join(cell.rjust(len(name)) for cell, name in zip(cells, columns)))
    return lines
