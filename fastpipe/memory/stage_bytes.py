"""Measuring what each stage holds for one micro-batch, by running it as the step runner does.

:func:`measure_stages` cuts the model as a pipe would (ties become reader copies,
:func:`fastpipe.model.ties.split_tied`) and runs each stage on one micro-batch with the
runtime's own split backward: Linears routed through
:class:`~fastpipe.runtime.wgrad.DeferringLinear`, vector parameters taken early, ``B`` by
:func:`~fastpipe.runtime.split_backward.backward_inputs`. It then counts storages, each once,
parameters left out:

* after the forward: the input, the tensors autograd saved (a ``saved_tensors_hooks`` holder
  per tensor, alive until autograd frees it) and the output, or, where more, every byte the
  forward left alive (``torch.utils.checkpoint`` keeps its inputs past the hooks);
* after ``B``: the deferred Linear records (``x``, ``dy``), and what else is still alive: saved
  tensors of a retained graph, the outputs ``W`` keeps, gradients ``B`` took early.

For the MLP ``Linear(256, 1024) · GELU · Linear(1024, 256)`` on 512 fp32 rows that is 4.50 MiB
saved in the forward (0.5 input, 2 + 2 hidden) and 5.00 MiB of records after ``B`` (per Linear
its input and output gradient: 0.5 + 2, 2 + 0.5). Skips are left out of both (counted apart).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from fastpipe.memory.accounting import PeakMeter
from fastpipe.memory.model import StageBytes
from fastpipe.memory.saved_bytes import Saved, storage_bytes, storages
from fastpipe.model.side_inputs import run_layers
from fastpipe.model.skips import SkipStore, has_skips
from fastpipe.model.ties import split_tied
from fastpipe.runtime.options import fuse_min_on
from fastpipe.runtime.selective import checkpointed, stage_early
from fastpipe.runtime.split_backward import backward_inputs, backward_weights
from fastpipe.runtime.wgrad import Deferred, accumulating_linears, fusable_linears, summing_linears
from fastpipe.step.microbatch import Value, replace_tensors, tensors_of
from fastpipe.step.recompute_policy import Recompute

__all__ = ["measure_stages"]


def _received(t: Tensor, grad: bool) -> Tensor:
    """A tensor as a stage receives it: a fresh leaf of its own size."""
    return t.detach().clone().requires_grad_(grad and (t.is_floating_point() or t.is_complex()))


def measure_stages(
    module: nn.Sequential,
    balance: Sequence[int],
    sample: Value,
    *,
    side_inputs: Mapping[str, Any] | None = None,
    skips: Mapping[str, Tensor] | None = None,
    loss_fn: Callable[[Any, Any], Tensor] | None = None,
    target: Any = None,
    fused_wgrad: bool = True,
    wgrad_fuse_min: int | None = None,
    transients: bool = True,
    recompute: Recompute | None = None,
    split: bool = True,
) -> list[StageBytes]:
    """Each stage's :class:`~fastpipe.memory.model.StageBytes` for one micro-batch ``sample``.

    Args:
        module: the model.
        balance: layers per stage, as the pipe's (``[1] * len(module)``: per layer, whose sum over a
            stage approximates that stage, less exactly where a graph is retained).
        sample: one micro-batch of input; its tensors require grad as the caller's would.
        side_inputs: keyword inputs of the layers that declare them, for this micro-batch.
        skips: tensors stashed before ``module`` (by name) for its pops: a stage measured apart
            from the stages before it.
        loss_fn: applied to the last stage's output and ``target``, as ``train_step``'s loss;
            None: the output's gradient is ones.
        target: this micro-batch's target for ``loss_fn``.
        fused_wgrad: the pipe's ``fused_wgrad`` (False: every weight gradient is left to autograd).
        wgrad_fuse_min: the pipe's ``wgrad_fuse_min``; None: as a pipe built now would take it
            (:func:`~fastpipe.runtime.options.fuse_min_on` of the sample's device).
        transients: measure the bytes each action holds only while it runs
            (:attr:`~fastpipe.memory.model.StageBytes.f_transient`, ``b_transient``,
            ``bw_transient``) with :class:`~fastpipe.memory.accounting.PeakMeter` on the stage's
            device; False: 0. On CPU that builds the byte counter once (a C++ compiler).
        recompute: a per-layer policy whose regions run recomputed, as the pipe runs them
            (:mod:`fastpipe.runtime.selective`): they keep only their inputs, their recompute
            counts in the backward's transient bytes, and ``B`` takes their parameters.
        split: measure the split backward too (``B``'s transient, the W records and what ``B``
            leaves for ``W``); False, for a schedule without ``W``: those are 0, and the measure
            holds no more than the step's own backward does.

    Raises:
        ValueError: ``balance`` does not cover ``module``, or ``recompute`` does not fit it.
        fastpipe.memory._cpu_counter.CounterUnavailableError: ``transients`` on CPU where the
            counter cannot be built; pass ``transients=False``.
    """
    if sum(balance) != len(module) or any(b < 1 for b in balance):
        raise ValueError(f"fastpipe: balance {list(balance)} must be counts >= 1 summing to len(module)={len(module)}")
    stages, ties = split_tied(module, balance)
    regions = recompute.regions(stages) if recompute is not None else [[] for _ in stages]
    copies = {id(t.copy()) for t in ties if t.is_parameter}
    tie_grads: dict[int, list[tuple[int, int]]] = {}  # per owner stage: (reader stage, bytes) of its ties
    for t in ties:
        if t.is_parameter and t.copy().requires_grad:
            tie_grads.setdefault(t.owner_stage, []).append((t.reader_stage, storage_bytes(storages([t.copy()]))))
    side = dict(side_inputs or {})
    outside = storages([*_tensors(side), *_tensors(target)])  # the caller's, alive before and after
    run = _Run(
        value=replace_tensors(sample, [_received(t, t.requires_grad) for t in tensors_of(sample)]),
        pending={name: _received(t, True) for name, t in (skips or {}).items()},
    )
    fusing = (fused_wgrad, fuse_min_on(tensors_of(run.value)[0].device, wgrad_fuse_min))
    if transients:  # the counter must see the forward's storages allocated to see them freed
        with PeakMeter(tensors_of(run.value)[0].device):
            pass
    measured = []
    # A layer that draws (dropout) must not move the generators the step after this draws from.
    cuda = sorted({t.device.index or 0 for t in [*module.parameters(), *tensors_of(sample)] if t.is_cuda})
    with torch.random.fork_rng(devices=cuda):
        for s, stage in enumerate(stages):
            last = s == len(stages) - 1
            finish = (lambda out: loss_fn(out, target)) if last and loss_fn is not None else None
            _arrive(run, stage)
            found = _measure_stage(stage, run, side, finish, outside, fusing, transients, regions[s], split)
            params = [p for p in stage.parameters() if p.requires_grad]
            optimized = found.trainable - storage_bytes(storages(p for p in params if id(p) in copies))
            measured.append(dataclasses.replace(found, optimized=optimized, tie_grads=tuple(tie_grads.get(s, ()))))
    return measured


@dataclasses.dataclass
class _Run:
    """What flows from one stage's measurement to the next: its output, and skips still to be popped."""

    value: Value
    pending: dict[str, Tensor] = dataclasses.field(default_factory=dict)


def _arrive(run: _Run, stage: nn.Module) -> None:
    """Hand ``run`` to a stage on another device than the one before it, as the pipe would."""
    device = next((t.device for t in [*stage.parameters(), *stage.buffers()]), None)
    if device is None or device == tensors_of(run.value)[0].device:
        return
    run.value = replace_tensors(run.value, [_received(t.to(device), t.requires_grad) for t in tensors_of(run.value)])
    run.pending = {name: _received(t.to(device), True) for name, t in run.pending.items()}


def _tensors(tree: Any) -> list[Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, Tensor)]


