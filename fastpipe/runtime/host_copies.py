"""Copies of saved activations to host memory and back, for offload (:mod:`fastpipe.runtime.offload`).

Which way a device's tensors go is a row of the capability table (:mod:`fastpipe.runtime.device`):

============================  ==================================================================
device                        copies
============================  ==================================================================
CUDA with ``fastpipe._C``     into page-locked blocks of ``_C``'s pinned pool, on the device's
                              D2H copy stream, and back on its H2D stream, ordered by events
                              against the compute stream: the worker does not wait for either
CPU (tests only: ``force``)   ``_C``'s host backend, the same code over host streams and an
                              aligned pool; offloading a CPU stage saves nothing
any other accelerator         torch's own copies, into pinned host memory where the device
                              has torch streams (CUDA without ``_C``), pageable elsewhere;
                              they block the worker while they run
============================  ==================================================================

A CUDA device whose host cannot give page-locked memory is refused (:func:`check_host_memory`):
without it an asynchronous copy to the host does not exist, and offload would stall every step.

Only dense tensors that are the whole of their storage go through ``_C`` (a raw byte copy of the
storage keeps the exact strides); the caller leaves others on the device.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

import fastpipe._C as _C
from fastpipe.runtime import device as _dev

__all__ = ["CopyPath", "HostMemoryError", "check_host_memory", "copy_path", "pending_copies"]


_lock = threading.Lock()
_pending: list[tuple[Any, tuple[object, ...]]] = []


def _defer(event: Any, *keep: object) -> None:
    """Keep ``keep`` (the buffers a copy reads and writes) alive until ``event`` has completed.

    A pooled host block dropped under a running copy would go to the next copy while this one
    still reads or writes it; a device tensor would go back to the caching allocator.
    """
    with _lock:
        _pending[:] = [entry for entry in _pending if not entry[0].query()]
        _pending.append((event, keep))


def pending_copies() -> int:
    """Drop the buffers of the copies that have landed; returns how many are still in flight.

    Called before a stage allocates (a forward, a copy back), so that a device copy whose host
    copy has landed is gone by then, as the memory model assumes, and not kept until the next
    copy starts.
    """
    with _lock:
        _pending[:] = [entry for entry in _pending if not entry[0].query()]
        return len(_pending)


class HostMemoryError(RuntimeError):
    """The host cannot give the page-locked memory that offload to it needs."""


def check_host_memory(device: torch.device) -> None:
    """Raise unless offload from ``device`` can get the host memory it copies into.

    Raises:
        HostMemoryError: a device whose copies need page-locked host memory (CUDA) on a host
            that cannot allocate it, naming why.
    """
    caps = _dev.capabilities(device)
    try:
        if caps.pinned:
            _dev.host_pool(pinned=True).acquire(1).release()
        elif caps.streams:
            torch.empty(1, pin_memory=True)
    except RuntimeError as exc:
        raise HostMemoryError(
            f"fastpipe: offload from {device} needs page-locked (pinned) host memory, and this host cannot "
            f"allocate it ({exc}); run without offload= (or offload=0), or raise the host's locked-memory "
            "limit (ulimit -l)"
        ) from exc


class CopyPath:
    """How one device's saved tensors go to host memory and come back.

    Args:
        device: the stage's device.
        force: copy CPU tensors through ``_C``'s host backend (tests of the asynchronous path).
    """

    def __init__(self, device: torch.device, *, force: bool = False) -> None:
        self.device = device
        caps = _dev.capabilities(device)
        self.c_copies = caps.c_copies or (force and device.type == "cpu")
        self.cuda = caps.c_copies
        self.pinned = caps.pinned or caps.streams

    def fits(self, t: torch.Tensor) -> bool:
        """Whether ``t`` can go this way: ``_C`` copies need the whole of a plain tensor's storage."""
        if not self.c_copies:
            return True
        if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            return False
        return t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()

    def to_host(self, t: torch.Tensor) -> tuple[Any, Any]:
        """Start copying ``t`` to host memory: ``(host copy, event or None)``.

        With an event, ``t`` must stay alive until it completes.
        """
        if not self.c_copies:
            host = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu", pin_memory=self.pinned)
            host.copy_(t)
            return host, None
        nbytes = t.numel() * t.element_size()
        stream = _dev.copy_stream(self.device, "out")
        if self.cuda:  # after the kernels that wrote t
            ready = _C.Event()
            ready.record(_dev.current_stream(self.device))
            ready.wait(stream)
        block = _dev.host_pool(pinned=self.cuda).acquire(nbytes)
        stream.copy(block.ptr, t.data_ptr(), nbytes, "d2h" if self.cuda else "h2h")
        done = stream.record_event()
        _defer(done, t.detach(), block)  # detached: its storage, not the graph behind it
        return block, done

    def to_device(self, host: Any, like: tuple[torch.Size, tuple[int, ...], torch.dtype], after: Any) -> Any:
        """Start copying ``host`` back into a new device tensor shaped ``like``: ``(tensor, event or None)``.

        Args:
            host: what :meth:`to_host` returned.
            like: the tensor's shape, strides and dtype.
            after: the event of the copy to the host (it must land before this one reads it), or None.
        """
        shape, stride, dtype = like
        if after is not None:
            # The device copy goes when the copy out has landed: wait for that before allocating
            # the one that comes back, or a late copy (a busy host, a slow link) would hold the
            # tensor twice. The copy out started at the forward's end, long before, so this
            # seldom waits.
            if not after.query():
                after.synchronize()
            pending_copies()
        with _dev.device_context(self.device):
            dst = torch.empty_strided(shape, stride, dtype=dtype, device=self.device)
        if not self.c_copies:
            dst.copy_(host)
            return dst, None
        stream = _dev.copy_stream(self.device, "in")
        if self.cuda:  # dst may reuse memory that older kernels of the compute stream still read
            free = _C.Event()
            free.record(_dev.current_stream(self.device))
            free.wait(stream)
        if after is not None:
            after.wait(stream)
        stream.copy(dst.data_ptr(), host.ptr, host.nbytes, "h2d" if self.cuda else "h2h")
        done = stream.record_event()
        _defer(done, host, dst)
        return dst, done

    def wait(self, t: torch.Tensor, event: Any, allocated_on: int | None) -> None:
        """Order the calling thread's use of ``t`` after its copy ``event``.

        CUDA: the caller's current stream waits for the copy (the host does not block), and the
        caching allocator learns of that stream where ``t`` was allocated on another one.
        """
        if event is None:
            return
        if not self.cuda:
            event.synchronize()
            pending_copies()  # the copy has landed: its entry no longer keeps ``t`` past its backward
            return
        event.wait(_dev.current_stream(self.device))
        consumer = torch.cuda.current_stream(self.device)
        if allocated_on is not None and consumer.cuda_stream != allocated_on:
            t.record_stream(consumer)

    def allocating_stream(self) -> int | None:
        """The raw handle of the stream a tensor allocated now belongs to (CUDA), else None."""
        return _dev.current_stream_handle(self.device) if self.cuda else None


def copy_path(device: torch.device, *, force: bool = False) -> CopyPath | None:
    """The copies for offload from ``device``; None for a CPU stage (its memory is host memory already).

    Args:
        device: the stage's device.
        force: run a CPU stage's copies through ``_C``'s host backend anyway (tests).
    """
    if device.type == "cpu" and not force:
        return None
    return CopyPath(device, force=force)
