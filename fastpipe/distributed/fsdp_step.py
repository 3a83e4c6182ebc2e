"""One step of stages sharded with FSDP2: each unit gathered once, its gradients reduce-scattered once.

FSDP2's hooks expect one ``loss.backward()`` per iteration; fastpipe runs one explicit backward
per micro-batch, split in two (B, then W with deferred Linear GEMMs) under the zero-bubble
schedules. So for the step FSDP2's forward hooks are set aside, and the step runs on the
gathered parameters as an unsharded pipe would::

    step begins         every unit all-gathered once (FSDP2's unshard); stage.params -> gathered
    F / BW / B / W      as without sharding: full-size gradients in the runtime's running sums
    stage's last BW/W   its sums reduce-scattered, one collective per unit and dtype (averaged
                        over D); its units resharded (the gathered parameters freed)
    step ends           the gradients are DTensor shards, laid out as the parameters

``fit`` updates each stage at its own ``U`` inside a window instead: it sets the hooks aside the
same way (:meth:`StageShards.begin_fit`) and moves a whole stage at once, one collective per
dtype: :meth:`StageShards.gather` (weights or a prediction of them, from the shards) and
:meth:`StageShards.reduce_scatter` (a mini-batch's gradient, into the shards); see
:mod:`fastpipe.asynchronous.sharded`.

Every collective is waited on through the runtime's watchdog, so a dead replica raises
:class:`~fastpipe.PipelineError` within the pipe's ``timeout`` instead of hanging.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from fastpipe.distributed.dp_reduce import ReplicaSync
from fastpipe.runtime.stage import Stage

__all__ = ["StageShards", "Unit", "Wait"]

Wait = Callable[[Any, str], None]


class _TrackedAllGather:
    """FSDP2's all-gather (given to ``set_custom_all_gather``), keeping each asynchronous one's work.

    The step waits on that work through the watchdog before FSDP2 copies the result out: FSDP2's own
    wait would block without limit on a dead replica.
    """

    def __init__(self) -> None:
        self.works: list[Any] = []

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group: Any, async_op: bool = False) -> Any:
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        work = gather(output_tensor, input_tensor, group=group, async_op=async_op)
        if async_op:
            self.works.append(work)
        return work


class _WaitedAside:
    """A collective's work that a helper thread waits on, so that the step can poll it.

    gloo's reduce-scatter progresses and reports completion only inside ``wait()``, which would
    block without limit on a dead replica; the watchdog polls :meth:`is_completed` instead.
    """

    def __init__(self, work: Any) -> None:
        self._work = work
        self._done = threading.Event()
        self._error: BaseException | None = None
        threading.Thread(target=self._run, name="fastpipe-reduce-scatter", daemon=True).start()

    def _run(self) -> None:
        try:
            self._work.wait()
        except BaseException as exc:  # noqa: BLE001 - re-raised by wait() on the step's thread
            self._error = exc
        finally:
            self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise self._error


@dataclass
class Unit:
    """One ``fully_shard`` unit of a stage, and where its trained parameters sit in ``stage.params``."""

    module: nn.Module
    index: list[int]


@dataclass
class _Scatter:
    """One in-flight reduce-scatter: a unit's gradients of one dtype, this rank's rows landing in ``out``."""

    stage: int
    work: Any
    flat: Tensor  # the input, kept alive until the collective completed
    out: Tensor
    index: list[int]
    rows: list[int]  # per gradient, the rows of one rank's chunk (padding included)


class StageShards(ReplicaSync):
    """This rank's stages sharded over their replicas: FSDP2 units gathered and reduced once per step.

    Args:
        stages: this rank's stages, wrapped by :func:`~fastpipe.distributed.fsdp.shard_stages`.
        units: per stage, its units (each layer with parameters of its own, then the stage).
        mesh: the ``"dp"`` sub-mesh.
        wait: waits for a collective within the pipe's timeout (the runtime's ``wait_collective``).

    Attributes:
        collectives: the all-gathers and reduce-scatters the last step launched, by kind.
    """

    def __init__(
        self, stages: Mapping[int, Stage], units: Mapping[int, list[Unit]], mesh: DeviceMesh, wait: Wait
    ) -> None:
        self.stages = dict(stages)
        self.units = dict(units)
        self.group = mesh.get_group()
        self.size = mesh.size()
        self.wait = wait
        self.collectives = {"all_gather": 0, "reduce_scatter": 0}
        self._sharded = {s: list(st.params) for s, st in self.stages.items()}
        self._gloo = dist.get_backend(self.group) == "gloo"
        self._gather = _TrackedAllGather()
        for unit in self._all_units():
            cast(FSDPModule, unit.module).set_custom_all_gather(cast(Any, self._gather))
        self._hooks: list[tuple[dict[int, Any], dict[int, Any]]] = []
        self._pending: list[_Scatter] = []

    def _all_units(self) -> list[Unit]:
        return [u for units in self.units.values() for u in units]

    def begin_fit(self) -> None:
        """Before a window of ``fit``: FSDP2's hooks set aside (until :meth:`end`); ``fit`` gathers and
        reduces through :meth:`gather` and :meth:`reduce_scatter`, at its own updates."""
        self.collectives = {"all_gather": 0, "reduce_scatter": 0}
        self._set_hooks_aside()

    @torch.no_grad()
    def gather(self, stage: int, shards: list[Tensor], out: list[Tensor] | None = None) -> list[Tensor]:
        """The whole tensors of ``shards`` (this rank's rows of ``stage``'s parameters, or of a prediction
        of them), one all-gather per dtype for the whole stage; written into ``out`` when given."""
        params = cast(list[DTensor], self._sharded[stage])
        full = list(out) if out is not None else [torch.empty(p.shape, dtype=p.dtype, device=p.device) for p in params]
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(shards):
            by_dtype.setdefault(t.dtype, []).append(i)
        for index in by_dtype.values():
            rows = [-(-params[i].shape[0] // self.size) for i in index]
            pieces = []
            for i, r in zip(index, rows):
                local = shards[i]
                if local.shape[0] != r:  # the last ranks' chunks are short (or empty): pad to the chunk
                    local = torch.cat([local, local.new_zeros((r - local.shape[0], *local.shape[1:]))])
                pieces.append(local.reshape(-1))
            flat = torch.cat(pieces)
            gathered = flat.new_empty(flat.numel() * self.size)
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            work = gather(gathered, flat, group=self.group, async_op=True)
            self.collectives["all_gather"] += 1
            self.wait(_WaitedAside(work) if self._gloo else work, f"the FSDP all-gather of stage {stage}'s weights")
            by_rank = gathered.view(self.size, -1)
            offset = 0
            for i, r in zip(index, rows):
                shape = params[i].shape
                width = r * shape[1:].numel()
                whole = by_rank[:, offset : offset + width].reshape(self.size * r, *shape[1:])
                full[i].copy_(whole[: shape[0]])
                offset += width
        return full

    def reduce_scatter(self, stage: int, grads: list[Tensor | None]) -> list[Tensor | None]:
        """``stage``'s whole gradients averaged over the replicas, each reduced to this rank's shard (a
        DTensor laid out as the parameter): one reduce-scatter per dtype for the whole stage."""
        params = self._sharded[stage]
        grads = [
            torch.zeros(p.shape, dtype=p.dtype, device=p.device) if g is None else g for p, g in zip(params, grads)
        ]
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, g in enumerate(grads):
            by_dtype.setdefault(cast(Tensor, g).dtype, []).append(i)
        self._pending = [self._launch(stage, [cast(Tensor, grads[i]) for i in ix], ix) for ix in by_dtype.values()]
        self.finish({stage: grads})
        return grads

    def begin(self) -> None:
        """All-gather every unit (FSDP2's unshard); the stages then train on the gathered parameters."""
        self._pending = []
        self.collectives = {"all_gather": 0, "reduce_scatter": 0}
        self._set_hooks_aside()
        handles = [cast(FSDPModule, unit.module).unshard(async_op=True) for unit in self._all_units()]
        works, self._gather.works = self._gather.works, []
        self.collectives["all_gather"] = len(works)
        for work in works:
            self.wait(work, "the FSDP all-gather of this rank's stages' parameters")
        for handle in handles:
            if handle is not None:
                handle.wait()
        for st in self.stages.values():
            st.params[:] = [p for p in st.module.parameters() if p.requires_grad]

    def stage_done(self, stage: int, grads: list[Tensor | None]) -> None:
        """Launch the reduce-scatters of ``stage``'s summed gradients, one per unit (and dtype); reshard it."""
        params = self.stages[stage].params
        for unit in self.units[stage]:
            by_dtype: dict[torch.dtype, list[int]] = {}
            for i in unit.index:
                if grads[i] is None:  # the replicas must agree on the layout: an unused parameter adds zeros
                    grads[i] = torch.zeros_like(params[i])
                by_dtype.setdefault(cast(Tensor, grads[i]).dtype, []).append(i)
            for index in by_dtype.values():
                self._pending.append(self._launch(stage, [cast(Tensor, grads[i]) for i in index], index))
        self._reshard(stage)

    def _launch(self, stage: int, grads: list[Tensor], index: list[int]) -> _Scatter:
        rows = [-(-g.shape[0] // self.size) for g in grads]  # torch.chunk's: the shards' layout
        pieces = []
        for g, r in zip(grads, rows):
            if g.shape[0] != r * self.size:
                padded = g.new_zeros((r * self.size, *g.shape[1:]))
                padded[: g.shape[0]] = g
                g = padded
            pieces.append(g.reshape(self.size, -1))
        flat = torch.cat(pieces, dim=1).reshape(-1)  # rank-major: rank k's chunks of every gradient, in a row
        out = flat.new_empty(flat.numel() // self.size)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        work = scatter(out, flat, group=self.group, async_op=True)
        if self._gloo:
            work = _WaitedAside(work)
        self.collectives["reduce_scatter"] += 1
        return _Scatter(stage, work, flat, out, index, rows)

    def finish(self, grads: Mapping[int, list[Tensor | None]]) -> None:
        """Wait for the reduce-scatters; each gradient becomes this rank's shard (a DTensor), averaged."""
        for pending in self._pending:
            self.wait(pending.work, f"the FSDP gradient reduce-scatter of stage {pending.stage}")
            pending.out.div_(self.size)
            sharded = self._sharded[pending.stage]
            offset = 0
            for i, rows in zip(pending.index, pending.rows):
                p = cast(DTensor, sharded[i])
                width = rows * p.shape[1:].numel()
                local = pending.out[offset : offset + width].view(rows, *p.shape[1:])[: p.to_local().shape[0]]
                grads[pending.stage][i] = DTensor.from_local(
                    local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                )
                offset += width
        self._pending = []

    def end(self) -> None:
        """Reshard whatever is still gathered and put FSDP2's hooks back (also after a failed step)."""
        self._pending = []
        for stage in self.stages:
            self._reshard(stage)
        for table, saved in self._hooks:
            table.clear()
            table.update(saved)
        self._hooks = []

    def _reshard(self, stage: int) -> None:
        for unit in self.units[stage]:
            cast(FSDPModule, unit.module).reshard()
        self.stages[stage].params[:] = self._sharded[stage]

    def _set_hooks_aside(self) -> None:
        """Take FSDP2's forward hooks off the units until :meth:`end` (see the module doc)."""
        for unit in self._all_units():
            state = fully_shard.state(unit.module)  # type: ignore[attr-defined]
            module = unit.module
            for table in (module._forward_pre_hooks, module._forward_hooks):
                saved = dict(table)
                self._hooks.append((table, saved))
                for key, hook in saved.items():
                    if getattr(hook, "__self__", None) is state:
                        del table[key]
