"""Devices, copy streams and pinned pools: the torch-facing side of ``fastpipe._C``.

``fastpipe._C`` speaks raw pointers, byte counts and stream handles. This module maps
``torch.device`` objects onto it:

* what the runtime may use on a device type is one row of a small table
  (:func:`capabilities`): CUDA has torch streams, ``_C`` copies and pinned staging; every
  other accelerator (XPU, MPS, a PrivateUse1 backend such as the tests' emulated device)
  takes the generic path, torch's own ``Tensor.to`` and no stream handling;
* a CUDA device ``cuda:i`` uses the CUDA backend (runtime device ``i``) when the driver
  can be loaded; the CPU uses the host backend (runtime device ``-1``);
* each device gets two cached copy streams, created on first use (thread-safe): one for
  copies into its memory (H2D, D2D) and one for copies out of it (D2H), so that an
  activation arriving and an offload leaving overlap instead of queueing on one stream;
* torch's current CUDA stream is wrapped (not owned) with ``_C.Stream.from_handle``.

The CUDA driver is only touched when a CUDA device is asked about, never at import, so
importing fastpipe before forking stays safe.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch

import fastpipe._C as _C

__all__ = [
    "COPY_DIRECTIONS",
    "HOST_DEVICE",
    "Capabilities",
    "as_torch_stream",
    "backend_for",
    "capabilities",
    "copy_stream",
    "current_stream",
    "current_stream_handle",
    "device_context",
    "host_pool",
    "normalize",
    "runtime_device",
]

#: The runtime device index of the host backend.
HOST_DEVICE = -1

_lock = threading.Lock()
_copy_streams: dict[tuple[int, str], _C.Stream] = {}
#: The two copy directions of a device: into its memory, and out of it to the host.
COPY_DIRECTIONS = ("in", "out")
_wrapped_streams: dict[tuple[int, int], _C.Stream] = {}
_pools: dict[str, _C.HostBufferPool] = {}


def _reset_after_fork() -> None:
    # Host streams' worker threads do not survive fork(); the child starts afresh.
    global _lock
    _lock = threading.Lock()
    _copy_streams.clear()
    _wrapped_streams.clear()


os.register_at_fork(after_in_child=_reset_after_fork)


@dataclass(frozen=True)
class Capabilities:
    """What fastpipe's runtime uses on one device type.

    Attributes:
        streams: torch's CUDA stream API drives it: a stage runs under ``torch.cuda.device``
            with a bound context and the caller's current streams, and copies are ordered
            on streams by events.
        c_copies: ``fastpipe._C``'s copy streams and events move its tensors (else
            :mod:`fastpipe.runtime.transfer` uses ``Tensor.to``).
        pinned: host copies are staged through ``fastpipe._C``'s pinned pool.
    """

    streams: bool
    c_copies: bool
    pinned: bool


#: The CPU, and any accelerator without a path of its own (XPU, MPS, PrivateUse1 backends).
_GENERIC = Capabilities(streams=False, c_copies=False, pinned=False)
_CUDA = Capabilities(streams=True, c_copies=True, pinned=True)
#: CUDA whose driver ``fastpipe._C`` cannot load (unusual: torch loaded it).
_CUDA_WITHOUT_C = Capabilities(streams=True, c_copies=False, pinned=False)


def capabilities(device: torch.device | str | int) -> Capabilities:
    """The row of the capability table for ``device``'s type (``int``: a CUDA ordinal)."""
    kind = torch.device(device).type if not isinstance(device, int) else "cuda"
    if kind == "cuda":
        return _CUDA if _C.backend_available("cuda") else _CUDA_WITHOUT_C
    return _GENERIC


def normalize(device: torch.device | str | int) -> torch.device:
    """``device`` with its index: an accelerator without one means its current device.

    autograd's engine wants explicit indices (it asserts on a bare ``"xpu"``), and equal
    devices must compare equal (``cuda`` and ``cuda:0`` do not).
    """
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type in ("cpu", "meta") or device.index is not None:
        return device
    if device.type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    module: Any = getattr(torch, device.type, None)
    current = getattr(module, "current_device", None)
    index = current() if callable(current) else 0
    return torch.device(device.type, index if isinstance(index, int) else 0)


