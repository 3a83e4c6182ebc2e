"""``schedule="auto"`` measures the stages before the first step; the measurement must not look like
a write into a buffer shared across stages, nor move a BatchNorm's statistics: the step then trains
as under a named schedule."""

from __future__ import annotations

import copy

import pytest
import torch
from fp_tolerance import assert_close_reordered
from torch import nn

import fastpipe
from fastpipe import Pipe


class Rotary(nn.Module):
    """A constant table, one module used by every block, as a rotary embedding is."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.linspace(0.5, 1.5, 5), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.table


class Block(nn.Module):
    def __init__(self, rot: Rotary) -> None:
        super().__init__()
        self.rot = rot
        self.linear = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(self.rot(x)))


class Join(nn.Module):
    def forward(self, x: torch.Tensor, **skips: torch.Tensor) -> torch.Tensor:
        return x + skips["early"]


def test_auto_trains_a_buffer_shared_across_stages_like_the_plain_model() -> None:
    torch.manual_seed(0)
    rot = Rotary()
    model = nn.Sequential(*[Block(rot) for _ in range(4)])
    ref = copy.deepcopy(model)
    pipe = Pipe(model, balance=[2, 2], chunks=2, schedule="auto")
    assert [t.name for t in pipe.ties] == ["0.rot.table"]
    x, y = torch.randn(4, 5), torch.randn(4, 5)
    for _ in range(2):  # the second step reuses the measured costs
        for p, q in zip(pipe.parameters(), ref.parameters()):
            p.grad = q.grad = None
        loss = pipe.train_step(x, y, nn.MSELoss())
        expected = nn.MSELoss()(ref(x), y)
        expected.backward()
        assert_close_reordered(loss, expected.detach(), k=4 * 5 + 4)
        for p, q in zip(pipe.parameters(), ref.parameters()):
            assert_close_reordered(p.grad, q.grad, k=4 * 5 + 4)


def test_auto_leaves_batch_norm_statistics_of_a_model_with_skips_as_a_named_schedule() -> None:
    def model() -> fastpipe.Sequential:
        torch.manual_seed(2)
        return fastpipe.Sequential(
            nn.Linear(6, 4), fastpipe.stash("early"), nn.Linear(4, 4), nn.BatchNorm1d(4), fastpipe.pops(Join(), "early")
        )

    x, y = torch.randn(8, 6) * 3 + 1, torch.randn(8, 4)
    states = []
    for schedule in ("1f1b", "auto"):
        m = model()
        Pipe(m, balance=[2, 3], chunks=2, schedule=schedule).train_step(x, y, nn.MSELoss())
        states.append(m.state_dict())
    for key, value in states[0].items():
        assert torch.equal(states[1][key], value), key  # each micro-batch's forward, the same ops


def test_auto_trains_a_hf_llama_like_hf() -> None:
    pytest.importorskip("transformers")
    from _hf_models import batch, grads_by_name, reduction_length, reference_step, tiny

    from fastpipe.hf import causal_lm_loss, to_sequential

    model = tiny("llama", attn="eager", tie=True)
    pipe = Pipe(to_sequential(model), balance=[3, 4], chunks=2, schedule="auto")
    ids, mask, labels = batch()
    ref_loss, ref_grads = reference_step(model, ids, mask, labels)
    loss = pipe.train_step(ids, labels, causal_lm_loss, attention_mask=mask)
    assert pipe.auto_schedule is not None and pipe.auto_schedule.choice is not None
    assert_close_reordered(loss.detach(), ref_loss, k=reduction_length())
    grads = grads_by_name(model)
    assert grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        assert_close_reordered(grads[name], grad, k=reduction_length("grad"), msg=name)
