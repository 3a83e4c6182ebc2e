"""Reproducible randomness for stages that run in parallel threads.

What a pipeline promises: every (stage, micro-batch) task draws its random numbers from a
stream of its own, seeded from one number drawn from the caller's generator per step::

    caller's generator ──draw once per step──▶ step_seed
    task_seed(step_seed, stage, mb) ──▶ the task's stream, one per device it draws on

so dropout masks do not depend on thread timing, a recompute replays them bit for bit,
and every checkpoint mode gives the same bits. The stream of a task on a device is the
one ``torch.manual_seed(task_seed(...))`` starts on that device, so the pipe equals the
plain stages run with those seeds (the property tests compare exactly that).

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
that draw (:data:`RANDOM_OPS`, extensible with :func:`register_random_op`). For each such
call it takes the lock of each device the call draws on, loads the task's saved state into
that device's default generator (seeding it the first time), runs the call, saves the
advanced state back into the task and restores the generator's previous state::

    worker A (task a)          default CPU generator          worker B (task b)
    lock; load a's state ───▶  [a's stream]  ──▶ dropout
    save a's state; restore    [parked]
                               [b's stream]  ◀─── lock; load b's state; SDPA(dropout)
                               [parked]      ◀─── save b's state; restore; unlock

Every draw of a pipeline task therefore comes from its own stream, whatever runs beside it,
and the default generators are left as they were (the caller's generator moves once per
step, by :func:`draw_step_seed`). Only the random call itself holds the lock; the CPU
generator serialises its draws under its own mutex anyway. The routing sits at the top-level
call: inside a composite such as ``F.multi_head_attention_forward`` the mode is off, and the
nested draws find the task's state already loaded. Locks are taken CPU first, then CUDA by
index, so two tasks cannot deadlock.

**Cost only where there is randomness.** A ``TorchFunctionMode`` intercepts every op of its
thread (+38% host time on a 150-layer model of tiny Linears). :func:`may_draw` decides per
stage whether it could draw at all: a stage made only of ``torch.nn`` layers that never
draw (Linear, Conv, norms, activations, Embedding…; dropout-like layers only in eval), with
no hooks, runs without the mode and pays nothing. Anything fastpipe cannot see through
(a custom module's ``forward``, a hook, a loss given as a plain function) gets the mode.

**torch.utils.checkpoint inside a stage** saves and restores the random state through
``torch.get_rng_state``/``set_rng_state``/``fork_rng`` (and ``torch.cuda``'s): in a thread
running a task with a stream (:func:`current_task`) those address the task's streams, so
its recompute replays the task's draws (:mod:`fastpipe.rng_state`; torch's own elsewhere).

Limits: a random op that is none of :data:`RANDOM_OPS` (a custom CUDA extension drawing
from the default generator, say) is not routed; :class:`TaskRNG` notices that the default
generator moved during the task and warns (register the op, or pass it a generator from
:func:`current_generator`). Other threads of yours that draw from torch's default
generators *during* a step race with it, as they would with each other.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import module as module_globals
from torch.overrides import TorchFunctionMode

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
]

_MASK64 = (1 << 64) - 1


def draw_step_seed() -> int:
    """Consume one 63-bit number from the caller's default CPU generator."""
    return int(torch.empty((), dtype=torch.int64).random_(0, 1 << 62).item())


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def task_seed(step_seed: int, stage: int, microbatch: int) -> int:
    """A well-mixed seed for one (stage, micro-batch) task, stable across runs."""
    return _splitmix64(_splitmix64(step_seed ^ (stage << 32)) ^ microbatch) >> 1


# -- which calls draw -------------------------------------------------------------------


def _vf(name: str) -> Any:
    return getattr(torch._C._VariableFunctions, name, None)


# Calls that draw from a default generator when given none. Composites (SDPA, MHA, RReLU,
# gumbel-softmax, fractional pooling, nn.init) are listed as a whole: the mode does not see
# the draws nested inside them. RNN kernels draw for their inter-layer dropout.
RANDOM_OPS: set[Callable[..., Any]] = {
    f
    for f in (
        torch.rand,
        torch.randn,
        torch.randint,
        torch.randperm,
        torch.bernoulli,
        torch.multinomial,
        torch.normal,
        torch.poisson,
        torch.binomial,
        torch.rand_like,
        torch.randn_like,
        torch.randint_like,
        _vf("_standard_gamma"),
        _vf("_sample_dirichlet"),
        Tensor.uniform_,
        Tensor.normal_,
        Tensor.bernoulli_,
        Tensor.bernoulli,
        Tensor.random_,
        Tensor.exponential_,
        Tensor.geometric_,
        Tensor.log_normal_,
        Tensor.cauchy_,
        Tensor.multinomial,
        F.dropout,
        F.alpha_dropout,
        F.dropout1d,
        F.dropout2d,
        F.dropout3d,
        F.feature_alpha_dropout,
        torch.dropout,
        torch.dropout_,
        torch.alpha_dropout,
        torch.alpha_dropout_,
        torch.feature_dropout,
        torch.feature_dropout_,
        torch.feature_alpha_dropout,
        torch.feature_alpha_dropout_,
        _vf("native_dropout"),
        _vf("_fused_dropout"),
        F.scaled_dot_product_attention,
        F.multi_head_attention_forward,
        F.rrelu,
        F.rrelu_,
        torch.rrelu,
        torch.rrelu_,
        F.gumbel_softmax,
        F.fractional_max_pool2d,
        F.fractional_max_pool3d,
        F.fractional_max_pool2d_with_indices,
        F.fractional_max_pool3d_with_indices,
        _vf("lstm"),
        _vf("gru"),
        _vf("rnn_tanh"),
        _vf("rnn_relu"),
        nn.init.uniform_,
        nn.init.normal_,
        nn.init.trunc_normal_,
        nn.init.kaiming_uniform_,
        nn.init.kaiming_normal_,
        nn.init.xavier_uniform_,
        nn.init.xavier_normal_,
        nn.init.orthogonal_,
        nn.init.sparse_,
    )
    if f is not None
}


