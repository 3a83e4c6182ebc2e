"""Which torch.distributed backend serves a device's tensors in a process group.

``dist.get_backend(group)`` names one backend only when the group was made with one:
``init_process_group()`` without ``backend=`` (as torchrun users write it) reports
``"undefined"``, and ``backend="cpu:gloo,cuda:nccl"`` reports that whole string. What a
stage's tensors travel on is the backend of *their* device, which the group's backend
config (``"cpu:gloo,cuda:nccl"``) says.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["backend_for"]


def backend_for(group: Any, device: torch.device | str) -> str:
    """The backend (``"gloo"``, ``"nccl"``, ...) that moves ``device``'s tensors in ``group``."""
    kind = torch.device(device).type
    name = str(dist.get_backend(group))
    if name != "undefined" and ":" not in name and "," not in name:
        return name  # made with one backend: it serves every device it can
    config = dist.get_backend_config(group) if hasattr(dist, "get_backend_config") else name
    return parse_backend_config(str(config)).get(kind, name)


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
