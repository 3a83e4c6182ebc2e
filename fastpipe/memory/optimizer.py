"""Optimizer state in bytes: how much a device holds per byte of the parameters an optimizer steps."""

from __future__ import annotations

import torch

from fastpipe.memory.host_optimizer import HostOptimizer

__all__ = ["OptimizerSpec", "optimizer_factor"]

OptimizerSpec = torch.optim.Optimizer | str | float | None

# State tensors per parameter byte, by name (torch keeps the moments in the parameter's dtype).
# "host": a HostOptimizer, whose state stays in host memory.
_FACTORS = {"none": 0.0, "sgd": 0.0, "momentum": 1.0, "sgd-momentum": 1.0, "adam": 2.0, "adamw": 2.0, "host": 0.0}


def optimizer_factor(optimizer: OptimizerSpec) -> float:
    """Bytes of optimizer state per byte of the parameters it steps.

    Args:
        optimizer: ``None`` or ``"none"`` (0), ``"sgd"`` (0, no momentum), ``"momentum"`` (1),
            ``"adam"`` or ``"adamw"`` (2: two moments in the parameters' dtype), ``"host"`` (0: a
            :class:`~fastpipe.memory.host_optimizer.HostOptimizer` to come); a number (that
            factor, for an optimizer of your own); a
            :class:`~fastpipe.memory.host_optimizer.HostOptimizer` (0: its state is on the host);
            or a ``torch.optim.Optimizer``: Adam and
            AdamW 2 (3 with ``amsgrad``), SGD 1 with momentum else 0, any other the state it
            already holds per byte of the parameters that have state.

    Raises:
        ValueError: an unknown name, a negative or non-finite number, or an optimizer of another
            kind that holds no state yet (run one step first, or pass the factor).
    """
    if optimizer is None:
        return 0.0
    if isinstance(optimizer, str):
        key = optimizer.lower()
        if key not in _FACTORS:
            raise ValueError(
                f"fastpipe: unknown optimizer {optimizer!r}; name one of {sorted(_FACTORS)}, pass its state "
                "bytes per parameter byte as a number, or pass the torch.optim.Optimizer"
            )
        return _FACTORS[key]
    if isinstance(optimizer, HostOptimizer):
        return 0.0  # its state is on the host
    if isinstance(optimizer, torch.optim.Optimizer):
        return _instance_factor(optimizer)
    if isinstance(optimizer, bool) or not isinstance(optimizer, (int, float)) or not 0 <= optimizer < float("inf"):
        raise ValueError(
            f"fastpipe: an optimizer factor is a finite number >= 0 (state bytes per parameter byte), got {optimizer!r}"
        )
    return float(optimizer)


def _instance_factor(optimizer: torch.optim.Optimizer) -> float:
    def nbytes(p: torch.Tensor) -> int:
        return p.numel() * p.element_size()

    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)):
        weighted = total = 0
        for group in optimizer.param_groups:
            if isinstance(optimizer, torch.optim.SGD):
                factor = 1 if group.get("momentum", 0) else 0
            else:
                factor = 3 if group.get("amsgrad", False) else 2
            size = sum(nbytes(p) for p in group["params"])
            weighted, total = weighted + factor * size, total + size
        return weighted / total if total else 0.0
    held = [(p, s) for group in optimizer.param_groups for p in group["params"] if (s := optimizer.state.get(p))]
    if not held:
        raise ValueError(
            f"fastpipe: {type(optimizer).__name__} holds no state yet, so its size is unknown; run one step "
            "first, or pass optimizer=<state bytes per parameter byte> (e.g. 2.0 for two moments)"
        )
    state = sum(nbytes(t) for _, s in held for t in s.values() if isinstance(t, torch.Tensor))
    return state / max(1, sum(nbytes(p) for p, _ in held))
