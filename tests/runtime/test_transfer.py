"""start_transfer on CPU (host backend): values, dtypes, shapes, lifetimes."""

from __future__ import annotations

import gc

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
