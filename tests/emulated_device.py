"""An emulated accelerator for the tests: a PrivateUse1 device ``emu`` whose tensors compute on the CPU.

autograd gives every non-CPU device type that has a device guard its own engine threads, and
a PrivateUse1 backend registered from Python has one. So on this device a backward runs the
way it does on CUDA: a node whose incoming gradients live on ``emu:0`` runs on the engine's
device thread, and a ``torch.autograd.grad`` of ``emu`` tensors started by any other thread
is queued to that thread. That is the routing fastpipe's GPU backward must survive, and CI
can run it on a CPU.

How it works:

* :class:`EmuTensor` is a wrapper subclass on ``emu:0`` holding a CPU tensor; its
  ``__torch_dispatch__`` runs every op on the CPU tensors and wraps the results back.
* A PrivateUse1 fallback turns what torch creates on the device itself (factories,
  ``.to("emu:0")``) into such wrappers.
* Ops that mix ``emu`` tensors with CPU tensors of one element or more raise, as on CUDA
  (copies excepted), so a missing device move fails here as it would on a GPU.

* ``torch.autocast("emu")`` runs the matrix products in the low dtype, the rest as the
  inputs come; ``torch.utils.checkpoint`` finds the device module it asks for.

Random ops on ``emu`` tensors run on the CPU tensors and so draw from the CPU's default
generator: ``torch.manual_seed`` seeds them, and fastpipe's task streams route them like
CPU draws (an accelerator without ``default_generators`` of its own, in ``fastpipe.rng.streams``).

:func:`memory_stats` counts the bytes of the device's storages (the CPU storages its tensors
wrap, each once, from the first tensor on it to the last one's end), as a device allocator
would: a test can hold a device's peak against a prediction.

What it cannot show: streams and events (the Python device guard has only the default
stream and one device, so ``emu:1`` does not exist), kernels and their asynchrony, pinned
memory, ``fastpipe._C``'s copies (the device takes the generic path of the capability
table in ``fastpipe.runtime.device``), NCCL.

Registration is process-wide, cannot be undone, and must precede the process's first
backward; tests/_emulated_session.py says where that happens. Tests leave no emu tensors
behind (the ``emu`` fixture checks).
"""

from __future__ import annotations

import contextlib
import gc
import sys
import threading
import traceback
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_map

__all__ = [
    "NAME",
    "EmuTensor",
    "RegisteredTooLate",
    "backward",
    "device",
    "live_tensors",
    "memory_stats",
    "register",
    "reset_peak",
    "stuck",
    "thread_state",
    "unavailable",
]

#: The device type's name.
NAME = "emu"

_lock = threading.Lock()
_state: dict[str, Any] = {}
_live: weakref.WeakSet[torch.Tensor] = weakref.WeakSet()
_storages: dict[int, list[int]] = {}  # data_ptr of a wrapped CPU storage -> [nbytes, emu tensors on it]
_bytes = {"live": 0, "peak": 0}
_bytes_lock = threading.Lock()

# What torch.autocast("emu") runs in its lower-precision dtype.
_AUTOCAST_LOWER = ("linear", "mm", "addmm", "matmul", "bmm", "baddbmm")

# Ops that take tensors on two devices by design.
_COPIES = frozenset(
    {
        "aten::copy_",
        "aten::_to_copy",
        "aten::_copy_from",
        "aten::_copy_from_and_resize",
        "aten::_has_compatible_shallow_copy_type",
        "aten::set_",
    }
)


class EmuTensor(torch.Tensor):
    """A tensor on ``emu:<index>`` whose data is the CPU tensor ``elem``."""

    elem: torch.Tensor

    __slots__ = ("elem",)

    @staticmethod
    def __new__(cls, elem: torch.Tensor, index: int = 0) -> EmuTensor:
        assert type(elem) is torch.Tensor and elem.device.type == "cpu", type(elem)
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            elem.size(),
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            layout=elem.layout,
            device=torch.device(NAME, index),
            requires_grad=False,
        )
        out.elem = elem
        _live.add(out)
        _count(out)
        return out

    def __repr__(self) -> str:  # type: ignore[override]
        return f"EmuTensor({self.elem!r}, device='{self.device}')"

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return _run(func, args, kwargs or {})


def _count(tensor: EmuTensor) -> None:
    storage = tensor.elem.untyped_storage()
    ptr, nbytes = storage.data_ptr(), storage.nbytes()
    if not ptr or not nbytes:
        return
    with _bytes_lock:
        entry = _storages.get(ptr)
        if entry is None:
            entry = _storages[ptr] = [nbytes, 0]
            _bytes["live"] += nbytes
            _bytes["peak"] = max(_bytes["peak"], _bytes["live"])
        entry[1] += 1
    weakref.finalize(tensor, _uncount, ptr)


def _uncount(ptr: int) -> None:
    with _bytes_lock:
        entry = _storages[ptr]
        entry[1] -= 1
        if not entry[1]:
            del _storages[ptr]
            _bytes["live"] -= entry[0]


