"""Pipe gives the plain Sequential's outputs and gradients (fp32, within float tolerance)."""

import copy

import pytest
import torch
from fp_tolerance import assert_close_reordered
from torch import nn

from fastpipe import Pipe


class Residual(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


def mlp():
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 8)), (12,)


def residual():
    return nn.Sequential(*[Residual(16) for _ in range(4)]), (16,)


def convnet():
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1),
        nn.GELU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(16, 5),
    ), (3, 6, 6)


def embedding():
    return nn.Sequential(nn.Embedding(50, 16), Residual(16), nn.LayerNorm(16), nn.Linear(16, 50)), None


MODELS = {"mlp": mlp, "residual": residual, "conv": convnet, "embedding": embedding}
# Reductions from input to output (in_features, LayerNorm width, conv taps), for the tolerance
# between a micro-batched and a full-batch run (other GEMM shapes, so other rounding); weight
# gradients also sum over the batch rows times the positions per row.
REDUCTION = {mlp: 12 + 16 + 16, residual: 4 * (16 + 16 + 32), convnet: 27 + 36 + 9 + 16, embedding: 64 + 16 + 16}
POSITIONS = {convnet: 36, embedding: 5}


def balance_for(n, stages):
    base, extra = divmod(n, stages)
    return [base + (1 if i < extra else 0) for i in range(stages)]


def make_input(shape, batch):
    if shape is None:
        return torch.randint(0, 50, (batch, 5))
    return torch.randn(batch, *shape)


def check(model_fn, stages, chunks, checkpoint, batch):
    model, shape = model_fn()
    if stages > len(model):
        pytest.skip("more stages than layers")
    ref = copy.deepcopy(model)
    pipe = Pipe(
        model, balance=balance_for(len(model), stages), devices=["cpu"] * stages, chunks=chunks, checkpoint=checkpoint
    )
    x = make_input(shape, batch)
    xr, xp = x.clone(), x.clone()
    if x.is_floating_point():
        xr.requires_grad_()
        xp.requires_grad_()
    out_ref, out = ref(xr), pipe(xp)
    k = REDUCTION[model_fn]
    assert_close_reordered(out, out_ref, k=k)
    weight = torch.randn_like(out_ref)
    (out_ref * weight).sum().backward()
    (out * weight).sum().backward()
    k_weights = k + batch * POSITIONS.get(model_fn, 1)
    for (name, p), (_, q) in zip(pipe.named_parameters(), ref.named_parameters()):
        assert_close_reordered(p.grad, q.grad, k=k_weights, msg=f"grad of {name}")
    if x.is_floating_point():
        assert_close_reordered(xp.grad, xr.grad, k=k)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("chunks", [1, 3, 8])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("model", list(MODELS))
def test_outputs_and_grads_match(model, stages, chunks, checkpoint):
    check(MODELS[model], stages, chunks, checkpoint, batch=16)


@pytest.mark.filterwarnings("ignore:fastpipe. a batch of")
@pytest.mark.parametrize("batch", [10, 17, 9, 5])
@pytest.mark.parametrize("model", ["mlp", "conv", "embedding"])
def test_uneven_batches(model, batch):
    # 10 and 17 in 8 chunks leave a smaller last micro-batch; 5 < 8 runs with 5 micro-batches.
    check(MODELS[model], 2, 8, "except_last", batch=batch)


def test_bit_identical_with_one_chunk():
    # One micro-batch: the same ops on the same data, so the same bits.
    model, _ = residual()
    ref = copy.deepcopy(model)
    pipe = Pipe(model, balance=[2, 2], chunks=1, checkpoint="never")
    x = torch.randn(8, 16)
    assert torch.equal(pipe(x), ref(x))


def test_tuple_input_with_passthrough_values():
    class Head(nn.Module):
        def forward(self, inp):
            x, mask, scale = inp
            return (x * mask, scale)

    class Tail(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, inp):
            x, scale = inp
            return self.fc(x) * scale

    model = nn.Sequential(Head(), Tail())
    ref = copy.deepcopy(model)
    pipe = Pipe(model, balance=[1, 1], chunks=3)
    x, mask = torch.randn(7, 4, requires_grad=True), (torch.rand(7, 4) > 0.5).float()
    out = pipe((x, mask, 2.0))
    torch.testing.assert_close(out, ref((x, mask, 2.0)))
    out.sum().backward()
    g = x.grad.clone()
    x.grad = None
    ref((x, mask, 2.0)).sum().backward()
    torch.testing.assert_close(g, x.grad)


def test_tuple_output():
    class Split(nn.Module):
        def forward(self, x):
            return x[:, :2], x[:, 2:]

    model = nn.Sequential(nn.Linear(4, 4), Split())
    ref = copy.deepcopy(model)
    pipe = Pipe(model, balance=[1, 1], chunks=2)
    x = torch.randn(6, 4)
    a, b = pipe(x)
    ra, rb = ref(x)
    torch.testing.assert_close(a, ra)
    torch.testing.assert_close(b, rb)
    (a.sum() + 2 * b.sum()).backward()
    (ra.sum() + 2 * rb.sum()).backward()
    for p, q in zip(pipe.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_unused_output_gets_no_grad():
    class Split(nn.Module):
        def forward(self, x):
            return x[:, :2], x[:, 2:]

    pipe = Pipe(nn.Sequential(nn.Linear(4, 4), Split()), balance=[1, 1], chunks=2)
    a, _ = pipe(torch.randn(6, 4))
    a.sum().backward()
    w = pipe[0].weight.grad
    assert w is not None and torch.count_nonzero(w[2:]) == 0


def test_state_dict_keys_match_and_load():
    model, _ = residual()
    keys = list(model.state_dict().keys())
    pipe = Pipe(copy.deepcopy(model), balance=[1, 3], chunks=2)
    assert list(pipe.state_dict().keys()) == keys
    pipe.load_state_dict(model.state_dict())
    model.load_state_dict(pipe.state_dict())


def test_no_grad_and_eval_run_without_graph():
    model, _ = mlp()
    pipe = Pipe(model, balance=[2, 3], chunks=4)
    with torch.no_grad():
        out = pipe(torch.randn(8, 12))
    assert not out.requires_grad
    pipe.eval()
    out = pipe(torch.randn(8, 12))
    assert out.requires_grad  # eval() still builds the graph when grad is enabled, like nn.Module


def test_frozen_parameters_get_no_grad():
    model, _ = mlp()
    for p in model[0].parameters():
        p.requires_grad_(False)
    ref = copy.deepcopy(model)
    pipe = Pipe(model, balance=[2, 3], chunks=4)
    x = torch.randn(8, 12)
    pipe(x).sum().backward()
    ref(x).sum().backward()
    assert pipe[0].weight.grad is None
    torch.testing.assert_close(pipe[4].weight.grad, ref[4].weight.grad)


def test_dtype_conversion_allowed():
    model, _ = mlp()
    ref = copy.deepcopy(model).double()
    pipe = Pipe(model, balance=[2, 3], chunks=2).to(torch.float64)
    x = torch.randn(4, 12, dtype=torch.float64)
    torch.testing.assert_close(pipe(x), ref(x))
