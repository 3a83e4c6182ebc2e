"""Devices, copy streams and pinned pools: the torch-facing side of ``fastpipe._C``.

``fastpipe._C`` speaks raw pointers, byte counts and stream handles. This module maps
``torch.device`` objects onto it:

* a CUDA device ``cuda:i`` uses the CUDA backend (runtime device ``i``) when the driver
  can be loaded; everything else (CPU) uses the host backend (runtime device ``-1``);
* each device gets one cached copy stream, created on first use (thread-safe);
* torch's current CUDA stream is wrapped (not owned) with ``_C.Stream.from_handle``.

The CUDA driver is only touched when a CUDA device is asked about, never at import, so
importing fastpipe before forking stays safe.
"""

from __future__ import annotations

import os
import threading

import torch

import fastpipe._C as _C

__all__ = [
    "HOST_DEVICE",
    "as_torch_stream",
    "backend_for",
    "copy_stream",
    "current_stream",
    "current_stream_handle",
    "host_pool",
    "runtime_device",
]

#: The runtime device index of the host backend.
HOST_DEVICE = -1

_lock = threading.Lock()
_copy_streams: dict[int, _C.Stream] = {}
_wrapped_streams: dict[tuple[int, int], _C.Stream] = {}
_pools: dict[str, _C.HostBufferPool] = {}


def _reset_after_fork() -> None:
    # Host streams' worker threads do not survive fork(); the child starts afresh.
    global _lock
    _lock = threading.Lock()
    _copy_streams.clear()
    _wrapped_streams.clear()


os.register_at_fork(after_in_child=_reset_after_fork)


def _normalize(device: torch.device | str | int) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def backend_for(device: torch.device | str | int) -> str:
    """Return the ``_C`` backend serving ``device``: ``"cuda"`` or ``"host"``.

    A CUDA device whose driver ``_C`` cannot load (unusual: torch loaded it) reports
    ``"host"``; :mod:`fastpipe.runtime.transfer` then falls back to ``Tensor.to``.
    """
    device = torch.device(device)
    if device.type == "cuda" and _C.backend_available("cuda"):
        return "cuda"
    return "host"


def runtime_device(device: torch.device | str | int) -> int:
    """Return the ``_C`` device index for ``device``: the CUDA ordinal, or -1 (host)."""
    device = _normalize(device)
    if backend_for(device) == "cuda":
        assert device.index is not None
        return device.index
    return HOST_DEVICE


def copy_stream(device: torch.device | str | int) -> _C.Stream:
    """Return the copy stream of ``device``, one per device, created on first use.

    CPU (and any device without the CUDA backend) shares the host copy stream.
    """
    index = runtime_device(device)
    with _lock:
        stream = _copy_streams.get(index)
        if stream is None or stream.closed:
            stream = _C.Stream(index)
            _copy_streams[index] = stream
        return stream


def current_stream_handle(device: torch.device | str | int) -> int:
    """Return torch's current CUDA stream on ``device`` as a raw ``CUstream`` (0 = default)."""
    device = _normalize(device)
    if device.type != "cuda":
        raise ValueError(f"{device} has no CUDA stream")
    return int(torch.cuda.current_stream(device).cuda_stream)


def current_stream(device: torch.device | str | int) -> _C.Stream:
    """Return torch's current stream on CUDA ``device`` as a (non-owning) ``_C.Stream``.

    Wrappers are cached per ``(device, handle)``; wrapping costs no driver call after
    the first.
    """
    device = _normalize(device)
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
    device = _normalize(device)
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
