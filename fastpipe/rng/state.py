"""torch's RNG-state functions, made to see the running task's stream.

``torch.utils.checkpoint`` used *inside* a stage saves the random state before its
region runs and restores it for the recompute, so that dropout draws the same mask twice.
It does so through torch's default generators, which a fastpipe task does not draw from
(:mod:`fastpipe.rng.streams` swaps the task's own stream in around each random op). Left alone,
the checkpoint would save the parked default state, the recompute would draw from it
outside the task, and the gradients would silently be wrong.

So, while a thread runs a fastpipe task with an active stream (:func:`fastpipe.rng.streams.current_task`),
the functions ``torch.utils.checkpoint`` calls address that task's stream instead:

* ``torch.get_rng_state()`` / ``torch.set_rng_state(s)``: the task's CPU stream;
* ``torch.cuda.get_rng_state(d)`` / ``torch.cuda.set_rng_state(s, d)``: its stream on
  ``cuda:d`` (``get_device_states``/``set_device_states`` call these under ``torch.cuda.device``);
* ``torch.random.fork_rng()``: forks the task's streams; and, when it runs in a stage's
  backward, where the task's :class:`~fastpipe.rng.streams.TaskRNG` mode is not on (a recompute
  runs inside ``torch.autograd.backward``, which a function mode cannot stay on around),
  it turns the mode on for its duration, so the recompute's random ops draw from the
  restored stream under the per-device lock, whatever the other stage workers do.

Everywhere else (no task, or a stage that cannot draw and so runs without a stream) they
are torch's own, unchanged. :func:`install` replaces the module attributes once; code
that bound ``from torch import get_rng_state`` before keeps torch's function.

fastpipe makes the task current (without its per-op interception) around each stage's
backward, in the thread that runs it. Limit: a GPU stage's backward started from its
worker (``train_step``) runs its nodes on autograd's device thread, which does not see
that; there the recompute restores the task's saved state into the default generator,
as torch does, holding the per-device locks of :mod:`fastpipe.rng.streams` for the whole region,
so that another stage sharing the GPU cannot draw from that generator in between and the
forward's draws are replayed.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.overrides import _get_current_function_mode_stack

from fastpipe.rng.streams import current_task, device_lock

__all__ = ["install"]

_installed = False


def _cuda(device: int | str | torch.device) -> torch.device:
    if isinstance(device, int):
        return torch.device("cuda", device)
    device = torch.device(device)
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def _get_cpu(original: Callable[[], Tensor]) -> Callable[[], Tensor]:
    @functools.wraps(original)
    def get_rng_state() -> Tensor:
        task = current_task()
        return original() if task is None else task.get_state("cpu")

    return get_rng_state


def _set_cpu(original: Callable[[Tensor], None]) -> Callable[[Tensor], None]:
    @functools.wraps(original)
    def set_rng_state(new_state: Tensor) -> None:
        task = current_task()
        if task is None:
            original(new_state)
        else:
            task.set_state(new_state, "cpu")

    return set_rng_state


def _get_cuda(original: Callable[..., Tensor]) -> Callable[..., Tensor]:
    @functools.wraps(original)
    def get_rng_state(device: int | str | torch.device = "cuda") -> Tensor:
        task = current_task()
        return original(device) if task is None else task.get_state(_cuda(device))

    return get_rng_state


def _set_cuda(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def set_rng_state(new_state: Tensor, device: int | str | torch.device = "cuda") -> None:
        task = current_task()
        if task is None:
            original(new_state, device)
        else:
            task.set_state(new_state, _cuda(device))

    return set_rng_state


def _forked_devices(args: tuple, kwargs: dict) -> list[torch.device]:
    """The generators ``fork_rng(*args, **kwargs)`` saves and restores: the CPU's and its devices'."""
    devices = kwargs.get("devices", args[0] if args else None)
    device_type = kwargs.get("device_type", "cuda")
    if devices is None:
        module = getattr(torch, device_type, None) if device_type == "cuda" else None
        count = module.device_count() if module is not None and module.is_available() else 0
        devices = range(count)
    out = [torch.device("cpu")]
    for d in devices:
        dev = torch.device(device_type, d) if isinstance(d, int) else torch.device(d)
        if dev.type == "cuda":
            out.append(dev)
    return out


@contextlib.contextmanager
def _holding(devices: list[torch.device]) -> Iterator[None]:
    locks = [device_lock(d) for d in devices]
    for lock in locks:
        lock.acquire()
    try:
        yield
    finally:
        for lock in reversed(locks):
            lock.release()


def _fork(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    @contextlib.contextmanager
    def fork_rng(*args: Any, **kwargs: Any) -> Iterator[None]:
        task = current_task()
        if task is None:
            # No task here: autograd's device thread recomputing a torch.utils.checkpoint
            # region of a GPU stage, say. Its restore and its draws use the default
            # generators themselves, which the stage workers swap under the per-device
            # locks: hold them for the region, so that no other stage draws in between.
            with _holding(_forked_devices(args, kwargs)), original(*args, **kwargs):
                yield
            return
        routed = any(m is task for m in _get_current_function_mode_stack())
        with contextlib.nullcontext() if routed else task, original(*args, **kwargs):
            yield

    return fork_rng


def install() -> None:
    """Make torch's RNG-state functions task-aware (once; later calls do nothing)."""
    global _installed
    if _installed:
        return
    # The attributes torch.utils.checkpoint and torch.random.fork_rng look up at call time.
    patches: list[tuple[Any, str, Callable[[Any], Any]]] = [
        (torch, "get_rng_state", _get_cpu),
        (torch, "set_rng_state", _set_cpu),
        (torch.cuda, "get_rng_state", _get_cuda),
        (torch.cuda, "set_rng_state", _set_cuda),
        (torch.random, "fork_rng", _fork),
    ]
    for module, name, wrap in patches:
        setattr(module, name, wrap(getattr(module, name)))
    _installed = True


install()
