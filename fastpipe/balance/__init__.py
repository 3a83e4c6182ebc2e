"""Automatic balance: profile the layers of an ``nn.Sequential`` and pick the best contiguous partition.

The map of the package (each module imports only those above it):

* :mod:`fastpipe.balance.bottleneck`: :func:`~fastpipe.balance.bottleneck.min_bottleneck`, the exact DP
  for the least largest stage cost (the planner's starting point, and ``by_size``'s answer).
* :mod:`fastpipe.balance.planner`: the planner, pure (no threads, no processes). :func:`plan` searches
  contiguous partitions by branch and bound and scores each one by simulating the chosen schedule
  (:func:`fastpipe.schedule.simulate`); of the partitions within a tolerance of the fastest it returns
  the most even. :func:`predict` simulates one given partition.
* :mod:`fastpipe.balance.profile`: :func:`profile_layers` runs every layer on one micro-batch (a tensor
  or a tuple, with side inputs), a warm-up pass and then timed passes, and keeps each layer's fastest
  forward and backward time, its saved activations and its parameters (:class:`LayerProfile`).
* :mod:`fastpipe.balance.torchgpipe`: torchgpipe's balancers, :func:`by_time` (profile, then
  :func:`plan`) and :func:`by_size` (profile, then the least largest stage memory).
* :mod:`fastpipe.balance.device_need`: what a stage of given layers needs on its device, in bytes, by the
  memory model (``balance="auto"`` with ``memory_limit``).
* :mod:`fastpipe.balance.auto`: :func:`auto_balance`, the balance behind ``Pipe(..., balance="auto")``.

Everything public is importable from ``fastpipe.balance`` itself. The planner's module is named
``planner`` so that no re-exported function shadows a module of the package.
"""

from fastpipe.balance.auto import auto_balance
from fastpipe.balance.planner import BalanceError, plan, predict
from fastpipe.balance.profile import MEASURED_TOLERANCE, LayerProfile, profile_layers
from fastpipe.balance.torchgpipe import by_size, by_time

__all__ = [
    "MEASURED_TOLERANCE",
    "BalanceError",
    "LayerProfile",
    "auto_balance",
    "by_size",
    "by_time",
    "plan",
    "predict",
    "profile_layers",
]
