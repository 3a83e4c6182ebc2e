"""A tied parameter's gradient, added into its owner's at the step's end, on the timeline of the memory model.

On one device the reader's gradient is added into the owner's sum in place, so the step's end holds
no third copy of the tensor (it did: counted 1.20x the prediction on zb-v); from another device the
copy waits on the owner's while it is added (``StageBytes.tie_grads``).
"""

from __future__ import annotations

import pytest
import torch
from _memory_utils import ProductLoss, install_counter_or_skip, metered_after_a_first_step
from torch import nn

import fastpipe
from fastpipe.memory.model import StageBytes, predict_memory
from fastpipe.memory.stage_bytes import measure_stages
from fastpipe.schedule import build

WIDTH, ROWS = 256, 64
STATES = 3 * torch.get_rng_state().numel()  # the generator states a CPU forward may hold (see test_model_property)


def _tied() -> nn.Sequential:
    torch.manual_seed(0)
    first, last = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
    last.weight = first.weight
    return nn.Sequential(first, nn.Tanh(), last)


@pytest.mark.parametrize("schedule", ["zb-v", "interleaved"])
def test_a_tie_on_one_device_folds_in_place(schedule: str) -> None:
    install_counter_or_skip()
    model = _tied()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(ROWS, WIDTH, generator=g), torch.randn(ROWS, WIDTH, generator=g)
    pipe = fastpipe.Pipe(
        model, [1, 2], devices=["cpu"], virtual_stages=2, chunks=1, schedule=schedule, memory_limit="1TiB"
    )
    try:
        counted = metered_after_a_first_step(pipe, None, x, y).peak
        assert pipe.memory_guard is not None
        (device,) = pipe.memory_guard.last
        grad = model[0].weight.grad
    finally:
        pipe.close()
    predicted = device.total - device.parameters - device.optimizer
    ratio = counted / predicted
    print(f"{schedule}: counted / predicted {ratio:.3f}")
    assert 0.95 * predicted <= counted <= 1.05 * predicted + STATES, (ratio, str(device))
    reference = _tied()
    ProductLoss()(reference(x), y).backward()
    torch.testing.assert_close(grad, reference[0].weight.grad)


def test_measure_names_each_tie_its_owner_folds() -> None:
    stages = measure_stages(_tied(), [1, 1, 1], torch.randn(4, WIDTH), transients=False)
    assert [st.tie_grads for st in stages] == [((2, WIDTH * WIDTH * 4),), (), ()]


def test_a_tie_from_another_device_is_copied_to_the_owners_at_the_end() -> None:
    owner = StageBytes(parameters=1000, activation=0, tie_grads=((1, 400),))
    apart = predict_memory(build("gpipe", 2, 1), [owner, StageBytes(parameters=400, activation=0)])
    assert [d.gradients for d in apart] == [1400, 400]  # the owner's sum and the copy, at the step's end
    together = predict_memory(build("zb-v", 1, 1), [owner, StageBytes(parameters=400, activation=0)])
    assert together[0].gradients == 1400  # both sums: added in place


@pytest.mark.parametrize("bad", [((1,),), ((1, -4),), ((1, True),), [(1, 4)]])
def test_tie_grads_must_be_reader_and_bytes_pairs(bad: object) -> None:
    with pytest.raises(ValueError, match=r"tie_grads must be a tuple of \(reader stage, bytes\) pairs"):
        StageBytes(parameters=0, activation=0, tie_grads=bad)  # type: ignore[arg-type]
