"""An exact, process-wide counter of CPU tensor bytes: current and peak, from every thread.

fastpipe runs stages on worker threads and autograd runs backward on engine threads, so the
thread-local hooks (``torch.profiler`` memory events, ``TorchDispatchMode``, saved-tensor hooks)
miss allocations. This counter sits below all of them, in c10's CPU allocator: :func:`install`
wraps the current ``c10::GetCPUAllocator()`` in a counting ``c10::Allocator`` and installs it with
``c10::SetCPUAllocator``. Every CPU storage allocated afterwards, on any thread, adds its
``nbytes`` when it is allocated and removes them when it is freed.

Why a JIT-built extension: ``fastpipe._C`` is built without torch (see DESIGN.md), and an
allocator can only be installed from C++. So this small source (c10 headers and pybind11, no
``<torch/extension.h>``) is compiled on first use with ``torch.utils.cpp_extension.load``,
against the torch that is running, and cached in torch's extension folder
(``$TORCH_EXTENSIONS_DIR``, else ``~/.cache/torch_extensions``) under a name that hashes the
source, torch's version and the Python ABI. The first build takes about 6 s on a 2-core host;
later processes load the cached library directly, without the compiler.

What is counted: the ``nbytes`` asked of the allocator by every storage allocated after
:func:`install` (tensors, gradients, optimizer state, autograd buffers, temporaries inside
kernels that go through c10). Not counted: storages allocated before :func:`install` (a
storage allocated before and freed after leaves the count unchanged, so it never goes
negative), memory that is not c10's (``torch.from_numpy``, BLAS workspaces, shared memory,
``mmap``-ed checkpoints), and the allocator's own alignment padding.

Host bytes: on a CPU the device's memory and the host's are one, but a CPU rank that stands for
an accelerator needs them apart (an optimizer kept in host memory, :mod:`fastpipe.memory.host_optimizer`).
Storages allocated by a thread inside :func:`host_scope` are booked to the host
(:func:`host_allocated`, :func:`host_peak`) and never to :func:`allocated`, for their whole life,
whichever thread frees them. Allocations made for the scope's work by other threads (an intra-op
pool) are the device's: run with one intra-op thread where the split matters.

The wrapper stays for the life of the process (storages it handed out keep its deleter); it
costs a table insert and erase per CPU allocation.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shutil
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

__all__ = [
    "CounterUnavailableError",
    "PRIORITY",
    "allocated",
    "build_directory",
    "host_allocated",
    "host_peak",
    "host_scope",
    "install",
    "installed",
    "live_storages",
    "peak",
    "reset_host_peak",
    "reset_peak",
]

#: Priority given to ``c10::SetCPUAllocator``: above the default allocator's 0, so it takes the slot.
PRIORITY = 100

_ADVICE = (
    "install a C++17 compiler (Debian/Ubuntu: apt-get install build-essential; Fedora/RHEL: "
    "dnf install gcc-c++) or point CXX at one, and retry"
)


class CounterUnavailableError(RuntimeError):
    """The CPU counter cannot be built or installed on this host; the message says what to change."""


_SOURCE = r"""
// A counting wrapper around c10's CPU allocator: exact current and peak bytes of every CPU
// storage allocated through c10::GetCPUAllocator(), from every thread.
//
// Built on first use by fastpipe/memory/_cpu_counter.py (torch.utils.cpp_extension.load,
// no <torch/extension.h>): c10 headers and pybind11 only, so it compiles in seconds.
//
// Every allocation is recorded in a sharded table keyed by its data pointer, and the DataPtr
// handed out is "simple" (context == data) with counted_delete as its deleter. That keeps the
// raw_allocate/raw_deallocate interface and copy-on-write (lazy clone) storages working, as they
// do with the default allocator. The wrapped allocator's own context and deleter are kept in the
// table entry and run on free.
//
//   allocate(n) ──▶ wrapped->allocate(n) ──▶ table[data] = {ctx, deleter, n};  current += n
//   counted_delete(data) ──▶ entry = take(table[data]) ──▶ current -= n; entry.deleter(entry.ctx)
//
// A pointer with no entry was allocated before the wrapper was installed (raw_deallocate of a
// raw_allocate made earlier): it goes to the wrapped allocator's raw deleter and is not counted,
// so the count never goes below what the wrapper itself handed out.

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <pybind11/pybind11.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_map>

