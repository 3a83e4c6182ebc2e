"""Reproducible randomness for stages that run in parallel threads: each task's own streams.

What a pipeline promises: every (stage, micro-batch) task draws its random numbers from a
stream of its own, seeded from one number drawn from the caller's generator per step::

    caller's generator ──draw once per step──▶ step_seed
    task_seed(step_seed, stage, mb) ──▶ the task's stream, one per device it draws on

so dropout masks do not depend on thread timing, a recompute replays them bit for bit,
and every checkpoint mode gives the same bits. The stream of a task on a device is the
one ``torch.manual_seed(task_seed(...))`` starts on that device, so the pipe equals the
plain stages run with those seeds (the property tests compare exactly that).

This module routes the draws to those streams. The seeds come from :mod:`fastpipe.rng.seeds`,
the table of calls that draw and the per-stage "could it draw at all" check from
:mod:`fastpipe.rng.registry`; their public names are re-exported here.

**Why not just seed the global generators, as torch.utils.checkpoint does?** Many random
ops offer no ``generator=`` argument and always draw from the device's default generator:
``F.scaled_dot_product_attention(dropout_p>0)``, dropout inside ``nn.MultiheadAttention``
and the RNN kernels, dropout itself. torch has *one* such generator per device, and two
stage workers on the same device (every CPU stage, or stages sharing a GPU) run at the
same time. Seeding it per task and restoring it for the recompute, as
``torch.utils.checkpoint`` does, is right for one thread only: with two, each task's draws
interleave with the other's in whatever order the threads run.

**What we do instead: swap the task's state in, under a per-device lock, around each
random op.** A thread-local ``TorchFunctionMode`` (:class:`TaskRNG`) recognises the calls
that draw (:data:`~fastpipe.rng.registry.RANDOM_OPS`, extensible with
:func:`~fastpipe.rng.registry.register_random_op`). For each such call it takes the lock of
each device the call draws on, loads the task's saved state into that device's default
generator (seeding it the first time), runs the call, saves the advanced state back into
the task and restores the generator's previous state::

    worker A (task a)          default CPU generator          worker B (task b)
    lock; load a's state ───▶  [a's stream]  ──▶ dropout
    save a's state; restore    [parked]
                               [b's stream]  ◀─── lock; load b's state; SDPA(dropout)
                               [parked]      ◀─── save b's state; restore; unlock

Every draw of a pipeline task therefore comes from its own stream, whatever runs beside it,
and the default generators are left as they were (the caller's generator moves once per
step, by :func:`~fastpipe.rng.seeds.draw_step_seed`). Only the random call itself holds the
lock; the CPU generator serialises its draws under its own mutex anyway. The routing sits at
the top-level call: inside a composite such as ``F.multi_head_attention_forward`` the mode
is off, and the nested draws find the task's state already loaded. Locks are taken CPU
first, then each accelerator by type and index, so two tasks cannot deadlock.

**Cost only where there is randomness.** A ``TorchFunctionMode`` intercepts every op of its
thread, so a stage that cannot draw at all (:func:`~fastpipe.rng.registry.may_draw`: only
``torch.nn`` layers that do not draw in their mode, no hooks) runs without the mode and
pays nothing.

**torch.utils.checkpoint inside a stage** saves and restores the random state through
``torch.get_rng_state``/``set_rng_state``/``fork_rng`` (and ``torch.cuda``'s): in a thread
running a task with a stream (:func:`current_task`) those address the task's streams, so
its recompute replays the task's draws (:mod:`fastpipe.rng.state`; torch's own elsewhere).

Limits: a random op that is none of :data:`~fastpipe.rng.registry.RANDOM_OPS` (a custom
CUDA extension drawing from the default generator, say) is not routed; :class:`TaskRNG`
notices that the default generator moved during the task and warns (register the op, or
pass it a generator from :func:`current_generator`). Other threads of yours that draw from
torch's default generators *during* a step race with it, as they would with each other.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

# Seeds and the table of what draws have modules of their own; they are re-exported here,
# so ``fastpipe.rng.streams`` stays the one public address of fastpipe's randomness.
from fastpipe.rng.registry import RANDOM_OPS, may_draw, register_deterministic, register_random_op
from fastpipe.rng.seeds import draw_step_seed, task_seed
from fastpipe.runtime.device import normalize

__all__ = [
    "draw_step_seed",
    "task_seed",
    "TaskRNG",
    "RANDOM_OPS",
    "register_random_op",
    "register_deterministic",
    "may_draw",
    "current_generator",
    "current_task",
    "device_lock",
]

# -- per-device default generators, and their locks ----------------------------------------

_CPU = torch.device("cpu")
_locks: dict[torch.device, threading.RLock] = {}
_locks_guard = threading.Lock()


def device_lock(device: torch.device) -> threading.RLock:
    """The lock held while anything swaps or draws from ``device``'s default generator."""
    return _lock(_normal(device))


