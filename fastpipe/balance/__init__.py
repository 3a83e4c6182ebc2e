"""Automatic balance: profile the layers of an ``nn.Sequential`` and pick the best contiguous partition.

The map of the package (each module imports only those above it):

* :mod:`fastpipe.balance.plan`: the planner (:func:`plan`, :func:`predict`), the layer profiler
  (:func:`profile_layers`) and torchgpipe's balancers (:func:`by_time`, :func:`by_size`).
* :mod:`fastpipe.balance.auto`: :func:`auto_balance`, the balance behind ``Pipe(..., balance="auto")``.

Everything public is importable from ``fastpipe.balance`` itself.
"""

from fastpipe.balance.auto import auto_balance
from fastpipe.balance.plan import BalanceError, LayerProfile, by_size, by_time, plan, predict, profile_layers

__all__ = [
    "BalanceError",
    "LayerProfile",
    "auto_balance",
    "by_size",
    "by_time",
    "plan",
    "predict",
    "profile_layers",
]
