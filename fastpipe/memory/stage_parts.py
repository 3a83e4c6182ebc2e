"""What one stage holds for one micro-batch, by part: the input of :mod:`fastpipe.memory.model`.

:func:`fastpipe.memory.stage_bytes.measure_stages` measures it; the model places each part on the
schedule's timeline.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from fastpipe.memory.backward_points import check_stage_bytes

__all__ = ["StageBytes"]


@dataclass(frozen=True)
class StageBytes:
    """What one stage holds, in bytes, for one micro-batch where it says so.

    Attributes:
        parameters: the stage's parameters, each storage once (a tie reader's copy included).
        activation: what a micro-batch holds from its forward to its backward besides its
            input: the tensors saved for backward and the stage's output.
        input: the stage's input of one micro-batch (received, kept by the task until its
            backward, or its ``W`` when split; all that recompute keeps).
        w_records: what ``B`` leaves in deferred Linear records, besides the input: each
            Linear's input and output gradient, kept until the ``W`` that runs them (the last
            of its batch with ``wgrad_batch`` > 1).
        w_kept: what else ``B`` keeps until the micro-batch's own ``W``: the graph where a
            parameter is left for ``W`` (it is then retained whole), the stage outputs,
            gradients ``B`` took early.
        gradients: bytes of the trainable parameters (their gradient sums); None: ``parameters``.
        optimized: bytes of the parameters the optimizer steps (a tie reader's copy is not);
            None: ``gradients``.
        f_transient: the most bytes a micro-batch's forward holds at once above both what it
            starts with and what it leaves (temporaries between layers), while it runs.
        b_transient: the most bytes its ``B`` holds at once above what it starts with (gradients in
            flight between layers, and the input's gradient where it outweighs what ``B`` frees).
        bw_transient: the same for a combined backward (``BW``) into sums that exist.
        w_input: what of ``input`` the deferred Linear records hold (a first Linear's ``x``): with
            ``wgrad_batch`` > 1 it stays until the last ``W`` of the batch, not the micro-batch's own.
        w_stacked: the largest one Linear's record of a micro-batch (its ``x`` and ``dy``): a
            ``W`` that runs several micro-batches' records stacks them, one Linear at a time.
        offloaded: what of ``activation`` a prefetched micro-batch's forward moves to host memory.
        bw_first: what the ``BW`` that makes the sums holds as it ends above what it leaves, its output aside.
        bw_peak: what the ``BW`` that makes the sums holds at its peak above what it starts with,
            the sums it has made by then included (without recompute: a replay adds ``activation``).
        w_gemms: per deferred Linear, in the order ``W`` runs them, ``(record, sums)``: one
            micro-batch's record bytes and the bytes of the sums its GEMM makes; empty: unknown.
        output_stashed: what of the stage's output it also stashes as a skip: under recompute the
            next stage's input on the same device is then that skip, held once.
        skip_grads_shared: what of the gradients a split ``B`` gives the skips the stage pops is
            the storage of its input's gradient (an add hands one tensor to both inputs).
        tie_grads: per tied parameter the stage owns and a later stage reads a copy of,
            ``(reader stage, bytes)``: at the step's end the reader's gradient is added into the
            owner's, through a copy on the owner's device where the reader is on another.
    """

    parameters: int
    activation: int
    input: int = 0
    w_records: int = 0
    w_kept: int = 0
    gradients: int | None = None
    optimized: int | None = None
    f_transient: int = 0
    b_transient: int = 0
    bw_transient: int = 0
    w_stacked: int = 0
    offloaded: int = 0
    bw_first: int = 0
    w_gemms: tuple[tuple[int, int], ...] = ()
    w_input: int = 0
    bw_peak: int = 0
    output_stashed: int = 0
    skip_grads_shared: int = 0
    tie_grads: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        for f in fields(self):
            check_stage_bytes(f.name, getattr(self, f.name))

    @property
    def trainable(self) -> int:
        """Bytes of the parameters that get gradients."""
        return self.parameters if self.gradients is None else self.gradients

    @property
    def stepped(self) -> int:
        """Bytes of the parameters the optimizer steps."""
        return self.trainable if self.optimized is None else self.optimized