def _lock(device: torch.device) -> threading.RLock:
    lock = _locks.get(device)
    if lock is None:
        with _locks_guard:
            lock = _locks.setdefault(device, threading.RLock())
    return lock


def _get_state(device: torch.device) -> Tensor:
    return _default_generator(device).get_state()


def _set_state(device: torch.device, state: Tensor) -> None:
    _default_generator(device).set_state(state)


def _seed(device: torch.device, seed: int) -> None:
    _default_generator(device).manual_seed(seed)


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    module: Any = getattr(torch, device.type)
    if not module.default_generators:
        module.init()  # torch.cuda and torch.xpu fill them at their lazy init
    return module.default_generators[device.index]


def _normal(device: Any) -> torch.device:
    """The device whose default generator a random op on ``device`` draws from.

    An accelerator whose torch module keeps per-device ``default_generators`` (CUDA, XPU, a
    PrivateUse1 backend that offers them) draws from its own; any other device (``meta``,
    the tests' emulated device, whose ops run on CPU tensors) from the CPU's.
    """
    device = torch.device(device)
    if device.type == "cpu" or not hasattr(getattr(torch, device.type, None), "default_generators"):
        return _CPU
    return normalize(device)


_ONLY_CPU = [_CPU]


def _lock_order(device: torch.device) -> tuple[bool, str, int]:
    return device.type != "cpu", device.type, device.index or 0


def _devices_of(args: tuple, kwargs: dict) -> list[torch.device]:
    """The devices whose default generator a call may draw on: CPU, or its CUDA devices."""
    if (
        "device" not in kwargs
        and args
        and isinstance(args[0], Tensor)
        and args[0].device.type == "cpu"
        and not any(isinstance(a, Tensor) and a.device.type != "cpu" for a in (*args[1:], *kwargs.values()))
    ):
        return _ONLY_CPU  # the common case (dropout on a CPU tensor), without building devices
    found: set[torch.device] = set()
    dev = kwargs.get("device")
    if dev is not None:
        found.add(_normal(dev))
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor):
            found.add(_normal(a.device))
        elif isinstance(a, (list, tuple)):  # e.g. the RNN kernels' weight lists
            found.update(_normal(t.device) for t in a if isinstance(t, Tensor))
    if not found:
        found.add(_normal(torch.get_default_device()))
    return sorted(found, key=_lock_order)


_current = threading.local()


def current_task() -> TaskRNG | None:
    """The task whose streams this thread draws from, or None outside a task."""
    return getattr(_current, "task", None)


def _set_current(task: TaskRNG | None) -> TaskRNG | None:
    outer = current_task()
    _current.task = task
    return outer


