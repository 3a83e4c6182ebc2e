"""A first run: train a small residual MLP with ``Pipe`` and check it against the plain model.

Run it with ``python -m fastpipe.demo`` (``--help`` for options). It trains the same
model twice from the same initial weights, once as a plain ``nn.Sequential`` and once as
a 2-stage ``Pipe``, prints both loss curves' largest gap, the step times, and writes a
Chrome trace (and a Gantt PNG when matplotlib is installed) of one pipelined step.
"""

from __future__ import annotations

import argparse
import copy
import os
import time

import torch
from torch import Tensor, nn

from fastpipe.pipe import Pipe

__all__ = ["main"]


class _Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.act = nn.GELU()
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(self.drop(self.act(self.fc1(self.norm(x)))))


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m fastpipe.demo``."""
    parser = argparse.ArgumentParser(prog="python -m fastpipe.demo", description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--out", default="fastpipe-demo", help="folder for the trace files")
    args = parser.parse_args(argv)

    from tqdm import tqdm

    torch.set_num_threads(1)  # one core per stage worker
    torch.manual_seed(0)
    model = nn.Sequential(*[_Block(args.hidden) for _ in range(args.blocks)])
    plain = copy.deepcopy(model)
    base, extra = divmod(args.blocks, args.stages)
    balance = [base + (1 if i < extra else 0) for i in range(args.stages)]
    pipe = Pipe(model, balance=balance, chunks=args.chunks, checkpoint="except_last")
    opt_pipe = torch.optim.SGD(pipe.parameters(), lr=0.05)
    opt_plain = torch.optim.SGD(plain.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(1)
    loss_fn = nn.MSELoss()
    gap, t_pipe, t_plain = 0.0, 0.0, 0.0
    bar = tqdm(range(args.steps + 1), desc="training", unit="step")
    for step in bar:
        x = torch.randn(args.batch, args.hidden, generator=data)
        y = torch.randn(args.batch, args.hidden, generator=data)
        for net, opt in ((pipe, opt_pipe), (plain, opt_plain)):
            net.eval()  # dropout off, so both runs see the same function
            start = time.perf_counter()
            opt.zero_grad()
            loss = loss_fn(net(x), y)
            loss.backward()
            opt.step()
            elapsed = (time.perf_counter() - start) if step > 0 else 0.0  # step 0 warms up
            if net is pipe:
                t_pipe += elapsed
                pipe_loss = loss.item()
            else:
                t_plain += elapsed
                gap = max(gap, abs(pipe_loss - loss.item()))
        bar.set_postfix(loss=f"{pipe_loss:.4f}")
    print(f"Pipe(balance={balance}, chunks={args.chunks}) vs plain nn.Sequential over {args.steps} steps:")
    print(f"  largest loss gap: {gap:.2e} (float rounding only)")
    print(f"  mean step: pipe {t_pipe / args.steps * 1e3:.1f} ms on {args.stages} threads, plain "
          f"{t_plain / args.steps * 1e3:.1f} ms on 1 thread (full batch; bench/e2e.py compares fairly, "
          "against the same micro-batches)")

    os.makedirs(args.out, exist_ok=True)
    pipe.train()
    pipe.trace = True
    loss_fn(pipe(x), y).backward()
    timeline = pipe.last_timeline
    assert timeline is not None
    trace_path = os.path.join(args.out, "trace.json")
    timeline.to_chrome_trace(trace_path)
    print(f"  trace of one step: {trace_path} (open in https://ui.perfetto.dev)")
    try:
        png = os.path.join(args.out, "timeline.png")
        timeline.plot(png, title=f"fastpipe: {args.stages} CPU stages, {args.chunks} micro-batches")
        print(f"  Gantt chart: {png}")
    except ImportError:
        print("  (pip install matplotlib for a Gantt chart)")
    return 0 if gap < 1e-3 else 1


if __name__ == "__main__":
    raise SystemExit(main())