@dataclasses.dataclass
class _Pass:
    """One forward of a stage: its output and the skips it popped and stashed."""

    out: Any
    skips_in: list[Tensor]
    skips_out: list[Tensor]
    left: dict[str, Tensor]  # the skips still to go on after it: received and not popped, or stashed

    def roots(self) -> list[Tensor]:
        return [t for t in [*tensors_of(self.out), *self.skips_out] if t.requires_grad]


def _forward(stage: nn.Module, run: _Run, side: dict[str, Any], finish: Callable[[Any], Tensor] | None) -> _Pass:
    received = dict(run.pending)
    store = SkipStore(received) if has_skips(stage) else None
    out = run_layers(stage, run.value, side, store)
    if finish is not None:
        out = finish(out)
    left = store.values if store is not None else received
    return _Pass(
        out,
        [t for n, t in run.pending.items() if n not in left],
        [t for n, t in left.items() if n not in run.pending],
        dict(left),
    )


def _measure_stage(
    stage: nn.Module,
    run: _Run,
    side: dict[str, Any],
    finish: Callable[[Any], Tensor] | None,
    outside: dict[int, int],
    fusing: tuple[bool, int],
    transients: bool,
    regions: Sequence[nn.Module],
    split: bool,
) -> StageBytes:
    """One stage on ``run.value``: its bytes; ``run`` moves on. ``fusing``: ``(fused_wgrad, wgrad_fuse_min)``."""
    (fused_wgrad, fuse_min), params = fusing, [p for p in stage.parameters() if p.requires_grad]
    linears = fusable_linears(stage, params) if fused_wgrad else []
    early = stage_early(params, [i for i, p in enumerate(params) if fused_wgrad and p.dim() <= 1], regions)
    fixed = {**outside, **storages([*stage.parameters(), *stage.buffers()])}
    inputs = tensors_of(run.value)
    device, summing = inputs[0].device, summing_linears(linears, fuse_min)
    combined, first, first_peak = (
        _combined_transient(stage, run, side, finish, params, summing, regions, device) if transients else (0, 0, 0)
    )
    saved = Saved(set(fixed))
    records = Deferred()
    with accumulating_linears(linears, records), checkpointed(regions), torch.enable_grad():
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack), _peak(device, transients) as forward:
            ran = _forward(stage, run, side, finish)
        seen = storages(inputs)
        apart = [seen, fixed, storages([*ran.skips_in, *ran.skips_out])]  # input, parameters, skips
        out = storages(tensors_of(ran.out))
        activation = storage_bytes({**saved.alive_bytes(), **out}, *apart)
        if forward is not None:  # see the module doc: what torch.utils.checkpoint keeps
            activation = max(activation, forward.result.end - storage_bytes(storages(ran.skips_out), seen, fixed))
        roots = ran.roots()
        leaves = [t for t in [*inputs, *ran.skips_in] if t.requires_grad]
        meter, work, shared_grads = None, None, 0
        if split:  # B's records for W: a step without W never holds them, so neither does its measure
            # The gradient B starts from exists before it, as a received one does (the model counts
            # it on the stage after); a loss's is a scalar.
            grads = [torch.ones_like(t) for t in roots]
            with _peak(device, transients) as meter:
                got, work = backward_inputs(roots, grads, leaves, params, early=early, records=records)
            given = sum(t.requires_grad for t in inputs)  # leaves: the inputs that need a gradient, then skips
            to_skips = storages(got[given:])
            shared_grads = storage_bytes(to_skips) - storage_bytes(to_skips, storages(got[:given]))
            del grads, got
    deferred = storages(t for r in records.records for t in r[2:])
    kept = {**saved.alive_bytes(), **storages(work.keep), **storages(g for _, g in work.early)} if work else {}
    result = StageBytes(
        parameters=storage_bytes(storages(stage.parameters())),
        activation=activation,
        input=storage_bytes(seen),
        w_records=storage_bytes(deferred, *apart),
        w_kept=storage_bytes(kept, deferred, *apart),
        gradients=storage_bytes(storages(params)),
        f_transient=0 if forward is None else _above(forward),
        b_transient=0 if meter is None else _over_start(meter),
        bw_transient=combined,
        bw_first=first,
        bw_peak=first_peak,
        w_stacked=max((storage_bytes(storages(r[2:])) for r in records.records), default=0),
        w_gemms=_gemms(records.records),
        w_input=storage_bytes({p: n for p, n in deferred.items() if p in seen}),
        output_stashed=storage_bytes(out) - storage_bytes(out, storages(ran.skips_out)),
        skip_grads_shared=shared_grads,
    )
    # As the step runs W: a checkpointed region W reaches first replays its forward, which must
    # save what the forward saved (the same Linear patch), or torch.utils.checkpoint refuses it.
    if work is not None:
        with accumulating_linears(linears, records), checkpointed(regions):
            backward_weights(work, [None] * len(params))
    saved.release()
    run.pending = {n: t if n in run.pending else _received(t, True) for n, t in ran.left.items()}
    run.value = replace_tensors(ran.out, [_received(t, t.requires_grad) for t in tensors_of(ran.out)])
    return result


