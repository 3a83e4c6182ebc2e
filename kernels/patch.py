"""``patch(module)``: swap matching torch modules for the fused drop-ins, in place."""

from __future__ import annotations

import logging

import torch

from .modules import GELU, Dropout, LayerNorm, RMSNorm

__all__ = ["patch", "SWAPS"]

log = logging.getLogger(__name__)

#: exact torch type -> drop-in subclass (subclasses of the torch types are left alone).
SWAPS: dict[type, type] = {
    torch.nn.LayerNorm: LayerNorm,
    torch.nn.RMSNorm: RMSNorm,
    torch.nn.Dropout: Dropout,
    torch.nn.GELU: GELU,
}


def patch(module: torch.nn.Module) -> list[tuple[str, str, str]]:
    """Replace every ``nn.LayerNorm``/``RMSNorm``/``Dropout``/``GELU`` in ``module`` in place.

    The swap changes only the class of each matching submodule (the drop-ins subclass the torch
    modules and add no state), so parameters, hooks and ``state_dict`` keys stay as they were.

    Returns:
        One ``(qualified_name, old_type, new_type)`` per swapped module (``""`` is the root);
        also logged at INFO level.
    """
    swapped: list[tuple[str, str, str]] = []
    for name, sub in module.named_modules():
        new_cls = SWAPS.get(type(sub))
        if new_cls is None:
            continue
        old = type(sub).__name__
        sub.__class__ = new_cls
        swapped.append((name, f"torch.nn.{old}", f"fastpipe.kernels.{new_cls.__name__}"))
    counts: dict[str, int] = {}
    for _, old, _ in swapped:
        counts[old] = counts.get(old, 0) + 1
    log.info("fastpipe.kernels.patch swapped %d modules: %s", len(swapped), counts)
    return swapped
