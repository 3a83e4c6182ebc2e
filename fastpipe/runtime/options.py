"""The runtime's switches: keyword arguments of ``Pipe`` and ``DistributedPipe``, fixed when a pipe is built.

No step or action reads the environment. Where a keyword is ``None``, its environment variable is
read once, when the pipe is built, and where that is unset (or empty) too, the built-in default
applies; a pipe built earlier keeps what it read::

    keyword        environment default           built-in default
    fused_wgrad    FASTPIPE_FUSED_WGRAD=0|1      True
    wgrad_batch    FASTPIPE_WGRAD_BATCH=n        2 on CPU stages, 1 on others
    wgrad_fuse_min FASTPIPE_WGRAD_FUSE_MIN=n     2**17 on CPU stages, 0 on others
    tune_malloc    FASTPIPE_TUNE_MALLOC=0|1      True
    p2p            FASTPIPE_P2P=tags|ordered     "ordered" on NCCL, "tags" on other backends

The variables suit a launcher or a benchmark that sets them for a whole run. What each switch
does is told in :mod:`fastpipe.runtime.wgrad` (``fused_wgrad``, ``wgrad_batch``, ``wgrad_fuse_min``),
:mod:`fastpipe.runtime.host_alloc` (``tune_malloc``) and :mod:`fastpipe.distributed.ranks` (``p2p``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal, cast

import torch

from fastpipe.runtime.wgrad import default_fuse_min, default_wgrad_batch

__all__ = ["P2P", "P2P_MODES", "RuntimeOptions", "fuse_min_on"]

P2P = Literal["tags", "ordered"]
P2P_MODES: tuple[P2P, ...] = ("tags", "ordered")

_ENV = {
    "fused_wgrad": "FASTPIPE_FUSED_WGRAD",
    "wgrad_batch": "FASTPIPE_WGRAD_BATCH",
    "wgrad_fuse_min": "FASTPIPE_WGRAD_FUSE_MIN",
    "tune_malloc": "FASTPIPE_TUNE_MALLOC",
    "p2p": "FASTPIPE_P2P",
}


@dataclass(frozen=True)
class RuntimeOptions:
    """How a pipe's runtime runs its steps.

    Attributes:
        fused_wgrad: plain ``nn.Linear`` layers sum their weight gradients inside the GEMM
            (``W.grad.addmm_(dyᵀ, x)``) and, under a split backward, defer that GEMM to W;
            False leaves every weight gradient to autograd.
        wgrad_batch: how many micro-batches' deferred Linear work one W runs as one GEMM
            (1: each W its own); None: :func:`~fastpipe.runtime.wgrad.default_wgrad_batch`
            of each stage's device.
        wgrad_fuse_min: with ``fused_wgrad``, the fewest weight elements for which a Linear's
            combined backward sums in the GEMM (0: every Linear); None:
            :func:`~fastpipe.runtime.wgrad.default_fuse_min` of each stage's device. Split
            backwards defer every Linear's GEMM whatever its size.
        tune_malloc: on CPU stages, tune glibc's allocator once per process so that freed
            activations stay in the process (:func:`~fastpipe.runtime.host_alloc.tune_host_allocator`).
        p2p: how a ``DistributedPipe`` matches payloads between ranks: ``"tags"`` (gloo only) or
            ``"ordered"`` (the order NCCL needs, also on gloo); None: ordered on NCCL, tags elsewhere.

    Raises:
        ValueError: a value outside those accepted, naming them.
    """

    fused_wgrad: bool = True
    wgrad_batch: int | None = None
    wgrad_fuse_min: int | None = None
    tune_malloc: bool = True
    p2p: P2P | None = None

    def __post_init__(self) -> None:
        for name in ("fused_wgrad", "tune_malloc"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"fastpipe: {name} must be True or False, got {getattr(self, name)!r}")
        batch = self.wgrad_batch
        if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
            raise ValueError(
                "fastpipe: wgrad_batch must be a whole number >= 1 (1: each W runs its own micro-batch's "
                f"GEMM) or None (the device's default), got {batch!r}"
            )
        least = self.wgrad_fuse_min
        if least is not None and (isinstance(least, bool) or not isinstance(least, int) or least < 0):
            raise ValueError(
                "fastpipe: wgrad_fuse_min must be a whole number >= 0 (0: every Linear sums in its GEMM) "
                f"or None (the device's default), got {least!r}"
            )
        if self.p2p is not None and self.p2p not in P2P_MODES:
            raise ValueError(f"fastpipe: p2p must be 'tags', 'ordered' or None (the backend's), got {self.p2p!r}")

    @classmethod
    def resolve(
        cls,
        *,
        fused_wgrad: bool | None = None,
        wgrad_batch: int | None = None,
        wgrad_fuse_min: int | None = None,
        tune_malloc: bool | None = None,
        p2p: P2P | None = None,
    ) -> RuntimeOptions:
        """The options of a pipe being built: each keyword as given, or where None, from the environment.

        Raises:
            ValueError: a keyword, or the environment variable read in its place, holds a value
                outside those accepted.
        """
        if fused_wgrad is None:
            fused_wgrad = _env_flag("fused_wgrad")
        if wgrad_batch is None:
            wgrad_batch = _env_whole("wgrad_batch", 1, "a whole number >= 1 (1: no batching)")
        if wgrad_fuse_min is None:
            wgrad_fuse_min = _env_whole("wgrad_fuse_min", 0, "a whole number >= 0")
        if tune_malloc is None:
            tune_malloc = _env_flag("tune_malloc")
        if p2p is None:
            p2p = _env_p2p("p2p")
        return cls(
            fused_wgrad=True if fused_wgrad is None else fused_wgrad,
            wgrad_batch=wgrad_batch,
            wgrad_fuse_min=wgrad_fuse_min,
            tune_malloc=True if tune_malloc is None else tune_malloc,
            p2p=p2p,
        )

    def wgrad_batch_on(self, device: torch.device) -> int:
        """The micro-batches per deferred-W GEMM of a stage on ``device``."""
        return self.wgrad_batch if self.wgrad_batch is not None else default_wgrad_batch(device)

    def wgrad_fuse_min_on(self, device: torch.device) -> int:
        """The fewest weight elements for which a Linear of a stage on ``device`` sums in its GEMM."""
        return self.wgrad_fuse_min if self.wgrad_fuse_min is not None else default_fuse_min(device)


def fuse_min_on(device: torch.device, given: int | None = None) -> int:
    """``wgrad_fuse_min`` on ``device`` as a pipe built now would take it: ``given``, its variable, the default."""
    least = given if given is not None else _env_whole("wgrad_fuse_min", 0, "a whole number >= 0")
    return least if least is not None else default_fuse_min(device)


def _env_text(name: str) -> str | None:
    """The text of ``name``'s environment variable, or None where it is unset or empty."""
    return os.environ.get(_ENV[name]) or None


def _refused(name: str, accepted: str, text: str) -> ValueError:
    return ValueError(f"fastpipe: {_ENV[name]} must be {accepted}, got {text!r}; fix or unset it, or pass {name}=")


def _env_flag(name: str) -> bool | None:
    text = _env_text(name)
    if text is not None and text not in ("0", "1"):
        raise _refused(name, "0 or 1", text)
    return None if text is None else text == "1"


def _env_whole(name: str, least: int, accepted: str) -> int | None:
    """The whole number in ``name``'s variable, at least ``least``, or None where it is unset."""
    text = _env_text(name)
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise _refused(name, accepted, text)
    return value


def _env_p2p(name: str) -> P2P | None:
    text = _env_text(name)
    if text is not None and text not in P2P_MODES:
        raise _refused(name, "'tags' or 'ordered'", text)
    return cast(P2P, text)
