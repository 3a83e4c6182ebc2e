"""Which torch.distributed backend serves a device's tensors in a process group.

``dist.get_backend(group)`` names one backend only when the group was made with one:
``init_process_group()`` without ``backend=`` (as torchrun users write it) reports
``"undefined"``, and ``backend="cpu:gloo,cuda:nccl"`` reports that whole string. What a
stage's tensors travel on is the backend of *their* device, which the group's backend
config (``"cpu:gloo,cuda:nccl"``) says. torch 2.13 configures only the host's accelerator
for a group made without ``backend=``: ``"cuda:nccl"`` on a CUDA host (no CPU backend),
``"cpu:gloo"`` on a CPU-only one; :func:`require_backend` turns the missing one into advice.

When a step fails, :func:`abort_nccl` aborts a group's NCCL communicators, so that a GPU
stream waiting on a receive from a hung peer is released instead of blocking every later
synchronisation until NCCL's own timeout.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["abort_nccl", "backend_for", "parse_backend_config", "rank_device", "require_backend"]


def backend_for(group: Any, device: torch.device | str) -> str:
    """The backend (``"gloo"``, ``"nccl"``, ...) that moves ``device``'s tensors in ``group``.

    ``"undefined"`` when the group has none for that device type.
    """
    kind = torch.device(device).type
    name = str(dist.get_backend(group))
    if name != "undefined" and ":" not in name and "," not in name:
        return name  # made with one backend: it serves every device it can
    config = dist.get_backend_config(group) if hasattr(dist, "get_backend_config") else name
    return parse_backend_config(str(config)).get(kind, "undefined")


def require_backend(group: Any, device: torch.device | str, what: str = "the pipeline group") -> str:
    """:func:`backend_for`, or ValueError saying how to make a group that has one for ``device``."""
    backend = backend_for(group, device)
    if backend != "undefined":
        return backend
    kind = torch.device(device).type
    config = dist.get_backend_config(group) if hasattr(dist, "get_backend_config") else dist.get_backend(group)
    raise ValueError(
        f"fastpipe: {what} has no backend for {kind} tensors (its backends: {config}); "
        "init_process_group() without backend= sets up only the host's accelerator "
        '(cuda:nccl on a CUDA host), so pass backend="cpu:gloo,cuda:nccl" to init_process_group()'
    )


def abort_nccl(group: Any) -> bool:
    """Abort ``group``'s NCCL communicators, where NCCL serves its CUDA tensors; True if it did.

    NCCL's receive makes the compute stream wait on the GPU: after a peer hung, that
    stream (and every ``.item()``, ``synchronize`` or ``destroy_process_group`` behind it)
    would wait until NCCL's own timeout. Aborting the communicator ends those kernels.
    The group stays registered (the caller still destroys it) but moves no more CUDA
    tensors. A group without NCCL (gloo) is left as it is.

    A torch whose Backend binding has no ``abort`` leaves only torch's
    ``_abort_process_group``, which also unregisters the group. That is used for a group of
    the pipeline's own, never for WORLD: there it aborts and unregisters *every* group
    (gloo side groups included) and the caller's later ``destroy_process_group()`` raises.
    WORLD is then not aborted (False): the step still fails with PipelineError, but a
    stream waiting on a hung peer is bounded only by NCCL's own timeout.
    """
    group = group if group is not None else dist.group.WORLD
    if backend_for(group, "cuda") != "nccl":
        return False
    backend = group._get_backend(torch.device("cuda"))
    if hasattr(backend, "abort"):
        backend.abort()
    elif group is dist.group.WORLD:
        return False
    else:
        dist.distributed_c10d._abort_process_group(group)
    return True


def parse_backend_config(config: str) -> dict[str, str]:
    """``"cpu:gloo,cuda:nccl"`` as ``{"cpu": "gloo", "cuda": "nccl"}`` (a bare name: for cpu and cuda)."""
    pairs: dict[str, str] = {}
    for item in config.split(","):
        item = item.strip()
        if not item:
            continue
        if ":" in item:
            dev, backend = item.split(":", 1)
            pairs[dev.strip()] = backend.strip()
        else:
            pairs.setdefault("cpu", item)
            pairs.setdefault("cuda", item)
    return pairs


def rank_device(group: Any, device: torch.device | str | None) -> torch.device:
    """Where a rank's stages live: ``device``, or by default this rank's GPU where NCCL serves CUDA
    tensors in ``group`` (also a ``"cpu:gloo,cuda:nccl"`` group, or one made without ``backend=``), else the CPU.
    """
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available() and backend_for(group, "cuda") == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
