"""The predicted peak bytes of each device over one training step, as a sum of named parts.

The inputs are per-stage bytes of one micro-batch (:class:`StageBytes`; measured by
:func:`fastpipe.memory.stage_bytes.measure_stages`), a schedule and its timing. Each
``(stage, micro-batch)`` holds, on its stage's device::

    F start ─────────────── B end ─────────── W end (own) ──── W end (last of its batch)
    input ════════════════════════════════════════╡            (the task keeps it until W)
    activation ═══════════════╡                                 (saved tensors, stage output)
                              w_kept ═════════════╡             (retained graph, outputs)
                              w_records ══════════════════════╡ (deferred Linears' x and dy)

The input of a stage whose stage before runs on the same device is there from the end of that
stage's ``F``. A combined backward (``BW``) frees all of it at its end. While an action runs it also holds
its transient bytes (temporaries, gradients in flight). With recompute (``checkpoint``) a micro-batch
keeps only its input until its backward, which holds the activation again while it runs.
Around that timeline:

===============  ==============================================================================
part             when it is alive
===============  ==============================================================================
parameters       always; a weight tied across stages is held by its owner and, as a copy, by each
                 reader stage (:mod:`fastpipe.model.ties`); a tensor two layers of one stage share
                 counts once
gradients        each stage's running sums, to the end of the step, from the end of its first
                 ``BW`` (which makes its last layers' sums first, while the saved tensors of the
                 layers before are alive: while it runs it holds its measured peak, ``bw_peak``,
                 sums made so far included) or from the start of its first ``W``
                 that runs deferred GEMMs (which frees the records it reads only when done); in a
                 stream of mini-batches, one sum per mini-batch, to the end of its update ``U``;
                 at the step's end, a tied parameter's gradient copied from another device
                 (``tie_grads``) while it is added into the owner's
optimizer        always: the state of the parameters the optimizer steps (tie copies excluded),
                 :func:`optimizer_factor` times their bytes; while a ``U`` runs, also the
                 temporaries of its optimizer step (``update_transient``)
activations      the inputs, activations and recomputed activations above
w_records        ``w_kept`` and ``w_records`` above
skips            a cross-stage skip on its producer until the producer's backward, on its
                 consumer until the consumer's backward (each one's ``W`` when split: ``W`` keeps
                 what ``B`` ran from and on), and its gradient on the producer's device from the
                 consumer's backward to the producer's (in receive buffers on gloo);
                 where both stages share a device, one tensor from the stash until both let go,
                 and its gradient from the consumer's backward to the producer's
input_grads      the gradient of the pipe's input (``input_grad``), kept for the caller from the
                 first stage's backward to the end of the step
weight_versions  asynchronous ``fit``: the most weight copies a policy holds at once
                 (:func:`fastpipe.schedule.multistep.weight_versions`) times the trainable bytes
receive_buffers  bytes a transport keeps between steps, as given
gathered         stages sharded over their replicas (``sharded``): every unit's parameters
                 all-gathered from the step's start to the stage's last ``BW`` or ``W``
reduce_scatter   and then the reduce-scatter's input and output buffers, to the step's end
===============  ==============================================================================

With ``sharded`` (:mod:`fastpipe.memory.sharded`), ``parameters`` and ``optimizer`` count each
rank's shards (1/D, padded); the gradient sums stay full size, as the step keeps them.

Offload (:mod:`fastpipe.runtime.offload`) takes ``offloaded`` bytes of the activation of each
micro-batch that the schedule prefetches (a ``P``) off the device, from the end of its ``F`` to the
start of its ``P``. They are host bytes until the ``P``'s end (:attr:`DeviceMemory.offloaded`, at
their own peak), not part of the device's total. The runtime drops a device copy once its copy out
has landed, checked before each forward of the stage, and a ``P`` waits for that copy before it
allocates: a copy out slower than the forward that follows holds its bytes that much longer, never
twice.

The time-varying parts are summed per worker over the schedule's simulated timing
(:func:`fastpipe.schedule.simulate.sweep_peak`), and a device's activations, W records, skips
and gradients are those alive at its peak. A ``W`` that runs several micro-batches' records
holds their stacked copy while it runs (:func:`~fastpipe.memory.backward_points.stacked_bytes`).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

from fastpipe.memory.backward_points import first_sums, sent_gradient, stacked_bytes
from fastpipe.memory.local_skips import local_skips, sent_skip_grads
from fastpipe.memory.optimizer import OptimizerSpec, optimizer_factor
from fastpipe.memory.sharded import ShardBytes, kept_bytes, shard_points
from fastpipe.memory.sizes import format_bytes
from fastpipe.memory.stage_parts import StageBytes
from fastpipe.schedule.fuse import adjacent_pairs
from fastpipe.schedule.ir import Action, Schedule, ScheduleError
from fastpipe.schedule.multistep import weight_versions
from fastpipe.schedule.simulate import simulate_times, sweep_peak, weight_release

__all__ = ["PARTS", "DeviceMemory", "OptimizerSpec", "StageBytes", "optimizer_factor", "predict_memory", "require_fit"]

_CHECKPOINT = ("always", "except_last", "never")
_POLICIES = ("sync", "stale", "stash", "predict")


@dataclass(frozen=True)
class DeviceMemory:
    """The predicted peak of one device (one worker of the schedule), in bytes, by part.

    ``total`` is the sum of the parts; the time-varying ones (gradients, activations,
    w_records, skips) are those alive at the device's peak. ``offloaded`` is apart: the most host
    bytes its offload holds at once.
    """

    worker: int
    stages: tuple[int, ...]
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    w_records: int
    skips: int
    input_grads: int
    weight_versions: int
    receive_buffers: int
    gathered: int = 0
    reduce_scatter: int = 0
    offloaded: int = 0

    @property
    def parts(self) -> dict[str, int]:
        """Each part's bytes, in the order of :data:`PARTS`."""
        return {name: getattr(self, name) for name in PARTS}

    @property
    def total(self) -> int:
        """The predicted peak: every part together."""
        return sum(self.parts.values())

    def __str__(self) -> str:
        shown = ", ".join(f"{name} {format_bytes(n)}" for name, n in self.parts.items() if n)
        where = ", ".join(str(s) for s in self.stages)
        host = f"; host {format_bytes(self.offloaded)} offloaded" if self.offloaded else ""
        return f"device {self.worker} (stages {where}): {format_bytes(self.total)} ({shown or 'nothing'}){host}"


