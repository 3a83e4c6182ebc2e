"""One window of ``fit``: its mini-batches, flattened into micro-batches, with their targets and side inputs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import Tensor

from fastpipe.step.microbatch import Value

__all__ = ["Split", "Window", "side_of"]


@dataclass
class Window:
    """One window's mini-batches, flattened into micro-batches (inputs only where stage 0 runs)."""

    minibatches: int
    microbatches: int  # per mini-batch
    seed: int
    inputs: list[Value]
    targets: list[Any]
    sizes: list[int]  # per micro-batch
    factors: list[float]
    side: list[dict[str, Any]] = field(default_factory=list)  # per micro-batch, or none at all

    def losses(self, results: Mapping[int, Value]) -> list[Tensor]:
        """Each mini-batch's loss from the last stage's per-micro-batch losses."""
        m = self.microbatches
        with torch.no_grad():
            return [
                torch.stack([self.factors[i] * cast(Tensor, results[i]) for i in range(j * m, (j + 1) * m)]).sum()
                for j in range(self.minibatches)
            ]


Split = tuple[list[Value], list[Any], list[int], list[dict[str, Any]]]  # one mini-batch's


def side_of(group: Sequence[Split]) -> list[dict[str, Any]]:
    """The window's side inputs per micro-batch; none at all when no mini-batch has any."""
    side = [mb for *_, sd in group for mb in sd]
    return side if any(side) else []
