"""Point-to-point transport between pipeline ranks, and the watchdog that keeps it from hanging.

:class:`P2PTransport` moves values between ranks with ``isend``/``irecv`` and between
stages of one rank (interleaved schedules) through a dict::

      rank 0 (stage 0)                         rank 1 (stage 1)
    F(0,m) ── header ──isend──────────────▶ irecv  ┐ both posted at step start when the
           ── payload ─isend──────────────▶ irecv  ┘ layout repeats (else sized by the header)
    BW(0,m) ◀──────────── header, payload ── BW(1,m)

The header (shapes, dtypes, requires_grad flags, non-tensor tuple items) goes first, so
shapes may change from step to step; payloads travel as flat bytes into receive buffers
that are reused while the shapes repeat. Sends are reaped by a background thread.

Never hang (:class:`Watchdog`): every receive waits at most ``timeout`` seconds. A rank
that fails writes its diagnosis under one abort key in the process group's store and
sends an abort header in place of every value it still owed its peers this step; a peer
that receives one fails the same way, so the error travels down the pipeline at once.
A dead peer shows as a connection error, a hung one as the deadline passing; collectives
are polled while the abort key is watched.
"""

from __future__ import annotations

import datetime
import pickle
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fastpipe.errors import PipelineError
from fastpipe.microbatch import Value, tensors_of
from fastpipe.runtime.transport import Transport
from fastpipe.schedule import Action

__all__ = ["Watchdog", "P2PTransport", "DEFAULT_TIMEOUT", "bounded_barrier"]

DEFAULT_TIMEOUT = 30.0
_HEADER = 512  # bytes of the fixed-size header (pickled shapes, dtypes, flags, non-tensor items)
_PARTS = 64  # tag slots per (kind, stage, micro-batch): header, then two sets of 31 tensor items
_SPECULATIVE, _FRESH = 2, 33  # tag offsets of payloads into pre-posted / header-sized receives
_ACT, _GRAD = 0, 1


def bounded_barrier(group: Any, timeout: float, what: str) -> None:
    """Wait for every rank of ``group``, at most ``timeout`` seconds; raise PipelineError naming the missing.

    Collectives (``gather_object``, ``broadcast_object_list``) wait forever for a dead rank.
    Calling this first turns a rank that died before the collective into an error. gloo's
    ``monitored_barrier`` names the ranks that did not arrive; other backends do not have it.
    """
    if dist.get_backend(group) != "gloo":
        return
    try:
        dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=timeout), wait_all_ranks=True)
    except RuntimeError as exc:
        raise PipelineError(
            f"fastpipe: {what}: not every rank arrived within {timeout:g} s (a rank died or hangs): {exc}"
        ) from exc


