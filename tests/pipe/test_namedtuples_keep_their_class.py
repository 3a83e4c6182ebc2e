"""A namedtuple input, target or stage output stays a namedtuple of its class wherever the pipeline
splits, moves, hands on or sends it, so layers and losses read its fields by name, as they do in the
plain model. Plain tuples stay plain tuples."""

from __future__ import annotations

import collections
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from _dist_utils import check_ok, run_ranks
from fp_tolerance import assert_close_reordered
from torch import Tensor, nn

import fastpipe
from fastpipe.distributed.wire import assemble, pack, unpack, value_kind
from fastpipe.step.microbatch import gather, replace_tensors, scatter, to_device

Masked = collections.namedtuple("Masked", "value mask")


class Pair(NamedTuple):
    hidden: Tensor
    scale: Tensor
    tag: str


class Encode(nn.Module):
    """Returns a :class:`Pair`; given one, reads its fields (a plain tuple has none)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: Tensor | Pair) -> Pair:
        if isinstance(x, Tensor):
            return Pair(torch.tanh(self.linear(x)), torch.ones(x.size(0), 1), "first")
        return Pair(torch.tanh(self.linear(x.hidden)) * x.scale, x.scale, x.tag)


class Decode(nn.Module):
    def forward(self, p: Pair) -> Tensor:
        return p.hidden * p.scale


def test_split_moved_and_joined_namedtuples_keep_their_class() -> None:
    value = Masked(torch.randn(6, 3), torch.ones(6, 3))
    pair = Pair(torch.randn(6, 2), torch.randn(6, 1), "kept")
    for v in (value, pair):
        parts = scatter(v, 3)
        assert [type(p) for p in parts] == [type(v)] * 3
        assert type(to_device(parts[0], torch.device("cpu"))) is type(v)
        assert type(replace_tensors(v, [t * 2 for t in v if isinstance(t, Tensor)])) is type(v)
        joined = gather(parts)
        assert type(joined) is type(v) and all(torch.equal(a, b) for a, b in zip(joined[:2], v[:2]))
    assert pair.tag == scatter(pair, 2)[1].tag
    plain = (torch.randn(4, 2), 7)
    assert [type(p) for p in scatter(plain, 2)] == [tuple, tuple]
    assert type(to_device(plain, torch.device("cpu"))) is tuple


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_token_loss_reads_a_namedtuple_targets_fields(schedule: str) -> None:
    loss_fn = fastpipe.token_loss(
        lambda out, y: (F.mse_loss(out, y.value, reduction="none") * y.mask).sum(),
        lambda y: y.mask.sum(),
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
    x = torch.randn(12, 8)
    y = Masked(torch.randn(12, 8), (torch.rand(12, 8) < 0.5).float())
    expected = loss_fn(model(x), y)
    expected.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    pipe = fastpipe.Pipe(model, balance=[2, 1], chunks=3, schedule=schedule)
    loss = pipe.train_step(x, y, loss_fn)
    assert_close_reordered(loss, expected.detach(), k=16 + 8 + 12 * 8)
    for p, g in zip(pipe.parameters(), grads):
        assert_close_reordered(p.grad, g, k=16 + 8 + 12 * 8)


def test_a_namedtuple_passed_between_stages_keeps_its_fields() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(Encode(), Encode(), Decode())
    x, y = torch.randn(6, 4), torch.randn(6, 4)
    pipe = fastpipe.Pipe(model, balance=[1, 1, 1], chunks=3)
    assert_close_reordered(pipe(x), model(x), k=8)
    pipe.train_step(x, y, nn.MSELoss())
    out = fastpipe.Pipe(nn.Sequential(Encode(), Encode()), balance=[1, 1], chunks=2)(x)
    assert type(out) is Pair and out.tag == "first"


def test_a_namedtuple_header_names_its_class() -> None:
    value = Pair(torch.randn(2, 3), torch.randn(2, 1), "tag")
    meta = unpack(pack([value_kind(value), False]))
    assert meta[0] is Pair
    rebuilt = assemble(meta[0], list(value))
    assert type(rebuilt) is Pair and rebuilt.tag == "tag"
    assert assemble(unpack(pack([value_kind((1, value.hidden)), False]))[0], [1, value.hidden]) == (1, value.hidden)
    Local = collections.namedtuple("Local", "a b")
    with pytest.raises(TypeError, match=r"class 'Local'.*cannot find.*define the class at module level"):
        value_kind(Local(value.hidden, 1))


def _model_and_batch() -> tuple[nn.Sequential, Tensor, Tensor]:
    torch.manual_seed(1)
    model = nn.Sequential(Encode(), Encode(), Decode())
    return model, torch.randn(4, 4), torch.randn(4, 4)


def _two_ranks(rank: int, world: int) -> float | None:
    from fastpipe.distributed_pipe import DistributedPipe

    model, x, y = _model_and_batch()
    pipe = DistributedPipe(model, [2, 1], chunks=2, timeout=20)  # a Pair goes from rank 0 to rank 1
    loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, nn.MSELoss())
    pipe.close()
    return float(loss) if pipe.is_last else None


def test_a_namedtuple_crosses_ranks_as_its_class() -> None:
    losses = check_ok(run_ranks(_two_ranks, 2))
    model, x, y = _model_and_batch()
    expected = nn.MSELoss()(model(x), y).detach()
    assert_close_reordered(torch.tensor(losses[1]), expected, k=16)
