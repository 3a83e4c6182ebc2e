"""The step core: the action handlers (F, BW, B, W) that every driver runs.

A step is a :class:`~fastpipe.schedule.Schedule` executed over :class:`Stage` s. This module
says what each action does; a driver says where and when it runs:

* :mod:`fastpipe.runtime.threads`: one process, one worker thread per pipeline worker;
* :mod:`fastpipe.distributed.runtime`: one process per rank, over ``torch.distributed``;
* :mod:`fastpipe.asynchronous.runner`: the same handlers plus weight updates (``U``).

Each action waits for what it needs through a :class:`~fastpipe.runtime.transport.Transport`
(the previous stage's activation, the next stage's gradient), runs, and posts its result for
the consumer. The order of work is the schedule's; the handlers only supply the dependencies.

Autograd never crosses a stage boundary. A stage's forward sees its input as a fresh
leaf; its backward is an explicit autograd call run *in that stage's worker*. That is what
lets stage backwards overlap on a CPU, where torch's autograd engine would otherwise run
every CPU backward on the one thread that called ``backward()``::

      worker 0            worker 1
    ┌──────────┐  act   ┌──────────┐
    │ x0 ─ f0 ─┼──────▶ │ x1 ─ f1 ─┼──▶ output          (forward phase)
    │  ▲ grad  │ ◀──────┼─ ▲ grad  │ ◀── grad_output    (backward phase)
    └──────────┘  dx1   └──────────┘
    x_s: leaf with requires_grad; f_s's graph stays inside worker s.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from fastpipe.model.side_inputs import run_layers, side_inputs_on
from fastpipe.rng.state import install as install_task_rng_state
from fastpipe.rng.streams import TaskRNG, may_draw, task_seed
from fastpipe.runtime.offload import StepOffload
from fastpipe.runtime.param_hooks import hooks_set_aside
from fastpipe.runtime.replay import Snapshot
from fastpipe.runtime.selective import stage_regions
from fastpipe.runtime.skip_flow import SkipFlow
from fastpipe.runtime.split_backward import WeightWork, backward_inputs, backward_weights
from fastpipe.runtime.stage import Stage
from fastpipe.runtime.stage_checks import check_output, checked_loss, in_place_on_input
from fastpipe.runtime.transport import Transport
from fastpipe.runtime.wgrad import CarriedRecords, Deferred, accumulating_linears
from fastpipe.runtime.worker import CallerState, recomputing
from fastpipe.schedule import Action, Schedule
from fastpipe.schedule.fuse import adjacent_pairs, weight_batches
from fastpipe.step.microbatch import Value, replace_tensors, tensors_of

__all__ = ["Stage", "StepState", "StepRunner", "LossSpec", "Recorder"]

Recorder = Callable[[int, str, float, float], None]


@dataclass
class _Task:
    """What one (stage, micro-batch) keeps between its forward and its backward."""

    inputs: Value  # the stage's input leaves
    outputs: Value | None  # graph-attached outputs; None when checkpointed
    rng: Callable[[], Any]  # enters the task's RNG (the same streams again for a recompute)
    snapshot: Snapshot | None = None  # of a checkpointed forward, for its recompute
    weight_work: WeightWork | None = None  # set by B, consumed by W
    skips_in: dict[str, Tensor] = field(default_factory=dict)  # skip leaves received from other stages
    skips_out: list[Tensor] | None = None  # stashed tensors sent to other stages, graph-attached


@dataclass
class LossSpec:
    """The loss a training step computes on the last stage, per micro-batch.

    Attributes:
        fn: ``fn(output, target) -> scalar tensor``.
        targets: one target per micro-batch (a tensor or tuple, or None).
        weights: the factor of each micro-batch's loss in the mini-batch loss (for a mean
            loss, the micro-batch's share of the samples).
    """

    fn: Callable[[Any, Any], Tensor]
    targets: Sequence[Any]
    weights: Sequence[float]


@dataclass
class StepState:
    """Everything a step's backward phase needs from its forward phase."""

    schedule: Schedule
    caller: CallerState
    step_seed: int
    side: Sequence[Mapping[str, Any]] = ()  # each micro-batch's side inputs (fastpipe.model.side_inputs)
    tasks: dict[tuple[int, int], _Task] = field(default_factory=dict)
    consumed: bool = False
    side_copies: dict[tuple[int, torch.device], Tensor] = field(default_factory=dict)  # per device, once a step
    draws: dict[int, bool] = field(default_factory=dict)  # per stage: may its task draw (see fastpipe.rng.streams)
    deferred: dict[tuple[int, int], Deferred] = field(default_factory=dict)  # split pairs' Linear work, B to W
    unsplit: set[tuple[int, int]] = field(default_factory=set)  # split pairs run combined at B (see feed)
    carried: CarriedRecords | None = None  # deferred work handed from W to W (see wgrad)
    offload: StepOffload = field(default_factory=StepOffload)  # what Fs offloaded, until their P (runtime.offload)


