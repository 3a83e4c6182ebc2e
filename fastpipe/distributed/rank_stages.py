"""This rank's stages of a :class:`~fastpipe.DistributedPipe`, tied weights included.

A rank holds stages ``r, r+K, …`` of the Sequential. A tensor that layers on several stages
use (a tied embedding, a reused block) is kept at two levels:

* **across ranks**, every rank that uses it holds one tensor of its own, its *primary*: the
  model's tensor on the rank of the first stage that uses it (the owner), a copy elsewhere.
  It is registered under the Sequential's name of the rank's first use, so ``parameters()``
  and ``state_dict()`` hold it once; :mod:`fastpipe.distributed.tie_group` keeps the primaries
  equal (one value at set-up, the summed gradient after every step);
* **within a rank**, its later stages read copies of the primary, as in :class:`fastpipe.Pipe`
  (:mod:`fastpipe.model.ties`: refreshed before each step, their gradients folded into the
  primary's)::

    rank 0:  stage 0 [wte: T]          stage 2 [block: T' = copy of T, local]
    rank 1:  stage 1 [...]             stage 3 [head: T1, rank 1's primary]
                 T.grad ◀── all-reduce (sum) over ranks {0, 1} ──▶ T1.grad

A whole model is cut by :func:`fastpipe.model.ties.split_tied`, which finds the ties itself. A
rank that builds only its stages (:meth:`~fastpipe.DistributedPipe.from_stage_builder`)
cannot see the other ranks' layers, so its ties are declared by name.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from fastpipe.model.partition import check_materialised, layers_of
from fastpipe.model.ties import Location, Tie, split_tied

__all__ = ["Use", "RankStages", "build_stages", "split_module", "declared_stages"]

StageBuilder = Callable[[int], nn.Module]


@dataclass
class Use:
    """One stage's use of a tied tensor.

    Attributes:
        stage: the stage.
        name: the Sequential's name of the tensor's first use on that stage (``"6.weight"``).
        locations: where this rank's stage holds it (module, key, is_parameter); empty for
            another rank's stage.
    """

    stage: int
    name: str
    locations: list[Location]


@dataclass
class RankStages:
    """What a rank runs and registers.

    Attributes:
        layers: the layers to register, by their names in the Sequential; each tied tensor
            appears as this rank's primary only.
        stages: what runs, by stage index; a later stage of a tie within the rank reads a copy.
        local_ties: the ties between this rank's stages (global stage indices).
        uses: per tied tensor of the whole model, in an order every rank shares: this rank's uses.
        expected: per tied tensor, the names of all its uses (what the ranks must report together).
    """

    layers: list[tuple[str, nn.Module]]
    stages: dict[int, nn.Sequential]
    local_ties: list[Tie]
    uses: list[list[Use]]
    expected: list[list[str]]

    def report(self) -> list[list[tuple[int, str, tuple[int, ...], str, bool, bool]]]:
        """Per tied tensor, this rank's uses as ``(stage, name, shape, dtype, is_parameter, requires_grad)``."""
        out = []
        for uses in self.uses:
            rows = []
            for use in uses:
                t = tensor_at(use.locations[0])
                rows.append((use.stage, use.name, tuple(t.shape), str(t.dtype), use.locations[0][2], t.requires_grad))
            out.append(rows)
        return out


def tensor_at(loc: Location) -> Tensor:
    """The tensor at a location."""
    module, key, is_param = loc
    tensor = (module._parameters if is_param else module._buffers)[key]
    assert tensor is not None
    return tensor


def split_module(
    module: nn.Sequential, balance: Sequence[int], mine: Sequence[int], device: torch.device, *, free_others: bool
) -> RankStages:
    """Cut the whole model; the stages of other ranks are released to meta with ``free_others``."""
    parts, ties = split_tied(module, balance)
    for s in mine:  # other ranks' layers may already be released to meta
        check_materialised(parts[s])
    if free_others:
        for s, part in enumerate(parts):
            if s not in mine:
                part.to("meta")  # the reader stages' clones hold copies: the owner's tensor is not touched
    grouped: dict[str, list[Use]] = {}
    for tie in ties:
        uses = grouped.setdefault(tie.name, [Use(tie.owner_stage, tie.name, [tie.owner])])
        uses.append(Use(tie.reader_stage, tie.reader_name, tie.readers))
    expected = [[u.name for u in uses] for uses in grouped.values()]
    local = [[u for u in uses if u.stage in mine] for uses in grouped.values()]
    return _assemble({s: parts[s] for s in mine}, local, expected, device)


