"""The distributed runtime: one process per pipeline worker, over torch.distributed.

Each rank of the pipeline group runs its own worker's action list of the
:class:`~fastpipe.schedule.Schedule` through the same :class:`StepRunner` as the local
runtime; only the :class:`~fastpipe.runtime.transport.Transport` differs
(:class:`~fastpipe.distributed.p2p.P2PTransport` on gloo,
:class:`~fastpipe.distributed.p2p_ordered.OrderedTransport` on NCCL, which follows the round
plan of :mod:`fastpipe.schedule.ordered`). Every rank raises
:class:`~fastpipe.PipelineError` naming the rank and stage that failed first
(see :mod:`fastpipe.distributed.watchdog` for how waits are bounded).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fastpipe.distributed.backend import abort_nccl, require_backend
from fastpipe.distributed.dp_reduce import AllReduceSync, ReplicaSync, connect_replicas, finish_reduce, start_reduce
from fastpipe.distributed.host_values import (
    LOSS_DTYPES,
    LossReadback,
    host_all_reduce,
    host_broadcast,
    host_reduce_groups,
)
from fastpipe.distributed.p2p import P2PTransport
from fastpipe.distributed.p2p_ordered import OrderedTransport
from fastpipe.distributed.ranks import check_nccl_device, check_rank_stages, check_same_transport, order_matched
from fastpipe.distributed.watchdog import DEFAULT_TIMEOUT, FIRST_STEP_TIMEOUT, Watchdog, bounded_barrier, default_store
from fastpipe.errors import PipelineError, annotate
from fastpipe.runtime.host_alloc import tune_host_allocator
from fastpipe.runtime.options import P2P
from fastpipe.runtime.skip_flow import share_skip_routes
from fastpipe.runtime.step import LossSpec, Recorder, Stage, StepRunner, StepState
from fastpipe.runtime.worker import CallerState
from fastpipe.schedule import Action, Schedule, ScheduleError
from fastpipe.schedule.ordered import Message, Step, check_ordered, inputs, plan
from fastpipe.step.microbatch import Value
from fastpipe.trace.timeline import Timeline

__all__ = ["DistributedRuntime", "StepOutcome", "DEFAULT_TIMEOUT", "RunnerFactory"]

RunnerFactory = Callable[[Mapping[int, Stage], int, Any, StepState], StepRunner]

_SHOWN_WAIT = 1e-4  # seconds: shorter waits for a peer's value stay out of the timeline


@dataclass
class StepOutcome:
    """What one distributed training step returns on every rank.

    Attributes:
        loss: the mini-batch loss (averaged over data-parallel replicas), the same on every rank.
        nonfinite: where the loss was NaN/inf (``"micro-batch 3"``, ``"another data-parallel replica"``) or None.
        param_grads: per local stage, the gradient of each ``stage.params`` entry (dp-averaged; fsdp: shards).
    """

    loss: Tensor
    nonfinite: str | None
    param_grads: dict[int, list[Tensor | None]]


class DistributedRuntime:
    """Runs this rank's share of every schedule step, in the calling thread.

    Args:
        stages: the stages this rank holds, by index (stage ``s`` on group rank ``placement[s]``).
        num_stages: all stages of the pipeline.
        placement: the group rank of each stage, as in the schedules it will run
            (:attr:`~fastpipe.schedule.Schedule.placement`); default round robin, ``s % K``.
        group: the pipeline process group (default: WORLD).
        dp_group: optional data-parallel group of this rank's replicas; gradients are
            averaged over it (bucketed, started as each stage finishes its backward).
        timeout: bound in seconds on every single wait.
        first_step_timeout: the bound during the first step, slow when cold (Triton compiles, NCCL connections).
        store: the store for the abort side channel (default: the default group's store).
        bucket_bytes: size of one gradient all-reduce bucket.
        recorder: optional ``(worker, action_text, start_s, end_s)`` callback.
        p2p: ``"tags"``, ``"ordered"`` or None (ordered on NCCL, tags elsewhere): see :func:`order_matched`.
        tune_malloc: tune glibc's allocator for CPU stages (:mod:`fastpipe.runtime.host_alloc`).
    """

    def __init__(
        self,
        stages: Mapping[int, Stage],
        num_stages: int,
        *,
        group: Any = None,
        dp_group: Any = None,
        timeout: float = DEFAULT_TIMEOUT,
        first_step_timeout: float = FIRST_STEP_TIMEOUT,
        store: dist.Store | None = None,
        bucket_bytes: int = 25 << 20,
        recorder: Recorder | None = None,
        placement: Sequence[int] | None = None,
        p2p: P2P | None = None,
        tune_malloc: bool = True,
    ) -> None:
        self.group: Any = group if group is not None else dist.group.WORLD
        self.dp_group: Any = dp_group
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.num_stages = num_stages
        self.placement = check_rank_stages(placement, num_stages, self.size, self.rank, stages)
        self.stages = dict(stages)
        if tune_malloc and any(st.device.type == "cpu" for st in self.stages.values()):
            tune_host_allocator()  # see fastpipe.runtime.host_alloc: page faults per step otherwise
        device = next(iter(self.stages.values())).device if self.stages else torch.device("cpu")
        # The backend that moves this stage's tensors ("cpu:gloo,cuda:nccl" groups, and
        # init_process_group() without backend=, which reports "undefined").
        backend = require_backend(self.group, device)
        self.ordered = order_matched(backend, p2p)
        if backend == "nccl":  # before any collective: a misplaced rank must not leave its peers waiting
            check_nccl_device(device)
        store = store if store is not None else default_store()
        self.global_rank = dist.get_rank()
        self.timeout, self.first_step_timeout = timeout, max(timeout, first_step_timeout)
        # Set-up waits are bounded on a gloo group of the pipeline's ranks: the group itself on
        # gloo, else a side group (which also carries the ordered transport's headers). NCCL's
        # own collectives would wait for a dead or misconfigured rank without limit.
        plain_gloo = dist.get_backend(self.group) == "gloo"  # not "undefined" or "cpu:gloo,cuda:nccl"
        self.side_group: Any = None if plain_gloo else self._gloo_side_group()
        self.control_group: Any = self.group if plain_gloo else self.side_group
        self.watchdog = Watchdog(store, self._abort_key(), timeout, self.global_rank)
        # A failed step aborts the NCCL communicators (gloo groups are left as they are): a
        # GPU stream waiting on a hung peer's payload would block every later sync otherwise.
        self.watchdog.aborts += [functools.partial(abort_nccl, g) for g in (self.group, self.dp_group) if g is not None]
        check_same_transport(self.ordered, self.control_group)
        # Collectives run on the backend's device: NCCL reduces CUDA tensors only.
        self.comm_device = device if backend == "nccl" else torch.device("cpu")
        connect_replicas(dp_group, self.comm_device, self.wait_collective)  # NCCL's communicator now, not in step 1
        self.replicas: ReplicaSync | None = None  # how gradients meet the replicas' (fsdp: fsdp_step's)
        if dp_group is not None:
            self.replicas = AllReduceSync(self.stages, dp_group, bucket_bytes, self.wait_collective)
        # Where each group reduces the host's values: the gloo control group, then the replicas'.
        self.host_groups = [(self.control_group, torch.device("cpu")), *host_reduce_groups(dp_group, self.comm_device)]
        routes = share_skip_routes(self.stages, num_stages, self.control_group)  # fastpipe.model.skips
        # Skips are edges of the dataflow: an order-matched transport plans their messages too.
        self.skip_edges = tuple((p, c) for p, sk in enumerate(routes) for c, _ in sk.sends)
        self.transport: P2PTransport
        if self.ordered:
            if self.side_group is None:
                self.side_group = self._gloo_side_group()
            self.transport = OrderedTransport(
                self.group, self.side_group, num_stages, self.watchdog, device, self.placement
            )
            self.transport.use_skips(routes)
            self.transport.connect()
        else:
            self.transport = P2PTransport(self.group, num_stages, self.watchdog, device, self.placement)
            self.transport.use_skips(routes)
        self._plans: dict[Schedule, list[Step]] = {}
        self.bucket_bytes = bucket_bytes
        self.recorder = recorder
        self.steps = 0

    def _record_wait(self, messages: Sequence[Message], since: float, until: float | None = None) -> None:
        """Show a wait for cross-rank values in the timeline, as the IR's RECV action of the first one."""
        until = time.perf_counter() if until is None else until
        if self.recorder is None or not messages or until - since < _SHOWN_WAIT:  # tracing is off, or no wait
            return
        first = messages[0]  # a skip arrives for the forward ("S") or the backward ("SB") of its stage
        kind = "F" if first.kind in ("F", "S") else "B"
        self.recorder(self.rank, f"{first.stage}RECV_{kind}{first.microbatch}", since, until)

    def _plan(self, schedule: Schedule) -> list[Step]:
        """This rank's posts and actions for an ordered transport; refuses schedules that could deadlock."""
        steps = self._plans.get(schedule)
        if steps is None:
            dataflow = schedule.with_skips(self.skip_edges)
            try:
                check_ordered(dataflow)
            except ScheduleError as exc:
                raise ValueError(f"fastpipe: {exc}") from None
            steps = self._plans[schedule] = plan(dataflow, self.rank)
        return steps

    def _gloo_side_group(self) -> Any:
        """A gloo group of the pipeline's ranks, created within ``timeout`` or PipelineError."""
        ranks = [self.global_rank_of(r) for r in range(self.size)]
        try:
            return dist.new_group(
                ranks, backend="gloo", use_local_synchronization=True, timeout=datetime.timedelta(seconds=self.timeout)
            )
        except Exception as exc:  # noqa: BLE001 - the store barrier inside timed out: a rank is missing
            raise PipelineError(
                f"fastpipe: setting up the pipeline: not every rank of {ranks} arrived within "
                f"{self.timeout:g} s (a rank died, hangs or failed its set-up): {exc}"
            ) from exc

    def _abort_key(self) -> str:
        """One key per pipeline (all its data-parallel replicas): chosen by replica 0's rank 0."""
        name = [f"fastpipe/abort/{uuid.uuid4().hex}"]
        bounded_barrier(self.control_group, self.timeout, "setting up the pipeline")
        dist.broadcast_object_list(name, src=self.global_rank_of(0), group=self.control_group)
        if self.dp_group is not None:
            dist.broadcast_object_list(name, src=dist.get_global_rank(self.dp_group, 0), group=self.dp_group)
        return str(name[0])

    @property
    def first_rank(self) -> int:
        """Group rank of stage 0 (reads the input)."""
        return self.placement[0]

    @property
    def last_rank(self) -> int:
        """Group rank of the last stage (reads the target, computes the loss; rank 0 in a V)."""
        return self.placement[-1]

    def global_rank_of(self, group_rank: int) -> int:
        """The global rank of the pipeline group's rank ``group_rank``."""
        return dist.get_global_rank(self.group, group_rank)

    @contextlib.contextmanager
    def reported(self, where: str) -> Iterator[None]:
        """An error raised in the block fails the step on every rank: the others raise PipelineError naming it."""
        try:
            yield
        except BaseException as exc:
            self.watchdog.fail(f"rank {self.global_rank} ({where}) raised {type(exc).__name__}: {exc}")
            raise

    def wait_collective(self, work: Any, what: str) -> None:
        """Wait for an async collective within ``timeout``; a failed peer raises PipelineError."""
        self.watchdog.wait_collective(work, what)

    def broadcast(self, values: Tensor, src: int, what: str) -> Tensor:
        """``values`` of the pipeline group's rank ``src`` on every rank (a CPU tensor, over gloo), bounded."""
        return host_broadcast(values, self.global_rank_of(src), self.control_group, self.wait_collective, what)

    def dp_mean(self, values: Tensor, what: str) -> Tensor:
        """The mean of ``values`` over the data-parallel replicas (a CPU tensor), bounded."""
        reduced = host_all_reduce(values, self.host_groups[1:], self.wait_collective, what)
        return reduced / dist.get_world_size(self.dp_group)

    def agree_max(self, values: Tensor, what: str) -> Tensor:
        """The element-wise max of ``values`` over the pipeline's ranks and their replicas (a CPU tensor), bounded."""
        return host_all_reduce(values, self.host_groups, self.wait_collective, what, dist.ReduceOp.MAX)

    def reduce_stage_grads(self, stage: int, grads: list[Tensor | None]) -> None:
        """Average ``stage``'s gradients over the data-parallel replicas, in place (None -> zeros)."""
        for bucket in start_reduce(stage, self.stages[stage].params, grads, self.dp_group, self.bucket_bytes):
            self.wait_collective(bucket.work, f"the data-parallel gradient all-reduce of stage {stage}")
            finish_reduce(grads, bucket, self.dp_group)

    def start_timeline(self, enabled: bool) -> Timeline | None:
        """Record this rank's next actions into a new :class:`Timeline` (or stop recording)."""
        timeline = Timeline(self.size) if enabled else None
        self.recorder = timeline.record if timeline is not None else None
        return timeline

    def broadcast_sizes(
        self, sizes: Sequence[int] | None, max_chunks: int, step_seed: int = 0, digest: int = 0
    ) -> tuple[list[int], int, int]:
        """Share the micro-batch sizes, the step's seed and a schedule digest from stage 0's rank.

        Returns ``(sizes, step_seed, digest)`` as stage 0's rank gave them, so that every stage
        draws its dropout masks from the same step seed as in a one-process run, and every rank
        can check that it runs stage 0's schedule (:mod:`fastpipe.schedule.digest`).
        """
        self.watchdog.check()
        buf = torch.zeros(max_chunks + 3, dtype=torch.int64)
        if self.rank == self.first_rank:
            assert sizes is not None
            buf[0], buf[1], buf[2] = len(sizes), step_seed, digest
            buf[3 : 3 + len(sizes)] = torch.tensor(list(sizes), dtype=torch.int64)
        shared = self.broadcast(buf, self.first_rank, "the micro-batch sizes").tolist()
        return shared[3 : 3 + shared[0]], shared[1], shared[2]

    def train(
        self,
        schedule: Schedule,
        microbatches: Sequence[Value] | None,
        loss: LossSpec,
        *,
        checkpoint: Callable[[int], bool],
        caller: CallerState | None = None,
        step_seed: int = 0,
        runner_factory: RunnerFactory | None = None,
        side: Sequence[Mapping[str, Any]] = (),
    ) -> StepOutcome:
        """Run this rank's actions of one step; the loss comes back on every rank.

        Args:
            microbatches: the input micro-batches on stage 0's rank, None elsewhere.
            loss: the loss; its targets matter on the last stage's rank only.
            runner_factory: makes the action handlers from (stages, num_stages, transport, state);
                default a :class:`StepRunner` (``fastpipe.asynchronous`` adds updates).
            side: each micro-batch's side inputs (every rank splits its own, see
                :mod:`fastpipe.model.side_inputs`), or empty.
        """
        if self.watchdog.failure is not None:
            raise self.watchdog.failure
        if schedule.num_workers != self.size or schedule.num_stages != self.num_stages:
            raise ValueError(
                f"fastpipe: schedule for {schedule.num_workers} workers / {schedule.num_stages} stages "
                f"on a group of {self.size} ranks holding {self.num_stages} stages"
            )
        if schedule.placement != self.placement:
            raise ValueError(
                f"fastpipe: schedule {schedule.name!r} places the stages on ranks {list(schedule.placement)}, but "
                f"this pipeline's ranks hold them as {list(self.placement)}; build the pipe with that schedule"
            )
        self.steps += 1
        self.watchdog.timeout = self.first_step_timeout if self.steps == 1 else self.timeout
        state = StepState(schedule, caller or CallerState.capture(), step_seed, side)
        runner = (
            StepRunner(self.stages, self.num_stages, self.transport, state, grad=True, checkpoint=checkpoint, loss=loss)
            if runner_factory is None
            else runner_factory(self.stages, self.num_stages, self.transport, state)
        )
        actions = schedule.workers[self.rank]
        steps = self._plan(schedule) if self.ordered else [Step(action=a) for a in actions]
        last_grad_action = {a.stage: i for i, a in enumerate(actions) if a.kind in ("BW", "W")}
        readback = LossReadback(loss.weights) if self.rank == self.last_rank else None
        # No replicas: nothing to reduce; fit (a runner_factory) averages at each of its updates instead.
        sync = self.replicas if self.replicas is not None and runner_factory is None else ReplicaSync()
        try:
            sync.begin()
            self.transport.begin(actions)
            if self.rank == self.first_rank:
                assert microbatches is not None, "stage 0's rank needs the input"
                runner.feed(microbatches)
            handlers = runner.handlers()
            i = -1
            for step in steps:
                action = step.action
                called = time.perf_counter()
                try:
                    if action is None:
                        assert isinstance(self.transport, OrderedTransport)
                        self.transport.post(step.ops)
                        if self.recorder is not None:
                            self._record_wait([op.message for op in step.ops if not op.send], called)
                        continue
                    i += 1
                    start = handlers[action.kind](action)
                except PipelineError as exc:
                    if self.watchdog.failure is None:  # raised here (a plan bug), not learnt from a peer
                        self.watchdog.fail(
                            f"rank {self.global_rank} ({_where(action, actions[i + 1 :], self.steps)})"
                            f" raised PipelineError: {exc}"
                        )
                    raise
                except BaseException as exc:
                    where = _where(action, actions[i + 1 :], self.steps)
                    self.watchdog.fail(f"rank {self.global_rank} ({where}) raised {type(exc).__name__}: {exc}")
                    raise annotate(exc, f"fastpipe: raised on rank {self.global_rank} in {where}") from None
                if readback is not None:
                    readback.poll(runner.results)
                if self.recorder is not None:
                    self._record_wait(inputs(schedule, action), called, start)
                    self.recorder(self.rank, str(action), start, time.perf_counter())
                if last_grad_action.get(action.stage) == i:
                    sync.stage_done(action.stage, runner.param_grads[action.stage])
            self.transport.finish()
            sync.finish(runner.param_grads)
            return self._share_loss(readback.read(runner.results) if readback is not None else None, runner)
        except BaseException:
            state.tasks.clear()
            self.transport.reset()
            raise
        finally:
            sync.end()

    def _share_loss(self, message: Tensor | None, runner: StepRunner) -> StepOutcome:
        buf = message if message is not None else torch.zeros(3, dtype=torch.float64)
        buf = self.broadcast(buf, self.last_rank, "the step's loss")
        _, first_bad, code = buf.tolist()
        # Every rank returns the loss in the last stage's dtype (a float64 model's loss is not rounded).
        dtype = LOSS_DTYPES[int(code)] if code >= 0 else torch.get_default_dtype()
        nonfinite = f"micro-batch {int(first_bad) - 1}" if first_bad > 0 else None
        if self.dp_group is not None:
            flags = self.dp_mean(torch.stack([buf[0], (buf[1] > 0).double()]), "the data-parallel loss all-reduce")
            buf[0] = flags[0]
            if nonfinite is None and flags.tolist()[1] > 0:
                nonfinite = "another data-parallel replica"
        return StepOutcome(buf[0].to(dtype), nonfinite, runner.param_grads)

    def close(self) -> None:
        """Drop pending state; the process groups stay the caller's to destroy."""
        self.transport.close()


def _where(action: Action | None, ahead: Sequence[Action], step: int) -> str:
    """Where in the step a failure happened, for the error message."""
    if action is not None:
        return f"stage {action.stage}, micro-batch {action.microbatch} (step {step}, action {action})"
    return f"posting transfers before {ahead[0] if ahead else 'the end of the step'} (step {step})"
