"""A U-Net over three pipeline stages, its encoder features skipping straight to the decoder.

After ``pip install .``, from the clone's root (from anywhere else, give the script's path)::

    python examples/unet_skips.py

A U-Net's decoder joins each upsampled map with the encoder's map of the same size. As an
``nn.Sequential`` those maps would have to ride along through every layer in between. Instead
the encoder stashes them (``fastpipe.stash("e1")``) and the decoder blocks that need them say so
(``fastpipe_pops = ("e1",)``, or ``fastpipe.pops(layer, "e1")``). Cut into stages, each stashed map
goes straight from the stage that made it to the stage that reads it, and its gradient comes
straight back. The script trains the pipe and a copy of the plain model (``fastpipe.Sequential``
runs the same layers in one piece) side by side on a toy segmentation task, and checks that both
give the same losses and the same predictions.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

import fastpipe


def convs(cin: int, cout: int) -> nn.Sequential:
    """Two 3x3 convolutions, each followed by a GELU."""
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GELU(), nn.Conv2d(cout, cout, 3, padding=1), nn.GELU())


class Down(nn.Sequential):
    """Halve the map, then convolve: one encoder level."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__(nn.MaxPool2d(2), convs(cin, cout))


class Up(nn.Module):
    """Double the map, join it with the encoder's map of that size (popped), then convolve."""

    def __init__(self, cin: int, cout: int, skip: str) -> None:
        super().__init__()
        self.skip = skip
        self.fastpipe_pops = (skip,)  # receives that stashed map as a keyword argument
        self.up = nn.ConvTranspose2d(cin, cout, 2, stride=2)
        self.convs = convs(2 * cout, cout)

    def forward(self, x: Tensor, **skips: Tensor) -> Tensor:
        return self.convs(torch.cat([self.up(x), skips[self.skip]], dim=1))


def unet() -> fastpipe.Sequential:
    return fastpipe.Sequential(
        convs(1, 8),  # 16x16
        fastpipe.stash("e1"),
        Down(8, 16),  # 8x8
        fastpipe.stash("e2"),
        Down(16, 32),  # 4x4, the bottleneck
        Up(32, 16, "e2"),  # 8x8
        Up(16, 8, "e1"),  # 16x16
        nn.Conv2d(8, 1, 1),  # one logit per pixel
    )


def batch(generator: torch.Generator, size: int = 16) -> tuple[Tensor, Tensor]:
    """Noisy images with a bright square somewhere; the target is the square's mask."""
    masks = torch.zeros(size, 1, 16, 16)
    for i, (r, c) in enumerate(torch.randint(0, 10, (size, 2), generator=generator).tolist()):
        masks[i, :, r : r + 6, c : c + 6] = 1.0
    return masks + 0.5 * torch.randn(masks.shape, generator=generator), masks


def main(steps: int = 5) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)  # one core per stage
    model = unet()
    plain = copy.deepcopy(model)

    # Stage 0: the first level and its stash; stage 1: two levels down; stage 2: the decoder.
    pipe = fastpipe.Pipe(model, balance=[2, 3, 3], devices=["cpu"] * 3, chunks=4, schedule="1f1b")
    for s, stage in enumerate(pipe.runtime.stages):
        for consumer, names in stage.skips.sends:
            print(f"skips {', '.join(names)}: stage {s} -> stage {consumer}")
    opt = torch.optim.Adam(pipe.parameters(), lr=3e-3)
    plain_opt = torch.optim.Adam(plain.parameters(), lr=3e-3)
    loss_fn = nn.BCEWithLogitsLoss()

    data = torch.Generator().manual_seed(1)
    for step in range(steps):
        x, y = batch(data)
        opt.zero_grad()
        loss = pipe.train_step(x, y, loss_fn)
        opt.step()
        plain_opt.zero_grad()
        plain_loss = loss_fn(plain(x), y)
        plain_loss.backward()
        plain_opt.step()
        print(f"step {step}: pipe loss {loss.item():.6f}, plain loss {plain_loss.item():.6f}")

    x, _ = batch(data)
    with torch.no_grad():  # micro-batches round differently from one batch: a float tolerance
        torch.testing.assert_close(pipe(x), plain(x), rtol=1e-4, atol=1e-5)
    print("the pipeline and the plain model predict the same masks")


if __name__ == "__main__":
    main()
