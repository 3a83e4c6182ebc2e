"""An optimizer whose state and update live in host memory: the device keeps parameters and gradients.

Adam keeps two moments per parameter, so parameters, gradients and state take four times the
parameters' bytes on the device. ZeRO-Offload (Ren et al., "ZeRO-Offload: Democratizing
Billion-Scale Model Training", USENIX ATC 2021) keeps the optimizer state on the host and runs the
update there, which leaves two. :class:`HostOptimizer` does this around any torch optimizer::

    step():  host copy of each parameter  <- the parameter       (device to host)
             the host copy's .grad        <- the parameter's .grad
             the wrapped optimizer steps the host copies (its state is created on the host)
             the parameter                <- its host copy       (host to device)

The host copies are refreshed from the parameters at every step, so whatever changes a parameter
between steps (a checkpoint load, tied copies kept equal, an edit of the user's) is what the update
starts from. The update is the wrapped optimizer's own arithmetic: on a CPU device the parameters
are bitwise those of the plain optimizer; on an accelerator the update runs on the host's kernels,
within floating-point tolerance of the device's.

Where the bytes are:

* on a CUDA device, the host copies and their gradients are page-locked, so both copies run at the
  link's speed; the state is in pageable host memory, where the host's kernels update it;
* on a CPU device the host is the same memory, so nothing is saved. fastpipe's exact CPU counter
  books everything the step allocates on the host (:func:`fastpipe.memory._cpu_counter.host_scope`),
  so a CPU rank that stands for an accelerator (the largest-model benchmark) counts what the
  accelerator would hold.

The memory model counts no optimizer state on the device for it
(:func:`~fastpipe.memory.optimizer.optimizer_factor` answers 0): build the pipe with
``optimizer_state="host"``, so that its planners and its guard count none.

It suits ``train_step`` (or ``pipe(x)`` and ``backward()``) followed by ``optimizer.step()``, and
``fit``, which steps one stage's parameters at a time: a parameter without a gradient is neither
stepped nor copied, and ``consistency="predict"`` reads the moments on the host
(:mod:`fastpipe.asynchronous.host_steps`). ``fit`` over stages sharded with FSDP2 refuses it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from fastpipe.memory._cpu_counter import host_scope

__all__ = ["HostOptimizer"]


def _groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    given = list(params)
    if not given:
        raise ValueError("fastpipe: HostOptimizer got no parameters; pass the pipe's parameters (pipe.parameters())")
    if all(isinstance(g, dict) for g in given):
        groups = [dict(g) for g in given]
        for g in groups:
            if "params" not in g:
                raise ValueError("fastpipe: a parameter group given to HostOptimizer has no 'params' entry")
            g["params"] = [g["params"]] if isinstance(g["params"], Tensor) else list(g["params"])
        return groups
    if any(isinstance(g, dict) for g in given):
        raise TypeError("fastpipe: HostOptimizer takes either tensors or parameter groups (dicts), not a mix")
    return [{"params": given}]


def _check(p: Any, seen: set[int]) -> None:
    if not isinstance(p, Tensor):
        raise TypeError(f"fastpipe: HostOptimizer steps tensors; got {type(p).__name__}")
    if not p.is_leaf:
        raise ValueError("fastpipe: HostOptimizer can only step leaf tensors (parameters), not results of an op")
    if p.is_sparse or p.layout != torch.strided:
        raise ValueError(f"fastpipe: HostOptimizer steps dense tensors; got layout {p.layout}")
    if id(p) in seen:
        raise ValueError("fastpipe: a parameter appears twice in HostOptimizer's parameters; give each once")
    seen.add(id(p))


def _host_like(p: Tensor) -> Tensor:
    # Page-locked where a copy engine reads it (CUDA); torch refuses pinning without CUDA.
    return torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=p.is_cuda)


class HostOptimizer(torch.optim.Optimizer):
    """Runs ``optimizer`` on host copies of ``params``, keeping its state off the device.

    Args:
        optimizer: the optimizer class (or a factory taking parameter groups and keywords),
            for example ``torch.optim.Adam``.
        params: the parameters, or parameter groups (dicts with ``"params"``), as for torch's optimizers.
        **kwargs: the optimizer's settings (``lr=1e-4``, ...).

    ``param_groups`` and ``state`` are the wrapped optimizer's: a learning-rate scheduler drives it
    as usual, and ``state_dict()`` is what the plain optimizer over the same parameters would
    save (parameters numbered in the same order), so checkpoints load either way.

    Raises:
        ValueError: no parameters, a non-leaf, sparse or repeated tensor, or an optimizer that
            steps with a closure.
        TypeError: ``optimizer`` does not build a ``torch.optim.Optimizer``.
    """

    def __init__(self, optimizer: Callable[..., torch.optim.Optimizer], params: Iterable[Any], **kwargs: Any) -> None:
        groups = _groups(params)
        seen: set[int] = set()
        self._pairs: list[tuple[Tensor, Tensor]] = []
        host_groups = [self._host_group(group, seen) for group in groups]
        with host_scope():
            inner = optimizer(host_groups, **kwargs)
        if not isinstance(inner, torch.optim.Optimizer):
            raise TypeError(
                f"fastpipe: HostOptimizer's optimizer must build a torch.optim.Optimizer (e.g. torch.optim.Adam); "
                f"{optimizer!r} built {type(inner).__name__}"
            )
        self._grad_buffers: dict[int, Tensor] = {}
        self._index: dict[int, Tensor] | None = None  # host_of's, built on first use
        super().__init__([{"params": [h for _, h in self._pairs]}], dict(inner.defaults))
        self.inner = inner
        # One set of groups and state, the wrapped optimizer's: a scheduler's lr reaches it.
        self.param_groups = inner.param_groups
        self.state = inner.state
        self.defaults = inner.defaults

    @property
    def device_params(self) -> list[Tensor]:
        """The parameters it steps, on their devices, in order."""
        return [p for p, _ in self._pairs]

    @property
    def host_params(self) -> list[Tensor]:
        """The host copies it steps, in the order of :attr:`device_params`."""
        return [h for _, h in self._pairs]

    def host_of(self, p: Tensor) -> Tensor | None:
        """The host copy of device parameter ``p`` (None: not one of its parameters).

        It equals ``p`` after each step that updated ``p``; before the first, it is ``p`` as it was
        when the optimizer was built.
        """
        if self._index is None:
            self._index = {id(d): h for d, h in self._pairs}
        return self._index.get(id(p))

    def host_bytes(self) -> int:
        """Host bytes it holds: the copies, their gradients and the wrapped optimizer's state."""
        tensors = [h for _, h in self._pairs] + list(self._grad_buffers.values())
        tensors += [t for s in self.inner.state.values() for t in s.values() if isinstance(t, Tensor)]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return sum(storages.values())

    def _grad_buffer(self, p: Tensor, h: Tensor) -> Tensor:
        buf = self._grad_buffers.get(id(h))
        if buf is None:
            with host_scope():
                buf = self._grad_buffers[id(h)] = _host_like(p)
        return buf

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """Copy parameters and gradients to the host, step there, and copy the parameters back.

        A parameter without a gradient is skipped by the wrapped optimizer, as it would be on the device,
        and is not copied either way: ``fit`` steps one stage's parameters at a time while other
        stages compute with theirs.

        Raises:
            ValueError: a closure (the loss would have to be recomputed on the device between copies).
        """
        if closure is not None:
            raise ValueError(
                "fastpipe: HostOptimizer.step takes no closure; compute the loss and backward first, then call step()"
            )
        accelerators: set[torch.device] = set()
        for p, h in self._pairs:
            if p.grad is not None and p.grad.is_sparse:
                raise ValueError("fastpipe: HostOptimizer steps dense gradients; this parameter's gradient is sparse")
            if p.grad is None:
                h.grad = None
                continue
            h.copy_(p, non_blocking=p.is_cuda)
            buf = self._grad_buffer(p, h)
            buf.copy_(p.grad, non_blocking=p.is_cuda)
            h.grad = buf
            if p.is_cuda:
                accelerators.add(p.device)
        for device in accelerators:  # the copies above were queued on each device's current stream
            torch.cuda.current_stream(device).synchronize()
        with host_scope():
            self.inner.step()
        for p, h in self._pairs:
            if h.grad is not None:
                p.copy_(h, non_blocking=p.is_cuda)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the device parameters' gradients (and the host copies')."""
        for p, h in self._pairs:
            h.grad = None
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().zero_()

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict: what the plain optimizer over the same parameters saves."""
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved by it or by the plain optimizer over the same parameters, onto the host."""
        with host_scope():
            self.inner.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of device parameters; its host copies join the wrapped optimizer."""
        if not hasattr(self, "inner"):  # torch.optim.Optimizer.__init__ adds the first group
            super().add_param_group(param_group)
            return
        (group,) = _groups([param_group])
        host_group = self._host_group(group, {id(p) for p, _ in self._pairs})
        with host_scope():
            self.inner.add_param_group(host_group)

    def _host_group(self, group: dict[str, Any], seen: set[int]) -> dict[str, Any]:
        """``group`` with host copies of its parameters in their place; each pair joins ``_pairs``."""
        copies = []
        self._index = None  # host_of's index, rebuilt with this group's pairs
        with host_scope(), torch.no_grad():
            for p in group["params"]:
                _check(p, seen)
                h = _host_like(p).copy_(p.detach()).requires_grad_(p.requires_grad)
                self._pairs.append((p, h))
                copies.append(h)
        return {**group, "params": copies}

    def __repr__(self) -> str:
        return f"HostOptimizer({self.inner!r})"