class StepRunner:
    """The action handlers (F, BW, B, W) of one step, over any :class:`Transport`.

    Both runtimes use it: the local one with one thread per worker and a
    :class:`LocalTransport`, a distributed one with one process per worker and a transport
    over torch.distributed. ``stages`` holds only the stages this process runs.
    Every handler returns the time at which its inputs had arrived, so that waiting shows
    as a gap in the timeline, not as work.
    """

    def __init__(
        self,
        stages: Mapping[int, Stage],
        num_stages: int,
        transport: Transport,
        state: StepState,
        *,
        grad: bool,
        checkpoint: Callable[[int], bool],
        loss: LossSpec | None,
    ) -> None:
        self.stages = stages  # the stages this process runs, by index
        self.transport = transport
        self.state = state
        self.grad = grad
        self.checkpoint = checkpoint
        self.loss = loss
        self.last = num_stages - 1
        self.results: dict[int, Value] = {}
        self.input_grads: dict[int, list[Tensor | None]] = {}
        self.param_grads: dict[int, list[Tensor | None]] = {s: [None] * len(st.params) for s, st in stages.items()}
        self.skip_flow = SkipFlow({s: st.skips for s, st in stages.items()}, transport)

    def handlers(self) -> dict[str, Callable[[Action], float]]:
        fetch = self.state.offload.prefetch  # P: copies back what an F offloaded
        return {"F": self.forward, "BW": self.backward, "B": self.backward_input, "W": self.backward_weight, "P": fetch}

    def waits_on(self, action: Action) -> tuple[str, int, int] | None:
        """What ``action`` first receives from another worker: ``("act" | "grad", stage, mb)``.

        None when it needs nothing (a W, or the last stage's backward under a loss).
        """
        s, m = action.stage, action.microbatch
        if action.kind == "F":
            return ("act", s, m)
        if action.kind in ("BW", "B") and not (s == self.last and self.loss is not None):
            return ("grad", s, m)
        return None

    # -- forward --------------------------------------------------------------------

    def feed(self, microbatches: Sequence[Value]) -> None:
        """Deliver the micro-batches to stage 0."""
        # The caller's tensors keep their own requires_grad: the input gradient is only
        # computed where the plain Sequential would compute one.
        flags = [[self.grad and _differentiable(t) and t.requires_grad for t in tensors_of(v)] for v in microbatches]
        # Nobody waits for such a B's gradient: where W follows at once, don't split. Settled
        # before the first send, since stage 0's worker may start its forward at once.
        unsplit = {(0, m) for m, f in enumerate(flags) if not any(f)}
        self.state.unsplit = unsplit & adjacent_pairs(self.state.schedule) if unsplit else set()
        self._batch_weights()
        for m, value in enumerate(microbatches):
            self.transport.send_activation(0, m, value, flags[m])

    def _batch_weights(self) -> None:
        """Which Ws hand their Linear work to a later W (see wgrad.CarriedRecords); the unsplit pairs do none."""
        carry: dict[tuple[int, int], tuple[int, int]] = {}
        for s, stage in self.stages.items():
            if stage.wgrad_batch > 1:
                batches = weight_batches(self.state.schedule, stage.wgrad_batch, frozenset(self.state.unsplit))
                carry.update((key, into) for key, into in batches.items() if key[0] == s)
        self.state.carried = CarriedRecords(carry)

    def _run_module(self, s: int, m: int, inputs: Value) -> Value:
        stage = self.stages[s]
        fuse = torch.is_grad_enabled() and stage.linears
        try:
            value = _fresh(inputs) if stage.clone_input else inputs
            got = self.state.side
            side = side_inputs_on(got[m], stage.side_names, stage.device, self.state.side_copies) if got else {}
            skips = self.skip_flow.stores.get((s, m))
            with self._linears(s, m) if fuse else contextlib.nullcontext(), stage_regions(stage.module):
                out = run_layers(stage.module, value, side, skips) if side or skips is not None else stage.module(value)
        except RuntimeError as exc:
            restated = in_place_on_input(exc, s)
            if restated is None:
                raise
            raise restated from exc
        check_output(out, s)
        if s == self.last and self.loss is not None:
            return checked_loss(self.loss.fn(out, self.loss.targets[m]))
        return out

    def _linears(self, s: int, m: int) -> Any:
        """Route the stage's Linears for task (s, m): summed into ``.grad`` by a combined backward
        (BW), or deferred by B to W (see fastpipe.runtime.wgrad)."""
        if (s, m) not in self.state.schedule.split_pairs or (s, m) in self.state.unsplit:
            return accumulating_linears(self.stages[s].summing)
        store = self.state.deferred.get((s, m))
        if store is None:  # made by the forward (a checkpointed one's replay); B takes it to W
            store = self.state.deferred[(s, m)] = Deferred()
        return accumulating_linears(self.stages[s].linears, store)

    def _task_rng(self, s: int, m: int) -> Callable[[], Any]:
        """What to enter around task (s, m) so that its random ops draw from its own streams.

        Stages that cannot draw skip :class:`TaskRNG`, whose per-op interception costs host
        time (see fastpipe.rng.streams); the choice is kept with the task, so a recompute replays it.
        """
        stage = self.stages[s]
        draws = self.state.draws.get(s)
        if draws is None:  # once a step per stage, not per micro-batch: may_draw walks every module
            loss = self.loss.fn if s == self.last and self.loss is not None else None
            draws = self.state.draws[s] = may_draw(stage.module, loss)
        if not draws:
            return contextlib.nullcontext
        seed = task_seed(self.state.step_seed, s, m)
        watch = {torch.device("cpu"), stage.device}
        return lambda: TaskRNG(seed, watch)

    def forward(self, action: Action) -> float:
        s, m = action.stage, action.microbatch
        inputs, skips_in = self.transport.recv_activation(s, m), self.skip_flow.receive(s, m)
        started = time.perf_counter()
        rng = self._task_rng(s, m)
        keep_graph = self.grad and not self.checkpoint(m)
        replayed = self.grad and not keep_graph  # recomputed in the backward
        snapshot = Snapshot(self.stages[s].module, inputs) if replayed else None
        saving = self.state.offload.saving(self.stages[s], action, keep_graph, self.state.schedule)
        with saving, self.state.caller.enter(grad_enabled=keep_graph), rng():
            out, skips_out = self.skip_flow.run(s, m, skips_in, lambda: self._run_module(s, m, inputs))
        if snapshot is not None:
            snapshot.seal(s, m)
        if self.grad:
            kept = skips_out if keep_graph else None
            self.state.tasks[(s, m)] = _Task(inputs, out if keep_graph else None, rng, snapshot, None, skips_in, kept)
        self.skip_flow.send(s, m, skips_out, self.grad, keep_graph)  # before the activation (see skip_flow)
        if s == self.last:
            self.results[m] = replace_tensors(out, [_kept(t) for t in tensors_of(out)])
        else:
            # Under checkpointing the output has no graph yet, but its recompute will: the
            # consumer must still ask for its input gradient.
            flags = [self.grad and _differentiable(t) and (t.requires_grad or not keep_graph) for t in tensors_of(out)]
            self.transport.send_activation(s + 1, m, out, flags)
        return started

    # -- backward -------------------------------------------------------------------

    def post_output_grads(self, grad_outputs: Sequence[Sequence[Tensor | None]]) -> None:
        """Deliver the gradients of the last stage's outputs (Pipe.forward's backward)."""
        for m, grads in enumerate(grad_outputs):
            self.transport.send_grad(self.last, m, list(grads))

    def _prepare_backward(self, s: int, m: int) -> tuple[_Task, list[tuple[Tensor, Tensor]], list[Tensor], float]:
        """Receive the output gradient, recompute if checkpointed.

        Returns (task, (output, grad) pairs, input leaves, the time the gradient had
        arrived: a recompute is work and shows in the action's bar).
        """
        task = self.state.tasks[(s, m)]
        if s == self.last and self.loss is not None:
            assert task.outputs is None or isinstance(task.outputs, Tensor)
            grads: list[Tensor | None] = [None]  # filled below, once the loss exists
        else:
            grads = self.transport.recv_grad(s, m)
        skip_grads = self.skip_flow.receive_grads(s, m)
        started = time.perf_counter()
        if task.outputs is None:  # checkpointed: replay the forward with the same RNG
            task.outputs = self._replay(s, m, task)
        if s == self.last and self.loss is not None:
            loss = task.outputs
            assert isinstance(loss, Tensor)
            grads = [torch.full_like(loss, self.loss.weights[m])]
        pairs = [(o, g) for o, g in zip(tensors_of(task.outputs), grads) if g is not None and o.requires_grad]
        pairs += self.skip_flow.pairs(task.skips_out, skip_grads)
        leaves = [t for t in [*tensors_of(task.inputs), *task.skips_in.values()] if t.requires_grad]
        return task, pairs, leaves, started

    def _replay(self, s: int, m: int, task: _Task) -> Value:
        """Recompute a checkpointed forward exactly: the same inputs, the same random streams,
        and no side effect applied twice (see fastpipe.runtime.replay)."""
        assert task.snapshot is not None
        with task.snapshot.replaying(s, m), recomputing(), self.state.caller.enter(grad_enabled=True), task.rng():
            out, task.skips_out = self.skip_flow.run(s, m, task.skips_in, lambda: self._run_module(s, m, task.inputs))
        return out

    def _send_input_grads(self, s: int, m: int, task: _Task, leaf_grads: Sequence[Tensor | None]) -> None:
        it = iter(leaf_grads)
        dx = [next(it) if t.requires_grad else None for t in tensors_of(task.inputs)]
        self.skip_flow.send_grads(s, m, task.skips_in, it)  # before the input gradient
        if s == 0:
            self.input_grads[m] = dx
        else:
            self.transport.send_grad(s - 1, m, dx)

    def backward(self, action: Action) -> float:
        """BW: input and weight gradients in one pass.

        Autograd adds each weight gradient into this step's running sum as soon as it is
        produced, the way ``loss.backward()`` accumulates into ``.grad``: the sums are
        swapped into ``p.grad`` for the call (a stage's parameters belong to this worker
        alone). ``torch.autograd.grad`` would instead hold all of a micro-batch's weight
        gradients at once before they are summed, which costs memory and, on a CPU, page
        faults.
        """
        s, m = action.stage, action.microbatch
        task, pairs, leaves, started = self._prepare_backward(s, m)
        params = self.stages[s].params
        leaf_grads: list[Tensor | None] = [None] * len(leaves)
        if pairs and (leaves or params):
            acc = self.param_grads[s]
            saved = [p.grad for p in params]
            try:
                for p, g in zip(params, acc):
                    p.grad = g
                # Linears stay routed as in this micro-batch's forward, so that a recompute
                # inside the backward (torch.utils.checkpoint in the model) saves what the
                # forward saved; hooks see the step's sum (see param_hooks).
                with self._linears(s, m), hooks_set_aside(params), _streams(task):
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs], inputs=[*leaves, *params])
                acc[:] = [p.grad for p in params]
            finally:
                for p, g in zip(params, saved):
                    p.grad = g
            leaf_grads = [t.grad for t in leaves]
        del self.state.tasks[(s, m)], pairs
        self._send_input_grads(s, m, task, leaf_grads)
        return started

    def backward_input(self, action: Action) -> float:
        """B: input gradients now; what the weights need is kept for W."""
        s, m = action.stage, action.microbatch
        if (s, m) in self.state.unsplit:
            return self.backward(action)
        task, pairs, leaves, started = self._prepare_backward(s, m)
        stage = self.stages[s]
        records = self.state.deferred.pop((s, m), None) or Deferred()
        # A recompute inside the backward defers too; the hooks see the step's sum (param_hooks).
        with accumulating_linears(stage.linears, records), hooks_set_aside(stage.params), _streams(task):
            leaf_grads, task.weight_work = backward_inputs(
                [o for o, _ in pairs], [g for _, g in pairs], leaves, stage.params, early=stage.early, records=records
            )
        task.outputs = task.skips_out = None
        self._send_input_grads(s, m, task, leaf_grads)
        return started

    def backward_weight(self, action: Action) -> float:
        """W: the deferred weight gradients of a B that already ran."""
        s, m = action.stage, action.microbatch
        started = time.perf_counter()
        if (s, m) in self.state.unsplit:
            return started
        task = self.state.tasks.pop((s, m))
        work = task.weight_work
        assert work is not None, f"W before B for {action}"
        if self.state.carried is None:  # a rank without stage 0 (never fed) runs its Ws on one thread
            self._batch_weights()
        assert self.state.carried is not None
        work.records = self.state.carried.take((s, m), work.records)
        with hooks_set_aside(self.stages[s].params), _streams(task):
            backward_weights(work, self.param_grads[s])
        return started


install_task_rng_state()


def _streams(task: _Task) -> Any:
    """The task's streams, current but not routing, around its backward: a torch.utils.checkpoint
    recompute there draws from them (fastpipe.rng.state); the backward's own ops pay nothing."""
    rng = task.rng()
    return rng.streams_only() if isinstance(rng, TaskRNG) else contextlib.nullcontext()


def _kept(t: Tensor) -> Tensor:
    """``t`` detached, in a storage of its own size: what the step keeps until it ends.

    A result can be a view into a larger buffer: torch 2.13's ``mse_loss`` returns a 0-d view of
    its input-sized workspace, and keeping it held that buffer for every micro-batch of the step.
    """
    t = t.detach()
    return t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t


def _differentiable(t: Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _fresh(value: Value) -> Value:
    """Copies of the tensors of ``value``, for a first layer that works in place."""
    return replace_tensors(value, [t.clone() for t in tensors_of(value)])
