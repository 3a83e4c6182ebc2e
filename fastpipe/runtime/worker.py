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

__all__ = ["CallerState", "WorkerPool", "live_worker_threads", "recomputing", "is_recomputing"]

_AUTOCAST_TYPES = ("cpu", "cuda")
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


def live_worker_threads() -> int:
    """How many fastpipe worker threads are alive in this process."""
    return _live


@dataclass(frozen=True)
class CallerState:
    """Thread-local torch state of the calling thread, to be re-entered in workers."""

    grad_enabled: bool
    autocast: tuple[tuple[str, bool, torch.dtype], ...]
    autocast_cache: bool

    @staticmethod
    def capture() -> CallerState:
        """Snapshot the current thread's grad mode and autocast settings."""
        autocast = tuple(
            (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)) for dev in _AUTOCAST_TYPES
        )
        return CallerState(torch.is_grad_enabled(), autocast, torch.is_autocast_cache_enabled())

    @contextlib.contextmanager
    def enter(self, grad_enabled: bool | None = None) -> Iterator[None]:
        """Re-enter the snapshot; ``grad_enabled`` overrides the captured grad mode."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled if grad_enabled is None else grad_enabled))
            for dev, enabled, dtype in self.autocast:
                if enabled:
                    stack.enter_context(torch.autocast(dev, dtype=dtype, cache_enabled=self.autocast_cache))
            yield


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
        if self._closed:
            raise RuntimeError("fastpipe: this pipeline's workers were closed")
        done = threading.Semaphore(0)
        errors: list[BaseException] = []
        lock = threading.Lock()

        def report(exc: BaseException) -> None:
            with lock:
                first = not errors
                errors.append(exc)
            if first:
                on_error(exc)

        count = 0
        for q, job in zip(self._queues, jobs):
            if job is not None:
                q.put((job, report, done))
                count += 1
        for _ in range(count):
            done.acquire()
        if errors:
            raise errors[0]

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
                del job
                done.release()
    finally:
        with _live_lock:
            _live -= 1
