"""A block's exact peak bytes on one device, with parameters, gradients and optimizer state split out.

::

    with PeakMeter("cpu", modules=model, optimizers=opt) as meter:
        loss = pipe.train_step(x, y, loss_fn)
        opt.step()
    print(meter.result)   # cpu: peak 12.00 MiB above 5.00 MiB at start (transient 9.00 MiB, ...)

Where the bytes come from:

* **CUDA**: the caching allocator's statistics (``torch.cuda.memory_allocated``,
  ``max_memory_allocated``, ``reset_peak_memory_stats``), read after synchronizing the device.
  They count blocks as the allocator rounds them (multiples of 512 bytes) and every stream and
  thread of the process, which is what the device holds.
* **CPU**: :mod:`fastpipe.memory._cpu_counter`, a counting wrapper of c10's CPU allocator,
  exact to the byte and process-wide: fastpipe's stage workers and autograd's engine threads
  are all counted. It is built and installed on the first CPU meter.

The static split (:class:`StaticBytes`) is computed exactly by walking the given modules and
optimizers: every storage on the device counted once, so tied weights and views add nothing
twice; a tensor subclass is walked into the tensors it wraps.

Why not ``torch.distributed._tools.mem_tracker.MemTracker``: it is a ``TorchDispatchMode`` plus
module hooks, so it sees what runs on the thread that entered it (and CPU autograd, which runs
on the calling thread), and nothing that fastpipe's stage workers allocate. On a one-thread step
it agrees with this meter; tests/memory/test_accounting_memtracker.py pins by how much.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from fastpipe.memory import _cpu_counter

__all__ = ["PeakMemory", "PeakMeter", "StaticBytes", "measure_peak", "static_bytes"]

_MIB = float(1 << 20)


def _mib(nbytes: int) -> str:
    return f"{nbytes / _MIB:.2f} MiB"


@dataclass(frozen=True)
class StaticBytes:
    """Bytes on one device of what a training step keeps between steps.

    Attributes:
        parameters: the parameters' storages.
        gradients: the ``.grad`` storages of those parameters.
        optimizer_state: the tensors in the optimizers' ``state`` (moments, step counters).
    """

    parameters: int
    gradients: int
    optimizer_state: int

    @property
    def total(self) -> int:
        """Parameters, gradients and optimizer state together."""
        return self.parameters + self.gradients + self.optimizer_state


@dataclass(frozen=True)
class PeakMemory:
    """What a :class:`PeakMeter` measured on its device.

    Attributes:
        device: the device measured.
        start: bytes alive on the device when the block began (on CPU, those the counter saw
            allocated since it was installed).
        peak: the most bytes alive at any moment of the block, above ``start``.
        end: bytes alive when the block ended, above ``start`` (negative if it freed more than it kept).
        static: parameters, gradients and optimizer state on the device when the block ended.
        static_at_start: the same total when the block began.
    """

    device: torch.device
    start: int
    peak: int
    end: int
    static: StaticBytes
    static_at_start: int

    @property
    def peak_total(self) -> int:
        """The most bytes alive on the device during the block, counting those alive at its start."""
        return self.start + self.peak

    @property
    def static_created(self) -> int:
        """Static bytes the block added (a first step's gradients and optimizer state), or 0."""
        return max(0, self.static.total - self.static_at_start)

    @property
    def transient(self) -> int:
        """The peak less the static bytes the block created: activations, W records, buffers, temporaries.

        Exact when the static bytes the block created were alive at its peak (gradients that
        persist through the step, optimizer state present from the start); otherwise a lower
        bound of what was transient at the peak.
        """
        return max(0, self.peak - self.static_created)

    def __str__(self) -> str:
        s = self.static
        return (
            f"{self.device}: peak {_mib(self.peak)} above {_mib(self.start)} at start "
            f"(transient {_mib(self.transient)}, created static {_mib(self.static_created)}); "
            f"at the end: parameters {_mib(s.parameters)}, gradients {_mib(s.gradients)}, "
            f"optimizer state {_mib(s.optimizer_state)}"
        )


def _leaf_tensors(value: Any) -> Iterator[torch.Tensor]:
    """The plain tensors in ``value``: containers walked, tensor subclasses opened."""
    if isinstance(value, torch.Tensor):
        if is_traceable_wrapper_subclass(value):
            names, _ = value.__tensor_flatten__()
            for name in names:
                yield from _leaf_tensors(getattr(value, name))
        else:
            yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _leaf_tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _leaf_tensors(item)


def _on(tensor: torch.Tensor, device: torch.device) -> bool:
    if tensor.device.type != device.type:
        return False
    return device.type == "cpu" or tensor.device.index == device.index


class _Storages:
    """Sums storage bytes on one device, each storage once across everything added."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._seen: set[int] = set()

    def add(self, value: Any) -> int:
        total = 0
        for tensor in _leaf_tensors(value):
            if not _on(tensor, self._device):
                continue
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in self._seen:
                continue
            self._seen.add(storage.data_ptr())
            total += storage.nbytes()
        return total


def _as_tuple(value: Any, kind: type) -> tuple[Any, ...]:
    return (value,) if isinstance(value, kind) else tuple(value)


def static_bytes(
    device: torch.device | str | int,
    modules: nn.Module | Iterable[nn.Module] = (),
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] = (),
) -> StaticBytes:
    """Exact bytes of parameters, gradients and optimizer state on ``device``.

    Args:
        device: the device whose bytes count; tensors elsewhere are left out.
        modules: modules whose parameters (and their gradients) count.
        optimizers: optimizers whose state counts, and whose parameters count too.

    Each storage counts once, in the first of parameters, gradients, optimizer state where it
    appears: a weight tied between two layers, or a parameter held by a module and an
    optimizer, counts once.
    """
    where = _device(device)
    mods = _as_tuple(modules, nn.Module)
    opts = _as_tuple(optimizers, torch.optim.Optimizer)
    params: dict[int, nn.Parameter] = {}
    for module in mods:
        for p in module.parameters():
            params.setdefault(id(p), p)
    for opt in opts:
        for group in opt.param_groups:
            for p in group["params"]:
                params.setdefault(id(p), p)
    storages = _Storages(where)
    parameters = storages.add(list(params.values()))
    gradients = storages.add([p.grad for p in params.values() if p.grad is not None])
    optimizer_state = storages.add([list(opt.state.values()) for opt in opts])
    return StaticBytes(parameters, gradients, optimizer_state)


class _Source(Protocol):
    def synchronize(self) -> None: ...
    def allocated(self) -> int: ...
    def peak(self) -> int: ...
    def reset_peak(self) -> None: ...


class _CPU:
    def __init__(self) -> None:
        _cpu_counter.install()

    def synchronize(self) -> None:
        """Nothing to wait for: CPU ops have run when they return, and the counter is updated as they allocate."""

    def allocated(self) -> int:
        return _cpu_counter.allocated()

    def peak(self) -> int:
        return _cpu_counter.peak()

    def reset_peak(self) -> None:
        _cpu_counter.reset_peak()


class _CUDA:
    def __init__(self, device: torch.device) -> None:
        self._device = device

    def synchronize(self) -> None:
        torch.cuda.synchronize(self._device)

    def allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self._device))

    def peak(self) -> int:
        return int(torch.cuda.max_memory_allocated(self._device))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self._device)


def _device(device: torch.device | str | int) -> torch.device:
    if isinstance(device, bool):
        raise TypeError(
            f"device must be a torch.device, a string such as 'cpu' or 'cuda:0', or a CUDA index; got {device!r}"
        )
    where = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if where.type == "cpu":
        return torch.device("cpu")
    if where.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"cannot measure {where}: this torch sees no CUDA device; measure 'cpu' instead")
        return torch.device("cuda", torch.cuda.current_device() if where.index is None else where.index)
    raise ValueError(f"PeakMeter measures 'cpu' or 'cuda[:N]' devices; got {str(where)!r}")


# Open meters per device, innermost last. An inner meter resets the device's peak statistic,
# so on entering it hands the outer one the peak seen so far, and on leaving its own peak.
_open: dict[torch.device, list[PeakMeter]] = {}
_open_lock = threading.Lock()


class PeakMeter:
    """Measures the peak bytes on ``device`` during a ``with`` block; the result is in :attr:`result`.

    Meters on one device nest (an inner one leaves the outer one's peak intact) and must close
    in the reverse order they opened. On CPU every thread of the process counts, so measure
    with no unrelated work running.

    Args:
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"``, a ``torch.device`` or a CUDA index.
        modules: modules whose parameters and gradients form the static split.
        optimizers: optimizers whose state (and parameters) form the static split.

    Raises:
        ValueError: a device other than CPU or CUDA, or CUDA without a device.
        fastpipe.memory._cpu_counter.CounterUnavailableError: CPU, where the counter cannot be built.
    """

    def __init__(
        self,
        device: torch.device | str | int,
        *,
        modules: nn.Module | Iterable[nn.Module] = (),
        optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] = (),
    ) -> None:
        self.device = _device(device)
        self._modules = _as_tuple(modules, nn.Module)
        self._optimizers = _as_tuple(optimizers, torch.optim.Optimizer)
        self._source: _Source = _CPU() if self.device.type == "cpu" else _CUDA(self.device)
        self._state = "new"
        self._result: PeakMemory | None = None
        self._start = 0
        self._static_start = 0
        self._carried = 0  # the highest absolute bytes seen in this window before the statistic was last reset

    @property
    def result(self) -> PeakMemory:
        """The measurement, once the ``with`` block has ended."""
        if self._result is None:
            raise RuntimeError("PeakMeter.result is read after its `with` block ends")
        return self._result

    def __enter__(self) -> PeakMeter:
        if self._state != "new":
            raise RuntimeError("a PeakMeter measures one block; make a new one for the next block")
        self._state = "open"
        self._static_start = static_bytes(self.device, self._modules, self._optimizers).total
        self._source.synchronize()
        with _open_lock:
            stack = _open.setdefault(self.device, [])
            if stack:
                outer = stack[-1]
                outer._carried = max(outer._carried, self._source.peak())
            self._source.reset_peak()
            self._start = self._source.allocated()
            self._carried = self._start
            stack.append(self)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._source.synchronize()
        with _open_lock:
            stack = _open[self.device]
            if stack[-1] is not self:
                raise RuntimeError(f"PeakMeters on {self.device} must close in the reverse order they opened")
            highest = max(self._carried, self._source.peak())
            end = self._source.allocated()
            stack.pop()
            if stack:
                stack[-1]._carried = max(stack[-1]._carried, highest)
        self._state = "closed"
        self._result = PeakMemory(
            device=self.device,
            start=self._start,
            peak=highest - self._start,
            end=end - self._start,
            static=static_bytes(self.device, self._modules, self._optimizers),
            static_at_start=self._static_start,
        )


def measure_peak(
    fn: Callable[[], object],
    device: torch.device | str | int,
    *,
    modules: nn.Module | Iterable[nn.Module] = (),
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] = (),
) -> PeakMemory:
    """Run ``fn()`` under a :class:`PeakMeter` on ``device`` and return what it measured.

    ``fn``'s return value is dropped before the measurement ends, so it is not held at the end.
    """
    with PeakMeter(device, modules=modules, optimizers=optimizers) as meter:
        fn()
    return meter.result