def _gemms(records: Sequence[tuple[Tensor, Tensor | None, Tensor, Tensor]]) -> tuple[tuple[int, int], ...]:
    """:attr:`~fastpipe.memory.model.StageBytes.w_gemms` of one micro-batch's deferred records.

    As :func:`fastpipe.runtime.wgrad.apply_deferred` runs them: one GEMM per Linear (weight and
    bias) in the order B first recorded it, over its records stacked (not under autocast, where
    each runs alone: nothing to stack), making the sums of the parameters no GEMM before made.
    """
    by_linear: dict[tuple[int, int], list[tuple[Tensor, Tensor | None, Tensor, Tensor]]] = {}
    for rec in records:
        by_linear.setdefault((id(rec[0]), id(rec[1])), []).append(rec)
    made: set[int] = set()
    gemms = []
    for recs in by_linear.values():
        stacked = all(r[2].dtype == r[0].dtype for r in recs)
        record = sum(t.numel() * t.element_size() for r in recs for t in r[2:]) if stacked else 0
        new = [p for p in recs[0][:2] if p is not None and p.requires_grad and id(p) not in made]
        made.update(id(p) for p in new)
        gemms.append((record, sum(p.numel() * p.element_size() for p in new)))
    return tuple(gemms)


def _above(meter: PeakMeter) -> int:
    """What a block held at its peak above both its start and its end."""
    return max(0, meter.result.peak - max(0, meter.result.end))


