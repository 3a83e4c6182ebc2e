"""Over random models and schedules, a device's predicted peak is within 5% of its counted peak.

A case is a random ``nn.Sequential`` (a Linear, then 1 to 5 of Linear, GELU, ReLU, Tanh,
LayerNorm and Dropout, which save different tensors: inputs, outputs, masks, statistics), a
random schedule, micro-batch count, recompute mode, W batching where the schedule has W, and
whether the input needs a gradient. It trains one step in a :class:`fastpipe.Pipe` on the CPU,
counted by the exact byte counter (:mod:`fastpipe.memory._cpu_counter`), against the prediction of
the pipe's own ``memory_limit`` guard (:class:`fastpipe.memory.limit.MemoryGuard`).

The counter is process-wide, so the pipe has one device: ``zb-v`` and ``interleaved`` place two
stages on it at a random cut; ``gpipe``, ``1f1b``, ``zb-h1`` and ``zb-h2`` run the model as one
stage.
Two-stage schedules on a device each are counted per rank in tests/memory/test_model_ranks.py
(a spawn of two ranks takes about 15 s, too long for a property's examples).

On a CPU, a forward that draws random numbers (Dropout) holds up to three generator states
(5056 bytes each: the caller's parked, its task's, a copy; :mod:`fastpipe.rng.streams`), which the
model leaves out: a GPU keeps them in host memory. The comparison allows for them.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch
from _memory_utils import ProductLoss, install_counter_or_skip
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn

from fastpipe import Pipe
from fastpipe.memory.limit import MARGIN

WIDTHS = (128, 256)
ACTIVATIONS = ("gelu", "relu", "tanh", "norm", "dropout")
ONE_STAGE = ("gpipe", "1f1b", "zb-h1", "zb-h2")
TWO_STAGES = ("zb-v", "interleaved")  # two stages on the one device
TOLERANCE = 0.05
STREAM_STATES = 3 * torch.get_rng_state().numel()  # bytes a drawing forward's generator states hold on a CPU


@dataclass(frozen=True)
class Case:
    """One model, schedule and step setting."""

    layers: tuple[tuple[str, int], ...]  # (kind, output width); width 0 for a layer that keeps its input's
    width: int
    rows: int
    chunks: int
    schedule: str
    cut: int  # layers of the first stage, where there are two
    checkpoint: str
    wgrad_batch: int
    input_grad: bool


@st.composite
def cases(draw: st.DrawFn) -> Case:
    depth = draw(st.integers(2, 6))
    layers = [("linear", draw(st.sampled_from(WIDTHS)))]
    for _ in range(depth - 1):
        kind = draw(st.sampled_from(("linear", *ACTIVATIONS)))
        layers.append((kind, draw(st.sampled_from(WIDTHS)) if kind == "linear" else 0))
    schedule = draw(st.sampled_from(ONE_STAGE + TWO_STAGES))
    return Case(
        layers=tuple(layers),
        width=draw(st.sampled_from(WIDTHS)),
        rows=draw(st.sampled_from((64, 128))),
        chunks=draw(st.integers(1, 6)),
        schedule=schedule,
        cut=draw(st.integers(1, depth - 1)),
        checkpoint=draw(st.sampled_from(("never", "always", "except_last"))),
        wgrad_batch=draw(st.integers(1, 2)) if schedule.startswith("zb") else 1,
        input_grad=draw(st.booleans()),
    )


def _model(case: Case) -> tuple[nn.Sequential, int]:
    """The case's model (seeded) and its output width."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    width = case.width
    for kind, out in case.layers:
        if kind == "linear":
            layers.append(nn.Linear(width, out))
            width = out
        elif kind == "norm":
            layers.append(nn.LayerNorm(width))
        elif kind == "dropout":
            layers.append(nn.Dropout(0.25))
        else:
            layers.append({"gelu": nn.GELU, "relu": nn.ReLU, "tanh": nn.Tanh}[kind]())
    return nn.Sequential(*layers), width


def counted_and_predicted(case: Case) -> tuple[int, int, int]:
    """The step's counted peak and the guard's predicted one, both above the parameters; and the parameters.

    The first step makes what later steps reuse; the second one, with the gradients set to None,
    is counted from its start, when only the parameters and those reused buffers are alive.
    """
    from fastpipe.memory.accounting import PeakMeter

    model, out = _model(case)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(case.chunks * case.rows, case.width, generator=g).requires_grad_(case.input_grad)
    y = torch.randn(case.chunks * case.rows, out, generator=g)
    two = case.schedule in TWO_STAGES
    pipe = Pipe(
        model,
        [case.cut, len(model) - case.cut] if two else [len(model)],
        devices=["cpu"],
        virtual_stages=2 if two else 1,
        chunks=case.chunks,
        schedule=case.schedule,
        checkpoint=case.checkpoint,  # type: ignore[arg-type]
        wgrad_batch=case.wgrad_batch,
        memory_limit="1TiB",
    )
    try:
        pipe.train_step(x, y, ProductLoss())
        pipe.zero_grad(set_to_none=True)
        x.grad = None
        gc.collect()
        with PeakMeter("cpu") as meter:
            pipe.train_step(x, y, ProductLoss())
        assert pipe.memory_guard is not None
        (device,) = pipe.memory_guard.last
    finally:
        pipe.close()
    # The step allocates no optimizer state; the guard counts Adam's.
    return meter.result.peak, device.total - device.parameters - device.optimizer, device.parameters


