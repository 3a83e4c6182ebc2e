"""Let gloo's worker threads finish with the last collective before the interpreter ends.

A gloo collective runs on one of its process group's worker threads. The caller sees it
complete, and only then does the worker drop its reference to the work and, with it, to the
work's tensors. A tensor made in Python needs the GIL to be freed. When the main thread ends
the interpreter in the milliseconds between the two, CPython ends the worker thread inside
that destructor and the C++ runtime calls ``std::terminate``: a run that succeeded exits with
SIGABRT ("terminate called without an active exception"). With torch 2.13 and Python 3.11 this
followed the last collective of an asynchronous checkpoint in 5 of 15 runs of the checkpoint
recipe in docs/checkpoints.md (2026-12-02); torchrun then restarted a finished job.

:func:`settle_at_exit` registers, once per process, an exit hook that releases the GIL for
:data:`SETTLE_SECONDS`, before the interpreter starts finalizing: a worker waiting for the GIL
takes it at once, frees the tensors, and goes back to waiting for work, which it never gets.
"""

from __future__ import annotations

import atexit
import threading
import time

__all__ = ["SETTLE_SECONDS", "settle_at_exit"]

# A worker needs microseconds once it holds the GIL; the margin is for a loaded host, where
# it may wait tens of milliseconds for a core.
SETTLE_SECONDS = 0.2

_registered = threading.Event()


def _settle() -> None:
    time.sleep(SETTLE_SECONDS)


def settle_at_exit() -> None:
    """Register the exit hook (once per process); called wherever fastpipe runs gloo collectives."""
    if not _registered.is_set():
        _registered.set()
        atexit.register(_settle)
