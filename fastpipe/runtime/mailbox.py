"""Write-once slots through which pipeline workers hand values to each other."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Collection, Hashable, Iterator
from typing import Any

__all__ = ["Mailbox", "Aborted"]


class Aborted(Exception):
    """Raised in a worker waiting on a mailbox whose phase failed elsewhere."""


class Mailbox:
    """Slots keyed by e.g. ``("act", stage, mb)``; ``take`` blocks until ``put``.

    One condition variable serves all slots: a pipeline has a handful of workers, and
    ``abort`` can wake every waiter at once. A ``put`` wakes the waiters only when one of
    them waits for that key: most values arrive before their consumer asks (a skip, an
    activation while its consumer still works), and waking every blocked worker for each
    of them costs thread switches that show in the step time of a small model.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._slots: dict[Hashable, Any] = {}
        self._waiting: dict[Hashable, int] = {}  # keys a take or wait_any is blocked on, with their waiters
        self._aborted: BaseException | None = None

    def put(self, key: Hashable, value: Any) -> None:
        """Deliver ``value``; each key is written once per phase."""
        with self._cond:
            if key in self._slots:
                raise RuntimeError(f"fastpipe: mailbox slot {key!r} written twice (a schedule bug)")
            self._slots[key] = value
            if key in self._waiting:
                self._cond.notify_all()

    def take(self, key: Hashable) -> Any:
        """Remove and return the value for ``key``, waiting for it if needed."""
        with self._cond:
            if key not in self._slots:
                with self._awaited((key,)):
                    while key not in self._slots:
                        if self._aborted is not None:
                            raise Aborted(f"pipeline phase aborted while waiting for {key!r}") from None
                        self._cond.wait()
            return self._slots.pop(key)

    def __contains__(self, key: Hashable) -> bool:
        """Whether ``key`` holds a value now (``take`` would not wait)."""
        with self._cond:
            return key in self._slots

    def wait_any(self, keys: Collection[Hashable]) -> Hashable:
        """Wait until one of ``keys`` holds a value and return that key, leaving the value.

        The caller takes it afterwards; each key has one consumer, so it is still there.
        """
        with self._cond, self._awaited(keys):
            while True:
                if self._aborted is not None:
                    raise Aborted(f"pipeline phase aborted while waiting for one of {sorted(map(repr, keys))}")
                for key in keys:
                    if key in self._slots:
                        return key
                self._cond.wait()

    @contextlib.contextmanager
    def _awaited(self, keys: Collection[Hashable]) -> Iterator[None]:
        """Mark ``keys`` as waited for while the caller (holding the lock) waits."""
        for key in keys:
            self._waiting[key] = self._waiting.get(key, 0) + 1
        try:
            yield
        finally:
            for key in keys:
                left = self._waiting.pop(key) - 1
                if left:
                    self._waiting[key] = left

    def abort(self, exc: BaseException) -> None:
        """Wake every waiter with :class:`Aborted`; values already delivered are dropped."""
        with self._cond:
            self._aborted = exc
            self._slots.clear()
            self._cond.notify_all()
