"""What asynchronous ``fit`` holds on each device, and its predicted peak.

``fit`` runs a window of N mini-batches of M micro-batches as one stream schedule
(:func:`fastpipe.schedule.multistep.build_multistep`). Besides what a ``train_step`` holds
(:func:`fastpipe.memory.model.predict_memory`), a device holds:

* the weight copies of the consistency policy (:func:`weight_copy_bytes`): stashed versions or
  predictions, kept in a pool for the run, so they stay allocated between windows;
* one gradient sum per stage and mini-batch, freed by the stage's update ``U``;
* while a ``U`` runs, the temporaries of its optimizer step (:func:`update_temporaries`);
* with the tag-matched transport of a :class:`~fastpipe.DistributedPipe` (gloo), a receive
  buffer per value and micro-batch of the window, posted at its start and kept for the next
  one; a stage's input is a view of its buffer. The order-matched transport (NCCL) keeps only
  the headers and receives each payload into a fresh buffer (:func:`receive_buffer_bytes`).

:func:`fit_devices` sums it all on the stream's timeline.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fastpipe.asynchronous.weights import POLICIES
from fastpipe.memory.model import DeviceMemory, OptimizerSpec, StageBytes, predict_memory
from fastpipe.memory.receive_buffers import TRANSPORTS, buffered_stages, receive_buffer_bytes
from fastpipe.schedule.ir import Schedule
from fastpipe.schedule.multistep import build_multistep, weight_versions

__all__ = ["TRANSPORTS", "fit_devices", "receive_buffer_bytes", "update_temporaries", "weight_copy_bytes"]


def weight_copy_bytes(pipe: Any, chunks: int | None = None) -> dict[str, dict[int, int]]:
    """Per policy, per stage: the most bytes of weight copies ``fit`` holds at once in steady state.

    ``stash`` keeps the versions that updates superseded while micro-batches that ran on
    them are in flight (at most K versions with the live one), ``predict`` one predicted copy
    per (mini-batch, version seen) in flight with a lag, ``sync`` and ``stale`` none (see
    :func:`fastpipe.schedule.multistep.weight_versions`). Counted for this process's stages
    (all of them for a :class:`fastpipe.Pipe`); optimizer state is never copied.

    Args:
        pipe: a :class:`fastpipe.Pipe` or :class:`fastpipe.DistributedPipe`.
        chunks: micro-batches per mini-batch; default the pipe's ``chunks``.
    """
    stages: Any = pipe.runtime.stages  # a list (threads) or a dict of this rank's (distributed)
    owned = dict(enumerate(stages)) if isinstance(stages, list) else dict(stages)
    k = len(pipe.balance)
    m = pipe.chunks if chunks is None else chunks
    workers: int = pipe.num_workers
    n = k + 2  # K + 2 mini-batches reach steady state
    while (n * m) % workers:  # the interleaved order needs a multiple of the workers
        n += 1
    versions = weight_versions(build_multistep(k, m, n, flush=False, workers=workers))
    sizes = {s: sum(p.numel() * p.element_size() for p in st.params) for s, st in owned.items()}
    return {policy: {s: versions[policy][s] * sizes[s] for s in owned} for policy in POLICIES}


class _Allocations(TorchDispatchMode):
    """Meta-device bytes that the ops run under it allocate and still hold, and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.alive: dict[int, int] = {}
        self.now = self.peak = 0

    def _freed(self, key: int) -> None:
        self.now -= self.alive.pop(key)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        given = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, Tensor) or t.device.type != "meta":
                continue
            storage = t.untyped_storage()  # one Python object per storage while it lives
            key = id(storage)
            if key in given or key in self.alive or not storage.nbytes():
                continue  # an in-place result or a view of something that exists
            self.alive[key] = storage.nbytes()
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now)
            weakref.finalize(storage, self._freed, key)
        return out


def _meta_leaf(p: Tensor) -> Tensor:
    shadow = torch.empty_strided(p.size(), p.stride(), dtype=p.dtype, device="meta").requires_grad_(True)
    shadow.grad = torch.empty_strided(p.size(), p.stride(), dtype=p.dtype, device="meta")
    return shadow