def _over_start(meter: PeakMeter) -> int:
    """What a backward held at its peak above its start.

    Not above its end as well: a backward ends holding the gradient of its input while the
    saved tensors it freed may be fewer bytes, and the model applies those ends only at the
    action's end, so a transient measured above the end would lose that difference.
    """
    return max(0, meter.result.peak)


def _combined_transient(
    stage: nn.Module,
    run: _Run,
    side: dict[str, Any],
    finish: Callable[[Any], Tensor] | None,
    params: list[nn.Parameter],
    linears: list[nn.Linear],
    regions: Sequence[nn.Module],
    device: torch.device,
) -> tuple[int, int, int]:
    """:attr:`StageBytes.bw_transient`, :attr:`~StageBytes.bw_first` and :attr:`~StageBytes.bw_peak`: a backward
    into ``.grad`` sums that exist, as every ``BW`` but a first runs, and the first one.

    A first backward allocates the sums as it goes; the model counts them from its end, plus what
    it held above its end (the gradient in flight into its first layers, once all sums are made),
    and while it runs, its peak above its start: the last layers' sums are made first, while the
    saved tensors of the layers before are still alive.
    """
    before = [p.grad for p in params]
    leaves = [t for t in [*tensors_of(run.value), *run.pending.values()] if t.requires_grad]
    try:
        for p in params:
            p.grad = None
        above: list[int] = []  # the first backward's, then a later one's
        with accumulating_linears(linears), checkpointed(regions), torch.enable_grad():
            for _ in range(2):
                roots = _forward(stage, run, side, finish).roots()
                grads = [torch.ones_like(t) for t in roots]
                if not roots or not (leaves or params):
                    return 0, 0, 0
                with _peak(device, True) as meter:
                    torch.autograd.backward(roots, grads, inputs=[*leaves, *params])
                assert meter is not None
                if not above:  # the first one's above its own end, which holds the sums it made
                    first_peak = _over_start(meter)
                    above.append(meter.result.peak - meter.result.end)
                else:
                    above.append(_over_start(meter))
                for t in leaves:
                    t.grad = None
            return above[1], above[0], first_peak
    finally:
        for p, g in zip(params, before):
            p.grad = g
        for t in leaves:
            t.grad = None


@contextlib.contextmanager
def _peak(device: torch.device, on: bool) -> Iterator[PeakMeter | None]:
    """A :class:`PeakMeter` on ``device`` around the block (garbage collection held off), or None."""
    if not on:
        yield None
        return
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        with PeakMeter(device) as meter:
            yield meter
    finally:
        if was:
            gc.enable()
