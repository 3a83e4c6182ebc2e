"""The CPU counter counts every CPU storage's bytes exactly, on every thread, and never goes negative."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from _memory_utils import on_thread

from fastpipe.memory import _cpu_counter as counter

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "setup.py").is_file())


@pytest.fixture(autouse=True)
def installed() -> None:
    counter.install()


def test_current_and_peak_are_the_exact_sums_of_known_sizes() -> None:
    sizes = [1000, 2048, 333, 12288, 7]
    base = counter.allocated()
    counter.reset_peak()
    held = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    assert counter.allocated() - base == sum(sizes)
    del held[3], held[1]  # 12288 and 2048
    assert counter.allocated() - base == 1000 + 333 + 7
    held.append(torch.empty(100, dtype=torch.float64))  # 800 bytes: below the earlier high
    assert counter.peak() - base == sum(sizes)
    counter.reset_peak()
    assert counter.peak() == counter.allocated()
    held.append(torch.empty(5000, dtype=torch.uint8))
    assert counter.peak() - base == 1000 + 333 + 7 + 800 + 5000
    held.clear()
    assert counter.allocated() == base


def test_a_host_scope_books_its_storages_to_the_host_for_their_whole_life() -> None:
    base, host_base = counter.allocated(), counter.host_allocated()
    counter.reset_host_peak()
    with counter.host_scope():
        on_host = torch.empty(4096, dtype=torch.uint8)
        with counter.host_scope():  # nested: still the host's
            nested = torch.empty(1024, dtype=torch.uint8)
        after_nested = torch.empty(512, dtype=torch.uint8)
    on_device = torch.empty(300, dtype=torch.uint8)
    assert counter.allocated() - base == 300
    assert counter.host_allocated() - host_base == 4096 + 1024 + 512
    # Another thread allocating meanwhile is not in this thread's scope; a free from anywhere
    # leaves the side it was booked to.
    elsewhere: list[torch.Tensor] = []
    with counter.host_scope():
        on_thread(lambda: elsewhere.append(torch.empty(200, dtype=torch.uint8)))
    assert counter.allocated() - base == 300 + 200
    holder = [on_host]
    del on_host
    on_thread(holder.clear)  # the last reference dropped on another thread
    assert counter.host_allocated() - host_base == 1024 + 512
    del nested, after_nested
    assert counter.host_allocated() == host_base
    assert counter.host_peak() - host_base == 4096 + 1024 + 512
    assert counter.allocated() - base == 300 + 200
    del on_device
    elsewhere.clear()


def test_the_counter_sees_an_allocation_made_on_another_thread() -> None:
    kept: list[torch.Tensor] = []
    base = counter.allocated()
    on_thread(lambda: kept.append(torch.empty(12345, dtype=torch.uint8)))
    assert counter.allocated() - base == 12345
    kept.clear()  # freed on this thread: allocation and free need not share a thread
    assert counter.allocated() == base


class _AllocatesInBackward(torch.autograd.Function):
    """Identity whose backward allocates a known number of bytes, kept, and notes its thread."""

    kept: list[torch.Tensor] = []
    threads: list[int] = []

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        _AllocatesInBackward.threads.append(threading.get_ident())
        _AllocatesInBackward.kept.append(torch.empty(77777, dtype=torch.uint8))
        return grad


def test_the_counter_sees_an_allocation_inside_a_backward_on_another_thread() -> None:
    x = torch.ones(4, requires_grad=True)
    _AllocatesInBackward.kept.clear()
    _AllocatesInBackward.threads.clear()
    loss = _AllocatesInBackward.apply(x).sum()
    x.grad = torch.zeros(4)  # accumulated in place, so the backward's only lasting storage is the kept one
    base = counter.allocated()
    on_thread(loss.backward)
    assert _AllocatesInBackward.threads and _AllocatesInBackward.threads[0] != threading.get_ident()
    assert counter.allocated() - base == 77777
    _AllocatesInBackward.kept.clear()
    assert counter.allocated() == base


def test_a_copy_on_write_clone_counts_once_until_it_is_written() -> None:
    source = torch.zeros(1024)
    base = counter.allocated()
    clone = torch._lazy_clone(source)
    assert counter.allocated() == base  # one storage, shared
    clone.add_(1)  # the write makes the clone its own copy
    assert counter.allocated() - base == 4096
    del clone
    assert counter.allocated() == base
    assert source.sum().item() == 0


def test_install_is_idempotent() -> None:
    base = counter.allocated()
    counter.install()
    counter.install()
    assert counter.installed()
    kept = torch.empty(64, dtype=torch.uint8)
    assert counter.allocated() - base == 64
    del kept


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_storage_allocated_before_install_and_freed_after_never_makes_the_count_negative() -> None:
    # A fresh process: in this one the counter is installed already.
    proc = _python(
        """
        import torch
        from fastpipe.memory import _cpu_counter as counter
        early = torch.empty(1 << 20, dtype=torch.uint8)
        early_resized = torch.empty(16, dtype=torch.uint8)
        counter.install()
        early_resized.resize_(4096)  # through the allocator its storage was made with: not counted
        late = torch.empty(1000, dtype=torch.uint8)
        del early, early_resized
        assert counter.allocated() == 1000, counter.allocated()
        del late
        assert counter.allocated() == 0 and counter.live_storages() == 0, counter.allocated()
        print("ok")
        """,
        TORCH_EXTENSIONS_DIR=str(counter.build_directory().parent),
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


def test_install_without_a_compiler_says_what_to_install(tmp_path: Path) -> None:
    # An empty extension folder forces a build; CXX points at nothing.
    proc = _python(
        """
        from fastpipe.memory import _cpu_counter as counter
        try:
            counter.install()
        except counter.CounterUnavailableError as error:
            print(error)
        else:
            print("installed")
        """,
        TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"),
        CXX=str(tmp_path / "no-such-compiler"),
    )
    assert proc.returncode == 0, proc.stderr
    message = proc.stdout.strip()
    assert "no-such-compiler" in message, message
    assert "build-essential" in message and "gcc-c++" in message and message.endswith("and retry"), message
    assert not (tmp_path / "extensions").exists() or not list((tmp_path / "extensions").rglob("*.so"))


def test_a_built_counter_loads_in_a_later_process_without_a_compiler(tmp_path: Path) -> None:
    proc = _python(
        """
        import torch
        from fastpipe.memory import _cpu_counter as counter
        counter.install()
        kept = torch.empty(321, dtype=torch.uint8)
        print(counter.allocated())
        """,
        TORCH_EXTENSIONS_DIR=str(counter.build_directory().parent),
        CXX=str(tmp_path / "no-such-compiler"),
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "321", proc.stdout + proc.stderr
