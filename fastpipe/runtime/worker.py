"""Worker threads: one per pipeline worker, persistent across steps.

Each worker owns a queue of jobs. A *phase* (the forward part or the backward part of a
schedule) hands every worker one job and waits until all have finished or one has
failed. On failure the phase's mailbox is aborted, which wakes every worker blocked on a
dependency, so all of them return to idle and the pool stays usable: no thread is left
waiting forever and none is leaked.

Threads carry the caller's thread-local torch state (grad mode, autocast), which new
threads would otherwise not see (a long-standing torch issue for autocast in threads).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fastpipe.runtime.device import capabilities

__all__ = [
    "CallerState",
    "Phase",
    "WorkerPool",
    "autocast_types",
    "live_worker_threads",
    "make_current",
    "recomputing",
    "is_recomputing",
]

_AUTOCAST_TYPES = ("cpu", "cuda", "xpu", "mps")
_live = 0
_live_lock = threading.Lock()
_local = threading.local()


def is_recomputing() -> bool:
    """True while this thread replays a checkpointed forward for its backward.

    Layers with side effects in forward (e.g. :class:`fastpipe.DeferredBatchNorm`'s
    statistics) use it to apply them once, not again in the replay.
    """
    return getattr(_local, "recomputing", False)


@contextlib.contextmanager
def recomputing() -> Iterator[None]:
    """Mark this thread as replaying a forward (see :func:`is_recomputing`)."""
    before = is_recomputing()
    _local.recomputing = True
    try:
        yield
    finally:
        _local.recomputing = before


def autocast_types() -> tuple[str, ...]:
    """The device types whose autocast state a worker takes over from its caller.

    torch's own accelerators, and a PrivateUse1 backend once its device module offers
    autocast (torch refuses ``torch.autocast`` for one that does not).
    """
    name = torch._C._get_privateuse1_backend_name()
    if hasattr(getattr(torch, name, None), "get_amp_supported_dtype"):
        return (*_AUTOCAST_TYPES, name)
    return _AUTOCAST_TYPES


def live_worker_threads() -> int:
    """How many fastpipe worker threads are alive in this process."""
    return _live


@dataclass(frozen=True)
class CallerState:
    """Thread-local torch state of the calling thread, to be re-entered in workers.

    Attributes:
        grad_enabled, autocast, autocast_cache: the caller's grad mode and autocast.
        default_device: the caller's ``torch.set_default_device`` (thread-local in torch).
        streams: the caller's current CUDA streams, where one is not the device's
            default stream (thread-local too), so stage work is ordered after the work
            the caller queued on them.
    """

    grad_enabled: bool
    autocast: tuple[tuple[str, bool, torch.dtype], ...]
    autocast_cache: bool
    default_device: torch.device = torch.device("cpu")
    streams: tuple[Any, ...] = ()

    @staticmethod
    def capture() -> CallerState:
        """Snapshot the current thread's grad mode, autocast, default device and streams."""
        autocast = tuple(
            (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)) for dev in autocast_types()
        )
        return CallerState(
            torch.is_grad_enabled(),
            autocast,
            torch.is_autocast_cache_enabled(),
            torch.get_default_device(),
            _custom_streams(),
        )

    @contextlib.contextmanager
    def enter(self, grad_enabled: bool | None = None) -> Iterator[None]:
        """Re-enter the snapshot; ``grad_enabled`` overrides the captured grad mode."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled if grad_enabled is None else grad_enabled))
            for dev, enabled, dtype in self.autocast:
                if enabled:
                    stack.enter_context(torch.autocast(dev, dtype=dtype, cache_enabled=self.autocast_cache))
            yield

    def placed(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        """Run on a stage's ``device``: current device, the caller's stream and default device.

        A non-CPU default device of the stage's type becomes the stage's own device, the
        way the stage's parameters were moved there (``torch.arange(n)`` in a stage on
        ``cuda:1`` lands on ``cuda:1`` when the caller's default is ``cuda``); any other
        default (``meta``, or CUDA for a CPU stage) is kept as it is.
        """
        default = self.default_device
        streams = capabilities(device).streams
        if not streams and default.type == "cpu":
            return contextlib.nullcontext()  # the common CPU case costs nothing
        stack = contextlib.ExitStack()
        if streams:
            stack.enter_context(torch.cuda.device(device))  # first: it restores the thread's device on exit
            make_current(device)
            for stream in self.streams:
                if stream.device == device:
                    stack.enter_context(torch.cuda.stream(stream))
        if default.type != "cpu":
            stack.enter_context(torch.device(device if default.type == device.type else default))
        return stack


def _custom_streams() -> tuple[Any, ...]:
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return ()
    streams = []
    for i in range(torch.cuda.device_count()):
        stream = torch.cuda.current_stream(i)
        if stream != torch.cuda.default_stream(i):
            streams.append(stream)
    return tuple(streams)


def make_current(device: torch.device) -> None:
    """Give this thread a current CUDA context (once per thread) before it uses ``device``.

    torch's device guard skips ``cudaSetDevice`` when the target equals what
    ``cudaGetDevice`` reports, and a new thread reports device 0 with no context bound:
    cuBLAS then warns "no current CUDA context" and binds one itself. Binding the
    primary context up front, through the driver, avoids both.
    """
    if getattr(_local, "has_context", False):
        return
    _local.has_context = True
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        import fastpipe._C as _C

        if _C.backend_available("cuda"):
            _C.cuda_make_current(index)
            return
    except ImportError:  # pragma: no cover - the extension is part of the install
        pass
    torch.cuda.set_device(index)


class Phase:
    """The jobs of one phase in flight: who failed first, and how many are still running."""

    def __init__(self, on_error: Callable[[BaseException], None]) -> None:
        self.done = threading.Semaphore(0)
        self.count = 0
        self._on_error = on_error
        self._errors: list[BaseException] = []
        self._lock = threading.Lock()

    def report(self, exc: BaseException) -> None:
        """Record a failure; the first one calls ``on_error`` (which wakes the others)."""
        with self._lock:
            first = not self._errors
            self._errors.append(exc)
        if first:
            self._on_error(exc)

    def wait(self) -> None:
        """Wait for every job handed out; re-raise the first failure, if any."""
        for _ in range(self.count):
            self.done.acquire()
        self.count = 0
        if self._errors:
            raise self._errors[0]


class WorkerPool:
    """A fixed set of worker threads that run one job each per phase.

    Args:
        size: number of workers.
        name: thread name prefix, shown in debuggers and tracebacks.
    """

    def __init__(self, size: int, name: str = "fastpipe") -> None:
        self._queues: list[queue.SimpleQueue[Any]] = [queue.SimpleQueue() for _ in range(size)]
        self._threads: list[threading.Thread] = []
        self._closed = False
        for i, q in enumerate(self._queues):
            t = threading.Thread(target=_worker_main, args=(q,), name=f"{name}-worker-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    @property
    def size(self) -> int:
        return len(self._queues)

    def run(self, jobs: Sequence[Callable[[], None] | None], on_error: Callable[[BaseException], None]) -> None:
        """Run ``jobs[i]`` on worker ``i`` (``None`` skips it) and wait for all of them.

        ``on_error`` is called once, from the failing worker, with the first exception, so
        the caller can unblock the other workers. That first exception is re-raised here.
        """
        self.start(jobs, on_error).wait()

    def start(self, jobs: Sequence[Callable[[], None] | None], on_error: Callable[[BaseException], None]) -> Phase:
        """Hand ``jobs[i]`` to worker ``i`` and return at once; :meth:`Phase.wait` joins them.

        Between the two the calling thread may do work of its own, reporting its failure
        through :meth:`Phase.report` like a worker would.
        """
        if self._closed:
            raise RuntimeError("fastpipe: this pipeline's workers were closed")
        phase = Phase(on_error)
        for q, job in zip(self._queues, jobs):
            if job is not None:
                q.put((job, phase.report, phase.done))
                phase.count += 1
        return phase

    def close(self) -> None:
        """Stop the threads; idempotent. Called when the owning pipeline is collected."""
        if self._closed:
            return
        self._closed = True
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=10)


def _worker_main(q: queue.SimpleQueue[Any]) -> None:
    global _live
    with _live_lock:
        _live += 1
    try:
        while True:
            item = q.get()
            if item is None:
                return
            job, report, done = item
            del item  # a job holds its step's state (gradients among it): keep nothing once it ran
            try:
                job()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                report(exc)
            finally:
                # report holds the phase, and the phase its failure, whose traceback holds the
                # step (and through its autograd node the pipe): nothing of it may wait here.
                done.release()
                del job, report, done
    finally:
        with _live_lock:
            _live -= 1