def device_context(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Make ``device`` the thread's current device where torch keeps one per thread (CUDA)."""
    if capabilities(device).streams:
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def backend_for(device: torch.device | str | int) -> str:
    """Return the ``_C`` backend serving ``device``: ``"cuda"`` or ``"host"``.

    A device without ``_C`` copies (a CUDA device whose driver ``_C`` cannot load, or any
    other accelerator) reports ``"host"``; :mod:`fastpipe.runtime.transfer` then uses
    ``Tensor.to`` for it.
    """
    return "cuda" if capabilities(device).c_copies else "host"


def runtime_device(device: torch.device | str | int) -> int:
    """Return the ``_C`` device index for ``device``: the CUDA ordinal, or -1 (host)."""
    device = normalize(device)
    if backend_for(device) == "cuda":
        assert device.index is not None
        return device.index
    return HOST_DEVICE


def copy_stream(device: torch.device | str | int, direction: str = "in") -> _C.Stream:
    """Return ``device``'s copy stream for ``direction``, created on first use.

    Args:
        device: the device whose memory the copy reads or writes.
        direction: ``"in"`` for copies that write ``device``'s memory (host-to-device,
            device-to-device), ``"out"`` for copies that read it into the host
            (device-to-host). One stream for both would queue an offload behind the next
            activation's upload, and DMA engines can run one of each at once.

    CPU (and any device without the CUDA backend) shares the host copy streams.
    """
    if direction not in COPY_DIRECTIONS:
        raise ValueError(f"direction must be one of {COPY_DIRECTIONS}, got {direction!r}")
    key = (runtime_device(device), direction)
    with _lock:
        stream = _copy_streams.get(key)
        if stream is None or stream.closed:
            stream = _C.Stream(key[0])
            _copy_streams[key] = stream
        return stream


def current_stream_handle(device: torch.device | str | int) -> int:
    """Return torch's current CUDA stream on ``device`` as a raw ``CUstream`` (0 = default)."""
    device = normalize(device)
    if not capabilities(device).streams:
        raise ValueError(f"{device} has no CUDA stream")
    return int(torch.cuda.current_stream(device).cuda_stream)


def current_stream(device: torch.device | str | int) -> _C.Stream:
    """Return torch's current stream on CUDA ``device`` as a (non-owning) ``_C.Stream``.

    Wrappers are cached per ``(device, handle)``; wrapping costs no driver call after
    the first.
    """
    device = normalize(device)
    index = runtime_device(device)
    if index == HOST_DEVICE:
        raise ValueError(f"{device} is not served by the CUDA backend")
    key = (index, current_stream_handle(device))
    with _lock:
        stream = _wrapped_streams.get(key)
        if stream is None:
            stream = _C.Stream.from_handle(index, key[1])
            _wrapped_streams[key] = stream
        return stream


def as_torch_stream(stream: _C.Stream, device: torch.device | str | int) -> torch.cuda.ExternalStream:
    """Return ``stream`` (a CUDA-backend ``_C.Stream``) as a ``torch.cuda.ExternalStream``.

    The ``_C.Stream`` must outlive the returned object.
    """
    device = normalize(device)
    if stream.backend != "cuda":
        raise ValueError("only CUDA-backend streams can be seen by torch")
    if device.index != stream.device:
        raise ValueError(f"stream lives on cuda:{stream.device}, not on {device}")
    return torch.cuda.ExternalStream(stream.handle, device=device)


def host_pool(pinned: bool) -> _C.HostBufferPool:
    """Return the process-wide host pool: pinned (CUDA) or plain aligned memory.

    Pinned blocks are allocated portable (usable from every device's context), so one
    pinned pool serves all CUDA devices.
    """
    key = "pinned" if pinned else "host"
    with _lock:
        pool = _pools.get(key)
        if pool is None:
            if pinned:
                if not _C.backend_available("cuda"):
                    raise RuntimeError(f"pinned memory needs the CUDA backend: {_C.cuda_load_error()}")
                pool = _C.HostBufferPool(torch.cuda.current_device())
            else:
                pool = _C.HostBufferPool(HOST_DEVICE)
            _pools[key] = pool
        return pool
