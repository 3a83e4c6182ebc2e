"""``fit`` with a :class:`~fastpipe.HostOptimizer`: the device parameters it steps, and predictions from host state.

``fit`` updates one stage at a time: it gives that stage's parameters their gradients and steps
the shared optimizer, which skips every parameter without one. A ``HostOptimizer`` does the same
on its host copies (it copies only the parameters with a gradient each way), so the update
needs nothing more. Two things differ, and this module hides them from the loop:

* its ``param_groups`` hold the host copies, so the stage's parameters are found in its groups
  through :meth:`~fastpipe.HostOptimizer.host_of`;
* its state (Adam's moments) lives on the host, keyed by the copies, so
  ``consistency="predict"`` computes Ŵ there, from the copy the last update wrote back, and
  copies it to the device. A parameter not stepped yet is predicted as itself, read from the
  device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from fastpipe.asynchronous.direction import check_predictable, predict_weights
from fastpipe.memory.host_optimizer import HostOptimizer

__all__ = ["check_fit_predictable", "device_groups", "predict_stage"]


def device_groups(optimizer: torch.optim.Optimizer) -> list[list[Tensor]]:
    """Each parameter group's parameters as the pipe holds them (a HostOptimizer's device parameters)."""
    if isinstance(optimizer, HostOptimizer):
        device_of = {id(h): p for p, h in zip(optimizer.device_params, optimizer.host_params)}
        return [[device_of[id(h)] for h in g["params"]] for g in optimizer.param_groups]
    return [list(g["params"]) for g in optimizer.param_groups]


def check_fit_predictable(optimizer: torch.optim.Optimizer) -> None:
    """:func:`~fastpipe.asynchronous.direction.check_predictable` of the optimizer that keeps the state."""
    check_predictable(optimizer.inner if isinstance(optimizer, HostOptimizer) else optimizer)


@torch.no_grad()
def predict_stage(
    optimizer: torch.optim.Optimizer, params: Sequence[Tensor], totals: Sequence[float], out: Sequence[Tensor] | None
) -> list[Tensor]:
    """Ŵ for ``params``, as :func:`~fastpipe.asynchronous.direction.predict_weights`, from a HostOptimizer's too."""
    if not isinstance(optimizer, HostOptimizer):
        return predict_weights(optimizer, params, totals, out)
    hosts = [optimizer.host_of(p) for p in params]
    stepped = [i for i, h in enumerate(hosts) if h is not None and optimizer.inner.state.get(h)]
    found = [torch.empty_like(p) for p in params] if out is None else list(out)
    if stepped:
        copies = [h for h in hosts if h is not None and optimizer.inner.state.get(h)]
        on_host = predict_weights(optimizer.inner, copies, [totals[i] for i in stepped])
        for i, w in zip(stepped, on_host):
            found[i].copy_(w)
    done = set(stepped)
    for i, p in enumerate(params):
        if i not in done:
            found[i].copy_(p)
    return found
