"""Tied weights across ranks: one process group per set of ranks that use a tensor, as Megatron's embedding group.

Every rank that uses a tied tensor holds a primary of its own (see
:mod:`fastpipe.distributed.rank_stages`), and each rank's optimizer steps its own. The primaries
stay bitwise equal because every rank applies the same update to the same value:

* at set-up, the owner's value (the first stage that uses the tensor) is broadcast to the
  other ranks of the group;
* after every backward (after the data-parallel average), the primaries' gradients are
  all-reduced (summed) over the group: each rank then holds the gradient of all the uses,
  as the plain model's parameter would. All-reduce hands every rank the same bits (its ring
  and tree algorithms reduce each element once, then pass the result on; the tests check it
  on gloo over 2 and 3 ranks), so the updates match bit for bit.

Only the ranks that own a use take part; with data parallelism each replica has its own
groups (they are made from the replica's pipeline ranks). A tie over all the pipeline's
ranks (any tie of a 2-rank pipeline) runs on the pipeline group; a tie over some of them
needs a new group, which every rank of the default group makes, so then every rank builds
its DistributedPipe (all replicas at once). A step that is skipped (``on_nan="skip"``) is
skipped by every rank of the pipeline, and a GradScaler's step still reduces, so the
groups stay in step.

A buffer used across ranks (a rotary table) is broadcast once and must stay constant: a step
that writes into it raises, as a write into a copied buffer does in :class:`fastpipe.Pipe`.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fastpipe.distributed.backend import backend_for
from fastpipe.distributed.dp_reduce import finish_reduce, local_part, start_reduce
from fastpipe.distributed.rank_stages import RankStages, Use, tensor_at
from fastpipe.distributed.ranks import gather_objects
from fastpipe.distributed.runtime import DistributedRuntime
from fastpipe.errors import PipelineError
from fastpipe.model.ties import Location, TiedWeights
from fastpipe.runtime.step import Stage

__all__ = ["TieInfo", "RankTies"]

Report = Sequence[Sequence[tuple[int, str, tuple[int, ...], str, bool, bool]]]


@dataclass(frozen=True)
class TieInfo:
    """A tensor that a later stage of the pipeline uses too.

    Attributes:
        name: its name on the owner's stage (the first that uses it): ``"0.wte.weight"``.
        reader_name: its name on the later stage: ``"9.weight"``.
        owner_stage: the first stage that uses it.
        reader_stage: the later stage.
        ranks: the global ranks that hold a use of it (a single rank for a tie within one).
        is_parameter: a parameter (its gradient is summed over the uses); else a constant buffer.
    """

    name: str
    reader_name: str
    owner_stage: int
    reader_stage: int
    ranks: tuple[int, ...]
    is_parameter: bool = True


@dataclass
class _Group:
    """The ranks that share some tied tensors, and this rank's gradient slots of them."""

    ranks: tuple[int, ...]
    process_group: Any
    names: list[str] = field(default_factory=list)
    slots: list[tuple[int, int]] = field(default_factory=list)  # (stage, index in its params)


@dataclass
class _Shared:
    """One tensor tied across ranks, as this rank holds it."""

    name: str  # this rank's name for it
    location: Location
    owner: int  # the global rank of the stage that owns it
    group: _Group
    seen: tuple[int, int] | None = None  # a buffer's (data_ptr, version) after the last check


