"""start_transfer on CPU (host backend): values, dtypes, shapes, lifetimes."""

from __future__ import annotations

import gc
import time

import pytest
import torch

from fastpipe import _C
from fastpipe.runtime import device as dev
from fastpipe.runtime.transfer import (
    Transfer,
    collect_pending,
    pending_count,
    start_transfer,
    synchronize_pending,
)

CPU = torch.device("cpu")


def test_same_device_without_force_is_identity():
    x = torch.randn(3, 4, requires_grad=True)
    tr = start_transfer(x, CPU)
    assert tr.done()
    assert tr.wait() is x


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(5, 7),
        lambda: torch.arange(-50, 1001, dtype=torch.int64),
        lambda: torch.tensor([True, False, True]),
        lambda: torch.randint(0, 100, (3, 5, 2), dtype=torch.int32),
        lambda: torch.randn(17, 9, dtype=torch.float64).t(),  # non-contiguous
        lambda: torch.randn(4, 6)[:, ::2],  # non-contiguous, strided
        lambda: torch.empty(0, 3),  # 0 elements
        lambda: torch.tensor(3.5),  # 0-dim
        lambda: torch.randn(250_001),  # odd size, 1_000_004 bytes
        lambda: torch.randn(8, 8, dtype=torch.bfloat16),
    ],
)
def test_forced_cpu_copy_preserves_values(make):
    x = make()
    tr = start_transfer(x, CPU, force=True)
    assert isinstance(tr, Transfer)
    y = tr.wait()
    assert tr.done()
    assert y.dtype == x.dtype and y.shape == x.shape and y.device == CPU
    assert y.is_contiguous() and not y.requires_grad
    assert torch.equal(y, x)
    if x.numel():
        assert y.data_ptr() != x.data_ptr()


def test_requires_grad_dropped():
    x = torch.randn(4, 4, requires_grad=True)
    y = start_transfer(x, CPU, force=True).wait()
    assert not y.requires_grad and y.grad_fn is None
    assert torch.equal(y, x.detach())


def test_copy_is_asynchronous_and_ordered():
    stream = dev.copy_stream(CPU)
    stream.delay(0.5)  # hold the copy stream so the transfer is surely in flight
    x = torch.randn(1000)
    tr = start_transfer(x, CPU, force=True)
    assert not tr.done()
    assert torch.equal(tr.wait(), x)
    assert tr.done()


def test_dropped_transfer_keeps_buffers_alive_until_done():
    stream = dev.copy_stream(CPU)
    synchronize_pending()
    before = pending_count()
    stream.delay(0.5)
    x = torch.randn(100_000)
    expected = x.clone()
    tr = start_transfer(x, CPU, force=True)
    del tr, x
    gc.collect()
    assert pending_count() == before + 1  # source and destination still held
    synchronize_pending()
    assert pending_count() == 0
    assert collect_pending() == 0
    # And the copy wrote correct data into memory that stayed valid.
    assert torch.equal(start_transfer(expected, CPU, force=True).wait(), expected)


def test_many_transfers_in_flight():
    xs = [torch.randn(i + 1, 3) for i in range(200)]
    trs = [start_transfer(x, CPU, force=True) for x in xs]
    for x, tr in zip(xs, trs, strict=True):
        assert torch.equal(tr.wait(), x)
    synchronize_pending()
    assert pending_count() == 0


def test_copy_stream_is_cached_per_device():
    assert dev.copy_stream(CPU) is dev.copy_stream("cpu")
    assert dev.backend_for(CPU) == "host"
    assert dev.runtime_device(CPU) == dev.HOST_DEVICE
    with pytest.raises(ValueError):
        dev.current_stream_handle(CPU)
    assert _C.live_host_threads() >= 1


def test_host_pool_is_shared():
    assert dev.host_pool(pinned=False) is dev.host_pool(pinned=False)
    if not _C.backend_available("cuda"):
        with pytest.raises(RuntimeError, match="pinned memory needs the CUDA backend"):
            dev.host_pool(pinned=True)


def test_copies_in_and_out_of_a_device_use_two_streams():
    into, out = dev.copy_stream(CPU, "in"), dev.copy_stream(CPU, "out")
    assert into is not out
    assert into is dev.copy_stream(CPU) and out is dev.copy_stream("cpu", "out")
    with pytest.raises(ValueError):
        dev.copy_stream(CPU, "sideways")


def _as_if_a_device(monkeypatch: pytest.MonkeyPatch, asked: list[tuple[torch.device, str]]) -> None:
    """Let the host backend stand in for a device in transfer's H2D and D2H paths."""
    from fastpipe.runtime import transfer

    compute = _C.Stream(dev.HOST_DEVICE)  # the "current stream" of the device: idle
    real = dev.copy_stream

    def copy_stream(device: torch.device, direction: str = "in") -> _C.Stream:
        asked.append((torch.device(device), direction))
        return real(device, direction)

    monkeypatch.setattr(transfer._dev, "copy_stream", copy_stream)
    monkeypatch.setattr(transfer._dev, "current_stream", lambda device: compute)
    monkeypatch.setattr(transfer._dev, "current_stream_handle", lambda device: 0)


def test_a_copy_out_does_not_queue_behind_a_copy_in(monkeypatch):
    from fastpipe.runtime import transfer

    asked: list[tuple[torch.device, str]] = []
    _as_if_a_device(monkeypatch, asked)
    x = torch.randn(1000)
    upload = transfer._host_to_device(x, CPU, x.numel() * 4)
    assert asked == [(CPU, "in")]
    dev.copy_stream(CPU, "in").delay(1.0)  # a long upload in flight
    offload = transfer._device_to_host(x, CPU, x.numel() * 4)
    assert asked[-1] == (CPU, "out")
    start = time.monotonic()
    assert torch.equal(offload.wait(), x)
    assert time.monotonic() - start < 0.5  # did not wait for the upload's stream
    assert torch.equal(upload.wait(), x)
    synchronize_pending()


class _FakeStream:
    def __init__(self, handle: int) -> None:
        self.cuda_stream = handle


class _FakeResult:
    def __init__(self) -> None:
        self.recorded: list[int] = []

    def record_stream(self, stream: _FakeStream) -> None:
        self.recorded.append(stream.cuda_stream)


class _DoneEvent:
    """An event that has already fired: a stream waiting on it goes on at once."""

    def wait(self, stream: object) -> None:
        return None

    def query(self) -> bool:
        return True


@pytest.mark.parametrize("allocated_on,recorded", [(7, []), (0, [7])])
def test_the_consumer_stream_is_recorded_when_it_did_not_allocate(monkeypatch, allocated_on, recorded):
    # A worker runs its stage on the caller's stream (7); the producer's thread allocated the
    # destination on the default stream (0): without record_stream the allocator could hand
    # that memory out again while the consumer still reads it.
    from fastpipe.runtime import transfer

    cuda0 = torch.device("cuda", 0)
    monkeypatch.setattr(transfer._dev, "capabilities", lambda device: dev._CUDA)
    monkeypatch.setattr(transfer._dev, "current_stream", lambda device: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _FakeStream(7))
    result = _FakeResult()
    tr = Transfer(result, cuda0, _DoneEvent(), stream=allocated_on)  # type: ignore[arg-type]
    assert tr.wait() is result
    assert tr.wait() is result  # once per consumer stream
    assert result.recorded == recorded