class Watchdog:
    """Bounded waits on ``Work`` handles plus the abort side channel in a ``Store``.

    A receive blocks in gloo's ``wait(timeout)`` (gloo's point-to-point ``Work`` only
    learns that it completed there, and an expired wait breaks the connection, so it is
    used once, with the whole bound). A peer that fails does not leave it waiting that
    long: :meth:`fail` calls ``on_fail``, with which the transport sends an abort header in
    place of every value this rank still owed its peers, and a dead peer's connection
    error ends the wait at once. Collectives are polled while the abort key is watched.

    Args:
        store: shared key-value store (the process group's), or None (timeouts only).
        key: the abort key; the first failing rank writes its diagnosis there.
        timeout: seconds any single wait may take.
        rank: this process's global rank (for messages).
    """

    def __init__(self, store: dist.Store | None, key: str, timeout: float, rank: int) -> None:
        self.store = store
        self.key = key
        self.timeout = timeout
        self.rank = rank
        self.failure: PipelineError | None = None
        self.on_fail: Callable[[str], None] | None = None
        self._next_check = 0.0

    def published(self) -> str | None:
        """The abort message another rank wrote, if any."""
        if self.store is None:
            return None
        try:
            if self.store.check([self.key]):
                return self.store.get(self.key).decode()
        except Exception as exc:  # noqa: BLE001 - the store's host is gone
            return f"the store is unreachable ({type(exc).__name__}: {exc}); its host rank likely died"
        return None

    def publish(self, message: str) -> str:
        """Write ``message`` unless another rank failed first; returns the message that won."""
        if self.store is not None:
            try:
                won = self.store.compare_set(self.key, "", message)
                return won.decode() if isinstance(won, bytes) else str(won)
            except Exception:  # noqa: BLE001 - nothing more to tell anyone
                pass
        return message

    def fail(self, diagnosis: str) -> PipelineError:
        """Record the failure (first cause wins) and return the error to raise."""
        if self.failure is None:
            cause = self.published() or self.publish(diagnosis)
            self.failure = PipelineError(f"fastpipe: {cause}")
            if self.on_fail is not None:
                try:
                    self.on_fail(cause)
                except Exception:  # noqa: BLE001 - best effort: peers still have the store and timeouts
                    pass
        return self.failure

    def check(self) -> None:
        """Raise if the step failed on another rank (rate-limited store poll)."""
        if self.failure is not None:
            raise self.failure
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + 0.05
        message = self.published()
        if message is not None:
            raise self.fail(message)

    def wait(self, work: Any, what: str, peer: str) -> None:
        """Block for a receive, at most ``timeout`` seconds; ``peer`` names who should deliver."""
        if self.failure is not None:
            raise self.failure
        try:
            work.wait(datetime.timedelta(seconds=self.timeout))
        except BaseException as exc:  # noqa: BLE001 - gloo reports a lost peer or a timeout this way
            raise self._broken(exc, what, peer) from None

    def wait_collective(self, work: Any, what: str) -> None:
        """Poll a collective (gloo collectives complete in the background)."""
        self.poll(work, what, "a peer rank")

    def poll(self, work: Any, what: str, peer: str) -> None:
        """Poll ``work`` until it completed, at most ``timeout`` seconds, watching the abort key.

        For work that completes in the background: collectives, and NCCL operations, whose
        ``wait()`` would only make the current CUDA stream wait.
        """
        if self.failure is not None:
            raise self.failure
        deadline = time.monotonic() + self.timeout
        pause = 5e-5
        while not work.is_completed():
            self.check()
            if time.monotonic() > deadline:
                raise self._late(what, peer)
            time.sleep(pause)
            pause = min(pause * 2, 2e-3)
        try:
            work.wait()
        except BaseException as exc:  # noqa: BLE001
            raise self._broken(exc, what, peer) from None

    def _late(self, what: str, peer: str) -> PipelineError:
        return self.fail(f"{peer} did not deliver {what} within {self.timeout:g} s (dead or hung); "
                         f"seen from rank {self.rank}")

    def _broken(self, exc: BaseException, what: str, peer: str) -> PipelineError:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if "Timed out" in text or "timed out" in text:
            return self._late(what, peer)
        return self.fail(f"{peer} failed while rank {self.rank} waited for {what} ({text})")


