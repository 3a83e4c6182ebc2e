"""Keep glibc from handing activation memory back to the OS between micro-batches.

Measured on the foundation workload (8 residual MLP blocks, 32-row micro-batches, one
stage): a worker thread allocates from its own glibc arena, whose heaps are unmapped as
soon as they fall empty, and large blocks are mmap'ed and munmap'ed one by one. Each
step then page-faults its activations in again: about 120,000 minor faults and 0.25 s
of system time per step against 0.45 s of user time; the same work on the main thread
faulted about 25,000 times.

:func:`tune_host_allocator` makes all threads share the main arena (``M_ARENA_MAX=1``),
raises the trim threshold to 1 GiB and fixes the mmap threshold at 32 MiB, the largest
glibc accepts. Freed activations then stay in the process and are reused: the faults
and the system time drop to about zero. Memory freed by the model is kept for reuse
(up to the trim threshold), as a caching allocator does.

It is process-wide, applies to glibc only, and must run before worker threads first
allocate. The runtimes apply it for CPU stages unless built with ``tune_malloc=False``
(:mod:`fastpipe.runtime.options`); such a pipe leaves the allocator as it finds it, and
cannot undo settings that another pipe of the process applied.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
import threading

__all__ = ["tune_host_allocator"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_lock = threading.Lock()
_state: bool | None = None


def tune_host_allocator() -> bool:
    """Apply the settings once per process; returns whether they are in effect."""
    global _state
    with _lock:
        if _state is not None:
            return _state
        _state = False
        if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
            return False
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            mallopt = libc.mallopt
        except (OSError, AttributeError):
            return False
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        mallopt.restype = ctypes.c_int
        ok = mallopt(_M_ARENA_MAX, 1) == 1
        ok = mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1 and ok
        ok = mallopt(_M_MMAP_THRESHOLD, 32 << 20) == 1 and ok
        _state = ok
        return ok
