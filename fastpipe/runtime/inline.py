"""Backward on an autograd device thread: the calling thread runs the device stages itself.

``Pipe.forward``'s backward is one autograd node (see :mod:`fastpipe.runtime.autograd_node`).
torch runs a node whose incoming gradients live on ``cuda:d`` on its engine thread for
``cuda:d``, and any ``torch.autograd.grad``/``backward`` of CUDA tensors started by
*another* thread queues its nodes to the engine thread of their device. A node that
blocks on the device thread while stage workers run their backward therefore deadlocks
as soon as one stage lives on that device::

    engine thread cuda:0                       stage worker (cuda:0)
    ┌─────────────────────────────┐            ┌────────────────────────────────┐
    │ PipelineNode.backward       │            │ autograd.grad(stage graph)     │
    │   waits for the workers ────┼──────────▶ │   queues its nodes to cuda:0 ──┼──┐
    └─────────────────────────────┘            └────────────────────────────────┘  │
                 ▲ the same thread, blocked: nothing ever runs them ◀──────────────┘

A backward started *from* an engine thread runs reentrantly, inline on that thread, and
its nodes on other devices go to those devices' engine threads, which nothing blocks. So
when the node runs on the device thread of ``cuda:d``, the calling thread executes the
actions of every worker that owns a stage on ``cuda:d`` itself, interleaved in an order the
schedule allows (:func:`run_inline`). Workers of stages on other GPUs keep their threads:
their autograd calls go to their own devices' engine threads, so the GPUs' host work
overlaps as it does in the forward. Workers of CPU stages keep their threads too: CPU
stages' graphs hold CPU tensors only (their inputs are fresh leaves on the stage's device)
and gradients cross devices through copies, not autograd::

    engine thread cuda:0 ── node ── runs the cuda:0 workers' B/W here
    worker (cuda:1) ──── autograd.grad ──▶ engine thread cuda:1 (free)
    worker (cpu) ─────── autograd.grad ──▶ runs on the worker itself

The alternative, stitching the GPU stages into one autograd graph, would give up the
per-stage control the schedules need (recompute placement, split B/W, the fused weight
gradients) and differ from the CPU path in every one of them; running the very same
action handlers on another thread keeps one code path.

The tests run this path on an emulated accelerator (``tests/emulated_device.py``), a
PrivateUse1 device whose engine thread routes autograd exactly like CUDA's.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence

import torch

from fastpipe.runtime.mailbox import Mailbox
from fastpipe.runtime.worker import autocast_types
from fastpipe.schedule import Action, Schedule

__all__ = ["inline_workers", "run_inline", "worker_like"]


def inline_workers(
    schedule: Schedule, devices: Sequence[torch.device], thread_device: torch.device | None
) -> frozenset[int]:
    """The workers whose actions the calling thread must run itself.

    Args:
        schedule: the step's schedule.
        devices: the device of every stage.
        thread_device: the device whose autograd engine thread is calling (the one the
            pipeline's backward node received its gradients on), or None for a thread
            of no device: then every worker keeps its thread.

    Returns:
        The workers that own a stage on ``thread_device``.
    """
    if thread_device is None or thread_device.type == "cpu":
        return frozenset()
    on_thread = {s for s, d in enumerate(devices) if d == thread_device}
    return frozenset(w for w, actions in enumerate(schedule.workers) if any(a.stage in on_thread for a in actions))


@contextlib.contextmanager
def worker_like() -> Iterator[None]:
    """The thread-local state a worker thread starts with: grad on, autocast off.

    An engine thread runs a node under no_grad, and a caller may run ``backward()``
    inside autocast; the handlers expect a worker's state and set what they need.
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.enable_grad())
        for kind in autocast_types():
            stack.enter_context(torch.autocast(kind, enabled=False))
        yield


def run_inline(
    queues: Mapping[int, Sequence[Action]],
    run: Callable[[int, Action], None],
    waits_on: Callable[[Action], Hashable | None],
    mailbox: Mailbox,
) -> None:
    """Run several workers' action lists on this thread, each list in its own order.

    Takes the workers in turn and runs the next action of the first one whose input has
    arrived (``waits_on(action)`` is the mailbox slot it will read, or None), so the
    stages' work interleaves like the threads would; when none can run, waits for any of
    the slots (filled by a worker thread or by an action run here). A schedule that
    passes validation always lets one run, or has a worker thread about to fill a slot.
    """
    pending = {w: deque(actions) for w, actions in queues.items() if actions}
    order = sorted(pending)
    turn = 0
    while pending:
        blocked: list[Hashable] = []
        for i in range(len(order)):
            w = order[(turn + i) % len(order)]
            todo = pending.get(w)
            if todo is None:
                continue
            slot = waits_on(todo[0])
            if slot is not None and slot not in mailbox:
                blocked.append(slot)
                continue
            run(w, todo.popleft())
            if not todo:
                del pending[w]
            turn = (turn + i + 1) % len(order)
            break
        else:
            mailbox.wait_any(blocked)