class _SendReaper:
    """Waits for sends in the background and drops each buffer once it has left.

    gloo only learns that an ``isend`` completed inside ``wait()``; without this thread a
    step would keep every sent activation alive until its end (defeating checkpointing).
    """

    def __init__(self, timeout: float, poll: bool = False) -> None:
        self.timeout = timeout
        self.poll = poll  # NCCL: wait() would not block the host; poll is_completed() instead
        self.error: BaseException | None = None
        self._pending = 0
        self._cond = threading.Condition()
        self._queue: queue.SimpleQueue[tuple[Any, Any] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def add(self, work: Any, buf: Any) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._main, daemon=True, name="fastpipe-sends")
            self._thread.start()
        with self._cond:
            self._pending += 1
        self._queue.put((work, buf))

    def _main(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                if self.poll:
                    deadline = time.monotonic() + self.timeout
                    while not item[0].is_completed():
                        if time.monotonic() > deadline:
                            raise TimeoutError(f"timed out after {self.timeout:g} s")
                        time.sleep(1e-4)
                item[0].wait(datetime.timedelta(seconds=self.timeout))
            except BaseException as exc:  # noqa: BLE001 - handed to the step's thread
                self.error = self.error or exc
            del item
            with self._cond:
                self._pending -= 1
                self._cond.notify_all()

    def drain(self, watchdog: Watchdog) -> None:
        """Wait until every send left (bounded; watching the abort key meanwhile)."""
        while True:
            with self._cond:
                if self._pending == 0 or self.error is not None:
                    break
                self._cond.wait(0.05)
            watchdog.check()
        if self.error is not None:
            text = str(self.error).splitlines()[0] if str(self.error) else type(self.error).__name__
            raise watchdog.fail(f"a send from rank {watchdog.rank} did not complete ({text})")

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread = None


@dataclass
class _Inbound:
    """A cross-rank receive in flight: its header and, when the layout is known, its payload."""

    src: int  # global rank
    peer: str
    header: Any
    speculative: list[tuple[int, Tensor, Any]]  # (item, buffer, work) posted before the header


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."))
    assert isinstance(dtype, torch.dtype)
    return dtype


def _nbytes(item: Any) -> int:
    return int(torch.Size(item[1]).numel()) * torch.empty((), dtype=_dtype(item[2])).element_size()


class P2PTransport(Transport):
    """Moves activations and gradients between the ranks of one pipeline group.

    Per (kind, stage, micro-batch) key both ends remember the last layout (bytes per
    tensor item). While it repeats, the receiver posts the payload receives into reused
    buffers at the start of the step, together with the header receive, so nothing waits
    for the header to arrive. When the layout changes, the sender fills the posted
    receives with dummies and sends the payload again on fresh tags, sized by the header.

    Args:
        group: the pipeline process group; stage ``s`` lives on group rank ``s % size``.
        num_stages: stages in the pipeline.
        watchdog: bounds every wait.
        device: where received tensors land (CPU for gloo, this rank's GPU for NCCL).
    """

    def __init__(self, group: Any, num_stages: int, watchdog: Watchdog, device: torch.device) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.num_stages = num_stages
        self.watchdog = watchdog
        self.device = device
        self._local: dict[tuple[int, int, int], Any] = {}
        self._inbound: dict[tuple[int, int, int], _Inbound] = {}
        self._sends = _SendReaper(watchdog.timeout)
        self._buffers: dict[tuple[int, int, int, int], Tensor] = {}
        self._headers: dict[tuple[int, int, int], Tensor] = {}
        self._recv_layout: dict[tuple[int, int, int], tuple[int, ...]] = {}
        self._owed: set[tuple[int, int, int]] = set()  # values this rank still sends this step
        watchdog.on_fail = self.poison
        self._sent_layout: dict[tuple[int, int, int], tuple[int, ...]] = {}

    # -- placement ------------------------------------------------------------------

    def owner(self, stage: int) -> int:
        """Group rank holding ``stage``."""
        return stage % self.size

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank)

    def _peer(self, stage: int) -> str:
        return f"rank {self._global(self.owner(stage))} (stage {stage})"

    def _tag(self, kind: int, stage: int, microbatch: int, part: int) -> int:
        return ((microbatch * self.num_stages + stage) * 2 + kind) * _PARTS + part

    # -- step boundaries ------------------------------------------------------------

    def begin(self, actions: Sequence[Action]) -> None:
        """Post the receives of every cross-rank value this worker will consume."""
        last = self.num_stages - 1
        for a in actions:
            if a.kind == "F" and a.stage > 0 and self.owner(a.stage - 1) != self.rank:
                self._expect(_ACT, a.stage, a.microbatch, a.stage - 1)
            elif a.kind in ("BW", "B") and a.stage < last and self.owner(a.stage + 1) != self.rank:
                self._expect(_GRAD, a.stage, a.microbatch, a.stage + 1)
            if a.kind == "F" and a.stage < last and self.owner(a.stage + 1) != self.rank:
                self._owed.add((_ACT, a.stage + 1, a.microbatch))
            elif a.kind in ("BW", "B") and a.stage > 0 and self.owner(a.stage - 1) != self.rank:
                self._owed.add((_GRAD, a.stage - 1, a.microbatch))

    def poison(self, message: str) -> None:
        """Send an abort header in place of every value still owed to a peer this step."""
        head = _pack(["abort", message[:400]])
        owed, self._owed = sorted(self._owed), set()
        for key in owed:
            dst = self._global(self.owner(key[1]))
            dist.isend(head.to(self.device), dst=dst, group=self.group, tag=self._tag(*key, 0))

    def _expect(self, kind: int, stage: int, microbatch: int, src_stage: int) -> None:
        key = (kind, stage, microbatch)
        header = self._headers.get(key)
        if header is None:
            header = self._headers[key] = torch.empty(_HEADER, dtype=torch.uint8, device=self.device)
        src = self._global(self.owner(src_stage))
        work = dist.irecv(header, src=src, group=self.group, tag=self._tag(kind, stage, microbatch, 0))
        speculative = [self._post(key, i, nbytes, src, _SPECULATIVE)
                       for i, nbytes in enumerate(self._recv_layout.get(key, ())) if nbytes]
        self._inbound[key] = _Inbound(src, self._peer(src_stage), work, speculative)

    def _post(self, key: tuple[int, int, int], item: int, nbytes: int, src: int,
              base: int) -> tuple[int, Tensor, Any]:
        buf = self._buffers.get((*key, item))
        if buf is None or buf.numel() != nbytes:
            buf = self._buffers[(*key, item)] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
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

    def _isend(self, buf: Tensor, dst: int, tag: int) -> None:
        self._sends.add(dist.isend(buf, dst=dst, group=self.group, tag=tag), buf)

    def _send(self, kind: int, stage: int, microbatch: int, meta: list[Any], tensors: Sequence[Tensor]) -> None:
        key = (kind, stage, microbatch)
        self._owed.discard(key)
        dst = self._global(self.owner(stage))
        if len(meta) - 2 > _FRESH - _SPECULATIVE:
            raise ValueError(f"fastpipe: a stage output has {len(meta) - 2} items; at most "
                             f"{_FRESH - _SPECULATIVE} can cross a rank boundary")
        layout = _layout(meta)
        previous = self._sent_layout.get(key)
        meta[1] = previous == layout
        self._isend(_pack(meta).to(self.device), dst, self._tag(*key, 0))
        if previous is not None and previous != layout:  # fill the receives posted for the old layout
            for i, nbytes in enumerate(previous):
                if nbytes:
                    self._isend(torch.zeros(nbytes, dtype=torch.uint8, device=self.device), dst,
                                self._tag(*key, _SPECULATIVE + i))
        base = _SPECULATIVE if previous == layout else _FRESH
        flat = iter(tensors)
        for i, item in enumerate(meta[2:]):
            if item[0] == "t":
                t = next(flat).detach().contiguous().reshape(-1)
                if t.numel():
                    self._isend(t.view(torch.uint8), dst, self._tag(*key, base + i))
        self._sent_layout[key] = layout

    def send_activation(self, stage: int, microbatch: int, value: Value, requires_grad: Sequence[bool]) -> None:
        flags = iter(requires_grad)
        if self.owner(stage) == self.rank:
            self._local[(_ACT, stage, microbatch)] = _map_tensors(
                value, lambda t: t.detach().requires_grad_(next(flags)))
            return
        items = [value] if isinstance(value, Tensor) else list(value)
        meta: list[Any] = [isinstance(value, Tensor), False]
        for v in items:
            meta.append(("t", tuple(v.shape), str(v.dtype), bool(next(flags))) if isinstance(v, Tensor)
                        else ("v", v))
        self._send(_ACT, stage, microbatch, meta, tensors_of(value))

    def send_grad(self, stage: int, microbatch: int, grads: Sequence[Tensor | None]) -> None:
        if self.owner(stage) == self.rank:
            self._local[(_GRAD, stage, microbatch)] = [None if g is None else g.detach() for g in grads]
            return
        meta: list[Any] = [False, False] + [("n",) if g is None else ("t", tuple(g.shape), str(g.dtype), False)
                                            for g in grads]
        self._send(_GRAD, stage, microbatch, meta, [g for g in grads if g is not None])

    # -- receiving ------------------------------------------------------------------

    def _read_header(self, key: tuple[int, int, int]) -> tuple[list[Any], _Inbound]:
        """Wait for the header of ``key`` (bounded); a peer's abort header fails the step here."""
        inbound = self._inbound.pop(key, None)
        if inbound is None:
            raise PipelineError(f"fastpipe: {_what(*key)} was never expected on this rank (a schedule bug)")
        self.watchdog.wait(inbound.header, f"the header of {_what(*key)}", inbound.peer)
        meta = _unpack(self._headers[key])
        if meta[0] == "abort":
            raise self.watchdog.fail(str(meta[1]))
        return meta, inbound

    def _receive(self, kind: int, stage: int, microbatch: int) -> tuple[list[Any], dict[int, Tensor]]:
        key = (kind, stage, microbatch)
        what = _what(*key)
        meta, inbound = self._read_header(key)
        for _, _, work in inbound.speculative:  # payloads, or dummies when the layout changed
            self.watchdog.wait(work, what, inbound.peer)
        buffers = {i: buf for i, buf, _ in inbound.speculative}
        if not meta[1]:  # the layout changed (or is new): the payload follows on fresh tags
            layout = _layout(meta)
            posted = [self._post(key, i, n, inbound.src, _FRESH) for i, n in enumerate(layout) if n]
            self._recv_layout[key] = layout
            for _, _, work in posted:
                self.watchdog.wait(work, what, inbound.peer)
            buffers = {i: buf for i, buf, _ in posted}
        return meta, _tensors(meta, buffers, self.device)

    def recv_activation(self, stage: int, microbatch: int) -> Value:
        local: Any = self._local.pop((_ACT, stage, microbatch), None)
        if local is not None:
            return local
        meta, tensors = self._receive(_ACT, stage, microbatch)
        items = [tensors[i].requires_grad_(item[3]) if item[0] == "t" else item[1]
                 for i, item in enumerate(meta[2:])]
        return items[0] if meta[0] else tuple(items)

    def recv_grad(self, stage: int, microbatch: int) -> list[Tensor | None]:
        local: Any = self._local.pop((_GRAD, stage, microbatch), None)
        if local is not None:
            return local
        meta, tensors = self._receive(_GRAD, stage, microbatch)
        return [tensors[i] if item[0] == "t" else None for i, item in enumerate(meta[2:])]

    def abort(self, exc: BaseException) -> None:
        self.reset()


