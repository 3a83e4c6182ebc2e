"""Point-to-point transport for backends that match messages by order, not tag (NCCL).

NCCL delivers the k-th payload a rank sends to a peer into the k-th receive that peer
posted from it, and a send may not complete before its receive is posted. So, unlike
:class:`~fastpipe.distributed.p2p.P2PTransport`, which posts every receive of a step at its
start and lets tags sort them out, :class:`OrderedTransport`:

- sends each value's header (shapes, dtypes, non-tensor items) at once over a gloo side
  group, matched by tag, so shapes may still change from step to step and every receive
  is sized before it is posted;
- keeps the payloads until the runtime posts the next batch of the plan from
  :func:`fastpipe.schedule.ordered.plan` (one ``batch_isend_irecv`` per round: what the
  action just done produced, and what peers produced for this rank in the same round).
  The plan is checked against deadlock under NCCL's semantics before a schedule runs
  (:func:`~fastpipe.schedule.ordered.check_ordered`).

Faults stay bounded as in the tag-matched transport: headers and abort headers travel on
the gloo side group; an NCCL payload is waited for on the compute stream, and a background
watch bounds it (see :meth:`OrderedTransport._wait`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fastpipe.distributed.backend import backend_for
from fastpipe.distributed.p2p import P2PTransport
from fastpipe.distributed.watchdog import SendReaper, Watchdog
from fastpipe.distributed.wire import ACT, GRAD, describe, pack, payload_sizes, skip_grad_kind, skip_kind, tensors_from
from fastpipe.errors import PipelineError
from fastpipe.schedule.ordered import Message, Op

__all__ = ["OrderedTransport"]


class OrderedTransport(P2PTransport):
    """Payloads matched by order on ``group``; headers matched by tag on ``header_group`` (gloo).

    Args:
        group: the pipeline process group that carries payloads (NCCL, or gloo in tests).
        header_group: a gloo group of the same ranks in the same order.
        num_stages: stages in the pipeline.
        watchdog: bounds every wait.
        device: where payloads live (this rank's GPU for NCCL).
        placement: the group rank of each stage (default round robin).
    """

    def __init__(
        self,
        group: Any,
        header_group: Any,
        num_stages: int,
        watchdog: Watchdog,
        device: torch.device,
        placement: Sequence[int] | None = None,
    ) -> None:
        if backend_for(header_group, "cpu") != "gloo":
            raise ValueError("fastpipe: the header group of an ordered transport must be a gloo group")
        if [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))] != [
            dist.get_global_rank(header_group, r) for r in range(dist.get_world_size(header_group))
        ]:
            raise ValueError("fastpipe: the header group must hold the pipeline group's ranks in the same order")
        super().__init__(header_group, num_stages, watchdog, torch.device("cpu"), placement)
        if device.type == "cuda" and device.index is None:  # compare like the tensors' own devices
            device = torch.device("cuda", torch.cuda.current_device())
        self.data_group = group
        self.data_device = device
        self.polls = backend_for(group, device) == "nccl"
        self._payload_sends = SendReaper(watchdog.timeout, poll=self.polls, device=device, watchdog=watchdog)
        # NCCL receives: ordered on the compute stream, bounded by this watch beside it.
        self._payload_recvs = SendReaper(
            watchdog.timeout, poll=True, device=device, what="a payload receive on", watchdog=watchdog
        )
        self._outbox: dict[tuple[int, int, int], list[Tensor]] = {}
        self._arrived: dict[tuple[int, int, int], tuple[list[Any], dict[int, Tensor], list[Any], str]] = {}

    def connect(self) -> None:
        """Exchange one byte with each neighbour rank, bounded by the watchdog.

        NCCL opens a pair's connection lazily, inside the first send or receive between
        them, and may block the host there until the peer arrives; doing it here, on every
        rank at once, keeps that out of the first step (as ``torch.distributed.pipelining``
        does for its neighbours). The pairs that ever talk hold stages s and s+1 (the ring's
        neighbours in round robin, the V's neighbours in a V) or a skip's two ends (call
        :meth:`use_skips` first).
        """
        if self.size == 1:
            return
        ops: list[dist.P2POp] = []
        edges = [(self.owner(s), self.owner(s + 1)) for s in range(self.num_stages - 1)]
        peers = {b if a == self.rank else a for a, b in edges if self.rank in (a, b) and a != b}
        for peer in sorted(peers | self._skip_peers()):
            g = self._global(peer)
            ops.append(
                dist.P2POp(
                    dist.isend, torch.ones(1, dtype=torch.uint8, device=self.data_device), g, group=self.data_group
                )
            )
            ops.append(
                dist.P2POp(
                    dist.irecv, torch.zeros(1, dtype=torch.uint8, device=self.data_device), g, group=self.data_group
                )
            )
        with self._posting("the connection handshake", "a neighbour rank"):
            works = dist.batch_isend_irecv(ops)
        for work in works:
            if self.polls:  # the connection must really be up: wait on the host, once
                self.watchdog.poll(work, "the connection handshake", "a neighbour rank")
            else:
                self.watchdog.wait(work, "the connection handshake", "a neighbour rank")

    def _skip_peers(self) -> set[int]:
        """The group ranks this rank's skips go to or come from (the relation is symmetric)."""
        stages = [c for sk in self.skips.values() for c, _ in sk.sends]
        stages += [p for sk in self.skips.values() for p, _ in sk.receives]
        return {self.owner(s) for s in stages} - {self.rank}

    # -- sending: the header now, the payload with the next batch -------------------------

    def _send(self, kind: int, stage: int, microbatch: int, meta: list[Any], tensors: Sequence[Tensor]) -> None:
        key = (kind, stage, microbatch)
        dst = self._global(self.owner(stage))
        payload = []
        for t in tensors:
            flat = t.detach().contiguous().reshape(-1)
            if flat.device != self.data_device:
                raise ValueError(
                    f"fastpipe: {describe(*key)} is on {flat.device}; the pipeline group moves tensors "
                    f"on {self.data_device} (keep every stage's outputs on its device)"
                )
            if flat.numel():
                payload.append(flat.view(torch.uint8))
        self._isend(pack(meta), dst, self._tag(*key, 0))
        self._owed.discard(key)  # only now: if anything above raised, the peer still gets an abort header
        self._outbox[key] = payload

    # -- the plan's batches -----------------------------------------------------------------

    def post(self, ops: Sequence[Op]) -> None:
        """Post one batch of the plan: payload sends of values already produced, sized receives."""
        p2p: list[dist.P2POp] = []
        receiving: list[tuple[tuple[int, int, int], int]] = []  # (key, index into p2p) per receive buffer
        sending: list[Tensor] = []
        for op in ops:
            key = _wire_key(op.message)
            if op.send:
                payload = self._outbox.pop(key, None)
                if payload is None:
                    raise PipelineError(f"fastpipe: {describe(*key)} was not produced before its send (a plan bug)")
                peer = self._global(self.owner(op.message.stage))
                for t in payload:
                    p2p.append(dist.P2POp(dist.isend, t, peer, group=self.data_group))
                    sending.append(t)
                continue
            meta, inbound = self._read_header(key)
            buffers = {}
            for i, nbytes in enumerate(payload_sizes(meta)):
                if nbytes:
                    buf = buffers[i] = self._receive_buffer(nbytes)
                    receiving.append((key, len(p2p)))
                    p2p.append(dist.P2POp(dist.irecv, buf, inbound.src, group=self.data_group))
            self._arrived[key] = (meta, buffers, [], inbound.peer)
        if not p2p:
            return
        with self._posting("a batch of sends and receives", "a neighbour rank"):
            works = dist.batch_isend_irecv(p2p)
        # NCCL coalesces a batch into one work; gloo returns one per operation.
        per_op = works if len(works) == len(p2p) else [works[-1]] * len(p2p)
        for key, index in receiving:
            self._arrived[key][2].append(per_op[index])
        sent = [w for w, op in zip(per_op, p2p) if op.op is dist.isend]
        if sent:
            self._payload_sends.add(sent[-1] if len(works) != len(p2p) else _AllOf(sent), sending)

    def _receive_buffer(self, nbytes: int) -> Tensor:
        """A fresh buffer for one payload; the value received into it is its only owner.

        Nothing here keeps it: once the task that consumed the value is done with it (its
        backward, for a saved activation), it goes back to the device's caching allocator,
        which is the size-keyed free list the next receive of that size draws from. Keeping
        one buffer per (value, micro-batch) across steps held M activations and M gradients
        on the GPU for good, undoing 1F1B's memory saving. NCCL keeps its own reference
        until the receive completed, so the memory is never reused under it.
        """
        return torch.empty(nbytes, dtype=torch.uint8, device=self.data_device)

    # -- receiving --------------------------------------------------------------------------

    def _receive(self, kind: int, stage: int, microbatch: int) -> tuple[list[Any], dict[int, Tensor]]:
        key = (kind, stage, microbatch)
        arrived = self._arrived.pop(key, None)
        if arrived is None:
            raise PipelineError(f"fastpipe: {describe(*key)} was consumed before its receive was posted (a plan bug)")
        meta, buffers, works, peer = arrived
        for work in works:
            self._wait(work, describe(*key), peer)
        return meta, tensors_from(meta, buffers, self.data_device)

    def _wait(self, work: Any, what: str, peer: str) -> None:
        """Make the payload usable: NCCL's on the GPU, gloo's on the host; bounded either way.

        NCCL: ``work.wait()`` without a timeout only makes the current (compute) stream
        wait for the receive, so the host runs ahead instead of draining the GPU at every
        receive; the time bound is kept by a background thread that polls the work
        (``is_completed()`` queries an event, it does not synchronize) and fails the step
        at this rank's next receive, or at the step's end, if it expires.
        """
        if not self.polls:
            self.watchdog.wait(work, what, peer)
            return
        self._payload_recvs.check(self.watchdog)
        self.watchdog.check()
        try:
            work.wait()
        except BaseException as exc:  # noqa: BLE001 - NCCL reports an aborted communicator this way
            raise self.watchdog.broken(exc, what, peer) from None
        self._payload_recvs.add(work, None)

    # -- step boundaries --------------------------------------------------------------------

    def finish(self) -> None:
        """Wait for every send of this step (bounded)."""
        if self._outbox or self._arrived:
            left = sorted(self._outbox) + sorted(self._arrived)
            self.reset()
            raise PipelineError(f"fastpipe: values never posted or never consumed in this step: {left} (a plan bug)")
        self._payload_recvs.drain(self.watchdog)
        self._payload_sends.drain(self.watchdog)
        super().finish()

    def reset(self) -> None:
        super().reset()
        self._outbox.clear()
        self._arrived.clear()

    def close(self) -> None:
        super().close()
        self._payload_sends.close()
        self._payload_recvs.close()


def _wire_key(msg: Message) -> tuple[int, int, int]:
    """The transport's ``(kind, stage, micro-batch)`` key of a plan's message (see :mod:`fastpipe.distributed.wire`)."""
    kind = {"F": ACT, "B": GRAD}.get(msg.kind)
    if kind is None:
        kind = skip_kind(msg.peer) if msg.kind == "S" else skip_grad_kind(msg.peer)
    return kind, msg.stage, msg.microbatch


class _AllOf:
    """Several works waited as one (gloo returns one per send of a batch)."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self, timeout: Any = None) -> bool:
        for w in self.works:
            w.wait(timeout) if timeout is not None else w.wait()
        return True
