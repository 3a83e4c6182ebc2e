"""What a stage sharded over its replicas with FSDP2 (``dp_shard="fsdp"``) holds, and when.

Between steps a rank holds its shard of each parameter, of its gradient and of the optimizer
state. FSDP2 cuts a parameter along its rows as :func:`torch.chunk` does and pads every shard to
``ceil(rows / D)`` rows, so a shard's storage is that padded size (the first rank's shard is the
largest, and a device is predicted at its largest). During a step
(:mod:`fastpipe.distributed.fsdp_step`) a rank also holds::

    step begins        every unit's all-gather buffer (padded, full size), kept until every
                       unit has copied its gathered parameters out of it: twice the stage
    until the stage's  the gathered parameters ("gathered"); the full-size gradient sums are
    last BW / W        the model's "gradients", as for a whole stage
    from then          the reduce-scatter's input (the padded full-size sums, flattened) and
                       its output (this rank's gradient shard), to the end of the step
                       ("reduce_scatter"); the gathered parameters are freed just after. gloo
                       copies the input once more, until the collective completes

:func:`shard_bytes` measures a stage's :class:`ShardBytes` from its parameters' shapes, sharded
already or not; :func:`shard_points` turns them into the byte events of
:func:`fastpipe.memory.model.predict_memory`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Protocol

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from fastpipe.schedule.ir import Action, Schedule

__all__ = ["ShardBytes", "Whole", "kept_bytes", "shard_bytes", "shard_points"]

Point = tuple[float, float, str]


class Whole(Protocol):
    """A whole stage's bytes, as :class:`~fastpipe.memory.model.StageBytes` gives them."""

    @property
    def parameters(self) -> int: ...

    @property
    def trainable(self) -> int: ...

    @property
    def stepped(self) -> int: ...


@dataclass(frozen=True)
class ShardBytes:
    """What one stage sharded ``shards`` ways holds on its largest rank, in bytes.

    Attributes:
        shards: the replicas the stage is sharded over (D).
        parameters: this rank's shards of the stage's parameters, padded as FSDP2 pads them.
        trainable: its shards of the parameters that get gradients (the reduce-scatter's output).
        scatter_copies: full-size copies of the gradients the reduce-scatter holds until it
            completes: its input (1), and on gloo the copy the collective makes of it (2).
        scatter_padding: the most bytes launching the reduce-scatters holds above their
            buffers: a unit's gradients of uneven rows, copied into padded ones to be flattened.
    """

    shards: int
    parameters: int
    trainable: int
    scatter_copies: int = 1
    scatter_padding: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or value < (1 if f.name in ("shards", "scatter_copies") else 0)
            ):
                raise ValueError(
                    f"fastpipe: ShardBytes.{f.name} must be a whole number (bytes >= 0, counts >= 1), got {value!r}"
                )

    @property
    def gathered(self) -> int:
        """Every unit's parameters all-gathered: each padded shard, ``shards`` times."""
        return self.parameters * self.shards

    def stepped(self, trainable: int, stepped: int) -> int:
        """This rank's shard of what the optimizer steps, given the whole stage's ``trainable`` and
        ``stepped`` bytes (a tied copy is trainable, not stepped)."""
        return self.trainable if trainable == 0 else round(self.trainable * stepped / trainable)

    @property
    def scattered(self) -> int:
        """What the reduce-scatter holds: its input (the trainable parameters' padded full-size
        gradient sums, ``scatter_copies`` times) and its output, this rank's gradient shard."""
        return self.trainable * (self.shards * self.scatter_copies + 1)


def shard_bytes(stage: nn.Module, shards: int, *, scatter_copies: int = 1) -> ShardBytes:
    """The :class:`ShardBytes` of ``stage`` sharded ``shards`` ways, from its parameters' global shapes.

    A stage sharded already (``fully_shard`` units inside) is measured by its units; a plain
    one by the units ``dp_shard="fsdp"`` would make: each child whose parameters no other child
    shares, then the stage itself for the rest.

    Args:
        stage: the stage's module.
        shards: the replicas it is sharded over.
        scatter_copies: see :class:`ShardBytes` (2 on gloo).

    Raises:
        ValueError: ``shards`` < 1.
    """
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise ValueError(f"fastpipe: a stage is sharded over 1 or more replicas, got shards={shards!r}")
    units = _units(stage)
    parameters = trainable = 0
    launched: list[tuple[int, int]] = []  # per unit, in launch order: its buffers, its padded copies
    for unit in units:
        buffers = padding = 0
        for p in unit:
            piece = _padded_shard(p, shards)
            parameters += piece
            if p.requires_grad:
                trainable += piece
                buffers += piece * (shards * scatter_copies + 1)
                padding += piece * shards if (p.shape[0] if p.dim() else 1) % shards else 0
        launched.append((buffers, padding))
    # A unit's padded copies live while its own buffers are made, after those of the units before it.
    total, made, above = sum(b for b, _ in launched), 0, 0
    for buffers, padding in launched:
        made += buffers
        above = max(above, made + padding - total)
    return ShardBytes(shards, parameters, trainable, scatter_copies, above)


