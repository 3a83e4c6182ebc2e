"""Bounded waits for the distributed runtime: nothing it does may wait forever.

:class:`Watchdog` bounds every wait on a ``Work`` handle and carries the abort side channel
(one key in the process group's store, written by the first rank that fails);
:class:`SendReaper` waits for sends in the background so their buffers are freed as soon as
they left; :func:`bounded_barrier` turns a rank that died before a collective into an error.
"""

from __future__ import annotations

import contextlib
import datetime
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fastpipe.distributed.settle import settle_at_exit
from fastpipe.errors import PipelineError
from fastpipe.runtime.worker import make_current

__all__ = [
    "DEFAULT_TIMEOUT",
    "FIRST_STEP_TIMEOUT",
    "SEND_POLL_MAX_PAUSE",
    "SendReaper",
    "Watchdog",
    "bounded_barrier",
    "default_store",
]

DEFAULT_TIMEOUT = 30.0
# Seconds: the bound on each wait of a pipeline's first step. A cold step can take minutes on
# a peer: first-launch Triton compiles are serialized process-wide, and NCCL connects lazily.
FIRST_STEP_TIMEOUT = 300.0
# Seconds: the longest pause between two polls of an NCCL send; a finished send is noticed at
# most this late, which only delays freeing its buffer.
SEND_POLL_MAX_PAUSE = 2e-3


def bounded_barrier(group: Any, timeout: float, what: str) -> None:
    """Wait for every rank of ``group``, at most ``timeout`` seconds; raise PipelineError naming the missing.

    Collectives (``gather_object``, ``broadcast_object_list``) wait forever for a dead rank.
    Calling this first turns a rank that died before the collective into an error. gloo's
    ``monitored_barrier`` names the ranks that did not arrive; other backends do not have it.
    """
    if dist.get_backend(group) != "gloo":  # monitored_barrier needs a group made with gloo alone
        return
    try:
        dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=timeout), wait_all_ranks=True)
    except RuntimeError as exc:
        raise PipelineError(
            f"fastpipe: {what}: not every rank arrived within {timeout:g} s (a rank died or hangs): {exc}"
        ) from exc


