"""Host time that the task RNG adds to a step of a model with many tiny layers.

A ``TorchFunctionMode`` intercepts every op of its thread, so routing random ops through
one costs host time on every op: +38% on a 150-layer model when every stage had it. fastpipe
installs it only on stages that could draw (fastpipe.rng.streams.may_draw). This script times,
in one run and interleaved round-robin, one ``Pipe.forward`` + ``backward`` step of
75 × (Linear(16, 16), ReLU) on 2 CPU stages with chunks=4:

* ``scoped``: the shipped behaviour (these stages cannot draw: no mode);
* ``mode``: the mode forced onto every stage (what every stage would pay without the scoping);
* ``dropout``: the same model with one ``nn.Dropout`` per stage, i.e. the cost a stage with
  random layers pays (the mode, and a locked swap per draw);
* ``plain``: the plain Sequential over the same 4 micro-batches, one after another.

Usage::

    OMP_NUM_THREADS=1 python bench/rng_overhead.py --rounds 15
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Callable
from unittest import mock

import torch
from torch import nn

import fastpipe.runtime.step as step_core
from fastpipe import Pipe

LAYERS, WIDTH, BATCH, CHUNKS = 150, 16, 32, 4


def build(dropout: bool) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(LAYERS // 2):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
        if dropout and i in (LAYERS // 4 - 1, LAYERS // 2 - 1):  # one per stage, replacing a ReLU
            layers[-1] = nn.Dropout(0.1)
    return nn.Sequential(*layers)


def pipe_step(pipe: Pipe, x: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        pipe(x).sum().backward()

    return step


def plain_step(model: nn.Sequential, x: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        for mb in x.chunk(CHUNKS):
            model(mb).sum().backward()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=10, help="steps per timing")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(BATCH, WIDTH)
    half = LAYERS // 2

    def always() -> contextlib.AbstractContextManager[object]:
        return mock.patch.object(step_core, "may_draw", lambda *a, **k: True)

    def pipe(dropout: bool) -> Pipe:  # the recompute these figures were first taken under
        return Pipe(build(dropout), balance=[half, half], chunks=CHUNKS, checkpoint="except_last")

    shipped = contextlib.nullcontext
    variants: dict[str, tuple[Callable[[], None], Callable[[], contextlib.AbstractContextManager[object]]]] = {
        "scoped": (pipe_step(pipe(False), x), shipped),
        "mode": (pipe_step(pipe(False), x), always),
        "dropout": (pipe_step(pipe(True), x), shipped),
        "plain": (plain_step(build(False), x), shipped),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(args.rounds + 1):
        for name, (step, context) in variants.items():
            with context():
                start = time.perf_counter()
                for _ in range(args.steps):
                    step()
                elapsed = (time.perf_counter() - start) / args.steps
            if r > 0:  # round 0 warms up
                times[name].append(elapsed)
    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    print(
        f"{LAYERS} layers of Linear({WIDTH},{WIDTH})/ReLU, batch {BATCH}, chunks {CHUNKS}, 2 CPU stages; "
        f"median ms per forward+backward step over {args.rounds} rounds"
    )
    for name, ms in med.items():
        print(f"  {name:8s} {ms:8.2f} ms   {ms / med['scoped']:.2f}x scoped")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ms": med, "rounds": args.rounds, "steps": args.steps}, f, indent=1)


if __name__ == "__main__":
    main()
