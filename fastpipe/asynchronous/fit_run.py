"""``Pipe.fit``: a training loop that owns the optimizer step, synchronous or asynchronous.

The loop reads (input, target) mini-batches, runs them through a stream schedule
(:mod:`fastpipe.schedule.multistep`) in windows of ``window`` mini-batches, and yields each
mini-batch's loss. Inside a window there is no flush (except under ``sync``); between
windows the pipeline drains, so every window boundary is a point where the weights and the
optimizer state are complete: :func:`fastpipe.save` there, and a run resumed from the file
continues exactly (see :class:`FitRun`). A window costs one fill-and-drain bubble, so the
asynchronous gain over sync 1F1B at K stages and M micro-batches is at most
(N·(M+K-1)) / (N·M+K-1) for a window of N mini-batches: 1.21x at K=2, M=4, N=8.
"""

from __future__ import annotations

import threading
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn

from fastpipe.asynchronous.fit_limit import FitMemoryGuard
from fastpipe.asynchronous.host_steps import check_fit_predictable, device_groups, predict_stage
from fastpipe.asynchronous.runner import MultistepRunner
from fastpipe.asynchronous.weights import POLICIES, Predictor, StageWeights
from fastpipe.asynchronous.window import Split, Window, side_of
from fastpipe.model.side_inputs import check_side_inputs, split_side_inputs
from fastpipe.rng.streams import draw_step_seed
from fastpipe.runtime.param_hooks import accumulate_grads
from fastpipe.runtime.step import LossSpec, Stage, StepState
from fastpipe.runtime.transport import Transport
from fastpipe.runtime.worker import CallerState
from fastpipe.schedule import Schedule
from fastpipe.schedule.multistep import build_multistep, update_lag, weight_versions
from fastpipe.step.microbatch import Value, batch_size, check_value, scatter, to_device
from fastpipe.step.rules import checkpoint_predicate, microbatch_loss, microbatch_weights, split_targets

__all__ = ["FitRun", "RunnerFactory", "Window", "fit"]

RunnerFactory = Callable[[Mapping[int, Stage], int, Transport, StepState], MultistepRunner]


