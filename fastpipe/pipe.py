"""``Pipe``: a drop-in, pipeline-parallel replacement for ``nn.Sequential``."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from fastpipe.amp import loss_scale
from fastpipe.balance import auto_balance
from fastpipe.batchnorm import DeferredBatchNorm, commit_deferred_batch_norm
from fastpipe.microbatch import Value, batch_size, check_value, gather, replace_tensors, scatter, tensors_of
from fastpipe.partition import (
    MOVE_REFUSED,
    Device,
    check_balance,
    check_input,
    check_materialised,
    check_module,
    first_layer_in_place,
    layers_of,
    refuse_device_move,
    resolve_devices,
    split,
)
from fastpipe.rng import draw_step_seed
from fastpipe.runtime.local import LocalRuntime, LossSpec, Stage, StepState
from fastpipe.runtime.param_hooks import accumulate_grads
from fastpipe.runtime.worker import CallerState
from fastpipe.schedule import Schedule
from fastpipe.schedule.builders import build_for
from fastpipe.trace import Timeline

__all__ = ["Pipe", "CHECKPOINT_MODES"]

CHECKPOINT_MODES = ("always", "except_last", "never")
Checkpoint = Literal["always", "except_last", "never"]

def _schedule(name: str, stages: int, microbatches: int, virtual_stages: int) -> Schedule:
    # The messages speak of Pipe's own arguments; build_for checks the rest.
    if virtual_stages < 1 or stages % virtual_stages:
        raise ValueError(
            f"fastpipe: {stages} stages cannot be spread over workers with virtual_stages={virtual_stages}; "
            "len(balance) must be a multiple of virtual_stages"
        )
    if virtual_stages != 1 and name != "interleaved":
        raise ValueError(f"fastpipe: virtual_stages={virtual_stages} only applies to the 'interleaved' schedule")
    return build_for(name, stages, stages // virtual_stages, microbatches)


class Pipe(nn.Module):
    """Wraps an ``nn.Sequential`` to train it with GPipe's micro-batch pipeline.

    The keywords are torchgpipe's, so switching is one import away::

        pipe = Pipe(model, balance=[4, 4], devices=["cuda:0", "cuda:1"], chunks=8)
        out = pipe(x)                 # equals model(x); lives on the last stage's device
        loss_fn(out, y).backward()    # gradients equal model's, on every stage

    Every stage runs in its own worker thread, also when ``devices`` repeats a device,
    so on a CPU K stages use K cores (with ``torch.set_num_threads(1)``). The backward
    of each stage runs in that stage's worker, so stages overlap in backward too.

    Args:
        module: the model; its layers are registered here under their own names, so
            ``pipe.state_dict()`` has the same keys as ``module.state_dict()``.
        balance: number of layers per stage, summing to ``len(module)``.
        devices: one device per stage (may repeat). ``None``: one visible GPU per stage,
            or CPU for every stage when there is no GPU.
        chunks: micro-batches per mini-batch. A batch that does not divide evenly gets a
            smaller last micro-batch; a batch that yields fewer micro-batches runs with
            fewer, with a one-time warning.
        checkpoint: ``"always"``, ``"except_last"`` (all micro-batches but the last are
            recomputed in backward) or ``"never"``. There is no recomputation in ``eval()``.
            Recomputation replays dropout bit for bit: every (stage, micro-batch) draws from
            its own generator, seeded once per step from the caller's generator.
        deferred_batch_norm: replace BatchNorm layers with :class:`DeferredBatchNorm`, whose
            running statistics equal one pass over the whole mini-batch.
        trace: record a :class:`~fastpipe.trace.Timeline` of every step in ``last_timeline``.
        schedule: the default schedule of :meth:`train_step` (``forward`` is always GPipe's,
            since its backward comes later, from autograd).
        virtual_stages: the default stages per worker of the ``"interleaved"`` schedule.
        sample: with ``balance="auto"``: a mini-batch like the ones to come. Each layer's
            forward and backward time and memory are profiled on one micro-batch of it,
            and the planner picks the contiguous split with the least simulated step time
            of ``schedule`` (:func:`fastpipe.balance.plan`).
        memory_limit: with ``balance="auto"``: the most bytes (activations of all
            micro-batches in flight plus parameters, gradients and optimizer state) one
            stage may need.
        process_group, mesh: run one stage per process over ``torch.distributed`` instead
            (launch with ``torchrun``): ``Pipe(...)`` then returns a
            :class:`fastpipe.DistributedPipe`, which keeps only this rank's layers and trains
            with :meth:`~fastpipe.DistributedPipe.train_step` (its extra keywords, e.g.
            ``timeout``, ``on_nan``, ``dp_group``, pass through).

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``, or an argument has the wrong type.
        ValueError: ``balance``, ``devices``, ``chunks`` or ``checkpoint`` is invalid, or a
            parameter/module is shared between two stages.
    """

    def __new__(cls, *args: Any, process_group: Any = None, mesh: Any = None, **kwargs: Any) -> Any:
        """With ``process_group=`` or ``mesh=``: one process per stage, a :class:`DistributedPipe`."""
        if process_group is not None or mesh is not None:
            from fastpipe.distributed_pipe import DistributedPipe

            local_only = sorted(set(kwargs) & {"devices", "trace", "sample", "memory_limit", "virtual_stages"})
            if args[1:2] == ("auto",) or kwargs.get("balance") == "auto":
                local_only.append("balance='auto'")
            if local_only:
                raise TypeError(
                    f"fastpipe: with process_group=/mesh= each rank runs its own stage on its own device, so "
                    f"{', '.join(local_only)} does not apply; give balance as a list, the device with device=, and "
                    "virtual stages by len(balance) = K * v with schedule='interleaved'"
                )
            return DistributedPipe(*args, process_group=process_group, mesh=mesh, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        module: nn.Sequential,
        balance: Sequence[int] | Literal["auto"],
        *,
        devices: Sequence[Device] | None = None,
        chunks: int = 1,
        checkpoint: Checkpoint = "except_last",
        deferred_batch_norm: bool = False,
        trace: bool = False,
        schedule: str = "1f1b",
        virtual_stages: int = 1,
        sample: Value | None = None,
        memory_limit: float | None = None,
        process_group: Any = None,
        mesh: Any = None,
    ) -> None:
        super().__init__()
        module = check_module(module)
        check_materialised(module)
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"fastpipe: chunks must be an int >= 1 (micro-batches per batch), got {chunks!r}")
        if checkpoint not in CHECKPOINT_MODES:
            raise ValueError(f"fastpipe: checkpoint must be one of {CHECKPOINT_MODES}, got {checkpoint!r}")
        if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int):
            raise TypeError(f"fastpipe: virtual_stages must be an int (stages per worker), got {virtual_stages!r}")
        if not isinstance(balance, str):
            unused = [k for k, v in (("sample", sample), ("memory_limit", memory_limit)) if v is not None]
            if unused:
                raise TypeError(f"fastpipe: {' and '.join(unused)} only apply to balance='auto' (they plan the "
                                "balance); drop them, or pass balance='auto'")
        if isinstance(balance, str):
            if balance != "auto":
                raise TypeError(f"fastpipe: balance must be a list of layer counts or 'auto', got {balance!r}")
            balance = auto_balance(module, devices, sample, chunks=chunks, schedule=schedule,
                                   virtual_stages=virtual_stages, memory_limit=memory_limit)
        balance = check_balance(balance, len(module))
        device_list = resolve_devices(devices, len(balance))
        # Fail here, not at the first train_step: the schedule's name and virtual stages (any
        # micro-batch count that is a multiple of the workers satisfies every builder).
        _schedule(schedule, len(balance), max(len(balance) // max(virtual_stages, 1), 1), virtual_stages)
        if deferred_batch_norm:
            module = DeferredBatchNorm.convert(module)  # type: ignore[assignment]

        self.balance = balance
        self.devices = device_list
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.deferred_batch_norm = deferred_batch_norm
        self.trace = trace
        self.schedule = schedule
        self.virtual_stages = virtual_stages
        self.last_timeline: Timeline | None = None

        # Register the layers under their own names (state_dict keys match the
        # Sequential's); the stages are plain lists so they do not register twice.
        for name, layer in layers_of(module):
            self.add_module(name, layer)
        stage_modules = split(module, balance)
        for stage, device in zip(stage_modules, device_list):
            stage.to(device)
        self._stages = [
            Stage(m, d, clone_input=i > 0 and first_layer_in_place(m))
            for i, (m, d) in enumerate(zip(stage_modules, device_list))
        ]
        self._runtime = LocalRuntime(self._stages, recorder=None)
        weakref.finalize(self, self._runtime.close)

    # -- nn.Module surface --------------------------------------------------------------

    def __len__(self) -> int:
        return sum(self.balance)

    def __getitem__(self, index: int) -> nn.Module:
        return list(self._modules.values())[index]  # type: ignore[return-value]  # repeats included

    @property
    def partitions(self) -> list[nn.Sequential]:
        """The stages, in order (each an ``nn.Sequential`` on its device)."""
        return [s.module for s in self._stages]  # type: ignore[misc]

    def to(self, *args: Any, **kwargs: Any) -> Pipe:
        """Dtype changes only (``pipe.to(torch.float64)``); any device, in any form, is refused."""
        refuse_device_move(args, kwargs)
        return super().to(*args, **kwargs)

    def _refuse_move(self, *args: Any, **kwargs: Any) -> Pipe:
        raise TypeError(MOVE_REFUSED)

    cuda = cpu = xpu = ipu = mtia = to_empty = _refuse_move

    def close(self) -> None:
        """Stop the worker threads now (they would stop when the Pipe is collected)."""
        self._runtime.close()

    # -- running ------------------------------------------------------------------------

    def forward(self, input: Value) -> Value:
        """Run the pipeline on a mini-batch; returns the output on the last stage's device.

        Input tensors on another device than the first stage's are copied there (as the
        stages hand activations on), so a CPU batch can feed a GPU pipeline directly.
        """
        check_input(input)
        microbatches = scatter(input, self.chunks)
        params = [p for s in self._stages for p in s.params]
        grad = torch.is_grad_enabled() and (
            any(p.requires_grad for p in params) or any(t.requires_grad for t in tensors_of(input))
        )
        caller = CallerState.capture()
        step_seed = draw_step_seed()
        self._start_timeline(self.trace, len(self._stages))
        schedule = _schedule("gpipe", len(self._stages), len(microbatches), 1)
        count = len(microbatches)
        mode = self.checkpoint if self.training else "never"

        def checkpoint(m: int) -> bool:
            return mode == "always" or (mode == "except_last" and m < count - 1)

        if not grad:
            outputs, _ = self._runtime.forward(
                schedule, microbatches, grad=False, checkpoint=checkpoint, caller=caller, step_seed=step_seed
            )
            self._after_forward()
            return gather(outputs)

        inputs = tensors_of(input)
        run = _Run(self, schedule, microbatches, checkpoint, caller, step_seed, [t.device for t in inputs], params)
        flat = _PipelineFunction.apply(run, *inputs, *params)
        return replace_tensors(run.output_structure, flat)

    def train_step(
        self,
        input: Value,
        target: Any,
        loss_fn: Callable[[Any, Any], Tensor],
        *,
        schedule: str | None = None,
        virtual_stages: int | None = None,
        trace: bool | None = None,
        scaler: torch.amp.GradScaler | None = None,
    ) -> Tensor:
        """Forward and backward of one mini-batch under a schedule; returns the loss.

        The last stage computes ``loss_fn(output, target)`` per micro-batch. The returned
        loss is the mini-batch loss, and the gradients accumulated into ``.grad`` equal
        those of ``loss_fn(model(input), target).backward()``: for a mean-reduced loss
        (``loss_fn.reduction == "mean"`` or no ``reduction`` attribute) each micro-batch
        counts by its share of the samples, so uneven micro-batches are weighted right; for
        ``reduction="sum"`` the micro-batch losses are added. (A mean over something other
        than samples, e.g. cross-entropy with ``ignore_index``, is weighted by samples.)
        The optimizer step is the caller's.

        Args:
            input: the mini-batch (a tensor, or a tuple as for :meth:`forward`).
            target: split along dim 0 like ``input`` (tensor or tuple), or ``None``.
            loss_fn: ``loss_fn(output, target) -> scalar tensor``.
            schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` or ``"zb-h1"``
                (see :mod:`fastpipe.schedule`); default: the Pipe's ``schedule``.
            virtual_stages: stages per worker for ``"interleaved"``; stage ``s`` then runs on
                worker ``s % (len(balance) // virtual_stages)``; default: the Pipe's.
            trace: record the step's timeline in ``last_timeline`` (default: ``self.trace``).
            scaler: a ``torch.amp.GradScaler``: the backward runs on the scaled loss, as
                ``scaler.scale(loss).backward()`` would, and the returned loss is unscaled;
                then ``scaler.step(opt); scaler.update()`` as usual.
        """
        check_input(input)
        if not callable(loss_fn):
            raise TypeError(f"fastpipe: loss_fn must be callable as loss_fn(output, target), got "
                            f"{type(loss_fn).__name__}; e.g. nn.CrossEntropyLoss()")
        microbatches = scatter(input, self.chunks)
        count = len(microbatches)
        targets: list[Any] = [None] * count
        if target is not None:
            check_value(target, "target")
            targets = scatter(target, self.chunks)
            if [batch_size(t, "target") for t in targets] != [batch_size(x) for x in microbatches]:
                raise ValueError(
                    f"fastpipe: target batch size {batch_size(target, 'target')} differs from the input's "
                    f"{batch_size(input)}; give one target row per input row (they are split into "
                    "micro-batches together)"
                )
            # loss_fn runs on the last stage, so the targets go where its output is.
            last = self.devices[-1]
            targets = [replace_tensors(t, [v.to(last) for v in tensors_of(t)]) for t in targets]
        sizes = [batch_size(x) for x in microbatches]
        reduction = getattr(loss_fn, "reduction", "mean")
        if reduction not in ("mean", "sum"):
            raise ValueError(f"fastpipe: loss_fn.reduction={reduction!r}; train_step needs 'mean' or 'sum'")
        weights = [n / sum(sizes) for n in sizes] if reduction == "mean" else [1.0] * count
        sched = _schedule(self.schedule if schedule is None else schedule, len(self._stages), count,
                          self.virtual_stages if virtual_stages is None else virtual_stages)
        self._start_timeline(self.trace if trace is None else trace, sched.num_workers)
        mode = self.checkpoint if self.training else "never"

        def checkpoint(m: int) -> bool:
            return mode == "always" or (mode == "except_last" and m < count - 1)

        scale = loss_scale(scaler, self.devices[-1])
        losses, grads = self._runtime.train(
            sched, microbatches, LossSpec(loss_fn, targets, [w * scale for w in weights]), checkpoint=checkpoint,
            caller=CallerState.capture(), step_seed=draw_step_seed(),
        )
        self._after_forward()
        for stage, stage_grads in zip(self._stages, grads):
            accumulate_grads(stage.params, stage_grads)
        with torch.no_grad():
            return torch.stack([w * loss for w, loss in zip(weights, losses)]).sum()

    def fit(
        self,
        batches: Iterable[tuple[Value, Any]],
        loss_fn: Callable[[Any, Any], Tensor],
        optimizer: torch.optim.Optimizer,
        *,
        consistency: str = "predict",
        scheduler: Any = None,
        max_grad_norm: float | None = None,
        window: int = 8,
        trace: bool | None = None,
    ) -> Any:
        """Train on ``batches`` of ``(input, target)``; each stage steps ``optimizer`` itself.

        Returns an iterator of per-mini-batch losses (a :class:`fastpipe.asynchronous.FitRun`)::

            for loss in tqdm(pipe.fit(loader, nn.CrossEntropyLoss(), opt, consistency="predict")):
                ...

        Mini-batches stream through a 1F1B pipeline without a flush between them (XPipe),
        or Megatron's interleaved 1F1B with ``virtual_stages`` > 1,
        ``window`` at a time; the pipeline drains between windows, which is where
        :func:`fastpipe.save` captures an exact resume point (``run.steps % window == 0``).

        Args:
            batches: an iterable of ``(input, target)``, e.g. a DataLoader.
            loss_fn: as for :meth:`train_step` (mean- or sum-reduced).
            optimizer: one optimizer over the pipe's parameters; stage s steps it with only
                its own gradients, right after its last backward of each mini-batch.
            consistency: ``"sync"`` (flush every mini-batch: equals ``train_step`` then
                ``optimizer.step()``), ``"stale"``, ``"stash"`` or ``"predict"`` (see
                :mod:`fastpipe.asynchronous`).
            scheduler: an ``LRScheduler`` of ``optimizer``, stepped once per mini-batch; every
                stage's update of mini-batch n uses the n-th learning rate. It is stepped a
                window at a time, as the window starts (at a drained point it is exact).
            max_grad_norm: clip each *stage's* gradient norm to this (per stage, not global:
                stages update at different times).
            window: mini-batches between drains.
            trace: record each window's timeline in ``last_timeline``.

        With ``deferred_batch_norm=True``, stage s commits the BatchNorm running statistics
        of mini-batch n at its update of n, from exactly that mini-batch's micro-batches (the
        forwards of mini-batch n + 1 that run before it accumulate apart); under ``"sync"``
        they equal ``train_step``'s. Running statistics are buffers, not parameters, so the
        weight versions of ``"stash"`` and ``"predict"`` do not version them.
        """
        from fastpipe.asynchronous.fit import fit

        return fit(self, batches, loss_fn, optimizer, consistency=consistency, scheduler=scheduler,
                   max_grad_norm=max_grad_norm, window=window, trace=trace)

    def _start_timeline(self, enabled: bool, workers: int) -> None:
        timeline = Timeline(workers) if enabled else None
        self._runtime.recorder = timeline.record if timeline is not None else None
        self.last_timeline = timeline

    def _after_forward(self) -> None:
        if self.deferred_batch_norm and self.training:
            for s in self._stages:
                commit_deferred_batch_norm(s.module)


@dataclass
class _Run:
    """Carries one step's arguments into and out of the autograd Function."""

    pipe: Pipe
    schedule: Schedule
    microbatches: list[Value]
    checkpoint: Callable[[int], bool]
    caller: CallerState
    step_seed: int
    input_devices: list[torch.device]
    params: list[nn.Parameter]
    output_structure: Value = ()
    state: StepState | None = None
    output_sizes: list[int] = field(default_factory=list)


class _PipelineFunction(torch.autograd.Function):
    """The whole pipeline as one autograd node.

    Its backward runs every stage's backward in that stage's worker (see
    :mod:`fastpipe.runtime.local`), instead of letting autograd's single CPU thread walk
    one graph stitched across stages.
    """

    @staticmethod
    def forward(ctx: Any, run: _Run, *tensors: Tensor) -> Any:
        outputs, state = run.pipe._runtime.forward(
            run.schedule, run.microbatches, grad=True, checkpoint=run.checkpoint, caller=run.caller,
            step_seed=run.step_seed,
        )
        run.pipe._after_forward()
        run.microbatches = []  # the state holds what backward needs
        run.state = state
        run.output_sizes = [tensors_of(o)[0].size(0) for o in outputs]
        joined = gather(outputs)
        run.output_structure = joined
        flat = tensors_of(joined)
        ctx.run = run
        ctx.mark_non_differentiable(*[t for t in flat if not (t.is_floating_point() or t.is_complex())])
        return tuple(flat)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: Tensor | None) -> Any:
        run: _Run = ctx.run
        assert run.state is not None
        per_mb: list[list[Tensor | None]] = [[] for _ in run.output_sizes]
        for g in grads:
            pieces = [None] * len(run.output_sizes) if g is None else list(g.split(run.output_sizes, dim=0))
            for m, piece in enumerate(pieces):
                per_mb[m].append(piece)
        # autograd runs this node on the engine thread of its gradients' device; on a
        # device thread the GPU stages' backwards must run here (see runtime.inline).
        on_device_thread = any(g is not None and g.device.type != "cpu" for g in grads)
        input_grads, param_grads = run.pipe._runtime.backward(run.state, per_mb, on_device_thread=on_device_thread)
        flat_params = [g for stage in param_grads for g in stage]
        return (None, *join_input_grads(input_grads, run.input_devices), *flat_params)


def join_input_grads(input_grads: Sequence[Sequence[Tensor | None]],
                     devices: Sequence[torch.device]) -> list[Tensor | None]:
    """One gradient per input tensor, joined over micro-batches, on that input's device.

    Stage 0 computes them on its own device; autograd wants each where its input lives
    (e.g. a CPU batch fed to a pipeline whose first stage is on a GPU).
    """
    joined: list[Tensor | None] = []
    for i, device in enumerate(devices):
        parts = [g for mb in input_grads if (g := mb[i]) is not None]
        joined.append(torch.cat(parts).to(device) if parts and len(parts) == len(input_grads) else None)
    return joined
