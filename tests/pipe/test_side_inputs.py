"""Side inputs given once to the call reach the layers that declare them, split like the batch or whole.

The property is the plain model's result: ``Pipe(seq)(x, mask=m)`` equals
``fastpipe.Sequential(...)(x, mask=m)``, in every checkpoint mode and schedule, and each
micro-batch's layers see exactly its rows of a batch-shaped side input.
"""

import copy

import pytest
import torch
from fp_tolerance import assert_close_reordered
from torch import nn

import fastpipe
from fastpipe import Pipe


class Masked(nn.Module):
    """A layer that takes a per-sample mask and a table shared by every sample."""

    fastpipe_side_inputs = ("mask", "table")

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(5, 5)

    def forward(self, x, mask=None, table=None):
        out = torch.tanh(self.linear(x))
        if mask is not None:
            out = out * mask
        if table is not None:
            out = out + table
        return out


class Rotated(nn.Module):
    """Takes a (cos, sin) pair, as HF decoder blocks take their position embeddings."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(5, 5)

    def forward(self, x, rope=None):
        if rope is None:
            return self.linear(x)
        cos, sin = rope
        return self.linear(x) * cos + sin


def model() -> fastpipe.Sequential:
    return fastpipe.Sequential(
        Masked(), nn.Linear(5, 5), fastpipe.takes(Rotated(), "rope"), Masked(), nn.Tanh(), Masked()
    )


def side(batch: int = 8) -> dict:
    return {
        "mask": (torch.rand(batch, 5) > 0.3).float(),  # split with the batch
        "table": torch.randn(1, 5),  # dim 0 of 1: whole to every micro-batch
        "rope": (torch.randn(batch, 5), fastpipe.broadcast(torch.randn(5))),  # a pair: cos split, sin whole
    }


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_forward_and_backward_equal_the_plain_model(checkpoint):
    torch.manual_seed(0)
    seq = model()
    ref = copy.deepcopy(seq)
    pipe = Pipe(seq, balance=[2, 2, 2], chunks=4, checkpoint=checkpoint)
    x = torch.randn(8, 5)
    kw = side()
    out = pipe(x, **kw)
    out_ref = ref(x, **kw)
    assert_close_reordered(out, out_ref, k=16)
    out.square().sum().backward()
    out_ref.square().sum().backward()
    for (name, p), (_, q) in zip(pipe.named_parameters(), ref.named_parameters(), strict=True):
        assert_close_reordered(p.grad, q.grad, k=32, msg=name)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb-h1"])
def test_train_step_equals_the_plain_model(schedule):
    torch.manual_seed(1)
    seq = model()
    ref = copy.deepcopy(seq)
    vs = 2 if schedule == "interleaved" else 1
    balance = [2, 1, 2, 1] if vs == 2 else [2, 2, 2]
    pipe = Pipe(seq, balance=balance, chunks=4, schedule=schedule, virtual_stages=vs)
    x, y = torch.randn(8, 5), torch.randn(8, 5)
    kw = side()
    loss = pipe.train_step(x, y, nn.MSELoss(), **kw)
    loss_ref = nn.MSELoss()(ref(x, **kw), y)
    loss_ref.backward()
    assert_close_reordered(loss, loss_ref.detach(), k=32)
    for (name, p), (_, q) in zip(pipe.named_parameters(), ref.named_parameters(), strict=True):
        assert_close_reordered(p.grad, q.grad, k=32, msg=name)


class Spy(nn.Module):
    fastpipe_side_inputs = ("mask",)

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.Tensor] = []

    def forward(self, x, mask=None):
        self.seen.append(mask)
        return x


def test_each_micro_batch_sees_its_rows_and_a_broadcast_value_whole():
    spy = Spy()
    pipe = Pipe(nn.Sequential(nn.Identity(), spy), balance=[1, 1], chunks=3)
    mask = torch.arange(6.0).unsqueeze(1)
    pipe(torch.zeros(6, 2), mask=mask)
    assert [m.flatten().tolist() for m in spy.seen] == [[0, 1], [2, 3], [4, 5]]
    spy.seen.clear()
    pipe(torch.zeros(6, 2), mask=fastpipe.broadcast(mask))
    assert all(torch.equal(m, mask) for m in spy.seen) and len(spy.seen) == 3


def test_a_layer_without_the_declaration_gets_none():
    plain = nn.Linear(5, 5)  # called as plain(x), never with keywords
    seq = fastpipe.Sequential(Masked(), plain)
    pipe = Pipe(seq, balance=[1, 1], chunks=2)
    x, mask = torch.randn(4, 5), torch.ones(4, 5)
    assert_close_reordered(pipe(x, mask=mask), seq(x, mask=mask), k=16)


def test_an_unknown_name_is_refused_with_the_names_the_layers_take():
    pipe = Pipe(model(), balance=[3, 3], chunks=2)
    with pytest.raises(TypeError, match=r"side input\(s\) 'masks'.*take: 'mask', 'table', 'rope'.*fastpipe.takes"):
        pipe(torch.randn(4, 5), masks=torch.ones(4, 5))


def test_a_shape_that_is_neither_the_batch_nor_one_is_refused():
    pipe = Pipe(model(), balance=[3, 3], chunks=2)
    with pytest.raises(ValueError, match=r"'mask' has shape \(3, 5\).*neither the batch size \(4.*fastpipe.broadcast"):
        pipe(torch.randn(4, 5), mask=torch.ones(3, 5))


def test_a_side_input_that_needs_a_gradient_is_refused():
    pipe = Pipe(model(), balance=[3, 3], chunks=2)
    with pytest.raises(ValueError, match="'mask' requires grad.*carry no gradient"):
        pipe(torch.randn(4, 5), mask=torch.ones(4, 5, requires_grad=True))
    with torch.no_grad():
        pipe(torch.randn(4, 5), mask=torch.ones(4, 5, requires_grad=True))  # no graph: nothing to carry


def test_declaring_on_an_instance_adds_to_the_class_declaration():
    layer = fastpipe.takes(Masked(), "extra", "mask")
    assert layer.fastpipe_side_inputs == ("mask", "table", "extra")
    assert Masked.fastpipe_side_inputs == ("mask", "table")
    with pytest.raises(TypeError, match="keyword names"):
        fastpipe.takes(Masked(), "not a name")