def _pack(meta: list[Any]) -> Tensor:
    """The fixed-size header tensor (uint8, CPU) for ``meta``."""
    blob = pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)
    if len(blob) > _HEADER - 4:
        raise ValueError(f"fastpipe: the non-tensor items of a stage output pickle to {len(blob)} bytes; "
                         f"at most {_HEADER - 4} fit in a header (pass big objects as tensors)")
    head = bytearray(_HEADER)
    head[:4] = len(blob).to_bytes(4, "little")
    head[4:4 + len(blob)] = blob
    return torch.frombuffer(head, dtype=torch.uint8)


def _unpack(header: Tensor) -> list[Any]:
    raw = header.cpu().numpy().tobytes()
    meta: list[Any] = pickle.loads(raw[4:4 + int.from_bytes(raw[:4], "little")])
    return meta


def _layout(meta: list[Any]) -> tuple[int, ...]:
    """Payload bytes per item of a header (0 for non-tensor items)."""
    return tuple(_nbytes(item) if item[0] == "t" else 0 for item in meta[2:])


def _tensors(meta: list[Any], buffers: dict[int, Tensor], device: torch.device) -> dict[int, Tensor]:
    """The tensor items of a received value, as views of their byte buffers."""
    tensors: dict[int, Tensor] = {}
    for i, item in enumerate(meta[2:]):
        if item[0] == "t":
            buf = buffers.get(i)
            dtype = _dtype(item[2])
            if buf is None:  # an empty tensor travels in the header only
                tensors[i] = torch.empty(item[1], dtype=dtype, device=device)
            else:
                tensors[i] = buf.view(dtype).view(item[1]).detach()
    return tensors


def _what(kind: int, stage: int, microbatch: int) -> str:
    return f"the {'activation' if kind == _ACT else 'gradient'} for stage {stage}, micro-batch {microbatch}"


def _map_tensors(value: Value, fn: Callable[[Tensor], Tensor]) -> Value:
    if isinstance(value, Tensor):
        return fn(value)
    return tuple(fn(v) if isinstance(v, Tensor) else v for v in value)
