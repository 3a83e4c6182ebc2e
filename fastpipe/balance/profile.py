"""The layer profiler: forward and backward time and memory of each layer of an ``nn.Sequential``.

:func:`profile_layers` runs every layer on one micro-batch, on the caller's device or on a chosen one,
and returns a :class:`LayerProfile` that the planner (:mod:`fastpipe.balance.planner`) takes as per-layer
costs. It takes what a :class:`fastpipe.Pipe` takes: a sample that is a tensor or a tuple (non-tensor
items ride along), layers that return tuples, and side inputs handed to the layers that declare them.

Measured times are noisy on a shared machine, and noise only ever adds time. So the profiler first runs
a warm-up pass (allocator, caches, gradient buffers), then times ``repeats`` passes over all the layers,
one layer after another in each pass, and keeps each layer's fastest time. Passes, not one layer's
repeats back to back, so that a busy spell of the machine slows one pass of every layer, not every
repeat of a few layers. A run during which the operating system gave the CPU to another process (an
involuntary context switch of this thread) timed that process too, so it is run again.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

try:
    import resource  # POSIX; counts the context switches of this thread on Linux
except ImportError:  # pragma: no cover - Windows
    resource = None  # type: ignore[assignment]

import torch
from torch import nn

from fastpipe.balance._untouched import grads_set_aside, state_kept, visiting
from fastpipe.model.partition import layers_of
from fastpipe.model.side_inputs import call_layer, check_side_inputs, declared, side_inputs_on, split_side_inputs
from fastpipe.model.skips import SkipStore, Stash, popped
from fastpipe.step.microbatch import Value, batch_size, check_value, replace_tensors, tensors_of, to_device

__all__ = ["MEASURED_TOLERANCE", "LayerProfile", "profile_layers"]

# The relative margin of simulated step time that the balancers treat as measurement noise: plans
# simulated within it of the fastest tie, and the most even of them wins. Measured on 2 shared CPU
# cores (load 4-5), 90 profiles of 16 identical layers (8 x Linear(512)+ReLU, 32 rows, K=4, M=8, 1F1B):
# the even split simulated at most 3.0% (median 0%) slower than the fastest plan of the same profile.
MEASURED_TOLERANCE = 0.05

Timer = Callable[[], float]

# Runs of a layer added to a timed pass in which the system interrupted it.
_RETRIES = 5


@dataclass(frozen=True)
class LayerProfile:
    """Per-layer measurements of one micro-batch (the profiled sample).

    Attributes:
        forward: forward seconds per layer (the fastest of the timed passes).
        backward: backward seconds per layer (the fastest).
        activation_bytes: bytes saved for backward by each layer, parameters excluded.
        parameter_bytes: bytes of each layer's parameters.
    """

    forward: list[float]
    backward: list[float]
    activation_bytes: list[int]
    parameter_bytes: list[int]


def profile_layers(
    module: nn.Sequential,
    sample: Value,
    *,
    device: torch.device | str | None = None,
    repeats: int = 5,
    on: torch.device | str | None = None,
    warmup: int = 1,
    side_inputs: Mapping[str, Any] | None = None,
    timer: Timer | None = None,
) -> LayerProfile:
    """Measures each layer's forward and backward time and memory on ``sample`` (one micro-batch).

    The input follows each layer to the device of its parameters; with ``on``, each layer is
    measured on that device instead (moved there for each of its runs and back afterwards, one
    layer at a time, so a model too big for one device can still be profiled where it will run).
    Activation bytes are the storages saved for backward (``torch.autograd.graph.saved_tensors_hooks``),
    parameters excluded, each storage counted once. Parameter ``.grad`` fields are as before afterwards.
    Each layer runs on a copy of its input, so a layer that writes into its input (``ReLU(inplace=True)``)
    can be profiled, even as the first layer, and ``sample`` is never written into.

    The backward of a layer is seeded with ones at every output tensor that requires grad. The sample's
    floating-point tensors require grad (as a stage's input does); a later layer's input tensors require
    grad where the previous layer's outputs did.

    Args:
        module: the layers, profiled in order.
        sample: one micro-batch of input to the first layer: a tensor, or a tuple whose tensors share
            dim 0 (other items pass through), as :class:`fastpipe.Pipe` takes.
        device: where to move ``sample`` first.
        repeats: timed passes; each time is the fastest of them.
        on: the device to measure every layer on (``None``: where each layer's parameters are).
        warmup: untimed passes first.
        side_inputs: keyword values for the layers that declare them (:func:`fastpipe.takes`), for the
            same samples as ``sample``: a tensor whose dim 0 is the sample's batch, or anything that
            reaches every micro-batch whole, as ``Pipe``'s side inputs.
        timer: the clock, in seconds; tests give a fake one. ``None``: ``time.perf_counter``, and a run
            during which the operating system switched this thread out (an involuntary context
            switch: the time also holds another process's time slice) is run again, up to 5 more
            times in a pass; interrupted runs count only for a layer that never ran alone.

    Raises:
        ValueError: when ``repeats < 1`` or ``warmup < 0``, or a side input's dim 0 fits neither the
            batch nor 1.
        TypeError: when ``sample`` or a layer's output is neither a tensor nor a tuple holding one, or
            no layer declares a side input given.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1 (timed passes), got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0 (untimed passes), got {warmup}")
    check_value(sample, "sample")
    side = _one_sample_side_inputs(module, sample, side_inputs or {})
    target = None if on is None else torch.device(on)
    x = to_device(sample, torch.device(device)) if device is not None else sample
    if target is not None:
        x = to_device(x, target)
    clock = _Clock(time.perf_counter, _involuntary_switches) if timer is None else _Clock(timer, lambda: 0)
    layers = [layer for _, layer in layers_of(module)]  # every entry: children() would skip a layer used twice
    with grads_set_aside(module), state_kept(module, target):
        start = _Input(x, [t.is_floating_point() for t in tensors_of(x)])
        inputs, acts, first = _first_pass(layers, start, side, target, clock)
        fastest = [_Fastest() for _ in layers]
        for p in range(warmup + repeats):
            for i, (layer, inp) in enumerate(zip(layers, inputs)):
                run = first[i] if p == 0 else _measure(layer, inp, side, target, clock)
                if p >= warmup:
                    _add_quiet_run(fastest[i], run, functools.partial(_measure, layer, inp, side, target, clock))
    params = [sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in layers]
    return LayerProfile([b.forward for b in fastest], [b.backward for b in fastest], acts, params)


@dataclass(frozen=True)
class _Clock:
    """The profiler's clock: ``now()`` in seconds, and ``switches()``, a count that moves when the
    operating system takes the CPU away from this thread (constant for a clock that is not the wall's)."""

    now: Timer
    switches: Callable[[], int]


def _involuntary_switches() -> int:
    """This thread's involuntary context switches so far (0 where the system does not count them)."""
    who = getattr(resource, "RUSAGE_THREAD", None) if resource is not None else None
    return 0 if who is None else resource.getrusage(who).ru_nivcsw


@dataclass(frozen=True)
class _Input:
    """A layer's input as the profiler keeps it: the value (detached) and which tensors require grad."""

    value: Value
    grad: list[bool]


def _one_sample_side_inputs(module: nn.Module, sample: Value, side: Mapping[str, Any]) -> dict[str, Any]:
    """``side`` checked against ``module``'s declarations and fitted to ``sample``'s batch, broadcasts unwrapped."""
    if not side:
        return {}
    check_side_inputs(module, side, grad=True)
    batch = 1 if isinstance(sample, torch.Tensor) and sample.dim() == 0 else batch_size(sample, "sample")
    return split_side_inputs(side, batch, 1, 1)[0]


def _first_pass(
    layers: list[nn.Module], x: _Input, side: dict[str, Any], target: torch.device | None, clock: _Clock
) -> tuple[list[_Input], list[int], list[_Run]]:
    """Runs every layer once in order: each layer's input, its activation bytes and its run."""
    inputs: list[_Input] = []
    acts: list[int] = []
    runs: list[_Run] = []
    stashed: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(layers):
        if target is None:
            x = _follow(layer, x)
        inputs.append(x)
        if isinstance(layer, Stash) and isinstance(x.value, torch.Tensor):
            stashed[layer.name] = x.value
        if popped(layer):  # profiled with the tensors its stashes recorded, as in the pipeline
            layer = layers[i] = _Popping(layer, {n: stashed[n] for n in popped(layer) if n in stashed})
        saved: dict[int, int] = {}
        run = _measure(layer, x, side, target, clock, saved)
        acts.append(sum(saved.values()))
        runs.append(run)
        outs = tensors_of(run.output)
        x = _Input(replace_tensors(run.output, [t.detach() for t in outs]), [t.requires_grad for t in outs])
    return inputs, acts, runs


def _follow(layer: nn.Module, x: _Input) -> _Input:
    """``x`` on the device of ``layer``'s parameters (a model already spread over devices)."""
    home = next(iter(layer.parameters()), None)
    tensors = tensors_of(x.value)
    if home is None or all(t.device == home.device for t in tensors):
        return x
    return _Input(to_device(x.value, home.device), x.grad)


@dataclass(frozen=True)
class _Run:
    """One forward and backward of a layer: seconds of each, whether the system left each alone, the output."""

    forward: float
    backward: float
    forward_quiet: bool
    backward_quiet: bool
    output: Value


class _Fastest:
    """A layer's fastest forward and backward over its runs; runs the system interrupted count only if
    no other run did not (an interrupted run also timed another process's time slice)."""

    def __init__(self) -> None:
        self.any = [math.inf, math.inf]
        self.alone = [math.inf, math.inf]

    def add(self, run: _Run) -> None:
        for k, (t, quiet) in enumerate(((run.forward, run.forward_quiet), (run.backward, run.backward_quiet))):
            self.any[k] = min(self.any[k], t)
            if quiet:
                self.alone[k] = min(self.alone[k], t)

    @property
    def forward(self) -> float:
        return self.alone[0] if math.isfinite(self.alone[0]) else self.any[0]

    @property
    def backward(self) -> float:
        return self.alone[1] if math.isfinite(self.alone[1]) else self.any[1]


def _add_quiet_run(best: _Fastest, run: _Run, again: Callable[[], _Run]) -> None:
    """Adds ``run`` to ``best``, and runs ``again`` while the system interrupted every run of this pass
    (a forward or a backward), ``_RETRIES`` times at most."""
    forward, backward = run.forward_quiet, run.backward_quiet
    best.add(run)
    for _ in range(_RETRIES):
        if forward and backward:
            return
        run = again()
        best.add(run)
        forward, backward = forward or run.forward_quiet, backward or run.backward_quiet


def _measure(
    layer: nn.Module,
    x: _Input,
    side: dict[str, Any],
    target: torch.device | None,
    clock: _Clock,
    saved: dict[int, int] | None = None,
) -> _Run:
    """One run of ``layer`` on ``x``, on ``target`` if given (see :func:`_run_once`)."""
    with visiting(layer, target):
        return _run_once(layer, x, side, clock, saved)


class _Popping(nn.Module):
    """A layer that pops skips, called with the tensors recorded for it (leaves, as a stage receives them)."""

    def __init__(self, layer: nn.Module, skips: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.layer = layer
        self.skips = skips
        self.fastpipe_side_inputs = declared(layer)

    def forward(self, x: Any, **side: Any) -> Any:
        device = tensors_of(x)[0].device
        received = {n: t.detach().to(device).requires_grad_(t.is_floating_point()) for n, t in self.skips.items()}
        return call_layer(self.layer, x, side, SkipStore(received))


def _fresh(x: _Input) -> Value:
    """A copy of ``x`` for one run: each tensor a non-leaf copy, requiring grad as recorded.

    The layer runs on a copy that is not a leaf, as a layer inside a stage does: autograd refuses an
    in-place write (``ReLU(inplace=True)``) into a leaf that requires grad, and the copy keeps such a
    write out of the kept input, so every pass, and the next layer, sees the same input. Its backward
    only passes the gradient through.
    """
    tensors = tensors_of(x.value)
    return replace_tensors(x.value, [t.detach().requires_grad_(g).clone() for t, g in zip(tensors, x.grad)])


def _run_once(layer: nn.Module, x: _Input, side: dict[str, Any], clock: _Clock, saved: dict[int, int] | None) -> _Run:
    """One timed forward and backward of ``layer``.

    With ``saved``, the bytes of the storages saved for backward (parameters excluded) are recorded in it.
    """
    inp = _fresh(x)
    device = tensors_of(inp)[0].device
    kwargs = side_inputs_on(side, declared(layer), device, {}) if side else {}
    param_ptrs = {p.untyped_storage().data_ptr() for p in layer.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if saved is not None:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in param_ptrs:
                saved[ptr] = t.untyped_storage().nbytes()
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if saved is not None else None
    _sync(device)
    s0, t0 = clock.switches(), clock.now()
    with torch.enable_grad(), hooks or contextlib.nullcontext():
        out = call_layer(layer, inp, kwargs)
    _sync(device)
    t1, s1 = clock.now(), clock.switches()
    if not (isinstance(out, torch.Tensor) or (isinstance(out, tuple) and tensors_of(out))):
        raise TypeError(
            f"layer {layer.__class__.__name__} returned {type(out).__name__}; a layer of a Pipe returns a Tensor "
            "or a tuple holding at least one Tensor (other items pass through)"
        )
    roots = [t for t in tensors_of(out) if t.requires_grad]
    s2, t2 = clock.switches(), clock.now()
    if roots:
        torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
    _sync(device)
    t3, s3 = clock.now(), clock.switches()
    return _Run(t1 - t0, t3 - t2, s1 == s0, s3 == s2, out)


def _sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work, so the clock sees it (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
