"""fastpipe._C on the CUDA backend, and start_transfer to and from cuda:0.

Every test is marked ``gpu`` and skipped without CUDA. Tests that provoke driver
errors which could poison the CUDA context run in a subprocess.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch

from fastpipe import _C

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = torch.device("cuda", 0)


def _torch_stream() -> _C.Stream:
    return _C.Stream.from_handle(0, torch.cuda.current_stream(DEV).cuda_stream)


def test_backend_available():
    assert _C.backend_available("cuda"), _C.cuda_load_error()
    assert _C.cuda_device_count() == torch.cuda.device_count()
    assert _C.cuda_load_error() == ""
    s = _C.Stream(0)
    assert s.backend == "cuda" and s.device == 0 and s.owned and s.handle != 0
    s.close()
    assert s.closed
    with pytest.raises(ValueError, match="invalid CUDA device"):
        _C.Stream(torch.cuda.device_count() + 7)


def test_wrapped_torch_stream_orders_copy_after_torch_work():
    a = torch.randn(2048, 2048, device=DEV)
    y = a @ a  # queued on torch's current stream
    ready = _C.Event()
    ready.record(_torch_stream())
    copy = _C.Stream(0)
    ready.wait(copy)
    out = torch.empty_like(y)
    copy.copy(out.data_ptr(), y.data_ptr(), y.numel() * 4, "d2d")
    done = copy.record_event()
    done.synchronize()
    torch.cuda.synchronize()
    assert torch.equal(out, y)
    copy.close()


def test_torch_stream_waits_on_runtime_event():
    copy = _C.Stream(0)
    src = torch.randn(1 << 20, device=DEV)
    dst = torch.empty_like(src)
    torch.cuda.synchronize()
    copy.copy(dst.data_ptr(), src.data_ptr(), src.numel() * 4, "d2d")
    done = copy.record_event()
    done.wait(_torch_stream())
    total = dst.sum()  # ordered after the copy by the wait
    assert torch.allclose(total, src.sum())
    copy.close()


@pytest.mark.parametrize("n", [1, 3, 4097, 1_000_003])
def test_h2d_d2h_round_trip_odd_sizes(n):
    pool = _C.HostBufferPool(0)
    stream = _C.Stream(0)
    src_blk, back_blk = pool.acquire(n), pool.acquire(n)
    src = torch.frombuffer(src_blk, dtype=torch.uint8)
    src.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
    dev_buf = torch.zeros(n + 2, dtype=torch.uint8, device=DEV)
    torch.cuda.synchronize()
    stream.copy(dev_buf.data_ptr() + 1, src_blk.ptr, n, "h2d")
    stream.copy(back_blk.ptr, dev_buf.data_ptr() + 1, n, "d2h")
    stream.synchronize()
    back = torch.frombuffer(back_blk, dtype=torch.uint8)
    assert torch.equal(back, src)
    assert dev_buf[0].item() == 0 and dev_buf[n + 1].item() == 0
    # "default" lets the driver infer the direction (unified addressing).
    stream.copy(dev_buf.data_ptr(), src_blk.ptr, n, "default")
    stream.synchronize()
    assert torch.equal(dev_buf[:n].cpu(), src)
    del src, back
    stream.close()


def test_events_timing_and_query():
    s = _C.Stream(0)
    start, end = _C.Event(True), _C.Event(True)
    buf = torch.empty(64 << 20, dtype=torch.uint8, device=DEV)
    other = torch.empty_like(buf)
    torch.cuda.synchronize()
    start.record(s)
    for _ in range(4):
        s.copy(other.data_ptr(), buf.data_ptr(), buf.numel(), "d2d")
    end.record(s)
    end.synchronize()
    assert end.query() and s.query()
    assert end.device == 0
    assert start.elapsed_time(end) >= 0.0
    s.close()


def test_pinned_pool_reuse():
    pool = _C.HostBufferPool(0)
    n = 3 * 2**20 + 1
    blk = pool.acquire(n)
    ptr = blk.ptr
    assert pool.stats()["reserved_bytes"] <= 1.125 * n
    blk.release()
    assert pool.acquire(n).ptr == ptr


def test_as_torch_stream():
    from fastpipe.runtime import device as dev

    s = dev.copy_stream(DEV)
    ts = dev.as_torch_stream(s, DEV)
    assert ts.cuda_stream == s.handle
    with torch.cuda.stream(ts):
        assert dev.current_stream_handle(DEV) == s.handle
        x = torch.ones(10, device=DEV) * 2
    ts.synchronize()
    assert x.sum().item() == 20


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(33, 17),
        lambda: torch.arange(-5, 1000, dtype=torch.int64),
        lambda: torch.tensor([True, False, True]),
        lambda: torch.randn(17, 9).t(),
        lambda: torch.empty(0, 4),
        lambda: torch.randn(8, 8, dtype=torch.bfloat16),
    ],
)
def test_start_transfer_cpu_cuda_round_trip(make):
    from fastpipe.runtime.transfer import start_transfer, synchronize_pending

    x = make()
    y = start_transfer(x, DEV).wait()
    assert y.device == DEV and y.dtype == x.dtype and y.shape == x.shape and not y.requires_grad
    z = start_transfer(y, "cpu").wait()
    assert z.device.type == "cpu" and torch.equal(z, x)
    assert torch.equal(y.cpu(), x)
    w = start_transfer(y, DEV, force=True).wait()
    assert torch.equal(w.cpu(), x)
    if x.numel():
        assert w.data_ptr() != y.data_ptr()
    synchronize_pending()


def test_start_transfer_from_pinned_source():
    from fastpipe.runtime.transfer import start_transfer

    x = torch.randn(1000).pin_memory()
    assert torch.equal(start_transfer(x, DEV).wait().cpu(), x)


def test_dropped_transfers_do_not_free_memory_under_copies():
    from fastpipe.runtime.transfer import pending_count, start_transfer, synchronize_pending

    for i in range(20):
        start_transfer(torch.full((1 << 18,), float(i)), DEV)  # dropped at once
        start_transfer(torch.full((1 << 18,), float(i), device=DEV), "cpu")
    synchronize_pending()
    assert pending_count() == 0
    # Memory reused after the drain must be intact for a fresh transfer.
    x = torch.randn(1 << 18)
    assert torch.equal(start_transfer(x, DEV).wait().cpu(), x)


def test_transfer_wait_orders_consumer_stream():
    from fastpipe.runtime.transfer import start_transfer

    side = torch.cuda.Stream(DEV)
    x = torch.randn(1 << 22)
    with torch.cuda.stream(side):
        tr = start_transfer(x, DEV)
        y = tr.wait()  # makes `side` wait for the copy, without blocking the host
        doubled = y * 2  # queued on `side`, after the copy
        back = doubled.cpu()  # synchronous on `side`
    assert torch.equal(back, x * 2)


def test_start_transfer_peer():
    from fastpipe.runtime.transfer import start_transfer

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    x = torch.randn(1000, device=DEV)
    y = start_transfer(x, torch.device("cuda", 1)).wait()
    assert y.device.index == 1 and torch.equal(y.cpu(), x.cpu())


def _run_isolated(code: str) -> subprocess.CompletedProcess[str]:
    # Outside the checkout, so the installed package (with its built _C) is imported.
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tempfile.gettempdir(),
    )


def test_cuda_errors_name_the_code():
    # Out-of-range pinned allocation, and a copy from a pointer that is not device
    # memory: both must raise CudaError naming a CUDA_ERROR_* code and the call.
    r = _run_isolated(
        """
        from fastpipe import _C
        s = _C.Stream(0)
        try:
            _C.HostBufferPool(0).acquire(1 << 55)
        except _C.CudaError as e:
            print("ALLOC", e)
        except MemoryError as e:
            print("ALLOC MemoryError", e)
        import torch
        host = torch.zeros(16, dtype=torch.uint8)
        try:
            s.copy(host.data_ptr(), 16, 16, "d2h")
            s.synchronize()
        except _C.CudaError as e:
            print("COPY", e)
        """
    )
    assert r.returncode == 0, r.stderr
    assert "ALLOC CUDA_ERROR_" in r.stdout and "cuMemHostAlloc" in r.stdout, r.stdout
    assert "COPY CUDA_ERROR_" in r.stdout, r.stdout
    assert issubclass(_C.CudaError, _C.Error) and issubclass(_C.CudaError, RuntimeError)


def test_cross_backend_wait_rules():
    host = _C.Stream(-1)
    gpu = _C.Stream(0)
    e_host = host.record_event()
    with pytest.raises(ValueError, match="cannot wait on an event recorded on a host stream"):
        e_host.wait(gpu)
    # A host stream may wait on GPU work: its worker blocks on the CUDA event.
    e_gpu = gpu.record_event()
    e_gpu.wait(host)
    host.synchronize()
    host.close()
    gpu.close()
