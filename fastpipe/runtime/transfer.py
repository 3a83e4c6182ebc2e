"""Asynchronous tensor copies between devices, for inter-stage traffic.

``start_transfer(src, device)`` enqueues the copy on the copy stream of a device and
returns a :class:`Transfer` at once; ``Transfer.wait()`` hands the destination tensor to
the consumer. The ordering, CUDA -> CUDA::

    producer's current stream (src dev) ──record──▶ ready ─┐
    consumer's current stream (dst dev) ──record──▶ free ──┤  (dst memory was allocated
                                                           │   on this stream: it may still
                                                           ▼   be read by older kernels)
    copy stream (dst dev)          wait(ready), wait(free), copy ──record──▶ done
                                                                              │
    consumer's current stream, in Transfer.wait()  ◀──────── wait(done) ──────┘

Copies into a device's memory and copies out of it to the host run on two copy streams
of that device (:func:`fastpipe.runtime.device.copy_stream`), so they overlap.

Memory safety of the copies does not rely on ``Tensor.record_stream``: every buffer an
in-flight copy touches (source, destination, pinned staging block) is put on a
deferred-release list with the copy's ``done`` event, and is only dropped once the event
has completed. So a :class:`Transfer` dropped before completion never frees memory under
a running copy.

The consumer is another matter. The destination is allocated on the destination device's
current stream *of the thread that starts the copy* (the producer's, usually the default
stream), but the consumer may run on another one (the caller's stream, which a worker
enters for its stage). The caching allocator would then hand the memory out again once
the allocating stream had moved on, while the consumer's kernels still read it, so
:meth:`Transfer.wait` calls ``record_stream`` for the consumer's stream when it differs.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch

import fastpipe._C as _C
from fastpipe.runtime import device as _dev

__all__ = ["Transfer", "collect_pending", "pending_count", "start_transfer", "synchronize_pending"]

_pending_lock = threading.Lock()
_pending: list[tuple[Any, tuple[object, ...]]] = []


def _reset_after_fork() -> None:
    # Copies in flight in the parent are not ours to track in a forked child.
    global _pending_lock
    _pending_lock = threading.Lock()
    _pending.clear()


os.register_at_fork(after_in_child=_reset_after_fork)


def _defer(event: Any, keep: tuple[object, ...]) -> None:
    """Keep ``keep`` alive until ``event`` completes."""
    with _pending_lock:
        _pending.append((event, keep))


def collect_pending() -> int:
    """Drop buffers whose copies have completed; return how many entries remain."""
    with _pending_lock:
        _pending[:] = [entry for entry in _pending if not entry[0].query()]
        return len(_pending)


def pending_count() -> int:
    """Number of (event, buffers) entries still waiting for their copy to complete."""
    with _pending_lock:
        return len(_pending)


def synchronize_pending() -> None:
    """Block until every in-flight copy has completed, then release its buffers."""
    with _pending_lock:
        entries = list(_pending)
    for event, _ in entries:
        event.synchronize()
    collect_pending()


class Transfer:
    """An in-flight copy of one tensor to another device."""

    __slots__ = ("_device", "_event", "_result", "_staged", "_shape", "_dtype", "_stream")

    def __init__(
        self,
        result: torch.Tensor | None,
        device: torch.device,
        event: Any = None,
        staged: Any = None,
        shape: torch.Size | None = None,
        dtype: torch.dtype | None = None,
        stream: int | None = None,
    ) -> None:
        self._result = result
        self._device = device
        self._event = event
        # CUDA -> CPU: the pinned block the copy lands in, copied out in wait().
        self._staged = staged
        self._shape = shape
        self._dtype = dtype
        # CUDA destination: the raw handle of the stream its memory was allocated on.
        self._stream = stream

    @property
    def device(self) -> torch.device:
        """The destination device."""
        return self._device

    def done(self) -> bool:
        """True when the copy has completed (never blocks)."""
        collect_pending()
        return self._event is None or bool(self._event.query())

    def wait(self) -> torch.Tensor:
        """Return the destination tensor, ordered after the copy.

        CUDA destination: the caller's *current* torch stream on that device is made to
        wait for the copy (the host does not block). CPU destination: blocks until the
        copy is done.
        """
        if self._event is None:
            assert self._result is not None
            return self._result
        if _dev.capabilities(self._device).c_copies:
            self._event.wait(_dev.current_stream(self._device))
            assert self._result is not None
            consumer = torch.cuda.current_stream(self._device)
            if self._stream is not None and consumer.cuda_stream != self._stream:
                self._result.record_stream(consumer)  # see the module docstring
                self._stream = consumer.cuda_stream  # once per consumer stream
            return self._result
        self._event.synchronize()
        self._finish_staged()
        assert self._result is not None
        return self._result

    def _finish_staged(self) -> None:
        # We copy out of the pinned block rather than returning a tensor that views it:
        # a received activation is often saved for backward and lives for many
        # micro-batches, and page-locked memory is scarce (it cannot be swapped and
        # slows the whole host when overused). A host memcpy is cheap next to the
        # PCIe copy, and the block goes straight back to the pool for the next copy.
        block = self._staged
        if block is None:
            return
        assert self._shape is not None and self._dtype is not None
        out = torch.empty(self._shape, dtype=self._dtype)
        _C.memcpy(out.data_ptr(), block.ptr, block.nbytes)
        block.release()
        self._staged = None
        self._result = out

    def __repr__(self) -> str:
        state = "done" if self._event is None or self._event.query() else "in flight"
        return f"<Transfer to {self._device} ({state})>"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def start_transfer(src: torch.Tensor, device: torch.device | str, *, force: bool = False) -> Transfer:
    """Start copying ``src`` to ``device``; return the in-flight :class:`Transfer`.

    Args:
        src: any tensor (non-contiguous is made contiguous first).
        device: the destination device.
        force: copy even when ``src`` is already on ``device`` (CPU -> CPU goes
            through the host backend's copy stream, so the asynchronous path can be
            tested without a GPU).

    The destination is contiguous, has ``src``'s dtype and shape, and does not require
    grad (the engine handles autograd itself). Without ``force``, a tensor already on
    ``device`` is returned as is. The caller must not modify ``src`` in place until the
    transfer is done (as with ``non_blocking=True`` copies in torch).

    For a CUDA destination, ``wait()`` orders the stream current in the consumer's
    thread after the copy, and tells the caching allocator about that stream when the
    destination was allocated on another one; using the result on further streams needs
    the usual ``record_stream``/event care, as for any tensor in torch.
    """
    device = _dev.normalize(device)
    collect_pending()
    if src.device == device and not force:
        return Transfer(src, device)

    src_c = src.detach().contiguous()
    nbytes = _nbytes(src_c)
    src_cuda = _dev.capabilities(src_c.device).c_copies
    dst_cuda = _dev.capabilities(device).c_copies
    if not (src_cuda or src_c.device.type == "cpu") or not (dst_cuda or device.type == "cpu"):
        # A device fastpipe._C does not drive (XPU, MPS, PrivateUse1, meta, or CUDA
        # without its driver): torch's own copy, ordered on that device's current stream.
        return Transfer(src_c.to(device, copy=True), device)

    if nbytes == 0:
        with _dev.device_context(device):
            return Transfer(torch.empty(src_c.shape, dtype=src_c.dtype, device=device), device)

    if not src_cuda and not dst_cuda:
        return _host_to_host(src_c, device, nbytes)
    if not src_cuda:
        return _host_to_device(src_c, device, nbytes)
    if not dst_cuda:
        return _device_to_host(src_c, device, nbytes)
    return _device_to_device(src_c, device, nbytes)


def _host_to_host(src: torch.Tensor, device: torch.device, nbytes: int) -> Transfer:
    dst = torch.empty(src.shape, dtype=src.dtype)
    stream = _dev.copy_stream(device, "in")
    stream.copy(dst.data_ptr(), src.data_ptr(), nbytes, "h2h")
    done = stream.record_event()
    _defer(done, (src, dst))
    return Transfer(dst, device, done)


def _consumer_free_event(device: torch.device) -> Any:
    """An event after the work queued on ``device``'s current stream so far.

    A tensor just allocated by the caching allocator on the current stream may reuse
    memory that older kernels on that stream still read; the copy stream waits for
    this event before writing into it.
    """
    event = _C.Event()
    event.record(_dev.current_stream(device))
    return event


def _host_to_device(src: torch.Tensor, device: torch.device, nbytes: int) -> Transfer:
    with _dev.device_context(device):
        dst = torch.empty(src.shape, dtype=src.dtype, device=device)
    stream = _dev.copy_stream(device, "in")
    _consumer_free_event(device).wait(stream)
    keep: tuple[object, ...]
    if src.is_pinned():
        host_ptr, keep = src.data_ptr(), (src,)
    else:
        # Pageable memory: stage into a pinned block so the copy is truly async.
        block = _dev.host_pool(pinned=_dev.capabilities(device).pinned).acquire(nbytes)
        _C.memcpy(block.ptr, src.data_ptr(), nbytes)
        host_ptr, keep = block.ptr, (block,)
    stream.copy(dst.data_ptr(), host_ptr, nbytes, "h2d")
    done = stream.record_event()
    _defer(done, keep + (dst,))
    return Transfer(dst, device, done, stream=_dev.current_stream_handle(device))


def _device_to_host(src: torch.Tensor, device: torch.device, nbytes: int) -> Transfer:
    ready = _C.Event()
    ready.record(_dev.current_stream(src.device))
    stream = _dev.copy_stream(src.device, "out")
    ready.wait(stream)
    block = _dev.host_pool(pinned=_dev.capabilities(src.device).pinned).acquire(nbytes)
    stream.copy(block.ptr, src.data_ptr(), nbytes, "d2h")
    done = stream.record_event()
    _defer(done, (src, block))
    return Transfer(None, device, done, staged=block, shape=src.shape, dtype=src.dtype)


def _device_to_device(src: torch.Tensor, device: torch.device, nbytes: int) -> Transfer:
    ready = _C.Event()
    ready.record(_dev.current_stream(src.device))
    with _dev.device_context(device):
        dst = torch.empty(src.shape, dtype=src.dtype, device=device)
    stream = _dev.copy_stream(device, "in")
    ready.wait(stream)
    _consumer_free_event(device).wait(stream)
    if src.device == device:
        stream.copy(dst.data_ptr(), src.data_ptr(), nbytes, "d2d")
    else:
        stream.copy_peer(dst.data_ptr(), device.index, src.data_ptr(), src.device.index, nbytes)
    done = stream.record_event()
    _defer(done, (src, dst))
    return Transfer(dst, device, done, stream=_dev.current_stream_handle(device))
