"""fastpipe._C on the host backend: ordering, events, pool, copies, errors, leaks."""

from __future__ import annotations

import time

import pytest
import torch

from fastpipe import _C


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


@pytest.fixture
def stream():
    s = _C.Stream(-1)
    yield s
    s.close()


def test_module_surface():
    assert isinstance(_C.version, str)
    assert _C.backend_available("host")
    assert isinstance(_C.backend_available("cuda"), bool)
    with pytest.raises(ValueError):
        _C.backend_available("tpu")
    s = _C.Stream()
    assert s.backend == "host" and s.device == -1 and s.owned and not s.closed
    s.close()
    assert s.closed


def test_fifo_on_one_stream(stream):
    # A slow first copy must still land before the second one overwrites it.
    src_a, src_b = _bytes(1 << 20, 1), _bytes(1 << 20, 2)
    dst = torch.zeros(1 << 20, dtype=torch.uint8)
    stream.delay(0.05)
    stream.copy(dst.data_ptr(), src_a.data_ptr(), dst.numel())
    stream.copy(dst.data_ptr(), src_b.data_ptr(), dst.numel())
    stream.synchronize()
    assert torch.equal(dst, src_b)


def test_event_query_synchronize_and_timing(stream):
    start, end = _C.Event(enable_timing=True), _C.Event(enable_timing=True)
    start.record(stream)
    stream.delay(0.3)  # long enough that a descheduled test thread still sees it pending
    end.record(stream)
    assert not end.query()
    assert not stream.query()
    end.synchronize()
    assert end.query() and start.query()
    assert start.elapsed_time(end) >= 290.0
    assert start.elapsed_time(start) == 0.0
    assert stream.query()


def test_event_never_recorded_counts_as_complete(stream):
    e = _C.Event()
    assert not e.recorded and e.device == -2
    assert e.query()
    e.synchronize()
    e.wait(stream)  # no-op
    stream.synchronize()
    with pytest.raises(_C.Error, match="enable_timing"):
        e.elapsed_time(_C.Event())
    with pytest.raises(_C.Error, match="never recorded"):
        _C.Event(True).elapsed_time(_C.Event(True))


def test_elapsed_time_before_completion_raises(stream):
    a, b = _C.Event(True), _C.Event(True)
    a.record(stream)
    stream.delay(0.5)
    b.record(stream)
    with pytest.raises(_C.Error, match="not completed"):
        a.elapsed_time(b)
    stream.synchronize()
    assert a.elapsed_time(b) > 0


def test_wait_orders_work_across_streams():
    a, b = _C.Stream(), _C.Stream()
    try:
        n = 1 << 20
        src = _bytes(n, 3)
        mid = torch.zeros(n, dtype=torch.uint8)
        out = torch.zeros(n, dtype=torch.uint8)
        a.delay(0.1)  # make A's copy late
        a.copy(mid.data_ptr(), src.data_ptr(), n)
        ev = a.record_event()
        b.wait_event(ev)
        b.copy(out.data_ptr(), mid.data_ptr(), n)  # depends on A's result
        done = b.record_event()
        done.synchronize()
        assert torch.equal(out, src)
    finally:
        a.close()
        b.close()


def test_rerecord_keeps_earlier_waits(stream):
    other = _C.Stream()
    try:
        e = _C.Event()
        stream.delay(0.1)
        e.record(stream)
        e.wait(other)  # waits for the first record only
        flag = torch.zeros(1, dtype=torch.uint8)
        one = torch.ones(1, dtype=torch.uint8)
        other.copy(flag.data_ptr(), one.data_ptr(), 1)
        stream.delay(1.5)
        e.record(stream)  # re-record after a long delay: must not hold `other` back
        t0 = time.perf_counter()
        other.synchronize()
        assert time.perf_counter() - t0 < 1.0
        assert flag.item() == 1
        assert not e.query()  # the event now stands for the second record
    finally:
        other.close()


def test_event_bound_to_device(stream):
    e = _C.Event()
    e.record(stream)
    assert e.device == -1 and e.recorded


@pytest.mark.parametrize("n", [1, 3, 4097, 1_000_003])
def test_copy_odd_sizes(stream, n):
    src = _bytes(n, n)
    dst = torch.zeros(n + 2, dtype=torch.uint8)  # guard bytes on the right
    stream.copy(dst.data_ptr() + 1, src.data_ptr(), n, "h2h")
    stream.synchronize()
    assert torch.equal(dst[1 : n + 1], src)
    assert dst[0].item() == 0 and dst[n + 1].item() == 0


