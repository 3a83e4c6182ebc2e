"""``Pipe``: a drop-in, pipeline-parallel replacement for ``nn.Sequential``."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn

from fastpipe.asynchronous.fit_run import FitRun
from fastpipe.memory.offload import OffloadSpec, PipeOffload
from fastpipe.memory.optimizer import OptimizerSpec
from fastpipe.memory.planner_pipe import DEFAULT_CHECKPOINT, resolve_settings
from fastpipe.memory.recompute import PipeRecompute
from fastpipe.model.batchnorm import DeferredBatchNorm, commit_deferred_batch_norm
from fastpipe.model.partition import (
    Device,
    check_balance,
    check_input,
    check_materialised,
    check_module,
    first_layer_in_place,
    layers_of,
    refuse_device_move,
    refuse_move,
    refuse_process_group,
    resolve_devices,
    stage_devices,
    warn_unpipelined,
)
from fastpipe.model.side_inputs import check_side_inputs, split_side_inputs
from fastpipe.model.ties import TiedWeights, split_tied
from fastpipe.rng.streams import draw_step_seed
from fastpipe.runtime.autograd_node import NodeRun, PipelineNode
from fastpipe.runtime.options import RuntimeOptions
from fastpipe.runtime.param_hooks import accumulate_grads
from fastpipe.runtime.step import LossSpec, Stage
from fastpipe.runtime.threads import LocalRuntime
from fastpipe.runtime.worker import CallerState
from fastpipe.schedule import Schedule
from fastpipe.step.amp import loss_scale
from fastpipe.step.auto_schedule import AutoRun, AutoSchedule, StepMemory
from fastpipe.step.microbatch import Value, batch_size, gather, replace_tensors, scatter, tensors_of, to_device
from fastpipe.step.recompute_policy import CheckpointSetting, Recompute
from fastpipe.step.rules import (
    CHECKPOINT_MODES,
    check_chunks,
    check_loss_fn,
    microbatch_loss,
    microbatch_weights,
    pipe_auto_schedule,
    pipe_schedule,
    split_targets,
)
from fastpipe.trace.timeline import Timeline

__all__ = ["Pipe", "CHECKPOINT_MODES"]


class Pipe(nn.Module):
    """Wraps an ``nn.Sequential`` to train it with GPipe's micro-batch pipeline.

    The keywords are torchgpipe's, so switching is one import away::

        pipe = Pipe(model, balance=[4, 4], devices=["cuda:0", "cuda:1"], chunks=8)
        out = pipe(x)                 # equals model(x); lives on the last stage's device
        loss_fn(out, y).backward()    # gradients equal model's, on every stage

    Every stage runs in its own worker thread, also when ``devices`` repeats a device (K stages
    use K cores with ``torch.set_num_threads(1)``), its backward too, so stages overlap in both.

    Args:
        module: the model; its layers are registered here under their own names, so
            ``pipe.state_dict()`` has the same keys as ``module.state_dict()``.
        balance: number of layers per stage, summing to ``len(module)``.
        devices: one device per stage (may repeat), or one per worker with ``virtual_stages`` > 1.
            ``None``: one visible GPU per stage, or CPU for every stage when there is no GPU.
        chunks: micro-batches per mini-batch. A batch that does not divide evenly gets a smaller last micro-batch;
            one that yields fewer runs with fewer, warned once. The default, 1, does not pipeline (it warns
            with several workers): pass the number of micro-batches, at least the number of stages.
        checkpoint: what the backward recomputes (docs/memory.md): whole stages, ``"always"``, ``"except_last"``
            (all micro-batches but the last) or ``"never"``; layers, ``fn(index, layer) -> bool``; parts of decoder
            blocks, ``"attention"``/``"mlp"`` or a list; ``"auto"`` (default): the least that fits ``memory_limit``, or
            without one the stage devices' capacity (CUDA; nothing recomputed on host memory), chosen at the first
            ``train_step`` or training ``forward`` of each shape. Nothing in ``eval()``. Recompute replays dropout bit
            for bit: each (stage, micro-batch) has its own generator.
        deferred_batch_norm: BatchNorm layers become :class:`DeferredBatchNorm` (statistics of the whole mini-batch).
        trace: record a :class:`~fastpipe.trace.timeline.Timeline` of every step in ``last_timeline``.
        schedule: the default schedule of :meth:`train_step` (``forward`` is always GPipe's: autograd runs its
            backward). ``"auto"`` or a ``fastpipe.AutoSchedule`` picks one from measured costs (``auto_schedule``).
        virtual_stages: default stages per worker (``"interleaved"``; 2 for ``"zb-v"``, ``"dualpipev"``).
        sample: with ``balance="auto"``: a mini-batch like the ones to come, whose layer
            costs are profiled on one micro-batch; of the splits within 5% of the least
            simulated step time of ``schedule``, the most even (:func:`fastpipe.balance.plan`).
        memory_limit: bytes per device (an int, or ``"24GiB"``): each step's predicted peak must fit
            or ``train_step`` raises before it runs (:mod:`fastpipe.memory.limit`). With ``balance="auto"`` and another
            ``"auto"`` among ``schedule``, ``checkpoint``, ``offload``, one planner chooses them together, the fastest
            combination that fits (``pipe.plan``, :mod:`fastpipe.memory.planner`).
        offload: saved activations kept in host memory from forward to backward (docs/memory.md): a fraction per
            stage, ``fn(index, layer) -> bool``, a list per stage, or ``"auto"`` (the least that fits ``memory_limit``).
        sample_side_inputs: with ``balance="auto"``: the side inputs of ``sample``.
        fused_wgrad: sum plain ``nn.Linear`` weight gradients inside their GEMM (default True), for weights of
            ``wgrad_fuse_min`` elements or more (default 2**17 on CPU, 0 on GPU) outside a split backward.
        wgrad_batch: micro-batches per GEMM of deferred Linear weight gradients (default 2 on CPU, 1 on GPU).
        tune_malloc: on CPU stages, keep freed activations in the process for reuse (default True). Where
            one of these four is None, its ``FASTPIPE_*`` variable is read here (:mod:`fastpipe.runtime.options`).
        optimizer_state: the optimizer state that ``memory_limit`` and the planners count per device: ``"adam"``
            (default), ``"sgd"``, ``"momentum"``, ``"host"`` (a :class:`fastpipe.HostOptimizer`), or bytes per byte.
        process_group, mesh: refused: :class:`fastpipe.DistributedPipe` runs one stage per process (``torchrun``).

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``, or an argument has the wrong type.
        ValueError: ``balance``, ``devices``, ``chunks`` or ``checkpoint`` is invalid.

    A parameter, buffer or module that layers on several stages share (a tied embedding) stays one
    tensor for ``parameters()`` and ``state_dict()``: the other stages read copies, refreshed before
    each step, and its gradient is the sum over all uses (:mod:`fastpipe.model.ties`).
    """

    def __init__(
        self,
        module: nn.Sequential,
        balance: Sequence[int] | Literal["auto"] | None = None,
        *,
        devices: Sequence[Device] | None = None,
        chunks: int = 1,
        checkpoint: CheckpointSetting = DEFAULT_CHECKPOINT,
        deferred_batch_norm: bool = False,
        trace: bool = False,
        schedule: str | AutoSchedule = "1f1b",
        virtual_stages: int = 1,
        sample: Value | None = None,
        memory_limit: float | str | None = None,
        offload: OffloadSpec = None,
        sample_side_inputs: Mapping[str, Any] | None = None,
        fused_wgrad: bool | None = None,
        wgrad_batch: int | None = None,
        tune_malloc: bool | None = None,
        wgrad_fuse_min: int | None = None,
        optimizer_state: OptimizerSpec = "adam",
        process_group: Any = None,
        mesh: Any = None,
    ) -> None:
        super().__init__()
        refuse_process_group(process_group, mesh)
        module = check_module(module)
        check_materialised(module)
        if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int):
            raise TypeError(f"fastpipe: virtual_stages must be an int (stages per worker), got {virtual_stages!r}")
        check_chunks(chunks)
        options = RuntimeOptions.resolve(fused_wgrad=fused_wgrad, wgrad_batch=wgrad_batch, tune_malloc=tune_malloc,
                                         wgrad_fuse_min=wgrad_fuse_min)  # fmt: skip
        given: dict[str, Any] = {"devices": devices, "sample": sample, "memory_limit": memory_limit,
                                 "optimizer": optimizer_state}  # fmt: skip
        settings = resolve_settings(
            module, balance, schedule, checkpoint, offload, chunks=chunks, virtual_stages=virtual_stages,
            side_inputs=sample_side_inputs, wgrad_batch=options.wgrad_batch, **given
        )  # fmt: skip
        self.checkpoint, self.plan = settings.checkpoint, settings.plan
        schedule, virtual_stages, offload = settings.schedule, settings.virtual_stages, settings.offload
        balance = check_balance(settings.balance, len(module))
        device_list = resolve_devices(stage_devices(devices, len(balance), schedule, virtual_stages), len(balance))
        self.auto_schedule = pipe_auto_schedule(schedule, len(balance), virtual_stages, optimizer_state)
        warn_unpipelined(chunks, len(balance), len(balance) // virtual_stages)
        if deferred_batch_norm:
            module = DeferredBatchNorm.convert(module)  # type: ignore[assignment]

        self.balance, self.devices, self.chunks, self.trace = balance, device_list, chunks, trace
        self.deferred_batch_norm, self.schedule, self.virtual_stages = deferred_batch_norm, schedule, virtual_stages
        self.last_timeline: Timeline | None = None

        # The layers under their own names (the Sequential's state_dict keys); stages stay a plain list.
        for name, layer in layers_of(module):
            self.add_module(name, layer)
        stage_modules, ties = split_tied(module, balance)
        for stage, device in zip(stage_modules, device_list):
            stage.to(device)
        self._stages = [Stage(m, d, first_layer_in_place(m), options) for m, d in zip(stage_modules, device_list)]
        self._ties = TiedWeights(ties, [s.params for s in self._stages])
        self._recompute = PipeRecompute(self.checkpoint, self._stages, memory_limit, optimizer_state)
        self.memory_guard = self._recompute.guard
        self._offload = PipeOffload(offload, self._stages, self.memory_guard)
        self._recompute.offload = self._offload  # chosen together under "auto"
        self._runtime = LocalRuntime(self._stages, tune_malloc=options.tune_malloc)
        weakref.finalize(self, self._runtime.close)

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

    cuda = cpu = xpu = ipu = mtia = to_empty = refuse_move

    def train(self, mode: bool = True) -> Pipe:
        """As ``nn.Module.train``; the stages' clones of tied layers follow too."""
        super().train(mode)
        for stage in self._stages:
            stage.module.train(mode)
        return self

    def close(self) -> None:
        """Stop the worker threads now (they would stop when the Pipe is collected)."""
        self._runtime.close()

    def forward(self, input: Value, **side: Any) -> Value:
        """Run the pipeline on a mini-batch; returns the output on the last stage's device.

        Input tensors on another device than the first stage's are copied there (as the
        stages hand activations on), so a CPU batch can feed a GPU pipeline directly.
        Keyword arguments are side inputs (``attention_mask=...``), handed to the layers
        that declare them (:mod:`fastpipe.model.side_inputs`).
        """
        microbatches, side_mbs = self._scatter(input, side)
        params = [p for s in self._stages for p in s.params]
        grad = torch.is_grad_enabled() and (
            any(p.requires_grad for p in params) or any(t.requires_grad for t in tensors_of(input))
        )
        caller = CallerState.capture()
        step_seed = draw_step_seed()
        self.last_timeline = self._runtime.start_timeline(self.trace, len(self._stages))
        schedule = pipe_schedule("gpipe", len(self._stages), len(microbatches), 1)
        checkpoint, schedule = self._recompute.for_forward(self.checkpoint, schedule, microbatches[0], grad)
        if not grad:
            kw: dict[str, Any] = {"checkpoint": checkpoint, "caller": caller, "step_seed": step_seed, "side": side_mbs}
            outputs, _ = self._runtime.forward(schedule, microbatches, grad=False, **kw)
            self._after_forward()
            return gather(outputs)

        inputs = tensors_of(input)
        run = NodeRun(
            self._runtime,
            self._after_forward,
            schedule,
            microbatches,
            checkpoint,
            caller,
            step_seed,
            [t.device for t in inputs],
            side_mbs,
            self._ties.fold,
        )
        flat = PipelineNode.apply(run, *inputs, *params)
        return replace_tensors(run.output_structure, flat)

    def _scatter(self, input: Value, side: dict[str, Any]) -> tuple[list[Value], list[dict[str, Any]]]:
        """The micro-batches and their side inputs; the tied copies brought up to date."""
        check_input(input)
        check_side_inputs([n for s in self._stages for n in s.side_names], side)
        microbatches = scatter(input, self.chunks)
        side_mbs = split_side_inputs(side, batch_size(input), self.chunks, len(microbatches)) if side else []
        self._ties.refresh()
        return microbatches, side_mbs

    def train_step(
        self,
        input: Value,
        target: Any,
        loss_fn: Callable[[Any, Any], Tensor],
        *,
        schedule: str | AutoSchedule | Schedule | None = None,
        virtual_stages: int | None = None,
        trace: bool | None = None,
        scaler: torch.amp.GradScaler | None = None,
        **side: Any,
    ) -> Tensor:
        """Forward and backward of one mini-batch under a schedule; returns the loss.

        The last stage computes ``loss_fn(output, target)`` per micro-batch. The returned
        loss, and the gradients accumulated into ``.grad``, equal those of
        ``loss_fn(model(input), target)``: each micro-batch's loss counts by its share of
        the mini-batch's normaliser, samples for a mean, valid targets for cross-entropy
        with ``ignore_index``, a declared normaliser for :func:`fastpipe.token_loss`
        (:mod:`fastpipe.step.rules`). The optimizer step is the caller's.

        Args:
            input: the mini-batch (a tensor, or a tuple as for :meth:`forward`).
            target: split along dim 0 like ``input`` (tensor or tuple), or ``None``.
            loss_fn: ``loss_fn(output, target) -> scalar tensor``.
            schedule: one of :data:`fastpipe.schedule.SCHEDULES` (``"1f1b"``, ``"zb-v"``, ...) or ``"auto"``;
                or a ``Schedule`` of this pipe's stages and step (IR data, run as given); default: the Pipe's.
            virtual_stages: stages per worker (``"interleaved"``; 2 for ``"zb-v"``, ``"dualpipev"``),
                placed by the schedule; default: the Pipe's.
            trace: record the step's timeline in ``last_timeline`` (default: ``self.trace``).
            scaler: a ``torch.amp.GradScaler``: the backward runs on the scaled loss, as
                ``scaler.scale(loss).backward()`` would, and the returned loss is unscaled;
                then ``scaler.step(opt); scaler.update()`` as usual.
            side: side inputs, as for :meth:`forward`.
        """
        check_loss_fn(loss_fn)
        microbatches, side_mbs = self._scatter(input, side)
        sizes = [batch_size(x) for x in microbatches]
        split = split_targets(target, self.chunks, sizes)
        # Weighed where the caller's targets are (the CPU, usually): no device sync for a count.
        weights = microbatch_weights(loss_fn, split, sizes, "train_step")
        targets = [to_device(t, self.devices[-1]) for t in split]  # where loss_fn runs: the last stage
        memory = StepMemory(getattr(self.memory_guard, "limit", None), self.checkpoint, targets[0], loss_fn)
        sched = pipe_schedule(
            self.schedule if schedule is None else schedule,
            len(self._stages),
            len(sizes),
            self.virtual_stages if virtual_stages is None else virtual_stages,
            AutoRun(self.auto_schedule, self.partitions, microbatches, side_mbs, self._stages[-1].wgrad_batch, memory),
        )
        checkpoint, sched = self._recompute.for_step(self.checkpoint, sched, microbatches[0], targets[0], loss_fn)
        self.last_timeline = self._runtime.start_timeline(self.trace if trace is None else trace, sched.num_workers)
        scale = loss_scale(scaler, self.devices[-1])
        losses, grads = self._runtime.train(
            sched,
            microbatches,
            LossSpec(microbatch_loss(loss_fn, targets), targets, [w * scale for w in weights]),
            checkpoint=checkpoint,
            caller=CallerState.capture(),
            step_seed=draw_step_seed(),
            side=side_mbs,
        )
        self._after_forward()
        for stage, stage_grads in zip(self._stages, self._ties.fold(grads)):
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
        memory_limit: float | str | None = None,
    ) -> Any:
        """Train on ``batches`` of ``(input, target)``; each stage steps ``optimizer`` itself.

        Returns an iterator of per-mini-batch losses (a :class:`fastpipe.asynchronous.FitRun`),
        e.g. ``for loss in tqdm(pipe.fit(loader, nn.CrossEntropyLoss(), opt)): ...``.

        Mini-batches stream through a 1F1B pipeline (interleaved with ``virtual_stages`` > 1)
        without a flush between them (XPipe), ``window`` at a time; the pipeline drains
        between windows, where :func:`fastpipe.save` captures an exact resume point
        (``run.steps % window == 0``). See docs/async.md, also for deferred BatchNorm.

        Args:
            batches: an iterable of ``(input, target)`` or ``(input, target, side_inputs)``.
            loss_fn: as for :meth:`train_step`.
            optimizer: one optimizer over the pipe's parameters; stage s steps it with only
                its own gradients, right after its last backward of each mini-batch.
            consistency: ``"sync"`` (equals ``train_step`` then ``optimizer.step()``),
                ``"stale"``, ``"stash"`` or ``"predict"`` (see :mod:`fastpipe.asynchronous`).
            scheduler: an ``LRScheduler`` of ``optimizer``, stepped once per mini-batch (a
                window at a time); stage updates of mini-batch n use the n-th rate.
            max_grad_norm: clip each *stage's* gradient norm to this (stages update apart).
            window: mini-batches between drains.
            trace: record each window's timeline in ``last_timeline``.
            memory_limit: per device, checked per window (default the pipe's; :mod:`fastpipe.asynchronous.fit_limit`).
        """
        kw: dict[str, Any] = {"scheduler": scheduler, "max_grad_norm": max_grad_norm, "window": window, "trace": trace}
        return FitRun(self, batches, loss_fn, optimizer, consistency=consistency, memory_limit=memory_limit, **kw)

    @property
    def runtime(self) -> LocalRuntime:
        """The thread driver that runs this pipe's schedules (its ``stages`` are the pipe's)."""
        return self._runtime

    @property
    def checkpoint_chosen(self) -> str | Recompute | None:
        """What the last step recomputed: ``checkpoint``, or what ``"auto"`` chose (None before its first step)."""
        return self._recompute.chosen

    @property
    def ties(self) -> TiedWeights:
        """The tensors that layers on several stages share, and the stages' copies of them."""
        return self._ties

    @property
    def num_workers(self) -> int:
        """Worker threads: one per stage, or per ``virtual_stages`` stages (placed by the schedule)."""
        return len(self.balance) // self.virtual_stages

    def _after_forward(self) -> None:
        self._ties.check_constant()
        if self.deferred_batch_norm and self.training:
            for s in self._stages:
                commit_deferred_batch_norm(s.module)