namespace {

struct Held {
  void* ctx;
  c10::DeleterFnPtr deleter;
  int64_t nbytes;
  bool host;  // allocated inside a host scope: booked to the host, not the device
};

struct Shard {
  std::mutex mu;
  std::unordered_map<void*, Held> live;
};

constexpr std::size_t kShards = 64;

// Never destroyed: storages freed during interpreter shutdown, after static destructors ran,
// still find their table.
Shard* const g_shards = new Shard[kShards];
std::atomic<int64_t> g_current{0};
std::atomic<int64_t> g_peak{0};
std::atomic<int64_t> g_live{0};
std::atomic<int64_t> g_host_current{0};
std::atomic<int64_t> g_host_peak{0};
c10::Allocator* g_wrapped = nullptr;
thread_local bool t_host = false;

Shard& shard_of(const void* ptr) {
  // Allocations are at least 16-byte aligned: drop the low bits before picking a shard.
  auto bits = reinterpret_cast<std::uintptr_t>(ptr) >> 6;
  bits ^= bits >> 13;
  return g_shards[bits % kShards];
}

void note_allocation(int64_t nbytes, bool host) {
  std::atomic<int64_t>& current = host ? g_host_current : g_current;
  std::atomic<int64_t>& peak = host ? g_host_peak : g_peak;
  const int64_t now = current.fetch_add(nbytes, std::memory_order_relaxed) + nbytes;
  int64_t seen = peak.load(std::memory_order_relaxed);
  while (now > seen && !peak.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
  }
}

void counted_delete(void* data) {
  Held held{nullptr, nullptr, 0, false};
  bool found = false;
  {
    Shard& shard = shard_of(data);
    std::lock_guard<std::mutex> lock(shard.mu);
    auto it = shard.live.find(data);
    if (it != shard.live.end()) {
      held = it->second;
      shard.live.erase(it);
      found = true;
    }
  }
  if (!found) {
    c10::DeleterFnPtr raw = g_wrapped->raw_deleter();
    if (raw != nullptr) {
      raw(data);
    }
    return;
  }
  (held.host ? g_host_current : g_current).fetch_sub(held.nbytes, std::memory_order_relaxed);
  g_live.fetch_sub(1, std::memory_order_relaxed);
  if (held.ctx != nullptr) {
    held.deleter(held.ctx);
  }
}

struct CountingAllocator final : c10::Allocator {
  c10::DataPtr allocate(std::size_t nbytes) override {
    c10::DataPtr inner = g_wrapped->allocate(nbytes);
    void* data = inner.get();
    if (data == nullptr) {
      return inner;  // zero bytes: nothing to count and nothing to free
    }
    const c10::Device device = inner.device();
    const c10::DeleterFnPtr deleter = inner.get_deleter();
    void* ctx = inner.release_context();
    {
      Shard& shard = shard_of(data);
      std::lock_guard<std::mutex> lock(shard.mu);
      shard.live.emplace(data, Held{ctx, deleter, static_cast<int64_t>(nbytes), t_host});
    }
    g_live.fetch_add(1, std::memory_order_relaxed);
    note_allocation(static_cast<int64_t>(nbytes), t_host);
    return c10::DataPtr(data, data, &counted_delete, device);
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &counted_delete;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    g_wrapped->copy_data(dest, src, count);
  }
};

CountingAllocator* g_counting = nullptr;
std::mutex g_install_mu;

// Returns false when another allocator of higher priority keeps the CPU slot.
bool install(int priority) {
  std::lock_guard<std::mutex> lock(g_install_mu);
  if (g_counting != nullptr) {
    return c10::GetCPUAllocator() == g_counting;
  }
  g_wrapped = c10::GetCPUAllocator();
  g_counting = new CountingAllocator();  // static lifetime, as SetCPUAllocator expects
  c10::SetCPUAllocator(g_counting, static_cast<uint8_t>(priority));
  return c10::GetCPUAllocator() == g_counting;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("install", &install, pybind11::arg("priority"));
  m.def("installed", [] { return g_counting != nullptr && c10::GetCPUAllocator() == g_counting; });
  m.def("allocated", [] { return g_current.load(std::memory_order_relaxed); });
  m.def("peak", [] { return g_peak.load(std::memory_order_relaxed); });
  m.def("live_storages", [] { return g_live.load(std::memory_order_relaxed); });
  m.def("reset_peak", [] { g_peak.store(g_current.load(std::memory_order_relaxed), std::memory_order_relaxed); });
  m.def("host_allocated", [] { return g_host_current.load(std::memory_order_relaxed); });
  m.def("host_peak", [] { return g_host_peak.load(std::memory_order_relaxed); });
  m.def("reset_host_peak", [] {
    g_host_peak.store(g_host_current.load(std::memory_order_relaxed), std::memory_order_relaxed);
  });
  // Returns the calling thread's previous setting, so scopes nest.
  m.def("set_host", [](bool host) {
    const bool before = t_host;
    t_host = host;
    return before;
  });
}
"""

_lock = threading.Lock()
_module: ModuleType | None = None


def _name() -> str:
    key = "\0".join([_SOURCE, torch.__version__, sys.implementation.cache_tag])
    return "fastpipe_cpu_counter_" + hashlib.sha256(key.encode()).hexdigest()[:16]


def build_directory() -> Path:
    """Where the counter's library is built and cached (``$TORCH_EXTENSIONS_DIR`` or torch's default)."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return Path(root) / _name()