class RankTies:
    """The tied tensors of a DistributedPipe as this rank sees them.

    Attributes:
        ties: every tie of the pipeline (all ranks'), one per tensor and later stage.
        local: the ties between this rank's stages (copies refreshed and folded as in ``Pipe``).
    """

    def __init__(
        self,
        built: RankStages,
        reports: Sequence[Report],
        stages: Mapping[int, Stage],
        runtime: DistributedRuntime,
        bucket_bytes: int,
    ) -> None:
        self._runtime = runtime
        self._bucket_bytes = bucket_bytes
        num_stages = runtime.num_stages
        self._params = [stages[s].params if s in stages else [] for s in range(num_stages)]
        self.local = TiedWeights(built.local_ties, self._params)
        self.ties: list[TieInfo] = []
        self._shared: list[_Shared] = []
        self.groups: list[_Group] = []
        device = next(iter(stages.values())).device if stages else torch.device("cpu")
        backend = backend_for(runtime.group, device)
        tied: list[tuple[tuple[int, ...], int, list[Use]]] = []  # (ranks, owner's global rank, this rank's uses)
        for k, expected in enumerate(built.expected):
            rows = sorted(
                ((r, *row) for r, report in enumerate(reports) for row in report[k]), key=lambda row: (row[1], row[0])
            )
            _check_uses(expected, rows, runtime)
            ranks = tuple(sorted({runtime.global_rank_of(row[0]) for row in rows}))
            owner = rows[0]
            seen_stages = {owner[1]}
            for row in rows[1:]:
                if row[1] not in seen_stages:
                    seen_stages.add(row[1])
                    self.ties.append(TieInfo(owner[2], row[2], owner[1], row[1], ranks, bool(owner[5])))
            if len(ranks) > 1:
                tied.append((ranks, runtime.global_rank_of(owner[0]), built.uses[k]))
        made = _groups(sorted({ranks for ranks, _, _ in tied}), runtime, backend)
        for ranks, owner_rank, uses in tied:
            if not uses:
                continue
            group = next((g for g in self.groups if g.ranks == ranks), None)
            if group is None:
                group = _Group(ranks, made[ranks])
                self.groups.append(group)
            loc = uses[0].locations[0]
            group.names.append(uses[0].name)
            self._shared.append(_Shared(uses[0].name, loc, owner_rank, group))
            tensor = tensor_at(loc)
            if loc[2] and tensor.requires_grad:
                index = next(i for i, p in enumerate(self._params[uses[0].stage]) if p is tensor)
                group.slots.append((uses[0].stage, index))
        self.sync()

    def __bool__(self) -> bool:
        return bool(self.ties)

    def __iter__(self) -> Iterator[TieInfo]:
        return iter(self.ties)

    def __repr__(self) -> str:
        if not self.ties:
            return "RankTies(no tensor is shared across stages)"
        return "RankTies(" + ", ".join(repr(t) for t in self.ties) + ")"

    def sync(self) -> None:
        """Give every rank's primary the owner's value (at set-up; call it on every rank after
        changing a tied tensor outside the optimizer on one rank only)."""
        works = []
        for shared in self._shared:
            # A view of the tensor (of its shard, under dp_shard="fsdp") unless it was strided.
            buf = local_part(tensor_at(shared.location)).detach().contiguous()
            works.append((dist.broadcast(buf, src=shared.owner, group=shared.group.process_group, async_op=True), buf))
        for (work, buf), shared in zip(works, self._shared):
            self._runtime.wait_collective(work, f"the value of tied '{shared.name}' from rank {shared.owner}")
            tensor = local_part(tensor_at(shared.location))
            if buf.data_ptr() != tensor.data_ptr():
                with torch.no_grad():
                    tensor.copy_(buf)
            _mark(shared)

    def refresh(self) -> None:
        """Bring the copies of this rank's later stages up to their primaries (before a step)."""
        self.local.refresh()

    def check_constant(self) -> None:
        """Raise if the step wrote into a buffer shared with another stage (the other ranks raise
        PipelineError at their next wait)."""
        try:
            self.local.check_constant()
            for shared in self._shared:
                if not shared.location[2] and shared.seen is not None:
                    t = tensor_at(shared.location)
                    if shared.seen[0] == t.data_ptr() and shared.seen[1] != t._version:
                        raise RuntimeError(
                            f"fastpipe: rank {self._runtime.global_rank} wrote into buffer '{shared.name}', which it "
                            f"shares with ranks {list(shared.group.ranks)}; a buffer shared across ranks is copied to "
                            "each and must stay constant (e.g. rotary tables, not BatchNorm statistics). Put its uses "
                            "in one stage through balance, or give each use its own module"
                        )
                    _mark(shared)
        except RuntimeError as exc:
            self._runtime.watchdog.fail(f"rank {self._runtime.global_rank} raised RuntimeError: {exc}")
            raise

    def reduce(self, grads: Mapping[int, list[Tensor | None]]) -> None:
        """Sum the gradients of every tied tensor, in place: the copies' into their rank's primary,
        then the primaries' over the ranks of each group (on every rank of it, every step)."""
        self.local.fold([grads.get(s, []) for s in range(len(self._params))])
        pending = []
        for group in self.groups:
            if not group.slots:
                continue
            mine = [grads[s][i] for s, i in group.slots]
            params = [self._params[s][i] for s, i in group.slots]
            buckets = start_reduce(group.slots[0][0], params, mine, group.process_group, self._bucket_bytes)
            pending.append((group, mine, buckets))
        for group, mine, buckets in pending:
            for bucket in buckets:
                what = f"the gradient all-reduce of tied {group.names} over ranks {list(group.ranks)}"
                self._runtime.wait_collective(bucket.work, what)
                finish_reduce(mine, bucket, group.process_group, average=False)
            for (s, i), g in zip(group.slots, mine):
                grads[s][i] = g