class TaskRNG(TorchFunctionMode):
    """Routes the random calls of one task to the task's own streams, seeded with ``seed``.

    Enter it in the thread that runs the task; torch function modes are thread-local, so
    tasks in other threads are unaffected. Entering it again with the same seed (the
    recompute) replays the same draws.

    Args:
        seed: the task's seed (:func:`~fastpipe.rng.seeds.task_seed`).
        watch: devices whose default generator the task must leave untouched; on exit,
            :class:`TaskRNG` warns if one moved, which means a random op it does not
            route drew from it (and will not replay).
    """

    def __init__(self, seed: int, watch: Iterable[torch.device] = ()) -> None:
        super().__init__()
        self.seed = seed
        self._states: dict[torch.device, Tensor] = {}
        self._watch = sorted({_normal(d) for d in watch}, key=_lock_order)
        self._watched: list[Tensor] = []
        self._outer: TaskRNG | None = None

    def __enter__(self) -> TaskRNG:
        self._watched = [self._parked(d) for d in self._watch]
        self._outer = _set_current(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        _set_current(self._outer)
        if exc[0] is None:
            for device, before in zip(self._watch, self._watched):
                if not torch.equal(before, self._parked(device)):
                    warnings.warn(
                        f"fastpipe: a random op drew from torch's default {device} generator without going "
                        "through fastpipe's task RNG, so its draws depend on thread timing and a recompute "
                        "will not replay them (wrong gradients under checkpointing). Register the op with "
                        "fastpipe.rng.register_random_op, or pass it generator=fastpipe.rng.current_generator().",
                        RuntimeWarning,
                        stacklevel=2,
                    )

    @contextlib.contextmanager
    def streams_only(self) -> Iterator[TaskRNG]:
        """Make this the thread's current task without routing its ops (a stage's backward,
        where a torch.utils.checkpoint recompute finds it: see :mod:`fastpipe.rng.state`)."""
        outer = _set_current(self)
        try:
            yield self
        finally:
            _set_current(outer)

    @staticmethod
    def _parked(device: torch.device) -> Tensor:
        with _lock(device):
            return _get_state(device)

    @contextlib.contextmanager
    def drawing(self, devices: list[torch.device]) -> Iterator[None]:
        """Hold the default generators of ``devices`` loaded with this task's state."""
        locks = [_lock(d) for d in devices]
        for lock in locks:
            lock.acquire()
        try:
            parked = [_get_state(d) for d in devices]
            for d in devices:
                state = self._states.get(d)
                if state is None:
                    _seed(d, self.seed)
                else:
                    _set_state(d, state)
            try:
                yield
            finally:
                for d, p in zip(devices, parked):
                    self._states[d] = _get_state(d)
                    _set_state(d, p)
        finally:
            for lock in reversed(locks):
                lock.release()

    def get_state(self, device: Any = "cpu") -> Tensor:
        """This task's stream state on ``device`` (what its next draw there starts from)."""
        device = _normal(device)
        with self.drawing([device]):
            return _get_state(device)

    def set_state(self, state: Tensor, device: Any = "cpu") -> None:
        """Move this task's stream on ``device`` to ``state`` (one :meth:`get_state` gave)."""
        device = _normal(device)
        with self.drawing([device]):
            _set_state(device, state)

    def generator(self, device: Any = "cpu") -> torch.Generator:
        """A fresh generator at this task's current position on ``device``, for an op that
        takes ``generator=`` but is not routed. Advances the task's stream by one draw so
        that two calls give different generators, reproducibly."""
        device = _normal(device)
        with self.drawing([device]):
            # The explicit generator keeps this draw from being routed (again) by the mode.
            seed = int(
                torch.empty((), dtype=torch.int64, device=device)
                .random_(0, 1 << 62, generator=_default_generator(device))
                .item()
            )
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        return gen

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func not in RANDOM_OPS or kwargs.get("generator") is not None or not _draws(func, args, kwargs):
            return func(*args, **kwargs)
        with self.drawing(_devices_of(args, kwargs)):
            return func(*args, **kwargs)


# Calls that draw only with a probability > 0 (and, for dropout, while training): (index of
# p, its default, index of training, its default). Without a draw they need no lock and no
# generator swap, which an attention without dropout would otherwise pay on every call.
_DRAWS_IF: dict[Any, tuple[int, str, float, int, str, bool]] = {
    F.scaled_dot_product_attention: (4, "dropout_p", 0.0, -1, "", True),
    **{f: (1, "p", 0.5, 2, "training", True) for f in (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d)},
    **{f: (1, "p", 0.5, 2, "training", False) for f in (F.alpha_dropout, F.feature_alpha_dropout)},
}


def _draws(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether this call of a random op draws at all (False for dropout with p=0 or not training)."""
    rule = _DRAWS_IF.get(func)
    if rule is None:
        return True
    p_at, p_name, p_default, train_at, train_name, train_default = rule
    p = kwargs.get(p_name, args[p_at] if len(args) > p_at else p_default)
    training = (
        train_default
        if train_at < 0
        else kwargs.get(train_name, args[train_at] if len(args) > train_at else train_default)
    )
    return bool(training) and p != 0


def current_generator(device: Any = "cpu") -> torch.Generator:
    """A generator drawn from the running task's stream (the default one outside a task).

    For random ops that :class:`TaskRNG` does not route: pass ``generator=`` this.
    """
    modes = torch.overrides._get_current_function_mode_stack()
    task = next((m for m in reversed(modes) if isinstance(m, TaskRNG)), None)
    if task is None:
        return _default_generator(_normal(device))
    return task.generator(device)