def _units(stage: nn.Module) -> list[list[nn.Parameter]]:
    """The stage's parameters by unit, each once, the stage's own unit last."""
    heads: list[nn.Module] = [m for m in stage.modules() if isinstance(m, FSDPModule) and m is not stage]
    if not any(isinstance(m, FSDPModule) for m in stage.modules()):
        children = list(stage.children())
        owners: dict[int, int] = {}
        for child in children:
            for p in child.parameters():
                owners[id(p)] = owners.get(id(p), 0) + 1
        heads = [
            c for c in children if any(True for _ in c.parameters()) and all(owners[id(p)] == 1 for p in c.parameters())
        ]
    seen: set[int] = set()
    units = []
    for head in [*heads, stage]:
        own = [p for p in head.parameters() if id(p) not in seen]
        seen.update(id(p) for p in own)
        units.append(own)
    return units


def _padded_shard(p: torch.Tensor, shards: int) -> int:
    """Bytes of one rank's padded shard of ``p`` (rows cut as ``torch.chunk`` cuts them)."""
    rows = -(-(p.shape[0] if p.dim() else 1) // shards)
    return rows * p.shape[1:].numel() * p.element_size()


def shard_points(
    schedule: Schedule, times: Mapping[Action, tuple[int, float, float]], sharded: Sequence[ShardBytes]
) -> list[list[Point]]:
    """Per worker, the byte events of its sharded stages' gathers and reduce-scatters.

    Args:
        schedule: the step's schedule.
        times: its timing, ``action -> (worker, start, end)``.
        sharded: per stage, its :class:`ShardBytes`.

    Raises:
        ValueError: not one :class:`ShardBytes` per stage.

    Returns:
        Per worker, ``(time, delta, part)`` events in parts ``"gathered"`` and ``"reduce_scatter"``:
        the gathers just before the worker's first action, each stage's reduce-scatter and reshard
        just after the end of its last ``BW`` or ``W`` (a stage without one reshards at the step's end).
    """
    if len(sharded) != schedule.num_stages:
        raise ValueError(
            f"fastpipe: {len(sharded)} ShardBytes for a schedule of {schedule.num_stages} stages; give one per stage"
        )
    first: dict[int, float] = {}
    done: dict[int, float] = {}
    for action, (w, start, end) in times.items():
        first[w] = min(first.get(w, start), start)
        if action.kind in ("BW", "W"):
            done[action.stage] = max(done.get(action.stage, end), end)
    out = []
    for w in range(schedule.num_workers):
        stages = schedule.stages_of(w)
        start = first.get(w, 0.0)
        gathered = float(sum(sharded[s].gathered for s in stages))
        # The all-gather buffers live until every unit has copied its parameters out.
        points: list[Point] = [
            (start - 2 * _tick(start), 2 * gathered, "gathered"),
            (start - _tick(start), -gathered, "gathered"),
        ]
        for s in stages:
            if s not in done:
                continue
            end = done[s]
            # The reduce-scatter's buffers exist before the reshard frees the gathered parameters.
            padding = float(sharded[s].scatter_padding)
            points.append((end + _tick(end), sharded[s].scattered + padding, "reduce_scatter"))
            points.append((end + 2 * _tick(end), -padding, "reduce_scatter"))
            points.append((end + 3 * _tick(end), -float(sharded[s].gathered), "gathered"))
        out.append(points)
    return out


def kept_bytes(stages: Sequence[Whole], sharded: Sequence[ShardBytes] | None) -> tuple[list[int], list[int]]:
    """Per stage, the parameter bytes a device keeps and those its optimizer steps: the whole
    stage's, or with ``sharded`` this rank's shards of them."""
    if sharded is None:
        return [st.parameters for st in stages], [st.stepped for st in stages]
    return [sh.parameters for sh in sharded], [sh.stepped(st.trainable, st.stepped) for st, sh in zip(stages, sharded)]


def _tick(at: float) -> float:
    """A step of time too small to reorder two actions: events within one moment keep their order."""
    return 1e-9 * max(1.0, abs(at))