class FitRun(Iterator[Tensor]):
    """The iterator :meth:`fastpipe.Pipe.fit` returns: one detached loss per mini-batch.

    Losses arrive a window at a time (the window runs, then its losses are yielded). When
    ``steps % window == 0`` between two losses, no work is in flight: the pipe and the
    optimizer hold the state after exactly ``steps`` updates, which is when to save.

    With :class:`~fastpipe.DeferredBatchNorm` layers (``deferred_batch_norm=True``), stage
    s commits the running statistics of mini-batch n at its update of n, from exactly that
    mini-batch's micro-batches, even where the stream has already run forwards of the next
    one; under ``sync`` they equal ``train_step``'s. The running statistics are buffers, so
    ``stash`` and ``predict`` do not version them: a forward in training mode normalises
    with its micro-batch's own statistics and never reads them.

    Attributes:
        steps: mini-batches whose loss has been yielded.
        weight_copy_bytes: per stage (this process's), the most bytes of weight copies (stashed or
            predicted versions) held at once so far; 0 for ``sync`` and ``stale``.
        weight_copy_bound: per stage, the same read from the schedule (the most copies the
            window's stream needs at once, times the stage's parameter bytes).
        memory_guard: the :class:`~fastpipe.asynchronous.fit_limit.FitMemoryGuard` of ``memory_limit``
            (``fit``'s, else the pipe's), whose ``last`` is the last window's prediction; or None.
    """

    def __init__(
        self,
        pipe: nn.Module,
        batches: Iterable[tuple[Value | None, Any]],
        loss_fn: Callable[[Any, Any], Tensor],
        optimizer: torch.optim.Optimizer,
        *,
        consistency: str,
        scheduler: Any,
        max_grad_norm: float | None,
        window: int,
        trace: bool | None,
        memory_limit: int | float | str | None = None,
    ) -> None:
        if consistency not in POLICIES:
            raise ValueError(f"fastpipe: consistency must be one of {POLICIES}, got {consistency!r}")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"fastpipe: window must be an int >= 1 (mini-batches per drain), got {window!r}")
        ties = getattr(pipe, "ties", None)
        tied_params = [t for t in ties or () if t.is_parameter]
        if tied_params:
            tie = tied_params[0]
            raise ValueError(
                f"fastpipe: fit steps each stage's optimizer on its own, so it cannot keep '{tie.name}' (stage "
                f"{tie.owner_stage}) and its use '{tie.reader_name}' (stage {tie.reader_stage}) tied; train with "
                "train_step and optimizer.step(), or put the tied uses in one stage through balance"
            )
        if ties:
            ties.refresh()  # constant buffers (rotary tables): copied once, they stay right for the run
        stages: Any = cast(Any, pipe).runtime.stages  # a list (threads) or a dict of this rank's (distributed)
        self.stages: dict[int, Stage] = dict(enumerate(stages)) if isinstance(stages, list) else dict(stages)
        self.num_stages = len(pipe.balance)  # type: ignore[arg-type]
        self.num_workers: int = pipe.num_workers  # type: ignore[assignment]
        self.chunks: int = pipe.chunks  # type: ignore[assignment]
        self.checkpoint_mode: str = pipe.checkpoint  # type: ignore[assignment]
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"fastpipe: max_grad_norm must be > 0 or None, got {max_grad_norm!r}")
        if scheduler is not None and not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
            raise TypeError(
                f"fastpipe: scheduler must be a torch.optim.lr_scheduler.LRScheduler stepped once per mini-batch, "
                f"got {type(scheduler).__name__} (ReduceLROnPlateau needs a metric: step it yourself between windows)"
            )
        if scheduler is not None and scheduler.optimizer is not optimizer:
            raise ValueError("fastpipe: the scheduler drives another optimizer than the one given to fit")
        if consistency == "predict":
            check_fit_predictable(optimizer)
        owned = {id(p) for st in self.stages.values() for p in st.params}
        foreign = [i for g in device_groups(optimizer) for i, p in enumerate(g) if id(p) not in owned]
        if foreign:
            raise ValueError(
                f"fastpipe: the optimizer holds parameters that are not trainable parameters of this "
                f"pipe (positions {foreign[:5]}); fit steps the pipe's stages one at a time"
            )
        self.pipe = pipe
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.consistency = consistency
        self.scheduler = scheduler
        self.max_grad_norm = max_grad_norm
        self.window = window
        self.trace = trace
        guard = getattr(pipe, "memory_guard", None)
        limit = getattr(guard, "limit", None) if memory_limit is None else memory_limit
        source = getattr(guard, "source", None) if memory_limit is None else None
        self.memory_guard = None if limit is None else FitMemoryGuard(limit, source)
        self.steps = 0
        self.weight_copy_bytes = {s: 0 for s in self.stages}
        self.weight_copy_bound = {s: 0 for s in self.stages}
        self._batches = batches
        # Per stage, spare weight copies reused window after window (see asynchronous.weights).
        self._pools: dict[int, list[list[Tensor]]] = {s: [] for s in self.stages}
        self._it = iter(batches)
        self._held: Split | None = None
        # The side inputs that some layer takes: a local pipe's own, every rank's for a distributed one.
        self.side_names: list[str] = list(
            dict.fromkeys(
                getattr(pipe, "_side_names", None) or [n for st in self.stages.values() for n in st.side_names]
            )
        )
        self._pending: deque[Tensor] = deque()
        self._lock = threading.Lock()  # one stage steps the shared optimizer at a time
        self._group_index = {id(p): i for i, g in enumerate(device_groups(optimizer)) for p in g}
        for p in pipe.parameters():
            p.grad = None  # the loop owns the gradients, as after optimizer.zero_grad()

    def __iter__(self) -> FitRun:
        return self

    def __len__(self) -> int:
        return len(self._batches)  # type: ignore[arg-type]

    def __next__(self) -> Tensor:
        if not self._pending:
            self._run_window()
        self.steps += 1
        return self._pending.popleft()

    # -- one window -----------------------------------------------------------------

    def _factors(self, targets: Sequence[Any], sizes: Sequence[int]) -> list[float]:
        """Each micro-batch's factor in its mini-batch's loss (see :func:`fastpipe.step.rules.microbatch_weights`)."""
        return microbatch_weights(self.loss_fn, targets, sizes, "fit")

    def _split(self, item: Any, need_input: bool = True) -> Split:
        """(micro-batches, targets, sizes, side inputs) of one mini-batch."""
        x, y, side = self._unpack(item)
        if not need_input:  # the last rank of a DistributedPipe: the sizes come from the target
            targets = split_targets(y, self.chunks, None)
            sizes = [batch_size(t, "target") for t in targets]
            return [], targets, sizes, self._split_side(side, sizes)
        check_value(x, "input")
        mbs = scatter(x, self.chunks)
        sizes = [batch_size(v) for v in mbs]
        return mbs, split_targets(y, self.chunks, sizes), sizes, self._split_side(side, sizes)

    def _unpack(self, item: Any) -> tuple[Any, Any, Mapping[str, Any]]:
        """``(input, target)`` or ``(input, target, side_inputs)`` (a mapping, as ``train_step``'s keywords)."""
        if not isinstance(item, (tuple, list)) or len(item) not in (2, 3):
            raise TypeError(
                f"fastpipe: fit expects batches of (input, target) or (input, target, side_inputs), got "
                f"{type(item).__name__}{f' of {len(item)} items' if isinstance(item, (tuple, list)) else ''}"
            )
        side = item[2] if len(item) == 3 else {}
        if not isinstance(side, Mapping) or not all(isinstance(k, str) for k in side):
            raise TypeError(
                "fastpipe: the third item of a fit batch holds the side inputs by name, e.g. "
                f"{{'attention_mask': mask}}; got {type(side).__name__}"
            )
        check_side_inputs(self.side_names, side)
        return item[0], item[1], side

    def _split_side(self, side: Mapping[str, Any], sizes: Sequence[int]) -> list[dict[str, Any]]:
        """Each micro-batch's side inputs, split like the input (see :mod:`fastpipe.model.side_inputs`)."""
        return split_side_inputs(dict(side), sum(sizes), self.chunks, len(sizes)) if side else [{} for _ in sizes]

    def _gather(self) -> Window | None:
        """The next window's mini-batches: as many as ``window`` with the same number of micro-batches."""
        group: list[Split] = []
        while len(group) < self.window:
            if self._held is not None:
                item, self._held = self._held, None
            else:
                try:
                    item = self._split(next(self._it))
                except StopIteration:
                    break
            if group and len(item[0]) != len(group[0][0]):
                self._held = item  # a mini-batch with fewer micro-batches starts its own window
                break
            group.append(item)
        if not group:
            return None
        return Window(
            len(group),
            len(group[0][0]),
            draw_step_seed(),
            [v for mbs, *_ in group for v in mbs],
            [t for _, ts, *_ in group for t in ts],
            [n for _, _, sz, _ in group for n in sz],
            [f for _, ts, sz, _ in group for f in self._factors(ts, sz)],
            side_of(group),
        )

    def _lr_table(self, n: int) -> list[list[float]]:
        """The learning rate of every param group at each of the window's ``n`` updates."""
        table = []
        for _ in range(n):
            table.append([g["lr"] for g in self.optimizer.param_groups])
            if self.scheduler is not None:
                with warnings.catch_warnings():
                    # Stepping ahead of the optimizer is the point here: each update reads its lr from the table.
                    warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)`")
                    self.scheduler.step()
        return table

    def _run_window(self) -> None:
        window = self._gather()
        if window is None:
            for pool in self._pools.values():
                pool.clear()
            raise StopIteration
        if self.memory_guard is not None:
            self.memory_guard.check(self, window)
        last = self.stages.get(self.num_stages - 1)
        if last is not None:  # the loss runs where the last stage's output is (weighed on the host first)
            window.targets = [to_device(t, last.device) for t in window.targets]
        m, n = window.microbatches, window.minibatches
        schedule = build_multistep(self.num_stages, m, n, flush=self.consistency == "sync", workers=self.num_workers)
        lags = update_lag(schedule)
        lrs = self._lr_table(n)
        weights = {s: self._stage_weights(s, {i: lags[(s, i)] for i in range(m * n)}, m, lrs) for s in self.stages}
        bound = weight_versions(schedule)[self.consistency]
        for s, st in self.stages.items():
            nbytes = sum(p.numel() * p.element_size() for p in st.params)
            self.weight_copy_bound[s] = max(self.weight_copy_bound[s], bound[s] * nbytes)
        mode = self.checkpoint_mode if self.memory_guard is None else self.memory_guard.checkpoint
        checkpoint = checkpoint_predicate(mode, self.pipe.training, m)  # type: ignore[arg-type]

        made: list[MultistepRunner] = []

        def make_runner(
            stages: Mapping[int, Stage], num_stages: int, transport: Transport, state: StepState
        ) -> MultistepRunner:
            made.append(
                MultistepRunner(
                    stages,
                    num_stages,
                    transport,
                    state,
                    checkpoint=checkpoint,
                    loss=LossSpec(microbatch_loss(self.loss_fn, window.targets), window.targets, window.factors),
                    weights=weights,
                    minibatch_size=m,
                    apply_update=lambda s, i, grads: self._apply(s, grads, lrs[i]),
                )
            )
            return made[-1]

        try:
            losses = self._execute(cast(Any, self.pipe)._offload.prefetch(schedule), window, make_runner)
        except BaseException:
            for runner in made:  # the statistics of mini-batches whose update never ran
                runner.discard_norm_stats(n)
            raise
        for s, w in weights.items():
            self.weight_copy_bytes[s] = max(self.weight_copy_bytes[s], w.peak_copy_bytes)
        self._pending.extend(losses)

    def _execute(self, schedule: Schedule, window: Window, make_runner: RunnerFactory) -> list[Tensor]:
        """Run one window on the local runtime; returns each mini-batch's loss."""
        pipe: Any = self.pipe
        runtime = pipe.runtime
        runner = make_runner(
            self.stages,
            self.num_stages,
            runtime.transport(),
            StepState(schedule, CallerState.capture(), window.seed, window.side),
        )
        pipe.last_timeline = runtime.start_timeline(pipe.trace if self.trace is None else self.trace, self.num_stages)
        runner.feed(window.inputs)
        try:
            runtime.execute(schedule, ("F", "BW", "U", "P"), runner, "fit")
        finally:
            runner.state.tasks.clear()
        return window.losses(runner.results)

    # -- the optimizer, one stage at a time --------------------------------------------

    def _apply(self, stage: int, grads: Sequence[Tensor | None], lrs: list[float]) -> None:
        """The optimizer step of one stage: its gradients in, clip (per stage), step, out."""
        params = self.stages[stage].params
        groups = self.optimizer.param_groups
        with self._lock:
            accumulate_grads(params, grads)  # parameter hooks see the mini-batch's gradient once
            if self.max_grad_norm is not None:
                self._clip([p for p in params if p.grad is not None], self.max_grad_norm)
            current = [g["lr"] for g in groups]
            try:
                for g, lr in zip(groups, lrs):
                    g["lr"] = lr
                self.optimizer.step()  # only this stage's parameters hold a gradient
            finally:
                for g, lr in zip(groups, current):
                    g["lr"] = lr
                for p in params:
                    p.grad = None

    def _clip(self, params: list[nn.Parameter], max_norm: float) -> None:
        """Scale one stage's gradients to a norm of at most ``max_norm`` (``max_grad_norm``)."""
        torch.nn.utils.clip_grad_norm_(params, max_norm)

    def _stage_weights(self, stage: int, lags: dict[int, int], m: int, lrs: list[list[float]]) -> StageWeights:
        """Who chooses the weights of ``stage``'s micro-batches in one window (``lags`` per micro-batch)."""
        params = self.stages[stage].params
        return StageWeights(params, self.consistency, lags, m, self._predictor(params, lrs), self._pools[stage])

    def _predictor(self, params: list[nn.Parameter], lrs: list[list[float]]) -> Predictor:
        optimizer, index = self.optimizer, self._group_index

        def predict(version: int, lag: int, out: Sequence[Tensor] | None) -> list[Tensor]:
            # Ŵ = W - Σ_{u=version}^{version+lag-1} lr_u · Δ: XPipe's W - lr·s·Δ (arXiv 1911.04610),
            # with PipeOptim's optimizer-specific Δ (arXiv 2312.00839) and the scheduler's own lrs.
            totals = [
                sum(row[index[id(p)]] for row in lrs[version : version + lag]) if id(p) in index else 0.0
                for p in params
            ]
            return predict_stage(optimizer, params, totals, out)

        return predict


def fit(
    pipe: Any,
    batches: Iterable[tuple[Value | None, Any]],
    loss_fn: Callable[[Any, Any], Tensor],
    optimizer: torch.optim.Optimizer,
    *,
    consistency: str = "predict",
    scheduler: Any = None,
    max_grad_norm: float | None = None,
    window: int = 8,
    trace: bool | None = None,
    memory_limit: int | float | str | None = None,
) -> FitRun:
    """Train ``pipe`` on ``batches``: the same as ``pipe.fit(...)``.

    ``pipe`` is a :class:`fastpipe.Pipe` (a :class:`FitRun` comes back) or a
    :class:`fastpipe.DistributedPipe` (a
    :class:`~fastpipe.asynchronous.distributed.DistributedFitRun`). See
    :meth:`fastpipe.Pipe.fit` for the arguments.
    """
    if not callable(getattr(pipe, "fit", None)):
        raise TypeError(f"fastpipe: fit trains a fastpipe.Pipe or DistributedPipe, got {type(pipe).__name__}")
    run: FitRun = pipe.fit(
        batches,
        loss_fn,
        optimizer,
        consistency=consistency,
        scheduler=scheduler,
        max_grad_norm=max_grad_norm,
        window=window,
        trace=trace,
        **({} if memory_limit is None else {"memory_limit": memory_limit}),
    )
    return run
