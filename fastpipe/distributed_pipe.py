"""``DistributedPipe``: one pipeline stage (or several, interleaved) per process.

Launch one process per pipeline rank (``torchrun``), build the model (or only this rank's
part of it) and call :meth:`DistributedPipe.train_step` on every rank::

    dist.init_process_group()                       # gloo on CPU, nccl on GPUs
    pipe = DistributedPipe(model, balance=[2, 2, 2, 2], chunks=8, schedule="1f1b",
                           process_group=dist.group.WORLD)
    loss = pipe.train_step(x, y, loss_fn)           # x read on stage 0's rank, y on the last
    opt.step()                                      # opt holds pipe.parameters(): this rank's stage

Rank ``r`` holds the stages the schedule places there: stage ``r``; ``r, r+K, …`` for ``"interleaved"``
(``len(balance) = K * v``); ``r`` and ``2K-1-r`` in the V of ``"zb-v"`` and ``"dualpipev"`` (2K stages).
With a 2-D :class:`~torch.distributed.device_mesh.DeviceMesh` (dims ``"pp"`` and
``"dp"``), every stage's gradients are averaged over its data-parallel replicas.

Side inputs (``train_step(x, y, loss_fn, attention_mask=mask)``) are passed by every rank,
each with the same values: each rank splits its own copy into micro-batches, nothing is sent.
A tensor that layers on several stages share (a tied embedding) is one tensor per rank that
uses it, kept equal across ranks (:mod:`fastpipe.distributed.tie_group`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from fastpipe.asynchronous.distributed import DistributedFitRun
from fastpipe.distributed.backend import rank_device
from fastpipe.distributed.fsdp import check_dp_shard, shard_pipe, state_bytes
from fastpipe.distributed.memory_limit import RankMemoryGuard, capacity_guard, check_rank_memory
from fastpipe.distributed.plan import check_balance_given, plan_for_ranks
from fastpipe.distributed.rank_offload import RankOffload
from fastpipe.distributed.rank_recompute import check_regions, described, rank_regions, whole_stage
from fastpipe.distributed.rank_stages import RankStages, StageBuilder, build_stages, declared_stages, split_module
from fastpipe.distributed.rank_step import rank_step
from fastpipe.distributed.ranks import check_same_settings, gather_objects, order_matched, pipeline_groups
from fastpipe.distributed.runtime import DEFAULT_TIMEOUT, DistributedRuntime
from fastpipe.distributed.step_outcome import apply_outcome
from fastpipe.distributed.tie_group import RankTies
from fastpipe.distributed.watchdog import FIRST_STEP_TIMEOUT
from fastpipe.errors import PipelineError
from fastpipe.memory.capacity import device_capacity
from fastpipe.memory.offload import OffloadSpec
from fastpipe.memory.optimizer import OptimizerSpec, optimizer_factor
from fastpipe.memory.planner import Plan
from fastpipe.model.batchnorm import DeferredBatchNorm
from fastpipe.model.partition import check_balance, check_module, first_layer_in_place
from fastpipe.runtime.options import P2P, RuntimeOptions
from fastpipe.runtime.step import LossSpec, Stage
from fastpipe.runtime.worker import CallerState
from fastpipe.schedule import Schedule
from fastpipe.schedule.builders import build_for, placement_for
from fastpipe.step.amp import distributed_loss_scale
from fastpipe.step.microbatch import Value
from fastpipe.step.recompute_policy import CheckpointSetting, checkpoint_setting
from fastpipe.step.rules import Checkpoint, check_chunks, check_loss_fn, checkpoint_predicate, microbatch_loss
from fastpipe.trace.timeline import Timeline

__all__ = ["DistributedPipe"]


class DistributedPipe(nn.Module):
    """The stages of an ``nn.Sequential`` that this rank holds, trained under a schedule.

    Local layers are registered under their names in the Sequential, so ``state_dict()``
    holds this rank's share of the Sequential's keys (see :func:`fastpipe.save`).

    Args:
        module: the whole model. Layers of other ranks' stages are released (moved to the meta device), so build
            the full model once per host only when it fits; otherwise use :meth:`from_stage_builder`.
        balance: layers per stage; ``len(balance)`` is the pipeline group size, a multiple
            of it with ``schedule="interleaved"``, or twice it with ``"zb-v"``/``"dualpipev"``; ``"auto"``: planned
            with the "auto" schedule and checkpoint under ``memory_limit`` (:mod:`fastpipe.distributed.plan`).
        chunks: micro-batches per mini-batch.
        schedule: one of :data:`fastpipe.schedule.SCHEDULES`; it fixes which stages this rank holds.
            ``"auto"`` with ``balance="auto"``: the planner's choice.
        checkpoint: as for :class:`fastpipe.Pipe`: whole-stage modes, a per-layer policy (over the whole model's
            layers: :mod:`fastpipe.distributed.rank_recompute`), or ``"auto"`` (default): per step shape, the least of
            never, except_last, always that fits ``memory_limit``, or without one the ranks' least CUDA capacity.
        process_group: the pipeline group (default: WORLD).
        mesh: a DeviceMesh with dims ``("pp", "dp")`` instead of the groups.
        dp_group: the data-parallel group of this rank's replicas (with ``process_group``).
        dp_shard: ``"replicate"`` (each replica holds whole stages) or ``"fsdp"``: FSDP2 shards each stage over
            the mesh's ``"dp"`` dimension (:mod:`fastpipe.distributed.fsdp`).
        device: where this rank's stages live (default: the current GPU under NCCL, else CPU).
        deferred_batch_norm: as for :class:`fastpipe.Pipe`.
        timeout: bound in seconds on every wait; a dead or failed peer raises
            :class:`~fastpipe.PipelineError` on every rank within it.
        first_step_timeout: the bound during the first step (never below ``timeout``), which a cold
            start (first Triton compiles, NCCL connections) can make take minutes.
        on_nan: a NaN/inf loss ``"raise"`` s :class:`~fastpipe.PipelineError` on every rank (naming step and
            micro-batch), or ``"skip"`` s the step: no gradients are accumulated and the non-finite loss is returned.
        free_others: release the layers of other ranks' stages in ``module``.
        bucket_bytes: size of one data-parallel (or tied-weight) gradient all-reduce bucket.
        p2p: how payloads are matched between ranks: ``"tags"`` (gloo only) or ``"ordered"`` (what NCCL
            needs, also on gloo); default ordered on NCCL, tags elsewhere. Every rank must match the same way.
        fused_wgrad, wgrad_batch, tune_malloc, wgrad_fuse_min: as for :class:`fastpipe.Pipe`. Where one of these is
            None, its ``FASTPIPE_*`` variable is read here (:mod:`fastpipe.runtime.options`).
        memory_limit: bytes per device (or ``"24GiB"``), checked on every rank before a step runs.
        optimizer_state: the optimizer state per device that ``memory_limit`` counts, as for :class:`fastpipe.Pipe`.
        offload: saved activations kept in host memory, as for :class:`fastpipe.Pipe`; a list has one entry per
            stage of the whole pipeline (:mod:`fastpipe.distributed.rank_offload`); ``fit`` runs it too.
        sample, sample_side_inputs: with ``balance="auto"``: a mini-batch like the real ones (read on the
            first rank) and its side inputs.

    A tensor that layers on several stages use (an embedding tied to the head) is found in ``module``. Each rank
    that uses it holds its own under the Sequential's name of its first use there (``"0.wte.weight"``;
    ``"9.weight"`` on the head's rank), which :func:`fastpipe.save` loads into the tied Sequential. The first
    stage's value is broadcast at construction and the gradient summed over those ranks after every backward
    (:mod:`fastpipe.distributed.tie_group`), so the optimizers keep the copies bitwise equal. Change one outside
    the optimizer on all of them, or call ``pipe.ties.sync()`` on every rank.
    """

    def __init__(
        self,
        module: nn.Sequential | None,
        balance: Sequence[int] | Literal["auto"] | None = None,
        *,
        chunks: int = 1,
        schedule: str = "1f1b",
        checkpoint: CheckpointSetting = "auto",
        process_group: Any = None,
        mesh: Any = None,
        dp_group: Any = None,
        dp_shard: str = "replicate",
        device: torch.device | str | None = None,
        deferred_batch_norm: bool = False,
        timeout: float = DEFAULT_TIMEOUT,
        first_step_timeout: float = FIRST_STEP_TIMEOUT,
        on_nan: Literal["raise", "skip"] = "raise",
        free_others: bool = True,
        bucket_bytes: int = 25 << 20,
        p2p: P2P | None = None,
        fused_wgrad: bool | None = None,
        wgrad_batch: int | None = None,
        tune_malloc: bool | None = None,
        wgrad_fuse_min: int | None = None,
        memory_limit: float | str | None = None,
        sample: Value | None = None,
        sample_side_inputs: dict[str, Any] | None = None,
        optimizer_state: OptimizerSpec = "adam",
        offload: OffloadSpec = None,
        _stage_modules: dict[int, nn.Sequential] | None = None,
        _ties: Sequence[Sequence[str]] = (),
    ) -> None:
        super().__init__()
        check_balance_given(balance, module)
        if on_nan not in ("raise", "skip"):
            raise ValueError(f"fastpipe: on_nan must be 'raise' or 'skip', got {on_nan!r}")
        check_chunks(chunks)
        state_factor = optimizer_factor(optimizer_state)  # a bad one is refused with or without a limit
        checkpoint = checkpoint_setting(checkpoint)
        self.plan: Plan | None = None
        opts = RuntimeOptions.resolve(p2p=p2p, tune_malloc=tune_malloc, fused_wgrad=fused_wgrad,
                                      wgrad_batch=wgrad_batch, wgrad_fuse_min=wgrad_fuse_min)  # fmt: skip
        check_dp_shard(dp_shard, mesh)
        group, dp = pipeline_groups(process_group, mesh, dp_group)
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        self.device = rank_device(group, device)
        if isinstance(balance, str):  # "auto", with the whole model (check_balance_given)
            backend = dist.get_backend(group)
            found = plan_for_ranks(check_module(cast(nn.Sequential, module)), schedule, checkpoint,
                                   sample=sample, side_inputs=sample_side_inputs, memory_limit=memory_limit,
                                   chunks=chunks, device=self.device, wgrad_batch=opts.wgrad_batch_on(self.device),
                                   group=group, dp_group=dp, timeout=timeout, optimizer=optimizer_state,
                                   transport="ordered" if order_matched(backend, opts.p2p) else "tags",
                                   offload=isinstance(offload, str) and offload == "auto")  # fmt: skip
            balance, schedule, self.plan = found.balance, found.schedule, found.plan
            checkpoint = found.checkpoint if checkpoint == "auto" else checkpoint  # a policy given stays this rank's
            offload = found.offload if isinstance(offload, str) and offload == "auto" else offload
        balance = list(cast(Sequence[int], balance))
        if len(balance) % size:
            raise ValueError(f"fastpipe: {len(balance)} stages do not spread over {size} pipeline ranks")
        placed = placement_for(schedule, len(balance), size)
        mine = [s for s, r in enumerate(placed) if r == rank]
        built: RankStages
        if _stage_modules is None:
            assert module is not None
            module = check_module(module)
            balance = check_balance(balance, len(module))
            if deferred_batch_norm:
                module = DeferredBatchNorm.convert(module)  # type: ignore[assignment]
            built = split_module(module, balance, mine, self.device, free_others=free_others)
        else:
            built = declared_stages(_stage_modules, _ties, self.device)
        build_for(schedule, len(balance), size, chunks)  # fail early on a bad combination
        self.balance, self.chunks, self.schedule, self.checkpoint = balance, chunks, schedule, checkpoint
        self.deferred_batch_norm, self.on_nan, self.group, self.dp_group = deferred_batch_norm, on_nan, group, dp
        self.last_timeline: Timeline | None = None
        guard = None if memory_limit is None else RankMemoryGuard(memory_limit, optimizer_state, dp_shard=dp_shard)
        self.memory_guard = guard
        for name, layer in built.layers:  # each tied tensor once: the Sequential's keys
            self.add_module(name, layer)
        self._stages = stages = {
            s: Stage(p, self.device, first_layer_in_place(p), opts) for s, p in built.stages.items()
        }
        kw = {"group": group, "dp_group": dp, "timeout": timeout, "bucket_bytes": bucket_bytes, "placement": placed}
        kw["first_step_timeout"] = first_step_timeout
        self._offload, wrong = RankOffload.reported(offload, stages, balance, guard is not None)
        self._runtime = DistributedRuntime(stages, len(balance), p2p=opts.p2p, tune_malloc=opts.tune_malloc, **kw)
        settings = {"balance": balance, "chunks": chunks, "schedule": schedule, "checkpoint": described(checkpoint),
                    "deferred_batch_norm": deferred_batch_norm, "on_nan": on_nan, "dp_shard": dp_shard,
                    "ties": built.expected, "memory_limit": None if guard is None else guard.limit,
                    "optimizer_state": state_factor}  # fmt: skip
        control = self._runtime.control_group
        for among, what in [(control, "pipeline")] + ([] if dp is None else [(dp, "data-parallel")]):
            check_same_settings(settings, among, what, timeout)
        # Each rank checks the side inputs of a call against the whole model's, and learns its ties.
        mine_facts = {"side": [n for st in stages.values() for n in st.side_names], "ties": built.report(),
                      "regions": rank_regions(checkpoint, stages, balance, wrong),
                      "capacity": device_capacity(self.device)}  # fmt: skip
        facts = gather_objects(mine_facts, control, "exchanging the stages' side inputs and ties", timeout)
        check_regions(checkpoint, [f["regions"] for f in facts])
        if guard is None and checkpoint == "auto":  # every rank decides alike, from everyone's facts
            self.memory_guard = capacity_guard([f["capacity"] for f in facts], optimizer_state, dp_shard)
        self._side_names = list(dict.fromkeys(n for f in facts for n in f["side"]))
        self._ties = RankTies(built, [f["ties"] for f in facts], stages, self._runtime, bucket_bytes)
        self.dp_shard = dp_shard
        if dp_shard == "fsdp":  # after the ties' first broadcast, which sends whole tensors
            shard_pipe(self, stages, mesh, self._runtime)

    @classmethod
    def from_stage_builder(
        cls, builder: StageBuilder, balance: Sequence[int], *, ties: Sequence[Sequence[str]] = (), **kwargs: Any
    ) -> DistributedPipe:
        """Build only this rank's stages: ``builder(stage)`` returns that stage's layers.

        ``builder(s)`` returns an ``nn.Sequential`` of ``balance[s]`` layers. Layers named
        ``"0".."n-1"`` are renamed to their index in the whole model (so keys match the full
        Sequential's); other names are kept. A stage built on the meta device
        (``with torch.device("meta"): ...``) is materialised with ``to_empty`` and every
        submodule's ``reset_parameters()``.

        ``ties`` declares the tensors that layers on different stages share, which no rank
        can see alone: ``ties=[("0.wte.weight", "9.weight")]`` (the Sequential's names; two
        or more per tie, on any ranks, of one shape and dtype). Each tie then works as one
        found in a whole model (see the class): the first stage's value is broadcast to the
        other uses at construction, whatever the builder initialised them with. A tensor
        shared between stages of one rank is found without a declaration. Pass the same
        ``ties`` on every rank.
        """
        group, _ = pipeline_groups(kwargs.get("process_group"), kwargs.get("mesh"), kwargs.get("dp_group"))
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        device = torch.device(kwargs.get("device") or "cpu")
        placement = placement_for(kwargs.get("schedule", "1f1b"), len(balance), size)
        modules = build_stages(builder, balance, [s for s, r in enumerate(placement) if r == rank], device)
        return cls(None, balance, _stage_modules=modules, _ties=[tuple(t) for t in ties], **kwargs)

    @property
    def stages(self) -> dict[int, nn.Module]:
        """This rank's stages by index."""
        return {s: st.module for s, st in self._stages.items()}

    @property
    def runtime(self) -> DistributedRuntime:
        """The driver that runs this rank's share of every schedule (its ``stages`` are this rank's)."""
        return self._runtime

    @property
    def num_workers(self) -> int:
        """The pipeline's ranks (one worker each; the schedule's placement says which stages)."""
        return self._runtime.size

    @property
    def timeout(self) -> float:
        """The bound in seconds on every wait of this pipeline's ranks."""
        return self._runtime.timeout

    @property
    def ties(self) -> RankTies:
        """The pipeline's tied tensors (every rank's), and this rank's part in keeping them equal."""
        return self._ties

    def state_bytes(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """This rank's bytes of ``"parameters"``, ``"gradients"`` and ``"optimizer"`` state (of ``optimizer``),
        tied copies included; 1/D of each with ``dp_shard="fsdp"``, besides the step's gathered working set."""
        return state_bytes([*self.parameters(), *(p for st in self._stages.values() for p in st.params)], optimizer)

    def train(self, mode: bool = True) -> DistributedPipe:
        """As ``nn.Module.train``; the stages' clones of tied layers follow too."""
        super().train(mode)
        for stage in self._stages.values():
            stage.module.train(mode)
        return self

    @property
    def is_first(self) -> bool:
        """This rank reads the input."""
        return 0 in self._stages

    @property
    def is_last(self) -> bool:
        """This rank reads the target and computes the loss."""
        return len(self.balance) - 1 in self._stages

    def forward(self, input: Value) -> Value:
        raise PipelineError(
            "fastpipe: a DistributedPipe has no forward(): each rank holds only its stages, so the output "
            "exists on the last rank alone; train with train_step(x, y, loss_fn) on every rank"
        )

    def train_step(
        self,
        input: Value | None,
        target: Any,
        loss_fn: Callable[[Any, Any], Tensor],
        *,
        scaler: torch.amp.GradScaler | None = None,
        trace: bool = False,
        schedule: Schedule | None = None,
        **side: Any,
    ) -> Tensor:
        """Forward and backward of one mini-batch; call it on every rank.

        ``input`` is read on stage 0's rank and ``target`` on the last stage's (both may be
        None elsewhere). Gradients accumulate into this rank's parameters' ``.grad``
        (averaged over data-parallel replicas; a tied tensor's summed over its uses on all
        ranks). Returns the mini-batch loss, the same on every rank. With ``trace=True``,
        ``last_timeline`` holds this rank's actions of the step (its worker row; gather the
        ranks' timelines to see the whole pipeline).

        ``scaler``: mixed precision's loss scaling, passed on every rank. The backward runs
        on the scaled loss and the unscaled loss is returned; then ``scaler.step(opt);
        scaler.update()`` on every rank. Over several ranks it must be a
        ``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`` whose group holds them
        all, so that an overflow on one rank skips the step on every rank (see
        :mod:`fastpipe.step.amp`); a non-finite loss is then the scaler's to handle, not ``on_nan``'s.

        ``schedule``: a :class:`~fastpipe.schedule.Schedule` to run instead of the pipe's (one
        from :func:`fastpipe.schedule.fuse.fuse_backward`, say), for this pipe's stages, ranks
        and placement and this step's micro-batches; every rank passes the same one (checked).

        ``side``: side inputs (``attention_mask=mask``), as for :meth:`fastpipe.Pipe.train_step`.
        Every rank passes the same ones: each splits its own copy with the micro-batch sizes of
        stage 0's input (nothing is sent), and its stages' layers receive those they declare.
        A name that no layer of any rank takes, or a shape that is neither the batch nor 1,
        raises on the rank that sees it and a :class:`~fastpipe.PipelineError` on the others.
        """
        check_loss_fn(loss_fn)
        runtime = self._runtime
        self.last_timeline = runtime.start_timeline(trace)
        here = f"stage {','.join(map(str, self._stages))}"
        step = rank_step(self, input, target, loss_fn, side, schedule, here)
        chosen = check_rank_memory(self, step, loss_fn)
        count = len(step.sizes)
        checkpoint = checkpoint_predicate(
            cast(Checkpoint, chosen or whole_stage(self.checkpoint)), self.training, count
        )

        scale = distributed_loss_scale(scaler, self.device, runtime)
        scaling = scaler is not None and scaler.is_enabled()  # its scale may have backed off to 1.0
        self._ties.refresh()
        outcome = runtime.train(
            self._offload.prefetch(step.schedule),
            step.microbatches,
            LossSpec(microbatch_loss(loss_fn, step.targets), step.targets, [w * scale for w in step.weights]),
            checkpoint=checkpoint,
            caller=CallerState.capture(),
            step_seed=step.step_seed,
            side=step.side,
        )
        return apply_outcome(self, outcome, scale, scaling)

    def fit(
        self,
        batches: Iterable[tuple[Value | None, Any]],
        loss_fn: Callable[[Any, Any], Tensor],
        optimizer: torch.optim.Optimizer,
        *,
        consistency: str = "predict",
        scheduler: Any = None,
        max_grad_norm: float | None = None,
        window: int = 8,
        trace: bool = False,
        memory_limit: float | str | None = None,
    ) -> Any:
        """:meth:`fastpipe.Pipe.fit` on every rank (its stage, or its virtual stages interleaved); see
        :mod:`fastpipe.asynchronous.distributed`.

        Every rank passes its own ``batches`` of ``(input, target)`` in step (stage 0's rank
        reads the inputs, the last rank the targets) and its optimizer over its parameters;
        every rank yields the same losses. With data parallelism each stage's update averages
        its gradient over the replicas first (with ``dp_shard="fsdp"``, into this rank's shard
        of it). A batch may carry side inputs as a third item (every rank's, as for
        :meth:`train_step`). It refuses tied weights across stages (each stage updates on its
        own, so the copies would drift). ``memory_limit`` (default the pipe's; the same on every
        rank) is checked per window on every rank (:mod:`fastpipe.asynchronous.fit_limit`).
        """
        return DistributedFitRun(self, batches, loss_fn, optimizer, consistency=consistency, scheduler=scheduler,
                                 max_grad_norm=max_grad_norm, window=window, trace=trace,
                                 memory_limit=memory_limit)  # fmt: skip

    def close(self) -> None:
        """Drop the runtime's pending state (the process groups stay the caller's)."""
        self._runtime.close()
