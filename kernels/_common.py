"""Shared helpers: optional Triton import, the dispatch rule, dropout seeds and masks.

Dispatch rule (the same for every op in this package)::

    Triton kernels  if the tensor is CUDA, or TRITON_INTERPRET == "1"
    PyTorch path    otherwise (CPU tensors), with the same saving strategy

Nothing here imports the rest of fastpipe, and everything works without triton installed.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings

import torch

try:  # triton is optional: the PyTorch reference path needs none of it.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    HAS_TRITON = False

__all__ = [
    "HAS_TRITON",
    "serialize_first_launches",
    "triton",
    "tl",
    "interpreting",
    "use_triton",
    "next_pow2",
    "cdiv",
    "draw_seed",
    "as_seed_tensor",
    "reference_keep_mask",
    "dropout_scale",
    "autocast_state",
    "autocast_like",
    "device_guard",
]


def interpreting() -> bool:
    """True when Triton's CPU interpreter is switched on (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _serialize_interpreter() -> None:
    """Let only one thread at a time run an interpreted kernel.

    While it runs a kernel, Triton's interpreter patches ``triton.language`` globally and
    restores it afterwards, so two threads interpreting at once (pipeline stages in their
    worker threads) break each other's kernels. Compiled kernels on a GPU are unaffected.
    """
    from triton.runtime import interpreter

    cls = interpreter.InterpretedFunction
    if getattr(cls.run, "_fastpipe_serialized", False):
        return
    lock = threading.RLock()
    original = cls.run

    def run(self: object, *args: object, **kwargs: object) -> object:
        with lock:
            return original(self, *args, **kwargs)

    run._fastpipe_serialized = True  # type: ignore[attr-defined]
    cls.run = run


def _launch_key(args: tuple, kwargs: dict) -> tuple:
    """What Triton specialises a compiled kernel on, or something finer.

    Positional tensors by dtype and 16-byte alignment, positional ints by being 1, by
    divisibility by 16 and by needing 64 bits; keywords (the constexprs and launch options
    of fastpipe's kernels) and everything else by value.
    """

    def part(v: object) -> object:
        if isinstance(v, torch.Tensor):
            return (v.dtype, v.data_ptr() % 16 == 0)
        if isinstance(v, bool) or not isinstance(v, int):
            return v if isinstance(v, (str, float, type(None), bool)) else type(v)
        return (v == 1, v % 16 == 0, abs(v) >= 2**31)

    named = tuple((k, v if isinstance(v, (int, float, str, bool, type(None))) else part(v)) for k, v in kwargs.items())
    return tuple(map(part, args)) + tuple(sorted(named, key=lambda kv: kv[0]))


def serialize_first_launches(cls: type) -> None:
    """Compile each of ``cls``'s kernels for a new specialisation in one thread at a time.

    Triton's first launch of a specialisation compiles it and fills caches that have not
    always been thread-safe (triton-lang/triton#7974, #5933); pipeline stages launch from
    their own threads. A launch whose :func:`_launch_key` was seen before takes no lock.
    """
    if getattr(cls.run, "_fastpipe_first_launch_lock", False):  # type: ignore[attr-defined]
        return
    lock = threading.Lock()
    original = cls.run  # type: ignore[attr-defined]

    def run(self: object, *args: object, **kwargs: object) -> object:
        seen: set[tuple] = self.__dict__.setdefault("_fastpipe_launched", set())
        key = _launch_key(args, kwargs)
        if key in seen:
            return original(self, *args, **kwargs)
        with lock:
            out = original(self, *args, **kwargs)
            seen.add(key)
            return out

    run._fastpipe_first_launch_lock = True  # type: ignore[attr-defined]
    cls.run = run  # type: ignore[attr-defined]


if HAS_TRITON and interpreting():
    _serialize_interpreter()
elif HAS_TRITON:
    from triton.runtime.jit import JITFunction

    serialize_first_launches(JITFunction)


_LARGE_WARNED = False


def use_triton(t: torch.Tensor) -> bool:
    """Whether the Triton kernels should handle ``t`` (CUDA tensor, or interpreter mode).

    A tensor of 2**31 elements or more takes the PyTorch path (the kernels index with int32),
    with a one-time warning: slower and heavier on memory, but right.
    """
    global _LARGE_WARNED
    if not (HAS_TRITON and (t.is_cuda or interpreting())):
        return False
    if t.numel() >= 2**31:
        if not _LARGE_WARNED:
            _LARGE_WARNED = True
            warnings.warn(
                f"fastpipe.kernels: a tensor of {t.numel()} elements exceeds the kernels' int32 indexing; "
                "it runs on the PyTorch path (this is said once per process)",
                stacklevel=3,
            )
        return False
    return True


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (and >= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for positive integers (``triton.cdiv`` without triton)."""
    return -(-a // b)


def draw_seed(device: torch.device) -> torch.Tensor:
    """Draw a dropout seed from torch's default generator of ``device``.

    The seed stays a one-element int64 tensor on ``device`` (no host sync on CUDA). A pipeline
    that restores torch's RNG state before a recompute draws the same seed, hence the same mask.
    """
    return torch.randint(0, 2**31 - 1, (1,), device=device, dtype=torch.int64)


def as_seed_tensor(seed: int | torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Turn an explicit seed (int or tensor) into a one-element int64 tensor; draw one if None."""
    if seed is None:
        return draw_seed(device)
    if isinstance(seed, torch.Tensor):
        return seed.reshape(1).to(device=device, dtype=torch.int64)
    return torch.tensor([int(seed)], device=device, dtype=torch.int64)


def reference_keep_mask(seed: torch.Tensor, numel: int, p: float, device: torch.device) -> torch.Tensor:
    """Keep-mask of the PyTorch path: a ``torch.Generator`` seeded with ``seed``; flat, bool.

    Element ``i`` of a tensor is kept when ``u_i >= p``; ``u`` depends only on the seed and the
    element's flat index, so a recompute with the same seed drops the same elements.
    """
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed.item()))
    return torch.rand(numel, generator=gen, device=device) >= p


def dropout_scale(p: float) -> float:
    """Scale applied to kept elements (0 when everything is dropped)."""
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


def autocast_state(t: torch.Tensor) -> tuple[str, bool, torch.dtype]:
    """Autocast state for ``t``'s device type, to be replayed in backward (any device type,
    unlike ``torch.amp.custom_fwd`` which is bound to one)."""
    dev = t.device.type
    return dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)


def autocast_like(state: tuple[str, bool, torch.dtype]) -> torch.autocast:
    """Context manager re-entering a state recorded by :func:`autocast_state`."""
    dev, enabled, dtype = state
    return torch.autocast(dev, dtype=dtype, enabled=enabled)


def device_guard(t: torch.Tensor) -> contextlib.AbstractContextManager[object]:
    """Make ``t``'s GPU current for a Triton launch (Triton launches on the current device's
    stream, so a tensor on another GPU would otherwise error or race); no-op off CUDA."""
    if t.is_cuda:
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()
