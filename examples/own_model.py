"""Pipeline your own model: a small GPT written as one module, cut into an ``nn.Sequential``.

After ``pip install .``, from the clone's root (from anywhere else, give the script's path)::

    python examples/own_model.py

``Pipe`` takes an ``nn.Sequential``: a pipeline cuts a model between layers, and a sequence says
where it may cut. A model whose ``forward`` is a chain (embed, blocks, head) becomes one by listing
its parts in order; they stay the same objects, with the same parameters.
"""

from __future__ import annotations

import tempfile

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import fastpipe


class Embed(nn.Embedding):
    """Token embeddings plus learned position embeddings."""

    def __init__(self, vocab: int, dim: int, seq_len: int) -> None:
        super().__init__(vocab, dim)
        self.positions = nn.Parameter(torch.randn(seq_len, dim) * 0.02)

    def forward(self, ids: Tensor) -> Tensor:
        return super().forward(ids) + self.positions[: ids.size(1)]


class Block(nn.TransformerEncoderLayer):
    """A pre-norm transformer block whose self-attention looks only backwards (causal)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__(dim, heads, 4 * dim, dropout=0.1, batch_first=True, norm_first=True)

    def forward(self, h: Tensor) -> Tensor:  # type: ignore[override]  # one input, as a Sequential passes it
        mask = nn.Transformer.generate_square_subsequent_mask(h.size(1), device=h.device)
        return super().forward(h, src_mask=mask, is_causal=True)


class TinyGPT(nn.Module):
    """The model as one would write it: ``forward`` loops over the blocks."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 2, layers: int = 4, seq_len: int = 16) -> None:
        super().__init__()
        self.embed = Embed(vocab, dim, seq_len)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, vocab))

    def forward(self, ids: Tensor) -> Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def as_sequential(self) -> nn.Sequential:
        """The same layers as a chain the pipeline can cut: embed, block 0 .. n-1, head."""
        return nn.Sequential(self.embed, *self.blocks, self.head)


def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
    """Next-token cross-entropy, averaged over every position (so micro-batches weigh by samples)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def main(steps: int = 4) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)  # one core per stage
    model = TinyGPT().as_sequential()
    ids = torch.randint(0, 64, (16, 17))
    x, y = ids[:, :-1], ids[:, 1:]  # learn to predict each next token

    # balance="auto" profiles each layer on one micro-batch of `sample` and picks the split with the least
    # simulated step time (or give a list: balance=[3, 3]). checkpoint="always" keeps only each stage's
    # input per micro-batch and recomputes the rest in backward, replaying the same dropout masks.
    pipe = fastpipe.Pipe(model, balance="auto", devices=["cpu", "cpu"], chunks=4, checkpoint="always", sample=x)
    print(f"balance (layers per stage): {pipe.balance}")
    opt = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    for step in range(steps):
        opt.zero_grad()
        loss = pipe.train_step(x, y, loss_fn)
        opt.step()
        print(f"step {step}: loss {loss.item():.4f}")

    # fastpipe.save writes the Sequential's keys: the file loads into the plain model or any other balance.
    plain = TinyGPT().as_sequential()  # fresh weights, replaced by the checkpoint's
    with tempfile.TemporaryDirectory() as folder:
        fastpipe.save(pipe, f"{folder}/tiny_gpt.pt", optimizer=opt)
        fastpipe.load(f"{folder}/tiny_gpt.pt", plain)
    pipe.eval()  # no dropout: the two must agree
    plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), plain(x))
    print("the saved weights give the plain model the pipeline's outputs")


if __name__ == "__main__":
    main()