PARTS: tuple[str, ...] = tuple(f.name for f in fields(DeviceMemory))[2:-1]  # after worker, stages; not host


def _checkpointed(mode: str, per_minibatch: int) -> Sequence[bool] | None:
    if mode not in _CHECKPOINT:
        raise ValueError(f"fastpipe: checkpoint must be one of {_CHECKPOINT}, got {mode!r}")
    return None if mode == "never" else [mode == "always" or (m + 1) % per_minibatch != 0 for m in range(per_minibatch)]


def predict_memory(
    schedule: Schedule,
    stages: Sequence[StageBytes],
    *,
    times: Mapping[Action, tuple[int, float, float]] | None = None,
    checkpoint: str = "never",
    optimizer: OptimizerSpec = None,
    skips: Sequence[tuple[int, int, float]] = (),
    wgrad_batch: int = 1,
    input_grad: bool = False,
    first_input: bool = False,
    weight_policy: str = "sync",
    receive_buffers: int | Sequence[int] = 0,
    update_transient: int | Sequence[int] = 0,
    sharded: Sequence[ShardBytes] | None = None,
    skip_buffers: bool = False,
) -> list[DeviceMemory]:
    """The predicted peak of every device (worker) of ``schedule`` over one step, by part.

    Args:
        schedule: the schedule (one step, or a stream of mini-batches for ``fit``).
        stages: one :class:`StageBytes` per stage of the schedule.
        times: its timing, from :func:`~fastpipe.schedule.simulate.simulate_times` with the
            measured costs; default unit costs.
        checkpoint: ``"always"``, ``"except_last"`` or ``"never"``, as the pipe's.
        optimizer: see :func:`optimizer_factor`.
        skips: the skips that cross stages, ``(producer, consumer, bytes)``
            (:func:`fastpipe.model.skip_memory.stage_skip_edges`).
        wgrad_batch: micro-batches whose deferred Linear work one ``W`` runs, the runtime's.
        input_grad: whether the first stage's input needs a gradient: its gradient is then
            kept for the caller from the backward to the end of the step; where it is not needed,
            the runtime runs that stage's ``B`` directly followed by its ``W`` as one backward.
        first_input: whether the first stage's input micro-batches are copies made on the
            device (True) or views of the caller's batch, which is there already (False).
        weight_policy: the consistency policy of an asynchronous ``fit``
            (``"sync"``, ``"stale"``, ``"stash"``, ``"predict"``); only a stream of mini-batches holds copies.
        receive_buffers: bytes a transport keeps between steps, per stage (or one for every stage).
        update_transient: bytes a stage's update ``U`` holds while it runs above what it starts and
            ends with (the optimizer step's temporaries,
            :func:`fastpipe.asynchronous.update_temporaries`), per stage (or one for every stage);
            seen only where a ``U`` takes time in ``times``.
        sharded: per stage, its :class:`~fastpipe.memory.sharded.ShardBytes` where the stages are
            sharded over their replicas (``dp_shard="fsdp"``); ``stages`` are then measured whole.
        skip_buffers: whether a skip from another device, and its gradient, arrive in receive
            buffers the transport keeps (gloo's, counted in ``receive_buffers`` by
            :func:`~fastpipe.memory.receive_buffers.receive_buffer_bytes`), not per action.

    Raises:
        ValueError: a list of the wrong length or a value out of range, named.
        ScheduleError: ``times`` lacks an action of the schedule.
    """
    n = schedule.num_stages
    if len(stages) != n:
        raise ValueError(f"fastpipe: {len(stages)} StageBytes for a schedule of {n} stages; give one per stage")
    if weight_policy not in _POLICIES:
        raise ValueError(f"fastpipe: weight_policy must be one of {_POLICIES}, got {weight_policy!r}")
    buffers = _per_stage(receive_buffers, n, "receive_buffers")
    updates = _per_stage(update_transient, n, "update_transient")
    factor = optimizer_factor(optimizer)
    per_minibatch = schedule.minibatch_size or schedule.num_microbatches
    recompute = _checkpointed(checkpoint, per_minibatch)
    # Unit costs, and a U that takes time: what it holds while it runs must be seen before it frees it.
    timed = simulate_times(schedule, update=1.0) if times is None else times
    unsplit = frozenset() if input_grad else frozenset(p for p in adjacent_pairs(schedule) if p[0] == 0)
    release = weight_release(schedule, wgrad_batch, unsplit)
    inputs = [st.input for st in stages]
    if not first_input:
        inputs[0] = 0
    produced = {s: 0 for s in range(n)}
    consumed = {s: 0 for s in range(n)}
    local: list[tuple[int, int, int]] = []
    crossing: list[tuple[int, int, int]] = []  # their gradients wait on the producer's device, unless buffered
    for producer, consumer, nbytes in skips:
        if not (0 <= producer < consumer < n) or nbytes < 0:
            raise ValueError(
                f"fastpipe: skip {(producer, consumer, nbytes)} is not (producer < consumer < {n}, bytes >= 0)"
            )
        if schedule.worker_of(producer) == schedule.worker_of(consumer):
            local.append((producer, consumer, int(nbytes)))  # one tensor on their one device
            continue
        produced[producer] += int(nbytes)
        consumed[consumer] += 0 if skip_buffers else int(nbytes)  # else a view of its receive buffer
        if not skip_buffers:
            crossing.append((producer, consumer, int(nbytes)))

    def when(action: Action) -> tuple[int, float, float]:
        try:
            return timed[action]
        except KeyError:
            raise ScheduleError(f"times has no entry for {action}; simulate the schedule it came with") from None

    points: list[list[tuple[float, float, str]]] = [[] for _ in range(schedule.num_workers)]
    host: list[list[tuple[float, float, str]]] = [[] for _ in range(schedule.num_workers)]
    first_grad: dict[tuple[int, int], float] = {}  # per (stage, mini-batch): when its sums appear
    updated: dict[tuple[int, int], float] = {}  # and when its U ends, which frees them
    writes = collections.Counter(release.values())  # the Ws that run deferred GEMMs, and for how many
    makes_sums = first_sums(timed, unsplit, writes, per_minibatch)
    redone = [recompute is not None and recompute[m % per_minibatch] for m in range(schedule.num_microbatches)]
    try:
        stashed_in, skip_points = local_skips(schedule, timed, stages, local, release, redone)
        skip_points += sent_skip_grads(schedule, timed, crossing)
    except KeyError as e:
        raise ScheduleError(f"times has no entry for {e}; simulate the schedule it came with") from None
    for action, (w, start, end) in timed.items():
        s, m = action.stage, action.microbatch
        st, add = stages[s], points[w].append
        redo = redone[m]
        shared = s > 0 and not redo and schedule.worker_of(s - 1) == w  # its input: the output the stage before keeps
        held_in = 0 if shared else max(0, inputs[s] - stashed_in[s])  # a skip may hold it (local_skips)
        kept = 0 if redo else st.activation
        off = min(st.offloaded, kept) if (s, m) in schedule.prefetched else 0
        if action.kind == "F":
            # On the device of the stage before, a recomputed stage's input is there from the end
            # of that stage's forward, however long this forward waits behind other actions.
            arrives = when(Action("F", s - 1, m))[2] if held_in and s > 0 and schedule.worker_of(s - 1) == w else start
            add((min(arrives, start), held_in, "activations"))
            add((start, kept + st.f_transient, "activations"))
            add((end, -st.f_transient - off, "activations"))
            add((start, produced[s] + consumed[s], "skips"))
            add((end, -produced[s] if redo else 0, "skips"))  # recomputed, the producer sends its stash and keeps none
            host[w].append((end, off, "offloaded"))
        elif action.kind == "P":
            add((start, off, "activations"))
            host[w].append((end, -off, "offloaded"))
        elif action.kind == "U":
            add((start, updates[s], "optimizer"))
            add((end, -updates[s], "optimizer"))
            updated[(s, m)] = end
        elif action.kind in ("B", "BW"):
            split = (s, m) in release
            if action in makes_sums:  # as it ends: the sums, its last gradient in flight, its output (held till return)
                # Measured whole (bw_peak), its peak needs no estimate from its end.
                tail = 0 if st.bw_peak else st.bw_first + (stages[s + 1].input if s + 1 < n else 0)
                end, tail_end = math.nextafter(end, -math.inf), end
                points[w].extend([(end, tail, "activations"), (tail_end, -tail, "activations")])
            in_flight = st.b_transient if split else st.bw_transient
            if action in makes_sums and not split:  # it makes the last layers' sums while the rest is alive
                in_flight = max(in_flight, st.bw_peak)
            during = max(in_flight, st.f_transient) + st.activation if redo else in_flight  # replay, then backward
            add((start, produced[s] if redo else 0, "skips"))  # the replay stashes again
            add((start, during, "activations"))
            add((end, -during, "activations"))
            add((end, -kept - (0 if split else held_in), "activations"))
            if s == 0 and input_grad:
                add((end, st.input, "input_grads"))
            add((end, 0 if split else -produced[s] - consumed[s], "skips"))
            if s > 0 and schedule.worker_of(s - 1) == w:  # across devices, the receive buffer holds it
                upstream, upstream_end = sent_gradient(timed, s, m)
                points[upstream].extend([(end, st.input, "activations"), (upstream_end, -st.input, "activations")])
                if shared and split:  # a later W keeps it: the task until its own, records until their batch's
                    recorded = min(st.w_input, st.input)
                    own, batch = when(Action("W", s, m))[2], when(release[(s, m)])[2]
                    for nbytes, freed in ((st.input - recorded, own), (recorded, batch)):
                        if nbytes and freed > upstream_end:
                            points[w].extend([(upstream_end, nbytes, "activations"), (freed, -nbytes, "activations")])
            if split:
                _, _, w_end = when(Action("W", s, m))
                _, _, batch_end = when(release[(s, m)])
                add((end, st.w_kept + st.w_records, "w_records"))
                add((w_end, -st.w_kept, "w_records"))
                add((batch_end, -st.w_records, "w_records"))
                recorded = min(st.w_input, held_in)  # the input a deferred Linear's record holds
                add((w_end, recorded - held_in, "activations"))
                add((batch_end, -recorded, "activations"))
                add((w_end, -produced[s] - consumed[s], "skips"))  # W keeps B's outputs, stashed ones too
        # A first backward's sums count from its end (while it runs, bw_peak holds those made so
        # far); a W frees its records only when done, so its sums add to them from its start.
        sums = (s, m // per_minibatch)
        if action.kind == "BW" or (action.kind == "B" and (s, m) in unsplit):
            first_grad[sums] = min(first_grad.get(sums, end), end)
        elif action in writes:
            first_grad[sums] = min(first_grad.get(sums, start), start)
            stacked = stacked_bytes(st.w_stacked, st.w_gemms, writes[action], action in makes_sums)
            add((start, stacked, "w_records"))
            add((end, -stacked, "w_records"))
    for w, at, nbytes in skip_points:
        points[w].append((at, nbytes, "skips"))
    for (stage, minibatch), at in first_grad.items():
        trainable, add = float(stages[stage].trainable), points[schedule.worker_of(stage)].append
        add((at, trainable, "gradients"))
        if (stage, minibatch) in updated:
            add((updated[(stage, minibatch)], -trainable, "gradients"))
    finish = max((end for _, _, end in timed.values()), default=0.0)
    for s, st in enumerate(stages):  # ties are folded one at a time, each through a copy from another device
        w = schedule.worker_of(s)
        moved = max((b for r, b in st.tie_grads if schedule.worker_of(r) != w), default=0)
        if moved:
            points[w].extend([(finish, moved, "gradients"), (math.nextafter(finish, math.inf), -moved, "gradients")])

    if sharded is not None:
        points = [p + q for p, q in zip(points, shard_points(schedule, timed, sharded))]
    held_bytes, stepped = kept_bytes(stages, sharded)
    copies = weight_versions(schedule)[weight_policy] if schedule.minibatch_size else [0] * n
    devices = []
    for w in range(schedule.num_workers):
        held = schedule.stages_of(w)
        _, at_peak = sweep_peak(points[w])
        devices.append(
            DeviceMemory(
                worker=w,
                stages=held,
                parameters=sum(held_bytes[s] for s in held),
                gradients=round(at_peak.get("gradients", 0.0)),
                optimizer=round(factor * sum(stepped[s] for s in held) + at_peak.get("optimizer", 0.0)),
                activations=round(at_peak.get("activations", 0.0)),
                w_records=round(at_peak.get("w_records", 0.0)),
                skips=round(at_peak.get("skips", 0.0)),
                input_grads=round(at_peak.get("input_grads", 0.0)),
                weight_versions=sum(copies[s] * stages[s].trainable for s in held),
                receive_buffers=sum(buffers[s] for s in held),
                gathered=round(at_peak.get("gathered", 0.0)),
                reduce_scatter=round(at_peak.get("reduce_scatter", 0.0)),
                offloaded=round(sweep_peak(host[w])[0]),
            )
        )
    return devices


def _per_stage(value: int | Sequence[int], n: int, name: str) -> list[int]:
    values = [value] * n if isinstance(value, int) else list(value)
    if len(values) != n or any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in values):
        raise ValueError(f"fastpipe: {name} must be bytes >= 0, one int or {n} of them; got {value!r}")
    return values


def require_fit(devices: Sequence[DeviceMemory], memory_limit: int) -> None:
    """Raise unless every device's predicted peak is within ``memory_limit`` bytes.

    Raises:
        ValueError: naming the first device over the limit, the least it needs and its parts,
            e.g. ``device 2 (stages 2) needs at least 3.10 GiB, over memory_limit=3.00 GiB:
            parameters 1.20 GiB, optimizer 1.50 GiB, ...``.
    """
    over = [d for d in devices if d.total > memory_limit]
    if over:
        d = max(over, key=lambda d: d.total)
        parts = ", ".join(f"{name} {format_bytes(n)}" for name, n in d.parts.items() if n)
        where = ", ".join(str(s) for s in d.stages)
        raise ValueError(
            f"fastpipe: device {d.worker} (stages {where}) needs at least {format_bytes(d.total)}, over "
            f"memory_limit={format_bytes(memory_limit)}: {parts}. Raise the limit, recompute "
            "(checkpoint='always'), use fewer or smaller micro-batches, or spread the model over more devices"
        )