@pytest.mark.parametrize("kind", ["default", "h2d", "d2h", "d2d", "h2h"])
def test_copy_kinds_are_memcpy_on_host(stream, kind):
    src, dst = _bytes(100), torch.zeros(100, dtype=torch.uint8)
    stream.copy(dst.data_ptr(), src.data_ptr(), 100, kind)
    stream.synchronize()
    assert torch.equal(dst, src)


def test_zero_byte_copy_is_noop(stream):
    stream.copy(0, 0, 0)
    stream.synchronize()


def test_bad_arguments_raise_clear_errors(stream):
    buf = torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="null destination"):
        stream.copy(0, buf.data_ptr(), 8)
    with pytest.raises(ValueError, match="null source"):
        stream.copy(buf.data_ptr(), 0, 8)
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        stream.copy(buf.data_ptr(), buf.data_ptr(), -1)
    with pytest.raises(ValueError, match="unknown copy kind"):
        stream.copy(buf.data_ptr(), buf.data_ptr(), 8, "sideways")
    with pytest.raises(ValueError):
        stream.delay(-1.0)
    with pytest.raises(ValueError):
        _C.Stream(-5)
    with pytest.raises(ValueError, match="CUDA streams only"):
        _C.Stream.from_handle(-1, 0)
    with pytest.raises(ValueError):
        _C.memcpy(0, buf.data_ptr(), 1)


def test_closed_stream_raises():
    s = _C.Stream()
    s.close()
    s.close()  # idempotent
    buf = torch.zeros(8, dtype=torch.uint8)
    for op in (
        lambda: s.copy(buf.data_ptr(), buf.data_ptr(), 8),
        s.synchronize,
        s.query,
        lambda: s.delay(0.0),
        lambda: s.record_event(),
        lambda: _C.Event().record(s),
    ):
        with pytest.raises(_C.Error, match="stream is closed"):
            op()
    e = _C.Event()
    e.record(_C.Stream())
    with pytest.raises(_C.Error, match="stream is closed"):
        e.wait(s)


def test_close_drains_queued_work():
    s = _C.Stream()
    src, dst = _bytes(1000, 9), torch.zeros(1000, dtype=torch.uint8)
    s.delay(0.05)
    s.copy(dst.data_ptr(), src.data_ptr(), 1000)
    s.close()
    assert torch.equal(dst, src)


def test_no_leaked_threads():
    base = _C.live_host_threads()
    streams = [_C.Stream() for _ in range(8)]
    assert _C.live_host_threads() == base + 8
    for s in streams:
        s.delay(0.001)
    for s in streams:
        s.close()
    assert _C.live_host_threads() == base
    # Garbage collection closes too.
    s = _C.Stream()
    assert _C.live_host_threads() == base + 1
    del s
    assert _C.live_host_threads() == base
    with _C.Stream() as s:
        s.delay(0.0)
    assert s.closed and _C.live_host_threads() == base


def test_synchronize_releases_gil(stream):
    import threading

    stream.delay(0.2)
    ticks = []

    def spin() -> None:
        t_end = time.monotonic() + 0.15
        while time.monotonic() < t_end:
            ticks.append(1)
            time.sleep(0.005)

    th = threading.Thread(target=spin)
    th.start()
    stream.synchronize()
    th.join()
    assert len(ticks) > 5


def test_pool_reuses_blocks_without_pow2_waste():
    pool = _C.HostBufferPool(-1)
    n = 3 * 2**20 + 1
    blk = pool.acquire(n)
    assert blk.nbytes == n and blk.capacity >= n
    assert blk.ptr % 4096 == 0
    st = pool.stats()
    assert st["reserved_bytes"] <= 1.125 * n
    assert st["misses"] == 1 and st["hits"] == 0 and st["in_use_bytes"] == blk.capacity
    ptr = blk.ptr
    blk.release()
    blk.release()  # idempotent
    with pytest.raises(_C.Error, match="released"):
        _ = blk.ptr
    assert pool.stats()["in_use_bytes"] == 0
    again = pool.acquire(n)
    assert again.ptr == ptr
    st = pool.stats()
    assert st["hits"] == 1 and st["misses"] == 1 and st["reserved_bytes"] <= 1.125 * n
    del again  # garbage collection returns the block
    assert pool.stats()["cached_blocks"] == 1
    pool.empty_cache()
    assert pool.stats()["reserved_bytes"] == 0


