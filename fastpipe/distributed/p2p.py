"""Point-to-point transport between pipeline ranks that match messages by tag (gloo).

:class:`P2PTransport` moves values between ranks with ``isend``/``irecv`` and between
stages of one rank (interleaved schedules) through a dict::

      rank 0 (stage 0)                         rank 1 (stage 1)
    F(0,m) ── header ──isend──────────────▶ irecv  ┐ both posted at step start when the
           ── payload ─isend──────────────▶ irecv  ┘ layout repeats (else sized by the header)
    BW(0,m) ◀──────────── header, payload ── BW(1,m)

The header (shapes, dtypes, requires_grad flags, non-tensor tuple items) goes first, so
shapes may change from step to step; payloads travel as flat bytes into receive buffers
that are reused while the shapes repeat. Sends are reaped by a background thread.

Never hang (:class:`~fastpipe.distributed.watchdog.Watchdog`): every receive waits at most ``timeout`` seconds. A rank
that fails writes its diagnosis under one abort key in the process group's store and
sends an abort header in place of every value it still owed its peers this step; a peer
that receives one fails the same way, so the error travels down the pipeline at once.
A dead peer shows as a connection error, a hung one as the deadline passing; collectives
are polled while the abort key is watched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fastpipe.distributed.watchdog import SendReaper, Watchdog
from fastpipe.distributed.wire import (
    ACT,
    GRAD,
    HEADER,
    assemble,
    describe,
    kinds,
    pack,
    payload_sizes,
    skip_grad_kind,
    skip_kind,
    tensors_from,
    unpack,
    value_kind,
)
from fastpipe.errors import PipelineError
from fastpipe.model.skips import StageSkips
from fastpipe.runtime.transport import Transport
from fastpipe.schedule import Action
from fastpipe.step.microbatch import Value, rebuilt, tensors_of

__all__ = ["P2PTransport"]

_PARTS = 64  # tag slots per (kind, stage, micro-batch): header, then two sets of 31 tensor items
Key = tuple[int, int, int]  # (kind, stage, micro-batch): see fastpipe.distributed.wire
_SPECULATIVE, _FRESH = 2, 33  # tag offsets of payloads into pre-posted / header-sized receives


@dataclass
class _Inbound:
    """A cross-rank receive in flight: its header and, when the layout is known, its payload."""

    src: int  # global rank
    peer: str
    header: Any
    speculative: list[tuple[int, Tensor, Any]]  # (item, buffer, work) posted before the header


class P2PTransport(Transport):
    """Moves activations and gradients between the ranks of one pipeline group.

    Per (kind, stage, micro-batch) key both ends remember the last layout (bytes per
    tensor item). While it repeats, the receiver posts the payload receives into reused
    buffers at the start of the step, together with the header receive, so nothing waits
    for the header to arrive. When the layout changes, the sender fills the posted
    receives with dummies and sends the payload again on fresh tags, sized by the header.

    Args:
        group: the pipeline process group; stage ``s`` lives on group rank ``placement[s]``.
        num_stages: stages in the pipeline.
        watchdog: bounds every wait.
        device: where received tensors land (CPU for gloo, this rank's GPU for NCCL).
        placement: the group rank of each stage (default round robin, ``s % size``).
    """

    def __init__(
        self,
        group: Any,
        num_stages: int,
        watchdog: Watchdog,
        device: torch.device,
        placement: Sequence[int] | None = None,
    ) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.num_stages = num_stages
        self.placement = tuple(placement) if placement is not None else tuple(s % self.size for s in range(num_stages))
        self.watchdog = watchdog
        self.device = device
        self._local: dict[tuple[int, int, int], Any] = {}
        self._inbound: dict[tuple[int, int, int], _Inbound] = {}
        self._sends = SendReaper(watchdog.timeout, watchdog=watchdog)
        self._buffers: dict[tuple[int, int, int, int], Tensor] = {}
        self._headers: dict[tuple[int, int, int], Tensor] = {}
        self._recv_layout: dict[tuple[int, int, int], tuple[int, ...]] = {}
        self._owed: set[tuple[int, int, int]] = set()  # values this rank still sends this step
        watchdog.on_fail = self.poison
        self._sent_layout: dict[tuple[int, int, int], tuple[int, ...]] = {}
        self._kinds = kinds(num_stages)
        self.skips: dict[int, StageSkips] = {}  # this rank's stages' skips (see use_skips)

    # -- placement ------------------------------------------------------------------

    def owner(self, stage: int) -> int:
        """Group rank holding ``stage``."""
        return self.placement[stage]

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank)

    def _peer(self, stage: int) -> str:
        return f"rank {self._global(self.owner(stage))} (stage {stage})"

    def _tag(self, kind: int, stage: int, microbatch: int, part: int) -> int:
        return ((microbatch * self.num_stages + stage) * self._kinds + kind) * _PARTS + part

    def use_skips(self, skips: Sequence[StageSkips]) -> None:
        """Carry the skips of ``skips`` (every stage's, in order) straight between their ranks."""
        self.skips = {s: sk for s, sk in enumerate(skips) if self.owner(s) == self.rank}

    def _skip_messages(self, a: Action) -> tuple[list[tuple[Key, int]], list[Key]]:
        """The skip values that ``a`` receives from other ranks (with their source stage), and those it owes them.

        A consumer's F receives its skips and its B sends their gradients back; a producer's
        F sends its skips and its B receives their gradients.
        """
        skips, s, m = self.skips.get(a.stage), a.stage, a.microbatch
        if skips is None or a.kind not in ("F", "BW", "B"):
            return [], []
        producers = [p for p, _ in skips.receives if self.owner(p) != self.rank]
        consumers = [c for c, _ in skips.sends if self.owner(c) != self.rank]
        if a.kind == "F":
            return [((skip_kind(p), s, m), p) for p in producers], [(skip_kind(s), c, m) for c in consumers]
        return [((skip_grad_kind(c), s, m), c) for c in consumers], [(skip_grad_kind(s), p, m) for p in producers]

    # -- step boundaries ------------------------------------------------------------

    def begin(self, actions: Sequence[Action]) -> None:
        """Post the receives of every cross-rank value this worker will consume."""
        last = self.num_stages - 1
        for a in actions:
            if a.kind == "F" and a.stage > 0 and self.owner(a.stage - 1) != self.rank:
                self._expect(ACT, a.stage, a.microbatch, a.stage - 1)
            elif a.kind in ("BW", "B") and a.stage < last and self.owner(a.stage + 1) != self.rank:
                self._expect(GRAD, a.stage, a.microbatch, a.stage + 1)
            if a.kind == "F" and a.stage < last and self.owner(a.stage + 1) != self.rank:
                self._owed.add((ACT, a.stage + 1, a.microbatch))
            elif a.kind in ("BW", "B") and a.stage > 0 and self.owner(a.stage - 1) != self.rank:
                self._owed.add((GRAD, a.stage - 1, a.microbatch))
            expect, owed = self._skip_messages(a)
            for key, src in expect:
                self._expect(*key, src)
            self._owed.update(owed)

    def poison(self, message: str) -> None:
        """Send an abort header in place of every value still owed to a peer this step."""
        head = pack(["abort", message[:400]])
        owed, self._owed = sorted(self._owed), set()
        for key in owed:
            # Through the reaper, which keeps the work until the send left: a dropped gloo
            # work may take its unsent buffer with it, and the peer would wait the full bound.
            self._isend(head.to(self.device), self._global(self.owner(key[1])), self._tag(*key, 0))

    def _expect(self, kind: int, stage: int, microbatch: int, src_stage: int) -> None:
        key = (kind, stage, microbatch)
        header = self._headers.get(key)
        if header is None:
            header = self._headers[key] = torch.empty(HEADER, dtype=torch.uint8, device=self.device)
        src = self._global(self.owner(src_stage))
        with self._posting(describe(*key), f"rank {src}"):
            work = dist.irecv(header, src=src, group=self.group, tag=self._tag(kind, stage, microbatch, 0))
        speculative = [
            self._post(key, i, nbytes, src, _SPECULATIVE)
            for i, nbytes in enumerate(self._recv_layout.get(key, ()))
            if nbytes
        ]
        self._inbound[key] = _Inbound(src, self._peer(src_stage), work, speculative)

    def _post(self, key: tuple[int, int, int], item: int, nbytes: int, src: int, base: int) -> tuple[int, Tensor, Any]:
        buf = self._buffers.get((*key, item))
        if buf is None or buf.numel() != nbytes:
            buf = self._buffers[(*key, item)] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        with self._posting(describe(*key), f"rank {src}"):
            work = dist.irecv(buf, src=src, group=self.group, tag=self._tag(*key, base + item))
        return item, buf, work

    def finish(self) -> None:
        """Wait for every send of this step (bounded)."""
        self._sends.drain(self.watchdog)
        if self._inbound or self._local or self._owed:
            left = sorted(self._inbound) + sorted(self._local) + sorted(self._owed)
            self.reset()
            raise PipelineError(f"fastpipe: values never consumed or never sent in this step: {left} (a schedule bug)")

    def reset(self) -> None:
        """Forget the step's pending state (after a failure the group is not reusable)."""
        self._inbound.clear()
        self._local.clear()
        self._owed.clear()

    def close(self) -> None:
        """Stop the send thread."""
        self.reset()
        self._sends.close()

    # -- sending --------------------------------------------------------------------

    @contextlib.contextmanager
    def _posting(self, what: str, peer: str) -> Iterator[None]:
        """Posting a send or receive to a peer whose connection is already gone.

        gloo raises at ``isend``/``irecv`` itself (not in ``wait``) once it has seen the peer's
        socket close, so a rank that died a moment earlier shows up here first; that is a
        dead peer like any other and must become PipelineError, not gloo's RuntimeError.
        """
        try:
            yield
        except PipelineError:
            raise
        except Exception as exc:  # noqa: BLE001 - gloo reports a lost peer this way
            raise self.watchdog.broken(exc, f"{what} to be posted", peer) from exc

    def _isend(self, buf: Tensor, dst: int, tag: int) -> None:
        with self._posting("a send", f"rank {dst}"):
            work = dist.isend(buf, dst=dst, group=self.group, tag=tag)
        self._sends.add(work, buf)

    def _send(self, kind: int, stage: int, microbatch: int, meta: list[Any], tensors: Sequence[Tensor]) -> None:
        key = (kind, stage, microbatch)
        dst = self._global(self.owner(stage))
        if len(meta) - 2 > _FRESH - _SPECULATIVE:
            raise ValueError(
                f"fastpipe: a stage output has {len(meta) - 2} items; at most "
                f"{_FRESH - _SPECULATIVE} can cross a rank boundary"
            )
        layout = payload_sizes(meta)
        previous = self._sent_layout.get(key)
        meta[1] = previous == layout
        self._isend(pack(meta).to(self.device), dst, self._tag(*key, 0))
        self._owed.discard(key)  # only now: if anything above raised, the peer still gets an abort header
        if previous is not None and previous != layout:  # fill the receives posted for the old layout
            for i, nbytes in enumerate(previous):
                if nbytes:
                    self._isend(
                        torch.zeros(nbytes, dtype=torch.uint8, device=self.device),
                        dst,
                        self._tag(*key, _SPECULATIVE + i),
                    )
        base = _SPECULATIVE if previous == layout else _FRESH
        flat = iter(tensors)
        for i, item in enumerate(meta[2:]):
            if item[0] == "t":
                t = next(flat).detach().contiguous().reshape(-1)
                if t.numel():
                    self._isend(t.view(torch.uint8), dst, self._tag(*key, base + i))
        self._sent_layout[key] = layout

    def send_activation(self, stage: int, microbatch: int, value: Value, requires_grad: Sequence[bool]) -> None:
        self._send_value((ACT, stage, microbatch), value, requires_grad)

    def send_skip(
        self, producer: int, consumer: int, microbatch: int, value: tuple, requires_grad: Sequence[bool]
    ) -> None:
        self._send_value((skip_kind(producer), consumer, microbatch), value, requires_grad)

    def _send_value(self, key: Key, value: Value, requires_grad: Sequence[bool]) -> None:
        flags = iter(requires_grad)
        if self.owner(key[1]) == self.rank:
            self._local[key] = _map_tensors(value, lambda t: t.detach().requires_grad_(next(flags)))
            return
        items = [value] if isinstance(value, Tensor) else list(value)
        meta: list[Any] = [value_kind(value), False]
        for v in items:
            meta.append(("t", tuple(v.shape), str(v.dtype), bool(next(flags))) if isinstance(v, Tensor) else ("v", v))
        self._send(*key, meta, tensors_of(value))

    def send_grad(self, stage: int, microbatch: int, grads: Sequence[Tensor | None]) -> None:
        self._send_grads((GRAD, stage, microbatch), grads)

    def send_skip_grad(self, producer: int, consumer: int, microbatch: int, grads: Sequence[Tensor | None]) -> None:
        self._send_grads((skip_grad_kind(consumer), producer, microbatch), grads)

    def _send_grads(self, key: Key, grads: Sequence[Tensor | None]) -> None:
        if self.owner(key[1]) == self.rank:
            self._local[key] = [None if g is None else g.detach() for g in grads]
            return
        meta: list[Any] = [False, False] + [
            ("n",) if g is None else ("t", tuple(g.shape), str(g.dtype), False) for g in grads
        ]
        self._send(*key, meta, [g for g in grads if g is not None])

    # -- receiving ------------------------------------------------------------------

    def _read_header(self, key: tuple[int, int, int]) -> tuple[list[Any], _Inbound]:
        """Wait for the header of ``key`` (bounded); a peer's abort header fails the step here."""
        inbound = self._inbound.pop(key, None)
        if inbound is None:
            raise PipelineError(f"fastpipe: {describe(*key)} was never expected on this rank (a schedule bug)")
        self.watchdog.wait(inbound.header, f"the header of {describe(*key)}", inbound.peer)
        meta = unpack(self._headers[key])
        if meta[0] == "abort":
            raise self.watchdog.fail(str(meta[1]))
        return meta, inbound

    def _receive(self, kind: int, stage: int, microbatch: int) -> tuple[list[Any], dict[int, Tensor]]:
        key = (kind, stage, microbatch)
        what = describe(*key)
        meta, inbound = self._read_header(key)
        for _, _, work in inbound.speculative:  # payloads, or dummies when the layout changed
            self.watchdog.wait(work, what, inbound.peer)
        buffers = {i: buf for i, buf, _ in inbound.speculative}
        if not meta[1]:  # the layout changed (or is new): the payload follows on fresh tags
            layout = payload_sizes(meta)
            posted = [self._post(key, i, n, inbound.src, _FRESH) for i, n in enumerate(layout) if n]
            self._recv_layout[key] = layout
            for _, _, work in posted:
                self.watchdog.wait(work, what, inbound.peer)
            buffers = {i: buf for i, buf, _ in posted}
        return meta, tensors_from(meta, buffers, self.device)

    def recv_activation(self, stage: int, microbatch: int) -> Value:
        return self._recv_value((ACT, stage, microbatch))

    def recv_skip(self, producer: int, consumer: int, microbatch: int) -> tuple:
        value = self._recv_value((skip_kind(producer), consumer, microbatch))
        assert isinstance(value, tuple)
        return value

    def _recv_value(self, key: Key) -> Value:
        local: Any = self._local.pop(key, None)
        if local is not None:
            return local
        meta, tensors = self._receive(*key)
        items = [tensors[i].requires_grad_(item[3]) if item[0] == "t" else item[1] for i, item in enumerate(meta[2:])]
        return assemble(meta[0], items)

    def recv_grad(self, stage: int, microbatch: int) -> list[Tensor | None]:
        return self._recv_grads((GRAD, stage, microbatch))

    def recv_skip_grad(self, producer: int, consumer: int, microbatch: int) -> list[Tensor | None]:
        return self._recv_grads((skip_grad_kind(consumer), producer, microbatch))

    def _recv_grads(self, key: Key) -> list[Tensor | None]:
        local: Any = self._local.pop(key, None)
        if local is not None:
            return local
        meta, tensors = self._receive(*key)
        return [tensors[i] if item[0] == "t" else None for i, item in enumerate(meta[2:])]

    def abort(self, exc: BaseException) -> None:
        self.reset()


def _map_tensors(value: Value, fn: Callable[[Tensor], Tensor]) -> Value:
    if isinstance(value, Tensor):
        return fn(value)
    return rebuilt(value, [fn(v) if isinstance(v, Tensor) else v for v in value])
