"""Property: any weights tied across any stages give the plain model's loss, gradients and updates.

hypothesis draws a chain of Linear layers, which of them share a weight (a whole module used
again, or one parameter of another layer), the balance, the chunks, the schedule and the
checkpoint mode. In float64, rounding sits near 1e-15 while the bound is about 1e-11; a lost
use (a gradient not folded back) or a stale copy is off by the size of the values.
"""

from __future__ import annotations

import copy

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from fastpipe import Pipe

DTYPE = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-10}
WIDTH = 4


@st.composite
def tied_models(draw: st.DrawFn) -> tuple[nn.Sequential, list[int]]:
    depth = draw(st.integers(3, 7))
    layers: list[nn.Module] = []
    for i in range(depth):
        choice = draw(st.sampled_from(["new", "reuse", "share weight"])) if i else "new"
        if choice == "reuse":
            layers.append(layers[draw(st.integers(0, i - 1))])  # the same module again
        elif choice == "share weight":
            layer = nn.Linear(WIDTH, WIDTH, dtype=DTYPE)
            layer.weight = layers[draw(st.integers(0, i - 1))].weight
            layers.append(layer)
        else:
            layers.append(nn.Linear(WIDTH, WIDTH, dtype=DTYPE))
    body: list[nn.Module] = []
    for layer in layers:
        body += [layer, nn.Tanh()]
    stages = draw(st.integers(2, min(4, len(body))))
    cuts = sorted(draw(st.lists(st.integers(1, len(body) - 1), min_size=stages - 1, max_size=stages - 1, unique=True)))
    balance = [b - a for a, b in zip([0, *cuts], [*cuts, len(body)])]
    return nn.Sequential(*body), balance


@settings(max_examples=25, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(
    tied_models(),
    st.integers(1, 4),
    st.sampled_from(["gpipe", "1f1b", "zb-h1"]),
    st.sampled_from(["always", "except_last", "never"]),
)
def test_ties_equal_the_plain_model_over_optimizer_steps(model_and_balance, chunks, schedule, checkpoint):
    model, balance = model_and_balance
    ref = copy.deepcopy(model)
    pipe = Pipe(model, balance=balance, chunks=chunks, schedule=schedule, checkpoint=checkpoint)
    assert len(list(pipe.parameters())) == len(list(ref.parameters()))
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(4, WIDTH, dtype=DTYPE, generator=g)
        y = torch.randn(4, WIDTH, dtype=DTYPE, generator=g)
        opt.zero_grad()
        opt_ref.zero_grad()
        loss = pipe.train_step(x, y, nn.MSELoss())
        loss_ref = nn.MSELoss()(ref(x), y)
        loss_ref.backward()
        torch.testing.assert_close(loss, loss_ref.detach(), **TOL)
        for (name, p), (_, q) in zip(pipe.named_parameters(), ref.named_parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, **TOL, msg=name)
        opt.step()
        opt_ref.step()
    out = pipe(x)  # a forward after the updates reads refreshed copies
    torch.testing.assert_close(out, ref(x), **TOL)
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[key], value, **TOL, msg=key)