@pytest.mark.parametrize("n", [513, 1000, 4097, 65_537, 1_000_003, 3 * 2**20 + 1, 100 * 2**20 + 7])
def test_size_classes_bound_slack(n):
    cap = _C.HostBufferPool.size_class(n)
    assert n <= cap <= 1.125 * n


def test_pool_block_buffer_protocol():
    pool = _C.HostBufferPool()
    with pool.acquire(10) as blk:
        view = torch.frombuffer(blk, dtype=torch.uint8)
        assert view.numel() == 10
        view.fill_(7)
        out = torch.zeros(10, dtype=torch.uint8)
        _C.memcpy(out.data_ptr(), blk.ptr, 10)
        assert out.tolist() == [7] * 10
        del view
    assert blk.released


def test_pool_block_outlives_pool():
    pool = _C.HostBufferPool()
    blk = pool.acquire(1000)
    del pool
    torch.frombuffer(blk, dtype=torch.uint8).fill_(1)
    blk.release()


def test_stress_small_copies_two_streams():
    a, b = _C.Stream(), _C.Stream()
    try:
        n_copies, size = 1000, 16
        src = _bytes(n_copies * size, 11)
        mid = torch.zeros_like(src)
        out = torch.zeros_like(src)
        for i in range(n_copies):
            off = i * size
            a.copy(mid.data_ptr() + off, src.data_ptr() + off, size)
            ev = a.record_event()
            b.wait_event(ev)
            b.copy(out.data_ptr() + off, mid.data_ptr() + off, size)
        b.synchronize()
        assert torch.equal(out, src)
        assert torch.equal(mid, src)
    finally:
        a.close()
        b.close()


def test_cuda_unavailable_is_reported_clearly():
    if _C.backend_available("cuda"):
        pytest.skip("a CUDA driver is present")
    assert _C.cuda_device_count() == 0
    assert _C.cuda_load_error()
    with pytest.raises(_C.Error, match="CUDA backend unavailable"):
        _C.Stream(0)
    with pytest.raises(_C.Error, match="CUDA backend unavailable"):
        _C.HostBufferPool(0)
    with pytest.raises(_C.Error, match="CUDA backend unavailable"):
        _C.Stream.from_handle(0, 0)


def test_streams_after_fork_fail_clearly_and_new_ones_work():
    import os

    from fastpipe.runtime import device as dev

    s = _C.Stream()
    cached = dev.copy_stream(torch.device("cpu"))
    s.delay(0.0)
    pid = os.fork()
    if pid == 0:  # child: report through the exit code, never return into pytest
        code = 1
        try:
            assert s.closed and _C.live_host_threads() == 0
            try:
                s.synchronize()
            except _C.Error as e:
                assert "fork" in str(e)
                fresh = dev.copy_stream(torch.device("cpu"))
                assert fresh is not cached and not fresh.closed
                src, dst = _bytes(100), torch.zeros(100, dtype=torch.uint8)
                fresh.copy(dst.data_ptr(), src.data_ptr(), 100)
                fresh.synchronize()
                s.close()  # no-op, must not hang
                code = 0 if torch.equal(src, dst) else 3
            else:
                code = 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    s.synchronize()  # the parent's stream is unaffected
    s.close()


def test_stream_work_overlaps_the_caller(stream):
    # Enqueueing returns at once; the stream's work runs while the caller works.
    t0 = time.perf_counter()
    stream.delay(0.3)
    enqueue_s = time.perf_counter() - t0
    time.sleep(0.3)  # the caller's "compute"
    stream.synchronize()
    total = time.perf_counter() - t0
    assert enqueue_s < 0.1
    assert total < 0.5  # serial would be >= 0.6


def test_a_fork_after_host_streams_ran_does_not_hang_the_child():
    # The device module's cache holds the only reference to these streams, so the child's
    # at-fork reset destroys them: their workers' threads are gone there, but their condition
    # variables still count them as waiters (a DataLoader's forked workers after offload).
    import os
    import signal

    from fastpipe.runtime import device as dev

    for direction in dev.COPY_DIRECTIONS:
        stream = dev.copy_stream(torch.device("cpu"), direction)
        stream.delay(0.0)
        stream.synchronize()  # the worker now waits for more work
        del stream
    pid = os.fork()
    if pid == 0:
        os._exit(0 if not dev._copy_streams else 1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.WEXITSTATUS(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError("the forked child hung in its at-fork reset")