def memory_stats() -> tuple[int, int]:
    """``(live, peak)``: bytes of the device's storages alive now, and the most at once since :func:`reset_peak`."""
    with _bytes_lock:
        return _bytes["live"], _bytes["peak"]


def reset_peak() -> None:
    """Start the peak of :func:`memory_stats` again from the bytes alive now."""
    with _bytes_lock:
        _bytes["peak"] = _bytes["live"]


def _unwrap(x: Any) -> Any:
    if isinstance(x, EmuTensor):
        return x.elem
    if isinstance(x, torch.device) and x.type == NAME:
        return torch.device("cpu")
    return x


def _run(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    name = func._schema.name
    wrappers: dict[int, EmuTensor] = {}
    host: list[torch.Tensor] = []

    def look(x: Any) -> Any:
        if isinstance(x, EmuTensor):
            wrappers[id(x.elem)] = x
        elif isinstance(x, torch.Tensor) and x.dim() > 0:
            host.append(x)
        return x

    tree_map(look, (args, kwargs))
    indices = sorted({w.device.index or 0 for w in wrappers.values()})
    if indices and host and name not in _COPIES:
        raise RuntimeError(
            f"Expected all tensors to be on the same device, but found at least two devices, "
            f"{NAME}:{indices[0]} and {host[0].device}! (emulated device, in {name})"
        )
    target = kwargs.get("device")
    if target is not None and torch.device(target).type != NAME:
        return func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))  # lands elsewhere, e.g. .cpu()
    index = (torch.device(target).index or 0) if target is not None else (indices[0] if indices else 0)
    out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))

    def wrap(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or isinstance(t, EmuTensor):
            return t
        # An op that returns one of its inputs (in place, out=) returns that input's wrapper.
        same = wrappers.get(id(t))
        return same if same is not None else EmuTensor(t, index)

    return tree_map(wrap, out)


def _fallback(op: Any, *args: Any, **kwargs: Any) -> Any:
    """What torch runs on the device itself: factories, and the copy into a new emu tensor."""
    name = op._schema.name
    if name in ("aten::_copy_from", "aten::_copy_from_and_resize"):
        src, dst = args[0], args[1]
        data = src.elem if isinstance(src, EmuTensor) else src
        if isinstance(dst, EmuTensor):
            if name == "aten::_copy_from_and_resize":
                dst.elem.resize_(data.shape)
            dst.elem.copy_(data)
        else:
            dst.copy_(data)
        return dst
    return _run(op, args, kwargs)


class _Backend:
    """``torch.emu``: the device module torch looks up by the backend's name."""

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1  # the Python device guard reports one device to autograd's engine

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        """Nothing to seed: emu ops draw from the CPU generator, which torch.manual_seed seeds."""

    @staticmethod
    def get_amp_supported_dtype() -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]

    @staticmethod
    @contextlib.contextmanager
    def device(index: Any) -> Iterator[None]:
        """The one device is always current (``torch.utils.checkpoint`` enters this)."""
        yield

    # emu ops draw from the CPU generator, so the device's RNG state is the CPU's; looked up
    # at call time, so that fastpipe's task-aware torch.get_rng_state is the one called.
    @staticmethod
    def get_rng_state(device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(state)


class RegisteredTooLate(RuntimeError):
    """autograd's engine started its device threads before the device was registered."""


def unavailable() -> str | None:
    """Why the device cannot be emulated here, or None when it can (registers it).

    Raises:
        RegisteredTooLate: a backward ran in this process before the registration; the
            emulation would silently run without its engine thread, so this is an error,
            not a reason to skip.
    """
    if torch.cuda.is_available():
        # The real device threads are here (tests/pipe/test_gpu.py), and a PrivateUse1
        # backend would become torch.accelerator's device for every later CUDA test.
        return "a CUDA device is present; the emulation is for hosts without one"
    try:
        register()
    except RegisteredTooLate:
        raise
    except Exception as exc:  # noqa: BLE001 - any other failure means: skip, saying why
        return f"this torch cannot register a Python PrivateUse1 device: {type(exc).__name__}: {exc}"
    return None


def register() -> None:
    """Register the ``emu`` device in this process; idempotent, thread-safe.

    Call it before the process runs its first backward: autograd's engine sizes its pool of
    device threads once, at the first backward, from the devices registered then.

    Raises:
        RegisteredTooLate: a backward ran before (the device has no engine thread).
        RuntimeError: another PrivateUse1 backend is registered, or the torch build lacks
            the pieces (``torch._C._acc``, ``_setup_privateuseone_for_python_backend``).
    """
    with _lock:
        if "error" in _state:
            raise _state["error"]
        if "lib" in _state:
            return
        try:
            _state["lib"] = _register()
        except Exception as exc:
            _state["error"] = exc
            raise


def _register() -> Any:
    from torch.utils import backend_registration

    current = torch._C._get_privateuse1_backend_name()
    if current not in ("privateuseone", NAME):
        raise RuntimeError(f"the PrivateUse1 backend is already registered as {current!r}")
    backend_registration._setup_privateuseone_for_python_backend(NAME, backend_module=_Backend())
    lib = torch.library.Library("_", "IMPL")  # kept: the fallback lives as long as the library object
    lib.fallback(_fallback, dispatch_key="PrivateUse1", with_keyset=False)
    # torch.autocast("emu"): the matrix products run in the autocast dtype, everything else
    # as its inputs come (CPU autocast's lower-precision list, cut to what the tests use).
    lib.fallback(torch.library.fallthrough_kernel, dispatch_key="AutocastPrivateUse1")
    aten = torch.library.Library("aten", "IMPL")
    for name in _AUTOCAST_LOWER:
        aten.impl(name, _autocast_kernel(getattr(torch.ops.aten, name).default), "AutocastPrivateUse1")
    if torch.distributed.is_available():
        # A registered accelerator becomes init_process_group()'s default device type, and
        # torch wants a collective backend for it; its tensors are CPU tensors underneath.
        torch.distributed.Backend.default_device_backend_map.setdefault(NAME, "gloo")
    check = torch.ones(2, device=device(), requires_grad=True)
    if not isinstance(check, EmuTensor) or (check * 2).detach().cpu().tolist() != [2.0, 2.0]:
        raise RuntimeError(f"the emulated device computes wrongly: {check!r}")
    try:
        (check * 2).sum().backward()
    except RuntimeError as exc:
        if "device_ready_queues_" not in str(exc):
            raise
        raise RegisteredTooLate(
            "autograd's engine sized its device threads at this process's first backward, before "
            "the emulated device was registered; register it first (tests/conftest.py does so at "
            "collection, before any test runs)"
        ) from None
    return lib, aten


def _autocast_kernel(op: Any) -> Any:
    def kernel(*args: Any, **kwargs: Any) -> Any:
        dtype = torch.get_autocast_dtype(NAME)

        def cast(t: Any) -> Any:
            if isinstance(t, EmuTensor) and t.is_floating_point() and t.dtype != dtype:
                return t.to(dtype)
            return t

        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)):
            return op(*tree_map(cast, args), **tree_map(cast, kwargs))

    return kernel