def _mark(shared: _Shared) -> None:
    t = tensor_at(shared.location)
    shared.seen = (t.data_ptr(), t._version)


def _groups(wanted: Sequence[tuple[int, ...]], runtime: DistributedRuntime, backend: str) -> dict[tuple[int, ...], Any]:
    """A process group for each set of ranks in ``wanted`` (the same list on every rank of the pipeline).

    A tie over all the pipeline's ranks uses the pipeline group, which the step already runs
    collectives on. Any other set is a new group, and ``dist.new_group`` must then be called
    by every rank of the default group, for every group, in one order (a group made by its
    members alone is named from a count that differs between ranks): the ranks pool the
    sets their pipelines need (all data-parallel replicas') and each makes all of them.
    """
    whole = tuple(sorted(runtime.global_rank_of(r) for r in range(runtime.size)))
    out: dict[tuple[int, ...], Any] = {ranks: runtime.group for ranks in wanted if ranks == whole}
    subsets = [ranks for ranks in wanted if ranks != whole]
    if not subsets:
        return out
    world = dist.group.WORLD
    what = f"creating the tied weights' groups {[list(r) for r in subsets]} (every rank builds its DistributedPipe)"
    everyone = gather_objects([(ranks, backend) for ranks in subsets], world, what, runtime.timeout)
    for ranks, kind in sorted({(tuple(r), b) for pooled in everyone for r, b in pooled}):
        try:
            group = dist.new_group(list(ranks), backend=kind, timeout=datetime.timedelta(seconds=runtime.timeout))
        except Exception as exc:  # noqa: BLE001 - gloo's connect timed out: a member is missing
            raise PipelineError(
                f"fastpipe: setting up the tied weights' group of ranks {list(ranks)}: not every rank arrived "
                f"within {runtime.timeout:g} s (a rank died, hangs, or was built with other ties): {exc}"
            ) from exc
        if ranks in subsets:
            out[ranks] = group
    return out


def _check_uses(expected: Sequence[str], rows: Sequence[tuple[Any, ...]], runtime: DistributedRuntime) -> None:
    """Every name of a tie is held by one rank, and all are one kind, shape and dtype."""
    where: dict[str, list[int]] = {}
    for row in rows:
        where.setdefault(row[2], []).append(runtime.global_rank_of(row[0]))
    missing = [n for n in expected if n not in where]
    twice = {n: r for n, r in where.items() if len(r) > 1}
    if missing or twice:
        problem = f"no rank's stages hold {missing}" if missing else f"several ranks hold {twice}"
        raise ValueError(
            f"fastpipe: the tie {tuple(expected)}: {problem}; name each use as in the Sequential's state_dict "
            "(the layer's index, then the path: '0.wte.weight')"
        )
    kinds = {row[3:] for row in rows}
    if len(kinds) > 1:
        each = ", ".join(
            f"'{row[2]}' on rank {runtime.global_rank_of(row[0])}: {'parameter' if row[5] else 'buffer'} "
            f"{row[4].removeprefix('torch.')} {row[3]}{'' if row[6] else ' (requires_grad=False)'}"
            for row in rows
        )
        raise ValueError(
            f"fastpipe: the uses of a tied tensor disagree ({each}); tied uses must be one kind, shape and dtype"
        )
