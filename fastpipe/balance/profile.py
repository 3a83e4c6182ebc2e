"""The layer profiler: forward and backward time and memory of each layer of an ``nn.Sequential``.

:func:`profile_layers` runs each layer ``repeats`` times on one micro-batch, on the caller's device or on
a chosen one, and returns a :class:`LayerProfile` that the planner (:mod:`fastpipe.balance.planner`) takes
as per-layer costs.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["LayerProfile", "profile_layers"]


@dataclass(frozen=True)
class LayerProfile:
    """Per-layer measurements of one micro-batch (the profiled sample).

    Attributes:
        forward: forward seconds per layer (median of the repeats).
        backward: backward seconds per layer (median).
        activation_bytes: bytes saved for backward by each layer, parameters excluded.
        parameter_bytes: bytes of each layer's parameters.
    """

    forward: list[float]
    backward: list[float]
    activation_bytes: list[int]
    parameter_bytes: list[int]


def profile_layers(
    module: nn.Sequential,
    sample: torch.Tensor,
    *,
    device: torch.device | str | None = None,
    repeats: int = 3,
    on: torch.device | str | None = None,
) -> LayerProfile:
    """Measures each layer's forward and backward time and memory on ``sample`` (one micro-batch).

    The input follows each layer to the device of its parameters; with ``on``, each layer is
    measured on that device instead (moved there for its measurement and back afterwards, one
    layer at a time, so a model too big for one device can still be profiled where it will run).
    Activation bytes are the storages saved for backward (``torch.autograd.graph.saved_tensors_hooks``),
    parameters excluded, each storage counted once. Parameter ``.grad`` fields are restored afterwards.
    Each layer runs on a copy of its input, so a layer that writes into its input (``ReLU(inplace=True)``)
    can be profiled, even as the first layer, and ``sample`` is never written into.

    Args:
        module: the layers, profiled in order.
        sample: one micro-batch of input to the first layer.
        device: where to move ``sample`` first.
        repeats: runs per layer; the times are their median.
        on: the device to measure every layer on (``None``: where each layer's parameters are).

    Raises:
        ValueError: when ``repeats < 1``.
        TypeError: when a layer returns something other than a Tensor.
    """
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    target = None if on is None else torch.device(on)
    x = sample.to(device) if device is not None else sample
    if target is not None:
        x = x.to(target)
    fwd: list[float] = []
    bwd: list[float] = []
    acts: list[int] = []
    params: list[int] = []
    for layer in module:  # every entry: children() would skip a layer used twice
        param_list = list(layer.parameters())
        with _visiting(layer, param_list, target):
            measured = _measure(layer, param_list, x, repeats, follow=target is None)
        fwd.append(measured.forward)
        bwd.append(measured.backward)
        acts.append(measured.activation_bytes)
        params.append(sum(p.numel() * p.element_size() for p in param_list))
        x = measured.output.detach()
    return LayerProfile(fwd, bwd, acts, params)


@contextlib.contextmanager
def _visiting(layer: nn.Module, param_list: list[nn.Parameter], target: torch.device | None) -> Iterator[None]:
    """Move ``layer`` to ``target`` for the block and back after it (its ``.grad`` fields stay put)."""
    home = next(iter([*param_list, *layer.buffers()]), None)
    if target is None or home is None or home.device == target:
        yield
        return
    grads = [p.grad for p in param_list]
    for p in param_list:
        p.grad = None
    layer.to(target)
    try:
        yield
    finally:
        for p in param_list:
            p.grad = None
        layer.to(home.device)
        for p, g in zip(param_list, grads):
            p.grad = g


@dataclass(frozen=True)
class _Measured:
    """One layer's medians over the repeats, and its output of the last repeat (the next layer's input)."""

    forward: float
    backward: float
    activation_bytes: int
    output: torch.Tensor


def _measure(
    layer: nn.Module, param_list: list[nn.Parameter], x: torch.Tensor, repeats: int, follow: bool
) -> _Measured:
    """Runs ``layer`` forward and backward ``repeats`` times on ``x``; its parameters' ``.grad`` are kept."""
    if follow and param_list and param_list[0].device != x.device:
        x = x.to(param_list[0].device)  # a model already spread over devices
    param_ptrs = {p.untyped_storage().data_ptr() for p in param_list}
    old_grads = [p.grad for p in param_list]
    f_times, b_times, saved_bytes = [], [], 0
    out = x
    for _ in range(repeats):
        f, b, saved_bytes, out = _run_once(layer, x, param_ptrs)
        f_times.append(f)
        b_times.append(b)
    for p, g in zip(param_list, old_grads):
        p.grad = g
    return _Measured(statistics.median(f_times), statistics.median(b_times), saved_bytes, out)


def _run_once(layer: nn.Module, x: torch.Tensor, param_ptrs: set[int]) -> tuple[float, float, int, torch.Tensor]:
    """One timed forward and backward of ``layer``: seconds of each, bytes saved for backward, the output."""
    cuda = x.is_cuda
    # The layer runs on a copy that is not a leaf, as a layer inside a stage does: autograd refuses an
    # in-place write (ReLU(inplace=True)) into a leaf that requires grad, and the copy keeps such a write
    # out of ``x``, so every repeat, and the next layer, sees the same input. The copy is made before
    # the clock starts; its backward only passes the gradient through.
    inp = x.detach().requires_grad_(x.is_floating_point()).clone()
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in param_ptrs:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    if cuda:
        torch.cuda.synchronize(x.device)
    t0 = time.perf_counter()
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(inp)
    if cuda:
        torch.cuda.synchronize(x.device)
    t1 = time.perf_counter()
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"layer {layer.__class__.__name__} returned {type(out).__name__}, not a Tensor")
    if out.requires_grad:
        torch.autograd.backward(out, torch.ones_like(out))
    if cuda:
        torch.cuda.synchronize(x.device)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, sum(storages.values()), out
