"""What the action that makes a stage's gradient sums holds beside them, as the step runs it.

A first combined backward ends with the sums, its last gradient in flight and the stage's output,
which the step drops only when the backward returns. A first ``W`` of stacked records runs one
GEMM per Linear: a Linear's stacked copy is freed before the sums of the Linears after it exist.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fastpipe.balance.device_need import compose
from fastpipe.memory.backward_points import stacked_bytes
from fastpipe.memory.model import StageBytes, predict_memory
from fastpipe.memory.stage_bytes import measure_stages
from fastpipe.schedule import build


def _stage(**parts: object) -> StageBytes:
    return StageBytes(**{"parameters": 0, "activation": 0, **parts})  # type: ignore[arg-type]


def test_a_first_backward_ends_holding_its_output_beside_the_sums() -> None:
    # gpipe, two stages, one micro-batch: stage 0's BW makes its sums of 1000 bytes. Its output is
    # stage 1's input (70), held with the gradient in flight (30) until the BW returns.
    first, second = _stage(activation=100, gradients=1000, bw_first=30), _stage(input=70)
    device, _ = predict_memory(build("gpipe", 2, 1), [first, second])
    assert (device.gradients, device.activations) == (1000, 30 + 70)
    # The last stage's output is the loss, which the step keeps apart.
    (alone,) = predict_memory(build("gpipe", 1, 1), [first])
    assert (alone.gradients, alone.activations) == (1000, 30)


def test_a_first_batched_w_frees_each_linears_copy_before_the_next_linears_sums() -> None:
    # zb-h2, one stage: F0 B0 F1 B1 W0 W1; W0 hands its records to W1, which stacks both
    # micro-batches' and makes the sums. Its first Linear's copy (2 x 100) is freed before the
    # second one makes its 300 bytes of sums; the second's copy is 2 x 10.
    stage = _stage(gradients=350, w_records=110, w_stacked=100, w_gemms=((100, 50), (10, 300)))
    (device,) = predict_memory(build("zb-h2", 1, 2), [stage], wgrad_batch=2, input_grad=True)
    assert (device.gradients, device.w_records) == (350, 2 * 110 + 20)


@pytest.mark.parametrize(
    ("microbatches", "makes_sums", "expected"),
    [(1, True, 0), (2, False, 200), (2, True, 20), (4, True, 100), (4, False, 400)],
)
def test_a_ws_stacked_copies_beside_its_sums(microbatches: int, makes_sums: bool, expected: int) -> None:
    gemms = ((100, 50), (10, 300))  # in the order W runs them: (one micro-batch's record, sums made)
    assert stacked_bytes(100, gemms, microbatches, makes_sums) == expected
    assert stacked_bytes(100, (), microbatches, makes_sums) == (0 if microbatches == 1 else 100 * microbatches)


def test_measured_gemms_are_the_linears_in_the_order_w_runs_them_and_compose_per_layer() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 256))
    x = torch.randn(32, 128)
    (stage,) = measure_stages(model, [3], x, transients=False)
    rows = 32 * 4  # bytes of a row's float
    last = (rows * (128 + 256), 4 * (256 * 128 + 256))  # its x and dy; its weight's and bias's sums
    first = (rows * (128 + 128), 4 * (128 * 128 + 128))
    assert stage.w_gemms == (last, first)
    layers = measure_stages(model, [1, 1, 1], x, transients=False)
    assert compose(layers, 0, 3).w_gemms == stage.w_gemms


@pytest.mark.parametrize("gemms", [((1,),), ((1, -2),), [(1, 2)], ((1, 2.0),), 5])
def test_stage_bytes_refuses_gemms_that_are_not_pairs_of_bytes(gemms: object) -> None:
    with pytest.raises(ValueError, match=r"StageBytes.w_gemms must be a tuple of \(record, sums\) pairs"):
        _stage(w_gemms=gemms)
    with pytest.raises(ValueError, match="StageBytes.activation must be a whole number of bytes"):
        _stage(activation=((1, 2),))


def test_a_stage_composed_of_layers_holds_at_most_its_largest_layers_first_backward_tail() -> None:
    # While layer i's first backward runs, the sums of the layers before it are not made yet: the
    # stage is at most layer i's bytes above its own end, never the sum over its layers.
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(6)])
    x = torch.randn(32, 64, requires_grad=True)
    (whole,) = measure_stages(model, [6], x)
    layers = measure_stages(model, [1] * 6, x)
    composed = compose(layers, 0, 6)
    assert composed.bw_first == max(st.bw_first for st in layers) >= whole.bw_first
    assert composed.bw_first < sum(st.bw_first for st in layers)