def declared_stages(parts: dict[int, nn.Sequential], ties: Sequence[Sequence[str]], device: torch.device) -> RankStages:
    """This rank's ``parts`` with the ``ties`` declared by name (each a sequence of the Sequential's names).

    A name this rank does not hold is left out here: every rank learns from the others which
    ones hold each name (:class:`~fastpipe.distributed.tie_group.RankTies`), and raises there at
    once, together, for a name that no rank holds.
    """
    where = {name: s for s, part in parts.items() for name, _ in layers_of(part)}
    local: list[list[Use]] = []
    for names in ties:
        uses = []
        for name in names:
            layer, _, path = name.partition(".")
            owner_path, _, key = path.rpartition(".")
            if layer not in where or not key:
                continue
            sub = parts[where[layer]].get_submodule(f"{layer}.{owner_path}" if owner_path else layer)
            if key in sub._parameters or key in sub._buffers:
                uses.append(Use(where[layer], name, [(sub, key, key in sub._parameters)]))
        local.append(uses)
    return _assemble(parts, local, [list(n) for n in ties], device)


def _assemble(
    parts: dict[int, nn.Sequential], uses: list[list[Use]], expected: list[list[str]], device: torch.device
) -> RankStages:
    """Point every use of a tied tensor on this rank at its primary, then cut the rank's stages again."""
    mine = sorted(parts)
    for local in uses:
        local.sort(key=lambda u: u.stage)
        if not local:
            continue
        primary = tensor_at(local[0].locations[0])
        for use in local:
            for loc in use.locations:
                _point(loc, primary)
    layers = [(n, layer) for s in mine for n, layer in layers_of(parts[s])]
    rank_model = nn.Sequential(OrderedDict(layers)).to(device)
    # The uses on several of this rank's stages now share the primary: split_tied gives the
    # later stages copies, and the ties between them (its stage numbers count this rank's stages).
    cut, ties = split_tied(rank_model, [len(parts[s]) for s in mine])
    local_ties = [replace(t, owner_stage=mine[t.owner_stage], reader_stage=mine[t.reader_stage]) for t in ties]
    return RankStages(layers, dict(zip(mine, cut)), local_ties, uses, expected)


def _point(loc: Location, primary: Tensor) -> None:
    """Make ``loc`` hold ``primary`` (in a clone of fastpipe's, or in a declared use of the caller's layers).

    A use of another kind, shape or dtype is left alone: the ranks' check of all the uses
    together names it, on every rank.
    """
    current = tensor_at(loc)
    module, key, is_param = loc
    alike = (current.shape, current.dtype, is_param) == (
        primary.shape,
        primary.dtype,
        isinstance(primary, nn.Parameter),
    )
    if current is primary or not alike:
        return
    if is_param:
        module._parameters[key] = primary  # type: ignore[assignment]  # a Parameter: checked above
    else:
        module._buffers[key] = primary


def build_stages(
    builder: StageBuilder, balance: Sequence[int], mine: Sequence[int], device: torch.device
) -> dict[int, nn.Sequential]:
    """``builder(s)`` for this rank's stages, named and materialised as ``from_stage_builder`` documents."""
    modules: dict[int, nn.Sequential] = {}
    for s in mine:
        part = builder(s)
        if not isinstance(part, nn.Sequential):
            part = nn.Sequential(part)
        if len(part) != balance[s]:
            raise ValueError(f"fastpipe: builder({s}) made {len(part)} layers, balance says {balance[s]}")
        offset = sum(balance[:s])
        names = [n for n, _ in layers_of(part)]
        if names == [str(i) for i in range(len(names))]:
            part = nn.Sequential(OrderedDict((str(offset + i), m) for i, m in enumerate(part)))
        if any(t.is_meta for t in [*part.parameters(), *part.buffers()]):
            part = part.to_empty(device=device)
            for sub in part.modules():
                reset = getattr(sub, "reset_parameters", None)
                if callable(reset):
                    reset()
        modules[s] = part
    return modules