def register_random_op(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Route ``fn`` through the task's stream too (usable as a decorator).

    For a function that draws from torch's default generator without taking a
    ``generator=`` (a custom op, say) and that torch function modes see, i.e. a torch op,
    a ``torch.ops`` op, or a Python function that calls ``handle_torch_function``.
    """
    RANDOM_OPS.add(fn)
    return fn


# Layers that draw while training. Checked by exact type: a subclass may override forward.
_DRAW_WHEN_TRAINING: frozenset[type[nn.Module]] = frozenset(
    {
        nn.Dropout,
        nn.Dropout1d,
        nn.Dropout2d,
        nn.Dropout3d,
        nn.AlphaDropout,
        nn.FeatureAlphaDropout,
        nn.RReLU,
        nn.MultiheadAttention,
        nn.Transformer,
        nn.TransformerEncoder,
        nn.TransformerDecoder,
        nn.TransformerEncoderLayer,
        nn.TransformerDecoderLayer,
        nn.RNN,
        nn.LSTM,
        nn.GRU,
    }
)
_ALWAYS_DRAW: frozenset[type[nn.Module]] = frozenset({nn.FractionalMaxPool2d, nn.FractionalMaxPool3d})
_DETERMINISTIC: set[type[nn.Module]] = set()


def register_deterministic(cls: type[nn.Module]) -> type[nn.Module]:
    """Declare that ``cls``'s forward never draws random numbers (usable as a decorator).

    Stages made only of such layers run without :class:`TaskRNG`'s per-op interception.
    """
    _DETERMINISTIC.add(cls)
    return cls


def _module_may_draw(m: nn.Module) -> bool:
    cls = type(m)
    if m._forward_hooks or m._forward_pre_hooks:  # arbitrary code
        return True
    if cls in _DRAW_WHEN_TRAINING:
        return m.training
    if cls in _ALWAYS_DRAW:
        return True
    if isinstance(m, nn.modules.lazy.LazyModuleMixin) and m.has_uninitialized_params():
        return True  # initialises its weights (randomly) in its first forward
    return cls not in _DETERMINISTIC and not cls.__module__.startswith("torch.nn.modules.")


def may_draw(module: nn.Module, extra: Callable[..., Any] | None = None) -> bool:
    """Whether running ``module`` (then ``extra``, e.g. a loss) could draw random numbers.

    False only when fastpipe can see that nothing in it draws: every submodule is a
    ``torch.nn`` layer that does not draw in its current mode (or was registered with
    :func:`register_deterministic`), no hooks are set, and ``extra`` is None, such a
    module, or a function of ``torch.nn.functional`` that does not draw.
    """
    if module_globals._global_forward_hooks or module_globals._global_forward_pre_hooks:
        return True
    if any(_module_may_draw(m) for m in module.modules()):
        return True
    if extra is None:
        return False
    if isinstance(extra, nn.Module):
        return may_draw(extra)
    return getattr(extra, "__module__", None) != "torch.nn.functional" or extra in RANDOM_OPS


# -- per-device default generators, and their locks ----------------------------------------

_locks: dict[torch.device, threading.RLock] = {}
_locks_guard = threading.Lock()


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
    torch.cuda.init()
    return torch.cuda.default_generators[device.index]


def _normal(device: Any) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device if device.type == "cuda" else torch.device("cpu")


_CPU = torch.device("cpu")
_ONLY_CPU = [_CPU]


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
    return sorted(found, key=lambda d: (d.type != "cpu", d.index or 0))


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
        seed: the task's seed (:func:`task_seed`).
        watch: devices whose default generator the task must leave untouched; on exit,
            :class:`TaskRNG` warns if one moved, which means a random op it does not
            route drew from it (and will not replay).
    """

    def __init__(self, seed: int, watch: Iterable[torch.device] = ()) -> None:
        super().__init__()
        self.seed = seed
        self._states: dict[torch.device, Tensor] = {}
        self._watch = sorted({_normal(d) for d in watch}, key=lambda d: (d.type != "cpu", d.index or 0))
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
        where a torch.utils.checkpoint recompute finds it: see :mod:`fastpipe.rng_state`)."""
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
        if func not in RANDOM_OPS or kwargs.get("generator") is not None:
            return func(*args, **kwargs)
        with self.drawing(_devices_of(args, kwargs)):
            return func(*args, **kwargs)


def current_generator(device: Any = "cpu") -> torch.Generator:
    """A generator drawn from the running task's stream (the default one outside a task).

    For random ops that :class:`TaskRNG` does not route: pass ``generator=`` this.
    """
    modes = torch.overrides._get_current_function_mode_stack()
    task = next((m for m in reversed(modes) if isinstance(m, TaskRNG)), None)
    if task is None:
        return _default_generator(_normal(device))
    return task.generator(device)