def _check(case: Case) -> float:
    install_counter_or_skip()  # before the tensors it counts exist
    counted, predicted, parameters = counted_and_predicted(case)
    states = STREAM_STATES if any(kind == "dropout" for kind, _ in case.layers) else 0
    ratio = counted / predicted
    print(f"counted/predicted {ratio:.4f} ({(counted - states) / predicted:.4f} without stream states): {case}")
    assert (1 - TOLERANCE) * predicted <= counted <= (1 + TOLERANCE) * predicted + states, (ratio, case)
    # What Pipe(memory_limit=) promises: the device's bytes stay within the prediction and its margin.
    assert parameters + counted - states <= (parameters + predicted) * (1 + MARGIN), (ratio, case)
    return ratio


# Cases the property found, each the model error it showed, kept as examples.
# A recompute replays the forward: its temporaries (GELU's, LayerNorm's) were left out (1.29).
REPLAY = Case((("linear", 128), ("relu", 0), ("gelu", 0), ("norm", 0)), 128, 128, 1, "zb-v", 1, "always", 1, False)
# The gradient a stage sends back waits on the stage before it until that stage's backward (1.08).
SENT_GRADIENT = Case(
    (("linear", 256), ("linear", 128), ("gelu", 0), ("norm", 0)), 256, 128, 3, "interleaved", 3, "always", 1, True
)
# On one device, the second stage's input is the output the first stage keeps: counted twice (0.91).
SHARED_INPUT = Case(
    (("linear", 128), ("gelu", 0), ("norm", 0), ("gelu", 0), ("linear", 128)),
    256,
    128,
    3,
    "interleaved",
    2,
    "except_last",
    1,
    False,
)

# After a split B, the first stage's saved tensors (GELU's input) counted as kept until W: the
# measurement's holders outlived autograd's hold on them (0.80).
SPLIT_FIRST_STAGE = Case((("linear", 128), ("gelu", 0)), 128, 64, 1, "zb-h1", 1, "never", 1, True)
# A first combined backward makes the sums while the gradient into its first layer is in flight (1.25).
FIRST_SUMS = Case((("linear", 128), ("linear", 128)), 128, 64, 1, "gpipe", 1, "never", 1, False)
# The step holds a stage's output until its backward returns: with the first sums and the
# gradient in flight, one activation more than the first backward's tail counted (1.17).
OUTPUT_AT_FIRST_SUMS = Case(
    (("linear", 256), ("tanh", 0), ("norm", 0)), 256, 64, 1, "interleaved", 2, "always", 1, False
)
# A first W of two micro-batches' records counted the largest Linear's stacked copy beside every
# sum; it runs the Linears one at a time, and frees that copy before the next Linear's sums exist (0.92).
FIRST_STACKED_W = Case((("linear", 128), ("linear", 256)), 128, 32, 2, "zb-h2", 1, "never", 2, False)
# A backward ends holding its input's gradient, more bytes than the saved tensors it frees; its
# transient was measured above that end, so the model lost the difference (1.12).
INPUT_GRAD_END = Case((("linear", 128), ("gelu", 0)), 256, 64, 2, "gpipe", 1, "never", 1, True)
# Under recompute, the second stage's input (the first stage's output) counted from the second
# stage's forward; on their one device it is there from the first stage's, across a backward (1.08).
WAITING_INPUT = Case((("linear", 256), ("linear", 128)), 128, 64, 2, "interleaved", 1, "always", 1, False)
# With W batching, a second stage's first Linear records its input, the first stage's output on
# their one device: it stays until the batch's last W, after the first stage's backward (1.08).
RECORDED_INPUT = Case((("linear", 128), ("linear", 128)), 128, 64, 2, "zb-v", 1, "never", 2, False)
# A split B's measure made the gradient it starts from inside its meter; the step receives it
# before, counted on the stage after until this B ends, so a transient above B's start counted it
# twice (0.88).
RECEIVED_GRADIENT = Case((("linear", 128), ("gelu", 0)), 128, 64, 2, "zb-v", 1, "never", 1, True)
# A first backward makes its last Linear's sums first, while the replayed activations of the
# layers before are alive; the model had the sums appear at its end (1.16).
FIRST_BACKWARD_PEAK = Case(
    (("linear", 128), ("gelu", 0), ("gelu", 0), ("linear", 128)), 128, 64, 1, "interleaved", 1, "always", 1, False
)


@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(cases())
@example(REPLAY)
@example(SENT_GRADIENT)
@example(SHARED_INPUT)
@example(FIRST_SUMS)
@example(SPLIT_FIRST_STAGE)
@example(OUTPUT_AT_FIRST_SUMS)
@example(FIRST_STACKED_W)
@example(INPUT_GRAD_END)
@example(WAITING_INPUT)
@example(RECORDED_INPUT)
@example(RECEIVED_GRADIENT)
@example(FIRST_BACKWARD_PEAK)
def test_the_predicted_peak_is_within_5_percent_of_the_counted_one(case: Case) -> None:
    _check(case)