def default_store() -> dist.Store | None:
    """The default group's store (the abort side channel), or None: dead peers then still time out."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no default group, or one without a store
        return None


class Watchdog:
    """Bounded waits on ``Work`` handles plus the abort side channel in a ``Store``.

    A receive blocks in gloo's ``wait(timeout)`` (gloo's point-to-point ``Work`` only
    learns that it completed there, and an expired wait breaks the connection, so it is
    used once, with the whole bound). A peer that fails does not leave it waiting that
    long: :meth:`fail` calls ``on_fail``, with which the transport sends an abort header in
    place of every value this rank still owed its peers, and a dead peer's connection
    error ends the wait at once. Collectives are polled while the abort key is watched.

    Args:
        store: shared key-value store (the process group's), or None (timeouts only).
        key: the abort key; the first failing rank writes its diagnosis there.
        timeout: seconds any single wait may take (the bound in force: a runtime raises it for
            its first step, and :class:`SendReaper` reads it for each work it watches).
        rank: this process's global rank (for messages).
    """

    def __init__(self, store: dist.Store | None, key: str, timeout: float, rank: int) -> None:
        settle_at_exit()  # a rank's collectives run on gloo's worker threads
        self.store = store
        self.key = key
        self.timeout = timeout
        self.rank = rank
        self.failure: PipelineError | None = None
        self.on_fail: Callable[[str], None] | None = None
        # Run after on_fail, once: what must not outlive a failed step (NCCL communicators).
        self.aborts: list[Callable[[], object]] = []
        self._next_check = 0.0
        # A background watch (SendReaper) may fail the step while this thread does: the first
        # cause must still win, and the aborts run once.
        self._failing = threading.RLock()

    def published(self) -> str | None:
        """The abort message another rank wrote, if any."""
        if self.store is None:
            return None
        try:
            if self.store.check([self.key]):
                return self.store.get(self.key).decode()
        except Exception as exc:  # noqa: BLE001 - the store's host is gone
            return f"the store is unreachable ({type(exc).__name__}: {exc}); its host rank likely died"
        return None

    def publish(self, message: str) -> str:
        """Write ``message`` unless another rank failed first; returns the message that won."""
        if self.store is not None:
            with contextlib.suppress(Exception):  # the store is gone: nothing more to tell anyone
                won = self.store.compare_set(self.key, "", message)
                return won.decode() if isinstance(won, bytes) else str(won)
        return message

    def fail(self, diagnosis: str) -> PipelineError:
        """Record the failure (first cause wins) and return the error to raise.

        Safe to call from any thread: :class:`SendReaper`'s watch calls it when a work runs
        past its bound.
        """
        with self._failing:
            if self.failure is None:
                cause = self.published() or self.publish(diagnosis)
                self.failure = PipelineError(f"fastpipe: {cause}")
                if self.on_fail is not None:
                    with contextlib.suppress(Exception):  # best effort: peers still have the store and timeouts
                        self.on_fail(cause)
                for abort in self.aborts:  # after on_fail: the abort headers travel on gloo first
                    with contextlib.suppress(Exception):
                        abort()
            return self.failure

    def check(self) -> None:
        """Raise if the step failed on another rank (rate-limited store poll)."""
        if self.failure is not None:
            raise self.failure
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + 0.05
        message = self.published()
        if message is not None:
            raise self.fail(message)

    def wait(self, work: Any, what: str, peer: str) -> None:
        """Block for a receive, at most ``timeout`` seconds; ``peer`` names who should deliver."""
        if self.failure is not None:
            raise self.failure
        try:
            work.wait(datetime.timedelta(seconds=self.timeout))
        except BaseException as exc:  # noqa: BLE001 - gloo reports a lost peer or a timeout this way
            raise self.broken(exc, what, peer) from None

    def wait_collective(self, work: Any, what: str) -> None:
        """Poll a collective (gloo collectives complete in the background)."""
        self.poll(work, what, "a peer rank")

    def poll(self, work: Any, what: str, peer: str, max_pause: float = 2e-3) -> None:
        """Poll ``work`` until it completed, at most ``timeout`` seconds, watching the abort key.

        For work that completes in the background: collectives, and NCCL operations, whose
        ``wait()`` would only make the current CUDA stream wait. The pause between polls
        doubles up to ``max_pause``, which bounds how late a completion is noticed: keep it
        small where a compute action waits on the result (NCCL payloads).
        """
        if self.failure is not None:
            raise self.failure
        deadline = time.monotonic() + self.timeout
        pause = 5e-5
        while not work.is_completed():
            self.check()
            if time.monotonic() > deadline:
                raise self._late(what, peer)
            time.sleep(pause)
            pause = min(pause * 2, max_pause)
        try:
            work.wait()
        except BaseException as exc:  # noqa: BLE001
            raise self.broken(exc, what, peer) from None

    def _late(self, what: str, peer: str) -> PipelineError:
        return self.fail(
            f"{peer} did not deliver {what} within {self.timeout:g} s (dead or hung); seen from rank {self.rank}"
        )

    def broken(self, exc: BaseException, what: str, peer: str) -> PipelineError:
        """The error for a wait on ``what`` that raised ``exc`` (a timeout, or a lost peer)."""
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if "Timed out" in text or "timed out" in text:
            return self._late(what, peer)
        return self.fail(f"{peer} failed while rank {self.rank} waited for {what} ({text})")


class SendReaper:
    """Waits for works in the background; drops each buffer once its work completed.

    gloo only learns that an ``isend`` completed inside ``wait()``; without this thread a
    step would keep every sent activation alive until its end (defeating checkpointing).
    NCCL receives use it as their watchdog: the compute stream waits for them on the GPU
    while this thread polls them against the time bound, so the host never waits. When a
    polled work runs past the bound, this thread fails the step itself through the
    watchdog (peers told, NCCL communicators aborted): the step's own thread may be blocked
    in a CUDA synchronize behind that work, and would never reach :meth:`check` to do it.

    Args:
        timeout: seconds one work may take (its watchdog's bound in force, once it has one).
        poll: poll ``is_completed()`` (NCCL, whose ``wait()`` does not block the host).
        device: the CUDA device the works run on; the thread makes it current before its
            first CUDA call (a new thread would otherwise create a context on GPU 0).
        what: the works, for messages: "<what> rank <r> did not complete".
        watchdog: the step's watchdog, which the watch fails when a polled work is late; also
            taken from the first :meth:`check` or :meth:`drain` (a transport checks before it adds).
    """

    def __init__(
        self,
        timeout: float,
        poll: bool = False,
        device: torch.device | None = None,
        what: str = "a send from",
        watchdog: Watchdog | None = None,
    ) -> None:
        self.timeout = timeout
        self.poll = poll  # NCCL: wait() would not block the host; poll is_completed() instead
        self.device = device if device is not None and device.type == "cuda" else None
        self.what = what
        self.watchdog = watchdog
        self.error: BaseException | None = None
        self._pending = 0
        self._cond = threading.Condition()
        self._queue: queue.SimpleQueue[tuple[Any, Any] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def add(self, work: Any, buf: Any) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._main, daemon=True, name="fastpipe-sends")
            self._thread.start()
        with self._cond:
            self._pending += 1
        self._queue.put((work, buf))

    def _main(self) -> None:
        if self.device is not None:
            make_current(self.device)
        while (item := self._queue.get()) is not None:
            timeout = self.watchdog.timeout if self.watchdog is not None else self.timeout
            try:
                if self.poll:
                    # Back off as Watchdog.poll does: a fixed 0.1 ms pause took the GIL about 10k
                    # times a second from the thread that launches the kernels.
                    deadline = time.monotonic() + timeout
                    pause = 5e-5
                    while not item[0].is_completed():
                        if time.monotonic() > deadline:
                            self.error = self.error or TimeoutError(f"timed out after {timeout:g} s")
                            if self.watchdog is not None:  # the step's thread may be stuck behind it on the GPU
                                self.watchdog.fail(self._diagnosis(self.watchdog.rank))
                            raise self.error
                        time.sleep(pause)
                        pause = min(pause * 2, SEND_POLL_MAX_PAUSE)
                item[0].wait(datetime.timedelta(seconds=timeout))
            except BaseException as exc:  # noqa: BLE001 - handed to the step's thread
                self.error = self.error or exc
            del item
            with self._cond:
                self._pending -= 1
                self._cond.notify_all()

    def _diagnosis(self, rank: int) -> str:
        error = self.error
        text = (str(error).splitlines()[0] if str(error) else type(error).__name__) if error is not None else "?"
        return f"{self.what} rank {rank} did not complete ({text})"

    def drain(self, watchdog: Watchdog) -> None:
        """Wait until every send left (bounded; watching the abort key meanwhile)."""
        self.watchdog = self.watchdog or watchdog
        while True:
            with self._cond:
                if self._pending == 0 or self.error is not None:
                    break
                self._cond.wait(0.05)
            watchdog.check()
        if self.error is not None:
            raise watchdog.fail(self._diagnosis(watchdog.rank))

    def check(self, watchdog: Watchdog) -> None:
        """Raise now if a work already failed or ran past the bound (no waiting)."""
        self.watchdog = self.watchdog or watchdog
        if self.error is not None:
            self.drain(watchdog)

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread = None
