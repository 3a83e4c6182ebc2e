"""What profiling must leave as it found it: parameters' gradients, buffers, the random generators.

:func:`fastpipe.balance.profile_layers` runs the caller's own layers, forward and backward, in
whatever mode they are in. These context managers put back what such runs move, so that a
profiled model then trains exactly as an unprofiled one, and a pipeline that checks its shared
buffers for writes (:meth:`fastpipe.model.ties.Tie.check_constant`) sees none from the profile.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["grads_set_aside", "state_kept", "visiting"]


@contextlib.contextmanager
def grads_set_aside(module: nn.Module) -> Iterator[None]:
    """Parameters' ``.grad`` are ``None`` during the block and the caller's own after it.

    Backward accumulates into an existing ``.grad`` in place, so the profile's gradients must not
    meet the caller's.
    """
    params = list(module.parameters())
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        for p, g in zip(params, grads):
            p.grad = g


@contextlib.contextmanager
def state_kept(module: nn.Module, target: torch.device | None) -> Iterator[None]:
    """Buffers and torch's random generators as they were before the block.

    Profiling runs the layers in training mode, which moves BatchNorm's running statistics and
    advances the generators dropout draws from; neither may differ from a run without it.

    Each buffer slot gets its own tensor back (a visit to another device, or a layer that rebinds
    a buffer, leaves a new one there), and only a tensor whose bits differ from before gets its
    values copied back. A restoring copy bumps the tensor's version counter, which the pipeline
    reads as a write into a buffer shared across stages (:meth:`fastpipe.model.ties.Tie.check_constant`),
    so an untouched buffer (a rotary table) must not get one. The bits are compared, not the
    counter: BatchNorm's kernel updates its running statistics without bumping it.
    """
    kept = [(slot, b, b.detach().clone()) for slot, b in _buffer_slots(module)]
    places = {t.device for t in [*module.parameters(), *module.buffers()]} | ({target} if target else set())
    cuda = sorted({d.index or 0 for d in places if d.type == "cuda"})
    with torch.random.fork_rng(devices=cuda):
        try:
            yield
        finally:
            with torch.no_grad():
                for (owner, key), b, saved in kept:
                    owner._buffers[key] = b
                    if not _same_bits(b, saved):
                        b.copy_(saved)


def _buffer_slots(module: nn.Module) -> Iterator[tuple[tuple[nn.Module, str], torch.Tensor]]:
    """Each ``(module, key)`` that holds a buffer under ``module`` (a shared module once), with the buffer."""
    for sub in module.modules():
        for key, b in sub._buffers.items():
            if b is not None:
                yield (sub, key), b


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same bytes (equal NaNs match; ``-0.0`` differs from ``0.0``).

    A sparse or quantized buffer, which has no plain bytes to view, counts as changed.
    """
    if a.layout != torch.strided or a.is_quantized or a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))


@contextlib.contextmanager
def visiting(layer: nn.Module, target: torch.device | None) -> Iterator[None]:
    """Move ``layer`` to ``target`` for the block and back after it (gradients of the visit are dropped)."""
    param_list = list(layer.parameters())
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
