"""Starting ``torch.distributed`` in a process that ``torchrun`` launched, restarts included.

``torchrun --max-restarts N`` restarts every rank when one fails, and the new ranks meet
again through the launcher's own store. In torch 2.13 that store keeps the last attempt's
keys, gloo's listening addresses among them, and ``init_process_group("gloo")`` does not keep
attempts apart: a new rank can read its dead peer's address and fail with "Connection
refused", or wait on it until the timeout (seen in 3 of 3 restarts, 2026-12-02).
:func:`init_distributed` gives each attempt its own key prefix, picks the backends the
pipeline needs (gloo on CPUs; NCCL for CUDA tensors with gloo beside it for the CPU objects
the pipeline exchanges), and makes this rank's GPU current before any NCCL call.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

__all__ = ["init_distributed", "launched_by_torchrun", "rank_device"]

_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def launched_by_torchrun() -> bool:
    """Whether ``torchrun`` (or another launcher that sets its variables) started this process."""
    return all(name in os.environ for name in _ENV)


def rank_device() -> torch.device:
    """``cuda:LOCAL_RANK`` when the host has a GPU for each of its processes, else the CPU."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_distributed(backend: str | None = None, timeout: float | None = None) -> torch.device:
    """Start the default process group from torchrun's environment; returns this rank's device.

    Call it once per process, where a script would call ``dist.init_process_group``. A second
    call returns the device and starts nothing.

    Args:
        backend: ``None`` picks ``"cpu:gloo,cuda:nccl"`` when the rank has a GPU, else ``"gloo"``.
        timeout: seconds a collective may wait (torch's default when None).

    Raises:
        RuntimeError: the process was not launched by torchrun (its variables are missing).
    """
    if not launched_by_torchrun():
        missing = [name for name in _ENV if name not in os.environ]
        raise RuntimeError(
            f"fastpipe.init_distributed() reads torchrun's {', '.join(_ENV)}, and {', '.join(missing)} "
            "is not set: launch the script with `torchrun --nproc-per-node K script.py`"
        )
    device = rank_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL works on the current device's tensors
    if dist.is_initialized():
        return device
    if backend is None:
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    store, rank, world = next(dist.rendezvous("env://"))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"fastpipe/attempt-{attempt}", store),
        rank=rank,
        world_size=world,
        timeout=None if timeout is None else datetime.timedelta(seconds=timeout),
    )
    return device