def update_temporaries(
    optimizer: torch.optim.Optimizer, params: Iterable[Tensor], max_grad_norm: float | None = None
) -> int:
    """Bytes one step of ``optimizer`` over ``params`` holds at its peak above what it starts and ends with.

    This is what a stage's update ``U`` in ``fit`` adds to its device while it runs: for torch's
    Adam on CPU (one parameter at a time) two temporaries of the largest parameter and the
    previous one's, three with L2 weight decay; for the foreach Adam of GPUs one temporary of
    every parameter at once; for SGD with momentum none, or one per parameter with weight decay.

    The step is replayed on meta tensors of the parameters' shapes, dtypes and strides (nothing
    is allocated), by an optimizer of the same class and per-group settings, its foreach choice
    resolved as for the real parameters: once to create the state, then once more (after
    ``clip_grad_norm_`` when ``max_grad_norm`` is set, as ``fit`` clips) under a dispatch mode
    that follows each storage an op makes until it is freed. A fused group holds nothing (its
    kernel updates in place); a capturable one is replayed as not capturable (the difference is
    one-element step tensors). Where the replay fails (an optimizer that reads values, or
    whose constructor takes other arguments), the answer is the parameters' bytes: one
    temporary of each at once, as foreach Adam holds.

    Args:
        optimizer: the optimizer ``fit`` steps.
        params: the stage's parameters; those the optimizer does not hold count nothing.
        max_grad_norm: ``fit``'s ``max_grad_norm``.
    """
    from torch.optim.optimizer import _default_to_fused_or_foreach

    mine = {id(p) for p in params}
    groups, held = [], 0
    for group in optimizer.param_groups:
        real = [p for p in group["params"] if id(p) in mine]
        held += sum(p.numel() * p.element_size() for p in real)
        if not real or group.get("fused"):
            continue
        options = {k: v for k, v in group.items() if k != "params"}
        if "foreach" in options and options["foreach"] is None:
            options["foreach"] = _default_to_fused_or_foreach(real, False, False)[1]
        if options.get("capturable"):
            options["capturable"] = False
        groups.append({**options, "params": [_meta_leaf(p) for p in real]})
    if not groups:
        return 0
    try:
        kind: Any = type(optimizer)  # its own constructor, whose signature Optimizer's does not tell
        shadow = kind(groups)
        shadow.step()  # the state that the real optimizer's earlier steps made
        with _Allocations() as tracked:
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_([p for g in groups for p in g["params"]], max_grad_norm)
            shadow.step()
    except Exception:  # noqa: BLE001 - any optimizer that cannot run on meta tensors gets the bound
        return held
    return max(0, tracked.peak - max(0, tracked.now))


def fit_devices(
    stages: Sequence[StageBytes],
    *,
    microbatches: int,
    minibatches: int,
    consistency: str = "predict",
    checkpoint: str = "never",
    optimizer: OptimizerSpec = None,
    update_transient: int | Sequence[int] = 0,
    workers: int | None = None,
    transport: str = "local",
    skips: Sequence[tuple[int, int, float]] = (),
    first_input: bool = False,
    window_bytes: int | Sequence[int] = 0,
    prefetch: Callable[[Schedule], Schedule] | None = None,
) -> list[DeviceMemory]:
    """The predicted peak of each device over one window of ``fit``, by part.

    Args:
        stages: each stage's bytes (:func:`fastpipe.memory.stage_bytes.measure_stages`).
        microbatches: micro-batches per mini-batch (the pipe's ``chunks``).
        minibatches: mini-batches per window (``fit``'s ``window``).
        consistency: ``fit``'s consistency policy.
        checkpoint: the pipe's checkpoint mode.
        optimizer: its state per parameter byte (:func:`fastpipe.memory.model.optimizer_factor`).
        update_transient: per stage (or one for all), what its optimizer step holds while it
            runs (:func:`update_temporaries`).
        workers: devices (default one per stage; fewer with virtual stages).
        transport: one of :data:`TRANSPORTS`.
        skips: skips that cross stages, ``(producer, consumer, bytes)``.
        first_input: whether stage 0's input micro-batches are copies made on its device.
        window_bytes: per stage (or one for all), bytes its device holds for the whole window
            besides (the targets ``fit`` moves to the last stage's device), counted with the
            receive buffers.
        prefetch: the pipe's offload: the window's stream with its ``P`` actions, as ``fit`` runs it
            (``stages`` then say what each offloads); None: nothing offloaded.

    Raises:
        ValueError: an unknown policy, checkpoint mode or transport, or a list of the wrong length.
        fastpipe.schedule.ScheduleError: the stream cannot be ordered on ``workers``.
    """
    if consistency not in POLICIES:
        raise ValueError(f"fastpipe: consistency must be one of {POLICIES}, got {consistency!r}")
    k = len(stages) if workers is None else workers
    schedule = build_multistep(len(stages), microbatches, minibatches, flush=consistency == "sync", workers=k)
    if prefetch is not None:
        schedule = prefetch(schedule)
    kept = receive_buffer_bytes(schedule, stages, transport, skips)
    extra = [window_bytes] * len(stages) if isinstance(window_bytes, int) else list(window_bytes)
    if len(extra) != len(stages):
        raise ValueError(f"fastpipe: window_bytes must be one int or {len(stages)} of them; got {window_bytes!r}")
    stages = buffered_stages(schedule, stages, transport)  # a received input is a view of its buffer
    return predict_memory(
        schedule,
        stages,
        checkpoint=checkpoint,
        optimizer=optimizer,
        skips=skips,
        skip_buffers=transport == "tags",
        first_input=first_input,
        weight_policy=consistency,
        receive_buffers=[a + b for a, b in zip(kept, extra)],
        update_transient=update_transient,
    )