def _import_built(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(_name(), path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(folder: Path) -> ModuleType:
    from torch.utils.cpp_extension import is_ninja_available, load

    compiler = os.environ.get("CXX", "c++").split()[0]
    if shutil.which(compiler) is None:
        raise CounterUnavailableError(
            f"fastpipe's CPU memory counter is compiled on first use and found no C++ compiler at CXX={compiler!r}: "
            + _ADVICE
        )
    if not is_ninja_available():
        raise CounterUnavailableError(
            "fastpipe's CPU memory counter is compiled on first use with ninja, which is not installed: "
            "pip install ninja, and retry"
        )
    folder.mkdir(parents=True, exist_ok=True)
    # load() on a file of our own: load_inline() prepends <torch/extension.h>, and this source
    # took 29 s to compile with it on a 2-core host, against 6 s without.
    source = folder / "counter.cpp"
    if not source.is_file() or source.read_text() != _SOURCE:
        partial = source.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(_SOURCE)
        partial.replace(source)
    try:
        module = load(_name(), sources=[str(source)], extra_cflags=["-O2", "-std=c++17"], build_directory=str(folder))
    except (RuntimeError, OSError) as error:
        raise CounterUnavailableError(
            f"fastpipe's CPU memory counter did not compile with CXX={compiler!r} in {folder}: {error}. "
            f"If the compiler is older than C++17, {_ADVICE}"
        ) from error
    assert isinstance(module, ModuleType)
    return module


def _loaded() -> ModuleType:
    global _module
    with _lock:
        if _module is None:
            folder = build_directory()
            library = folder / f"{_name()}.so"
            # A lock file means another process is building it: load() waits for that build.
            ready = library.is_file() and not (folder / "lock").exists()
            _module = _import_built(library) if ready else _build(folder)
        return _module


def install() -> None:
    """Start counting: wrap c10's CPU allocator (idempotent; builds the extension on first use).

    Install it before the allocations to be measured start, ideally before worker threads
    exist: c10 swaps the allocator without a lock.

    Raises:
        CounterUnavailableError: no C++ compiler or ninja to build it (the message says what
            to install), or another CPU allocator of higher priority holds c10's slot.
    """
    if not _loaded().install(PRIORITY):
        raise CounterUnavailableError(
            f"another CPU allocator set with a priority above {PRIORITY} holds c10's CPU allocator slot, so "
            "fastpipe's counter cannot see allocations; measure CPU memory in a process without it"
        )


def installed() -> bool:
    """Whether the counter is installed and still c10's CPU allocator (never builds anything)."""
    return _module is not None and bool(_module.installed())


def _counter() -> ModuleType:
    if not installed():
        raise RuntimeError(
            "fastpipe's CPU memory counter is not installed: call fastpipe.memory._cpu_counter.install()"
        )
    assert _module is not None
    return _module


def allocated() -> int:
    """Bytes of CPU storages allocated since :func:`install` and still alive."""
    return int(_counter().allocated())


def peak() -> int:
    """The most bytes :func:`allocated` has reached since :func:`install` or the last :func:`reset_peak`."""
    return int(_counter().peak())


def reset_peak() -> None:
    """Start a new peak window at the current :func:`allocated` bytes."""
    _counter().reset_peak()


def live_storages() -> int:
    """How many CPU storages counted by :func:`allocated` are alive."""
    return int(_counter().live_storages())


def host_allocated() -> int:
    """Bytes of CPU storages allocated inside :func:`host_scope` and still alive (never in :func:`allocated`)."""
    return int(_counter().host_allocated())


def host_peak() -> int:
    """The most bytes :func:`host_allocated` has reached since :func:`install` or the last :func:`reset_host_peak`."""
    return int(_counter().host_peak())


def reset_host_peak() -> None:
    """Start a new host peak window at the current :func:`host_allocated` bytes."""
    _counter().reset_host_peak()


@contextlib.contextmanager
def host_scope() -> Iterator[None]:
    """Within the block, this thread's CPU allocations are booked to the host, not the device.

    Without the counter installed it does nothing, so code that keeps memory on the host can enter
    it unconditionally. Scopes nest.
    """
    if not installed():
        yield
        return
    assert _module is not None
    before = bool(_module.set_host(True))
    try:
        yield
    finally:
        _module.set_host(before)