def device(index: int = 0) -> torch.device:
    """``emu:<index>``; the index is explicit, as a bare ``emu`` trips an assert in autograd's engine."""
    return torch.device(NAME, index)


def live_tensors() -> list[torch.Tensor]:
    """The emu tensors still alive after a garbage collection.

    autograd's device thread holds on to the last graph task it ran until the next one
    arrives, and a failed one holds its exception, whose traceback holds the test's frames;
    a tiny backward on the device first lets that go.
    """
    if stuck() is None:
        w = torch.ones((), device=device(), requires_grad=True)
        (w * 2).backward()
        del w
    if len(_live):
        gc.collect()  # only then: a collection takes a third of a second in a test session
    return list(_live)


def thread_state() -> tuple[Any, ...]:
    """The thread-local torch state a test must leave as it found it."""
    return (
        torch.is_grad_enabled(),
        torch.get_default_device(),
        torch.get_default_dtype(),
        torch.is_autocast_enabled("cpu"),
        torch.is_autocast_enabled(NAME),
        len(torch.overrides._get_current_function_mode_stack()),
    )


def stuck() -> str | None:
    """Why the device's engine thread is stuck (a deadlocked backward), or None."""
    return _state.get("stuck")


class Deadlock(AssertionError):
    """A backward did not finish in time; carries the stacks of all threads."""


def backward(tensor: torch.Tensor, grad: torch.Tensor | None = None, *, timeout: float = 30.0) -> None:
    """``tensor.backward(grad)`` from a helper thread, failing after ``timeout`` s with all stacks.

    A deadlocked backward blocks its caller inside autograd's C++ engine, where no signal
    reaches it; the test's own thread waits here in Python instead, so it fails with the
    stacks. The stuck threads stay stuck, and every later backward on the device would
    wait behind them, so :func:`stuck` then says why, and the ``emu`` fixture fails the
    later tests at once.
    """
    errors: list[BaseException] = []

    def run() -> None:
        try:
            tensor.backward(grad)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(exc)

    thread = threading.Thread(target=run, name="test-backward", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        _state["stuck"] = f"a backward that did not finish in {timeout:.0f} s"
        names = {t.ident: t.name for t in threading.enumerate()}
        stacks = "\n".join(
            f"--- thread {names.get(ident, '?')}\n" + "".join(traceback.format_stack(frame))
            for ident, frame in sys._current_frames().items()
        )
        raise Deadlock(f"backward did not finish in {timeout:.0f} s; stacks of all threads:\n{stacks}")
    if errors:
        raise errors[0]
