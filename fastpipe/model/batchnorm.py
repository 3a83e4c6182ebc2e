"""BatchNorm whose running statistics cover the whole mini-batch, not each micro-batch.

A pipeline calls every layer once per micro-batch. A plain BatchNorm would then update
its running mean and variance ``chunks`` times per step, each from a fraction of the
batch. :class:`DeferredBatchNorm` normalises each micro-batch with that micro-batch's
statistics, exactly as a plain BatchNorm does in training, but only *accumulates*
statistics for the running ones; :meth:`DeferredBatchNorm.commit` folds them in once
per mini-batch, so the running statistics equal those of one pass over the whole batch.

Statistics accumulate into a *slot*: the default one unless a forward runs inside
:func:`accumulating_into`. ``Pipe.train_step``, ``Pipe.forward`` and ``DistributedPipe``
use the default slot and commit it after the step. ``Pipe.fit`` runs forwards of mini-batch
n + 1 before stage s's update of mini-batch n (the asynchronous stream), so it gives each
mini-batch its own slot and commits exactly that one at the update (see
:mod:`fastpipe.asynchronous.runner`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fastpipe.runtime.worker import is_recomputing

__all__ = ["DeferredBatchNorm", "accumulating_into", "convert_deferred_batch_norm", "commit_deferred_batch_norm"]

# The most elements of a 16-bit activation widened to fp32 at once for its statistics (16 MiB).
WIDEN_ELEMENTS = 1 << 22

# Per thread (each thread starts in its own context): the slot this thread's forwards accumulate into.
_slot: ContextVar[Hashable] = ContextVar("fastpipe_deferred_batch_norm_slot", default=None)


# torch has no public query for whether autograd's backward is running in this thread;
# without the private one (another torch version), _in_backward is always False.
_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)


def _in_backward() -> bool:
    """Whether this forward runs inside autograd's backward: the recompute of a
    ``torch.utils.checkpoint`` within a stage, which fastpipe's own recompute flag does not
    see. Its micro-batch was already counted by the first forward."""
    return _graph_task_id is not None and _graph_task_id() != -1


@contextlib.contextmanager
def accumulating_into(slot: Hashable) -> Iterator[None]:
    """Within the block, this thread's DeferredBatchNorm forwards accumulate into ``slot``.

    ``None`` is the default slot, the one :meth:`DeferredBatchNorm.commit` commits when
    given no slot.
    """
    token = _slot.set(slot)
    try:
        yield
    finally:
        _slot.reset(token)


@dataclass
class _Stats:
    """Statistics of the micro-batches accumulated into one slot since its last commit."""

    mean: Tensor  # per channel, over all of them
    m2: Tensor  # per channel, their sum of squared deviations from ``mean``
    count: int  # values per channel


class DeferredBatchNorm(nn.modules.batchnorm._BatchNorm):
    """A BatchNorm (1d/2d/3d alike) that updates running statistics once per mini-batch.

    Its state dict has the same keys as ``nn.BatchNorm*d``'s. The accumulated statistics
    are kept per slot (see :func:`accumulating_into`) and are not part of the state dict.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self._pending: dict[Hashable, _Stats] = {}  # per slot, what its next commit folds in

    def __setstate__(self, state: dict[str, Any]) -> None:
        # One pickled before statistics were kept per slot had one set of them, uncommitted: drop it.
        for name in ("_mean", "_m2", "_count"):
            state.pop(name, None)
        super().__setstate__(state)
        self.__dict__.setdefault("_pending", {})

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"DeferredBatchNorm expects at least 2-D input (N, C, ...), got {input.dim()}-D")

    def forward(self, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        if not (self.training and self.track_running_stats):
            return super().forward(input)
        if not is_recomputing() and not _in_backward():
            self._accumulate(input, _slot.get())
        # Normalise with the micro-batch's own statistics; leave running stats alone.
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)

    @torch.no_grad()
    def _accumulate(self, input: Tensor, slot: Hashable) -> None:
        # Each micro-batch's mean and variance in one fused reduction (fp32 at least, no
        # copy of an fp32 activation), merged into per-channel sums in fp64 with Chan et
        # al.'s pairwise update: no fp64 copy of the activation or of its square. A 16-bit
        # activation is widened to fp32 a slice of samples at a time, so the copy stays
        # small (at most WIDEN_ELEMENTS) instead of twice the activation.
        dims = [0] + list(range(2, input.dim()))
        x = input.detach()
        wide = torch.float64 if input.device.type in ("cpu", "cuda") else torch.float32
        if x.element_size() >= 4:
            parts = [x]
        else:
            rows = max(1, WIDEN_ELEMENTS // max(1, x[:1].numel()))
            parts = [part.float() for part in x.split(rows)]
        for part in parts:
            var, mean = torch.var_mean(part, dims, correction=0)
            n_b = part.numel() // part.size(1)
            self._merge(slot, mean.to(wide), var.to(wide) * n_b, n_b)

    def _merge(self, slot: Hashable, mean: Tensor, m2: Tensor, n_b: int) -> None:
        acc = self._pending.get(slot)
        if acc is None or acc.count == 0:
            self._pending[slot] = _Stats(mean, m2, n_b)
            return
        n_a = acc.count
        n = n_a + n_b
        delta = mean - acc.mean
        acc.mean = acc.mean + delta * (n_b / n)
        acc.m2 = acc.m2 + m2 + delta * delta * (n_a * n_b / n)
        acc.count = n

    @torch.no_grad()
    def commit(self, slot: Hashable = None) -> None:
        """Fold the statistics accumulated into ``slot`` since its last commit into the running ones.

        Other slots are left as they are. Without anything accumulated in ``slot``, nothing changes.
        """
        acc = self._pending.pop(slot, None)
        if acc is None or acc.count == 0:
            return
        assert self.running_mean is not None and self.running_var is not None
        n = acc.count
        mean = acc.mean
        var = acc.m2 / n
        unbiased = var * (n / (n - 1)) if n > 1 else var
        assert self.num_batches_tracked is not None
        self.num_batches_tracked.add_(1)
        # A cumulative average (momentum None) weighs by 1 / batches seen, kept on the
        # device: float(num_batches_tracked) would wait for the GPU every step.
        momentum: Tensor | float = (
            self.momentum
            if self.momentum is not None
            else self.num_batches_tracked.reciprocal().to(self.running_mean.dtype)
        )
        self.running_mean.mul_(1 - momentum).add_(mean.to(self.running_mean.dtype) * momentum)
        self.running_var.mul_(1 - momentum).add_(unbiased.to(self.running_var.dtype) * momentum)

    def discard(self, slot: Hashable = None) -> None:
        """Drop what ``slot`` accumulated, without committing it (a step that failed)."""
        self._pending.pop(slot, None)

    @classmethod
    def convert(cls, module: nn.Module) -> nn.Module:
        """Return ``module`` with every ``nn.BatchNorm*d`` replaced by a DeferredBatchNorm.

        Parameters and buffers are moved over (the same tensors), so nothing is copied and
        the state dict keeps its keys.
        """
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, cls):
            new = cls(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats)
            for name in ("weight", "bias"):
                setattr(new, name, getattr(module, name))
            for name in ("running_mean", "running_var", "num_batches_tracked"):
                setattr(new, name, getattr(module, name))
            new.train(module.training)
            return new
        return cls._convert(module, {})

    @classmethod
    def _convert(cls, module: nn.Module, done: dict[int, nn.Module]) -> nn.Module:
        # ``_modules`` rather than ``named_children()``, which skips a module seen before, so
        # a BatchNorm used twice is seen, and refused: deferred, its two uses would pool into
        # one running-statistics update per step where the Sequential makes two.
        if id(module) in done:
            if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules()):
                raise ValueError(
                    "fastpipe: a BatchNorm layer is used twice in the model; with deferred_batch_norm=True "
                    "its running statistics would be one update over both uses instead of two. Give each use "
                    "its own BatchNorm, or pass deferred_batch_norm=False"
                )
            return done[id(module)]
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, cls):
            done[id(module)] = cls.convert(module)
            return done[id(module)]
        done[id(module)] = module
        for name, child in list(module._modules.items()):
            if child is not None:
                converted = cls._convert(child, done)
                if converted is not child:
                    setattr(module, name, converted)
        return module


def convert_deferred_batch_norm(module: nn.Module) -> nn.Module:
    """Functional form of :meth:`DeferredBatchNorm.convert`."""
    return DeferredBatchNorm.convert(module)


def commit_deferred_batch_norm(module: nn.Module, slot: Hashable = None) -> None:
    """Call :meth:`DeferredBatchNorm.commit` on every DeferredBatchNorm inside ``module``."""
    for m in module.modules():
        if isinstance(m, DeferredBatchNorm):
            m.commit(slot)
