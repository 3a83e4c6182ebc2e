"""Selective recompute: chosen modules of a stage give up their saved tensors until the backward.

A per-layer policy (:mod:`fastpipe.step.recompute_policy`) names *regions*: modules of a stage
(whole layers, or parts of blocks) that run under non-reentrant ``torch.utils.checkpoint``.
The rest of the stage keeps its graph as usual::

    forward      x ─▶ ln ─▶ [ mlp ] ─▶ + ─▶ y       the region keeps only its inputs
    backward    dx ◀─ ln ◀─ [ mlp ] ◀─ + ◀─ dy      its first node to need a saved tensor
                             └─ runs mlp again        recomputes the region, then it is freed

The recompute must see what the forward saw:

* **Random ops**: torch's checkpoint saves the RNG state before the region and restores it
  for the recompute; inside a fastpipe task that is the task's own stream
  (:mod:`fastpipe.rng.state`), so dropout and SDPA draw the same masks twice.
* **Linear routing**: a stage's ``nn.Linear`` layers run as accumulating or deferring
  functions (:mod:`fastpipe.runtime.wgrad`), chosen per forward. A recompute runs inside
  some backward (B, BW, or W) where another routing may be installed, and a checkpoint
  whose recompute saves other tensors than its forward fails. So the recompute reinstalls
  the routing each Linear of the region had in the forward.
* **Buffers**: norm layers' running statistics are written by the forward; the recompute
  writes into copies, so they are updated once.

A region's parameters are taken by ``B`` in a split backward (:func:`stage_early`): left to
``W``, their gradients would need the region's saved tensors a second time, in another
backward, and the region would be recomputed twice.

Regions are set per stage module (:func:`set_regions`) and applied around each of its
forwards (:func:`stage_regions`), so every driver (threads, processes, ``fit``) runs them.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import checkpoint

from fastpipe.runtime.stage import Stage

__all__ = ["checkpointed", "regions_of", "set_regions", "stage_regions"]

# Per stage module: its regions, and the parameters B took before any region was set.
_REGIONS: weakref.WeakKeyDictionary[nn.Module, tuple[nn.Module, ...]] = weakref.WeakKeyDictionary()
_BASE_EARLY: weakref.WeakKeyDictionary[nn.Module, tuple[int, ...]] = weakref.WeakKeyDictionary()


def set_regions(stage: Stage, regions: Sequence[nn.Module]) -> None:
    """From now on, ``stage`` recomputes ``regions`` (modules inside it); none: it keeps everything.

    Also makes ``B`` take the regions' parameters (``stage.early``). Call it between steps.
    """
    base = _BASE_EARLY.setdefault(stage.module, tuple(stage.early))
    unique = _outermost(regions)
    if unique:
        _REGIONS[stage.module] = unique
    else:
        _REGIONS.pop(stage.module, None)
    stage.early = stage_early(stage.params, base, unique)


def regions_of(module: nn.Module) -> tuple[nn.Module, ...]:
    """The regions set for the stage ``module``."""
    return _REGIONS.get(module, ())


def stage_early(params: Sequence[torch.Tensor], early: Sequence[int], regions: Sequence[nn.Module]) -> list[int]:
    """``early`` and the indices of ``params`` that belong to ``regions``, in order."""
    inside = {id(p) for region in regions for p in region.parameters()}
    return sorted({*early, *(i for i, p in enumerate(params) if id(p) in inside)})


def stage_regions(module: nn.Module) -> contextlib.AbstractContextManager[None]:
    """Around a forward of the stage ``module``: its regions recompute, if it has any and trains."""
    regions = _REGIONS.get(module)
    if not regions or not module.training:
        return contextlib.nullcontext()
    return checkpointed(regions)


@contextlib.contextmanager
def checkpointed(regions: Sequence[nn.Module]) -> Iterator[None]:
    """Within the block, calls of ``regions`` that build a graph run under non-reentrant checkpoint."""
    patched: list[tuple[nn.Module, Any]] = []
    try:
        for region in _outermost(regions):
            own = region.__dict__.get("forward")  # a routing installed on this call (a Linear), kept below
            region.forward = functools.partial(_run_region, region, region.forward)
            patched.append((region, own))
        yield
    finally:
        for region, own in reversed(patched):
            if own is None:
                del region.__dict__["forward"]
            else:
                region.__dict__["forward"] = own


def _run_region(region: nn.Module, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    # Keyword tensors go in as positional ones: checkpoint saves only those, and a saved input
    # is one that autograd's saved-tensor hooks (fastpipe.memory.stage_bytes) can count.
    leaves, spec = tree_flatten((args, kwargs))
    routes = [(m, m.__dict__.get("forward")) for m in region.modules() if type(m) is nn.Linear and m is not region]
    calls = 0

    def run(*flat: Any) -> Any:
        nonlocal calls
        calls += 1
        a, kw = tree_unflatten(list(flat), spec)
        if calls == 1:
            return forward(*a, **kw)
        with _routed(routes), _buffers_copied(region):
            return forward(*a, **kw)

    return checkpoint(run, *leaves, use_reentrant=False)


@contextlib.contextmanager
def _routed(routes: Sequence[tuple[nn.Module, Any]]) -> Iterator[None]:
    """The Linears' forwards as the region's forward found them."""
    before = [(lin, lin.__dict__.get("forward")) for lin, _ in routes]
    try:
        for lin, route in routes:
            _put_forward(lin, route)
        yield
    finally:
        for lin, route in before:
            _put_forward(lin, route)


def _put_forward(module: nn.Module, forward: Any) -> None:
    if forward is None:
        module.__dict__.pop("forward", None)
    else:
        module.__dict__["forward"] = forward


@contextlib.contextmanager
def _buffers_copied(region: nn.Module) -> Iterator[None]:
    """Norm layers' running statistics written into copies during a recompute."""
    norms = [m for m in region.modules() if isinstance(m, nn.modules.batchnorm._NormBase)]
    slots = [(m, name, b) for m in norms for name, b in m._buffers.items() if b is not None]
    try:
        for m, name, b in slots:
            m._buffers[name] = b.clone()
        yield
    finally:
        for m, name, b in slots:
            m._buffers[name] = b


def _outermost(regions: Sequence[nn.Module]) -> tuple[nn.Module, ...]:
    """``regions`` without repeats and without those inside another (its recompute covers them)."""
    unique = list(dict.fromkeys(regions))
    inner = {id(m) for r in unique for m in r.modules() if m is not r}
    return tuple(r for r in unique if id(r) not in inner)
