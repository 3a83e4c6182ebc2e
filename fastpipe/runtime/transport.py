"""How the values between stages travel: the one thing local and distributed runs differ in.

A :class:`Transport` moves a stage's output activations to the next stage and the
gradients of a stage's input back to the previous one, keyed by (stage, micro-batch), and
a skip's tensors (:mod:`fastpipe.model.skips`) straight from the stage that stashes them to the
stage that pops them and their gradients straight back, keyed by (producer, consumer,
micro-batch). The step logic (:mod:`fastpipe.runtime.step`) only calls these methods, so a
transport over threads (:class:`LocalTransport`) and one over processes can share it.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from fastpipe.runtime.mailbox import Mailbox
from fastpipe.step.microbatch import Value, rebuilt, replace_tensors, tensors_of

__all__ = ["Transport", "LocalTransport", "receive"]


class Transport(abc.ABC):
    """Interface: delivery of activations (forward) and gradients (backward)."""

    @abc.abstractmethod
    def send_activation(self, stage: int, microbatch: int, value: Value, requires_grad: Sequence[bool]) -> None:
        """Deliver ``value`` as the input of ``stage``; ``requires_grad`` per tensor item."""

    @abc.abstractmethod
    def recv_activation(self, stage: int, microbatch: int) -> Value:
        """The input of ``stage`` as detached leaves (blocking until it arrived)."""

    @abc.abstractmethod
    def send_grad(self, stage: int, microbatch: int, grads: Sequence[Tensor | None]) -> None:
        """Deliver the gradients of ``stage``'s output tensors."""

    @abc.abstractmethod
    def recv_grad(self, stage: int, microbatch: int) -> list[Tensor | None]:
        """The gradients of ``stage``'s output tensors (blocking until they arrived)."""

    @abc.abstractmethod
    def send_skip(
        self, producer: int, consumer: int, microbatch: int, value: tuple, requires_grad: Sequence[bool]
    ) -> None:
        """Deliver the tensors ``producer`` stashed for ``consumer`` (:mod:`fastpipe.model.skips`), straight to it."""

    @abc.abstractmethod
    def recv_skip(self, producer: int, consumer: int, microbatch: int) -> tuple:
        """The tensors ``producer`` stashed for ``consumer``, as detached leaves (blocking)."""

    @abc.abstractmethod
    def send_skip_grad(self, producer: int, consumer: int, microbatch: int, grads: Sequence[Tensor | None]) -> None:
        """Deliver the gradients of those tensors, from ``consumer`` straight back to ``producer``."""

    @abc.abstractmethod
    def recv_skip_grad(self, producer: int, consumer: int, microbatch: int) -> list[Tensor | None]:
        """The gradients of the tensors ``producer`` stashed for ``consumer`` (blocking)."""

    @abc.abstractmethod
    def abort(self, exc: BaseException) -> None:
        """Wake every waiter with an error: the step failed elsewhere."""


class LocalTransport(Transport):
    """Threads of one process: a mailbox, plus device copies through ``fastpipe._C``.

    Args:
        devices: the device of every stage.
        force_copy: copy even between stages on the same device (tests the copy path on
            CPU-only hosts).
    """

    def __init__(self, devices: Sequence[torch.device], force_copy: bool = False) -> None:
        self.devices = list(devices)
        self.force_copy = force_copy
        self.mailbox = Mailbox()

    def send_activation(self, stage: int, microbatch: int, value: Value, requires_grad: Sequence[bool]) -> None:
        sent = [_send(t, f, self.devices[stage], self.force_copy) for t, f in zip(tensors_of(value), requires_grad)]
        self.mailbox.put(self.slot("act", stage, microbatch), replace_tensors(value, sent))

    def recv_activation(self, stage: int, microbatch: int) -> Value:
        return receive(self.mailbox.take(self.slot("act", stage, microbatch)))

    def send_grad(self, stage: int, microbatch: int, grads: Sequence[Tensor | None]) -> None:
        device = self.devices[stage]
        sent = [None if g is None else _send(g, False, device, self.force_copy) for g in grads]
        self.mailbox.put(self.slot("grad", stage, microbatch), sent)

    def recv_grad(self, stage: int, microbatch: int) -> list[Tensor | None]:
        return receive(self.mailbox.take(self.slot("grad", stage, microbatch)))

    def send_skip(
        self, producer: int, consumer: int, microbatch: int, value: tuple, requires_grad: Sequence[bool]
    ) -> None:
        sent = [_send(t, f, self.devices[consumer], self.force_copy) for t, f in zip(value, requires_grad)]
        self.mailbox.put(("skip", producer, consumer, microbatch), tuple(sent))

    def recv_skip(self, producer: int, consumer: int, microbatch: int) -> tuple:
        return receive(self.mailbox.take(("skip", producer, consumer, microbatch)))

    def send_skip_grad(self, producer: int, consumer: int, microbatch: int, grads: Sequence[Tensor | None]) -> None:
        device = self.devices[producer]
        sent = [None if g is None else _send(g, False, device, self.force_copy) for g in grads]
        self.mailbox.put(("skip_grad", producer, consumer, microbatch), sent)

    def recv_skip_grad(self, producer: int, consumer: int, microbatch: int) -> list[Tensor | None]:
        return receive(self.mailbox.take(("skip_grad", producer, consumer, microbatch)))

    @staticmethod
    def slot(kind: str, stage: int, microbatch: int) -> tuple[str, int, int]:
        """The mailbox slot of ``stage``'s incoming ``"act"``ivation or ``"grad"``ient."""
        return (kind, stage, microbatch)

    def abort(self, exc: BaseException) -> None:
        self.mailbox.abort(exc)


class _Pending:
    """A transfer in flight plus the ``requires_grad`` flag its result must carry."""

    __slots__ = ("transfer", "requires_grad")

    def __init__(self, transfer: Any, requires_grad: bool) -> None:
        self.transfer = transfer
        self.requires_grad = requires_grad

    def wait(self) -> Tensor:
        t = self.transfer.wait()
        return t.requires_grad_(self.requires_grad) if self.requires_grad else t


def _send(t: Tensor, requires_grad: bool, device: torch.device, force_copy: bool = False) -> Any:
    """Detach ``t`` into a leaf for the consumer, starting a copy when it changes device."""
    if t.device == device and not force_copy:
        return t.detach().requires_grad_(requires_grad)
    from fastpipe.runtime.transfer import start_transfer  # only needed across devices

    return _Pending(start_transfer(t.detach(), device, force=force_copy), requires_grad)


def receive(value: Any) -> Any:
    """Finish the transfers inside ``value``; the consumer's stream waits for each copy."""
    if isinstance(value, tuple):
        return rebuilt(value, [receive(v) for v in value])
    if isinstance(value, list):
        return [receive(v) for v in value]
    if isinstance(value, _Pending):
        return value.wait()
    return value
