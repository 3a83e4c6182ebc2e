"""Measuring a model for the planner: per-layer seconds and bytes, under each recompute policy on offer.

:func:`measure_plan_profile` profiles one micro-batch as ``balance="auto"`` does (each layer's
fastest forward and backward, :func:`~fastpipe.balance.profile.profile_layers`; its bytes,
:func:`~fastpipe.balance.device_need.layer_bytes`), then, for each per-layer policy that
``checkpoint="auto"`` would try (:func:`~fastpipe.step.recompute_policy.auto_candidates`), the
layers' bytes with the policy applied and what its recompute costs: the forward time of the
regions it recomputes, timed around those modules in a forward of the model. On a device other
than the CPU the copy bandwidth that prices offload is measured too
(:func:`~fastpipe.memory.offload_bytes.copy_bandwidth`); on a CPU offload does nothing.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from fastpipe.balance._untouched import state_kept
from fastpipe.balance.device_need import layer_bytes
from fastpipe.balance.profile import Timer, profile_layers
from fastpipe.memory.offload_bytes import CopyBandwidth, copy_bandwidth
from fastpipe.memory.planner import PlanProfile, RecomputeOption
from fastpipe.memory.stage_bytes import measure_stages
from fastpipe.model.side_inputs import run_layers
from fastpipe.model.skip_memory import SkipSpan, measure_skips
from fastpipe.model.skips import has_skips, open_skips
from fastpipe.step.microbatch import Value, replace_tensors, tensors_of, to_device
from fastpipe.step.recompute_policy import Recompute, auto_candidates

__all__ = ["measure_plan_profile", "region_seconds"]


def measure_plan_profile(
    module: nn.Sequential,
    microbatch: Value,
    side_inputs: Mapping[str, Any] | None = None,
    *,
    device: torch.device | str | None = None,
    repeats: int = 3,
    timer: Timer | None = None,
    bandwidth: CopyBandwidth | None = None,
    weight_share: float = 0.5,
    comm: float = 0.0,
    policies: Sequence[Recompute] | None = None,
    offload: bool = True,
) -> PlanProfile:
    """The :class:`~fastpipe.memory.planner.PlanProfile` of ``module`` on one micro-batch.

    The model's buffers and torch's generators are left as they were.

    Args:
        module: the model.
        microbatch: one micro-batch of input.
        side_inputs: its side inputs, by name (one micro-batch's).
        device: where the stages will run (times are measured there); None: where the layers are.
        repeats: timed passes (each time is the fastest).
        timer: the clock in seconds (tests give a fake one); None: the wall clock.
        bandwidth: the copy rates that price offload; None: measured on a device other than the
            CPU, and none on a CPU (offload does nothing there).
        weight_share: W's part of each measured backward.
        comm: seconds per stage boundary.
        policies: the per-layer recompute policies to price; None: those ``checkpoint="auto"`` tries.
        offload: whether offload is on offer (False: no bandwidth, nothing offloaded).
    """
    # Each byte measurement collects garbage around what it meters; with the objects alive now set
    # aside (collected once, here), those collections walk only what the measurements made.
    gc.collect()
    gc.freeze()
    try:
        side = dict(side_inputs or {})
        found = _measure(module, microbatch, side, device, repeats, timer, bandwidth, policies, offload)
    finally:
        gc.unfreeze()
    return dataclasses.replace(found, weight_share=weight_share, comm=comm)


def _measure(
    module: nn.Sequential,
    microbatch: Value,
    side: dict[str, Any],
    device: torch.device | str | None,
    repeats: int,
    timer: Timer | None,
    bandwidth: CopyBandwidth | None,
    policies: Sequence[Recompute] | None,
    offload: bool,
) -> PlanProfile:
    where = None if device is None else torch.device(device)
    prof = profile_layers(module, microbatch, repeats=repeats, on=where, side_inputs=side, timer=timer)
    layers = layer_bytes(module, microbatch, side)
    spans: tuple[SkipSpan, ...] = ()
    if has_skips(module):
        with state_kept(module, None):
            spans = tuple(measure_skips(module, microbatch, **side))
    priced: list[RecomputeOption] = []
    offered = auto_candidates([module]) if policies is None else policies
    done: dict[tuple[Any, ...], RecomputeOption] = {}  # by regions: inside stage recompute, the same measurements
    for candidate in offered:
        if not isinstance(candidate, Recompute):
            continue
        same = done.get(candidate.regions_key)
        if same is None:
            with state_kept(module, None):
                measured = measure_stages(module, [1] * len(module), microbatch, side_inputs=side, recompute=candidate)
            seconds = region_seconds(module, microbatch, candidate, side, repeats=repeats, timer=timer)
            same = done[candidate.regions_key] = RecomputeOption(candidate, tuple(measured), tuple(seconds))
        priced.append(dataclasses.replace(same, setting=candidate))
    if not offload:
        bandwidth = None
    elif bandwidth is None and where is not None and where.type != "cpu":
        bandwidth = copy_bandwidth(where)
    return PlanProfile(
        tuple(prof.forward),
        tuple(prof.backward),
        tuple(layers),
        tuple(priced),
        bandwidth,
        spans,
    )


def region_seconds(
    module: nn.Sequential,
    microbatch: Value,
    policy: Recompute,
    side_inputs: Mapping[str, Any] | None = None,
    *,
    repeats: int = 3,
    timer: Timer | None = None,
) -> list[float]:
    """Per layer, the forward seconds of the regions ``policy`` recomputes (the fastest of ``repeats``).

    The regions are timed where they run, in a forward of the whole model with grad enabled (a
    recompute saves for its backward as the forward did).
    """
    clock: Callable[[], float] = timer if timer is not None else time.perf_counter
    layers = list(module.children())
    regions = policy.regions([nn.Sequential(layer) for layer in layers])
    totals = [0.0] * len(layers)
    started: dict[int, float] = {}
    handles: list[RemovableHandle] = []

    def watch(index: int, region: nn.Module) -> None:
        def before(*_: Any) -> None:
            started[id(region)] = clock()

        def after(*_: Any) -> None:
            totals[index] += clock() - started.pop(id(region))

        handles.append(region.register_forward_pre_hook(before))
        handles.append(region.register_forward_hook(after))

    for i, found in enumerate(regions):
        for region in found:
            watch(i, region)
    best = [float("inf")] * len(layers)
    first = next((p.device for p in module.parameters()), torch.device("cpu"))
    x = to_device(microbatch, first)
    try:
        with state_kept(module, None), torch.enable_grad():
            for _ in range(max(repeats, 1)):
                totals[:] = [0.0] * len(layers)
                value = replace_tensors(x, [t.detach().requires_grad_(t.is_floating_point()) for t in tensors_of(x)])
                run_layers(module, value, dict(side_inputs or {}), open_skips(module))
                best = [min(b, t) for b, t in zip(best, totals)]
    finally:
        for handle in handles:
            handle.remove()
    return best
