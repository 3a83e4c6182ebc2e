"""Train an ``nn.Sequential`` through a two-stage ``fastpipe.Pipe`` on one host, and check it.

After ``pip install .``, from the clone's root (from anywhere else, give the script's path)::

    python examples/one_host.py

Each stage runs in its own worker thread, here both on the CPU (``devices=["cuda:0", "cuda:1"]``
puts them on two GPUs). The script trains the Pipe and a copy of the plain model on the same batches
and shows that both give the same losses and end with the same weights.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from fastpipe import Pipe


def build_model() -> nn.Sequential:
    """Six layers: an MLP regressor from 32 features to 1."""
    return nn.Sequential(
        nn.Linear(32, 64),
        nn.GELU(),
        nn.Linear(64, 64),
        nn.GELU(),
        nn.Linear(64, 1),
        nn.Flatten(0),
    )


def main(steps: int = 5) -> None:
    torch.manual_seed(0)
    # One core per stage: the two stages then really run side by side.
    torch.set_num_threads(1)
    model = build_model()
    plain = copy.deepcopy(model)  # the reference: the same weights, trained without a pipeline

    # balance: layers per stage (4 + 2 = len(model)); chunks: micro-batches per mini-batch, so
    # stage 0 works on micro-batch 2 while stage 1 is still on micro-batch 1.
    pipe = Pipe(model, balance=[4, 2], devices=["cpu", "cpu"], chunks=4, schedule="1f1b")
    opt = torch.optim.SGD(pipe.parameters(), lr=0.05)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.05)
    loss_fn = nn.MSELoss()

    data = torch.Generator().manual_seed(1)
    for step in range(steps):
        x, y = torch.randn(64, 32, generator=data), torch.randn(64, generator=data)

        opt.zero_grad()
        # Forward and backward of every micro-batch under the 1F1B schedule; the optimizer step stays yours.
        loss = pipe.train_step(x, y, loss_fn)
        opt.step()

        plain_opt.zero_grad()
        plain_loss = loss_fn(plain(x), y)
        plain_loss.backward()
        plain_opt.step()
        print(f"step {step}: pipe loss {loss.item():.6f}, plain loss {plain_loss.item():.6f}")

    # The Pipe's state_dict has the Sequential's own keys, so the two compare key by key. Micro-batches
    # sum their gradients in another order than one big batch, hence a float tolerance, not bit equality.
    for name, value in pipe.state_dict().items():
        torch.testing.assert_close(value, plain.state_dict()[name], rtol=1e-5, atol=1e-6)
    print("the pipeline trained the same weights as the plain model")


if __name__ == "__main__":
    main()
