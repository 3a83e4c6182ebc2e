"""The thread driver: one process, one persistent worker thread per pipeline worker.

It runs a :class:`~fastpipe.schedule.Schedule`'s per-worker action lists, each in its own
thread, with the handlers of :mod:`fastpipe.runtime.step` and a
:class:`~fastpipe.runtime.transport.LocalTransport` between them, like torchgpipe.

``Pipe.forward``'s backward is one autograd node, and on a GPU that node is where the design
must bend. autograd runs a node whose gradients live on ``cuda:d`` on its engine thread for
``cuda:d``, and every autograd call another thread makes on ``cuda:d`` tensors queues behind
it: a node that waits for stage workers there deadlocks. So when the node runs on the device
thread of ``cuda:d``, that thread runs the backward actions of the stages on ``cuda:d``
itself, reentrantly and in an order the schedule allows, while the stages on other devices
keep their workers
(:mod:`fastpipe.runtime.inline`, which also says why not one graph stitched across the GPU
stages). ``train_step`` is not inside autograd and runs every stage in its worker.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from fastpipe.errors import PipelineError, annotate
from fastpipe.runtime.host_alloc import tune_host_allocator
from fastpipe.runtime.inline import inline_workers, run_inline, worker_like
from fastpipe.runtime.mailbox import Aborted
from fastpipe.runtime.skip_flow import route_skips
from fastpipe.runtime.step import LossSpec, Recorder, Stage, StepRunner, StepState
from fastpipe.runtime.transport import LocalTransport
from fastpipe.runtime.worker import CallerState, WorkerPool
from fastpipe.schedule import Action, Schedule
from fastpipe.step.microbatch import Value
from fastpipe.trace.timeline import Timeline

__all__ = ["LocalRuntime"]


class LocalRuntime:
    """Runs schedules over ``stages`` with one persistent thread per worker.

    Args:
        stages: the pipeline's stages, in order.
        recorder: optional ``(worker, action_text, start_s, end_s)`` callback, called from
            worker threads after every action (timelines).
        copy_same_device: send hand-offs between stages on the same device through the
            copy runtime too (as between devices). Tests use it to exercise the transfer
            path on CPU-only hosts; it also measures that path's overhead.
        tune_malloc: tune glibc's allocator before the first step where a stage is on the CPU
            (:mod:`fastpipe.runtime.host_alloc`).
    """

    def __init__(
        self,
        stages: Sequence[Stage],
        recorder: Recorder | None = None,
        *,
        copy_same_device: bool = False,
        tune_malloc: bool = True,
    ) -> None:
        self.stages = list(stages)
        route_skips(self.stages)  # refuses bad declarations here, when the pipe is built
        self.recorder = recorder
        self.copy_same_device = copy_same_device
        self.tune_malloc = tune_malloc
        self._pool: WorkerPool | None = None

    def start_timeline(self, enabled: bool, workers: int) -> Timeline | None:
        """Record the next runs' actions into a new :class:`Timeline` (or stop recording)."""
        timeline = Timeline(workers) if enabled else None
        self.recorder = timeline.record if timeline is not None else None
        return timeline

    def transport(self) -> LocalTransport:
        """A fresh transport between this runtime's stages (one per step)."""
        return LocalTransport([st.device for st in self.stages], force_copy=self.copy_same_device)

    def close(self) -> None:
        """Stop the worker threads (they restart on the next step)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def forward(
        self,
        schedule: Schedule,
        microbatches: Sequence[Value],
        *,
        grad: bool,
        checkpoint: Callable[[int], bool],
        caller: CallerState,
        step_seed: int,
        side: Sequence[Mapping[str, Any]] = (),
    ) -> tuple[list[Value], StepState]:
        """Run the schedule's F actions; return the last stage's outputs per micro-batch.

        Args:
            grad: build autograd graphs (the caller wants a backward).
            checkpoint: ``checkpoint(mb)`` says whether micro-batch ``mb`` is recomputed in
                the backward instead of keeping its graph.
            side: each micro-batch's side inputs (:mod:`fastpipe.model.side_inputs`).
        """
        state = StepState(schedule, caller, step_seed, side)
        step = self._step(state, grad=grad, checkpoint=checkpoint, loss=None)
        step.feed(microbatches)
        self.execute(schedule, ("F",), step, "forward")
        return [step.results[m] for m in range(len(microbatches))], state

    def backward(
        self,
        state: StepState,
        grad_outputs: Sequence[Sequence[Tensor | None]],
        *,
        thread_device: torch.device | None = None,
    ) -> tuple[list[list[Tensor | None]], list[list[Tensor | None]]]:
        """Run the schedule's backward actions after :meth:`forward`.

        Args:
            state: from :meth:`forward` with ``grad=True``; consumed.
            grad_outputs: per micro-batch, one gradient (or None) per tensor of the last
                stage's output.
            thread_device: the device whose autograd engine thread this is, if any; the
                workers of the stages on it then run here (see :mod:`fastpipe.runtime.inline`).

        Returns:
            ``(input_grads, param_grads)``: per micro-batch, the gradient of each input
            tensor (None where it needs none); per stage, the gradient of each
            ``stage.params`` entry summed over micro-batches.
        """
        if state.consumed:
            raise PipelineError(
                "fastpipe: backward ran twice through the same pipeline step; the step's graphs are "
                "freed after the first backward (retain_graph is not supported), so run forward again"
            )
        state.consumed = True
        step = self._step(state, grad=True, checkpoint=lambda m: False, loss=None)
        step.post_output_grads(grad_outputs)
        try:
            inline = inline_workers(state.schedule, [st.device for st in self.stages], thread_device)
            self.execute(state.schedule, ("BW", "B", "W", "P"), step, "backward", inline)
        finally:
            state.tasks.clear()
        return [step.input_grads[m] for m in range(len(grad_outputs))], [
            step.param_grads[s] for s in range(len(self.stages))
        ]

    def train(
        self,
        schedule: Schedule,
        microbatches: Sequence[Value],
        loss: LossSpec,
        *,
        checkpoint: Callable[[int], bool],
        caller: CallerState,
        step_seed: int,
        side: Sequence[Mapping[str, Any]] = (),
    ) -> tuple[list[Tensor], list[list[Tensor | None]]]:
        """Run a whole schedule, loss included, on the last stage (``side`` as for :meth:`forward`).

        Returns:
            ``(losses, param_grads)``: each micro-batch's (unweighted) loss, detached; per
            stage, the gradient of each ``stage.params`` entry summed over micro-batches
            (each micro-batch's share weighted by ``loss.weights``).
        """
        state = StepState(schedule, caller, step_seed, side)
        step = self._step(state, grad=True, checkpoint=checkpoint, loss=loss)
        step.feed(microbatches)
        try:
            self.execute(schedule, ("F", "BW", "B", "W", "P"), step, "train step")
        finally:
            state.tasks.clear()
        losses = [step.results[m] for m in range(len(microbatches))]
        return losses, [step.param_grads[s] for s in range(len(self.stages))]  # type: ignore[return-value]

    def _step(
        self, state: StepState, *, grad: bool, checkpoint: Callable[[int], bool], loss: LossSpec | None
    ) -> StepRunner:
        return StepRunner(
            dict(enumerate(self.stages)),
            len(self.stages),
            self.transport(),
            state,
            grad=grad,
            checkpoint=checkpoint,
            loss=loss,
        )

    def execute(
        self,
        schedule: Schedule,
        kinds: tuple[str, ...],
        step: StepRunner,
        phase: str,
        inline: frozenset[int] = frozenset(),
    ) -> None:
        """Run the ``kinds`` actions of every worker with ``step``'s handlers, one thread per worker.

        Args:
            schedule: the actions, per worker.
            kinds: which action kinds to run now (e.g. only ``("F",)`` for a forward).
            step: the handlers; its transport must be a :class:`LocalTransport`.
            phase: names the phase in error messages.
            inline: workers whose actions run on the calling thread instead.
        """
        if self._pool is None and self.tune_malloc and any(st.device.type == "cpu" for st in self.stages):
            tune_host_allocator()  # before the workers' first allocation (see host_alloc)
        if self._pool is None:
            self._pool = WorkerPool(schedule.num_workers)
        elif self._pool.size != schedule.num_workers:
            self._pool.close()
            self._pool = WorkerPool(schedule.num_workers)
        recorder = self.recorder
        handlers = step.handlers()
        caller = step.state.caller
        queues = [[a for a in schedule.workers[w] if a.kind in kinds] for w in range(schedule.num_workers)]

        def run(worker: int, action: Action) -> None:
            try:
                with caller.placed(self.stages[action.stage].device):
                    start = handlers[action.kind](action)
            except Aborted:
                raise
            except BaseException as exc:
                raise annotate(
                    exc,
                    f"fastpipe: raised in stage {action.stage}, micro-batch {action.microbatch} "
                    f"({phase}, action {action})",
                ) from None
            if recorder is not None:
                recorder(worker, str(action), start, time.perf_counter())

        def job_for(worker: int) -> Callable[[], None] | None:
            actions = queues[worker]
            if not actions or worker in inline:
                return None

            def job() -> None:
                for action in actions:
                    run(worker, action)

            return job

        running = self._pool.start([job_for(w) for w in range(schedule.num_workers)], step.transport.abort)
        if inline:
            assert isinstance(step.transport, LocalTransport)
            mailbox = step.transport.mailbox

            def waits_on(action: Action) -> Hashable | None:
                slot = step.waits_on(action)
                return None if slot is None else LocalTransport.slot(*slot)

            try:
                with worker_like():
                    run_inline({w: queues[w] for w in inline}, run, waits_on, mailbox)
            except BaseException as exc:  # noqa: BLE001 - reported like a worker's, re-raised by wait()
                running.report(exc)
        running.wait()
