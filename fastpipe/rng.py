"""Reproducible randomness for stages that run in parallel threads.

torch has one global generator per device. Two stage workers on the same device would
draw from it in whatever order the threads happen to run, so dropout masks would change
from run to run, and a recompute could not replay them. Instead, every
(stage, micro-batch) task gets generators of its own, seeded from one number drawn from
the caller's generator per step::

    caller's generator ──draw once per step──▶ step_seed
    task_seed(step_seed, stage, mb) ──▶ torch.Generator per device, used only by that task

The task's generators are handed to random ops through a thread-local
``TorchFunctionMode``: random functions called without ``generator=`` get the task's
one, and dropout (whose functional form has no ``generator`` argument) is evaluated with
the same arithmetic as ATen's CPU kernel but a mask drawn from the task's generator.
A recompute enters the same task seed again and so replays every mask bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

__all__ = ["draw_step_seed", "task_seed", "TaskRNG"]

_MASK64 = (1 << 64) - 1


def draw_step_seed() -> int:
    """Consume one 63-bit number from the caller's default CPU generator."""
    return int(torch.empty((), dtype=torch.int64).random_(0, 1 << 62).item())


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def task_seed(step_seed: int, stage: int, microbatch: int) -> int:
    """A well-mixed seed for one (stage, micro-batch) task, stable across runs."""
    return _splitmix64(_splitmix64(step_seed ^ (stage << 32)) ^ microbatch) >> 1


def _device_of(args: tuple, kwargs: dict) -> torch.device:
    dev = kwargs.get("device")
    if dev is not None:
        return torch.device(dev)
    for a in args:
        if isinstance(a, Tensor):
            return a.device
    return torch.get_default_device()


# Random ops that take ``generator=``; the mode supplies the task's generator when the
# caller did not pass one.
_RANDOM_FUNCS: frozenset[Callable[..., Any]] = frozenset(
    {
        torch.rand,
        torch.randn,
        torch.randint,
        torch.randperm,
        torch.bernoulli,
        torch.multinomial,
        torch.normal,
        torch.poisson,
        torch.rand_like,
        torch.randn_like,
        torch.randint_like,
        Tensor.uniform_,
        Tensor.normal_,
        Tensor.bernoulli_,
        Tensor.bernoulli,
        Tensor.random_,
        Tensor.exponential_,
        Tensor.geometric_,
        Tensor.log_normal_,
        Tensor.cauchy_,
        Tensor.multinomial,
    }
)


class TaskRNG(TorchFunctionMode):
    """Routes the random ops of one task to generators seeded with ``seed``.

    Enter it in the thread that runs the task; torch function modes are thread-local,
    so tasks in other threads are unaffected.
    """

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def generator(self, device: torch.device) -> torch.Generator:
        """The task's generator for ``device``, created and seeded on first use."""
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed)
            self._generators[device] = gen
        return gen

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        impl = _DROPOUTS.get(func)
        if impl is not None:
            return impl(self, *args, **kwargs)
        if func in _RANDOM_FUNCS and kwargs.get("generator") is None:
            kwargs["generator"] = self.generator(_device_of(args, kwargs))
        return func(*args, **kwargs)

    # -- dropout family -------------------------------------------------------------
    # The arithmetic follows ATen's ``_dropout_impl`` (noise = bernoulli(1-p) / (1-p),
    # alpha dropout's affine correction), so only the source of the mask differs.

    def _noise(self, x: Tensor, p: float, feature: bool, batched_dims: int) -> Tensor:
        if feature:
            shape = list(x.shape[:batched_dims]) + [1] * (x.dim() - batched_dims)
        else:
            shape = list(x.shape)
        noise = torch.empty(shape, dtype=x.dtype, device=x.device)
        return noise.bernoulli_(1.0 - p, generator=self.generator(x.device))

    def _apply(
        self, x: Tensor, p: float, training: bool, inplace: bool, *, feature: bool, alpha: bool, batched_dims: int
    ) -> Tensor:
        if p < 0.0 or p > 1.0:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        if not training or p == 0.0:
            return x
        if p == 1.0:
            return x.mul_(0) if inplace else x * 0
        noise = self._noise(x, p, feature, batched_dims)
        if alpha:
            alpha_ = 1.7580993408473766
            a = 1.0 / math.sqrt((alpha_ * alpha_ * p + 1) * (1 - p))
            b = noise.add(-1).mul_(alpha_ * a).add_(alpha_ * a * p)
            noise.mul_(a)
            return x.mul_(noise).add_(b) if inplace else x * noise + b
        noise.div_(1.0 - p)
        return x.mul_(noise) if inplace else x * noise

    def _dropout(self, x: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> Tensor:
        return self._apply(x, p, training, inplace, feature=False, alpha=False, batched_dims=0)

    def _alpha_dropout(self, x: Tensor, p: float = 0.5, training: bool = False, inplace: bool = False) -> Tensor:
        return self._apply(x, p, training, inplace, feature=False, alpha=True, batched_dims=0)

    def _feature(self, spatial: int | None, alpha: bool = False) -> Callable[..., Tensor]:
        def run(x: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> Tensor:
            # Masks cover whole channels: (N, C, 1, ...) when batched, (C, 1, ...) when not.
            batched = spatial is None or x.dim() == spatial + 2
            return self._apply(x, p, training, inplace, feature=True, alpha=alpha, batched_dims=2 if batched else 1)

        return run


def _dropout_table() -> dict[Callable[..., Any], Callable[..., Tensor]]:
    return {
        F.dropout: lambda m, *a, **k: m._dropout(*a, **k),
        F.alpha_dropout: lambda m, *a, **k: m._alpha_dropout(*a, **k),
        F.dropout1d: lambda m, *a, **k: m._feature(1)(*a, **k),
        F.dropout2d: lambda m, *a, **k: m._feature(2)(*a, **k),
        F.dropout3d: lambda m, *a, **k: m._feature(3)(*a, **k),
        F.feature_alpha_dropout: lambda m, *a, **k: m._feature(None, alpha=True)(*a, **k),
    }


_DROPOUTS = _dropout_table()
