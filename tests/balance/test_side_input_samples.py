"""The balance tools hand side inputs to the layers that declare them, split to the profiled micro-batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fastpipe
from fastpipe.balance import auto_balance, by_size, by_time, profile_layers
from fastpipe.balance.auto import resolve_balance


class Masked(nn.Module):
    """A block that takes ``attention_mask`` and ``table``, and records the shapes it was given."""

    fastpipe_side_inputs = ("attention_mask", "table")

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.shapes: list[tuple[tuple[int, ...], ...]] = []

    def forward(
        self, x: torch.Tensor, attention_mask: torch.Tensor | None = None, table: torch.Tensor | None = None
    ) -> torch.Tensor:
        assert attention_mask is not None and table is not None, "the profiler dropped a side input"
        self.shapes.append((tuple(x.shape), tuple(attention_mask.shape), tuple(table.shape)))
        return self.proj(x) * attention_mask.unsqueeze(-1) + table.sum()


def model() -> nn.Sequential:
    torch.manual_seed(0)
    # A plain layer between: it declares nothing, so it gets nothing.
    return nn.Sequential(Masked(), nn.Linear(4, 4), Masked(), fastpipe.takes(Masked(), "attention_mask"))


def side(batch: int) -> dict[str, object]:
    return {
        "attention_mask": torch.ones(batch, 6),  # dim 0 is the batch: split like the sample
        "table": fastpipe.broadcast(torch.randn(batch, 3)),  # whole, whatever its dim 0
    }


def test_auto_balance_splits_side_inputs_like_the_sample() -> None:
    m = model()
    balance = auto_balance(m, ["cpu"] * 2, torch.randn(10, 6, 4), chunks=4, repeats=1, side_inputs=side(10))
    assert sum(balance) == 4
    for layer in (m[0], m[2], m[3]):
        # ceil(10 / 4) = 3 rows of the sample and of the mask; the broadcast table whole.
        assert layer.shapes and set(layer.shapes) == {((3, 6, 4), (3, 6), (10, 3))}


def test_profile_by_time_and_by_size_take_the_sample_s_side_inputs() -> None:
    m = model()
    x = torch.randn(5, 6, 4)
    profile = profile_layers(m, x, repeats=1, side_inputs=side(5))
    assert len(profile.forward) == 4 and profile.activation_bytes[0] > 0
    assert sum(by_time(m, x, 2, repeats=1, microbatches=2, side_inputs=side(5))) == 4
    assert sum(by_size(m, x, 2, side_inputs=side(5))) == 4
    assert set(m[0].shapes) == {((5, 6, 4), (5, 6), (5, 3))}


def test_a_batch_one_side_input_reaches_every_layer_whole() -> None:
    m = model()
    shared = {"attention_mask": torch.ones(1, 6), "table": torch.randn(1, 3)}
    auto_balance(m, ["cpu"] * 2, torch.randn(8, 6, 4), chunks=2, repeats=1, side_inputs=shared)
    assert set(m[0].shapes) == {((4, 6, 4), (1, 6), (1, 3))}


def test_resolve_balance_forwards_the_side_inputs() -> None:
    m = model()
    common = {"memory_limit": None, "chunks": 2, "schedule": "1f1b", "virtual_stages": 1}
    balance = resolve_balance(m, "auto", ["cpu"] * 2, sample=torch.randn(8, 6, 4), side_inputs=side(8), **common)
    assert sum(balance) == 4 and set(m[0].shapes) == {((4, 6, 4), (4, 6), (8, 3))}  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="sample_side_inputs only apply to balance='auto'"):
        resolve_balance(m, [2, 2], ["cpu"] * 2, sample=None, side_inputs=side(8), **common)


def test_wrong_side_inputs_get_the_pipe_s_errors() -> None:
    x = torch.randn(8, 6, 4)
    with pytest.raises(TypeError, match=r"no layer of the model takes the side input\(s\) 'mask'.*fastpipe.takes"):
        auto_balance(model(), ["cpu"] * 2, x, chunks=2, side_inputs={"mask": torch.ones(8, 6)})
    with pytest.raises(ValueError, match="'attention_mask' has shape .*neither the batch size"):
        auto_balance(model(), ["cpu"] * 2, x, chunks=2, side_inputs={"attention_mask": torch.ones(3, 6)})
    with pytest.raises(ValueError, match="'table' requires grad, but side inputs carry no gradient"):
        profile_layers(model(), x, side_inputs={"table": torch.ones(8, 3, requires_grad=True)})
